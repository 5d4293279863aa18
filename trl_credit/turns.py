"""The turns of a multi-turn completion: the model's spans and the tools' or environment's replies.

TRL's multi-turn paths (``tools``, ``environment_factory``, a ``rollout_func`` returning ``env_mask``)
produce one completion per trajectory in which the tokens the model wrote alternate with tokens
the environment inserted; TRL's ``tool_mask`` is 1 on the model's tokens and 0 on the inserted ones,
and its loss ignores the latter. `Turns` reads that mask: a *turn* is a maximal run of the model's
tokens, numbered from 0 in each completion; a single-turn completion is one turn.

Tool calls and failures per turn come from the parsed messages TRL keeps for each completion (its tool loop
appends one assistant message per model turn and one ``tool`` message per call, whose content is
``str({"error": ...})`` when the call raised or named an unknown tool). Per-turn values an environment
recorded are read by `RolloutBatch.turn_values`.
"""

from __future__ import annotations

from dataclasses import dataclass

import math

import torch
import torch.nn.functional as F

__all__ = ["Turns", "carry_forward", "turn_ends", "turns_of", "tool_events", "values_per_turn"]

#: how TRL's tool loop renders a failed call's result: ``str({"error": str(exception)})``
_ERROR_PREFIX = "{'error': "


@dataclass
class Turns:
    """Turn structure of a batch, all ``(N, T)`` or ``(N,)`` / ``(N, K)`` tensors (``K`` = most turns).

    - ``index``: the model turn each token belongs to, -1 on environment tokens and padding.
    - ``model``, ``env``: bool masks of the model's tokens and of the environment's (within the completion).
    - ``count``: turns per completion; ``replies``: environment replies (runs of inserted tokens) per completion.
    - ``lengths``: ``(N, K)`` tokens of each turn (0 past a completion's last turn).
    - ``calls``, ``failures``: ``(N, K)`` tool calls the model made in each turn and how many of them failed
      (TRL's ``tools`` / ``environment_factory`` paths; 0 on other rollouts). Per completion: ``.sum(1)``.
      ``calls`` counts what the model asked for, so a last turn's calls that got no reply (TRL's tool-call limit,
      or replies it removed as too long) count here but not in TRL's ``tools/call_frequency``.
    """

    index: torch.Tensor
    model: torch.Tensor
    env: torch.Tensor
    count: torch.Tensor
    replies: torch.Tensor
    lengths: torch.Tensor
    calls: torch.Tensor | None = None
    failures: torch.Tensor | None = None

    def __post_init__(self):
        if self.calls is None:
            self.calls = torch.zeros_like(self.lengths)
        if self.failures is None:
            self.failures = torch.zeros_like(self.lengths)

    @property
    def max_turns(self) -> int:
        return self.lengths.shape[1]

    def broadcast(self, values: torch.Tensor) -> torch.Tensor:
        """``(N, K)`` per-turn values -> ``(N, T)`` per-token values on the model's tokens, 0 elsewhere.

        ``K`` may exceed `max_turns`; it may not be smaller. Token advantages on environment tokens would
        be ignored by TRL's loss anyway; they are 0 here so that sums over tokens count turns only.
        """
        if values.dim() != 2 or values.shape[0] != self.index.shape[0] or values.shape[1] < self.max_turns:
            raise ValueError(f"broadcast: values of shape {tuple(values.shape)}, expected ({self.index.shape[0]}, K) "
                             f"with K >= {self.max_turns}")
        if values.shape[1] == 0:
            return torch.zeros(self.index.shape, dtype=values.dtype, device=values.device)
        gathered = values.gather(1, self.index.clamp(min=0).to(values.device))
        return torch.where(self.model.to(values.device), gathered, torch.zeros((), dtype=values.dtype))

    def starts(self) -> torch.Tensor:
        """``(N, K)`` long: the completion-token position where each model turn begins, -1 past a row's turns.

        The prefix "after turn ``k``" including the environment's reply to it is ``completion_ids[i, :starts[i,
        k + 1]]`` (IGPO's and TRACE's turn boundaries; `RolloutBatch.prefix_logps` scores after it).
        """
        n, width = self.index.shape
        first = self.model & ~F.pad(self.model[:, :-1], (1, 0), value=False)
        out = torch.full((n, self.max_turns), -1, dtype=torch.long, device=self.index.device)
        if self.max_turns:
            position = torch.arange(width, device=self.index.device).expand(n, width)
            out.scatter_reduce_(1, self.index.clamp(min=0), torch.where(first, position, -1), reduce="amax")
        return out

    def last_turn(self) -> torch.Tensor:
        """``(N, T)`` bool: the tokens of each completion's last model turn."""
        return self.model & (self.index == (self.count - 1).unsqueeze(1))


def tool_events(completions: list | None, max_turns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(N, K)`` tool calls and failed calls per model turn, from TRL's parsed completion messages.

    The k-th assistant message is the k-th model turn; the ``tool`` messages after it answer its calls.
    A loop over rows and messages (bounded by the batch and the turns), never over tokens.
    """
    n = len(completions or [])
    calls = torch.zeros(n, max_turns, dtype=torch.long)
    failures = torch.zeros(n, max_turns, dtype=torch.long)
    for i, messages in enumerate(completions or []):
        if not isinstance(messages, list):  # a plain-text completion: one turn, no tool calls
            continue
        turn = -1
        for message in messages:
            role = message.get("role") if isinstance(message, dict) else None
            if role == "assistant":
                turn += 1
                if turn < max_turns:
                    calls[i, turn] += len(message.get("tool_calls") or [])
            elif role == "tool" and 0 <= turn < max_turns:
                content = message.get("content")
                failures[i, turn] += int(isinstance(content, str) and content.startswith(_ERROR_PREFIX))
    return calls, failures


def values_per_turn(messages: list, recorded: dict[str, list], tool_names: set[str], owner: str = "environment"
                    ) -> dict[str, list]:
    """An environment's per-call records -> one value (or None) per model turn.

    An ``environment_factory`` environment appends one value to ``self.turn_values[name]`` in each call of
    its tool methods that succeeds. The j-th value belongs to the j-th successful call (a ``tool`` message
    named after one of ``tool_names`` whose content is not TRL's error) and so to the model turn that made
    it; a turn that made several calls takes the last one's value, a turn without one gets None.

    TRL runs a turn's calls before it checks the length: when their results would overrun
    ``max_completion_length`` it removes the ``tool`` messages again and ends the rollout, so the last model
    turn's calls have no reply. Values recorded by those calls (at most one per call) are left out.
    """
    turn_of_call: list[int] = []
    turn = -1
    unanswered = 0  # tool calls of the last model turn that no `tool` message answers
    for message in messages if isinstance(messages, list) else []:
        role = message.get("role") if isinstance(message, dict) else None
        if role == "assistant":
            turn += 1
            unanswered = len(message.get("tool_calls") or [])
        elif role == "tool" and turn >= 0:
            unanswered = 0
            content = message.get("content")
            if message.get("name") in tool_names and not (isinstance(content, str)
                                                          and content.startswith(_ERROR_PREFIX)):
                turn_of_call.append(turn)
    out = {}
    for name, values in recorded.items():
        if not len(turn_of_call) <= len(values) <= len(turn_of_call) + unanswered:
            raise ValueError(f"{owner}.turn_values[{name!r}] holds {len(values)} value(s) for {len(turn_of_call)} "
                             "successful tool call(s); append exactly one value in each call that succeeds "
                             "(none in one that raises)")
        per_turn: list = [None] * (turn + 1)
        for k, value in zip(turn_of_call, values):  # zip stops before the unanswered calls' values
            per_turn[k] = value
        out[name] = per_turn
    return out


def turns_of(completion_mask: torch.Tensor, tool_mask: torch.Tensor | None, completions: list | None = None) -> Turns:
    """`Turns` from TRL's ``completion_mask`` and ``tool_mask`` (None: every completion is one turn) and, for
    tool calls and failures, its parsed ``completions`` (one list of messages per completion)."""
    valid = completion_mask.bool()
    model = valid if tool_mask is None else valid & tool_mask.bool()
    env = valid & ~model
    starts = model & ~F.pad(model[:, :-1], (1, 0), value=False)
    index = torch.where(model, starts.long().cumsum(1) - 1, torch.full_like(completion_mask, -1, dtype=torch.long))
    count = starts.sum(1)
    replies = (env & ~F.pad(env[:, :-1], (1, 0), value=False)).sum(1)
    k = int(count.max()) if count.numel() else 0
    lengths = torch.zeros(model.shape[0], k, dtype=torch.long, device=model.device)
    if k:
        lengths.scatter_add_(1, index.clamp(min=0), model.long())
    if completions is not None and len(completions) != model.shape[0]:
        raise ValueError(f"turns: {len(completions)} completions for {model.shape[0]} rows")
    if completions is None:
        return Turns(index, model, env, count, replies, lengths)
    calls, failures = tool_events(completions, k)
    return Turns(index, model, env, count, replies, lengths, calls.to(model.device), failures.to(model.device))


def turn_ends(batch, max_turns: int | None = None) -> torch.Tensor:
    """``(N, K)`` long: the state after each model turn of ``batch``'s multi-turn rollouts, as a completion-token
    prefix length: where the next turn begins (the tool's or environment's reply included), the completion's end
    after the last turn; -1 past a row's turns. The turn analogue of `trl_credit.step_ends` (TRACE, SIOP):
    ``max_turns`` keeps the last ``max_turns`` states (earlier turns merge into the first kept one)."""
    info = batch.turns()
    starts, count = info.starts(), info.count
    n, k = starts.shape
    if k == 0:
        return torch.full((n, 0), -1, dtype=torch.long, device=starts.device)
    column = torch.arange(k, device=starts.device).unsqueeze(0)
    ends = torch.cat([starts[:, 1:], torch.full((n, 1), -1, dtype=torch.long, device=starts.device)], dim=1)
    ends = torch.where(column == (count - 1).unsqueeze(1), batch.completion_lengths.to(starts.device).unsqueeze(1), ends)
    ends = torch.where(column < count.unsqueeze(1), ends, -1)
    if max_turns is not None and k > max_turns:
        keep = column[:, :max_turns] + (count - max_turns).clamp(min=0).unsqueeze(1)
        ends = torch.where(keep < count.unsqueeze(1), ends.gather(1, keep.clamp(max=k - 1)), -1)
    return ends


def carry_forward(values: torch.Tensor, start: float = math.nan) -> torch.Tensor:
    """``(N, K)``: each NaN of ``values`` replaced by the last non-NaN value before it in its row, ``start``
    before the first (per-turn states an environment recorded only on some turns: `RolloutBatch.turn_values`)."""
    position = torch.arange(values.shape[1], device=values.device).expand_as(values)
    last = torch.where(torch.isnan(values), -1, position).cummax(dim=1).values
    return torch.where(last >= 0, values.gather(1, last.clamp(min=0)), torch.full_like(values, start))
