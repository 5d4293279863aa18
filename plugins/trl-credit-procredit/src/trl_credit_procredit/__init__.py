"""ProCredit: progress credit from the task's acceptance checks, rerun after every turn.

Method. The checks that decide an agentic task's success are run on the state after each turn too; the
fraction of them that pass is the task's verified progress, and a turn is rewarded by how much it changed
that fraction. The turn rewards give credit across the attempts at the same task (each turn against the
group's turns, so a group with no success still has a signal and failed attempts differ by how far they
got) and across the turns of a trajectory (each turn's own progress lands on its own tokens), on top of the
run's outcome advantage.

Formula (completion ``i`` of group ``g``, model turns ``k = 0 .. K_i - 1``, ``A_i`` the outcome advantage of
the run's estimator, ``C_i`` the number of checks)::

    c_ik = checks passed after turn k        (turn column; NaN: no check ran, the last fraction carries)
    f_ik = c_ik / C_i,   f_i,-1 = 0          (NaN carried forward: f_ik = f_i,k-1)
    r_ik = f_ik - f_i,k-1                    progress reward of turn k; sum_k r_ik = f_i,K-1
    p_ik = r_ik                              credit: turn   (progress credited to the turn where it occurs)
         = sum_{j >= k} gamma^(j-k) r_ij      credit: return
    z_ik = (p_ik - mu_g) / (sigma_g + 1e-6)   normalise: group, mu_g and sigma_g (population) over the
                                              turns of the group's kept completions (sigma_g < 1e-6: 1)
         = p_ik - mu_g                        normalise: mean          (p_ik: normalise: none)
    A_it = A_i + coef * z_i,k(t) + final_weight * zf_i      on the model's tokens of turn k(t)
           zf_i: f_i,K-1 normalised over the group's kept completions the same way (0 by default)

``C_i``: ``total_checks`` when a number; the per-completion column ``total_column``; else the most checks
passed anywhere in the batch (``total_checks: batch``) or in the group (``group``). With ``values:
distance`` the column is a lower-is-better measurement and ``thresholds`` are the checks: check ``m``
passes after turn ``k`` when the value is ``<= thresholds[m]`` (``C = len(thresholds)``).

Source: the ProCredit abstract ("From Outcome Rewards to Progress Credit in Agentic Reinforcement
Learning", in /work/shared/papers/004), [abstract-inferred]. Established there: the checks are rerun after
each turn, a turn is rewarded by its change in progress, the rewards give credit across attempts and
across turns, and adding the final progress to the trajectory score alone does not help (the gain comes
from crediting progress to its turn). Chosen here: progress = the fraction of checks passed, the group
z-score of the turn rewards as the across-attempts comparison, the sum with the outcome advantage, ``coef
= 1``, and the final-progress term off (``final_weight = 0``, the ablation's variant as an option).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trl_credit import Plugin, carry_forward, discounted_returns, group_normalise, hookimpl

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch

__all__ = ["ProCredit", "progress_rewards"]


def progress_rewards(passed: torch.Tensor, total: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``r_k = f_k - f_{k-1}``, ``f_k = c_k / C`` with ``f_{-1} = 0``: ``passed`` ``(N, K)`` checks (NaN carried
    forward), ``total`` ``(N, 1)``; 0 past a row's turns. Differences of counts, so equal steps are exactly equal."""
    import torch

    c = torch.where(valid, carry_forward(passed, 0.0), 0.0)
    previous = torch.nn.functional.pad(c[:, :-1], (1, 0))
    return torch.where(valid, (c - previous) / total, 0.0)


class ProCredit(Plugin):
    """ProCredit: A_it = A_i + coef * z(r_ik), r_ik = f_ik - f_i,k-1 the change in the fraction of checks passed."""

    name = "procredit"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        column: str = Field("turn_checks", description="per-turn column (`batch.turn_values`): checks passed after "
                            "each model turn (values: checks) or a lower-is-better measurement (values: distance); "
                            "None/NaN where no check ran")
        values: Literal["checks", "distance"] = Field(
            "checks", description="checks: the column counts passed checks; distance: a measurement whose checks "
            "are `thresholds` (check m passes when the value is <= thresholds[m])")
        thresholds: list[float] | None = Field(
            None, description="values: distance: the checks as upper bounds on the measurement (e.g. [0] for the "
            "guess task's one check, the right number); unused otherwise")
        total_checks: int | Literal["batch", "group"] = Field(
            "batch", description="checks per task: a number, or the most checks passed in the batch (batch) or in "
            "the group (group); ignored with total_column or values: distance")
        total_column: str | None = Field(
            None, description="per-completion column (dataset or rollout field) with the task's number of checks; "
            "null: total_checks")
        credit: Literal["turn", "return"] = Field(
            "turn", description="turn: each turn's own progress (the paper's 'credit to the turn where it "
            "occurs'); return: the discounted progress from that turn on")
        gamma: float = Field(1.0, ge=0.0, le=1.0, description="discount of credit: return")
        normalise: Literal["group", "mean", "none"] = Field(
            "group", description="across attempts: z-score the credits over the group's turns (group), subtract "
            "the group's mean turn credit (mean), or use the raw fractions (none)")
        coef: float = Field(1.0, ge=0.0, description="weight of the turn credit added to the outcome advantage "
                            "(not established)")
        final_weight: float = Field(
            0.0, ge=0.0, description="weight of the final progress f_K, normalised over the group like the turn "
            "credit and added to every model token (the abstract's ablation: alone it does not help)")

        @model_validator(mode="after")
        def _consistent(self):
            if self.values == "distance":
                if not self.thresholds:
                    raise ValueError("values: distance needs `thresholds` (the checks, e.g. [0] for the guess task); "
                                     "fix: set thresholds: [...] or values: checks")
                if self.total_column is not None or self.total_checks != "batch":
                    raise ValueError("values: distance counts its checks from `thresholds`; fix: remove total_checks "
                                     "and total_column")
            elif self.thresholds is not None:
                raise ValueError("thresholds is read only with values: distance; fix: remove it or set values: "
                                 "distance")
            if isinstance(self.total_checks, int) and self.total_checks < 1:
                raise ValueError(f"total_checks must be >= 1 (or batch / group), got {self.total_checks}")
            if self.total_column is not None and self.total_checks != "batch":
                raise ValueError("give total_checks or total_column, not both; fix: remove one")
            return self

    def required_turn_values(self) -> list[str]:
        """The per-turn column; the host refuses a run or batch without it (`total_column` is per completion)."""
        return [self.config.column]

    def checks_passed(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(c (N, K), C (N, 1))``: checks passed after each turn (NaN: none ran) and checks per completion."""
        import torch

        cfg = self.config
        raw = batch.turn_values(cfg.column)
        if cfg.values == "distance":
            bounds = torch.tensor(cfg.thresholds, dtype=raw.dtype, device=raw.device)
            passed = (raw.unsqueeze(-1) <= bounds).sum(-1).to(raw.dtype)
            return torch.where(torch.isnan(raw), raw, passed), torch.full((raw.shape[0], 1), float(len(bounds)),
                                                                          device=raw.device)
        if bool((raw < 0).any()):
            raise ValueError(f"column '{cfg.column}' holds a negative number of checks passed; fix: record the "
                             "checks passed after each turn, or set values: distance with thresholds")
        if cfg.total_column is not None:
            total = torch.tensor([float(v) for v in batch.column(cfg.total_column)], device=raw.device).unsqueeze(1)
            if not bool((torch.isfinite(total) & (total > 0)).all()):
                raise ValueError(f"total_column '{cfg.total_column}' must hold a positive number of checks per "
                                 "completion")
        elif isinstance(cfg.total_checks, int):
            total = torch.full((raw.shape[0], 1), float(cfg.total_checks), device=raw.device)
        else:
            seen = raw.nan_to_num(0.0)
            if cfg.total_checks == "group":
                most = batch.grouped(seen).amax(dim=(1, 2)).repeat_interleave(batch.num_generations)
            else:
                most = seen.amax().expand(raw.shape[0]) if seen.numel() else torch.zeros(raw.shape[0])
            total = most.clamp(min=1.0).unsqueeze(1).to(raw.device)
        over = raw.nan_to_num(0.0) > total
        if bool(over.any()):
            row = int(over.any(1).nonzero()[0])
            raise ValueError(f"column '{cfg.column}': row {row} passed more checks than its total "
                             f"({raw[row].tolist()} of {float(total[row])}); fix: total_checks / total_column")
        return raw, total

    @hookimpl
    def transform_advantages(self, batch: RolloutBatch, advantages: torch.Tensor) -> torch.Tensor | None:
        import torch

        cfg = self.config
        turns = batch.turns()
        k = turns.max_turns
        if k == 0:
            return None
        device = advantages.device
        passed, total = (t.to(device) for t in self.checks_passed(batch))
        count = turns.count.to(device)
        valid = torch.arange(k, device=device).unsqueeze(0) < count.unsqueeze(1)
        members = (batch.kept & batch.scorable).to(device)  # kept and scored: the others get 0
        pool = valid & members.unsqueeze(1)
        r = progress_rewards(passed, total, valid)
        p = r if cfg.credit == "turn" else discounted_returns(r, cfg.gamma)
        g = batch.num_generations
        z = group_normalise(p, pool, g, cfg.normalise)
        base = advantages if advantages.dim() == 2 else advantages.unsqueeze(1).expand(-1, batch.width)
        out = base + cfg.coef * turns.broadcast(z).to(device)
        final = r.sum(1)  # telescopes to f_K
        if cfg.final_weight:
            rows = members & (count > 0)
            zf = group_normalise(final, rows, g, cfg.normalise)
            out = out + cfg.final_weight * zf.unsqueeze(1) * turns.model.to(device)
        if bool(pool.any()):
            self.log_metric(batch, "progress_credit", float(r[pool].mean()))
            self.log_metric(batch, "progress_turns", float((r[pool] > 0).float().mean()))
            self.log_metric(batch, "recorded", float((~torch.isnan(passed[pool])).float().mean()))
            self.log_metric(batch, "final_progress", float(final[pool.any(1)].mean()))
            self.log_metric(batch, "credit_abs", float((cfg.coef * z[pool]).abs().mean()))
        return out.float()
