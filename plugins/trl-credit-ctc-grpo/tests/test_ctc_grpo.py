"""CTC-GRPO: a hand-computed vector (carried states, deltas, group centring, coef, broadcast over the model's
tokens), the index centring, std scaling, returns, direction, initial: first, edge cases (single-turn batch,
all-NaN states, constant groups, NaN outcomes, a missing column refused by the host), the contract on multi-turn batches, and a real
training run on ScriptedTurns rollouts."""

from __future__ import annotations

import math

import pytest
import torch

from trl_credit import Plugin, hookimpl
from trl_credit.testing import check_plugin, make_batch, run_plugin, train_tiny
from trl_credit_ctc_grpo import CTCGRPO, centred_credit, state_deltas

# One group of four. Model turns (m) and environment replies (e), in tokens:
#   row 0: m m e m m e m      3 turns: tokens {0, 1}, {3, 4}, {6}
#   row 1: m e e m e m m      3 turns: {0}, {3}, {5, 6}
#   row 2: m m m              1 turn:  {0, 1, 2}
#   row 3: m m e m            2 turns: {0, 1}, {3}
TOOL = [[1, 1, 0, 1, 1, 0, 1], [1, 0, 0, 1, 0, 1, 1], [1, 1, 1, 1, 1, 1, 1], [1, 1, 0, 1, 1, 1, 1]]
LENGTHS = [7, 7, 3, 4]
TURN = [[0, 0, -1, 1, 1, -1, 2], [0, -1, -1, 1, -1, 2, 2], [0, 0, 0, -1, -1, -1, -1], [0, 0, -1, 1, -1, -1, -1]]
STATES = [[1.0, 3.0, 2.0], [2.0, None, 4.0], [1.0], [None, 3.0]]
REWARDS = [1.0, 0.0, 1.0, 0.0]
# GRPO's outcome advantage: mean 0.5, unbiased std sqrt(1/3); (r - 0.5) / (0.577350 + 1e-4)
A = 0.5 / (math.sqrt(1 / 3) + 1e-4)
OUTCOME = [A, -A, A, -A]


def make(states=STATES, rewards=REWARDS, column="state", **kw):
    return make_batch(list(rewards), 4, lengths=LENGTHS, tool_mask=TOOL, columns={column: list(states)},
                      reward_names=["accuracy"], **kw)


def per_token(per_turn):
    """(N, T) the outcome advantage plus each row's turn credit on the tokens of its turns (0 on replies)."""
    out = torch.zeros(4, 7)
    for i, row in enumerate(TURN):
        for t, k in enumerate(row):
            out[i, t] = OUTCOME[i] + (per_turn[i][k] if k >= 0 else 0.0)
    return out


def model_tokens(x):
    return x[torch.tensor(TURN) >= 0]


def test_the_hand_computed_vector():
    result = run_plugin(CTCGRPO, make(), {"column": "state"})
    # carried states (s_-1 = 0): row 0 [1, 3, 2], row 1 [2, 2 (carried), 4], row 2 [1], row 3 [0 (carried), 3]
    # d = row 0 [1, 2, -1], row 1 [2, 0, 2], row 2 [1], row 3 [0, 3]: nine turns, sum 10, mean 10/9
    # c = d - 10/9 = row 0 [-1, 8, -19]/9, row 1 [8, -10, 8]/9, row 2 [-1]/9, row 3 [-10, 17]/9; coef 0.5
    c = [[-1 / 9, 8 / 9, -19 / 9], [8 / 9, -10 / 9, 8 / 9], [-1 / 9], [-10 / 9, 17 / 9]]
    expected = per_token([[0.5 * v for v in row] for row in c])
    torch.testing.assert_close(model_tokens(result.advantages), model_tokens(expected), atol=1e-5, rtol=0)
    m = result.metrics
    assert m["ctc_grpo/valued_rows"] == 1.0 and m["ctc_grpo/credited_turns"] == 1.0
    assert m["ctc_grpo/state_delta"] == pytest.approx(10 / 9)
    # credit_abs: mean |0.5 c| over the 15 model tokens: 0.5 / 9 (2 + 16 + 19 + 8 + 10 + 16 + 3 + 20 + 17) / 15
    assert m["ctc_grpo/credit_abs"] == pytest.approx(0.5 / 9 * 111 / 15, abs=1e-6)
    assert m["ctc_grpo/outcome_abs"] == pytest.approx(A, abs=1e-5)


def test_the_functions_on_the_vector():
    values = torch.tensor([[1.0, 3.0, 2.0], [2.0, math.nan, 4.0], [1.0, math.nan, math.nan], [math.nan, 3.0, math.nan]])
    count = torch.tensor([3, 3, 1, 2])
    d, defined = state_deltas(values, count)
    torch.testing.assert_close(d, torch.tensor([[1.0, 2.0, -1.0], [2.0, 0.0, 2.0], [1.0, 0.0, 0.0], [0.0, 3.0, 0.0]]))
    assert defined.tolist() == [[True] * 3, [True] * 3, [True, False, False], [True, True, False]]
    # index centring: k = 0: d [1, 2, 1, 0] mean 1; k = 1: rows 0, 1, 3 [2, 0, 3] mean 5/3; k = 2: [-1, 2] mean 1/2
    torch.testing.assert_close(centred_credit(d, defined, 4, "index"), torch.tensor(
        [[0.0, 1 / 3, -1.5], [1.0, -5 / 3, 1.5], [0.0, 0.0, 0.0], [-1.0, 4 / 3, 0.0]]))
    # std scaling of the group centring: 9 c = [-1, 8, -19, 8, -10, 8, -1, -10, 17], sum of squares 1044,
    # population var 1044 / 81 / 9, sigma = 1.196704
    sigma = math.sqrt(1044 / 81 / 9)
    scaled = centred_credit(d, defined, 4, "group", "std")
    torch.testing.assert_close(scaled[0], torch.tensor([-1 / 9, 8 / 9, -19 / 9]) / sigma)
    assert scaled[defined].pow(2).mean() == pytest.approx(1.0, abs=1e-6)


def test_index_centring_and_returns_through_the_plugin():
    index = run_plugin(CTCGRPO, make(), {"column": "state", "centre": "index", "coef": 1.0})
    c = [[0.0, 1 / 3, -1.5], [1.0, -5 / 3, 1.5], [0.0], [-1.0, 4 / 3]]
    torch.testing.assert_close(model_tokens(index.advantages), model_tokens(per_token(c)), atol=1e-5, rtol=0)
    # credit: return (gamma 1) of the group-centred c: row 0 [-12, -11, -19]/9, row 1 [6, -2, 8]/9, row 3 [7, 17]/9
    ret = run_plugin(CTCGRPO, make(), {"column": "state", "credit": "return", "coef": 1.0})
    r = [[-12 / 9, -11 / 9, -19 / 9], [6 / 9, -2 / 9, 8 / 9], [-1 / 9], [7 / 9, 17 / 9]]
    torch.testing.assert_close(model_tokens(ret.advantages), model_tokens(per_token(r)), atol=1e-5, rtol=0)
    # gamma 0.5, row 0: [-1/9 + 0.5 (8/9 + 0.5 (-19/9)), 8/9 + 0.5 (-19/9), -19/9]
    half = run_plugin(CTCGRPO, make(), {"column": "state", "credit": "return", "gamma": 0.5, "coef": 1.0})
    assert half.advantages[0, 0] - A == pytest.approx(-1 / 9 + 0.5 * (8 / 9 - 0.5 * 19 / 9), abs=1e-5)


def test_direction_lower_negates_the_credit_and_initial_scales_with_it():
    higher = run_plugin(CTCGRPO, make(), {"column": "state"}).advantages
    lower = run_plugin(CTCGRPO, make(), {"column": "state", "direction": "lower"}).advantages
    torch.testing.assert_close(model_tokens(lower - per_token([[0] * 3] * 4)),
                               -model_tokens(higher - per_token([[0] * 3] * 4)), atol=1e-6, rtol=0)
    # a distance: guess_distance [5, 2, 0] (solved), [6, None, 3], [4], [None, 7]; lower is better, s_-1 = 0:
    # signed d = row 0 [-5, 3, 2], row 1 [-6, 0, 3], row 2 [-4], row 3 [0, -7]; mean -14/9
    dist = [[5.0, 2.0, 0.0], [6.0, None, 3.0], [4.0], [None, 7.0]]
    res = run_plugin(CTCGRPO, make(dist, column="guess_distance"),
                     {"column": "guess_distance", "direction": "lower", "coef": 1.0})
    d = [[-5, 3, 2], [-6, 0, 3], [-4], [0, -7]]
    c = [[v + 14 / 9 for v in row] for row in d]
    torch.testing.assert_close(model_tokens(res.advantages), model_tokens(per_token(c)), atol=1e-5, rtol=0)
    # initial: 10, the worst distance before any guess: a turn without a number moves nothing, a guess gains
    # 10 - distance first: d = row 0 [5, 3, 2], row 1 [4, 0, 3], row 2 [6], row 3 [0, 3]; mean 26/9
    worst = run_plugin(CTCGRPO, make(dist, column="guess_distance"),
                       {"column": "guess_distance", "direction": "lower", "initial": 10, "coef": 1.0})
    d = [[5, 3, 2], [4, 0, 3], [6], [0, 3]]
    c = [[v - 26 / 9 for v in row] for row in d]
    torch.testing.assert_close(model_tokens(worst.advantages), model_tokens(per_token(c)), atol=1e-5, rtol=0)


def test_initial_first_leaves_the_turns_up_to_the_first_record_out():
    res = run_plugin(CTCGRPO, make(), {"column": "state", "initial": "first", "coef": 1.0})
    # s_-1 = the first record: row 0 d [-, 2, -1], row 1 [-, 0, 2], row 2 nothing, row 3 nothing (first record at
    # its last turn); pool {2, -1, 0, 2}, mean 3/4
    c = [[0.0, 1.25, -1.75], [0.0, -0.75, 1.25], [0.0], [0.0, 0.0]]
    torch.testing.assert_close(model_tokens(res.advantages), model_tokens(per_token(c)), atol=1e-5, rtol=0)
    assert res.metrics["ctc_grpo/credited_turns"] == pytest.approx(4 / 9)
    # a numeric s_-1 shifts the first deltas: s_-1 = 1 -> d row 0 [0, 2, -1], row 1 [1, 0, 2], row 2 [0], row 3
    # [0 (1 carried), 2]; mean 6/9
    shifted = run_plugin(CTCGRPO, make(), {"column": "state", "initial": 1.0, "coef": 1.0})
    d = [[0, 2, -1], [1, 0, 2], [0], [0, 2]]
    c = [[v - 6 / 9 for v in row] for row in d]
    torch.testing.assert_close(model_tokens(shifted.advantages), model_tokens(per_token(c)), atol=1e-5, rtol=0)


def test_single_turn_batch_centres_the_first_state():
    # no tool mask: every completion is one turn; d = s_0 - 0, centred in each group of two
    batch = make_batch([1, 0, 1, 1], 2, lengths=[3, 2, 4, 1], columns={"state": [[3.0], [1.0], [5.0], [2.0]]},
                       reward_names=["accuracy"])
    res = run_plugin(CTCGRPO, batch, {"column": "state", "coef": 1.0})
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    # group 0: d [3, 1] -> c [1, -1]; group 1: d [5, 2] -> c [1.5, -1.5], rewards 1, 1: A = 0
    expected = torch.tensor([[a + 1] * 3 + [0], [-a - 1] * 2 + [0, 0], [1.5] * 4, [-1.5, 0, 0, 0]])
    torch.testing.assert_close(res.advantages * batch.completion_mask, expected, atol=1e-5, rtol=0)


def test_all_nan_states_constant_groups_and_nan_outcomes_give_no_credit():
    none = run_plugin(CTCGRPO, make([[None] * 3, [None] * 3, [None], None]), {"column": "state"})
    torch.testing.assert_close(model_tokens(none.advantages), model_tokens(per_token([[0] * 3] * 4)))
    assert none.metrics["ctc_grpo/valued_rows"] == 0.0 and none.metrics["ctc_grpo/credited_turns"] == 0.0
    # every turn moves the state by the same amount: centred credit 0
    same = run_plugin(CTCGRPO, make([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [1.0], [1.0, 2.0]]), {"column": "state"})
    torch.testing.assert_close(model_tokens(same.advantages), model_tokens(per_token([[0] * 3] * 4)))
    # a row whose reward is NaN trains on nothing: no credit, not in the pool (mean of the other 7 turns' d = 6/7)
    nan = run_plugin(CTCGRPO, make(rewards=[1.0, None, 1.0, 0.0]), {"column": "state", "coef": 1.0})
    assert nan.advantages[1].abs().sum() == 0
    assert nan.advantages[3, 3] - nan.advantages[3, 0] == pytest.approx(3.0, abs=1e-5)  # c = d - mu: 3 - 0
    assert nan.advantages[2, 0] - nan.advantages[0, 0] == pytest.approx(0.0, abs=1e-5)  # both d = 1


def test_sequence_or_token_advantages_in():
    class Tokens(Plugin):
        """An estimator giving (N, T) advantages: 1 on every token."""

        @hookimpl
        def compute_advantages(self, batch):
            return torch.ones(batch.completion_ids.shape)

    res = run_plugin(CTCGRPO, make(), {"column": "state", "coef": 1.0}, others=[Tokens])
    assert res.advantages[0, 0] == pytest.approx(1 - 1 / 9, abs=1e-6) and res.advantages[0, 2] == 1.0


def test_a_dropped_row_counts_in_the_pool_and_gets_nothing():
    class DropSecond(Plugin):
        @hookimpl
        def filter_rollouts(self, batch):
            return torch.arange(batch.num_completions) != 1

    plain = run_plugin(CTCGRPO, make(), {"column": "state"}).advantages
    dropped = run_plugin(CTCGRPO, make(), {"column": "state"}, others=[DropSecond]).advantages
    assert (dropped[1] == 0).all() and plain[1].abs().sum() > 0
    # the others keep their credit: row 1's deltas stay in the pool, as its outcome stays in GRPO's baseline
    torch.testing.assert_close(dropped[[0, 2, 3]], plain[[0, 2, 3]])


def test_a_batch_without_the_column_is_refused_by_the_host():
    from trl_credit import PluginRuntimeError
    from trl_credit.testing import plugin_set

    assert plugin_set(CTCGRPO, {"column": "state"}).plugins[0].members.required_turn_values == ("state",)
    with pytest.raises(PluginRuntimeError, match=r"plugin 'ctc_grpo' needs per-turn values \['state'\] "
                                                 r"\(required_turn_values\).*step 0"):
        run_plugin(CTCGRPO, make(column="other"), {"column": "state"})


def test_bad_options_are_refused():
    from trl_credit import ConfigError
    from trl_credit.testing import plugin_set

    for bad, key in (({"initial": "last"}, "initial"), ({"initial": math.inf}, "initial"), ({"coef": -1}, "coef"),
                     ({"centre": "batch"}, "centre"), ({"column": " "}, "column"), ({"gamma": 2}, "gamma")):
        with pytest.raises(ConfigError, match=key):
            plugin_set(CTCGRPO, bad)


def test_check_plugin_on_multi_turn_batches():
    check_plugin(CTCGRPO)  # the kit's edge cases, with the declared turn_state filled in (0.5, 1.0, ... per turn)
    check_plugin(CTCGRPO, {"column": "state"}, batches=[make, lambda: make(rewards=[1.0, 1.0, 1.0, 1.0]),
                                                        lambda: make([[None] * 3, None, [None], [None, None]])])
    check_plugin(CTCGRPO, {"column": "state", "centre": "index", "scale": "std", "credit": "return",
                           "initial": "first"}, batches=[make])


class Seen(Plugin):
    """Records each finished batch and its final advantages."""

    seen: list = []

    @hookimpl
    def on_batch_end(self, batch, advantages):
        Seen.seen.append((batch, advantages.detach().clone()))


def test_a_real_run_on_scripted_multi_turn_rollouts(tmp_path, monkeypatch):
    from trl_credit.testing import ScriptedTurns, scripted_turns_reward

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    Seen.seen.clear()
    trainer = train_tiny([{"name": "ctc_grpo", "column": "turn_checks"}, Seen], output_dir=tmp_path,
                         rollout_func=ScriptedTurns(), reward_funcs=[scripted_turns_reward], max_completion_length=32)
    logs = trainer.state.log_history
    assert all(math.isfinite(entry["loss"]) for entry in logs if "loss" in entry)
    assert any("trl_credit/ctc_grpo/credited_turns" in entry for entry in logs)
    batch, advantages = Seen.seen[-1]
    turns = batch.turns()
    assert int(turns.count.max()) > 1  # really multi-turn
    # the trained advantages are GRPO's outcome advantage plus 0.5 x the group-centred change of turn_checks
    values = batch.turn_values("turn_checks")
    d, defined = state_deltas(values, turns.count)
    credit = turns.broadcast(0.5 * centred_credit(d, defined, batch.num_generations))
    r = batch.total_reward().reshape(-1, batch.num_generations)
    outcome = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).reshape(-1, 1)
    model = turns.model
    torch.testing.assert_close(advantages[model], (outcome + credit)[model], atol=1e-5, rtol=0)
    assert credit[model].abs().sum() > 0
