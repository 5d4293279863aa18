"""Trust-GRPO (SophiaVL-R1): a thinking reward, weighted by its trustworthiness and annealed over training.

Method. Besides the answer score a_i, a judge model scores the quality of each completion's thinking
process, p_i in [0, 1]. The thinking reward is added with a factor f that decays exponentially with the
training step, so early training is guided by the thinking reward and later training by the answer.
Within each group the judge is checked against the answers: if the correct completions got a lower
mean thinking score than the incorrect ones, the judge is not trusted for this group and f is shrunk
by ``exp(mu_c - mu_i)``. Groups whose answers are all correct or all wrong get no thinking reward.

Formula (group g of G completions at training step t; correct = ``a_i >= 0.5``)::

    if all_i a_i >= 0.9 or all_i a_i <= 0.1:   R_i = a_i                  (no thinking reward)
    else:
        mu_c = mean_{i correct} p_i,  mu_i = mean_{i incorrect} p_i     (0 for an empty set)
        f = alpha * exp(-t / T)
        if mu_c < mu_i:  f <- f * exp(mu_c - mu_i)   (only when some completion is correct)
                         gamma = exp(2 (mu_c - mu_i))                   (logged trust factor)
        else:            gamma = 1
        R_i = a_i + f * p_i

Modes. ``paper``: every completion's thinking score counts (the paper scores all responses).
``code``: as the official code, the judge is queried only for ``a_i >= 0.2``; the other completions get
``p_i = 0`` before the means are taken (with binary answers mu_i is then 0 <= mu_c and the trust
factor never fires).

Implemented as a reward shaper: the thinking column is replaced by ``f_g * p_i`` (0 in all-correct /
all-wrong groups; NaN thinking score -> 0, as the official code returns 0 when the judge fails), the
answer column is left as it is, so the weighted total is the paper's R_i when the reward weights are 1
(TRL's default). A NaN answer score counts as 0 (wrong) in the group rule, the correctness split and
the ``code`` gate; the answer entry itself stays NaN, and where the thinking score is NaN too the
thinking entry stays NaN (the row stays unscored). The step t is the optimiser step (``batch.step``).

Source: Fan et al. 2025, "SophiaVL-R1: Reinforcing MLLMs Reasoning with Thinking Reward",
arXiv 2505.17018. [code] kxfan2002/SophiaVL-R1@a8184947 ``verl/workers/reward/custom.py``
(``CustomRewardManager.__call__``, group branch ``n > 0``), T from ``worker.reward`` config
(``verl/workers/reward/config.py``, default 500). Facts read there, no code copied.

Defaults (all from the official code): alpha = 0.3, T = 500, correct = ``a >= 0.5``, all-correct /
all-wrong group = every ``a >= 0.9`` / every ``a <= 0.1``, judge query threshold 0.2 (``code`` mode);
``mode = paper``. The official code logs gamma = 0.5 for all-correct / all-wrong groups (a marker, no
effect on the reward); here gamma and f are averaged over the groups that get a thinking reward only.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trl_credit import Plugin, hookimpl

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch

__all__ = ["TrustGRPO", "trust_thinking_reward"]


def trust_thinking_reward(
    a: torch.Tensor,
    p: torch.Tensor,
    step: int,
    *,
    alpha: float = 0.3,
    T: float = 500.0,
    mode: str = "paper",
    correct_threshold: float = 0.5,
    high: float = 0.9,
    low: float = 0.1,
    query_threshold: float = 0.2,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Grouped ``(M, G)`` answer scores ``a`` and thinking scores ``p`` -> ``(term, f, gamma, active)``.

    ``term`` ``(M, G)`` is the thinking reward ``f_g * p_i`` (0 in inactive groups); ``f``, ``gamma``
    ``(M,)`` the factor and trust of each group; ``active`` ``(M,)`` bool: the group gets a thinking reward.
    NaN ``a`` counts as 0, NaN ``p`` as 0; ``term`` stays NaN where both are NaN (an unscored row).
    """
    import torch

    unscored = torch.isnan(a) & torch.isnan(p)
    a = a.nan_to_num(0.0)
    p = torch.where(torch.isnan(p), torch.zeros_like(p), p)
    if mode == "code":
        p = torch.where(a >= query_threshold, p, torch.zeros_like(p))    # the judge is not asked
    uniform = (a >= high).all(dim=1) | (a <= low).all(dim=1)            # (M,)
    correct = (a >= correct_threshold).to(p.dtype)                       # (M, G)
    wrong = 1.0 - correct
    n_c, n_i = correct.sum(dim=1), wrong.sum(dim=1)
    mu_c = (p * correct).sum(dim=1) / n_c.clamp(min=1)                   # 0 when no correct one
    mu_i = (p * wrong).sum(dim=1) / n_i.clamp(min=1)                     # 0 when no incorrect one
    untrusted = mu_c < mu_i
    f = alpha * math.exp(-step / T) * torch.where(untrusted & (n_c > 0), torch.exp(mu_c - mu_i),
                                                  torch.ones_like(mu_c))
    gamma = torch.where(untrusted, torch.exp(2.0 * (mu_c - mu_i)), torch.ones_like(mu_c))
    active = ~uniform
    term = torch.where(active.unsqueeze(1), f.unsqueeze(1) * p, torch.zeros_like(p))
    return term.masked_fill(unscored, math.nan), f, gamma, active


class TrustGRPO(Plugin):
    """SophiaVL-R1 Trust-GRPO: R = a + f * p with f = alpha exp(-t/T), shrunk by exp(mu_c - mu_i) when untrusted.

    Replaces the thinking column with f * p per group; kxfan2002/SophiaVL-R1@a8184947 verl/workers/reward/custom.py.
    """

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        answer_reward: str = Field(
            "accuracy_reward",
            description="reward column holding the answer score a (a reward function's name)",
        )
        thinking_reward: str = Field(
            "thinking_reward",
            description="reward column holding the judge's thinking score p in [0, 1]; it is replaced by "
            "the trust-weighted, annealed thinking reward f * p",
        )
        mode: Literal["paper", "code"] = Field(
            "paper",
            description="paper: every thinking score counts (the paper scores all responses); code: as the "
            "official code, completions with a < query_threshold get p = 0 (the judge is not queried)",
        )
        alpha: float = Field(0.3, ge=0.0, description="initial thinking-reward factor (official code: 0.3)")
        T: float = Field(
            500.0, gt=0.0,
            description="annealing time constant in optimiser steps, f = alpha exp(-step / T) "
            "(official config worker.reward default 500)",
        )
        correct_threshold: float = Field(
            0.5, description="a completion is correct when a >= this (official code: 0.5)",
        )
        high: float = Field(
            0.9, description="a group whose answer scores are all >= high gets no thinking reward (official: 0.9)",
        )
        low: float = Field(
            0.1, description="a group whose answer scores are all <= low gets no thinking reward (official: 0.1)",
        )
        query_threshold: float = Field(
            0.2, description="code mode: the judge is queried only when a >= this; others get p = 0 (official: 0.2)",
        )

        @model_validator(mode="after")
        def _distinct_columns(self):
            if self.answer_reward == self.thinking_reward:
                raise ValueError("answer_reward and thinking_reward must be different columns")
            return self

    def required_rewards(self) -> list[str]:
        """The reward columns read: the answer score and the thinking score."""
        return [self.config.answer_reward, self.config.thinking_reward]

    @hookimpl
    def shape_rewards(self, batch: RolloutBatch) -> dict[str, torch.Tensor]:
        import torch

        c = self.config
        a = batch.grouped(batch.reward(c.answer_reward))                  # (M, G)
        p_col = batch.reward(c.thinking_reward)
        term, f, gamma, active = trust_thinking_reward(
            a, batch.grouped(p_col), batch.step, alpha=c.alpha, T=c.T, mode=c.mode,
            correct_threshold=c.correct_threshold, high=c.high, low=c.low, query_threshold=c.query_threshold)
        term = term.reshape(-1)                                           # (N,)
        f0 = c.alpha * math.exp(-batch.step / c.T)
        self.log_metric(batch, "f0", f0)                                  # the annealing schedule
        if active.numel():
            n_active = active.sum()
            act = active.to(f.dtype)
            denom = n_active.clamp(min=1)
            stats = torch.stack([
                act.mean(),                                               # share of groups with a thinking reward
                (gamma * act).sum() / denom,                              # mean trust factor over those groups
                (f * act).sum() / denom,                                  # mean f over those groups
                ((gamma < 1) & active).to(f.dtype).sum() / denom,         # share of them whose judge is distrusted
                n_active.to(f.dtype),
            ]).tolist()                                                   # one host sync
            self.log_metric(batch, "active_groups", stats[0])
            if stats[4] > 0:
                for name, value in zip(("gamma", "f", "untrusted_groups"), stats[1:4]):
                    self.log_metric(batch, name, value)
        return {c.thinking_reward: term}
