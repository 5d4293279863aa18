"""Positive-negative prompt pairing ("Beyond Variance"): every update pairs a hard-but-solvable
prompt with an easy-but-brittle one.

Method. "Beyond Variance: Prompt-Efficient RLVR via Rare-Event Amplification and Bidirectional
Pairing" (arXiv 2602.03452) argues that a minibatch should hold a reliable positive anchor and
explicit negative signals from rare failures. At each update it samples a *hard-but-solvable*
prompt ``q+`` (low but non-zero empirical success rate under multiple rollouts) and an
*easy-but-brittle* prompt ``q-`` (high success rate, but not perfect). With group-normalised
advantages a rare success on ``q+`` then becomes a strong positive signal and a rare failure on
``q-`` a strong negative one. Prompts with success rate 0 or 1 give a group no signal and are never
chosen.

Rule (empirical pass rates from the host-tracked rollouts, ``p_hat_q = passed_q / seen_q``, a
completion passing when its total reward is >= the host's pass threshold; with ``history: latest``,
the default, only the rollouts of the step the prompt was last scored in count, the paper's "success
rate under multiple rollouts" of the current policy, so a prompt the policy has since solved every
time leaves ``E``; ``history: all`` counts every rollout since the start)::

    eligible  E = { q : seen_q > 0 and 0 < p_hat_q < 1 }
    q+ : the lowest p_hat in E with p_hat < positive_below      (hard but solvable)
    q- : the highest p_hat in E with p_hat > negative_above     (easy but brittle)

A generation batch of ``k = prompts_per_batch`` prompts holds ``n_pairs = (k - n_explore) // 2``
pairs, where ``n_explore = min(floor(explore_share * k), #unseen)`` slots are kept for never-seen
prompts. Pair j takes the j-th lowest and the j-th highest candidate (ties: scored longest ago
first, then the lower dataset row); if one side runs out of candidates the other side still gets
its ``n_pairs`` prompts. Slots left open (an odd ``k``, the exploration slots, or too few
candidates) are filled uniformly from the never-seen prompts, then from eligible prompts not chosen,
and only then (by the host's sampler) from the rest; when no prompt is eligible or unseen (every
seen prompt always or never solved) the weights are uniform. Example: ``p_hat = {A: 0.1, B: 0.9, C: 0.5,
D: 1.0, E: 0.0}`` and ``k = 2`` give ``q+ = A``, ``q- = B`` (D and E carry no signal).

Weights (what the hook returns): 1 for each chosen prompt; ``1e-9 / #unseen`` for each unseen
prompt and ``1e-18 / #eligible-unchosen`` for each eligible prompt not chosen, only when slots are
open; 0 otherwise. The host's sampler draws ``k`` prompts without replacement, so it takes every
weight-1 prompt and fills the open slots in that order (the chance of anything else is about
1e-9). The weights are a pure function of the statistics: the same on every process.

Weighted GRPO (the paper's pair-level re-weighting of the binary outcomes before group
normalisation) is **not implemented**: its weights are not established from the abstract. This
plugin does the prompt selection only; the advantages are those of the configured estimator
(TRL's GRPO by default, which already gives one success in a group of 8 an advantage of +2.47).

Source: arXiv 2602.03452, abstract only (seed collection 000); no code found.
**Reconstructed from the abstract**: the thresholds ``positive_below = negative_above = 0.5`` (the
abstract only says "low" and "high"; a prompt at exactly 1/2 is neither), empirical rates without smoothing, the online tracking, the
tie-breaks, the exploration share (default 0: the paper uses one pair per update) and the handling
of odd ``k`` are ours and exposed as options where they are choices.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from trl_credit import Plugin, hookimpl

if TYPE_CHECKING:
    import torch

    from trl_credit import PromptStats

__all__ = ["PosNegPairing", "select_pairs"]

#: total weight of the unseen prompts that fill open slots, far below one chosen prompt's 1
FILL_MASS = 1e-9


def _stable_order(*keys: torch.Tensor) -> torch.Tensor:
    """Indices sorting lexicographically by ``keys`` (first key most significant), ties by index."""
    import torch

    order = torch.arange(keys[0].shape[0])
    for key in reversed(keys):
        order = order[torch.sort(key[order], stable=True).indices]
    return order


def select_pairs(p_hat: torch.Tensor, last_step: torch.Tensor, n_pairs: int, positive_below: float = 0.5,
                 negative_above: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose up to ``n_pairs`` ``q+`` and ``q-`` prompts.

    :param p_hat: ``(P,)`` empirical pass rates, NaN for unseen prompts (never chosen, nor 0 or 1).
    :param last_step: ``(P,)`` step each prompt was last scored (older first among equal rates).
    :return: ``(positives, negatives)``: long rows, best first (``positives[j]`` pairs ``negatives[j]``).
    """
    import torch

    p_hat = p_hat.to(torch.float64)
    eligible = (p_hat > 0) & (p_hat < 1)                               # NaN compares False
    rows = eligible.nonzero().squeeze(1)
    p, age = p_hat[rows], last_step[rows].to(torch.int64)
    pos = rows[_stable_order(p, age)]                                  # lowest rate first
    pos = pos[p_hat[pos] < positive_below][:n_pairs]
    neg = rows[_stable_order(-p, age)]                                 # highest rate first
    taken = torch.zeros_like(eligible)
    taken[pos] = True
    neg = neg[(p_hat[neg] > negative_above) & ~taken[neg]][:n_pairs]
    return pos, neg


class PosNegPairing(Plugin):
    """Beyond-Variance pairing: each batch pairs lowest-nonzero-p_hat q+ with highest-below-1 q- prompts."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        positive_below: float = Field(
            0.5, ge=0.0, le=1.0,
            description="a q+ (hard-but-solvable) prompt has empirical pass rate < positive_below "
            "(not established; the paper says 'low')",
        )
        negative_above: float = Field(
            0.5, ge=0.0, le=1.0,
            description="a q- (easy-but-brittle) prompt has empirical pass rate > negative_above "
            "(not established; the paper says 'high but not perfect')",
        )
        history: Literal["latest", "all"] = Field(
            "latest",
            description="which rollouts of a prompt give its pass rate: latest = those of the step it was "
            "last scored in (a prompt the policy has since solved every time is no longer eligible), all = "
            "every rollout since the start (a prompt once eligible stays eligible and is re-drawn)",
        )
        explore_share: float = Field(
            0.0, ge=0.0, le=1.0,
            description="share of each generation batch (floor(share * k) slots) kept for never-seen "
            "prompts; 0 = the paper's one-pair-per-update (unseen prompts then only fill slots no pair "
            "can take)",
        )

    @hookimpl
    def prompt_weights(self, stats: PromptStats, step: int) -> torch.Tensor:
        import torch

        c = self.config
        p_hat = stats.pass_rate(latest=c.history == "latest").to(torch.float64)  # NaN where never seen
        unseen = stats.seen <= 0
        unseen_count = int(unseen.sum())
        k = max(int(stats.prompts_per_batch), 2)                      # 0 = unknown: one pair
        n_explore = min(math.floor(c.explore_share * k + 1e-9), unseen_count)
        positives, negatives = select_pairs(p_hat, stats.last_step, (k - n_explore) // 2,
                                            c.positive_below, c.negative_above)
        weights = torch.zeros(stats.num_prompts, dtype=torch.float64)
        chosen = positives.numel() + negatives.numel()
        weights[positives] = 1.0
        weights[negatives] = 1.0
        if chosen < k:                                                 # open slots
            fill_unseen = FILL_MASS if chosen else 1.0
            if unseen_count:
                weights[unseen] = fill_unseen / unseen_count
            spare = (p_hat > 0) & (p_hat < 1) & (weights == 0)         # eligible, not chosen
            spare_count = int(spare.sum())
            if spare_count:
                scale = fill_unseen * FILL_MASS if unseen_count else fill_unseen
                weights[spare] = scale / spare_count
            if chosen == 0 and not unseen_count and not spare_count:
                weights.fill_(1.0)                                     # every prompt solved or failed: uniform
        return weights
