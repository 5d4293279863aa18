"""MiRA: milestone rewards, a bonus for each subgoal reached, credited to the turn that reached it.

Method. A long-horizon task is split into milestones (subgoals; in the paper a planner decomposes each task);
the environment records, after every model turn, which milestones the trajectory has reached. Each milestone
reached for the first time earns a bonus on the turn that reached it, a dense signal added to the sparse
outcome: turns that get the agent closer to its goal get credit even in trajectories that fail.

Formula (completion ``i``, model turns ``k = 0 .. K_i - 1``, ``A_i`` the outcome advantage of the run's
estimator)::

    n_ik = milestones newly reached in turn k:
           values: new       the column itself (a count, or 0/1 per turn; NaN: 0)
           values: total     M_ik - M_i,k-1,  M_ik = max_{j <= k} m_ij   (m: milestones reached so far; a
                             milestone once reached stays reached, NaN carries; M_i,-1 = 0)
           values: distance  M_ik = #{m : min_{j <= k} d_ij <= thresholds[m]}, then as total
                             (d: a lower-is-better measurement; the milestones are bounds on it)
    b_ik = n_ik                               credit: turn   (the bonus on the turn that reached it)
         = sum_{j >= k} gamma^(j-k) n_ij      credit: return (and on the turns that led there)
    A_it = A_i + bonus * N(b)_i,k(t)          on the model's tokens of turn k(t)
           N: as is (normalise: none), minus the group's mean turn value (mean), or the group z-score
              (population sigma + 1e-6, over the turns of the group's kept completions; sigma < 1e-6: 1) (group)

Source: the MiRA abstract ("A Subgoal-driven Framework for Improving Long-Horizon LLM Agents", MiRA =
Milestoning your Reinforcement Learning Enhanced Agent, in /work/shared/papers/004), [abstract-inferred]. The
abstract establishes only "an RL training framework that uses dense, milestone-based reward signals" next to
inference-time subgoal planning; how milestones are detected, the bonus size and how it meets the outcome are
not in it. Chosen here: milestones come from the environment as a per-turn column, each new one earns
``bonus = 0.5`` on its own turn, added raw to the outcome advantage (``normalise: none``); the return, a group
baseline and the z-score are options.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trl_credit import Plugin, discounted_returns, group_normalise, hookimpl

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch

__all__ = ["MiRA", "new_milestones"]


def new_milestones(values: torch.Tensor, valid: torch.Tensor, kind: str,
                   thresholds: list[float] | None = None) -> torch.Tensor:
    """``(N, K)`` milestones newly reached in each turn from the recorded ``values`` (``kind`` as ``values:``)."""
    import torch

    if kind == "new":
        return torch.where(valid, values.nan_to_num(0.0), 0.0)
    if kind == "distance":
        best = torch.where(valid, values.nan_to_num(float("inf")), float("inf")).cummin(dim=1).values
        bounds = torch.tensor(thresholds, dtype=values.dtype, device=values.device)
        reached = (best.unsqueeze(-1) <= bounds).sum(-1).to(values.dtype)
    else:  # total: the best count so far (NaN: nothing new)
        reached = torch.where(valid, values.nan_to_num(0.0), 0.0).cummax(dim=1).values.clamp(min=0.0)
    previous = torch.nn.functional.pad(reached[:, :-1], (1, 0))
    return torch.where(valid, reached - previous, 0.0)


class MiRA(Plugin):
    """MiRA: A_it = A_i + bonus * n_i,k(t), n_ik the milestones first reached in turn k (options: return, baseline)."""

    name = "mira"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        column: str = Field("turn_milestones", description="per-turn column (`batch.turn_values`) recording "
                            "milestones (see values); None/NaN where the turn recorded nothing")
        values: Literal["new", "total", "distance"] = Field(
            "new", description="new: milestones newly reached in the turn (a count or 0/1); total: milestones "
            "reached so far (a drop does not unreach one); distance: a lower-is-better measurement whose "
            "milestones are `thresholds`")
        thresholds: list[float] | None = Field(
            None, description="values: distance: milestone m is reached at the first turn whose value is <= "
            "thresholds[m] (e.g. [3, 1, 0] on the guess task's guess_distance); unused otherwise")
        bonus: float = Field(0.5, ge=0.0, description="advantage added per newly reached milestone (with normalise: "
                             "group, per group standard deviation); not established")
        credit: Literal["turn", "return"] = Field(
            "turn", description="turn: the bonus on the turn that reached the milestone; return: also on the turns "
            "before it (discounted by gamma)")
        gamma: float = Field(1.0, ge=0.0, le=1.0, description="discount of credit: return")
        normalise: Literal["none", "mean", "group"] = Field(
            "none", description="none: the bonus as is; mean: minus the group's mean turn bonus; group: z-scored "
            "over the group's turns")

        @model_validator(mode="after")
        def _consistent(self):
            if self.values == "distance" and not self.thresholds:
                raise ValueError("values: distance needs `thresholds` (the milestones, e.g. [3, 1, 0]); fix: set "
                                 "thresholds or choose values: new / total")
            if self.values != "distance" and self.thresholds is not None:
                raise ValueError("thresholds is read only with values: distance; fix: remove it or set values: "
                                 "distance")
            return self

    def required_turn_values(self) -> list[str]:
        """The per-turn milestone column; the host refuses a run or batch without it."""
        return [self.config.column]

    @hookimpl
    def transform_advantages(self, batch: RolloutBatch, advantages: torch.Tensor) -> torch.Tensor | None:
        import torch

        cfg = self.config
        turns = batch.turns()
        k = turns.max_turns
        if k == 0:
            return None
        device = advantages.device
        raw = batch.turn_values(cfg.column).to(device)
        if cfg.values != "distance" and bool((raw < 0).any()):
            raise ValueError(f"column '{cfg.column}' holds a negative milestone count; fix: record milestones "
                             "reached (values: new / total), or use values: distance with thresholds")
        count = turns.count.to(device)
        valid = torch.arange(k, device=device).unsqueeze(0) < count.unsqueeze(1)
        # a dropped row, or one no reward function scored (GRPO gives it 0), earns no milestone credit and leaves
        # the group's statistics
        scored = batch.kept & batch.scorable
        pool = valid & scored.to(device).unsqueeze(1)
        n = new_milestones(raw, valid, cfg.values, cfg.thresholds)
        b = n if cfg.credit == "turn" else discounted_returns(n, cfg.gamma)
        c = cfg.bonus * group_normalise(b, pool, batch.num_generations, cfg.normalise)
        base = advantages if advantages.dim() == 2 else advantages.unsqueeze(1).expand(-1, batch.width)
        if bool(pool.any()):
            rows = pool.any(1)
            self.log_metric(batch, "milestones", float(n.sum(1)[rows].mean()))
            self.log_metric(batch, "milestone_turns", float((n[pool] > 0).float().mean()))
            self.log_metric(batch, "recorded", float((~torch.isnan(raw[pool])).float().mean()))
            self.log_metric(batch, "credit_abs", float(c[pool].abs().mean()))
        return (base + turns.broadcast(c).to(device)).float()
