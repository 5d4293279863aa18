"""Negative-only GRPO ("relative negative gradients"), with a GRPO-to-negative-only schedule.

Method. GRPO pushes completions above their group's mean up and those below it down. The paper
describes a two-stage dynamic: in an exploitation stage positive advantages raise tokens that are
already likely (over-exploitation shrinks the capability boundary), in a later exploration stage an
occasionally sampled better token gains mass. It proposes prolonging training with the relative
*negative* gradients only: compute the usual group-relative advantage and keep the negative part.

Formula, exactly as the code runs it (elementwise, for ``(N,)`` or ``(N, T)`` advantages)::

    lambda(step) = positive_weight                                          schedule: constant (default)
                 = 1 if step < start_step else positive_weight              schedule: switch
                 = 1 + (positive_weight - 1) * clamp((step - start_step) / (end_step - start_step), 0, 1)
                                                                            schedule: linear
    mode: advantage (default)   A_i <- A_i if A_i < 0 else lambda(step) * A_i
                                (lambda = 0: A_i <- min(A_i, 0), methods.md 2.5)
    mode: loss                  token weight w_it = 1 if A_it < 0 else lambda(step)
                                (multiplies TRL's loss mask: policy term, KL term, and under
                                grpo/sapo/bnpo the token's share of the normaliser)

``step`` is ``batch.step`` (the optimiser step the generation batch was drawn for) in ``advantage``
mode and ``loss.step`` (the current optimiser step) in ``loss`` mode.

Source: "The Debate on RLVR Reasoning Capability Boundary: Shrinkage, Expansion, or Both? A
Two-Stage Dynamic View" (abstract only, ``papers/004``); methods.md section 2.5
**[abstract-inferred]**: ``A_i <- min(A_i, 0)``. No official code found.

Established: keep only negative-advantage gradients to prolong training; a schedule (GRPO first,
negative-only later) is implied by the two-stage view but not specified. CHOSEN here: the default
is methods.md's formula (``mode: advantage``, ``schedule: constant``, ``positive_weight: 0``:
negative-only from the first step); ``switch`` and ``linear`` schedules (no switch point is given:
``start_step`` / ``end_step`` are the user's); ``positive_weight`` between 0 and 1 keeps a damped
positive signal; ``mode: loss`` removes the positive samples from the loss instead (see the README
for how the two forms differ). Zero advantages are "not negative": they are scaled like positive
ones (a no-op in ``advantage`` mode; in ``loss`` mode their tokens, which carry no policy gradient,
lose their KL term and normaliser share too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trl_credit import ConfigError, LossWeights, Plugin, RunInfo, hookimpl

if TYPE_CHECKING:
    import torch

    from trl_credit import LossInputs, RolloutBatch

__all__ = ["NegativeOnly", "negative_only"]


def negative_only(advantages: torch.Tensor, lam: float) -> torch.Tensor:
    """``A if A < 0 else lam * A``, elementwise (``lam = 0``: ``min(A, 0)``)."""
    import torch

    return torch.where(advantages < 0, advantages, lam * advantages)


class NegativeOnly(Plugin):
    """Negative-only GRPO: A <- A if A < 0 else lambda(step) * A (or token weight lambda for A >= 0)."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        mode: Literal["advantage", "loss"] = Field(
            "advantage",
            description="advantage: scale the non-negative advantages by lambda (methods.md: A <- min(A, 0)); "
            "loss: weight the tokens with A >= 0 by lambda in TRL's loss (also their KL term and normaliser share)",
        )
        schedule: Literal["constant", "switch", "linear"] = Field(
            "constant",
            description="lambda(step): constant = positive_weight; switch = 1 before start_step, then "
            "positive_weight (GRPO first, negative-only later); linear = 1 until start_step, then linearly to "
            "positive_weight at end_step",
        )
        positive_weight: float = Field(
            0.0, ge=0.0,
            description="lambda once the schedule has moved on: 0 = pure negative-only, 1 = plain GRPO",
        )
        start_step: int = Field(0, ge=0, description="switch/linear: optimiser step where lambda starts to leave 1")
        end_step: int | None = Field(
            None, ge=0, description="linear: optimiser step where lambda reaches positive_weight (> start_step)")

        @model_validator(mode="after")
        def _schedule(self):
            if self.schedule == "linear" and (self.end_step is None or self.end_step <= self.start_step):
                raise ValueError(f"schedule 'linear' needs end_step > start_step (got start_step={self.start_step}, "
                                 f"end_step={self.end_step})")
            return self

    def disabled_hooks(self) -> list[str]:
        return ["loss_weights"] if self.config.mode == "advantage" else ["transform_advantages"]

    def positive_scale(self, step: int) -> float:
        """lambda(step): the factor of non-negative advantages (or the weight of their tokens) at ``step``."""
        cfg = self.config
        if cfg.schedule == "constant":
            return cfg.positive_weight
        if cfg.schedule == "switch":
            return 1.0 if step < cfg.start_step else cfg.positive_weight
        progress = min(max((step - cfg.start_step) / (cfg.end_step - cfg.start_step), 0.0), 1.0)
        return 1.0 + (cfg.positive_weight - 1.0) * progress

    def check_args(self, run: RunInfo) -> None:
        """Refuse a schedule that never acts and loss-mode weights that TRL's per-sequence normaliser cancels."""
        cfg = self.config
        max_steps = getattr(run.args, "max_steps", -1) or -1
        if cfg.schedule != "constant" and 0 < max_steps <= cfg.start_step:
            raise ConfigError.for_key(
                "start_step", f"schedule {cfg.schedule!r} leaves plain GRPO only at step {cfg.start_step}, but the "
                f"run stops at max_steps={max_steps}, so the plugin never acts",
                f"set `start_step` below {max_steps} (or `schedule: constant`)")
        loss_type = getattr(run.args, "loss_type", None)
        damped = cfg.schedule == "linear" or 0.0 < cfg.positive_weight < 1.0
        if cfg.mode == "loss" and loss_type in ("grpo", "sapo") and damped:
            raise ConfigError.for_key(
                "mode", f"under loss_type {loss_type!r} each sequence's loss is divided by its own weighted token "
                f"count, so a weight 0 < lambda < 1 on a whole positive sequence cancels out (mode 'loss' with "
                f"positive_weight={cfg.positive_weight}, schedule {cfg.schedule!r})",
                "use `mode: advantage`, or `positive_weight: 0` with a constant or switch schedule")

    @hookimpl
    def transform_advantages(self, batch: RolloutBatch, advantages: torch.Tensor) -> torch.Tensor | None:
        lam = self.positive_scale(batch.step)
        self.log_metric(batch, "positive_weight", lam)
        if lam == 1.0:
            return None                                   # plain GRPO at this step
        kept = batch.kept if advantages.dim() == 1 else batch.kept.unsqueeze(1) & batch.completion_mask.bool()
        positive = (advantages > 0) & kept
        self.log_metric(batch, "positive_fraction", (positive.sum() / kept.sum().clamp(min=1)).item())
        return negative_only(advantages, lam)

    @hookimpl
    def loss_weights(self, loss: LossInputs) -> LossWeights | None:
        import torch

        lam = self.positive_scale(loss.step)
        self.log_metric(loss.batch, "positive_weight", lam)
        if lam == 1.0:
            return None                                   # plain GRPO at this step
        a = loss.advantages if loss.advantages.dim() == 2 else loss.advantages.unsqueeze(1)
        down = (a >= 0).expand_as(loss.mask)              # tokens that carry no negative gradient
        token = torch.where(down, lam, 1.0).to(loss.mask)
        share = (loss.mask * down).sum() / loss.mask.sum().clamp(min=1.0)
        self.log_metric(loss.batch, "weighted_fraction", share.item())
        return LossWeights(token=token)
