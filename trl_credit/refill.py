"""Refill (DAPO dynamic sampling): more generation rounds until a batch holds its quota of kept groups.

A filter that declares ``refill()`` (a `trl_credit.Refill`) asks for it. After round 0 (TRL's own
batch) the host draws further generation batches from `RefillStream`, a seeded uniform prompt
stream apart from the training sampler, until the kept groups reach the quota (the groups of one
generation batch), ``max_rounds`` extra rounds have run, or the extra generated tokens reached
``max_tokens`` (no new round starts past the budget). `assemble` then keeps the first ``quota``
kept groups over all rounds (topped up with dropped groups, masked out, when too few were kept).
"""

from __future__ import annotations

from typing import Any

import torch
from trl.trainer.utils import RepeatSampler

from trl_credit.batch import RolloutBatch
from trl_credit.distributed import gather_padded, pad_to

__all__ = ["RIGHT_PADDED", "RefillStream", "assemble", "refill_choice"]

RIGHT_PADDED = {  # per-row outputs of _generate_and_score_completions and their padding value
    "completion_mask": 0,
    "old_per_token_logps": 0.0,
    "ref_per_token_logps": 0.0,
    "sampling_per_token_logps": 0.0,
    "importance_sampling_ratio": 0.0,
    "tool_mask": 1,
}
SEED_OFFSET = 7919  # the refill stream's seed is the run's seed plus this


class RefillStream:
    """The next local generation batch from a separate, seeded, uniform prompt stream.

    ``batches_drawn`` counts the generation batches taken so far; it is saved with checkpoints and
    `fast_forward` skips that many on resume, so a resumed run draws the same refill prompts.
    """

    def __init__(self, trainer: Any):
        self.trainer = trainer
        self.batches_drawn = 0
        self._loader = None
        self._iter = None

    def _make_loader(self):
        t = self.trainer
        return t._get_dataloader(
            dataset=t.train_dataset,
            description="Refill",
            batch_size=t._train_batch_size * t.args.steps_per_generation,
            sampler_fn=lambda ds: RepeatSampler(
                ds,
                mini_repeat_count=t.num_generations,
                batch_size=t.args.generation_batch_size // t.num_generations,
                repeat_count=1,
                shuffle=True,
                seed=t.args.seed + SEED_OFFSET,
            ),
            is_training=True,
            dataloader_key="trl_credit_refill",
        )

    def _next(self) -> list[dict[str, Any]]:
        if self._iter is None:
            self._loader = self._make_loader()
            self._iter = iter(self._loader)
        try:
            return next(self._iter)
        except StopIteration:
            self._iter = iter(self._loader)
            return next(self._iter)

    def next(self) -> list[dict[str, Any]]:
        inputs = self._next()
        self.batches_drawn += 1
        return inputs

    def fast_forward(self, batches: int) -> None:
        """Skip ``batches`` generation batches (those drawn before the checkpoint)."""
        for _ in range(batches):
            self._next()
        self.batches_drawn = batches


def refill_choice(batches: list[RolloutBatch], quota: int) -> list[tuple[int, int]]:
    """``(round, group)`` of the first ``quota`` kept groups over all rounds (topped up with dropped ones)."""
    group_kept = [b.grouped(b.kept).all(dim=1) for b in batches]
    chosen = [(r, gi) for r, k in enumerate(group_kept) for gi in k.nonzero().squeeze(1).tolist()][:quota]
    if len(chosen) < quota:  # not enough kept groups: fill with dropped ones (masked out)
        dropped = [(r, gi) for r, k in enumerate(group_kept) for gi in (~k).nonzero().squeeze(1).tolist()]
        chosen += dropped[: quota - len(chosen)]
    return sorted(chosen)


def assemble(trainer: Any, rounds: list[tuple[dict[str, Any], RolloutBatch]], chosen: list[tuple[int, int]]
             ) -> tuple[dict[str, Any], RolloutBatch]:
    """The ``chosen`` ``(round, group)`` groups of ``rounds`` as one output and batch, re-sliced per rank.

    Refill chooses with `refill_choice`; extra generation (`trl_credit.augment`) keeps a round's groups
    and adds (or swaps in) its augmented ones. ``len(chosen)`` must be a multiple of the process count.
    """
    acc = trainer.accelerator
    pad_id = trainer._tokenizer.pad_token_id
    g = trainer.num_generations
    per_row = ["prompt_ids", "prompt_mask", "completion_ids", *RIGHT_PADDED]
    unknown = [k for k, v in rounds[0][0].items()
               if isinstance(v, torch.Tensor) and v.dim() > 0 and k not in per_row and k != "advantages"]
    if unknown:
        raise NotImplementedError(f"refill does not support these inputs yet: {unknown}")

    def pad_value(key: str) -> float:
        return pad_id if key in ("prompt_ids", "completion_ids") else RIGHT_PADDED.get(key, 0)

    gathered = [{key: gather_padded(acc, output[key], pad_value(key), left=key.startswith("prompt"))
                 for key in per_row if output.get(key) is not None} for output, _ in rounds]
    for key in dict.fromkeys(k for c in gathered for k in c):  # a key only some rounds have
        missing = [r for r, c in enumerate(gathered) if key not in c]
        if missing and key != "tool_mask":
            raise NotImplementedError(f"refill: generation round(s) {missing} returned no {key!r} while others did; "
                                      "every round must return the same outputs")
        for r in missing:  # no tool or environment tokens in that round: every token is the model's
            gathered[r][key] = torch.ones_like(gathered[r]["completion_mask"])
    batches = [b for _, b in rounds]
    merged: dict[str, torch.Tensor] = {}
    for key in gathered[0]:
        left = key.startswith("prompt")
        width = max(c[key].shape[1] for c in gathered)
        parts = [pad_to(c[key], width, pad_value(key), left) for c in gathered]
        merged[key] = torch.cat([parts[r][gi * g:(gi + 1) * g] for r, gi in chosen])
    rows_by_round = [[gi * g + j for (r2, gi) in chosen if r2 == r for j in range(g)] for r in range(len(rounds))]
    views = [b.select(torch.tensor(rows, dtype=torch.long, device=b.device))
             for b, rows in zip(batches, rows_by_round) if rows]
    local_n = len(chosen) * g // acc.num_processes
    rank = acc.process_index
    local = slice(rank * local_n, (rank + 1) * local_n)
    output = dict(rounds[0][0])
    for key, value in merged.items():
        output[key] = value[local]
    used = output["prompt_mask"].any(dim=0)  # trim the left padding every local prompt shares
    first = int(used.float().argmax()) if used.any() else 0
    output["prompt_ids"], output["prompt_mask"] = output["prompt_ids"][:, first:], output["prompt_mask"][:, first:]
    from trl_credit.trainer import TrainerScorer

    combined = RolloutBatch.concat(views, merged["completion_ids"], merged["completion_mask"],
                                   scorer=TrainerScorer(trainer, output))
    return output, combined
