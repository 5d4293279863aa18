"""Tensors across processes: the host gathers per-rank rows into the batch every rank sees."""

from __future__ import annotations

import torch
from accelerate.utils import gather

__all__ = ["gather_padded", "pad_to"]


def pad_to(x: torch.Tensor, width: int, value: float, left: bool) -> torch.Tensor:
    """Pad dim 1 of ``x`` to ``width`` with ``value`` (on the left for prompts)."""
    if x.dim() < 2 or x.shape[1] >= width:
        return x
    pad = x.new_full((x.shape[0], width - x.shape[1], *x.shape[2:]), value)
    return torch.cat([pad, x] if left else [x, pad], dim=1)


def gather_padded(accelerator, x: torch.Tensor, value: float, left: bool = False) -> torch.Tensor:
    """Gather ``(n, T_rank, ...)`` tensors from every rank, padding dim 1 to the widest."""
    if accelerator.num_processes == 1:
        return x
    x = accelerator.pad_across_processes(x, dim=1, pad_index=value, pad_first=left)
    return gather(x)
