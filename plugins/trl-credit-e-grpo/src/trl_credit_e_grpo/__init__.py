"""E-GRPO: partial credit for wrong answers, proportional to the gold entities the completion mentions.

Method. Search-agent training data is often synthesised from a chain of entities (the people, works,
places ... that the question hides behind descriptions); plain GRPO throws them away and gives every
wrong answer 0, so a "near miss" that found most of the chain scores the same as a completion that
understood nothing. Entity-aware GRPO keeps the outcome reward for correct answers and gives a wrong
answer a partial reward proportional to its entity match rate: the share of the question's gold
entities that appear in its reasoning. The factor alpha < 1 keeps every near miss below every success.

Formula (completion i with gold entity set E_gold and the entities E_traj,i it mentions)::

    gamma_i = |E_gold ∩ E_traj,i| / |E_gold|           (0 when E_gold is empty)
    R_i     = 1                   if answer i is correct
              alpha * gamma_i     otherwise

Matching: gold entities and the completion text are normalised (Unicode NFKC, lower-case, every run
of punctuation/whitespace/underscore becomes one space, trimmed), and an entity counts as mentioned
when it occurs in the text on word boundaries (``" " + entity + " "`` in ``" " + text + " "``).
Duplicates (after normalisation) count once; entities that normalise to nothing are ignored.

Implemented as a reward shaper: the correctness column (correct = value ``>= correct_threshold``) is
replaced by R_i; a NaN correctness stays NaN (an unscored completion gets no partial credit). The
gold entities come from a dataset column holding a list of strings or one delimited string. The text
searched is the completion: all assistant messages of a chat completion (``scope: assistant``) or
only its last message (``scope: last``, ``trl_credit.completion_text``).

Source: Zhao et al. 2025, "Repurposing Synthetic Data for Fine-grained Search Agent Supervision"
(E-GRPO), arXiv 2510.24694. Reconstructed from the abstract (no official code located): "assigns
partial rewards to incorrect samples proportional to their entity match rate". Third-party summaries
mention a *normalised* match rate and a best alpha around 0.3 in the paper's ablation; the
normalisation is not established here and is not applied.

Defaults: ``alpha = 0.5`` (NOT established: methods.md's test value; the abstract only implies
alpha < 1, which is validated); ``correct_threshold = 0.5`` (NOT established: any value in (0, 1]
gives the paper for binary correctness); the normaliser and word-boundary matching (NOT established:
the paper's matcher is unknown); ``delimiter = ";"``; ``scope = assistant``; column names
``accuracy_reward`` (TRL's accuracy reward function) and ``entities``.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from trl_credit import Plugin, completion_text, hookimpl

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch

__all__ = ["EntityGRPO", "compile_entities", "entity_match_rate", "normalize_text", "parse_entities", "trajectory_text"]

_SEPARATORS = re.compile(r"[\W_]+")  # any run of punctuation, whitespace or underscores


def normalize_text(text: str) -> str:
    """NFKC, lower-case, every run of non-word characters (and ``_``) -> one space, trimmed."""
    return _SEPARATORS.sub(" ", unicodedata.normalize("NFKC", text).lower()).strip()


def parse_entities(value: Any, delimiter: str = ";") -> frozenset[str]:
    """Gold entities of one row: a list/tuple of strings or one ``delimiter``-separated string -> normalised set."""
    if value is None:
        return frozenset()
    if isinstance(value, str):
        items: Sequence[Any] = value.split(delimiter) if delimiter else [value]
    elif isinstance(value, Sequence) or hasattr(value, "tolist"):
        items = value.tolist() if hasattr(value, "tolist") else value
    else:
        items = [value]
    return frozenset(e for e in (normalize_text(str(item)) for item in items if item is not None) if e)


def trajectory_text(completion: Any, scope: str = "assistant") -> str:
    """The text searched for entities: a string as is; for a chat completion the assistant messages
    (``assistant``) or the last message (``last``)."""
    if scope == "last" or isinstance(completion, str):
        return completion_text(completion)
    if isinstance(completion, list) and len(completion) == 1:   # the usual one-message chat completion
        message = completion[0]
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            return message["content"] if message.get("role", "assistant") == "assistant" else ""
    if isinstance(completion, dict):
        completion = [completion]
    if not isinstance(completion, Sequence):
        return ""
    parts = [completion_text([m]) for m in completion if isinstance(m, dict) and m.get("role", "assistant") == "assistant"]
    return "\n".join(parts)


class _Entity:
    """One normalised gold entity, matched on word boundaries in lower-cased (NFKC) text.

    In the text the entity's words may be separated by any run of punctuation, whitespace or
    underscores and must not touch a letter or digit on either side: the same as a substring match
    of ``" " + entity + " "`` in the normalised, space-padded text, without normalising the whole
    text (which costs ~1 ms per 4 kB in Python's ``re``).
    """

    __slots__ = ("search", "words")

    def __init__(self, normalised: str):
        self.words = tuple(normalised.split(" "))
        # a literal prefix and no look-around keeps ``re``'s fast prefix scan
        self.search = re.compile(r"[\W_]+".join(re.escape(w) for w in self.words)).search

    def found_in(self, text: str) -> bool:
        """``text`` must be ``unicodedata.normalize("NFKC", raw).lower()``."""
        for word in self.words:                          # fast reject: a word is missing altogether
            if word not in text:
                return False
        pos, end = 0, len(text)
        while (m := self.search(text, pos)) is not None:
            start, stop = m.span()
            if (start == 0 or not text[start - 1].isalnum()) and (stop == end or not text[stop].isalnum()):
                return True                              # "_" is not alnum: a separator, as in normalize_text
            pos = start + 1
        return False


def compile_entities(gold: frozenset[str]) -> tuple[_Entity, ...]:
    """Normalised gold entities -> matchers (sorted, so the order is deterministic)."""
    return tuple(_Entity(e) for e in sorted(gold))


def entity_match_rate(text: str, gold: frozenset[str] | tuple[_Entity, ...]) -> float:
    """``|E_gold ∩ E_text| / |E_gold|`` for normalised gold entities (0.0 when ``gold`` is empty)."""
    if not gold:
        return 0.0
    entities = gold if isinstance(gold, tuple) else compile_entities(gold)
    low = unicodedata.normalize("NFKC", text).lower()
    hits = 0
    for entity in entities:
        hits += entity.found_in(low)
    return hits / len(entities)


class EntityGRPO(Plugin):
    """E-GRPO: R = 1 if correct else alpha * |E_gold ∩ E_traj| / |E_gold| (entity-match partial credit).

    Replaces the correctness column with R; arXiv 2510.24694, reconstructed from the abstract.
    """

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        correct_reward: str = Field(
            "accuracy_reward",
            description="reward column saying whether the answer is correct (a reward function's name); "
            "it is replaced by the E-GRPO reward R",
        )
        entities_column: str = Field(
            "entities",
            description="dataset column with the gold entities of each row: a list of strings or one "
            "delimited string",
        )
        alpha: float = Field(
            0.5, ge=0.0, lt=1.0,
            description="weight of the partial credit, must be < 1 so a near miss ranks below a success "
            "(NOT established: 0.5 is methods.md's test value; third-party summaries report ~0.3 best)",
        )
        correct_threshold: float = Field(
            0.5,
            description="an answer is correct when the correctness column is >= this (NOT established; "
            "any value in (0, 1] is the paper for binary correctness)",
        )
        delimiter: str = Field(
            ";", description="separator of the gold entities when the column holds one string ('' = one entity)",
        )
        scope: Literal["assistant", "last"] = Field(
            "assistant",
            description="text searched in a chat completion: every assistant message (the trajectory's "
            "reasoning, tool outputs excluded) or only the last message",
        )

    def required_rewards(self) -> list[str]:
        """The correctness column."""
        return [self.config.correct_reward]

    def required_columns(self) -> list[str]:
        """The gold-entity dataset column."""
        return [self.config.entities_column]

    def match_rates(self, batch: RolloutBatch) -> list[float]:
        """``gamma_i`` of every completion (text work, one pass per completion; gold parsed once per row)."""
        c = self.config
        cache: dict[Any, tuple[_Entity, ...]] = {}
        rates = []
        for completion, value in zip(batch.completions, batch.column(c.entities_column), strict=True):
            key = tuple(value) if isinstance(value, list) else value
            try:
                entities = cache[key]
            except (KeyError, TypeError):
                entities = compile_entities(parse_entities(value, c.delimiter))
                try:
                    cache[key] = entities
                except TypeError:  # unhashable row value: parse every time
                    pass
            rates.append(entity_match_rate(trajectory_text(completion, c.scope), entities) if entities else 0.0)
        return rates

    @hookimpl
    def shape_rewards(self, batch: RolloutBatch) -> dict[str, torch.Tensor]:
        import torch

        c = self.config
        a = batch.reward(c.correct_reward)                                          # (N,)
        gamma = torch.tensor(self.match_rates(batch), dtype=a.dtype, device=a.device)  # (N,)
        correct = a >= c.correct_threshold
        r = torch.where(correct, torch.ones_like(a), c.alpha * gamma)
        r = r.masked_fill(torch.isnan(a), float("nan"))                            # unscored stays unscored
        if r.numel():
            wrong = (~correct & ~torch.isnan(a)).to(a.dtype)
            n_wrong = wrong.sum()
            stats = torch.stack([
                gamma.mean(),                                                       # mean entity match rate
                (r.nan_to_num(0.0) * wrong).sum() / n_wrong.clamp(min=1),          # mean partial credit of wrong ones
                ((gamma > 0).to(a.dtype) * wrong).sum() / n_wrong.clamp(min=1),    # wrong ones with any credit
                n_wrong,
            ]).tolist()                                                             # one host sync
            self.log_metric(batch, "match_rate", stats[0])
            if stats[3] > 0:
                self.log_metric(batch, "partial_credit", stats[1])
                self.log_metric(batch, "credited_wrong", stats[2])
        return {c.correct_reward: r}
