"""S-GRPO: serial-group decaying-reward policy optimisation (early exit from the chain of thought).

Method. GRPO's group is parallel: G independent reasoning paths. S-GRPO adds a *serial* group: one reasoning
path cut at G positions from front to back; at each cut an end-of-thinking cue is inserted and the answer is
generated directly. Correct answers earn less the later they exit, so the policy learns when its reasoning is
already sufficient and stops there (shorter chains, same or better accuracy).

Formula (the serial group of completion ``y`` of group ``g``: exits ``e_1 <= ... <= e_G``, the last at the end of
``y``; answer ``a_j`` generated after ``prompt + y[:e_j] + cue``; ``c_j`` = 1 if ``a_j``'s reward passes
``threshold``)::

    uniform exits:  e_j = floor(j * L / G + 1/2)      (random: G - 1 sorted draws in 1..L-1, then L)
    decay "correct_rank" (methods.md 2.31, the paper as recalled):
                    r_j = c_j / 2^(n_j - 1),   n_j = c_1 + ... + c_j   (the rank of a correct exit)
    decay "position" (a third-party re-implementation):
                    r_j = c_j / 2^(j - 1)
    A_j = r_j - mean_j r                              (no std), on every token of the exit's answer
    an exit no reward function scored (NaN) has c_j = 0, stays out of the mean and gets A_j = 0 (as TRL gives it)

Exits repeat when the path is shorter than G tokens (uniform) or when random draws coincide; repeated exits are
separate samples of the answer at the same cut.

The serial group is generated through TRL's own path (`trl_credit.Augmentation` with one prompt per exit,
`RolloutBatch.prefix_prompt`: the rendered prompt, the decoded prefix, the cue) and scored by the run's reward
functions; it is added to the batch as a group of its own (``trl_credit_augmented`` = ``s_grpo``). The parallel
groups keep their GRPO advantages. Trained tokens: each exit's answer (the prefix and the cue are its prompt).

Source: the abstract of "S-GRPO: Early Exit via Reinforcement Learning in Reasoning Models" (``papers/000``:
one sampled path, serial exits, rewards that decrease from front to back for correct answers) and methods.md
2.31 (the decaying reward as recalled from the paper, its test vector, the cue, the third-party positional
decay, ``A = r - mean(r)``). Chosen: the first completion of each group as the serial path (a random sample);
uniform exits by default; the loss trains the exit answers only (methods.md leaves "answer tokens and the
shared prefix" unverified: training the prefix would need the prefix inside the completion, not its prompt).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from trl_credit import Augmentation, Plugin, hookimpl

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch

__all__ = ["CONTEXT", "SGRPO", "exit_positions", "serial_advantages", "serial_rewards"]

CONTEXT = "s_grpo"  # the augmented column value of the serial groups
CUE = "Time is limited, stop thinking and start answering.\n</think>\n"


def exit_positions(length: int, g: int, mode: str = "uniform", generator: torch.Generator | None = None) -> list[int]:
    """``G`` exit points in ``1..length``, non-decreasing, the last one ``length`` (the full path)."""
    import torch

    if mode == "uniform" or length <= 1:
        return [max(1, int(j * length / g + 0.5)) for j in range(1, g + 1)]
    cuts = torch.randint(1, length, (g - 1,), generator=generator).sort().values.tolist()
    return [*cuts, length]


def serial_rewards(correct: torch.Tensor, decay: str = "correct_rank") -> torch.Tensor:
    """``(S, G)`` decayed rewards of serial groups ordered from the earliest exit (``correct`` 0/1)."""
    import torch

    c = correct.float()
    if decay == "position":
        rank = torch.arange(c.shape[1], device=c.device).expand_as(c).float()
    else:
        rank = (c.cumsum(1) - 1).clamp(min=0)
    return c / 2.0 ** rank


def serial_advantages(rewards: torch.Tensor, scored: torch.Tensor | None = None) -> torch.Tensor:
    """``r - mean(r)`` per serial group (no std), the mean over the ``scored`` exits only; 0 for the others."""
    import torch

    if scored is None:
        return rewards - rewards.mean(1, keepdim=True)
    m = scored.to(rewards.dtype)
    mean = (rewards * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)
    return torch.where(scored, rewards - mean, 0.0)


class SGRPO(Plugin):
    """S-GRPO: a serial group of early exits per chosen group, with decaying rewards (extra generation)."""

    name = "s_grpo"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        cue: str = Field(CUE, description="text inserted at each exit before the answer is generated")
        exits: Literal["uniform", "random"] = Field("uniform", description="exit points along the path: evenly "
                                                    "spaced, or G - 1 random ones; the last is always the full path")
        decay: Literal["correct_rank", "position"] = Field("correct_rank", description="decay of a correct exit's "
                                                           "reward: by its rank among the correct exits, or by position")
        max_groups: int | None = Field(None, ge=1, description="serial groups per round at most (null: one per "
                                       "group; the host allows as many as the round has groups)")
        reward: str | None = Field(None, description="reward column deciding correctness; null: the total reward")
        threshold: float = Field(0.5, description="an exit is correct when its reward is >= threshold")

    def required_rewards(self):
        return [self.config.reward] if self.config.reward else []

    @hookimpl
    def augment_rollouts(self, batch: RolloutBatch) -> list[Augmentation] | None:
        import torch

        cfg = self.config
        g = batch.num_generations
        eos = getattr(batch.tokenizer, "eos_token_id", None)
        lengths = batch.completion_lengths.tolist()
        generator = torch.Generator().manual_seed(int(getattr(batch.args, "seed", 0) or 0) * 7919 + batch.step)
        requests = []
        for group in range(batch.num_groups):
            row = group * g
            length = lengths[row]
            if length and eos is not None and int(batch.completion_ids[row, length - 1]) == eos:
                length -= 1  # exit before the EOS: the full path ends with its last content token
            if length < 1:
                continue
            ends = exit_positions(length, g, cfg.exits, generator)
            requests.append(Augmentation(group, prompts=[batch.prefix_prompt(row, e, cfg.cue) for e in ends],
                                         context=CONTEXT))
            if cfg.max_groups is not None and len(requests) >= cfg.max_groups:
                break
        return requests or None

    @hookimpl
    def transform_advantages(self, batch: RolloutBatch, advantages: torch.Tensor) -> torch.Tensor | None:
        import torch

        marks = batch.columns.get("trl_credit_augmented") or []
        serial = torch.tensor([m == CONTEXT for m in marks], dtype=torch.bool, device=advantages.device)
        if not serial.any():
            return None
        g = batch.num_generations
        rows = serial.nonzero().squeeze(1).reshape(-1, g)  # whole groups, in exit order
        reward = batch.reward(self.config.reward) if self.config.reward else batch.total_reward()
        exit_reward = reward.to(advantages.device)[rows]
        scored = ~torch.isnan(exit_reward)
        correct = (exit_reward >= self.config.threshold) & scored
        r = serial_rewards(correct, self.config.decay)
        a = serial_advantages(r, scored)
        out = advantages.clone()
        values = a.reshape(-1).to(out.dtype)
        out[rows.reshape(-1)] = values.unsqueeze(1).expand(-1, out.shape[1]) if out.dim() == 2 else values
        self.log_metric(batch, "serial_groups", float(rows.shape[0]))
        self.log_metric(batch, "exit_accuracy", float(correct.float().mean()))
        first = torch.where(correct.any(1), correct.float().argmax(1), g).float()
        self.log_metric(batch, "first_correct_exit", float(first.mean()) + 1.0)  # 1-based; G + 1: none correct
        return out
