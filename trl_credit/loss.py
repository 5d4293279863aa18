"""What a loss plugin sees of one micro-batch, and what it may give back.

The host wraps TRL's ``compute_loss`` (never copies it). Per micro-batch, on every process:

1. ``loss_weights`` plugins see a `LossInputs` without the new log-probs and may return a
   `LossWeights`: per-token weights (multiplied into TRL's loss mask, as ``tool_mask`` is) and
   per-sample clip bounds (used in place of ``epsilon`` / ``epsilon_high``).
2. TRL computes its loss for the run's ``loss_type``.
3. ``loss_terms`` plugins see the same `LossInputs` with ``logps`` (with gradient) and
   ``entropies`` from TRL's own forward pass (no second pass), and return named scalar terms that are
   added to TRL's loss (scaled for gradient accumulation as TRL scales its own) and logged.

Rows are this process's rows of the micro-batch, in TRL's (shuffled) order; ``rows`` maps each one
to its row of ``batch``, the generation batch the rollout hooks saw, so a plugin reads rewards,
groups or its own statistics there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from trl_credit.batch import RolloutBatch

__all__ = ["CLIPPED_LOSSES", "LossInputs", "LossWeights", "aggregate"]

#: Loss types whose surrogate uses TRL's clip bounds (cispo only the upper one); sapo and vespo have none.
CLIPPED_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo")


@dataclass
class LossWeights:
    """What a ``loss_weights`` plugin returns; every field may be None (no change).

    ``token``: ``(B, T)`` non-negative weights. They multiply the token's loss mask, exactly as
    TRL's ``tool_mask`` does: the token's policy term, KL term and entropy bonus are scaled, and so
    is its share of the normaliser where TRL's normaliser counts mask tokens (``grpo``, ``sapo``:
    per-sequence mean; ``bnpo``: batch token mean). Under ``dapo``, ``cispo``, ``vespo``, ``dr_grpo``
    and ``luspo`` the normaliser is fixed, so the loss is the weighted sum. Weight 0 removes a token.
    ``epsilon_low`` / ``epsilon_high``: ``(B,)`` per-sample clip bounds, ``1 - eps_low <= ratio <=
    1 + eps_high`` (``cispo``: ``ratio <= eps_high``), for the loss types in `CLIPPED_LOSSES`.
    """

    token: torch.Tensor | None = None
    epsilon_low: torch.Tensor | None = None
    epsilon_high: torch.Tensor | None = None


@dataclass
class LossInputs:
    """One micro-batch of TRL's loss (this process's rows), read-only.

    Shapes: ``B`` rows, ``T`` completion width. ``mask`` is the float loss mask TRL uses
    (``completion_mask``, times ``tool_mask`` where the rollout has one), before plugin weights.
    ``old_logps`` is None when TRL trains on-policy without storing them (they equal ``logps``
    detached). ``logps`` and ``entropies`` are None in ``loss_weights`` and come from TRL's own
    forward pass in ``loss_terms`` (``logps`` carries the gradient).
    """

    batch: RolloutBatch
    rows: torch.Tensor
    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    old_logps: torch.Tensor | None
    ref_logps: torch.Tensor | None
    loss_type: str
    epsilon_low: float
    epsilon_high: float
    beta: float
    max_completion_length: int
    num_items: torch.Tensor | None  # TRL's token normaliser of dapo/cispo/vespo for this micro-batch
    step: int
    logps: torch.Tensor | None = None
    entropies: torch.Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def sequence_advantages(self) -> torch.Tensor:
        """``(B,)`` advantages (the first token's where they are per token)."""
        return self.advantages if self.advantages.dim() == 1 else self.advantages[:, 0]

    def aggregate(self, per_token: torch.Tensor) -> torch.Tensor:
        """Reduce a ``(B, T)`` (or ``(B, 1)``) per-token quantity the way this run's ``loss_type`` reduces
        its per-token loss (before the gradient-accumulation scaling the host adds). See `aggregate`."""
        return aggregate(per_token, self.mask, self.loss_type, self.max_completion_length, self.num_items)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str, max_completion_length: int,
              num_items: torch.Tensor | None = None) -> torch.Tensor:
    """TRL 1.16's reduction of a per-token loss, per ``loss_type`` (pinned against TRL by a test).

    ``grpo``/``sapo``: mean over rows of the masked per-row token mean; ``bnpo``: masked token mean
    over the micro-batch; ``dr_grpo``: masked sum / (rows x ``max_completion_length``); ``dapo``,
    ``cispo``, ``vespo``: masked sum / ``num_items`` (TRL's normaliser for one micro-batch);
    ``luspo``: mean over rows of the masked per-row sum.
    """
    masked = per_token * mask
    if loss_type in ("grpo", "sapo"):
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return masked.sum() / (per_token.size(0) * max_completion_length)
    if loss_type in ("dapo", "cispo", "vespo"):
        if num_items is None:
            raise ValueError(f"aggregate: loss_type {loss_type} needs num_items")
        return masked.sum() / num_items
    if loss_type == "luspo":
        return masked.sum(-1).mean()
    raise ValueError(f"aggregate: unknown loss_type {loss_type!r}")
