"""GRPO-lambda: a length penalty only for the groups the policy already solves best.

Method. Length-penalty rewards (shorter correct answers score higher) cut chain-of-thought length
but make GRPO training collapse early: accuracy drops abruptly as lengths shrink. GRPO-lambda
watches the correctness ratio of each prompt's group: where it is high the length penalty stays on
(efficiency), where it is low the plain 0/1 reward is used (capability first). Per batch, the
groups are ranked by correctness ratio and the top-lambda fraction get the length-penalised reward.

Formula (group g of G completions, ``c_i`` = 1[completion i correct], ``L_i`` its length in tokens;
Kimi-1.5 length reward)::

    acc_g = mean_{i in g} c_i ;   S = the ceil(lambda * M) groups of highest acc_g, minus those with acc_g = 0
    lam_i = 0.5 - (L_i - L_min,g) / (L_max,g - L_min,g)      (lam_i = 0 when L_max,g = L_min,g)
    len_i = lam_i if c_i else min(0, lam_i)
    R_i   = r_i + w * len_i   if g in S,      R_i = r_i   otherwise      (r_i = c_i for a 0/1 column)

Source: **reconstructed from the abstract** of Dai, Liu, Si 2025, "Stable Reinforcement Learning for
Efficient Reasoning", arXiv 2505.18086 (the correctness-ratio switch between a length penalty and
0/1 rewards) plus a third-party summary naming "batch-wise group correctness and a top-lambda
selection"; no code found. The length reward is Kimi k1.5's (Kimi Team 2025, arXiv 2501.12599,
"length penalty"), assumed because the paper's baseline is "GRPO + length penalty" in Kimi style.

Not established, so every one is an option: the fraction lambda (``fraction = 0.5``, our choice),
the selection rule (``selection``: top fraction of the batch, or every group whose ratio reaches
``ratio_threshold``), how lambda * M is rounded (up here, so a non-empty batch with lambda > 0
always selects at least one group with a correct answer), the length-reward form (``length_reward``:
``kimi``, or ``kimi_correct_only`` which leaves wrong answers unpenalised) and its weight
``length_weight = 1``. Ties in the ranking go to the earlier group of the batch (a stable sort),
so the selection is deterministic and the same on every process.

Reconstruction choices (documented, not options): correctness is ``r >= correct_threshold`` on the
named column; NaN rows (no reward) count neither in a group's ratio nor in its L_min/L_max and stay
NaN; a group without any finite reward is never selected; lengths are ``batch.completion_lengths``
(unmasked completion tokens; with ``mask_truncated_completions`` a truncated completion counts 0).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from trl_credit import Plugin, hookimpl

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch

__all__ = ["GrpoLambda", "kimi_length_reward", "select_groups"]


def kimi_length_reward(correct: torch.Tensor, lengths: torch.Tensor, valid: torch.Tensor,
                       correct_only: bool = False) -> torch.Tensor:
    """Kimi-1.5 length reward per completion of ``(M, G)`` groups.

    :param correct: ``(M, G)`` bool; ``lengths``: ``(M, G)`` float; ``valid``: ``(M, G)`` bool, the rows that
        count for ``L_min``/``L_max`` (others get 0).
    :return: ``(M, G)`` float: ``lam`` for correct, ``min(0, lam)`` for wrong (0 with ``correct_only``),
        ``lam = 0.5 - (L - L_min) / (L_max - L_min)``, 0 where the group's valid lengths are all equal.
    """
    import torch

    lengths = lengths.to(torch.float32)
    l_min = lengths.masked_fill(~valid, math.inf).amin(dim=1, keepdim=True)
    l_max = lengths.masked_fill(~valid, -math.inf).amax(dim=1, keepdim=True)
    spread = l_max - l_min
    varied = spread > 0                                               # False also for groups with < 2 valid rows
    lam = torch.where(varied, 0.5 - (lengths - l_min) / torch.where(varied, spread, 1.0), 0.0)
    wrong = torch.zeros_like(lam) if correct_only else lam.clamp(max=0.0)
    return torch.where(correct, lam, wrong).masked_fill(~valid, 0.0)


def select_groups(ratio: torch.Tensor, selection: str, fraction: float, ratio_threshold: float) -> torch.Tensor:
    """``(M,)`` bool: the groups that get the length penalty (never one whose ratio is 0 or NaN).

    ``top_fraction``: the ``ceil(fraction * M)`` highest ratios, ties to the earlier group;
    ``threshold``: every group with ``ratio >= ratio_threshold``.
    """
    import torch

    eligible = ratio > 0                                              # NaN compares False
    if selection == "threshold":
        return eligible & (ratio >= ratio_threshold)
    m = ratio.shape[0]
    k = min(m, math.ceil(fraction * m - 1e-9))
    order = torch.sort(ratio.nan_to_num(-1.0), descending=True, stable=True).indices
    top = torch.zeros(m, dtype=torch.bool, device=ratio.device)
    top[order[:k]] = True
    return top & eligible


class GrpoLambda(Plugin):
    """GRPO-lambda (reconstructed): the top-lambda groups by correctness ratio get R = 1[correct] + Kimi
    length reward; every other group keeps its 0/1 reward."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        column: str | None = Field(None, description="correctness reward column; None = the first column")
        correct_threshold: float = Field(0.5, description="a completion is correct when its reward >= this")
        selection: Literal["top_fraction", "threshold"] = Field(
            "top_fraction", description="top_fraction: the ceil(fraction * groups) groups of highest correctness "
            "ratio in the batch (ties: earlier group first); threshold: every group with ratio >= ratio_threshold "
            "(not established which the paper uses)",
        )
        fraction: float = Field(
            0.5, ge=0.0, le=1.0, description="lambda, the fraction of the batch's groups that get the length "
            "penalty (not established; 0.5 is our choice)",
        )
        ratio_threshold: float = Field(
            0.5, ge=0.0, le=1.0, description="selection=threshold: minimum correctness ratio (not established)",
        )
        length_reward: Literal["kimi", "kimi_correct_only"] = Field(
            "kimi", description="kimi: correct +lam, wrong +min(0, lam) (Kimi k1.5); kimi_correct_only: wrong 0",
        )
        length_weight: float = Field(1.0, ge=0.0, description="multiplier of the length reward (not established)")
        output_column: str | None = Field(
            None, description="None: add the length reward to the correctness column in place (R = r + len); "
            "a name: append it as its own column (weight 1, 0 outside the selected groups)",
        )

    def required_rewards(self) -> list[str]:
        """The correctness column, when named."""
        return [self.config.column] if self.config.column is not None else []

    @hookimpl
    def shape_rewards(self, batch: RolloutBatch) -> dict[str, torch.Tensor]:
        import torch

        c = self.config
        name = c.column if c.column is not None else batch.reward_names[0]
        r = batch.grouped(batch.reward(name))                          # (M, G)
        valid = ~torch.isnan(r)
        correct = valid & (r >= c.correct_threshold)
        ratio = correct.sum(dim=1) / valid.sum(dim=1)                  # NaN for a group without rewards
        selected = select_groups(ratio, c.selection, c.fraction, c.ratio_threshold)
        lengths = batch.grouped(batch.completion_lengths)
        bonus = kimi_length_reward(correct, lengths, valid, c.length_reward == "kimi_correct_only")
        bonus = c.length_weight * bonus * selected.unsqueeze(1)       # (M, G), 0 outside the selection
        rows = valid & selected.unsqueeze(1)
        stats = torch.stack([selected.float().sum() / max(selected.numel(), 1),
                             bonus.sum() / rows.sum().clamp(min=1)]).tolist()       # one host sync
        self.log_metric(batch, "selected_fraction", stats[0])
        self.log_metric(batch, "length_reward_mean", stats[1])
        if c.output_column is not None:  # a row no reward function scored stays unscored (NaN), as in TRL
            return {c.output_column: torch.where(batch.scorable, bonus.reshape(-1), math.nan)}
        return {name: (r + bonus).reshape(-1)}                         # NaN + x stays NaN
