"""Outcome-based exploration: bonuses on final answers, from history (UCB) and within the batch.

Method. Outcome-based RL (reward = correctness of the final answer) collapses the diversity of
the answers a model gives, and the collapse on solved questions carries over to unsolved ones.
Reasoning tasks admit few distinct final answers, so exploration can be counted in *outcome*
space: per question ``x`` the trainer keeps the number of times ``N(x, a)`` each canonicalised
final answer ``a`` has been produced. *Historical exploration* adds a UCB-style bonus that is
large for answers rarely produced before; *batch exploration* subtracts a penalty from an answer
for every other completion of the same group that gave the same answer (test-time diversity).

Formulas (``y_i`` a completion, ``a(y_i)`` its canonical answer, ``n`` the group size G)::

    b_hist(x, a)  = c * min(1, 1 / sqrt(N(x, a)))                 (1/sqrt(0) = inf, so N = 0 -> c)
    b_batch(y_i)  = -c_batch * (1/n) * sum_{j != i} 1[a(y_j) = a(y_i)]
    r'(x, y_i)    = r(x, y_i) + b_hist(x, a(y_i)) + b_batch(y_i)

``N(x, a)`` counts the sightings of earlier generation rounds (``count_current_batch: false``,
methods.md "update counts after computing bonuses"); with ``count_current_batch: true`` this
round's sightings are added first (``N >= 1``). The table is updated with every completion of the
round after the bonuses are computed.

Source: Song, Kempe, Munos, "Outcome-based Exploration for LLM Reasoning", arXiv 2509.06941.
**Paper-recalled**: no official code was found; the formulas above are from methods.md section
2.11 (recalled from the paper) and the abstract ("historical exploration, which encourages rarely
observed answers via UCB-style bonuses, and batch exploration, which penalizes within-batch
repetition"). Implementation our own.

Defaults and what is NOT established (each is a config option):

- ``c = 1.0``, ``c_batch = 1.0``: the values of methods.md's test vectors; the paper's tuned
  constants are **not established**.
- ``count_current_batch = false``: methods.md's "update counts after computing bonuses"; whether
  the paper counts the current batch first is **not established**.
- ``historical_on = "all"``: the bonus goes to every answer; ``"correct"`` gives it only to
  completions whose ``correct_column`` reward is ``>= correct_threshold`` (the paper discusses
  variants; which one it recommends is **not established**).
- ``baseline = "none"``: the paper's "UCB with mean / constant baseline" variants are recalled,
  not their exact form (**not established**). ``"group_mean"`` subtracts the mean bonus of the
  group's eligible completions, ``"constant"`` subtracts ``baseline_value``.
- Batch scope = the group (``n = G``, the completions of one prompt); the paper's "batch" of a
  question is its group of samples. Unparseable answers (``unparseable = "bucket"``) share one
  bucket ``"∅"``, counted and penalised like any answer; ``"no_bonus"``: no bonus, no penalty,
  not counted (**not established**, the paper's datasets always have an extracted answer).
- Canonicalisation ``"last_number"`` (the host's ``trl_credit.last_number``, normalised:
  ``12.0 -> "12"``); ``"math_verify"`` uses ``math_verify.parse`` (first parsed value as sympy
  prints it, so ``\\frac12`` and ``1/2`` meet but ``0.5`` and ``sqrt(8)`` vs ``2*sqrt(2)`` do not;
  about 4 ms per 4 kB completion, i.e. ~30 s per 8192 completions: for competition math only).
- Table bounds ``max_prompts = 50000`` and ``max_answers_per_prompt = 32``, least-recently-seen
  evicted (an evicted answer counts as new again): engineering choices, not from the paper.
- Rows whose every reward is NaN get no bonus (a bonus alone would turn "no verdict" into a reward).
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import threading
from collections import OrderedDict
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trl_credit import ConfigError, Plugin, completion_text, hookimpl, last_number

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch, RunInfo

__all__ = ["UNPARSEABLE", "OutcomeExploration", "batch_penalty", "canonical_last_number", "canonical_last_numbers",
           "historical_bonus"]

#: The bucket of completions without a parseable final answer (``unparseable: bucket``).
UNPARSEABLE = "∅"
_NUMBER_CHARS = frozenset("0123456789,.-")   # every character a match of the host's number regex can hold
_SEP = "\x00"
_RUN = re.compile(r"-?\d[\d,.\-]*")    # from a digit (or a '-' before it) to the end of its run
_RUN_OR_SEP = re.compile(f"{_RUN.pattern}|{_SEP}")
_EMPTY: dict = {}


# ----------------------------------------------------------------------------- the two bonuses
def historical_bonus(counts: torch.Tensor, c: float = 1.0) -> torch.Tensor:
    """``c * min(1, 1/sqrt(N))`` element-wise for counts ``N >= 0`` (``N = 0`` gives ``c``)."""
    import torch

    n = counts.to(torch.float32)
    return c * torch.rsqrt(n.clamp(min=1.0)).clamp(max=1.0)


def batch_penalty(answer_ids: torch.Tensor, num_generations: int, c_batch: float = 1.0) -> torch.Tensor:
    """``-c_batch * (1/G) * #{j != i in i's group: a_j = a_i}`` for ``(N,)`` long answer ids.

    Ids need only be equal for equal answers of one group; a negative id matches nothing (no penalty).
    """
    import torch

    ids = answer_ids.reshape(-1, num_generations)                        # (M, G)
    same = (ids.unsqueeze(2) == ids.unsqueeze(1)).sum(dim=2) - 1         # (M, G) others with my answer
    same = same.masked_fill(ids < 0, 0)
    return (-c_batch / num_generations) * same.reshape(-1).to(torch.float32)


# ----------------------------------------------------------------------------- canonical answers
def canonical_last_number(text: str, window: int = 64) -> str | None:
    """The host's ``last_number(text)`` as a canonical string (``"12.50" -> "12.5"``), or None.

    Reads only the tail of the text: the window is widened until it holds a number, and its start
    is moved left onto a character that cannot belong to a number, so the result is exactly
    ``last_number(text)`` (the regex's matches consist of ``0-9 , . -`` only).
    """
    return canonical_last_numbers([text], window)[0]


def canonical_last_numbers(texts: list[str], window: int = 64) -> list[str | None]:
    r"""`canonical_last_number` of every text, with one regex scan over all the tails.

    Every match of the host's number regex (``(?:(?<!\d)-)?\d+(?:,\d{3})*(?:\.\d+)?``) consists of
    ``0-9 , . -`` characters and contains a digit. So the last match of a text lies in the last
    stretch that starts at a digit (or at a ``-`` right before it, which no digit can precede
    there) and runs over those characters; its matches are the same read alone, so the host's
    ``last_number`` reads that short stretch only. One C-level scan finds the stretch of every tail.
    """
    tails = [_tail(text, window) for text in texts]
    joined = _SEP.join(tails)
    if joined.count(_SEP) != len(tails) - 1:                    # a text holds the separator itself
        runs = [_last(_RUN.findall(tail)) for tail in tails]
    else:
        runs, last = [], None
        for token in _RUN_OR_SEP.findall(joined + _SEP):          # digit runs, and _SEP after each tail
            if token == _SEP:
                runs.append(last)
                last = None
            else:
                last = token
    out = []
    for text, tail, run in zip(texts, tails, runs):
        wide = window
        while run is None and len(tail) < len(text):               # no number in the tail: widen
            wide *= 4
            tail = _tail(text, wide)
            run = _last(_RUN.findall(tail))
        if run is None:
            out.append(None)
            continue
        run = run.rstrip(",.-")                                      # a match ends with a digit
        if run.isdigit():                                            # the common case: a plain integer
            out.append(run.lstrip("0") or "0")
        else:
            out.append(_canonical(last_number(run)))                # the host's reading of the stretch
    return out


def _tail(text: str, window: int) -> str:
    start = len(text) - window
    if start <= 0:
        return text
    while start > 0 and text[start] in _NUMBER_CHARS:
        start -= 1
    return text[start:]


def _last(tokens: list[str]) -> str | None:
    return tokens[-1] if tokens else None


def _canonical(value: Decimal) -> str:
    """A number as ``last_number`` reads it, normalised: ``"1,000.50" -> "1000.5"``, ``"-0" -> "0"``."""
    return "0" if value == 0 else format(value.normalize(), "f")


def _math_verify(text: str, timeout: int) -> str | None:
    from math_verify import parse

    if threading.current_thread() is not threading.main_thread():
        timeout = 0  # math_verify's timeout uses signal.alarm, main thread only
    try:
        parsed = parse(text, parsing_timeout=timeout or None)
    except Exception:  # noqa: BLE001 - a parser failure is an unparseable answer, not a crash
        return None
    return str(parsed[0]) if parsed else None


def _prompt_key(index: int, prompt: Any) -> int | str:
    """The dataset row when known, else the prompt text (chat prompts as canonical JSON)."""
    if index >= 0:
        return index
    if isinstance(prompt, str):
        return prompt
    return json.dumps(prompt, sort_keys=True, default=str, ensure_ascii=False)


# ----------------------------------------------------------------------------- the plugin
class OutcomeExploration(Plugin):
    """Outcome-based exploration (arXiv 2509.06941, paper-recalled): reward bonus over final answers.

    ``b_hist = c * min(1, 1/sqrt(N(x, a)))`` from a per-question count table of canonical answers
    (checkpointed) plus ``b_batch = -c_batch/G * #{j != i: a_j = a_i}`` within the group; appended
    as a reward column (or added to one).
    """

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        historical: bool = Field(True, description="add the historical UCB bonus c * min(1, 1/sqrt(N(x, a)))")
        c: float = Field(1.0, ge=0.0, description="historical bonus scale c (not established; methods.md vectors use 1)")
        count_current_batch: bool = Field(
            False, description="N(x, a) includes this round's sightings before the bonus (N >= 1); false = only "
            "earlier rounds, the table updated after the bonus (methods.md); not established")
        historical_on: Literal["all", "correct"] = Field(
            "all", description="which completions get the historical bonus: every one, or only those whose "
            "correct_column reward is >= correct_threshold (paper variants; not established)")
        correct_column: str | None = Field(
            None, description="reward column telling correctness (needed with historical_on: correct)")
        correct_threshold: float = Field(0.5, description="a completion is correct when correct_column >= this")
        baseline: Literal["none", "group_mean", "constant"] = Field(
            "none", description="subtract from the historical bonus of eligible completions: nothing, the mean "
            "bonus of the group's eligible completions, or baseline_value (recalled 'UCB-Mean/UCB-Con' variants; "
            "not established)")
        baseline_value: float = Field(0.0, description="the constant subtracted with baseline: constant")
        batch: bool = Field(True, description="add the within-group repetition penalty b_batch")
        c_batch: float = Field(1.0, ge=0.0, description="repetition penalty scale (not established; methods.md uses 1)")
        canonicalizer: Literal["last_number", "math_verify"] = Field(
            "last_number", description="final-answer extraction: the last number in the text (trl_credit.last_number, "
            "normalised) or math_verify.parse (slow: ~4 ms per completion)")
        parse_timeout: int = Field(5, ge=0, description="math_verify parsing timeout in seconds (0 = none)")
        unparseable: Literal["bucket", "no_bonus"] = Field(
            "bucket", description="a completion without a final answer: counted as the answer '∅' (bonus and "
            "penalty like any answer), or given no bonus, no penalty and not counted")
        max_prompts: int = Field(50_000, ge=1, description="questions kept in the count table; the least "
                                 "recently seen is evicted beyond this")
        max_answers_per_prompt: int = Field(32, ge=1, description="answers kept per question; the least "
                                            "recently seen is evicted beyond this (it then counts as new)")
        column: str = Field("exploration_bonus", min_length=1,
                            description="name of the reward column appended with the bonus (when add_to is null)")
        add_to: str | None = Field(None, description="add weight * bonus to this existing reward column instead "
                                   "of appending a column (NaN entries stay NaN)")
        weight: float = Field(1.0, description="weight of the appended column, or factor of the bonus with add_to")

        @model_validator(mode="after")
        def _check(self):
            if self.historical_on == "correct" and not self.correct_column:
                raise ValueError("historical_on: correct needs correct_column (the correctness reward column)")
            if not (self.historical or self.batch):
                raise ValueError("historical and batch are both off: the plugin would do nothing")
            return self

    def __init__(self, config: Config | None = None):
        super().__init__(config)
        # prompt key -> (canonical answer -> count), both in least-recently-seen-first order
        self.table: OrderedDict[int | str, dict[str, int]] = OrderedDict()

    # ------------------------------------------------------------------ contract
    def required_rewards(self) -> list[str]:
        """Reward columns read: ``add_to`` and, with ``historical_on: correct``, ``correct_column``."""
        names = [self.config.add_to] if self.config.add_to else []
        if self.config.historical and self.config.historical_on == "correct":
            names.append(self.config.correct_column)
        return names

    def check_args(self, run: RunInfo) -> None:
        """Refuse, before the model loads, an appended column that a reward function already produces and
        ``canonicalizer: math_verify`` without the ``math_verify`` package."""
        cfg = self.config
        if cfg.add_to is None and cfg.column in run.reward_names:
            raise ConfigError.for_key(
                "column", f"the bonus column {cfg.column!r} would be appended, but a reward function already "
                f"produces a column of that name (reward functions: {list(run.reward_names)})",
                f"set `column` to another name, or `add_to: {cfg.column}` to add the bonus to it")
        if cfg.canonicalizer == "math_verify" and importlib.util.find_spec("math_verify") is None:
            raise ConfigError.for_key(
                "canonicalizer", "'math_verify' needs the math_verify package, which is not installed",
                "`pip install math-verify`, or set `canonicalizer: last_number`")

    def state_dict(self) -> dict[str, Any]:
        """The answer-count table as plain lists, least recently seen first (checkpointed by the host):
        ``{"version": 1, "table": [[prompt_key, [[answer, count], ...]], ...]}``."""
        return {"version": 1, "table": [[key, [[a, k] for a, k in answers.items()]]
                                        for key, answers in self.table.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict`'s table (pairs as lists or tuples), trimmed to this config's bounds."""
        cap = self.config.max_answers_per_prompt
        self.table = OrderedDict((key, dict(answers[-cap:])) for key, answers in state["table"])
        while len(self.table) > self.config.max_prompts:
            self.table.popitem(last=False)

    def count(self, prompt_key: int | str, answer: str) -> int:
        """``N(x, a)`` as the table holds it now (0 if never seen or evicted)."""
        return self.table.get(prompt_key, _EMPTY).get(answer, 0)

    @property
    def total_count(self) -> int:
        """Sum of every count in the table."""
        return sum(sum(answers.values()) for answers in self.table.values())

    # ------------------------------------------------------------------ helpers
    def answers(self, batch: RolloutBatch) -> list[str | None]:
        """Canonical final answer of each completion (None: unparseable)."""
        texts = [c if isinstance(c, str) else completion_text(c) for c in batch.completions]
        if self.config.canonicalizer == "last_number":
            return canonical_last_numbers(texts)
        cache: dict[str, str | None] = {}                            # math_verify is slow: parse each text once
        for text in texts:
            if text not in cache:
                cache[text] = _math_verify(text, self.config.parse_timeout)
        return [cache[text] for text in texts]

    def _update(self, pairs: list[tuple[int | str, str | None]], counts: list[int]) -> None:
        """Add ``counts[u]`` sightings of each (prompt, answer) pair; they become the most recently seen."""
        cap_answers, table = self.config.max_answers_per_prompt, self.table
        for (key, answer), k in zip(pairs, counts):
            if answer is None:                                       # unparseable with no_bonus: not counted
                continue
            bucket = table.get(key)
            if bucket is None:
                bucket = table[key] = {}
            else:
                table.move_to_end(key)
            bucket[answer] = bucket.pop(answer, 0) + k             # re-inserted last: most recently seen
            if len(bucket) > cap_answers:
                del bucket[next(iter(bucket))]                      # dicts keep insertion order
        while len(table) > self.config.max_prompts:
            table.popitem(last=False)

    # ------------------------------------------------------------------ hook
    @hookimpl
    def shape_rewards(self, batch: RolloutBatch) -> dict[str, Any]:
        import torch

        cfg, n, g, device = self.config, batch.num_completions, batch.num_generations, batch.device
        if cfg.add_to is None and cfg.column in batch.reward_names:
            raise ValueError(f"reward column {cfg.column!r} already exists; set `column` to another name "
                             f"or `add_to: {cfg.column}` to add the bonus to it")
        parsed = self.answers(batch)
        # one prompt per group (groups are consecutive rows of one prompt)
        group_keys = [_prompt_key(i, p) for i, p in zip(batch.prompt_index[::g].tolist(), batch.prompts[::g])]

        # pair ids: equal (prompt, answer) -> equal id in 0..U-1, in first-seen order
        answers = parsed if cfg.unparseable == "no_bonus" else [UNPARSEABLE if a is None else a for a in parsed]
        keys = [key for key in group_keys for _ in range(g)]
        pairs = list(dict.fromkeys(zip(keys, answers)))
        index = {pair: u for u, pair in enumerate(pairs)}
        ids = torch.tensor(list(map(index.__getitem__, zip(keys, answers))), dtype=torch.long, device=device)
        u = len(pairs)
        valid = torch.tensor([a is not None for a in answers], dtype=torch.bool, device=device)
        slot = torch.where(valid, ids, u)                          # slot u: no answer, count 0
        table = self.table
        before = torch.tensor([table.get(k, _EMPTY).get(a, 0) for k, a in pairs] + [0],
                              dtype=torch.float32, device=device)[slot]
        in_round = torch.bincount(slot, minlength=u + 1)[:u]       # sightings of each pair this round

        bonus = torch.zeros(n, dtype=torch.float32, device=device)
        unparsed = sum(a is None for a in parsed) / max(n, 1)
        stats = [torch.tensor(unparsed, device=device),
                 ((before == 0) & valid).float().sum() / valid.sum().clamp(min=1)]
        if cfg.historical:
            counts = before
            if cfg.count_current_batch:
                counts = before + torch.cat([in_round, in_round.new_zeros(1)]).to(torch.float32)[slot]
            eligible = valid
            if cfg.historical_on == "correct":
                eligible = eligible & (batch.reward(cfg.correct_column) >= cfg.correct_threshold)  # NaN: False
            hist = historical_bonus(counts, cfg.c)
            if cfg.baseline == "constant":
                hist = hist - cfg.baseline_value
            elif cfg.baseline == "group_mean":
                e = batch.grouped(eligible.to(torch.float32))
                mean = (batch.grouped(hist) * e).sum(dim=1) / e.sum(dim=1).clamp(min=1)
                hist = hist - mean.repeat_interleave(g)
            hist = torch.where(eligible, hist, 0.0)
            bonus = bonus + hist
            stats.append(hist.mean())
        if cfg.batch:
            # a unique negative id per unanswered completion: it matches nothing
            unique = torch.where(valid, slot, -1 - torch.arange(n, device=device))
            penalty = batch_penalty(unique, g, cfg.c_batch)
            bonus = bonus + penalty
            stats.append(penalty.mean())

        self._update(pairs, in_round.tolist())               # after the bonus (methods.md)

        no_verdict = torch.isnan(batch.rewards).all(dim=1)
        bonus = bonus.masked_fill(no_verdict, 0.0)
        stats.append(bonus.mean())
        values = torch.stack(stats).tolist()                           # one host sync
        names = ["unparseable_fraction", "new_answer_fraction"] + ["historical_bonus"] * cfg.historical \
            + ["batch_penalty"] * cfg.batch + ["bonus"]
        for name, value in zip(names, values):
            self.log_metric(batch, name, value)
        self.log_metric(batch, "table_prompts", len(self.table))
        self.log_metric(batch, "table_answers", sum(map(len, self.table.values())))

        if cfg.add_to is not None:
            return {cfg.add_to: batch.reward(cfg.add_to) + cfg.weight * bonus}
        # a new column stays NaN on a no-verdict row, so the row stays unscorable (GRPO: out of the baseline, 0)
        return {cfg.column: (bonus.masked_fill(no_verdict, math.nan), cfg.weight)}

