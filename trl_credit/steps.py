"""Step segmentation and step-level process scores for single-turn completions.

Step-based plugins (PRM reward refinement, gated reward accumulation, ...) share three pieces:

- :func:`split_steps` cuts a completion text into steps at a regex delimiter (default ``\\n+``: every
  line is a step; ``\\n\\s*\\n`` gives paragraphs; a zero-width pattern such as ``(?=Step \\d)``
  also works). Steps are stripped of surrounding whitespace and empty ones are dropped.
- :func:`token_steps` maps every completion token of a `RolloutBatch` to the step its text falls in,
  as an ``(N, T)`` long tensor (-1 on padding, masked tokens and tokens outside every step, such as
  the delimiters themselves).
- A *step scorer* gives one score per step: any callable
  ``scorer(prompts, completions, steps, columns) -> list[list[float]]`` (``steps[i]`` the step texts
  of completion ``i``, ``columns`` the dataset columns, one value per completion; keyword options
  may follow). :func:`resolve_step_scorer` turns a built-in name or a dotted path
  ``"pkg.module:func"`` into the callable; :func:`score_steps` calls it and checks what it returns.

Named scorers are found under the entry-point group ``trl_credit.step_scorers``. The host's
application registers ``arithmetic`` (`trl_credit.app.arithmetic_steps`), a rule-based checker of
integer equations: the deterministic stand-in for a process reward model (PRM) that the tests and
benchmarks use. A learned PRM plugs in through the same interface (a dotted path to a function that
runs the model).

Token offsets come from the batch's tokenizer: the decoded length of every vocabulary id is
measured once (in context, after an anchor token, so SentencePiece's leading spaces count) and
cached per tokenizer; a completion's offsets are the cumulative lengths of its tokens. A row where
those lengths do not add up to its text (a character split across byte tokens, a tokenizer that
cleans up spaces) is measured exactly by decoding its prefixes. A stand-in tokenizer without
``batch_decode`` or marked ``stand_in`` (``trl_credit.testing.make_batch``) spreads each text evenly over its tokens.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import math
import os
import re
import sys
import weakref
from array import array
from collections.abc import Callable, Sequence
from itertools import chain
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from trl_credit.answers import completion_text

if TYPE_CHECKING:
    import torch

    from trl_credit.batch import RolloutBatch

__all__ = [
    "DEFAULT_PATTERN",
    "StepConfig",
    "StepScorer",
    "known_step_scorers",
    "pad_step_scores",
    "resolve_step_scorer",
    "score_steps",
    "split_steps",
    "discounted_returns",
    "step_ends",
    "step_scores",
    "token_char_offsets",
    "token_steps",
]

#: Default step delimiter: one or more newlines (every non-empty line is a step).
DEFAULT_PATTERN = r"\n+"

#: ``scorer(prompts, completions, steps, columns, **options) -> list[list[float]]``, one score per step.
StepScorer = Callable[..., list[list[float]]]


# ----------------------------------------------------------------------------------------- splitting
def split_steps(text: str, pattern: str | re.Pattern = DEFAULT_PATTERN) -> tuple[list[str], list[tuple[int, int]]]:
    """Cut ``text`` into steps at every match of the delimiter regex ``pattern``.

    :return: ``(steps, spans)``: the step texts, stripped of surrounding whitespace, and their
        ``(start, end)`` character spans in ``text`` (``text[start:end] == step``). Empty steps are
        dropped, so a text of only whitespace and delimiters has no step.
    """
    regex = re.compile(pattern) if isinstance(pattern, str) else pattern
    cuts = [0, *chain.from_iterable(m.span() for m in regex.finditer(text)), len(text)]
    steps: list[str] = []
    spans: list[tuple[int, int]] = []
    for a, b in zip(cuts[::2], cuts[1::2]):
        piece = text[a:b]
        step = piece.strip()
        if step:
            a += len(piece) - len(piece.lstrip())
            steps.append(step)
            spans.append((a, a + len(step)))
    return steps, spans


def _split_batch(batch: RolloutBatch, pattern: str) -> tuple[list[list[str]], list[list[tuple[int, int]]]]:
    """:func:`split_steps` of every completion of ``batch`` (cached per batch and pattern)."""
    key = f"split_steps::{pattern}"
    cached = batch.token_cache.get(key)
    if cached is None:
        regex = re.compile(pattern)
        split = [split_steps(completion_text(c), regex) for c in batch.completions]
        cached = ([st for st, _ in split], [sp for _, sp in split])
        batch.token_cache[key] = cached  # type: ignore[assignment]
    return cached  # type: ignore[return-value]


# ----------------------------------------------------------------------------------------- token offsets
_TABLES: dict[int, tuple[Any, Any]] = {}  # id(tokenizer) -> (weakref or tokenizer, (V,) decoded lengths, -1 unknown)


def _length_table(tokenizer: Any, flat_ids: torch.Tensor) -> torch.Tensor:
    """``(V,)`` long: decoded length of each id seen so far (filled for every id in ``flat_ids``)."""
    import torch

    key = id(tokenizer)
    entry = _TABLES.get(key)
    if entry is not None:
        owner = entry[0]() if isinstance(entry[0], weakref.ref) else entry[0]
        if owner is not tokenizer:
            entry = None
    size = max(len(tokenizer), int(flat_ids.max()) + 1 if flat_ids.numel() else 0)
    if entry is None:
        table = torch.full((size,), -1, dtype=torch.long)
        try:
            ref: Any = weakref.ref(tokenizer, lambda _, k=key: _TABLES.pop(k, None))
        except TypeError:
            ref = tokenizer
        _TABLES[key] = (ref, table)
    else:
        table = entry[1]
        if table.numel() < size:
            table = torch.cat([table, torch.full((size - table.numel(),), -1, dtype=torch.long)])
            _TABLES[key] = (entry[0], table)
    present = torch.bincount(flat_ids, minlength=size).cpu() > 0
    missing = torch.nonzero(present & (table < 0)).flatten().tolist()
    if missing:
        anchor = list(tokenizer.encode("a", add_special_tokens=False))[-1:]
        base = len(tokenizer.decode(anchor, skip_special_tokens=True))
        # ids past the tokenizer's vocabulary (a padded model vocabulary) decode to ""
        texts = tokenizer.batch_decode([anchor + [i] for i in missing], skip_special_tokens=True)
        table[torch.tensor(missing, dtype=torch.long)] = torch.tensor(
            [max(len(t) - base, 0) for t in texts], dtype=torch.long)
    return table


def _prefix_ends(tokenizer: Any, ids: list[int], text_len: int) -> list[int]:
    """Exact end offsets of each token of one row: lengths of its decoded prefixes, made monotone."""
    if not ids:
        return []
    prefixes = tokenizer.batch_decode([ids[: t + 1] for t in range(len(ids))], skip_special_tokens=True)
    ends = [len(p) for p in prefixes]
    for t in range(len(ends) - 2, -1, -1):  # a split character shows as U+FFFD until it completes
        ends[t] = min(ends[t], ends[t + 1])
    if ends[-1] != text_len and ends[-1] > 0:  # the text is not this decode: rescale (approximate)
        ends = [e * text_len // ends[-1] for e in ends]
    return [min(e, text_len) for e in ends]


def _token_ends(batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lengths, ends)``: ``(N, T)`` int32 decoded length and end offset of every completion token."""
    import torch

    ids = batch.completion_ids
    texts = [completion_text(c) for c in batch.completions]
    width = ids.shape[1]
    text_len = torch.tensor([len(t) for t in texts], dtype=torch.int32, device=ids.device)
    tokenizer = batch.tokenizer
    if getattr(tokenizer, "stand_in", False) or not hasattr(tokenizer, "batch_decode"):
        # a stand-in tokenizer (tests): spread each text evenly over its unmasked tokens
        real = batch.completion_mask.to(torch.int64)
        count = real.sum(dim=1, keepdim=True)
        ends = (real.cumsum(dim=1) * text_len.unsqueeze(1) // count.clamp(min=1)).to(torch.int32)
        lengths = torch.diff(ends, dim=1, prepend=torch.zeros_like(ends[:, :1]))
        return lengths, ends
    table = _length_table(tokenizer, ids.reshape(-1)).to(device=ids.device, dtype=torch.int32)
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is not None and pad < table.numel() and int(table[pad]) != 0:  # a pad token that is not special
        table = table.clone()
        table[pad] = 0
    lengths = table.index_select(0, ids.reshape(-1)).view_as(ids)
    ends = lengths.cumsum(dim=1, dtype=torch.int32)
    wrong = torch.nonzero(ends[:, -1] != text_len).flatten().tolist() if width else []
    if wrong:  # rows whose token lengths do not add up to the text: decode their prefixes
        cpu_ids = ids[wrong].tolist()
        for row, row_ids in zip(wrong, cpu_ids):
            last = len(row_ids)
            while last and int(lengths[row, last - 1]) == 0 and row_ids[last - 1] == pad:
                last -= 1
            exact = _prefix_ends(tokenizer, row_ids[:last], len(texts[row]))
            ends[row] = torch.tensor(exact + [exact[-1] if exact else 0] * (width - last),
                                     dtype=torch.int32, device=ids.device)
        lengths = torch.diff(ends, dim=1, prepend=torch.zeros_like(ends[:, :1]))
    return lengths, ends


def token_char_offsets(batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Character span ``[start, end)`` of every completion token in its completion's text.

    :return: two ``(N, T)`` long tensors on ``batch.device``. Padding and special tokens (which TRL's
        ``skip_special_tokens=True`` decode drops) have ``start == end``.
    """
    import torch

    lengths, ends = _token_ends(batch)
    return (ends - lengths).to(torch.long), ends.to(torch.long)


def token_steps(batch: RolloutBatch, pattern: str = DEFAULT_PATTERN,
                fill: bool = False) -> tuple[torch.Tensor, list[list[str]]]:
    """Map every completion token to the step (see :func:`split_steps`) its text belongs to.

    A token belongs to the first step its character span overlaps (a token straddling a delimiter
    belongs to the step before it); a token made only of delimiter text or surrounding whitespace
    belongs to no step (-1), unless ``fill``: then such a token takes the step before it (the
    delimiter closes its step; trailing text and EOS go to the last step) and tokens before the
    first step take the first step. Cached per batch, pattern and ``fill``.

    :return: ``(step_index, steps)``: ``step_index`` ``(N, T)`` long on ``batch.device``, in
        ``0..len(steps[i]) - 1``, and -1 on padding, on masked tokens (``completion_mask == 0``), in
        completions without steps and (without ``fill``) on tokens outside every step; ``steps``
        the step texts of each completion.
    """
    import torch

    key = f"token_steps::{pattern}::{'fill' if fill else 'strict'}"
    cached = batch.token_cache.get(key)
    if cached is not None:
        return cached  # type: ignore[return-value]
    steps, spans = _split_batch(batch, pattern)
    ids = batch.completion_ids
    n, width = ids.shape
    counts = [len(s) for s in steps]
    most = max(counts, default=0)
    if most == 0 or width == 0:
        result = (torch.full((n, width), -1, dtype=torch.long, device=ids.device), steps)
        batch.token_cache[key] = result  # type: ignore[assignment]
        return result
    lengths, ends = _token_ends(batch)
    starts = ends - lengths
    # padded (N, S) step boundaries; padding lies past every token, so it lands in the spare column
    buffer = array("i", chain.from_iterable(chain.from_iterable(spans)))
    flat = torch.frombuffer(buffer, dtype=torch.int32)
    count_t = torch.tensor(counts, dtype=torch.long)
    row = torch.repeat_interleave(torch.arange(n), count_t)
    col = torch.arange(len(flat) // 2) - torch.repeat_interleave(count_t.cumsum(0) - count_t, count_t)
    bounds = torch.full((2, n, most), 2**31 - 1, dtype=torch.int32)
    bounds[:, row, col] = flat.view(-1, 2).T
    bounds = bounds.to(ids.device)
    # ended(t)   = #steps with end <= start_t   (= index of the first step not over before token t)
    # started(t) = #steps with start < end_t    (token t overlaps that step iff started > ended)
    first_after_end = torch.searchsorted(starts, bounds[1], side="left")   # first token starting at/after a step end
    first_past_start = torch.searchsorted(ends, bounds[0], side="right")   # first token ending past a step start
    marks = torch.zeros((2, n, width + 1), dtype=torch.int32, device=ids.device)
    ones = torch.ones((n, most), dtype=torch.int32, device=ids.device)
    marks[0].scatter_add_(1, first_after_end.clamp(max=width), ones)
    marks[1].scatter_add_(1, first_past_start.clamp(max=width), ones)
    ended, started = marks[:, :, :width].cumsum(dim=2, dtype=torch.int32).unbind(0)
    real = batch.completion_mask.bool()
    inside = started > ended
    if fill:
        index = torch.where(inside, ended, (started - 1).clamp(min=0))
        real = real & (count_t > 0).to(ids.device).unsqueeze(1)
    else:
        index = ended
        real = real & inside & (lengths > 0)
    result = (torch.where(real, index, -1).to(torch.long), steps)
    batch.token_cache[key] = result  # type: ignore[assignment]
    return result


def step_ends(batch: RolloutBatch, pattern: str = DEFAULT_PATTERN, max_steps: int | None = None,
              eos: bool = True) -> torch.Tensor:
    """``(N, K)`` long: the completion-token position just past each step (delimiter included), -1 past a row's steps.

    The prefix "up to the end of step k" of row ``i`` is ``completion_ids[i, :ends[i, k]]``: what
    `RolloutBatch.prefix_logps` scores a continuation after (IGPO, TRACE, P2S). Steps come from
    :func:`token_steps` with ``fill=True`` (a delimiter closes the step before it). ``max_steps``
    keeps the last ``max_steps`` boundaries of each row (the last step ends the completion; earlier
    ones are merged into the first kept step), which bounds the number of scored prefixes. The last step of
    a finished completion holds its EOS token; ``eos=False`` ends it before the EOS (to read "after the whole
    completion" without the EOS). With no step in any row the result is ``(N, 0)``.
    """
    import torch

    index, steps = token_steps(batch, pattern, fill=True)
    n, width = index.shape
    most = max((len(s) for s in steps), default=0)
    ends = torch.full((n, max(most, 1)), -1, dtype=torch.long, device=index.device)
    if most == 0 or width == 0:
        return ends[:, :most]
    position = torch.arange(1, width + 1, device=index.device).expand(n, width)
    valid = index >= 0
    ends.scatter_reduce_(1, index.clamp(min=0), torch.where(valid, position, -1), reduce="amax", include_self=True)
    if not eos and getattr(batch.tokenizer, "eos_token_id", None) is not None:
        lengths = batch.completion_lengths.to(index.device)
        rows = torch.arange(n, device=index.device)
        finished = (lengths > 0) & (batch.completion_ids.to(index.device)[rows, (lengths - 1).clamp(min=0)]
                                    == batch.tokenizer.eos_token_id)
        content = torch.where(finished, lengths - 1, lengths).unsqueeze(1)
        ends = torch.where(ends >= 0, torch.minimum(ends, content), ends)
    if max_steps is not None and most > max_steps:
        counts = (ends >= 0).sum(1, keepdim=True)
        keep = torch.arange(most, device=index.device).unsqueeze(0) + (counts - max_steps).clamp(min=0)
        ends = torch.where(keep < counts, ends.gather(1, keep.clamp(max=most - 1)), -1)[:, :max_steps]
    return ends


def discounted_returns(rewards: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """``G_k = sum_{j >= k} gamma^(j - k) r_j`` along the last dimension (one matrix product; entries past a
    row's steps should be 0). The backward accumulation of step or turn credit (IGPO, SIOP)."""
    import torch

    k = rewards.shape[-1]
    power = torch.arange(k, device=rewards.device)
    lag = power.unsqueeze(0) - power.unsqueeze(1)  # [k, j] = j - k
    discount = torch.where(lag >= 0, float(gamma) ** lag.clamp(min=0).to(rewards.dtype), 0.0)
    return rewards @ discount.T


# ----------------------------------------------------------------------------------------- scorers
#: Entry-point group of named step scorers (the host registers ``arithmetic``; a package may add more).
STEP_SCORER_GROUP = "trl_credit.step_scorers"


def _named_scorers() -> dict[str, Any]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=STEP_SCORER_GROUP)}


def known_step_scorers() -> list[str]:
    """Names :func:`resolve_step_scorer` accepts without a dotted path (entry points ``trl_credit.step_scorers``)."""
    return sorted(_named_scorers())


def resolve_step_scorer(name: str | StepScorer) -> StepScorer:
    """A step scorer from a built-in name (:func:`known_step_scorers`), a dotted path
    ``"pkg.module:func"`` (or ``"pkg.module.func"``; the working directory is importable), or a callable.

    Raises:
        ValueError: naming the scorer, when it is unknown, cannot be imported or is not callable.
    """
    if callable(name):
        return name
    named = _named_scorers()
    if name in named:
        return named[name].load()
    if "." not in name and ":" not in name:
        raise ValueError(f"unknown step scorer {name!r}; built-in: {', '.join(known_step_scorers())}, "
                         "or a dotted import path such as 'my_pkg.prm:score_steps'")
    module_path, _, attr = name.replace(":", ".").rpartition(".")
    if not module_path or not attr:
        raise ValueError(f"step scorer {name!r}: not a dotted import path")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_path)
    except ImportError as exc:
        raise ValueError(f"step scorer {name!r}: cannot import module {module_path!r} ({exc})") from None
    func = getattr(module, attr, None)
    if func is None:
        raise ValueError(f"step scorer {name!r}: module {module_path!r} has no attribute {attr!r}")
    if not callable(func):
        raise ValueError(f"step scorer {name!r} is not callable")  # noqa: TRY004 (pydantic reports ValueError)
    return func


def score_steps(scorer: str | StepScorer, prompts: Sequence[Any], completions: Sequence[Any],
                steps: Sequence[Sequence[str]], columns: dict[str, list] | None = None,
                **options: Any) -> list[list[float]]:
    """Call a step scorer and check its answer: one finite float per step of every completion."""
    func = resolve_step_scorer(scorer)
    label = scorer if isinstance(scorer, str) else getattr(scorer, "__name__", repr(scorer))
    scores = func(list(prompts), list(completions), [list(s) for s in steps], dict(columns or {}), **options)
    if len(scores) != len(steps):
        raise ValueError(f"step scorer {label!r} returned {len(scores)} score lists for {len(steps)} completions")
    out = []
    for i, (row, want) in enumerate(zip(scores, steps)):
        row = [float(v) for v in row]
        if len(row) != len(want):
            raise ValueError(f"step scorer {label!r} returned {len(row)} scores for the {len(want)} steps "
                             f"of completion {i}")
        if not all(math.isfinite(v) for v in row):
            raise ValueError(f"step scorer {label!r} returned a non-finite score for completion {i}: {row}")
        out.append(row)
    return out


def step_scores(batch: RolloutBatch, scorer: str | StepScorer, pattern: str = DEFAULT_PATTERN,
                **options: Any) -> tuple[list[list[str]], list[list[float]]]:
    """Split every completion of ``batch`` into steps and score them (cached per batch, scorer,
    pattern and options). :return: ``(steps, scores)``, both lists of length ``N``."""
    key = f"step_scores::{scorer!r}::{pattern}::{sorted(options.items())!r}"
    cached = batch.token_cache.get(key)
    if cached is not None:
        return cached  # type: ignore[return-value]
    steps = _split_batch(batch, pattern)[0]
    scores = score_steps(scorer, batch.prompts, batch.completions, steps, batch.columns, **options)
    batch.token_cache[key] = (steps, scores)  # type: ignore[assignment]
    return steps, scores


def pad_step_scores(scores: Sequence[Sequence[float]], device: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged step scores -> ``(N, S)`` float32 tensor (0 past each row's steps) and ``(N,)`` long counts."""
    import torch

    counts = torch.tensor([len(r) for r in scores], dtype=torch.long)
    n, most = len(scores), int(counts.max()) if len(scores) else 0
    out = torch.zeros((n, most), dtype=torch.float32)
    if most:
        buffer = array("f", chain.from_iterable(scores))
        flat = torch.frombuffer(buffer, dtype=torch.float32)
        row = torch.repeat_interleave(torch.arange(n), counts)
        col = torch.arange(flat.numel()) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
        out[row, col] = flat
    return out.to(device) if device is not None else out, counts.to(device) if device is not None else counts


class StepConfig(BaseModel):
    """Options every step-based plugin shares; a plugin's ``Config`` inherits them (``class Config(StepConfig)``)."""

    model_config = ConfigDict(extra="forbid")

    scorer: str = Field(
        "arithmetic",
        description="step scorer: a built-in name (arithmetic) or a dotted path 'pkg.module:func' to "
        "scorer(prompts, completions, steps, columns, **scorer_kwargs) -> list[list[float]]",
    )
    scorer_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="keyword options for the scorer (arithmetic: neutral, default 0.0)"
    )
    pattern: str = Field(
        r"\n+", description="regex that separates steps in a completion (default: newlines)"
    )

    def check_scorer_kwargs(self) -> None:
        """Raise `ConfigError` (key ``scorer_kwargs``) when the scorer's signature does not take
        ``scorer_kwargs``: ``scorer(prompts, completions, steps, columns, **scorer_kwargs)`` would raise at the
        first batch. Step plugins call it from ``check_args``."""
        import inspect

        from trl_credit.config import ConfigError

        try:
            signature = inspect.signature(resolve_step_scorer(self.scorer))
        except (TypeError, ValueError):  # no signature to read (a builtin): the first batch tells
            return
        try:
            signature.bind([], [], [], {}, **self.scorer_kwargs)
        except TypeError as exc:
            plain = signature.replace(parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
                                      return_annotation=signature.empty)
            raise ConfigError.for_key(
                "scorer_kwargs", f"step scorer {self.scorer!r} cannot be called with {self.scorer_kwargs} ({exc})",
                f"pass only keyword options the scorer takes; its signature is {plain}") from None

    @field_validator("scorer")
    @classmethod
    def _known_scorer(cls, value: str) -> str:
        resolve_step_scorer(value)
        return value

    @field_validator("pattern")
    @classmethod
    def _valid_pattern(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"not a valid regex: {exc}") from None
        return value
