"""Stage norm: GRPO normalised per workflow stage, on the turns of multi-turn rollouts.

Method. Lean4AgenticRL trains agents with rewards at several levels (tool call, workflow stage, outcome) and a
"workflow-stage-normalized GRPO". Read here as: each model turn of a trajectory belongs to a stage of the
workflow, and its reward is normalised within the group against the turns *of the same stage* only, rather
than against whole trajectories, so a stage that is hard for every rollout does not drown the others' signal::

    r_ik   = turn_coef * u_ik + outcome_coef * R_i     u: per-turn column (None/NaN: 0; none: 0), R: outcome
    s_ik   = stage of turn k of trajectory i           an integer column, or the turn index k (default)
    S      = { (j, l) : j in the group of i, s_jl = s_ik }        the same-stage turns of the group
    z_ik   = (r_ik - mean_S r) / (std_S r + epsilon)   scale: stage (unbiased std, as TRL's group std)
             (r_ik - mean_S r) / (std_batch r + epsilon)          scale: batch (std of every scored turn's r)
             r_ik - mean_S r                                      scale: none
    A_ik   = z_ik                        credit: turn (default)
             sum_{l >= k} gamma^(l-k) z_il                        credit: return (the sum of later normalised rewards)
    A_it   = A_i,k(t)                    `Turns.broadcast`: every token of turn k; 0 on environment tokens

A stage with one member in a group (or a constant one) has ``r - mean = 0``: its advantage is 0 whatever the
scale, as GRPO's constant groups. Turns without a stage (NaN in the stage column) and the turns of rows whose
outcome is NaN (when ``outcome_coef != 0``) take part in no statistic and get 0.

Source: "Lean4AgenticRL: Advancing Agentic RL with Verifiable Multi-level Process Rewards" (Amazon; abstract
only, in the project's paper list) [abstract-inferred]. The abstract names "multi-level rewards" (tool call,
workflow stage, outcome) and "the workflow-stage-normalized GRPO algorithm" and gives no formula; the grouping
by (prompt group, stage), the reward mix, the scale and the credit are choices, the alternatives options.
Note: with the defaults (stage = turn index, the outcome on every turn) this is the survivor-conditioned
per-turn normalisation, which is biased when the policy decides when to stop (see trl-credit-turn-baseline);
with stages every trajectory passes through (a stage column) the cells no longer shrink with stopping.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trl_credit import Plugin, discounted_returns, hookimpl

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch

__all__ = ["StageNorm", "stage_normalise"]


def stage_normalise(rewards: torch.Tensor, stages: torch.Tensor, valid: torch.Tensor, num_generations: int,
                    scale: str = "stage", epsilon: float = 1e-4) -> tuple[torch.Tensor, torch.Tensor]:
    """``(z (N, K), members (N, K))``: each valid turn's reward centred (and scaled) within its group's turns of
    the same stage, and how many turns share that (group, stage) (0 where not valid)."""
    import torch

    n, k = rewards.shape
    z = torch.zeros_like(rewards)
    members = torch.zeros(n, k, dtype=torch.long, device=rewards.device)
    if not bool(valid.any()):
        return z, members
    group = (torch.arange(n, device=rewards.device) // num_generations).unsqueeze(1).expand(n, k)
    keys = torch.stack([group[valid], stages[valid]], dim=1)
    _, cell = torch.unique(keys, dim=0, return_inverse=True)  # one cell per (group, stage)
    x = rewards[valid]
    cells = int(cell.max()) + 1
    count = torch.zeros(cells, dtype=x.dtype, device=x.device).index_add_(0, cell, torch.ones_like(x))
    mean = torch.zeros_like(count).index_add_(0, cell, x) / count
    centred = x - mean[cell]
    if scale == "stage":
        square = torch.zeros_like(count).index_add_(0, cell, centred**2)
        std = (square / (count - 1).clamp(min=1)).sqrt()  # unbiased; one member: centred is 0 anyway
        centred = centred / (std[cell] + epsilon)
    elif scale == "batch":
        centred = centred / ((x.std() if x.numel() > 1 else x.new_zeros(())) + epsilon)
    elif scale != "none":
        raise ValueError(f"stage_norm: scale must be stage, batch or none, got {scale!r}")
    z[valid] = centred
    members[valid] = count[cell].long()
    return z, members


class StageNorm(Plugin):
    """GRPO advantages normalised within each group among the turns of the same workflow stage.

    The stage is a per-turn column or the turn index. See the module docstring for the formula, source and choices."""

    name = "stage_norm"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        stage: str | None = Field(None, min_length=1, description="per-turn column of integer stages (read with "
                                  "batch.turn_values; None/NaN: no stage, advantage 0); null: the turn index")
        turn_rewards: str | None = Field(None, min_length=1, description="per-turn reward column (batch.turn_values; "
                                         "None/NaN: 0); null: no per-turn reward, the outcome alone")
        turn_coef: float = Field(1.0, description="weight of the per-turn rewards (negative for a cost)")
        outcome_coef: float = Field(1.0, description="weight of the outcome reward added to every turn's reward "
                                    "(0: the per-turn rewards alone)")
        reward: str | None = Field(None, description="outcome reward column; null: the total (weighted) reward")
        scale: Literal["stage", "batch", "none"] = Field("stage", description="divide by the same-stage std of the "
                                                         "group (GRPO's), by the batch std of the turn rewards, or not")
        epsilon: float = Field(1e-4, gt=0.0, description="added to the std (TRL's 1e-4)")
        credit: Literal["turn", "return"] = Field("turn", description="a turn's advantage is its normalised reward, "
                                                  "or the discounted sum of its and the later turns' (return)")
        gamma: float = Field(1.0, ge=0.0, le=1.0, description="discount of credit: return")

        @model_validator(mode="after")
        def _some_reward(self):
            if self.outcome_coef == 0 and (self.turn_rewards is None or self.turn_coef == 0):
                raise ValueError("outcome_coef: 0 with no per-turn reward (turn_rewards null or turn_coef 0) makes "
                                 "every turn's reward 0; set turn_rewards to a per-turn column or outcome_coef != 0")
            return self

    def required_rewards(self):
        return [self.config.reward] if self.config.reward else []

    def required_turn_values(self) -> list[str]:
        """The per-turn stage and reward columns that are set; the host refuses a run or batch without them."""
        return list(dict.fromkeys(name for name in (self.config.stage, self.config.turn_rewards) if name))

    def _stages(self, batch: RolloutBatch, exists: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(stage (N, K) long, staged (N, K) bool)``: the stage column (integers, checked) or the turn index."""
        import torch

        n, k = exists.shape
        if self.config.stage is None:
            return torch.arange(k, device=exists.device).expand(n, k), exists
        values = batch.turn_values(self.config.stage).to(exists.device)
        staged = exists & torch.isfinite(values)
        bad = staged & (values != values.round())
        if bool(bad.any()):
            i, j = (int(x) for x in bad.nonzero()[0])
            raise ValueError(f"stage_norm: stage column {self.config.stage!r} holds {float(values[i, j])} at row {i}, "
                             f"turn {j}; stages must be integers (record an int per turn, or None for no stage)")
        return torch.where(staged, values, 0.0).long(), staged

    @hookimpl
    def compute_advantages(self, batch: RolloutBatch) -> torch.Tensor:
        import torch

        cfg = self.config
        turns = batch.turns()
        n, k = batch.num_completions, turns.max_turns
        device = turns.index.device
        exists = torch.arange(k, device=device).unsqueeze(0) < turns.count.unsqueeze(1)
        outcome = (batch.reward(cfg.reward) if cfg.reward else batch.total_reward()).to(device, torch.float64)
        rewards = (cfg.outcome_coef * outcome.nan_to_num(0.0)).unsqueeze(1).expand(n, k)
        if cfg.turn_rewards:
            per_turn = batch.turn_values(cfg.turn_rewards).to(device, torch.float64).nan_to_num(0.0)
            rewards = rewards + cfg.turn_coef * per_turn
        stage, staged = self._stages(batch, exists)
        valid = staged & (torch.isfinite(outcome).unsqueeze(1) if cfg.outcome_coef != 0 else True)
        z, members = stage_normalise(rewards, stage, valid, batch.num_generations, cfg.scale, cfg.epsilon)
        advantage = torch.where(valid, discounted_returns(z, cfg.gamma), 0.0) if cfg.credit == "return" and k else z
        if bool(exists.any()):
            self.log_metric(batch, "unstaged", float((exists & ~staged).sum() / exists.sum()))
        if bool(valid.any()):
            group = (torch.arange(n, device=device) // batch.num_generations).unsqueeze(1).expand(n, k)
            cells = torch.unique(torch.stack([group[valid], stage[valid]], dim=1), dim=0)
            self.log_metric(batch, "stages", cells.shape[0] / torch.unique(cells[:, 0]).numel())
            self.log_metric(batch, "singletons", float((members[valid] == 1).double().mean()))
            self.log_metric(batch, "advantage_abs", float(advantage[valid].abs().mean()))
        self.log_metric(batch, "turns", float(turns.count.double().mean()))
        return turns.broadcast(advantage.float())
