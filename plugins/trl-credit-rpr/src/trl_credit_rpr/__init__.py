"""RPR, the reasoning-pattern reward: reward key reasoning phrases in the thinking, minus repetition.

Method. Lv et al. find that RL for reasoning is robust to heavy reward noise, and that rewarding
only the *appearance of key reasoning phrases* ("first, I need to", "wait", "therefore", ...)
without checking the answer reaches a downstream accuracy close to training on verified answers.
They also use RPR to calibrate a noisy reward model: completions the model scores low get a small
RPR bonus, which softens its false negatives. This plugin computes RPR for every completion and
adds it as a reward column, uses it as the only reward, or calibrates an existing column with it.

Formula (``t`` = the lower-cased thinking span of a completion, ``P`` = the 40 official phrases)::

    RPR(t) = max(0, min(1, |{p in P : p occurs in t}| / 20) - rep_20(t) - count(t, "user: "))
    rep_n(t) = |{distinct n-grams of the whitespace words of t occurring more than once}| / #n-grams(t)

Presence counts, not occurrences: a phrase written ten times counts once. ``rep_n`` is 0 when the
text has fewer than ``n`` words. Any "user: " (the model writing a new user turn to itself) drives
the score to 0. Calibration (the reward-model path of the code): ``r <- min(1, r + 0.1 * RPR)``
where ``r < 0.5``, else ``r``.

Source: Lv, Xie, Sun, Kang, Yan 2025, "The Climb Carves Wisdom Deeper Than the Summit: On the Noisy
Rewards in Learning to Reason", arXiv 2505.22653. Official code
trestad/Noisy-Rewards-in-Learning-to-Reason@083f72ba: ``verl/verl/utils/reward_score/math_score.py``
(``think_reward``, ``calculate_ngram_repetition_ratio``: the formula, phrase list, 1/20, 20-grams,
the "user: " penalty) and ``verl/verl/workers/fsdp_workers.py`` (``_forward_micro_batch``: the
calibration ``rm < 0.5 -> min(rm + 0.1 * rpr, 1)``; there RPR has no "user: " term and is computed on
the text between the last ``<think>``/``</think>`` plus the answer). Facts read there; the code here is
our own.

Thinking span. The math code takes everything after ``"Assistant: <think> "`` in prompt + response
(``text[text.find(marker) + 19:]``), so the answer part is scored too, and when the marker is absent
``find`` returns -1 and the first 18 characters of the text are silently dropped. Here the span is
the text after the first ``think_start`` and before the next ``think_end`` (the whole completion
when ``think_start`` is absent, up to the end when ``think_end`` is absent or ``None``). The
vectors of methods.md 2.10 are for this span. ``repo_slicing: true`` replicates the code's slicing
exactly (``text[text.find(think_start) + len(think_start) + 1:]``, end marker ignored), quirk
included.

Defaults (all from the code): the 40 phrases (including the typo "makes sence" and the trailing
spaces of "we can observe ", "first, ", ...), ``full_score_phrases = 20``, ``ngram = 20``,
``user_marker = "user: "``, calibration scale 0.1, threshold 0.5, cap 1.0. Not established by the
paper or code, so options: the weight of the appended column (``weight = 1.0``; the paper's
RPR-only run uses RPR as the whole reward: ``combine: alone``) and the default markers
``<think>``/``</think>`` (the code's ``"Assistant: <think>"`` belongs to its prompt template).
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trl_credit import Plugin, completion_text, hookimpl

if TYPE_CHECKING:
    from trl_credit import RolloutBatch

__all__ = ["PHRASES", "ReasoningPatternReward", "repetition_ratio", "rpr_reward", "rpr_score", "rpr_terms",
           "score_spans", "thinking_span"]

#: The official phrase list, in the code's order (lower case; trailing spaces and the typo are part of it).
PHRASES: tuple[str, ...] = (
    "i need to", "we need to", "wait", "alternatively", "let me check", "let me see", "let's focus on",
    "we know that", "we can observe ", "we can see ", "let me try", "let's try", "let us try", "first, ",
    "firstly, ", "next, ", "finally, ", "let us first", "let's first", "let me first", "try again",
    "still not", "not working", "not correct", "does not work", "doesn't work", "makes sence", "since we ",
    "because we ", "consequently", "as a result", "thus", "therefore", "hence", "so that", "thereby",
    "if we", "given there ", "for instance ", "for example ",
)


def thinking_span(text: str, start: str | None = "<think>", end: str | None = "</think>",
                  repo_slicing: bool = False) -> str:
    """The part of ``text`` RPR scores.

    Default: after the first ``start`` and before the next ``end``; the whole text when ``start`` is
    absent (or ``None``), up to the end when ``end`` is absent (or ``None``). ``repo_slicing``: the
    official code's ``text[text.find(start) + len(start) + 1:]`` (one more character skipped after the
    marker; when it is absent, the first ``len(start)`` characters are dropped; ``end`` ignored).
    """
    if repo_slicing:
        if not start:
            raise ValueError("repo_slicing needs a start marker")
        return text[text.find(start) + len(start) + 1:]
    if start:
        i = text.find(start)
        if i >= 0:
            text = text[i + len(start):]
    if end:
        j = text.find(end)
        if j >= 0:
            text = text[:j]
    return text


def repetition_ratio(text: str, n: int = 20) -> float:
    """Distinct whitespace-word ``n``-grams that occur more than once, over all ``n``-gram positions (0 if none)."""
    if len(text) < 2 * n:                                         # at most n words: at most one n-gram
        return 0.0
    words = text.split()
    total = len(words) - n + 1
    if total <= 1:
        return 0.0
    vocab = dict.fromkeys(words)
    if len(vocab) < 0x110000:                                     # one character per distinct word: an n-gram
        code = {w: chr(i) for i, w in enumerate(vocab)}           # is then a length-n substring (fast to hash)
        s = "".join(map(code.__getitem__, words))
        grams: list = [s[i:i + n] for i in range(total)]
    else:  # pragma: no cover - more distinct words than code points
        grams = list(zip(*(words[k:] for k in range(n))))
    if len(set(grams)) == total:                                  # the common case: nothing repeats
        return 0.0
    return sum(1 for c in Counter(grams).values() if c > 1) / total


def rpr_terms(span: str, phrases: Sequence[str] = PHRASES, ngram: int = 20,
              user_marker: str | None = "user: ") -> tuple[int, float, int]:
    """``(phrases present, n-gram repetition ratio, user-marker count)`` of one thinking span, lower-cased here."""
    t = span.lower()
    present = sum(1 for p in phrases if p.lower() in t)
    users = t.count(user_marker.lower()) if user_marker else 0
    return present, repetition_ratio(t, ngram), users


def rpr_score(text: str, *, phrases: Sequence[str] = PHRASES, full_score_phrases: float = 20.0,
              ngram: int = 20, user_marker: str | None = "user: ") -> float:
    """RPR of one thinking span: ``max(0, min(1, present / 20) - rep_20 - #"user: ")``."""
    present, rep, users = rpr_terms(text, phrases, ngram, user_marker)
    return max(0.0, min(1.0, present / full_score_phrases) - rep - users)


def score_spans(spans: Sequence[str], phrases: Sequence[str] = PHRASES, full_score_phrases: float = 20.0,
                ngram: int = 20, user_marker: str | None = "user: ",
                ) -> tuple[list[float], list[int], list[float], list[int]]:
    """`rpr_score` of many spans at once: ``(rpr, phrases present, repetition ratio, user-marker count)`` lists.

    Same values as `rpr_terms` span by span, faster: one regex pass over all spans (joined by NUL)
    finds the spans holding at least one phrase, and only those get the per-phrase substring tests;
    `repetition_ratio` codes each distinct word as one character.
    """
    phrases = tuple(p.lower() for p in phrases)
    marker = user_marker.lower() if user_marker else None
    lowered = [s.lower() for s in spans]
    hits: set[int] = set()
    if phrases and lowered:
        starts, offset = [], 0
        for t in lowered:
            starts.append(offset)
            offset += len(t) + 1
        # a match consumes the rest of its span: at most one match (one Python object) per span
        pattern = re.compile("(?:" + "|".join(map(re.escape, phrases)) + ")[^\\0]*")
        if any(not p or "\0" in p for p in phrases):                   # a phrase could cross spans
            hits = set(range(len(lowered)))
        else:
            hits = {bisect_right(starts, m.start()) - 1 for m in pattern.finditer("\0".join(lowered))}
    rpr, present, rep, users = [], [], [], []
    for i, t in enumerate(lowered):                                      # text work: one pass per completion
        p = sum(1 for q in phrases if q in t) if i in hits else 0
        r = repetition_ratio(t, ngram)
        u = t.count(marker) if marker else 0
        rpr.append(max(0.0, min(1.0, p / full_score_phrases) - r - u))
        present.append(p)
        rep.append(r)
        users.append(u)
    return rpr, present, rep, users


def rpr_reward(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """TRL reward function: RPR of each completion's ``<think>`` span with the official defaults.

    Use it in ``reward_funcs`` (``trl_credit_rpr.rpr_reward``) to score RPR on each process's own
    completions instead of in the plugin's hook (which runs on the gathered batch on every rank).
    """
    return score_spans([thinking_span(completion_text(c)) for c in completions])[0]


class ReasoningPatternReward(Plugin):
    """RPR (Lv et al. 2025): max(0, min(1, #phrases/20) - rep_20 - #"user: ") of the thinking span,
    appended as a reward column, used alone, or used to calibrate a (noisy) reward column."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        column: str = Field("rpr", description="name of the RPR reward column (replaced if it already exists)")
        weight: float = Field(
            1.0, description="weight of the RPR column in the weighted total (not established: the paper's "
            "RPR-only run is 'combine: alone'; the code's calibration uses 'calibration_scale')",
        )
        combine: Literal["append", "alone", "calibrate"] = Field(
            "append",
            description="append: add the RPR column to the other rewards; alone: RPR is the only reward "
            "(every other column's weight set to 0, as the paper's RPR-only runs); calibrate: no new column, "
            "target r <- min(cap, r + scale * RPR) where r < threshold (the code's reward-model path)",
        )
        target: str | None = Field(
            None, description="combine=calibrate: the reward column to calibrate; None = the first column",
        )
        calibration_scale: float = Field(0.1, ge=0.0, description="combine=calibrate: RPR multiplier (code: 0.1)")
        calibration_threshold: float = Field(
            0.5, description="combine=calibrate: only rewards below this are calibrated (code: 0.5)",
        )
        calibration_cap: float = Field(1.0, description="combine=calibrate: upper clamp of a calibrated reward "
                                       "(code: 1.0)")
        think_start: str | None = Field(
            "<think>", description="the thinking span starts after the first occurrence of this marker; "
            "absent or None: at the start of the completion (code: 'Assistant: <think>' in prompt + response)",
        )
        think_end: str | None = Field(
            "</think>", description="the thinking span ends before the next occurrence of this marker; "
            "absent or None: at the end of the completion (the code scores up to the end, answer included)",
        )
        repo_slicing: bool = Field(
            False, description="replicate the code's slicing text[find(think_start) + len(think_start) + 1:] "
            "(drops len(think_start) characters when the marker is absent; think_end ignored)",
        )
        phrases: list[str] = Field(
            list(PHRASES), description="key reasoning phrases, matched as lower-cased substrings, presence only "
            "(default: the code's 40, typo 'makes sence' and trailing spaces included)",
        )
        full_score_phrases: float = Field(
            20.0, gt=0.0, description="phrases present for the full phrase score 1 (code: 20)",
        )
        ngram: int = Field(20, ge=1, description="n of the repetition-ratio n-grams of whitespace words (code: 20)")
        user_marker: str | None = Field(
            "user: ", description="each occurrence (lower-cased text) subtracts 1 (code's math path: 'user: '); "
            "None = no penalty (code's reward-model path)",
        )

        @model_validator(mode="after")
        def _check(self) -> ReasoningPatternReward.Config:
            if self.repo_slicing and not self.think_start:
                raise ValueError("repo_slicing needs a non-empty think_start")
            return self

    def required_rewards(self) -> list[str]:
        """The calibrated column, when named."""
        return [self.config.target] if self.config.combine == "calibrate" and self.config.target else []

    def scores(self, completions: Sequence[Any]) -> tuple[list[float], list[int], list[float], list[int]]:
        """Per completion: RPR, phrases present, repetition ratio, user-marker count."""
        c = self.config
        spans = [thinking_span(completion_text(x), c.think_start, c.think_end, c.repo_slicing) for x in completions]
        return score_spans(spans, c.phrases, c.full_score_phrases, c.ngram, c.user_marker)

    @hookimpl
    def shape_rewards(self, batch: RolloutBatch) -> dict[str, Any]:
        import torch

        c = self.config
        rpr_list, present, rep, users = self.scores(batch.completions)
        rpr = torch.tensor(rpr_list, dtype=torch.float32, device=batch.device)
        n = max(len(rpr_list), 1)
        self.log_metric(batch, "mean", sum(rpr_list) / n)
        self.log_metric(batch, "phrases", sum(present) / n)
        self.log_metric(batch, "repetition", sum(rep) / n)
        self.log_metric(batch, "user_turn_fraction", sum(1 for u in users if u) / n)
        if c.combine == "calibrate":
            name = c.target if c.target is not None else batch.reward_names[0]
            r = batch.reward(name)
            low = r < c.calibration_threshold                             # NaN compares False: stays NaN
            calibrated = torch.where(low, (r + c.calibration_scale * rpr).clamp(max=c.calibration_cap), r)
            self.log_metric(batch, "calibrated_fraction", low.float().mean().item())
            return {name: calibrated}
        out: dict[str, Any] = {c.column: (rpr, c.weight)}
        if c.combine == "alone":
            out.update({name: (batch.rewards[:, j], 0.0) for j, name in enumerate(batch.reward_names)
                        if name != c.column})
        return out

