r"""MatchTIR: turn rewards from a bipartite matching of tool calls, and a dual-level advantage.

Method. The tool calls a trajectory made are matched against the prompt's gold tool calls (a dataset column):
each (predicted, gold) pair gets a matching score from the tool name, the argument names and the argument
values; an assignment (hard: one-to-one, optimal; soft: an optimal-transport plan) gives every predicted call
a reward; a turn's reward is the mean reward of its calls. Turn rewards are discounted backwards, normalised
within the group, and mixed with a trajectory-level GRPO advantage, so every turn of a trajectory gets its own
advantage (redundant or wrong calls less than the calls that hit the gold trace).

Formula (trajectory ``i`` of a group, model turns ``k = 0 .. c_i - 1``, predicted calls ``p_1 .. p_m`` in order,
gold calls ``g_1 .. g_n``, ``N(x)`` the argument names of a call, ``o_i`` the outcome reward)::

    S_ab  = 1[name(p_a) = name(g_b)] * (1 + J(N(p_a), N(g_b)) + sum_{q in N(g_b)} 1[p_a[q] = g_b[q]]) / (2 + |N(g_b)|)
            J = |A & B| / |A | B| (1 when both are empty)
    hard (KM):  sigma = argmax over one-to-one partial matchings of sum_a S_a,sigma(a);
                s_a = S_a,sigma(a) when matched with S > 0, else `unmatched_penalty`
    greedy:     pairs taken by descending S (ties: earlier p, then earlier g) while both are free and S > 0
    soft (OT):  T = Sinkhorn(mu = 1/m, nu = 1/n, cost = -S, reg);   s_a = sum_b T_ab S_ab
    r_ik  = mean_{a in turn k} s_a   (0 for a turn without calls)   + [k = c_i - 1] o_i   (outcome_turn)
    R_ik  = sum_{j >= k} gamma^(j-k) r_ij                               (gamma = 0.9)
    turn level (norm "index"): Z_ik = (R_ik - mean_k) / (std_k + 1e-6) over the group's trajectories with a
            k-th turn, std unbiased; a lone trajectory at its index keeps Z = R (lone "raw"; "zero": 0).
            norm "group": the same over all turns of the group pooled.
    trajectory level: A_i = GRPO(sum_k r_ik) (trajectory "turns") or GRPO(o_i) (trajectory "outcome"),
            the run's own GRPO (`trl_credit.grpo_advantages`, its ``scale_rewards``)
    A_it  = (1 - w) A_i + w Z_i,k(t)   on the tokens of turn k (w = 0.5: the code's (A + Z) / 2)

The predicted calls are the ``tool_calls`` of the completion's assistant messages (the k-th assistant message is
model turn k, as TRL's tool loop writes them and `Turns.calls` counts them), or, with ``calls_column``, a rollout
field with one list of calls per model turn (a ``rollout_func`` whose completions are plain text). A call is
``{"name", "arguments"}`` or TRL's ``{"type": "function", "function": {...}}``; arguments may be a JSON string.

Source: the abstract (arXiv 2601.10712, Qu et al. 2026) and the code of the ACL 2026 submission,
``CyberSculptor96/MatchTIR@02ee2a53b5a801cb2ce34414ed934375d3eae970`` (read, not copied):
``Code/verl/utils/reward_score/tool.py`` (``tool_similarity``, ``assign_rewards_hungarian``, ``assign_rewards_ot``,
``compute_process_KM``, ``compute_process_ot``) and ``Code/verl/trainer/ppo/core_algos.py``
(``compute_grpo_outcome_advantage``: the dual-level advantage). The official ``quchangle1/MatchTIR`` as stored
holds its README and evaluation only. Provenance [code] for everything below unless marked.

Established (code): S as above (name compared case-insensitively, argument values by ``==`` after JSON
decoding); all calls of the trajectory matched jointly against the gold list; unmatched calls 0
(``unmatched_penalty=0`` in ``compute_process_KM``); OT with uniform marginals, cost ``-S``, ``reg = 0.1``; a turn's
reward the mean over its calls; the answer turn scored by the outcome (answer F1 there); the trajectory score
the sum of the turn rewards; ``lambda = 0.9`` returns; turn advantages normalised per (group, turn index) with
the unbiased std and ``1e-6``, a lone trajectory keeping its raw return; ``(A + Z) / 2`` on each turn's tokens.

Chosen here: "hard" is the optimal one-to-one assignment the paper names (Kuhn-Munkres), solved by
``scipy.optimize.linear_sum_assignment`` (a 1e-9 tie-break weights earlier calls' scores slightly more, so a
repeated correct call earns nothing the second time); the submission code's ``hungarian_assignment`` is in fact greedy, offered as
``greedy``; OT by a log-domain Sinkhorn in torch (no POT dependency); ``values: loose`` compares numbers as numbers
and strings case-folded (not in the code); the trajectory GRPO is the host's (eps 1e-4 and NaN rules as TRL)
rather than the code's (eps 1e-6); a trajectory whose rewards are all NaN gets advantage 0 and stays out of the
turn statistics; ``trajectory: outcome`` (GRPO on the run's reward alone) and ``weight`` are options.
"""

from __future__ import annotations

import json
import math
import warnings
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from trl_credit import Plugin, discounted_returns, grpo_advantages, hookimpl

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch

__all__ = ["MatchTIR", "call_rewards", "call_score", "gold_calls", "greedy_assignment", "normalise_call",
           "optimal_assignment", "predicted_calls", "transport_plan", "turn_advantages"]

_TIE = 1e-9  # tie-break between equally good matchings: the matched score of earlier predicted calls counts more

Call = tuple[str, "dict | None"]  # (name case-folded, arguments or None when they do not parse)


# ------------------------------------------------------------------------------------------- calls
def _arguments(value: Any) -> dict | None:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError:
            return None
    if value is None:
        return {}
    return dict(value) if isinstance(value, dict) else None


def normalise_call(call: Any) -> Call:
    """``(name, arguments)`` of a call given as ``{"name", "arguments"}`` (or ``"parameters"``, the submission's
    gold field), TRL's ``{"type": "function", "function": {...}}``, or a JSON string of either. The name is
    stripped and case-folded; arguments that do not decode to an object are None (their values match nothing)."""
    if isinstance(call, str):
        try:
            call = json.loads(call)
        except ValueError:
            return ("", None)
    if not isinstance(call, dict):
        return ("", None)
    if isinstance(call.get("function"), dict):
        call = call["function"]
    arguments = call["arguments"] if "arguments" in call else call.get("parameters")
    return (str(call.get("name") or "").strip().casefold(), _arguments(arguments))


def _loose(value: Any) -> Any:
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return " ".join(value.casefold().split())
        return number if math.isfinite(number) else value
    if isinstance(value, (list, tuple)):
        return tuple(_loose(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _loose(v)) for k, v in value.items()))
    return value


def call_score(pred: Call, gold: Call, values: str = "exact") -> float:
    """``S``: name indicator times (1 + Jaccard of the argument names + gold arguments with the right value)
    over (2 + number of gold arguments); in [0, 1]."""
    if not pred[0] or pred[0] != gold[0]:
        return 0.0
    given, wanted = pred[1], gold[1] or {}
    names = set(given or {})
    union = names | set(wanted)
    jaccard = len(names & set(wanted)) / len(union) if union else 1.0
    same = (lambda x, y: _loose(x) == _loose(y)) if values == "loose" else (lambda x, y: x == y)
    content = sum(1 for q, v in wanted.items() if given is not None and q in given and same(given[q], v))
    return (1.0 + jaccard + content) / (2.0 + len(wanted))


# -------------------------------------------------------------------------------------- assignment
def optimal_assignment(scores: list[list[float]]) -> list[int | None]:
    """Hard matching: the gold index of each predicted call under the maximum-score one-to-one matching
    (scipy's ``linear_sum_assignment``, Kuhn-Munkres), None when unmatched (or matched with score 0). Of equally
    good matchings, the one crediting earlier calls wins."""
    from scipy.optimize import linear_sum_assignment

    m = len(scores)
    n = len(scores[0]) if m else 0
    if not m or not n:
        return [None] * m
    # maximise sum_a S_a,sigma(a) (1 + tie * (m - a) / m): among optimal matchings, credit goes to earlier calls
    cost = [[-scores[a][b] * (1.0 + _TIE * (m - a) / m) for b in range(n)] for a in range(m)]
    rows, cols = linear_sum_assignment(cost)
    out: list[int | None] = [None] * m
    for a, b in zip(rows.tolist(), cols.tolist()):
        if scores[a][b] > 0:
            out[a] = b
    return out


def greedy_assignment(scores: list[list[float]]) -> list[int | None]:
    """The submission code's matching: pairs by descending score (ties: earlier predicted, then gold call),
    taken while both are free and the score is > 0."""
    m = len(scores)
    n = len(scores[0]) if m else 0
    out: list[int | None] = [None] * m
    taken: set[int] = set()
    for score, a, b in sorted(((scores[a][b], a, b) for a in range(m) for b in range(n)),
                              key=lambda x: (-x[0], x[1], x[2])):
        if score > 0 and out[a] is None and b not in taken:
            out[a] = b
            taken.add(b)
    return out


def transport_plan(scores: list[list[float]], reg: float = 0.1, iterations: int = 1000,
                   tol: float = 1e-9) -> torch.Tensor:
    """Soft matching: the entropic optimal-transport plan ``(m, n)`` float64 between uniform marginals ``1/m`` and
    ``1/n`` with cost ``-S`` (Sinkhorn in the log domain, stable for any ``reg > 0``)."""
    import torch

    s = torch.tensor(scores, dtype=torch.float64)
    m, n = s.shape
    log_k = s / reg
    log_a = torch.full((m,), -math.log(m), dtype=torch.float64)
    log_b = torch.full((n,), -math.log(n), dtype=torch.float64)
    log_u = torch.zeros(m, dtype=torch.float64)
    log_v = torch.zeros(n, dtype=torch.float64)
    for it in range(iterations):  # bounded; usually converges in a few dozen
        log_v = log_b - torch.logsumexp(log_k + log_u.unsqueeze(1), dim=0)
        log_u = log_a - torch.logsumexp(log_k + log_v.unsqueeze(0), dim=1)
        if it % 10 == 9:
            columns = torch.logsumexp(log_k + log_u.unsqueeze(1) + log_v.unsqueeze(0), dim=0).exp()
            if float((columns - log_b.exp()).abs().max()) < tol:
                break
    return (log_u.unsqueeze(1) + log_k + log_v.unsqueeze(0)).exp()


def call_rewards(preds: list[Call], golds: list[Call], assignment: str = "hard", values: str = "exact",
                 unmatched_penalty: float = 0.0, reg: float = 0.1) -> tuple[list[float], list[int | None]]:
    """Per-call rewards ``s_a`` of one trajectory's calls (in order) and, for hard / greedy, the gold index each
    was matched to (None: unmatched; soft matching reports None throughout). The loops run over the calls and
    gold calls of this trajectory only."""
    m, n = len(preds), len(golds)
    if not m:
        return [], []
    if not n:
        return [0.0 if assignment == "soft" else unmatched_penalty] * m, [None] * m
    scores = [[call_score(p, g, values) for g in golds] for p in preds]
    if assignment == "soft":
        plan = transport_plan(scores, reg)
        import torch

        return (plan * torch.tensor(scores, dtype=torch.float64)).sum(1).tolist(), [None] * m
    matched = optimal_assignment(scores) if assignment == "hard" else greedy_assignment(scores)
    return [scores[a][b] if b is not None else unmatched_penalty for a, b in enumerate(matched)], matched


def gold_calls(value: Any) -> list[Call] | None:
    """The gold calls of one row: a list of calls, one call, a JSON string of either, or None / "" (no gold);
    None for anything else (malformed: the caller counts it and treats the row as having no gold calls). Gold
    arguments whose value is None are dropped (a ``datasets`` column of dicts fills the keys other rows have with
    None; a JSON-string column avoids that)."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except ValueError:
            return None
    if value is None:
        return []
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(c, (dict, str)) for c in value):
        return None
    calls = [normalise_call(c) for c in value]
    # a dataset stores a column of dicts as one Arrow struct: keys missing from a row come back as None
    return [(name, None if args is None else {q: v for q, v in args.items() if v is not None}) for name, args in calls]


def predicted_calls(batch: RolloutBatch, column: str | None = None) -> list[list[list[Call]]]:
    """Per completion, per model turn (``Turns.count``), the calls it made: from the ``tool_calls`` of its k-th
    assistant message, or from the rollout field ``column`` (one list of calls per turn). A loop over rows and
    messages, bounded by the batch and its turns."""
    counts = batch.turns().count.tolist()
    out: list[list[list[Call]]] = []
    if column is not None:
        if column not in batch.columns:
            raise KeyError(f"matchtir: calls_column {column!r} is not a rollout column (columns: "
                           f"{sorted(batch.columns)}); return it from the rollout_func, one list of calls per "
                           "model turn, or unset calls_column to read the completions' tool_calls")
        for i, row in enumerate(batch.column(column)):
            row = [] if row is None else list(row)
            if len(row) > counts[i]:
                raise ValueError(f"matchtir: {column}[{i}] lists calls for {len(row)} turns, the completion has "
                                 f"{counts[i]} model turn(s); give one list per model turn")
            out.append([[normalise_call(c) for c in ([turn] if isinstance(turn, dict) else turn or [])] for turn in row]
                       + [[] for _ in range(counts[i] - len(row))])
        return out
    for i, messages in enumerate(batch.completions):
        turns: list[list[Call]] = [[] for _ in range(counts[i])]
        k = -1
        for message in messages if isinstance(messages, list) else []:
            if isinstance(message, dict) and message.get("role") == "assistant":
                k += 1
                if k < counts[i]:
                    turns[k] = [normalise_call(c) for c in (message.get("tool_calls") or [])]
        out.append(turns)
    return out


# --------------------------------------------------------------------------------------- advantages
def turn_advantages(returns: torch.Tensor, valid: torch.Tensor, num_generations: int, norm: str = "index",
                    lone: str = "raw", eps: float = 1e-6) -> torch.Tensor:
    """``Z`` ``(N, K)``: returns normalised over the group's valid turns at the same index (``norm="index"``) or
    over all of them (``"group"``), unbiased std; a pool of one keeps its raw value (``lone="raw"``) or gets 0."""
    import torch

    n, k = returns.shape
    g = num_generations
    r = returns.reshape(-1, g, k)
    m = valid.reshape(-1, g, k).to(returns.dtype)
    dims = (1,) if norm == "index" else (1, 2)
    count = m.sum(dims, keepdim=True)
    mean = (r * m).sum(dims, keepdim=True) / count.clamp(min=1)
    var = (((r - mean) ** 2) * m).sum(dims, keepdim=True) / (count - 1).clamp(min=1)
    z = (r - mean) / (var.sqrt() + eps)
    alone = (count == 1).expand_as(r)
    z = torch.where(alone, r if lone == "raw" else torch.zeros_like(r), z)
    return (z * m).reshape(n, k)


class MatchTIR(Plugin):
    """MatchTIR's estimator: turn rewards from matching predicted against gold tool calls, dual-level advantage.

    ``A_it = (1 - w) GRPO(trajectory score)_i + w Z_ik`` on the tokens of turn ``k``, ``Z`` the group-normalised
    discounted returns of the turn rewards (mean matching score of the turn's calls, plus the outcome on the last
    turn). Source: ``CyberSculptor96/MatchTIR@02ee2a53`` (the ACL 2026 submission's code) and arXiv 2601.10712.
    """

    name = "matchtir"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        column: str = Field("gold_calls", description="dataset column with the prompt's gold tool calls: a list "
                            "of {name, arguments} (or a JSON string of one)")
        calls_column: str | None = Field(None, description="rollout field with the predicted calls, one list per "
                                         "model turn; null: the tool_calls of the completions' assistant messages")
        assignment: Literal["hard", "greedy", "soft"] = Field("hard", description="hard: optimal one-to-one "
                                                              "matching (KM); greedy: the submission code's; soft: "
                                                              "optimal transport (Sinkhorn)")
        values: Literal["exact", "loose"] = Field("exact", description="argument values equal by == after JSON "
                                                  "decoding (exact), or numbers as numbers and strings "
                                                  "case-folded (loose)")
        unmatched_penalty: float = Field(0.0, le=0.0, description="reward of a predicted call left unmatched "
                                         "(hard, greedy); the code uses 0")
        reg: float = Field(0.1, gt=0.0, description="entropic regularisation of the soft (OT) matching")
        outcome_turn: bool = Field(True, description="add the outcome reward to the last turn's reward (the code "
                                   "scores the answer turn by the answer)")
        reward: str | None = Field(None, description="outcome reward column; null: the total reward")
        trajectory: Literal["turns", "outcome"] = Field("turns", description="trajectory-level GRPO on the sum of "
                                                        "the turn rewards (the code) or on the outcome alone")
        gamma: float = Field(0.9, ge=0.0, le=1.0, description="discount of the turn returns (the code's 0.9)")
        norm: Literal["index", "group"] = Field("index", description="normalise turn returns per group and turn "
                                                "index (the code) or over all turns of the group")
        lone: Literal["raw", "zero"] = Field("raw", description="a turn alone in its pool keeps its raw return "
                                             "(the code) or gets 0")
        weight: float = Field(0.5, ge=0.0, le=1.0, description="w: weight of the turn-level advantage against "
                              "the trajectory-level one (0.5: their mean, the code)")

        @field_validator("column", "calls_column", "reward")
        @classmethod
        def _named(cls, value):
            if value is not None and not value.strip():
                raise ValueError("must be a non-empty name (or null where allowed), e.g. column: gold_calls")
            return value

    def __init__(self, config: BaseModel | None = None):
        super().__init__(config)
        self._warned = self._warned_text = False

    def required_columns(self):
        return [self.config.column]

    def required_rewards(self):
        return [self.config.reward] if self.config.reward else []

    def turn_rewards(self, batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """``r`` ``(N, K)`` match rewards per turn (outcome not included) and the matching statistics."""
        import torch

        cfg = self.config
        turns = batch.turns()
        k = turns.max_turns
        rewards = torch.zeros(batch.num_completions, k, dtype=torch.float64)
        calls, matched, gold_total, gold_hit, total, malformed = 0, 0, 0, 0, 0.0, []
        golds = batch.column(cfg.column)
        if cfg.calls_column is None and not self._warned_text:
            for i, (c, messages) in enumerate(zip(turns.count.tolist(), batch.completions)):
                said = sum(isinstance(m, dict) and m.get("role") == "assistant"
                           for m in (messages if isinstance(messages, list) else []))
                if c > 1 and said < c:
                    self._warned_text = True
                    warnings.warn(f"matchtir: completion {i} has {c} model turns but {said} assistant message(s) "
                                  "(TRL's rollout_func path keeps one plain message per rollout), so the calls of "
                                  "its other turns are not seen; return the calls per model turn as a rollout field "
                                  "and name it in calls_column", stacklevel=2)
                    break
        for i, per_turn in enumerate(predicted_calls(batch, cfg.calls_column)):  # rows; calls within a row
            flat = [(t, c) for t, turn in enumerate(per_turn) for c in turn]
            gold = gold_calls(golds[i])
            if gold is None:
                malformed.append(i)
                gold = []
            scores, match = call_rewards([c for _, c in flat], gold, cfg.assignment, cfg.values,
                                         cfg.unmatched_penalty, cfg.reg)
            for (t, _), s in zip(flat, scores):
                rewards[i, t] += s
            sizes = torch.tensor([len(turn) for turn in per_turn] + [0] * (k - len(per_turn)), dtype=torch.float64)
            rewards[i] = rewards[i] / sizes.clamp(min=1)
            calls += len(flat)
            total += sum(scores)
            matched += sum(b is not None for b in match)
            gold_total += len(gold)
            gold_hit += len({b for b in match if b is not None})
        stats = {"calls": calls / max(batch.num_completions, 1)}
        if malformed:
            stats["malformed_gold"] = len(malformed) / batch.num_completions
            if not self._warned:
                self._warned = True
                warnings.warn(f"matchtir: {cfg.column}[{malformed[0]}] = {str(golds[malformed[0]])[:80]!r} is not a "
                              "list of {name, arguments} calls (or its JSON); such rows count as having no gold "
                              f"calls (logged as trl_credit/{self.name}/malformed_gold)", stacklevel=2)
        if calls:
            stats["call_reward"] = total / calls
            if cfg.assignment != "soft":
                stats["matched"] = matched / calls
        if gold_total and cfg.assignment != "soft":
            stats["gold_recall"] = gold_hit / gold_total
        return rewards.to(torch.float32), stats

    @hookimpl
    def compute_advantages(self, batch: RolloutBatch) -> torch.Tensor:
        import torch

        cfg = self.config
        turns = batch.turns()
        k, g = turns.max_turns, batch.num_generations
        if k == 0:  # every completion is empty: no token to credit
            return torch.zeros(batch.num_completions, batch.width)
        match, stats = self.turn_rewards(batch)
        outcome = (batch.reward(cfg.reward) if cfg.reward else batch.total_reward()).float().cpu()
        count = turns.count.cpu()
        column = torch.arange(k).unsqueeze(0)
        scored = ~torch.isnan(outcome)
        valid = (column < count.unsqueeze(1)) & scored.unsqueeze(1)
        last = column == (count - 1).unsqueeze(1)
        rewards = match + (last * outcome.nan_to_num(0.0).unsqueeze(1) if cfg.outcome_turn else 0.0)
        rewards = torch.where(valid, rewards, 0.0)
        z = turn_advantages(discounted_returns(rewards, cfg.gamma), valid, g, cfg.norm, cfg.lone)
        scale = getattr(batch.args, "scale_rewards", "group")
        if cfg.trajectory == "outcome" and cfg.reward is None:
            aggregation = getattr(batch.args, "multi_objective_aggregation", "sum_then_normalize")
            a = grpo_advantages(batch.rewards.cpu(), batch.reward_weights.cpu(), g, scale, aggregation)
        else:
            score = outcome if cfg.trajectory == "outcome" else rewards.sum(1).masked_fill(~scored, math.nan)
            a = grpo_advantages(score.unsqueeze(1), torch.ones(1), g, scale, "sum_then_normalize")
        per_turn = torch.where(valid, (1 - cfg.weight) * a.float().unsqueeze(1) + cfg.weight * z, 0.0)
        for name, value in stats.items():
            self.log_metric(batch, name, value)
        if bool(valid.any()):
            self.log_metric(batch, "turn_advantage_abs", float(z[valid].abs().mean()))
        return turns.broadcast(per_turn.to(batch.device)).float()
