"""G-RA: gated reward accumulation: step rewards count only when the outcome reward passes a gate.

Method. Dense immediate rewards from stepwise critics can be misaligned with the long-term goal, and
a policy then learns to collect them instead of solving the task. Gated Reward Accumulation adds the
immediate rewards to the return only when the high-level (outcome) reward meets a threshold, so they
rank successful trajectories among themselves but never make a failure look good. The paper works
with multi-turn software-engineering agents (turn rewards); this plugin is the single-turn analogue:
the immediate rewards are the scores of the reasoning steps of one completion, from a step scorer.

Formula (completion with steps ``k = 1..K`` scored ``r_k``, outcome reward ``R_out``)::

    R = R_out + 1[R_out >= tau] * w * sum_k r_k              (accumulate = sum)
    R = R_out + 1[R_out >= tau] * w * mean_k r_k             (accumulate = mean)

``R`` replaces the outcome column (default), or the gated term ``1[R_out >= tau] * w * sum_k r_k``
is appended as a new column (``append_column``), which is the same total under TRL's default
``sum_then_normalize`` when the outcome's weight is 1. A NaN outcome (the reward function returned
``None``) keeps its NaN and never opens the gate; a completion without steps adds 0.

Source: "Stabilizing Long-term Multi-turn Reinforcement Learning with Gated Rewards" (arXiv, Aug 2025;
methods.md section 2.14 records it as 2508.x, the full id was not pinned), **reconstructed from the
abstract**; no code located.

Defaults and constants **not established** (all options): ``tau = 1.0`` (the paper's "predefined
threshold"; 1.0 on a 0/1 accuracy means "only correct answers accumulate"); ``accumulate = sum``
(the abstract says "accumulates"); ``process_weight = 1.0`` (no weight in the abstract's rule);
``outcome = arithmetic_accuracy`` (the host's arithmetic reward; a column is named after its reward
function's ``__name__``). The step scorer defaults to the built-in rule-based ``arithmetic``
checker, a deterministic stand-in for a PRM; any ``pkg.module:func`` scorer plugs in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator

from trl_credit import ConfigError, Plugin, StepConfig, hookimpl

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch, RunInfo

__all__ = ["GatedRewardAccumulation", "gated_accumulation"]


def gated_accumulation(outcome: Any, step_rewards: Any, tau: float = 1.0, weight: float = 1.0) -> torch.Tensor:
    """``(N,)`` gated term ``1[R_out >= tau] * weight * s`` (0 where the outcome is NaN or below ``tau``).

    :param outcome: ``(N,)`` outcome rewards (NaN allowed). :param step_rewards: ``(N,)`` accumulated
        step rewards ``s`` (sum or mean over each completion's steps).
    """
    import torch

    outcome = torch.as_tensor(outcome, dtype=torch.float32)
    s = torch.as_tensor(step_rewards, dtype=torch.float32, device=outcome.device)
    gate = outcome >= tau  # NaN >= tau is False
    return torch.where(gate, weight * s, torch.zeros_like(s))



class GatedRewardAccumulation(Plugin):
    """G-RA: ``R = R_out + 1[R_out >= tau] * sum_k r_k`` (step rewards from a step scorer)."""

    class Config(StepConfig):
        outcome: str = Field(
            "arithmetic_accuracy",
            description="reward column of the outcome reward R_out (a reward function's __name__)",
        )
        tau: float = Field(
            1.0, description="gate threshold: step rewards count only when R_out >= tau (not established)"
        )
        accumulate: Literal["sum", "mean"] = Field(
            "sum", description="how a completion's step rewards are accumulated: sum (G-RA) or mean"
        )
        process_weight: float = Field(
            1.0, description="weight w of the accumulated step rewards (not in the abstract: 1)"
        )
        append_column: str | None = Field(
            None,
            description="null = replace the outcome column by R; a name = keep R_out and append the gated "
            "term as a new reward column of that name (weight 1)",
        )

        @model_validator(mode="after")
        def _distinct_columns(self) -> GatedRewardAccumulation.Config:
            if self.append_column is not None and self.append_column == self.outcome:
                raise ValueError("append_column must differ from the outcome column (omit it to replace)")
            return self

    def required_rewards(self) -> list[str]:
        """The outcome column the host must find among the reward functions."""
        return [self.config.outcome]

    def check_args(self, run: RunInfo) -> None:
        """Refuse ``scorer_kwargs`` the step scorer does not take, and an ``append_column`` that a reward
        function already produces (the gated term would overwrite that column instead of being appended)."""
        c = self.config
        problems = []
        try:
            c.check_scorer_kwargs()
        except ConfigError as exc:
            problems += exc.problems
        if c.append_column is not None and c.append_column in run.reward_names:
            problems += ConfigError.for_key(
                "append_column", f"{c.append_column!r} is already a reward column (reward functions: "
                f"{list(run.reward_names)}), so the gated term would overwrite it",
                "name a new column, or omit append_column to add the term to the outcome column").problems
        if problems:
            raise ConfigError(problems)

    @hookimpl
    def shape_rewards(self, batch: RolloutBatch) -> dict[str, Any]:
        import torch

        from trl_credit import step_scores

        c = self.config
        outcome = batch.reward(c.outcome)
        _, scores = step_scores(batch, c.scorer, c.pattern, **c.scorer_kwargs)
        if c.accumulate == "sum":
            acc = [sum(row) for row in scores]
        else:
            acc = [sum(row) / len(row) if row else 0.0 for row in scores]
        s = torch.tensor(acc, dtype=torch.float32, device=outcome.device)
        gated = gated_accumulation(outcome, s, c.tau, c.process_weight)
        if outcome.numel():
            open_ = (outcome >= c.tau).float()
            self.log_metric(batch, "gate_open", open_.mean().item())
            self.log_metric(batch, "step_reward", s.mean().item())
            self.log_metric(batch, "gated_bonus", gated.mean().item())
        if c.append_column is not None:
            return {c.append_column: gated}
        return {c.outcome: outcome + gated}  # NaN outcomes stay NaN (their gated term is 0)
