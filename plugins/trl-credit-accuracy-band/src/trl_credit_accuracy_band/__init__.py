"""PRIME's online accuracy filter: train only on prompts whose group pass rate lies inside a band.

Method. PRIME (Cui et al. 2025, "Process Reinforcement through Implicit Rewards", arXiv 2502.01456)
samples ``n`` completions per prompt, measures each prompt's accuracy over its own completions and
drops the prompts that are too easy or too hard before the update: a prompt the policy always (or
never) solves carries little learning signal and, with group-relative baselines, none at all. The
generation batch is over-sampled so that enough prompts survive.

Rule (``r_i`` = the tested reward of completion ``i``, ``thr`` the pass threshold, NaN ignored)::

    acc_g = mean_{i in g, r_i not NaN} 1[r_i >= thr]
    keep group g  <=>  low <= acc_g <= high            (both bounds inclusive, as in PRIME)

A group with no finite reward has no accuracy and is dropped (with ``nan_counts_as_fail`` every NaN
reward counts as a failure instead, so such a group has accuracy 0). With ``refill`` the host draws
further generation batches (at most ``max_refill_rounds`` extra ones and, with ``max_refill_tokens``,
no new one once the refill rounds have generated that many completion tokens) until the batch holds
as many kept groups as one generation batch has groups.

Source: official code ``PRIME-RL/PRIME@18ad596f`` ``training/examples/run_prime_main.sh``
(``data.filter_accuracy=True``, ``data.accuracy_lower_bound=0.2``, ``data.accuracy_upper_bound=0.8``,
``data.n_samples=4``) and ``training/verl/trainer/ppo/ray_trainer.py`` (``RayPRIMETrainer.filter``:
``acc = mean over the n samples of the verifier's 0/1 accuracy``, kept iff
``lower <= acc <= upper``; ``fit`` keeps generating ``train_batch_size * oversample_factor`` prompts
per round until ``train_batch_size`` prompts are kept, surplus prompts go to a buffer). Facts read
there, no code copied.

Defaults: ``low = 0.2``, ``high = 0.8`` (PRIME's script); ``threshold = 0.5`` (ours: PRIME tests a
0/1 accuracy, for which any threshold in (0, 1] is the same rule; for non-binary rewards the
threshold turns a score into pass/fail and is **not established**); ``metric = None`` (the weighted
total reward; set it to the accuracy column to test exactly PRIME's ``acc``); ``refill = True`` and
``max_refill_rounds = 3`` (PRIME over-samples without a round cap, its examples use
``oversample_factor`` 1 to 4, verl's PRIME recipe 4; one refill round here is one generation batch,
so 3 extra rounds are at most 4x a step's generation: **our choice**); ``max_refill_tokens = None``
(no token budget; PRIME has none).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trl_credit import Plugin, Refill, hookimpl

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch

__all__ = ["AccuracyBand", "group_accuracy"]


def group_accuracy(grouped: torch.Tensor, threshold: float, nan_counts_as_fail: bool = False) -> torch.Tensor:
    """``(M, G)`` rewards -> ``(M,)`` pass rate ``mean 1[r >= threshold]`` per group.

    NaN rewards are left out of the mean (NaN for a group without a finite reward), or count as
    failures with ``nan_counts_as_fail``.
    """
    import torch

    finite = ~torch.isnan(grouped)
    passed = (grouped >= threshold) & finite                       # NaN >= thr is already False
    if nan_counts_as_fail:
        return passed.to(torch.float32).mean(dim=1)
    count = finite.sum(dim=1)
    acc = passed.sum(dim=1).to(torch.float32) / count.clamp(min=1).to(torch.float32)
    return acc.masked_fill(count == 0, float("nan"))


class AccuracyBand(Plugin):
    """PRIME accuracy filter: keep group g iff low <= mean_g 1[r >= threshold] <= high; refill the batch."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        low: float = Field(
            0.2, ge=0.0, le=1.0,
            description="lowest group pass rate kept, inclusive (PRIME: data.accuracy_lower_bound = 0.2)",
        )
        high: float = Field(
            0.8, ge=0.0, le=1.0,
            description="highest group pass rate kept, inclusive (PRIME: data.accuracy_upper_bound = 0.8)",
        )
        threshold: float = Field(
            0.5,
            description="a completion passes when its reward is >= threshold (PRIME tests a 0/1 accuracy; "
            "for non-binary rewards this cut is not established)",
        )
        metric: str | None = Field(
            None,
            description="reward column whose pass rate is tested (PRIME: the verifier's acc); None = the "
            "weighted total reward, summed as TRL does",
        )
        nan_counts_as_fail: bool = Field(
            False,
            description="count a NaN reward (reward function returned None) as a failure; false = leave it "
            "out of the group's pass rate (a group with no finite reward is then dropped)",
        )
        refill: bool = Field(
            True,
            description="ask the host to draw more prompts until the batch holds as many kept groups as one "
            "generation batch has groups (PRIME over-samples); false = only mask",
        )
        max_refill_rounds: int = Field(
            3, ge=0,
            description="extra generation rounds per step at most (PRIME: no cap, oversample_factor 1-4 "
            "per round); each round costs one generation batch",
        )
        max_refill_tokens: int | None = Field(
            None, ge=0,
            description="budget of extra generated completion tokens (all processes) that refill may spend "
            "per optimiser batch: no new refill round starts once it is reached (one round may overshoot; "
            "logged as trl_credit/refill_budget_hit); None = no budget, only max_refill_rounds",
        )

        @model_validator(mode="after")
        def _ordered(self) -> AccuracyBand.Config:
            if self.low > self.high:
                raise ValueError(f"low ({self.low}) must be <= high ({self.high})")
            return self

    def refill(self) -> Refill | None:
        """With ``refill``: up to ``max_refill_rounds`` extra rounds within ``max_refill_tokens``; else none."""
        cfg = self.config
        if not cfg.refill:
            return None
        return Refill(max_rounds=cfg.max_refill_rounds, max_tokens=cfg.max_refill_tokens)

    def required_rewards(self) -> list[str]:
        """The reward column the host must find among the reward functions (none for the total)."""
        return [self.config.metric] if self.config.metric is not None else []

    @hookimpl
    def filter_rollouts(self, batch: RolloutBatch) -> torch.Tensor:
        import torch

        c = self.config
        r = batch.reward(c.metric) if c.metric is not None else batch.total_reward()
        acc = group_accuracy(batch.grouped(r.to(torch.float32)), c.threshold, c.nan_counts_as_fail)  # (M,)
        keep = (acc >= c.low) & (acc <= c.high)                        # NaN compares False: dropped
        if keep.numel():
            stats = torch.stack([
                acc > c.high,                                          # too easy
                acc < c.low,                                           # too hard
                torch.isnan(acc),                                      # no reward at all
            ]).float().mean(dim=1).tolist()                            # one host sync
            for name, value in zip(("too_easy", "too_hard", "no_reward_groups"), stats):
                self.log_metric(batch, name, value)
        return keep
