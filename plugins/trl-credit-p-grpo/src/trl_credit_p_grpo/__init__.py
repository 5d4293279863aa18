"""P-GRPO (Posterior-GRPO): the process reward only counts for completions whose outcome is correct.

Method. A reward on the reasoning process (a thinking/process score from a reward model or judge)
invites reward hacking: the policy can raise the process score without getting the answer right.
Posterior-GRPO conditions the process reward on task success: a completion earns its process
score only when its outcome reward says it is correct; wrong completions get the outcome (and
format) reward alone. Within a group the correct completions are then ranked by reasoning quality,
while no wrong completion can out-score a correct one through its reasoning.

Formula (completion i; R_fmt optional; binary outcome R_out in {0, 1})::

    R_i = R_fmt,i + R_out,i + R_out,i * w * R_proc,i

generalised to non-binary outcomes with a gate ``1[R_out,i >= tau]`` in place of the factor R_out,i::

    R_i = R_fmt,i + R_out,i + 1[R_out,i >= tau] * w * R_proc,i

Implemented as a reward shaper: the process column is replaced by the gated term
``1[R_out >= tau] * w * R_proc`` (NaN process score -> 0), the outcome and format columns are left
as they are, so the weighted total the advantage estimator uses is the paper's R_i when the reward
weights are 1 (TRL's default). A reward weight on the process column multiplies ``w``. A
completion with no outcome (NaN) gets no process credit; a row whose outcome and process are both
NaN keeps a NaN process entry (TRL then treats an otherwise unscored row as unscored).

Source: Fan, Zhang, Chen, Liu 2025, "Posterior-GRPO: Rewarding Reasoning Processes in Code
Generation", arXiv 2508.05170. Reconstructed from the abstract (no official code located): "conditions
process-based rewards on task success ... selectively applying rewards to the reasoning processes of
only successful outcomes".

Defaults: ``weight`` w = 1.0 (NOT established: the abstract gives no weight); ``threshold`` tau = 0.5
(NOT established: for a binary outcome every tau in (0, 1] gives the paper's formula; 0.5 is the
host's pass threshold); column names ``accuracy_reward`` (TRL's accuracy reward function) and
``process_reward``; no format column.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trl_credit import Plugin, hookimpl

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch

__all__ = ["PosteriorGRPO", "gated_process_reward"]


def gated_process_reward(r_out: torch.Tensor, r_proc: torch.Tensor, weight: float = 1.0,
                         threshold: float = 0.5) -> torch.Tensor:
    """``(N,)`` outcome and process rewards -> ``(N,)`` term ``1[r_out >= threshold] * weight * r_proc``.

    NaN process scores count as 0; a NaN outcome closes the gate. Where both are NaN the result is NaN.
    """
    import torch

    proc_nan = torch.isnan(r_proc)
    gate = r_out >= threshold                                          # NaN >= x is False
    term = torch.where(gate & ~proc_nan, weight * r_proc, torch.zeros_like(r_proc))
    return term.masked_fill(proc_nan & torch.isnan(r_out), math.nan)


class PosteriorGRPO(Plugin):
    """P-GRPO: R = R_fmt + R_out + 1[R_out >= tau] * w * R_proc (process credit only when correct).

    Replaces the process column with the gated term; arXiv 2508.05170, reconstructed from the abstract.
    """

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        outcome_reward: str = Field(
            "accuracy_reward",
            description="reward column holding the outcome reward R_out (a reward function's name)",
        )
        process_reward: str = Field(
            "process_reward",
            description="reward column holding the process/thinking score R_proc; it is replaced by the "
            "gated term 1[R_out >= threshold] * weight * R_proc",
        )
        format_reward: str | None = Field(
            None,
            description="optional reward column holding the format reward R_fmt: only checked to exist "
            "(it enters the weighted total as any column does); null = no format term",
        )
        weight: float = Field(
            1.0, ge=0.0,
            description="w, the weight of the gated process term (NOT established by the paper; 1.0)",
        )
        threshold: float = Field(
            0.5,
            description="tau: the outcome counts as correct when R_out >= tau (NOT established; any tau in "
            "(0, 1] reproduces the paper for binary outcomes)",
        )

        @model_validator(mode="after")
        def _distinct_columns(self):
            names = [self.outcome_reward, self.process_reward] + ([self.format_reward] if self.format_reward else [])
            if len(set(names)) != len(names):
                raise ValueError(f"outcome_reward, process_reward and format_reward must differ, got {names}")
            return self

    def required_rewards(self) -> list[str]:
        """The reward columns read: outcome, process and (if set) format."""
        c = self.config
        return [c.outcome_reward, c.process_reward] + ([c.format_reward] if c.format_reward else [])

    @hookimpl
    def shape_rewards(self, batch: RolloutBatch) -> dict[str, torch.Tensor]:
        import torch

        c = self.config
        r_out = batch.reward(c.outcome_reward)                              # (N,)
        r_proc = batch.reward(c.process_reward)                             # (N,)
        term = gated_process_reward(r_out, r_proc, c.weight, c.threshold)   # (N,)
        if term.numel():
            stats = torch.stack([
                (r_out >= c.threshold).float().mean(),                      # share of completions gated in
                term.nan_to_num(0.0).mean(),                                # mean gated process term
            ]).tolist()                                                     # one host sync
            self.log_metric(batch, "gate_rate", stats[0])
            self.log_metric(batch, "process_term_mean", stats[1])
        return {c.process_reward: term}
