r"""Fatal-aware masking with a one-sided advantage clamp (OpenSearch-VL's multi-turn fatal-aware GRPO).

Method. In a multi-turn tool-using rollout a tool failure can cascade: once a call fails, what the model writes
next is conditioned on a broken interaction, and the outcome reward mostly reflects the failure. Fatal-aware GRPO
keeps such a trajectory but (1) masks its post-failure tokens out of the loss and (2) clamps the advantage of the
kept pre-failure tokens one-sidedly, so useful reasoning before the failure is not punished for it.

Formula (completion ``i``, ``failures_ik`` TRL's failed tool calls of model turn ``k``, ``m = min_failures``)::

    fatal_i = the first turn of the first run of >= m consecutive turns with failures_ik > 0 (none: no change)
    b_i     = start of turn fatal_i                         mask_from: failing_turn (default)
            = just past the last token of turn fatal_i      mask_from: after_failing_turn
    masked_it = t >= b_i                                    (within the completion)
    A_it  <- 0                                   where masked_it
    A_it  <- max(A_it, 0) | min(A_it, 0) | A_it  on t < b_i  (clamp: nonneg (default) | nonpos | none)
    loss weight w_it = 0 where masked_it, else c    (TRL's loss mask times w: masked tokens do not train)
    c = N_loss / N_kept under dapo / cispo (their normaliser counts the batch's loss tokens before the loss hooks
        run; c makes it count the kept ones only), else 1 (grpo, sapo, bnpo: a weight 0 already leaves the
        normaliser; dr_grpo, luspo: no token count in it)
    a completion with no kept model token (fatal in its first turn, failing_turn) is dropped (``drop_empty``):
        the host then leaves it out of the loss and of every normaliser; it still counts in its group's baseline

Source: the abstract of OpenSearch-VL (``papers/000``: "a multi-turn fatal-aware GRPO training algorithm that
handles cascading tool failures by masking post-failure tokens while preserving useful pre-failure reasoning
through one-sided advantage clamping") and methods.md 2.22 **[abstract-inferred]** (test: T = 6, failure call at
t = 3, A = -0.8 -> ``[0, 0, 0, masked x 3]`` under ``max(A, 0)``). No code read (the release was announced).

Established (abstract): post-failure tokens masked, pre-failure tokens kept, a one-sided clamp on their advantage,
for cascading tool failures. Chosen (methods.md: not established): the clamp side ``max(A, 0)`` (pre-failure
reasoning is not punished; ``nonpos`` and ``none`` offered); masking starts at the failing turn (the methods.md
vector masks from the failure call, so the call is neither reinforced nor punished; ``after_failing_turn`` keeps
the calling turn); "cascading" = the first failing turn (``min_failures: 1``), or the first of ``m`` consecutive
failing turns; failures are TRL's failed tool calls per turn (`Turns.failures`), so the turn is the unit (no
token position inside a turn is known); masked tokens also leave the normaliser (``renormalise``, ``drop_empty``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from trl_credit import LossWeights, Plugin, hookimpl

if TYPE_CHECKING:
    import torch

    from trl_credit import LossInputs, RolloutBatch, Turns

__all__ = ["FatalAware", "clamp_prefix", "fatal_turn", "post_failure_mask"]

#: Loss types whose normaliser is the generation batch's loss-token count, fixed before the loss hooks run.
COUNTED_NORMALISER = ("dapo", "cispo")


def fatal_turn(failures: torch.Tensor, min_failures: int = 1) -> torch.Tensor:
    """``(N,)`` long: the first turn of the first run of ``>= min_failures`` consecutive failing turns, -1 if none.

    ``failures`` ``(N, K)``: failed tool calls per model turn (``Turns.failures``); a turn fails when it has one.
    """
    import torch

    n, k = failures.shape
    if k == 0:
        return torch.full((n,), -1, dtype=torch.long, device=failures.device)
    fail = failures > 0
    column = torch.arange(k, device=failures.device).expand(n, k)
    last_ok = torch.where(fail, -1, column).cummax(dim=1).values  # last non-failing turn up to k
    run = torch.where(fail, column - last_ok, 0)  # length of the failing run ending at turn k
    hit = run >= min_failures
    first = hit.to(torch.long).argmax(dim=1)
    start = last_ok.gather(1, first.unsqueeze(1)).squeeze(1) + 1  # where that run began
    return torch.where(hit.any(dim=1), start, -1)


def post_failure_mask(turns: Turns, completion_mask: torch.Tensor, fatal: torch.Tensor,
                      mask_from: str = "failing_turn") -> torch.Tensor:
    """``(N, T)`` bool: the completion tokens from the fatal failure on (``mask_from``), False in rows without one."""
    import torch

    index = turns.index.to(fatal.device)
    n, width = index.shape
    position = torch.arange(width, device=index.device).expand(n, width)
    has = fatal >= 0
    inside = (index == fatal.unsqueeze(1)) & has.unsqueeze(1)  # the tokens of the fatal turn
    if mask_from == "failing_turn":
        boundary = torch.where(inside, position, width).min(dim=1).values  # its first token
    else:
        boundary = torch.where(inside, position + 1, -1).max(dim=1).values  # just past its last token
    boundary = torch.where(has, boundary, width)
    return (position >= boundary.unsqueeze(1)) & completion_mask.to(index.device).bool()


def clamp_prefix(advantages: torch.Tensor, masked: torch.Tensor, fatal: torch.Tensor,
                 clamp: str = "nonneg") -> torch.Tensor:
    """``(N, T)``: 0 where ``masked``; in the rows with a fatal failure (``fatal`` ``(N,)`` bool), the kept tokens'
    advantages clamped one-sidedly (``nonneg``: ``max(A, 0)``, ``nonpos``: ``min(A, 0)``, ``none``: as they are);
    other rows unchanged."""
    import torch

    a = advantages.to(torch.float32)
    a = a.unsqueeze(1).expand(masked.shape) if a.dim() == 1 else a[:, : masked.shape[1]]
    failed = fatal.to(a.device).unsqueeze(1)
    if clamp == "nonneg":
        a = torch.where(failed, a.clamp(min=0.0), a)
    elif clamp == "nonpos":
        a = torch.where(failed, a.clamp(max=0.0), a)
    return torch.where(masked, 0.0, a)


class FatalAware(Plugin):
    """Fatal-aware GRPO: after a cascading tool failure the tokens leave the loss (weight 0, advantage 0) and the
    kept prefix's advantage is clamped one-sidedly (A <- max(A, 0))."""

    name = "fatal_aware"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        clamp: Literal["nonneg", "nonpos", "none"] = Field(
            "nonneg", description="one-sided clamp of the kept prefix's advantage in a trajectory with a fatal "
            "failure: max(A, 0) (nonneg: pre-failure reasoning is not punished), min(A, 0) (nonpos), or none")
        mask_from: Literal["failing_turn", "after_failing_turn"] = Field(
            "failing_turn", description="where masking starts: at the fatal failing turn (its call included: "
            "methods.md's vector) or after it (the calling turn kept, the tool's reply and later turns masked)")
        min_failures: int = Field(1, ge=1, description="consecutive failing turns before a failure counts as fatal "
                                  "(1: the first failing turn); masking starts at the first turn of that run")
        renormalise: bool = Field(True, description="under loss_type dapo / cispo, scale the kept tokens' loss "
                                  "weights by N_loss / N_kept so that masked tokens leave TRL's token-count "
                                  "normaliser (other loss types need no scaling)")
        drop_empty: bool = Field(True, description="drop completions with no kept model token (fatal in their "
                                 "first turn) through the host's filter: out of the loss and every normaliser")

    def _masked(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(masked (N, T), fatal (N,))`` for the whole generation batch (cheap: the turns are cached)."""
        turns = batch.turns()
        fatal = fatal_turn(turns.failures, self.config.min_failures)
        return post_failure_mask(turns, batch.completion_mask, fatal, self.config.mask_from), fatal

    @hookimpl
    def filter_rollouts(self, batch: RolloutBatch) -> torch.Tensor | None:
        if not self.config.drop_empty:
            return None
        masked, fatal = self._masked(batch)
        model = batch.turns().model.to(masked.device)
        empty = (fatal >= 0) & ~(model & ~masked).any(dim=1)
        self.log_metric(batch, "dropped", float(empty.float().mean()) if empty.numel() else 0.0)
        return ~empty if empty.any() else None

    @hookimpl
    def transform_advantages(self, batch: RolloutBatch, advantages: torch.Tensor) -> torch.Tensor | None:
        masked, fatal = self._masked(batch)
        masked = masked.to(advantages.device)
        kept = batch.kept.to(advantages.device)
        model = batch.turns().model.to(advantages.device) & kept.unsqueeze(1)
        fatal_rows = (fatal.to(advantages.device) >= 0) & kept
        self.log_metric(batch, "fatal_fraction", float(fatal_rows.float().mean()) if kept.numel() else 0.0)
        self.log_metric(batch, "masked_token_fraction", float((masked & model).sum() / model.sum().clamp(min=1)))
        if not fatal_rows.any():
            return None
        out = clamp_prefix(advantages, masked, fatal_rows, self.config.clamp)
        before = advantages.unsqueeze(1).expand(out.shape) if advantages.dim() == 1 else advantages[:, : out.shape[1]]
        changed = (out != before) & ~masked & model
        self.log_metric(batch, "clamped_token_fraction", float(changed.sum() / model.sum().clamp(min=1)))
        return out

    @hookimpl
    def loss_weights(self, loss: LossInputs) -> LossWeights | None:
        import torch

        batch = loss.batch
        masked, _ = self._masked(batch)
        masked = masked & batch.kept.to(masked.device).unsqueeze(1)  # dropped rows are out of the loss already
        if not masked.any():
            return None
        scale = 1.0
        if self.config.renormalise and loss.loss_type in COUNTED_NORMALISER:
            counted = batch.completion_mask.to(masked.device).bool() & batch.kept.to(masked.device).unsqueeze(1)
            if batch.tool_mask is not None:
                counted = counted & batch.tool_mask.to(masked.device).bool()
            total, kept = counted.sum(), (counted & ~masked).sum()
            scale = float(total) / float(kept) if int(kept) > 0 else 1.0
        rows = loss.rows.to(masked.device)
        width = loss.mask.shape[1]
        own = masked[rows][:, :width]
        if own.shape[1] < width:
            own = torch.nn.functional.pad(own, (0, width - own.shape[1]))
        token = torch.where(own, 0.0, scale).to(device=loss.mask.device, dtype=loss.mask.dtype)
        self.log_metric(batch, "normaliser_scale", scale)
        return LossWeights(token=token)
