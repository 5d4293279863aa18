"""MatchTIR: the call score, the three assignments, a hand-computed dual-level advantage on a multi-turn batch,
edge cases, the contract, config errors and a real training run on scripted multi-turn rollouts."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from trl_credit import ConfigError, Plugin, hookimpl
from trl_credit.testing import ScriptedTurns, check_plugin, make_batch, plugin_set, run_plugin, tiny_dataset, train_tiny
from trl_credit_matchtir import (MatchTIR, call_rewards, call_score, gold_calls, greedy_assignment,
                                 normalise_call, optimal_assignment, transport_plan, turn_advantages)

ADD = {"name": "add", "arguments": {"a": 1, "b": 2}}
MUL = {"name": "mul", "arguments": {"a": 3, "b": 4}}
GOLD = [ADD, MUL]


def tool_call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


# ------------------------------------------------------------------------------------------ the score
@pytest.mark.parametrize("pred, expected", [
    (ADD, 1.0),                                                     # (1 + 1 + 2) / 4
    ({"name": "Add", "arguments": {"a": 1, "b": 3}}, 0.75),         # name case-folded; (1 + 1 + 1) / 4
    ({"name": "add", "arguments": {"a": 1, "c": 2}}, 7 / 12),       # J = 1/3, one right value: (1 + 1/3 + 1) / 4
    ({"name": "sub", "arguments": {"a": 1, "b": 2}}, 0.0),          # wrong tool
    (tool_call("add", a=1, b=2), 1.0),                              # TRL's message format
    ({"name": "add", "arguments": '{"a": 1, "b": 2}'}, 1.0),        # JSON-string arguments
    ({"name": "add", "arguments": "not json"}, 0.25),               # unparsable arguments: the name alone, 1 / 4
])
def test_call_score_vectors(pred, expected):
    assert call_score(normalise_call(pred), normalise_call(ADD)) == pytest.approx(expected)


def test_call_score_without_gold_arguments_and_loose_values():
    now = normalise_call({"name": "now"})
    assert call_score(normalise_call({"name": "now", "arguments": {}}), now) == 1.0  # (1 + 1 + 0) / 2
    assert call_score(normalise_call({"name": "now", "arguments": {"x": 1}}), now) == 0.5  # J = 0
    pred = normalise_call({"name": "add", "arguments": {"a": "1", "b": 2.0}})
    assert call_score(pred, normalise_call(ADD)) == pytest.approx(0.75)  # exact: "1" != 1, 2.0 == 2
    assert call_score(pred, normalise_call(ADD), "loose") == 1.0
    words = normalise_call({"name": "f", "arguments": {"q": "  New   York "}})
    assert call_score(words, normalise_call({"name": "f", "arguments": {"q": "new york"}}), "loose") == 1.0


# ------------------------------------------------------------------------------------- assignments
def test_hard_matching_is_optimal_where_greedy_is_not():
    scores = [[0.9, 0.8], [0.8, 0.0]]
    assert optimal_assignment(scores) == [1, 0]  # 0.8 + 0.8 = 1.6 > 0.9
    assert greedy_assignment(scores) == [0, None]  # the submission code's greedy takes 0.9 first
    assert optimal_assignment([[1.0], [1.0]]) == [0, None]  # a tie goes to the earlier call: repeats earn nothing
    assert optimal_assignment([[0.2], [0.9], [0.5]]) == [None, 0, None]  # more calls than gold calls
    assert optimal_assignment([[0.0, 0.0]]) == [None]  # a zero score is no match
    assert optimal_assignment([]) == [] and optimal_assignment([[]]) == [None]


def test_optimal_assignment_matches_brute_force_and_credits_the_earliest_of_equal_calls():
    g = torch.Generator().manual_seed(0)
    for m, n in [(1, 1), (2, 3), (3, 3), (4, 2), (5, 4), (3, 5)]:
        for _ in range(5):
            scores = (torch.rand(m, n, generator=g) * (torch.rand(m, n, generator=g) > 0.3)).tolist()
            best = max(sum(scores[a][b] for a, b in zip(rows, cols))
                       for rows in itertools.permutations(range(m), min(m, n))
                       for cols in itertools.permutations(range(n), min(m, n)))
            got = optimal_assignment(scores)
            assert sum(scores[a][b] for a, b in enumerate(got) if b is not None) == pytest.approx(best)
            assert len({b for b in got if b is not None}) == sum(b is not None for b in got)  # one-to-one
    ties = [[0.0, 0.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 1.0]]
    assert optimal_assignment(ties) == [2, 1, None, None]  # the earliest of three equal calls


def test_soft_matching_vectors():
    # identity scores, reg 0.1: the plan is K / (2 (e^10 + 1)) with K = exp(S / 0.1): s_0 = e^10 / (2 (e^10 + 1))
    plan = transport_plan([[1.0, 0.0], [0.0, 1.0]], 0.1)
    assert plan[0, 0].item() == pytest.approx(0.5 * math.exp(10) / (math.exp(10) + 1), abs=1e-9)
    rewards, matched = call_rewards([normalise_call(ADD)] * 2, [normalise_call(ADD)], "soft")
    assert rewards == pytest.approx([0.5, 0.5]) and matched == [None, None]  # two calls share one gold's mass
    assert torch.isfinite(transport_plan([[1.0, 0.0], [0.0, 1.0]], 1e-4)).all()  # log domain: no overflow


def test_call_rewards_without_gold_or_calls():
    assert call_rewards([], [normalise_call(ADD)]) == ([], [])
    assert call_rewards([normalise_call(ADD)], [], unmatched_penalty=-0.5) == ([-0.5], [None])
    assert call_rewards([normalise_call(ADD)], [], "soft") == ([0.0], [None])


# --------------------------------------------------------------------------- the dual-level vector
# Two trajectories (G = 2), gold [add(1, 2), mul(3, 4)].
#   row 0, three turns: add(1, 2) | add(1, 2) again | answer (outcome 1)
#   row 1, two turns:   add(1, 5), mul(3, 4) | answer (outcome 0)
# Hard matching over all calls of a trajectory: row 0 -> [1.0, 0 (the repeat is unmatched)], row 1 -> [0.75, 1.0].
# Turn rewards r = [1, 0, 0 + 1] and [(0.75 + 1) / 2, 0 + 0] = [0.875, 0].
# Returns (gamma 0.9): R0 = [1 + 0.9 * 0.9, 0.9, 1] = [1.81, 0.9, 1], R1 = [0.875, 0].
# Turn level, per index: k = 0 and 1 hold two values each -> z = +-d/2 / (|d|/sqrt(2) + 1e-6) = +-0.7071057 (d = 0.935,
#   0.9); k = 2 holds row 0 alone -> its raw return 1.
# Trajectory level (sum of turn rewards): s = [2, 0.875] -> A = +-0.5625 / (1.125/sqrt(2) + 1e-4) = +-0.7070179.
# Tokens: w = 0.5: row 0 turns [0.7070618, 0.7070618, 0.8535090], row 1 turns [-0.7070618, -0.7070618].
TOOL = [[1, 1, 0, 0, 1, 1, 0, 1], [1, 1, 0, 1, 0, 0, 0, 0]]
MASK = [[1] * 8, [1, 1, 1, 1, 0, 0, 0, 0]]
MESSAGES = [
    [{"role": "assistant", "content": "", "tool_calls": [tool_call("add", a=1, b=2)]},
     {"role": "tool", "name": "add", "content": "3"},
     {"role": "assistant", "content": "", "tool_calls": [tool_call("add", a=1, b=2)]},
     {"role": "tool", "name": "add", "content": "3"},
     {"role": "assistant", "content": "3 and 12"}],
    [{"role": "assistant", "content": "", "tool_calls": [tool_call("add", a=1, b=5), tool_call("mul", a=3, b=4)]},
     {"role": "tool", "name": "add", "content": "6"}, {"role": "tool", "name": "mul", "content": "12"},
     {"role": "assistant", "content": "6 and 12"}],
]
Z = 0.4675 / (0.935 / math.sqrt(2) + 1e-6)
A = 0.5625 / (1.125 / math.sqrt(2) + 1e-4)


def vector_batch(**kw):
    return make_batch([1.0, 0.0], 2, completion_mask=MASK, tool_mask=TOOL, completions=MESSAGES,
                      columns={"gold_calls": [GOLD, json.dumps(GOLD)]}, **kw)  # a list or its JSON string


def test_dual_level_advantage_vector():
    batch = vector_batch()
    assert batch.turns().calls.tolist() == [[1, 1, 0], [2, 0, 0]]  # the host counts the same calls
    rewards, stats = MatchTIR().turn_rewards(batch)
    torch.testing.assert_close(rewards, torch.tensor([[1.0, 0.0, 0.0], [0.875, 0.0, 0.0]]))
    assert stats == pytest.approx({"calls": 2.0, "call_reward": 2.75 / 4, "matched": 0.75, "gold_recall": 0.75})
    result = run_plugin(MatchTIR, batch)
    first, last = 0.5 * A + 0.5 * Z, 0.5 * A + 0.5 * 1.0
    expected = torch.tensor([[first, first, 0, 0, first, first, 0, last], [-first, -first, 0, -first, 0, 0, 0, 0]])
    torch.testing.assert_close(result.advantages, expected, atol=1e-6, rtol=0)
    assert Z == pytest.approx(0.7071057, abs=1e-7) and A == pytest.approx(0.7070179, abs=1e-7)
    assert result.metrics["matchtir/call_reward"] == pytest.approx(0.6875)
    assert result.metrics["matchtir/turn_advantage_abs"] == pytest.approx((4 * Z + 1) / 5, abs=1e-6)


def test_options_on_the_vector():
    batch = vector_batch()
    zero = run_plugin(MatchTIR, batch, {"lone": "zero"}).advantages
    assert zero[0, 7].item() == pytest.approx(0.5 * A)  # the lone third turn keeps only the trajectory part
    turn_only = run_plugin(MatchTIR, batch, {"weight": 1.0}).advantages
    assert turn_only[0, 7].item() == pytest.approx(1.0) and turn_only[1, 0].item() == pytest.approx(-Z, abs=1e-6)
    outcome = run_plugin(MatchTIR, batch, {"weight": 0.0, "trajectory": "outcome"}).advantages
    grpo = 0.5 / (math.sqrt(0.5) + 1e-4)  # TRL's GRPO on the outcomes [1, 0]
    assert outcome[0, 0].item() == pytest.approx(grpo, abs=1e-6) and outcome[1, 3].item() == pytest.approx(-grpo, abs=1e-6)
    greedy = run_plugin(MatchTIR, batch, {"assignment": "greedy"}).advantages
    torch.testing.assert_close(greedy, run_plugin(MatchTIR, batch).advantages)  # no conflict here: same matching
    soft, _ = MatchTIR(MatchTIR.Config(assignment="soft")).turn_rewards(batch)
    # row 0: S = [[1, 0], [1, 0]]: the two identical calls split add's mass, T = [[.25, .25], [.25, .25]] -> .25 each
    # row 1: S = [[.75, 0], [0, 1]]: T ~ diag(.5, .5) -> (.375 + .5) / 2 on its first turn
    torch.testing.assert_close(soft[0], torch.tensor([0.25, 0.25, 0.0]), atol=1e-6, rtol=0)
    assert soft[1, 0].item() == pytest.approx(0.4375, abs=1e-3)
    pooled = run_plugin(MatchTIR, batch, {"norm": "group", "weight": 1.0}).advantages
    r = torch.tensor([1.81, 0.9, 1.0, 0.875, 0.0])  # every turn return of the group in one pool
    z = (r - r.mean()) / (r.std() + 1e-6)
    assert pooled[0, 7].item() == pytest.approx(z[2].item(), abs=1e-5) and pooled[1, 3].item() == pytest.approx(z[4].item(), abs=1e-5)
    no_outcome, _ = MatchTIR(MatchTIR.Config(outcome_turn=False)).turn_rewards(batch)
    torch.testing.assert_close(no_outcome, torch.tensor([[1.0, 0.0, 0.0], [0.875, 0.0, 0.0]]))


def test_calls_column_gives_the_same_advantages_for_plain_text_rollouts():
    per_turn = [[[ADD], [ADD], []], [[{"name": "add", "arguments": {"a": 1, "b": 5}}, MUL], []]]
    batch = make_batch([1.0, 0.0], 2, completion_mask=MASK, tool_mask=TOOL, completions=["text", "text"],
                       columns={"gold_calls": [GOLD, GOLD], "turn_calls": per_turn})
    a = run_plugin(MatchTIR, batch, {"calls_column": "turn_calls"}).advantages
    torch.testing.assert_close(a, run_plugin(MatchTIR, vector_batch()).advantages)
    short = make_batch([1.0, 0.0], 2, completion_mask=MASK, tool_mask=TOOL, completions=["text", "text"],
                       columns={"gold_calls": [GOLD, GOLD], "turn_calls": [[[ADD]], None]})
    assert torch.isfinite(run_plugin(MatchTIR, short, {"calls_column": "turn_calls"}).advantages).all()
    plain = make_batch([1.0, 0.0], 2, completion_mask=MASK, tool_mask=TOOL, completions=["text", "text"],
                       columns={"gold_calls": [GOLD, GOLD], "turn_calls": per_turn})
    with pytest.warns(UserWarning, match=r"completion 0 has 3 model turns but 0 assistant message\(s\)"):
        assert run_plugin(MatchTIR, plain).metrics["matchtir/calls"] == 0  # without calls_column: nothing seen
    one = make_batch([1.0, 0.0], 2, completion_mask=MASK, tool_mask=TOOL, completions=["t", "t"],
                     columns={"gold_calls": [GOLD, GOLD], "turn_calls": [[ADD], [[MUL], None]]})  # a bare call
    assert MatchTIR(MatchTIR.Config(calls_column="turn_calls")).turn_rewards(one)[0][:, 0].tolist() == [1.0, 1.0]
    with pytest.raises(Exception, match="calls_column 'missing' is not a rollout column"):
        run_plugin(MatchTIR, batch, {"calls_column": "missing"})
    too_long = make_batch([1.0, 0.0], 2, completion_mask=MASK, tool_mask=TOOL, completions=["t", "t"],
                          columns={"gold_calls": [GOLD, GOLD], "turn_calls": [[[], [], [], []], []]})
    with pytest.raises(Exception, match=r"lists calls for 4 turns, the completion has 3 model turn\(s\)"):
        run_plugin(MatchTIR, too_long, {"calls_column": "turn_calls"})


# ------------------------------------------------------------------------------------------ edge cases
def single_turn_batch(rewards=(1.0, 0.0, 0.5, 0.0)):
    calls = [[ADD, MUL], [ADD], [], [{"name": "sub", "arguments": {}}]]
    messages = [[{"role": "assistant", "content": "", "tool_calls": c}] for c in calls]
    return make_batch(list(rewards), 4, lengths=[3, 4, 2, 5], completions=messages, columns={"gold_calls": [GOLD] * 4})


def test_single_turn_batch_is_grpo_on_the_turn_reward():
    batch = single_turn_batch()
    assert batch.turns().max_turns == 1
    a = run_plugin(MatchTIR, batch).advantages
    s = torch.tensor([1.0 + 1.0, 1.0 + 0.0, 0.0 + 0.5, 0.0 + 0.0])  # mean call score of the turn + outcome
    grpo = (s - s.mean()) / (s.std() + 1e-4)
    z = (s - s.mean()) / (s.std() + 1e-6)
    for row, length in enumerate([3, 4, 2, 5]):
        assert torch.allclose(a[row, :length], (0.5 * grpo[row] + 0.5 * z[row]).expand(length), atol=1e-6)
        assert (a[row, length:] == 0).all()


def test_constant_group_no_gold_and_no_calls():
    same = [[{"role": "assistant", "content": "", "tool_calls": [tool_call("add", a=1, b=2)]}]] * 4
    constant = make_batch([1.0] * 4, 4, lengths=[3] * 4, completions=same, columns={"gold_calls": [GOLD] * 4})
    assert (run_plugin(MatchTIR, constant).advantages == 0).all()
    bare = make_batch([1.0, 0.0], 2, lengths=[3, 3], completions=["a", "b"], columns={"gold_calls": [None, "[]"]})
    a = run_plugin(MatchTIR, bare).advantages  # no calls and no gold: turn reward = the outcome alone
    grpo = 0.5 / (math.sqrt(0.5) + 1e-4)
    z = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert a[0, 0].item() == pytest.approx(0.5 * grpo + 0.5 * z, abs=1e-6) and a[1, 0] < 0


def test_one_turn_rows_mixed_with_three_turn_rows_and_a_nan_outcome():
    # rows: 0 one turn (tokens 0-1), 1 three turns, 2 three turns, 3 NaN outcome (three turns): G = 4
    tool = [[1, 1, 0, 0, 0, 0, 0], [1, 0, 1, 0, 1, 1, 1], [1, 0, 1, 0, 1, 1, 1], [1, 0, 1, 0, 1, 1, 1]]
    mask = [[1, 1, 0, 0, 0, 0, 0], [1] * 7, [1] * 7, [1] * 7]
    batch = make_batch([0.0, 1.0, 0.0, None], 4, completion_mask=mask, tool_mask=tool,
                       completions=["a", "b", "c", "d"], columns={"gold_calls": [GOLD] * 4})
    a = run_plugin(MatchTIR, batch, {"weight": 1.0}).advantages
    assert (a[3] == 0).all()  # all rewards NaN: advantage 0, and out of the pools
    # r: row 0 [0], row 1 [0, 0, 1], row 2 [0, 0, 0]. R: row 1 [0.81, 0.9, 1], row 2 [0, 0, 0], row 0 [0]
    # k = 0 pool {0, 0.81, 0}: z = (x - 0.27) / (0.467654 + 1e-6); k = 1, 2 pools of two: +-0.7071
    std0 = torch.tensor([0.0, 0.81, 0.0]).std().item()
    assert a[0, 0].item() == pytest.approx(-0.27 / (std0 + 1e-6), abs=1e-5)
    assert a[1, 0].item() == pytest.approx(0.54 / (std0 + 1e-6), abs=1e-5)
    assert a[1, 2].item() == pytest.approx(0.45 / (0.9 / math.sqrt(2) + 1e-6), abs=1e-5)
    assert a[2, 6].item() == pytest.approx(-0.5 / (1 / math.sqrt(2) + 1e-6), abs=1e-5)
    assert (a[:, 1][torch.tensor([False, True, True, True])] == 0).all()  # environment tokens get 0


def test_empty_completions_and_turn_advantages_helper():
    empty = make_batch([1.0, 0.0], 2, lengths=[0, 0], completions=["", ""], columns={"gold_calls": [GOLD] * 2})
    assert (run_plugin(MatchTIR, empty).advantages == 0).all()
    r = torch.tensor([[1.0, 2.0], [3.0, 0.0]])
    valid = torch.tensor([[True, True], [True, False]])
    z = turn_advantages(r, valid, 2)
    assert z[0, 1].item() == 2.0 and z[1, 1].item() == 0.0  # a lone value keeps its raw return; invalid -> 0
    assert turn_advantages(r, valid, 2, lone="zero")[0, 1].item() == 0.0


def test_malformed_gold_counts_as_none_and_is_reported():
    assert gold_calls("{nope") is None and gold_calls(8) is None and gold_calls([1, 2]) is None
    assert gold_calls(None) == gold_calls("") == [] and gold_calls(json.dumps(ADD)) == [normalise_call(ADD)]
    # a datasets struct column: keys of other rows come back as None and are not gold arguments
    assert gold_calls([{"name": "add", "arguments": {"a": 1, "b": 2, "x": None}}]) == [normalise_call(ADD)]
    messages = [[{"role": "assistant", "content": "", "tool_calls": [ADD]}]] * 2
    batch = make_batch([1.0, 0.0], 2, lengths=[2, 2], completions=messages, columns={"gold_calls": ["{nope", "8"]})
    with pytest.warns(UserWarning, match=r"gold_calls\[0\] = '\{nope' is not a list of \{name, arguments\} calls"):
        result = run_plugin(MatchTIR, batch)
    assert result.metrics["matchtir/malformed_gold"] == 1.0 and result.metrics["matchtir/call_reward"] == 0.0


@pytest.mark.parametrize("options, key", [({"weight": 1.5}, "weight"), ({"reg": 0.0}, "reg"),
                                          ({"unmatched_penalty": 0.5}, "unmatched_penalty"),
                                          ({"column": " "}, "column"), ({"assignment": "km"}, "assignment")])
def test_config_errors_name_the_option(options, key):
    with pytest.raises(ConfigError, match=key):
        plugin_set(MatchTIR, options)


def test_required_columns_and_rewards():
    assert MatchTIR().required_columns() == ["gold_calls"]
    assert MatchTIR(MatchTIR.Config(reward="accuracy")).required_rewards() == ["accuracy"]


def test_contract_on_multi_turn_batches():
    def nan_batch():
        return make_batch([1.0, None], 2, completion_mask=MASK, tool_mask=TOOL, completions=MESSAGES,
                          columns={"gold_calls": [GOLD, GOLD]})

    check_plugin(MatchTIR, batches=[vector_batch, nan_batch, single_turn_batch,
                                    lambda: single_turn_batch((1.0, 1.0, 1.0, 1.0))])
    check_plugin(MatchTIR, {"assignment": "soft"}, batches=[vector_batch, single_turn_batch])


# --------------------------------------------------------------------------------------- training run
GOOD, NEAR, WRONG = ADD, {"name": "add", "arguments": {"a": 1, "b": 9}}, {"name": "sub", "arguments": {"a": 1}}


class CallingTurns(ScriptedTurns):
    """ScriptedTurns whose turns also report the tool calls they made (a rollout field): the first turn calls
    add(1, 2) (score 1) or add(1, 9) (score 0.75), at random; later turns call sub (score 0)."""

    def __call__(self, prompts, trainer):
        out = super().__call__(prompts, trainer)
        first = torch.randint(2, (len(prompts),)).tolist()
        out["turn_calls"] = [[[GOOD if f else NEAR] if k == 0 else [WRONG] for k in range(len(p))]
                             for f, p in zip(first, out["turn_progress"])]
        return out


class Seen(Plugin):
    """Records each finished batch and its advantages."""

    name = "seen"
    batches: list = []

    @hookimpl
    def on_batch_end(self, batch, advantages):
        Seen.batches.append((batch, advantages.clone()))


def expected_advantages(batch):
    """The documented formula, written out by hand (loops), for the trained batch."""
    g, turns = batch.num_generations, batch.turns()
    solved = batch.total_reward().tolist()
    rewards = []
    for i, calls in enumerate(batch.column("turn_calls")):
        c = int(turns.count[i])
        r = [1.0 if calls[0][0] == GOOD else 0.75] + [0.0] * (c - 1)
        r[-1] += solved[i]
        rewards.append(r)
    returns = []
    for r in rewards:
        acc, out = 0.0, []
        for x in reversed(r):
            acc = x + 0.9 * acc
            out.append(acc)
        returns.append(out[::-1])
    per_turn = []
    for i, r in enumerate(returns):
        members = range(i // g * g, i // g * g + g)
        sums = torch.tensor([sum(rewards[j]) for j in members])
        a = ((sum(rewards[i]) - sums.mean()) / (sums.std() + 1e-4)).item()
        zs = []
        for k, value in enumerate(r):
            pool = torch.tensor([returns[j][k] for j in members if len(returns[j]) > k])
            zs.append(value if len(pool) == 1 else ((value - pool.mean()) / (pool.std() + 1e-6)).item())
        per_turn.append([0.5 * a + 0.5 * z for z in zs])
    k = turns.max_turns
    values = torch.tensor([p + [0.0] * (k - len(p)) for p in per_turn])
    return turns.broadcast(values)


def test_trains_on_scripted_multi_turn_rollouts(tmp_path):
    dataset = tiny_dataset(32).add_column("gold_calls", [json.dumps([GOOD])] * 32)
    from trl_credit.testing import scripted_turns_reward

    Seen.batches.clear()
    trainer = train_tiny([{"name": "matchtir", "calls_column": "turn_calls"}, Seen], output_dir=tmp_path,
                         dataset=dataset, rollout_func=CallingTurns(), reward_funcs=[scripted_turns_reward],
                         max_completion_length=32)
    logs = trainer.state.log_history
    assert math.isfinite(logs[-1]["train_loss"])
    assert len(Seen.batches) == 2
    for step, (batch, advantages) in enumerate(Seen.batches):
        assert int(batch.turns().count.max()) > 1  # really multi-turn
        torch.testing.assert_close(advantages, expected_advantages(batch), atol=1e-5, rtol=0)
        scores = [1.0 if c == GOOD else 0.75 if c == NEAR else 0.0
                  for row in batch.column("turn_calls") for turn in row for c in turn]
        assert logs[step]["trl_credit/matchtir/call_reward"] == pytest.approx(sum(scores) / len(scores))
        assert logs[step]["trl_credit/matchtir/calls"] == pytest.approx(len(scores) / batch.num_completions)
