"""`CurriculumSampler`: TRL's RepeatSampler layout with prompts drawn from curriculum weights.

Each generation batch asks ``weights_fn`` for the current per-prompt weights (the product of the
enabled ``prompt_weights`` hooks over host-tracked `PromptStats`) and draws ``prompts_per_batch``
distinct prompts from them. The generator is seeded with ``(seed, batch number)``, and the
statistics are gathered, so every process draws the same prompts; accelerate then hands each
process its slice as it does for TRL's sampler.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch.utils.data import Sampler


class CurriculumSampler(Sampler[int]):
    def __init__(
        self,
        num_prompts: int,
        prompts_per_batch: int,
        mini_repeat_count: int,
        repeat_count: int,
        seed: int,
        weights_fn: Callable[[], torch.Tensor | None],
    ):
        if prompts_per_batch > num_prompts:
            raise ValueError(
                f"a generation batch needs {prompts_per_batch} distinct prompts but the dataset has {num_prompts}"
            )
        self.num_prompts = num_prompts
        self.prompts_per_batch = prompts_per_batch
        self.mini_repeat_count = mini_repeat_count
        self.repeat_count = repeat_count
        self.seed = seed
        self.weights_fn = weights_fn
        self.batches_drawn = 0  # across epochs: every generation batch gets its own seed

    def __len__(self) -> int:
        batches = self.num_prompts // self.prompts_per_batch
        return batches * self.prompts_per_batch * self.mini_repeat_count * self.repeat_count

    def draw(self) -> list[int]:
        """The prompts of the next generation batch."""
        weights = self.weights_fn()
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.batches_drawn)
        self.batches_drawn += 1
        if weights is None:
            chosen = torch.randperm(self.num_prompts, generator=generator)[: self.prompts_per_batch]
        else:
            weights = weights.to(torch.float64)
            positive = weights > 0
            if int(positive.sum()) < self.prompts_per_batch:  # too few weighted prompts: the rest uniformly
                weights = torch.where(positive, weights, weights[positive].min() * 1e-6 if positive.any() else 1.0)
            chosen = torch.multinomial(weights, self.prompts_per_batch, replacement=False, generator=generator)
        return chosen.tolist()

    def __iter__(self) -> Iterator[int]:
        for _ in range(self.num_prompts // self.prompts_per_batch):
            prompts = self.draw()
            for _ in range(self.repeat_count):
                for index in prompts:
                    for _ in range(self.mini_repeat_count):
                        yield index
