"""PPPO: progressive prefix-token policy optimisation ("Well Begun, Half Done").

Method. Early tokens of a reasoning trace lock in what follows (the "beginning lock-in effect"), so PPPO trains
only on a prefix of every completion, and lets the retained prefix grow over training (progressive prefix
retention). Optionally the prefix is rewarded by what it leads to: several continuations are sampled from the
retained prefix and their scores are accumulated into its reward (continuation accumulated reward), which
removes the luck of the one continuation that was sampled.

Formula (completion ``i`` with ``|o_i|`` loss tokens, step ``s`` of ``S`` = ``ramp_steps``)::

    rho_s  = rho_start + (rho_end - rho_start) * min(s / S, 1)                    (linear ramp)
    L_i    = ceil(rho_s * |o_i|)
    w_it   = 1 if the token is among the first L_i loss tokens of row i, else 0    (TRL's loss mask * w)
    continuation reward (``continuations: M > 0``):
    R_i    = mean over {o_i} + M samples c_im ~ pi(. | x, o_i[:L_i]) of reward(o_i[:L_i] + c_im)
             (every reward column averaged; ``include_original: false`` leaves o_i out; each c_im has at most
             max_completion_length - min_i L_i tokens)

Source: the abstract of "Well Begun, Half Done: Reinforcement Learning with Prefix Optimization for LLM
Reasoning" (``papers/004``) and methods.md 2.21 (test: ``|o| = 10, rho = 0.3 -> [1,1,1,0,0,0,0,0,0,0]``).
Established by the abstract: training on the prefix only, a retained proportion that increases over
training, and a prefix reward accumulated over several sampled continuations. Chosen (not in the abstract):
the linear ramp and its ends (``rho_start = 0.2``, ``rho_end = 0.5`` over the whole run, so about a third of the
tokens train on average: the paper reports its gains "on only 26.17% training tokens"); ``ceil``; the token
mask applied as TRL's loss mask (its KL and entropy terms follow the same tokens; under ``dapo`` the normaliser
stays the round's token count, so the update is the sum over retained tokens); the mean as the accumulation,
with the sampled original continuation counted as one of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trl_credit import LossWeights, Plugin, RunInfo, hookimpl

if TYPE_CHECKING:
    import torch

    from trl_credit import LossInputs, RolloutBatch

__all__ = ["PPPO", "prefix_lengths", "prefix_mask"]


def prefix_lengths(lengths: torch.Tensor, rho: float) -> torch.Tensor:
    """``ceil(rho * |o_i|)`` (long)."""
    import torch

    return torch.ceil(lengths.float() * rho - 1e-9).long()


def prefix_mask(mask: torch.Tensor, rho: float) -> torch.Tensor:
    """``(B, T)`` 1 on the first ``ceil(rho * |o_i|)`` loss tokens of each row (``mask`` > 0), 0 elsewhere."""
    keep = prefix_lengths((mask > 0).sum(1), rho)
    seen = (mask > 0).long().cumsum(1)  # loss tokens up to and including t
    return ((seen <= keep.unsqueeze(1)) & (mask > 0)).to(mask.dtype)


class PPPO(Plugin):
    """Progressive prefix retention as token weights of TRL's loss; optional continuation-accumulated reward."""

    name = "pppo"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        rho_start: float = Field(0.2, gt=0.0, le=1.0, description="retained prefix fraction at step 0")
        rho_end: float = Field(0.5, gt=0.0, le=1.0, description="retained prefix fraction after the ramp")
        ramp_steps: int | None = Field(None, ge=1, description="steps of the linear ramp; null: the run's max_steps")
        continuations: int = Field(0, ge=0, description="continuations sampled from each retained prefix for its "
                                   "reward (0: off; the completion's own reward is kept)")
        include_original: bool = Field(True, description="count the completion's own continuation in the mean")
        temperature: float = Field(1.0, gt=0.0, description="sampling temperature of the continuations")

        @model_validator(mode="after")
        def _ordered(self):
            if self.rho_end < self.rho_start:
                raise ValueError(f"rho_end ({self.rho_end}) must be >= rho_start ({self.rho_start})")
            return self

    def __init__(self, config=None):
        super().__init__(config)
        self.ramp = self.config.ramp_steps

    def check_args(self, run: RunInfo) -> None:
        if self.config.ramp_steps is None:
            steps = int(getattr(run.args, "max_steps", -1) or -1)
            self.ramp = steps if steps > 0 else 1000

    def rho(self, step: int) -> float:
        """``rho_s`` of the linear ramp."""
        c = self.config
        ramp = self.ramp or 1000
        return c.rho_start + (c.rho_end - c.rho_start) * min(step / ramp, 1.0)

    @hookimpl
    def shape_rewards(self, batch: RolloutBatch) -> dict | None:
        import torch

        c = self.config
        if not c.continuations:
            return None
        rho = self.rho(batch.step)
        keep = prefix_lengths(batch.completion_lengths, rho)
        new_tokens = max(batch.max_completion_length - int(keep.min()) if keep.numel() else 1, 1)
        probes = batch.probe(keep.unsqueeze(1), "", num_samples=c.continuations, max_new_tokens=new_tokens,
                             temperature=c.temperature)
        n, m = batch.num_completions, c.continuations
        prefixes = [batch.tokenizer.decode(batch.completion_ids[i, : int(keep[i])], skip_special_tokens=True)
                    for i in range(n)]
        texts = [prefixes[i] + probes.texts[i][0][j] for i in range(n) for j in range(m)]
        scores = batch.score_texts([i for i in range(n) for _ in range(m)], texts).reshape(n, m, -1)  # (N, M, K)
        if c.include_original:
            scores = torch.cat([batch.rewards.unsqueeze(1).to(scores), scores], dim=1)
        accumulated = scores.nanmean(dim=1)  # NaN only where every continuation returned None
        # a column no continuation could score keeps the rollout's own reward (NaN only where that is NaN too)
        accumulated = torch.where(torch.isnan(accumulated), batch.rewards.to(accumulated), accumulated)
        self.log_metric(batch, "rho", rho)
        self.log_metric(batch, "continuation_reward", float(accumulated.nan_to_num(0.0).mean()))
        return {name: accumulated[:, k] for k, name in enumerate(batch.reward_names)}

    @hookimpl
    def loss_weights(self, loss: LossInputs) -> LossWeights:
        rho = self.rho(loss.batch.step)  # the generation step: the prefix shape_rewards scored (steps_per_generation > 1)
        token = prefix_mask(loss.mask, rho)
        self.log_metric(loss.batch, "rho", rho)
        self.log_metric(loss.batch, "retained_fraction", float(token.sum() / loss.mask.sum().clamp(min=1.0)))
        return LossWeights(token=token)

