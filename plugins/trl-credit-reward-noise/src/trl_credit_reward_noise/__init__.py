"""Reward noise: flip binary rewards at random, seeded, the robustness fixture of the noisy-reward paper.

Method. Lv et al. test how robust RL for reasoning is to a noisy verifier by flipping a binary
correctness reward with probability ``p``: a correct answer is rewarded 0, a wrong one 1. With
``p = 0.4`` a Qwen-2.5-7B still climbs from 5 % to 72 % on MATH (75 % without noise). This plugin
injects that noise into one reward column, so any credit-assignment method can be stress-tested the
same way.

Rule (``r`` in {low, high}, ``u`` ~ U[0, 1) drawn per flip unit)::

    r' = (low + high) - r   if u < p        (binary: r' = 1 - r)
    r' = r                  otherwise

The official code draws one ``u`` per *group* (all G completions of a prompt are flipped together:
``if i % rollout_n == 0: do_flip = flip_prob > random.random()``, run name ``...-group-flip-<p>``);
the paper's text says 40 % of the reward function's outputs are flipped, which also reads as one draw
per completion. Both are offered (``unit``); the default is the code's. NaN rewards stay NaN (and a
NaN row in a flipped group stays NaN).

Randomness. The draws come from a CPU ``torch.Generator`` seeded with a hash of ``(seed,
batch.step, round within the step, the batch's prompt indices)``: every process sees the same
gathered batch and therefore draws the same flips (no communication needed), a run is reproducible
for a fixed seed, each optimiser step and each refill round gets fresh draws.

Source: Lv, Xie, Sun, Kang, Yan 2025, "The Climb Carves Wisdom Deeper Than the Summit: On the Noisy
Rewards in Learning to Reason", arXiv 2505.22653; official code
trestad/Noisy-Rewards-in-Learning-to-Reason@083f72ba ``verl/verl/workers/reward_manager/naive.py``
(the group flip, ``1 - score``) and ``scripts/train_rl_math_7b_orz_flip.sh`` (``flip_prob`` as the
script argument, ``rollout.n = 4``). Facts read there; the code here is our own.

Defaults: ``p = 0.4`` (the paper's headline setting; the code's ``flip_prob`` default is null = no
flip), ``unit = "group"`` (the code), ``column = None`` = the first reward column (the code has a
single reward), ``seed = 0``. Not from the paper (options): what to do with non-binary values
(``non_binary: error`` or ``threshold``), the binary levels ``low``/``high``.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trl_credit import Plugin, hookimpl

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch

__all__ = ["RewardNoise", "flip_draws"]


def flip_draws(count: int, seed: int, step: int, round_: int, prompt_index: torch.Tensor) -> torch.Tensor:
    """``(count,)`` float64 uniforms in [0, 1), a pure function of its arguments (identical on every process)."""
    import torch

    digest = hashlib.blake2b(digest_size=8)
    digest.update(f"{seed}:{step}:{round_}:{count}:".encode())
    digest.update(repr(prompt_index.detach().to("cpu", torch.int64).tolist()).encode())
    generator = torch.Generator(device="cpu").manual_seed(int.from_bytes(digest.digest(), "little") >> 1)
    return torch.rand(count, generator=generator, dtype=torch.float64)


class RewardNoise(Plugin):
    """Flip a binary reward column with probability p (per group as the official code, or per completion),
    seeded from (seed, step, round, prompt indices): the same flips on every process."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        column: str | None = Field(None, description="reward column to corrupt; None = the first column")
        p: float = Field(0.4, ge=0.0, le=1.0, description="flip probability (paper's headline setting: 0.4)")
        unit: Literal["group", "completion"] = Field(
            "group", description="group: one draw per group, all its completions flipped together (official "
            "code); completion: one draw per completion (the paper's '40% of outputs' read literally)",
        )
        seed: int = Field(0, description="base seed; the draws also depend on the step, the round within the "
                          "step and the prompt indices of the batch")
        low: float = Field(0.0, description="the 'wrong' value of the binary reward")
        high: float = Field(1.0, description="the 'correct' value of the binary reward")
        non_binary: Literal["error", "threshold"] = Field(
            "error", description="a finite value other than low/high: error (raise, naming the column), or "
            "threshold (binarise: >= threshold counts as high, then flip; the column becomes binary)",
        )
        threshold: float = Field(0.5, description="non_binary=threshold: values >= threshold count as high")

        @model_validator(mode="after")
        def _check(self) -> RewardNoise.Config:
            if self.low == self.high:
                raise ValueError("low and high must differ")
            return self

    def __init__(self, config: Config | None = None):
        super().__init__(config)
        self._step: int | None = None
        self._round = 0

    def required_rewards(self) -> list[str]:
        """The corrupted column, when named."""
        return [self.config.column] if self.config.column is not None else []

    @hookimpl
    def shape_rewards(self, batch: RolloutBatch) -> dict[str, torch.Tensor]:
        import torch

        c = self.config
        if batch.step != self._step:                                   # rounds of one step: same rank order
            self._step, self._round = batch.step, 0
        else:
            self._round += 1
        name = c.column if c.column is not None else batch.reward_names[0]
        r = batch.reward(name)
        finite = ~torch.isnan(r)
        is_high = r == c.high
        if c.non_binary == "threshold":
            is_high = r >= c.threshold
        else:
            odd = finite & ~is_high & (r != c.low)
            if odd.any():
                value = r[odd][0].item()
                raise ValueError(f"reward column {name!r} is not binary ({value!r} is neither low={c.low} nor "
                                 f"high={c.high}); set non_binary: threshold to binarise it")
        n = batch.num_completions
        units = batch.num_groups if c.unit == "group" else n
        u = flip_draws(units, c.seed, batch.step, self._round, batch.prompt_index)
        flip = (u < c.p).to(batch.device)
        if c.unit == "group":
            flip = flip.repeat_interleave(batch.num_generations)
        high = torch.full_like(r, c.high)
        low = torch.full_like(r, c.low)
        noisy = torch.where(is_high ^ flip, high, low)
        noisy = torch.where(finite, noisy, r)                          # NaN stays NaN
        flipped = (flip & finite).float().sum() / finite.float().sum().clamp(min=1)
        self.log_metric(batch, "flipped_fraction", flipped.item())
        return {name: noisy}
