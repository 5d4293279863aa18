r"""TACO: Tool-Augmented Credit Optimization, two coupled advantage channels for tool calls (an estimator).

Method. A rollout is cut into segments: the tool calls, each followed by what it returned, and a final answer
segment. (1) DAPR, the Differential Answer-Probe Reward: a probe cue inserted into the rollout makes the policy
state its answer there. Comparing the run's own outcome reward on answers elicited before a call with answers
elicited after it gives the call's value: positive when the call helped, negative when it misled, zero when it
changed nothing. Because this is a difference, an answer the probe would get right anyway earns nothing. (2)
OGAR, Outcome-Gated Advantage Routing: the outcome advantage goes only to the segments responsible for the
outcome. A useful call is not blamed for a failure; a misleading or idle call is not rewarded for a success and
is blamed for a failure. The rule has no parameters and discourages wasted calls without a cost term.

Two plugins, one formula. ``taco_probe``: the segments are the steps of a single completion (split by
``pattern``, `trl_credit.step_ends`). ``taco``: they are the model turns of a multi-turn rollout (TRL's tool mask,
`RolloutBatch.turns`); a turn and the reply it got are one call, and the last turn is the answer.

Formula. Completion ``i`` of group ``g`` has kept segments ``k = 0 .. c_i - 1``; ``b_ik`` is the prefix length
(in completion tokens) where segment ``k`` starts, with ``b_i0 = 0`` the prompt alone (for ``taco`` the start of
turn ``k``, after the reply to turn ``k - 1``). ``a_iks``, ``s = 1 .. m``, are answers sampled after
``prompt + y_i[:b_ik] + cue``; ``r(.)`` scores one answer::

    J_ik   = mean_s r(a_iks)                              NaN scores are skipped (all NaN: J = NaN)
             score "rewards": r = the run's reward functions on answer_prefix + a_iks (`RolloutBatch.score_texts`;
                              the weighted total, or the column `reward`)
             score "answer":  r = 1[last_number(a_iks) == last_number(answer_i)]  (exact numeric equality)
    d_ik   = J_i,k+1 - J_ik          k = 0 .. c_i - 2: the call segments; the answer segment c_i - 1 has none
    Z_ik   = (d_ik - mean_g d) / (sigma_g d + 1e-6)       over every scored call of the group (population sigma;
             `trl_credit.group_normalise`: a constant pool gives 0)                              DAPR
    A_i    = TRL's GRPO outcome advantage (the run's scale_rewards and aggregation)
    gated:     O_ik = A_i  if (A_i > 0 and d_ik > 0) or (A_i < 0 and d_ik <= 0)  else 0        OGAR
    broadcast: O_ik = A_i
    A_it   = O_ik + probe_coef * Z_ik     on the model tokens t of call segment k
    A_it   = A_i                          on the answer segment and on model tokens outside any call segment
    A_it   = 0                            on environment tokens and padding (the loss ignores them)

Source: "TACO: Tool-Augmented Credit Optimization for Agentic Tool Use" (2026), abstract only, no official code:
[abstract-inferred]. Established by the abstract: the two channels; a call's value is the difference in outcome
reward between answers elicited with and without it, scored by the run's own answer checker; the sign reading
(useful, misleading, no effect); the outcome advantage goes only to the responsible segments, conditioned on the
call's value, with no parameter and no cost term. Chosen here: the probe points (the start of each segment, so
"without" the call is the history before it and "with" it is the history after its reply); J as the mean over
``num_samples`` answers; DAPR as d z-scored over the calls of a group and added with ``probe_coef`` (1.0); the
gate above (0 is idle, treated as misleading); the cue ``"My final answer is"`` with the scored text
``answer_prefix + sample``, as MRT builds it; a call whose d cannot be scored (every probe unscorable) counts as
no call (plain A_i, out of the pool); rows without a reward or dropped by a filter are not probed; ``max_steps`` /
``max_turns`` (8) keep the last segments, and earlier ones merge into the first kept one.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from trl_credit import (ConfigError, Plugin, Regex, answer_prefix, grpo_advantages, group_normalise, hookimpl,
                        last_number, step_ends, token_steps)

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch, RunInfo

__all__ = ["TACO", "TACO_CUE", "TacoProbe", "answer_prefix", "call_values", "dapr", "route", "step_segments",
           "token_advantages", "turn_segments"]

TACO_CUE = "My final answer is"

#: bundled reward functions that read a rollout field (the outcome), not the text they are given
_OUTCOME_READERS = ("guess_reward", "scripted_turns_reward")


def call_values(j: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``(N, S)`` d: ``J_k+1 - J_k`` for the call segments ``k < count - 1``, NaN on the answer segment and past it."""
    import torch

    n, s = j.shape
    later = torch.cat([j[:, 1:], torch.full((n, 1), math.nan, dtype=j.dtype, device=j.device)], dim=1)
    call = torch.arange(s, device=j.device).unsqueeze(0) < (count.to(j.device) - 1).unsqueeze(1)
    return torch.where(call, later - j, math.nan)


def dapr(d: torch.Tensor, num_generations: int, mode: str = "group") -> torch.Tensor:
    """``(N, S)`` Z: the scored calls' d normalised over each group's pool of calls (0 where d is NaN)."""
    import torch

    scored = torch.isfinite(d)
    return group_normalise(d, scored, num_generations, mode)


def route(outcome: torch.Tensor, d: torch.Tensor, routing: str = "gated") -> torch.Tensor:
    """``(N, S)`` the outcome advantage each segment receives: OGAR's gate on the scored calls (a useful call is
    not blamed, a misleading or idle one is not rewarded), ``A_i`` where d is NaN (no call) or with ``broadcast``."""
    import torch

    a = outcome.to(d.dtype).unsqueeze(1).expand_as(d)
    if routing == "broadcast":
        return a.clone()
    responsible = ((a > 0) & (d > 0)) | ((a < 0) & (d <= 0))
    return torch.where(torch.isfinite(d) & ~responsible, 0.0, a)


def token_advantages(outcome: torch.Tensor, routed: torch.Tensor, z: torch.Tensor, d: torch.Tensor,
                     segment: torch.Tensor, model: torch.Tensor, probe_coef: float) -> torch.Tensor:
    """``(N, T)``: ``routed + probe_coef * Z`` of its segment on a model token of a scored call, ``A_i`` on other
    model tokens, 0 on environment tokens and padding."""
    import torch

    inside = segment >= 0
    at = segment.clamp(min=0)
    call = inside & torch.isfinite(d).gather(1, at)
    per_token = routed.gather(1, at) + probe_coef * z.gather(1, at)
    a = torch.where(call, per_token, outcome.to(routed.dtype).unsqueeze(1))
    return torch.where(model, a, 0.0)


def step_segments(batch: RolloutBatch, pattern: str, max_steps: int | None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(starts (N, S), segment (N, T), count (N,))`` for the steps of single completions: the prefix length where
    each kept step starts (0 for the first), the kept step of every token (-1 outside) and the kept steps."""
    import torch

    ends = step_ends(batch, pattern, max_steps).to(batch.device)
    n, s = ends.shape
    count = (ends >= 0).sum(1)
    column = torch.arange(s, device=batch.device).unsqueeze(0)
    previous = torch.cat([torch.zeros(n, 1, dtype=torch.long, device=batch.device), ends[:, :-1]], 1)[:, :s]
    starts = torch.where(column < count.unsqueeze(1), previous, -1)
    index, steps = token_steps(batch, pattern, fill=True)
    index = index.to(batch.device)
    total = torch.tensor([len(x) for x in steps], dtype=torch.long, device=batch.device)
    offset = (total - count).clamp(min=0).unsqueeze(1)  # steps merged into the first kept one
    return starts, torch.where(index >= 0, (index - offset).clamp(min=0), -1), count


def turn_segments(batch: RolloutBatch, max_turns: int | None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(starts (N, S), segment (N, T), count (N,))`` for the model turns of multi-turn rollouts: where each kept
    turn starts (after the reply to the one before), the kept turn of every model token and the kept turns."""
    import torch

    info = batch.turns()
    begins = info.starts().to(batch.device)
    n, k = begins.shape
    total = info.count.to(batch.device)
    offset = (total - max_turns).clamp(min=0) if max_turns is not None else torch.zeros_like(total)
    count = total - offset
    s = min(k, max_turns) if max_turns is not None else k
    column = torch.arange(s, device=batch.device).unsqueeze(0)
    source = (column + offset.unsqueeze(1)).clamp(max=max(k - 1, 0))
    starts = begins.gather(1, source) if s else begins[:, :0]
    if s:  # the first kept segment holds the merged early turns: it starts where turn 0 does
        starts = torch.cat([begins[:, :1], starts[:, 1:]], 1)
    starts = torch.where(column < count.unsqueeze(1), starts, -1)
    index = info.index.to(batch.device)
    return starts, torch.where(index >= 0, (index - offset.unsqueeze(1)).clamp(min=0), -1), count


def _positive(what: str, example: str):
    def check(cls, value):
        if value is not None and value < 1:
            raise ValueError(f"must be >= 1 ({what}), got {value}; set it to e.g. {example}")
        return value

    return check


class _Options(BaseModel):
    """Options shared by both plugins."""

    model_config = ConfigDict(extra="forbid")
    score: Literal["rewards", "answer"] = Field(
        "rewards", description="how a probe answer is judged: rewards = the run's reward functions on "
        "answer_prefix + the answer (score_texts); answer = its last number against the dataset column "
        "answer_column (for rewards that read rollout fields, e.g. the guess task)")
    cue: str = Field(TACO_CUE, description="probe text appended after a prefix to elicit the answer")
    answer_prefix: str | None = Field(None, description="score: rewards: text put before each sampled answer when "
                                      "it is scored; null: the cue after its last '</think>', leading whitespace "
                                      "stripped")
    answer_column: str = Field("answer", description="score: answer: the dataset column with the gold answer")
    reward: str | None = Field(None, description="score: rewards: reward column that judges a probe answer; null: "
                               "the weighted total of the run's rewards")
    num_samples: int = Field(4, description="probe answers per probe point (J is their mean score)")
    max_new_tokens: int = Field(16, description="tokens per probe answer at most")
    temperature: float | None = Field(None, description="probe sampling temperature; null: the run's temperature")
    probe_coef: float = Field(1.0, description="weight of the DAPR term Z added on a call's tokens")
    routing: Literal["gated", "broadcast"] = Field(
        "gated", description="gated: OGAR, a call receives the outcome advantage only when responsible for it; "
        "broadcast: every token gets it (plain GRPO plus DAPR)")
    normalise: Literal["group", "mean", "none"] = Field(
        "group", description="DAPR: d over the calls of a group z-scored (group), mean-centred (mean) or raw (none)")

    _samples = field_validator("num_samples")(classmethod(_positive("J is the mean over that many probe answers", 4)))
    _tokens = field_validator("max_new_tokens")(classmethod(_positive("a probe answer needs a token", 16)))

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value):
        if value is not None and not value > 0:
            raise ValueError(f"must be > 0 (a sampling temperature), got {value}; use null for the run's temperature")
        return value

    @field_validator("probe_coef")
    @classmethod
    def _coef(cls, value):
        if not (value >= 0 and math.isfinite(value)):
            raise ValueError(f"must be a finite number >= 0, got {value}; 0 switches DAPR off, 1.0 is the default")
        return value

    @field_validator("cue")
    @classmethod
    def _cue(cls, value):
        if not value.strip():
            raise ValueError("must not be empty: a probe needs a cue that elicits the answer, e.g. "
                             f"{TACO_CUE!r}")
        return value


class _TacoBase(Plugin):
    """The shared estimator: probe J at each segment start, d per call, DAPR and OGAR (see the module)."""

    Config = _Options

    def required_rewards(self):
        return [self.config.reward] if self.config.reward and self.config.score == "rewards" else []

    def required_columns(self):
        return [self.config.answer_column] if self.config.score == "answer" else []

    def check_args(self, run: RunInfo) -> None:
        cfg = self.config
        unused = ("reward", "answer_prefix") if cfg.score == "answer" else ("answer_column",)
        for key in unused:
            if key in cfg.model_fields_set:
                other = "rewards" if cfg.score == "answer" else "answer"
                raise ConfigError.for_key(key, f"{key} = {getattr(cfg, key)!r} has no effect with score {cfg.score!r} "
                                          f"(it applies to score {other!r})", f"remove `{key}`, or set `score: {other}`")
        readers = [name for name in run.reward_names if name in _OUTCOME_READERS]
        if cfg.score == "rewards" and readers:
            raise ConfigError.for_key("score", f"score 'rewards' judges probe answers with the run's reward "
                                      f"functions, but {readers[0]} reads the rollout's outcome field, not the text: "
                                      "every probe would get the row's own outcome", "set `score: answer` (the probe's "
                                      "last number against the dataset column `answer`)")

    def _segments(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _outcome_column(self, batch: RolloutBatch) -> torch.Tensor:
        """``(N,)`` what a probe's score is compared with (the refusal check): the column or the total reward."""
        return batch.reward(self.config.reward) if self.config.reward else batch.total_reward()

    # ------------------------------------------------------------------ J
    def success(self, batch: RolloutBatch, points: torch.Tensor) -> torch.Tensor:
        """``(N, P)`` J: the mean score of the answers probed after each prefix (NaN where ``points < 0``)."""
        import torch

        cfg = self.config
        s = cfg.num_samples
        temperature = cfg.temperature or float(getattr(batch.args, "temperature", None) or 1.0)
        n, p = points.shape
        per = torch.full((n, p, s), math.nan, device=batch.device)
        if not bool((points >= 0).any()):
            return per.mean(-1)
        probes = batch.probe(points, cfg.cue, num_samples=s, max_new_tokens=cfg.max_new_tokens,
                             temperature=temperature, top_k=1)
        entries = [(i, k, j) for i, k in probes.valid.nonzero().tolist()
                   for j in range(min(s, len(probes.texts[i][k])))]
        rows = [i for i, _, _ in entries]
        texts = [probes.texts[i][k][j] or "" for i, k, j in entries]
        values = self._scores(batch, rows, texts) if cfg.score == "rewards" else self._answer_scores(batch, rows, texts)
        at = torch.tensor(entries, dtype=torch.long, device=batch.device).T
        per[at[0], at[1], at[2]] = values.to(per)
        return torch.nanmean(per, dim=-1)

    def _answer_scores(self, batch: RolloutBatch, rows: list[int], texts: list[str]) -> torch.Tensor:
        """1 where the answer's last number equals the gold's (as numbers), 0 where not, NaN without a gold number."""
        import torch

        gold = [None if a is None else last_number(str(a)) for a in batch.column(self.config.answer_column)]
        values = [math.nan if gold[r] is None else float(last_number(t) == gold[r]) for r, t in zip(rows, texts)]
        return torch.tensor(values, dtype=torch.float32, device=batch.device)

    def _scores(self, batch: RolloutBatch, rows: list[int], texts: list[str]) -> torch.Tensor:
        """The run's rewards on ``answer_prefix + text`` (each distinct (row, text) once), and the refusal check."""
        import torch

        cfg = self.config
        prefix = cfg.answer_prefix if cfg.answer_prefix is not None else answer_prefix(cfg.cue)
        keys = [(r, prefix + t) for r, t in zip(rows, texts)]
        unique = list(dict.fromkeys(keys))
        outcome = self._outcome_column(batch).float()
        pair = self._contrast(batch, outcome, unique)
        wanted = unique + [key for key in pair if key not in set(unique)]
        scores = batch.score_texts([r for r, _ in wanted], [t for _, t in wanted])
        if cfg.reward:
            value = scores[:, batch.reward_names.index(cfg.reward)]
        else:  # the weighted total, NaN where every column is NaN (as `total_reward`)
            value = (scores * batch.reward_weights.to(scores).unsqueeze(0)).nansum(1)
            value = value.masked_fill(torch.isnan(scores).all(1), math.nan)
        where = {key: u for u, key in enumerate(wanted)}
        if pair:
            (i, text), (j, _) = pair
            vi, vj = float(value[where[pair[0]]]), float(value[where[pair[1]]])
            if abs(vi - float(outcome[i])) < 1e-6 and abs(vj - float(outcome[j])) < 1e-6:
                raise ValueError(
                    f"score: rewards judges probe answers with the run's reward functions, but they gave the same "
                    f"text {text!r} the score {vi:g} for row {i} and {vj:g} for row {j} of the same prompt: each row's "
                    "own outcome. They read a rollout field (e.g. the guess task's `guess_solved`), not the text. "
                    "Fix: set `score: answer` (the probe's last number against the dataset column `answer`)")
        index = torch.tensor([where[key] for key in keys], dtype=torch.long, device=value.device)
        return value[index]

    @staticmethod
    def _contrast(batch: RolloutBatch, outcome: torch.Tensor, unique: list) -> list:
        """``[(i, text), (j, text)]``: one probed text of row ``i`` also scored for a row ``j`` of its group with
        another outcome (an answer checker must score a text of one prompt alike); ``[]`` when there is none."""
        g = batch.num_generations
        values = outcome.tolist()
        for i, text in unique:  # bounded by the batch: stops at the first usable row
            if not math.isfinite(values[i]):
                continue
            for j in range(i // g * g, i // g * g + g):
                if j != i and math.isfinite(values[j]) and abs(values[j] - values[i]) > 1e-6:
                    return [(i, text), (j, text)]
        return []

    # ------------------------------------------------------------------ the estimator
    @hookimpl
    def compute_advantages(self, batch: RolloutBatch) -> torch.Tensor:
        import torch

        cfg = self.config
        args = batch.args
        outcome = grpo_advantages(batch.rewards, batch.reward_weights, batch.num_generations,
                                  getattr(args, "scale_rewards", "group"),
                                  getattr(args, "multi_objective_aggregation", "sum_then_normalize")).to(batch.device)
        starts, segment, count = self._segments(batch)
        judged = torch.isfinite(batch.total_reward()) & batch.kept.to(batch.device)
        calls = torch.where(judged, (count - 1).clamp(min=0), 0)
        self.log_metric(batch, "calls", float(calls.float().mean()) if calls.numel() else 0.0)
        if not bool((calls > 0).any()):  # no call anywhere: TRL's GRPO advantages, unchanged
            return outcome.float()
        points = torch.where((calls > 0).unsqueeze(1), starts, -1)
        j = self.success(batch, points)
        d = call_values(j, torch.where(calls > 0, count, 0))
        z = dapr(d, batch.num_generations, cfg.normalise)
        routed = route(outcome, d, cfg.routing)
        model = batch.turns().model.to(batch.device)
        advantages = token_advantages(outcome, routed, z, d, segment, model, cfg.probe_coef)
        self._log(batch, calls, j, d, outcome, routed, segment, model)
        return advantages.float()

    def _log(self, batch, calls, j, d, outcome, routed, segment, model) -> None:
        import torch

        scored = torch.isfinite(d)
        self.log_metric(batch, "scored_calls", float(scored.sum()) / max(int(calls.sum()), 1))
        first = j[:, 0][torch.isfinite(j[:, 0])]
        if first.numel():
            self.log_metric(batch, "j_start", float(first.mean()))
        values = d[scored]
        if values.numel():
            self.log_metric(batch, "value", float(values.mean()))
            for name, hit in (("useful", values > 0), ("misleading", values < 0), ("idle", values == 0)):
                self.log_metric(batch, name, float(hit.float().mean()))
        at = segment.clamp(min=0)
        gated = model & (segment >= 0) & scored.gather(1, at) & (routed.gather(1, at) == 0)
        credit = outcome.abs().unsqueeze(1) * model
        total = float(credit.sum())
        self.log_metric(batch, "routed_away", float((credit * gated).sum()) / total if total > 0 else 0.0)


class TacoProbe(_TacoBase):
    """TACO on the steps of single completions: answer probes at each step start value the step (DAPR), and the
    outcome advantage reaches a step only when it is responsible for the outcome (OGAR)."""

    name = "taco_probe"

    class Config(_Options):
        pattern: Regex = Field(r"\n+", description="regex separating the steps (segments) of a completion; the last "
                               "step is the answer segment")
        max_steps: int | None = Field(8, description="steps per completion at most (the last ones; earlier steps "
                                      "merge into the first kept): bounds the probes")

        _steps = field_validator("max_steps")(classmethod(_positive("it bounds the probed steps", 8)))

    def check_args(self, run: RunInfo) -> None:
        super().check_args(run)
        if re.compile(self.config.pattern).fullmatch("") is not None:
            raise ConfigError.for_key("pattern", f"{self.config.pattern!r} matches the empty string, so every "
                                      "character would end a step (a probe each)",
                                      "use a delimiter that needs at least one character, e.g. '\\n+'")

    def _segments(self, batch):
        return step_segments(batch, self.config.pattern, self.config.max_steps)


class TACO(_TacoBase):
    """TACO on multi-turn rollouts: a model turn and the reply it got are one tool call, valued by answer probes at
    the turn starts (DAPR); OGAR routes the outcome advantage to the responsible turns; the last turn answers."""

    name = "taco"

    class Config(_Options):
        max_turns: int | None = Field(8, description="turns per rollout at most (the last ones; earlier turns merge "
                                      "into the first kept): bounds the probes")

        _turns = field_validator("max_turns")(classmethod(_positive("it bounds the probed turns", 8)))

    def _segments(self, batch):
        return turn_segments(batch, self.config.max_turns)
