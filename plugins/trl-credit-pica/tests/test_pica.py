"""PiCA: hand-computed potentials, step rewards and token advantages for the three success estimates (prefix
tree, gold probability, recorded column), the two history cuts, the step penalty, edge cases, the options'
checks, the contract on multi-turn batches and real multi-turn training runs."""

from __future__ import annotations

import math

import pytest
import torch

from trl_credit import ConfigError, Plugin, PluginRuntimeError, carry_forward, hookimpl
from trl_credit.testing import ScriptedTurns, check_plugin, make_batch, plugin_set, run_plugin, scripted_turns_reward
from trl_credit.testing import train_tiny
from trl_credit_pica import PiCA, normalise, penalties, prefix_success, shaping, state_ends

NAN = math.nan
R5 = math.sqrt(5)
# One group of four. Tokens 0-1 turn 0, 2 the reply, 3-4 turn 1, 5 the reply, 6 turn 2 (c0, c1); c2 and c3 stop after
# turn 1 (token 3). c0 and c1 are identical up to token 5; c2 shares c0's first turn and reply; c3 differs at once.
IDS = [[5, 6, 9, 7, 8, 9, 1], [5, 6, 9, 7, 8, 9, 2], [5, 6, 9, 3], [4, 4, 9, 3]]
TOOL = [[1, 1, 0, 1, 1, 0, 1], [1, 1, 0, 1, 1, 0, 1], [1, 1, 0, 1, 0, 0, 0], [1, 1, 0, 1, 0, 0, 0]]
TURN_OF = [[0, 0, None, 1, 1, None, 2]] * 2 + [[0, 0, None, 1, None, None, None]] * 2  # None: no model token
OUTCOME = [1.0, 0.0, 1.0, 0.0]
A = 0.5 / (math.sqrt(1 / 3) + 1e-4)  # TRL's GRPO advantage of [1, 0, 1, 0]: (r - .5) / (unbiased std + 1e-4) = .866


def batch_of(ids=IDS, tool=TOOL, outcome=OUTCOME, **kwargs):
    return make_batch(list(outcome), len(outcome), completion_ids=ids, tool_mask=tool, reward_names=["solved"],
                      **kwargs)


def per_token(credit, base=(A, -A, A, -A), turn_of=TURN_OF):
    """The outcome advantage on every position, plus the turn's credit on its model tokens."""
    return torch.tensor([[base[i] + (credit[i][k] if k is not None and k < len(credit[i]) else 0.0) for k in row]
                         for i, row in enumerate(turn_of)])


def test_states_and_the_prefix_tree():
    batch = batch_of()
    assert state_ends(batch).tolist() == [[0, 3, 6, 7], [0, 3, 6, 7], [0, 3, 4, -1], [0, 3, 4, -1]]
    assert state_ends(batch, "action").tolist() == [[0, 2, 5, 7], [0, 2, 5, 7], [0, 2, 4, -1], [0, 2, 4, -1]]
    codes = torch.where(batch.completion_mask.bool(), batch.completion_ids * 2 + batch.turns().model.long() + 1, 0)
    phi, count = prefix_success(codes, state_ends(batch), torch.tensor(OUTCOME), torch.ones(4, dtype=torch.bool), 4)
    # h_0: the group, 1/2. After turn 0 (token 3): c0, c1, c2 share it -> 2/3; c3 alone -> 0. After turn 1: c0 and c1
    # share tokens 0-5 -> 1/2; c2 alone -> 1; c3 -> 0. After c0's / c1's last turn: their own outcomes.
    expected = torch.tensor([[0.5, 2 / 3, 0.5, 1.0], [0.5, 2 / 3, 0.5, 0.0], [0.5, 2 / 3, 1.0, NAN],
                             [0.5, 0.0, 0.0, NAN]])
    torch.testing.assert_close(phi, expected, equal_nan=True)
    assert count.tolist() == [[4, 3, 2, 1], [4, 3, 2, 1], [4, 3, 1, 0], [4, 1, 1, 0]]
    # a dropped member no longer counts: without c1, h_0 is 2/3 and c0's states after turns 0 and 1 are 1 and 1; c1
    # (not a member) is estimated from the members that share its history
    dropped, _ = prefix_success(codes, state_ends(batch), torch.tensor(OUTCOME), torch.tensor([True, False, True, True]),
                                4)
    assert dropped[0, :3].tolist() == pytest.approx([2 / 3, 1.0, 1.0])
    assert dropped[1, :3].tolist() == pytest.approx([2 / 3, 1.0, 1.0])


def test_hand_computed_prefix_potential():
    # F (steps k < K_i - 1): c0 [2/3 - 1/2, 1/2 - 2/3] = [1/6, -1/6], c1 the same, c2 [1/6], c3 [0 - 1/2] = [-1/2].
    # pool mean -1/18: deviations [2/9, -1/9, 2/9, -1/9, 2/9, -4/9], population var 5/81 -> z = dev / (sqrt(5)/9)
    # = [2, -1, 2, -1, 2, -4] / sqrt(5). credit: return: c0 [z0 + z1, z1] = [1, -1] / sqrt(5); c2 2/sqrt(5); c3 -4/sqrt(5)
    s = (R5 / 9) / (math.sqrt(5 / 81 + 1e-8) + 1e-6)  # the 1e-8 and 1e-6 of the official normalisation
    result = run_plugin(PiCA, batch_of())
    expected = per_token([[s / R5, -s / R5, 0], [s / R5, -s / R5, 0], [2 * s / R5, 0], [-4 * s / R5, 0]])
    torch.testing.assert_close(result.advantages, expected, atol=1e-5, rtol=0)
    assert result.metrics["pica/potential_start"] == pytest.approx(0.5)
    assert result.metrics["pica/step_reward"] == pytest.approx(-1 / 18)
    assert result.metrics["pica/positive_steps"] == pytest.approx(3 / 6)
    assert result.metrics["pica/credited_steps"] == pytest.approx(6 / 10)  # 6 steps of 10 member turns
    assert result.metrics["pica/shared_states"] == pytest.approx(5 / 6)  # the states after the 6 steps: c3's is alone
    # credit: reward: each step keeps its own z; coef scales the credit
    own = run_plugin(PiCA, batch_of(), {"credit": "reward", "coef": 0.5}).advantages
    expected = per_token([[s / R5, -0.5 * s / R5, 0], [s / R5, -0.5 * s / R5, 0], [s / R5, 0], [-2 * s / R5, 0]])
    torch.testing.assert_close(own, expected, atol=1e-5, rtol=0)
    # normalise: none / mean: the raw step rewards, accumulated
    raw = run_plugin(PiCA, batch_of(), {"normalise": "none"}).advantages
    torch.testing.assert_close(raw, per_token([[0, -1 / 6, 0], [0, -1 / 6, 0], [1 / 6, 0], [-0.5, 0]]), atol=1e-6, rtol=0)
    centred = run_plugin(PiCA, batch_of(), {"normalise": "mean", "credit": "reward"}).advantages
    torch.testing.assert_close(centred, per_token([[2 / 9, -1 / 9, 0], [2 / 9, -1 / 9, 0], [2 / 9, 0], [-4 / 9, 0]]),
                               atol=1e-6, rtol=0)


def test_gamma_discounts_the_shaping_and_the_return():
    # gamma 0.5, raw: c0 F = [.5 * 2/3 - 1/2, .5 * 1/2 - 2/3] = [-1/6, -5/12]; return [-1/6 + .5 * -5/12, -5/12]
    a = run_plugin(PiCA, batch_of(), {"normalise": "none", "gamma": 0.5}).advantages
    c0 = [-1 / 6 - 5 / 24, -5 / 12, 0]
    c2, c3 = [0.5 * 2 / 3 - 0.5, 0], [-0.5, 0]
    torch.testing.assert_close(a, per_token([c0, [-1 / 6 - 5 / 24, -5 / 12, 0], c2, c3]), atol=1e-6, rtol=0)


def test_action_and_reply_histories_differ_when_replies_differ():
    # c2's reply to turn 0 is 8, not 9: after turn 0's own tokens c2 still shares c0's history, after the reply not
    ids = [IDS[0], IDS[1], [5, 6, 8, 3], IDS[3]]
    raw = {"normalise": "none", "credit": "reward"}
    reply = run_plugin(PiCA, batch_of(ids=ids), raw).advantages
    # reply: after turn 0, c0 and c1 share -> 1/2, c2 alone -> 1: F c0 [0, 0], c2 [1/2], c3 [-1/2]
    torch.testing.assert_close(reply, per_token([[0, 0, 0], [0, 0, 0], [0.5, 0], [-0.5, 0]]), atol=1e-6, rtol=0)
    action = run_plugin(PiCA, batch_of(ids=ids), {**raw, "state": "action"}).advantages
    # action: after token 1, c0, c1, c2 share -> 2/3; after token 4 (c0, c1) 1/2, after c2's token 3 only c2 -> 1
    torch.testing.assert_close(action, per_token([[1 / 6, -1 / 6, 0], [1 / 6, -1 / 6, 0], [1 / 6, 0], [-0.5, 0]]),
                               atol=1e-6, rtol=0)


def test_gold_probability_potential():
    # P(gold | prompt, first e tokens) = 0.2 + 0.1 * e for rows 0-2, 0.1 for row 3 (a flat belief); mean log-prob -> P
    def fn(row, end, text, model):
        assert text == "3" and model == "policy"
        p = 0.1 if row == 3 else 0.2 + 0.1 * end
        return [math.log(p)] * 2
    seen = []
    batch = batch_of(columns={"answer": ["3"] * 4}, prefix_logps_fn=lambda *a: seen.append(a[:2]) or fn(*a))
    a = run_plugin(PiCA, batch, {"potential": "gold", "normalise": "none", "credit": "reward"}).advantages
    # reply states: c0 [0, 3, 6] -> P [.2, .5, .8]: F [.3, .3]; c2 [0, 3] -> [.2, .5]: F [.3]; c3: F [0]
    torch.testing.assert_close(a, per_token([[0.3, 0.3, 0], [0.3, 0.3, 0], [0.3, 0], [0.0, 0]]), atol=1e-6, rtol=0)
    # only the histories a step reads are scored: not the end of a completion
    assert sorted(set(seen)) == [(0, 0), (0, 3), (0, 6), (1, 0), (1, 3), (1, 6), (2, 0), (2, 3), (3, 0), (3, 3)]
    # a one-turn row has no step and a non-member's credit is 0: neither is scored
    seen.clear()
    one_turn = batch_of(tool=TOOL[:3] + [[1, 1, 1, 1, 0, 0, 0]], outcome=(1.0, None, 1.0, 0.0),
                        columns={"answer": ["3"] * 4}, prefix_logps_fn=lambda *a: seen.append(a[:2]) or fn(*a))
    run_plugin(PiCA, one_turn, {"potential": "gold"})
    assert sorted(set(seen)) == [(0, 0), (0, 3), (0, 6), (2, 0), (2, 3)]
    single = batch_of(tool=[[1] * 7] * 4, columns={"answer": ["3"] * 4})  # no scorer: one turn reads nothing
    outcome_only = run_plugin(PiCA, single, {"potential": "gold"}).advantages
    assert torch.equal(outcome_only, run_plugin(PiCA, single, {"potential": "gold", "coef": 0.0}).advantages)


def test_column_potential_with_the_groups_prior():
    # Phi_0 = the group's mean outcome 1/2; Phi_k+1 = the recorded value after turn k (None carries the last one)
    columns = {"turn_success": [[0.9, None, 1.0], [0.4, 0.1, 0.0], [None, 1.0], [0.2]]}
    tool = TOOL[:3] + [[1, 1, 1, 1, 0, 0, 0]]  # c3: one turn, so no step
    turn_of = TURN_OF[:3] + [[0, 0, 0, 0, None, None, None]]
    a = run_plugin(PiCA, batch_of(tool=tool, columns=columns), {"potential": "column", "normalise": "none",
                                                                "credit": "reward"}).advantages
    # c0 [.9 - .5, .9 - .9] = [.4, 0]; c1 [.4 - .5, .1 - .4] = [-.1, -.3]; c2 [.5 - .5] = [0] (None carries the prior)
    torch.testing.assert_close(a, per_token([[0.4, 0, 0], [-0.1, -0.3, 0], [0, 0], [0]], turn_of=turn_of),
                               atol=1e-6, rtol=0)
    with pytest.raises(RuntimeError, match=r"not success probabilities in \[0, 1\]"):
        run_plugin(PiCA, batch_of(columns={"turn_success": [[2.0], [0.1], [0.1], [0.1]]}), {"potential": "column"})
    assert plugin_set(PiCA, {"potential": "column"}).plugins[0].members.required_turn_values == ("turn_success",)
    with pytest.raises(PluginRuntimeError, match=r"needs per-turn values \['turn_success'\]"):
        run_plugin(PiCA, batch_of(), {"potential": "column"})


def test_step_penalty():
    assert penalties(5, 0.3, 1.5, 3).tolist() == pytest.approx([0, 0, 0, 0.45, 0.675])  # the official 0.3 * 1.5^(i-2)
    # free_turns 0: p = [.1 * 2, .1 * 4] on steps 0 and 1
    a = run_plugin(PiCA, batch_of(), {"normalise": "none", "credit": "reward", "penalty": 0.1, "growth": 2.0,
                                      "free_turns": 0}).advantages
    torch.testing.assert_close(a, per_token([[1 / 6 - 0.2, -1 / 6 - 0.4, 0], [1 / 6 - 0.2, -1 / 6 - 0.4, 0],
                                             [1 / 6 - 0.2, 0], [-0.5 - 0.2, 0]]), atol=1e-6, rtol=0)


def test_helpers():
    torch.testing.assert_close(carry_forward(torch.tensor([[NAN, 1.0, NAN], [2.0, NAN, 3.0]])),
                               torch.tensor([[NAN, 1.0, 1.0], [2.0, 2.0, 3.0]]), equal_nan=True)
    phi = torch.tensor([[0.5, 1.0, NAN, 0.0], [0.5, 0.2, 0.0, 0.0]])
    f, valid = shaping(phi, torch.tensor([3, 1]), 1.0)
    assert f.tolist() == [[0.5, 0.0, 0.0], [0.0, 0.0, 0.0]] and valid.tolist() == [[True, False, False], [False] * 3]
    z = normalise(torch.tensor([[1.0, 3.0], [5.0, 0.0]]), torch.tensor([[True, True], [False, False]]), 1)
    torch.testing.assert_close(z, torch.tensor([[-1.0, 1.0], [0.0, 0.0]]), atol=1e-5, rtol=0)
    # a group pooling one entry has std 1: z = 0; constant entries: 0
    assert normalise(torch.tensor([[4.0, 0.0]]), torch.tensor([[True, False]]), 1).tolist() == [[0.0, 0.0]]


def test_edge_cases_leave_the_outcome_advantage():
    # single-turn batch: no step is answered by an environment, so no step reward
    single = make_batch([1.0, 0.0, 0.0, 1.0], 4, lengths=[3, 2, 3, 1])
    plain = run_plugin(PiCA, single, {"coef": 0.0}).advantages
    torch.testing.assert_close(run_plugin(PiCA, make_batch([1.0, 0.0, 0.0, 1.0], 4, lengths=[3, 2, 3, 1])).advantages,
                               plain)
    # constant group: every potential equals the outcome, F = 0
    torch.testing.assert_close(run_plugin(PiCA, batch_of(outcome=[1.0] * 4)).advantages, torch.zeros(4, 7))
    # all-NaN turn values: the prior carries, F = 0
    columns = {"turn_success": [[None] * 3, [None] * 3, [None, None], [None, None]]}
    torch.testing.assert_close(run_plugin(PiCA, batch_of(columns=columns), {"potential": "column"}).advantages,
                               per_token([[0, 0, 0]] * 4))


def test_one_turn_rows_mixed_with_three_turn_rows():
    # c2, c3 one turn (tokens 0-3): no step of their own, and their model-written token 2 is not c0's reply, so
    # after turn 0 only c0 and c1 share a history: F c0 = c1 = [1/2 - 1/2, 1/2 - 1/2] = [0, 0]
    tool = TOOL[:2] + [[1, 1, 1, 1, 0, 0, 0]] * 2
    turn_of = TURN_OF[:2] + [[0, 0, 0, 0, None, None, None]] * 2
    a = run_plugin(PiCA, batch_of(tool=tool), {"normalise": "none"}).advantages
    torch.testing.assert_close(a, per_token([[0, 0, 0], [0, 0, 0], [0], [0]], turn_of=turn_of), atol=1e-6, rtol=0)
    # c2 a one-turn row [5, 6] that stops where c0's first turn ends: with state: action it shares c0's history after
    # turn 0 -> 2/3, so c0 F = [2/3 - 1/2, 1/2 - 2/3]; c2 and c3 still have no step
    ids = [IDS[0], IDS[1], [5, 6], [4, 4, 9, 3]]
    tool = TOOL[:2] + [[1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0]]
    turn_of = TURN_OF[:2] + [[0, 0, None, None, None, None, None], [0, 0, 0, 0, None, None, None]]
    a = run_plugin(PiCA, batch_of(ids=ids, tool=tool), {"normalise": "none", "credit": "reward", "state": "action"})
    torch.testing.assert_close(a.advantages, per_token([[1 / 6, -1 / 6, 0], [1 / 6, -1 / 6, 0], [0], [0]],
                                                       turn_of=turn_of), atol=1e-6, rtol=0)


class DropSecond(Plugin):
    """Drops the second completion of each group."""

    @hookimpl
    def filter_rollouts(self, batch):
        return torch.arange(batch.num_completions) % batch.num_generations != 1


def test_dropped_completions_are_not_members():
    result = run_plugin(PiCA, batch_of(), {"normalise": "none", "credit": "reward"}, others=[DropSecond])
    assert torch.equal(result.advantages[1], torch.zeros(7))
    # members c0, c2, c3: h_0 = 2/3; after turn 0 c0, c2 share -> 1; c3 -> 0; after c0's turn 1 -> 1
    # F: c0 [1/3, 0], c2 [1/3], c3 [-2/3]; the outcome advantages of [1, 1, 0] (c1 dropped, still in the baseline)
    plain = run_plugin(PiCA, batch_of(), {"coef": 0.0}, others=[DropSecond]).advantages
    credit = result.advantages - plain
    assert credit[0, :2].tolist() == pytest.approx([1 / 3, 1 / 3]) and credit[0, 3] == pytest.approx(0.0)
    assert credit[2, 0] == pytest.approx(1 / 3) and credit[3, 0] == pytest.approx(-2 / 3)


@pytest.mark.parametrize("options, text", [
    ({"potential": "column", "state": "action"}, "state applies to potential: prefix / gold"),
    ({"column": "x"}, "column is read only with potential: column"),
    ({"cue": "<answer>"}, "apply to potential: gold"),
    ({"potential": "gold", "answer_column": " "}, "must name a column"),
    ({"gamma": 1.5}, "gamma"),
    ({"growth": 0.5}, "growth"),
])
def test_options_are_checked_at_construction(options, text):
    with pytest.raises(ConfigError, match=r"plugins\[0\] \(pica\)") as info:
        plugin_set(PiCA, options, name="pica")
    assert text in str(info.value)


def test_declared_needs():
    members = plugin_set(PiCA, {"potential": "gold", "model": "reference"}).plugins[0].members
    assert members.required_columns == ("answer",) and members.needs_reference
    members = plugin_set(PiCA, {"reward": "solved"}).plugins[0].members
    assert members.required_rewards == ("solved",) and members.required_turn_values == () and not members.needs_reference


def test_contract_on_multi_turn_batches():
    columns = {"turn_success": [[0.9, None, 1.0], [0.4, 0.1, 0.0], [None, 1.0], [0.2, 0.3]]}
    check_plugin(PiCA, batches=[batch_of, lambda: batch_of(outcome=[1.0, None, 0.0, 0.0])])
    check_plugin(PiCA, {"potential": "column"}, batches=[lambda: batch_of(columns=columns)])
    check_plugin(PiCA)  # the kit's edge cases (single turns)
    check_plugin(PiCA, {"potential": "column"})  # the kit fills the declared turn_success


class Record(Plugin):
    """Keeps every final batch and its advantages."""

    seen: list = []

    @hookimpl
    def on_batch_end(self, batch, advantages):
        Record.seen.append((batch, advantages.clone()))


@pytest.mark.parametrize("options", [{}, {"potential": "gold", "credit": "reward"}])
def test_trains_on_scripted_turns(tmp_path, monkeypatch, options):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    Record.seen.clear()
    trainer = train_tiny([{"name": "pica", **options}, Record], output_dir=tmp_path, rollout_func=ScriptedTurns(),
                         reward_funcs=[scripted_turns_reward], max_completion_length=32)
    logs = trainer.state.log_history[0]
    assert math.isfinite(logs["loss"]) and 0.0 <= logs["trl_credit/pica/positive_steps"] <= 1.0
    assert math.isfinite(logs["trl_credit/pica/potential_start"]) and logs["trl_credit/pica/credited_steps"] > 0
    batch, advantages = Record.seen[-1]
    assert int(batch.turns().count.max()) > 1 and advantages.dim() == 2
    # what was trained on is the formula on that batch (gold: the cached scores of the real prefix pass)
    torch.testing.assert_close(advantages, run_plugin(PiCA, batch, options).advantages)
    outcome = run_plugin(PiCA, batch, {**options, "coef": 0.0}).advantages
    credit = (advantages - outcome)[batch.turns().model]
    assert credit.abs().max() > 0
    if options.get("potential") == "gold":  # the potentials are probabilities of the gold answer, not outcomes
        phi = PiCA(PiCA.Config(**options)).potentials(batch, batch.total_reward(), batch.kept)
        read = batch.kept & (batch.turns().count >= 2)  # the rows with a step: the only ones scored
        assert read.any() and bool(((phi > 0) & (phi < 1))[read, 0].all()) and bool(phi[~read, 0].isnan().all())
