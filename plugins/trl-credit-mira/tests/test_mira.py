"""MiRA: hand-computed newly reached milestones (new, total and distance readings) and token advantages on
tool-masked rollouts (turn and return credit, the group baseline and z-score), edge cases, the options' checks,
the contract on a multi-turn batch and a real multi-turn training run."""

from __future__ import annotations

import math

import pytest
import torch

from trl_credit import ConfigError, Plugin, PluginRuntimeError, group_normalise, hookimpl
from trl_credit.testing import ScriptedTurns, check_plugin, make_batch, plugin_set, run_plugin, scripted_turns_reward
from trl_credit.testing import train_tiny
from trl_credit_mira import MiRA, new_milestones

NAN = math.nan
# one group of two. c0: four model turns at tokens 0, 2, 4, 6-7 (replies at 1, 3, 5); c1: three turns at 0-1,
# 3, 5 (replies at 2 and 4), padding at 6-7
TOOL = [[1, 0, 1, 0, 1, 0, 1, 1], [1, 1, 0, 1, 0, 1, 1, 1]]
MASK = [[1] * 8, [1, 1, 1, 1, 1, 1, 0, 0]]
TURN_OF = [[0, None, 1, None, 2, None, 3, 3], [0, 0, None, 1, None, 2, None, None]]
A = 0.5 / (math.sqrt(0.5) + 1e-4)  # TRL's GRPO advantage of outcomes [1, 0]: 0.707007


def batch_of(values, outcome=(1.0, 0.0), tool=TOOL, mask=MASK, column="turn_milestones"):
    return make_batch(list(outcome), len(outcome), completion_mask=mask, tool_mask=tool, columns={column: values})


def per_token(credit, base=(A, -A), turn_of=TURN_OF):
    return torch.tensor([[base[i] + (credit[i][k] if k is not None else 0.0) for k in row]
                         for i, row in enumerate(turn_of)])


VALID = torch.tensor([[True] * 4, [True, True, True, False]])


def test_new_milestones_in_the_three_readings():
    # total: reached so far c0 [1, -, 1, 3] -> best [1, 1, 1, 3] -> new [1, 0, 0, 2]; c1 [0, 2, 1] -> new [0, 2, 0]
    total = torch.tensor([[1.0, NAN, 1.0, 3.0], [0.0, 2.0, 1.0, NAN]])
    expected = torch.tensor([[1.0, 0, 0, 2], [0, 2, 0, 0]])
    torch.testing.assert_close(new_milestones(total, VALID, "total"), expected)
    new = torch.tensor([[1.0, NAN, 0.0, 2.0], [0.0, 2.0, 0.0, NAN]])  # already per turn (None: nothing)
    torch.testing.assert_close(new_milestones(new, VALID, "new"), expected)
    # distance, milestones <= 3, <= 1, <= 0: c0 [5, 3, -, 0] -> best [5, 3, 3, 0] -> reached [0, 1, 1, 3];
    # c1 [2, 4, 1] -> best [2, 2, 1] -> reached [1, 1, 2]
    distance = torch.tensor([[5.0, 3.0, NAN, 0.0], [2.0, 4.0, 1.0, NAN]])
    torch.testing.assert_close(new_milestones(distance, VALID, "distance", [3, 1, 0]),
                               torch.tensor([[0.0, 1, 0, 2], [1, 0, 1, 0]]))


def test_hand_computed_turn_bonus():
    # bonus .5 per new milestone, on the turn that reached it, added to the outcome advantage
    result = run_plugin(MiRA, batch_of([[1, None, 1, 3], [0, 2, 1]]), {"values": "total"})
    torch.testing.assert_close(result.advantages, per_token([[0.5, 0, 0, 1.0], [0, 1.0, 0]]))
    assert result.metrics["mira/milestones"] == pytest.approx(2.5)  # (3 + 2) / 2 per trajectory
    assert result.metrics["mira/milestone_turns"] == pytest.approx(3 / 7)
    assert result.metrics["mira/recorded"] == pytest.approx(6 / 7)


def test_return_credit_and_a_discount():
    a = run_plugin(MiRA, batch_of([[1, None, 0, 2], [0, 2, 0]]), {"credit": "return"}).advantages
    torch.testing.assert_close(a, per_token([[1.5, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]))  # .5 x [3, 2, 2, 2], [2, 2, 0]
    half = run_plugin(MiRA, batch_of([[1, None, 0, 2], [0, 2, 0]]), {"credit": "return", "gamma": 0.5}).advantages
    # G_k = n_k + .5 G_k+1: c0 [1.25, .5, 1, 2], c1 [1, 2, 0]; x .5
    torch.testing.assert_close(half, per_token([[0.625, 0.25, 0.5, 1.0], [0.5, 1.0, 0.0]]))


def test_group_baseline_and_z_score():
    values = [[1, None, 0, 2], [0, 2, 0]]
    # pool of new counts [1, 0, 0, 2, 0, 2, 0]: mu = 5/7
    mu = 5 / 7
    centred = run_plugin(MiRA, batch_of(values), {"normalise": "mean", "bonus": 1.0}).advantages
    torch.testing.assert_close(centred, per_token([[1 - mu, -mu, -mu, 2 - mu], [-mu, 2 - mu, -mu]]))
    # population sigma = sqrt(5.428571 / 7) = .880630 -> z = [.324443, -.811107, -.811107, 1.459993, ...]; x .5
    z = run_plugin(MiRA, batch_of(values), {"normalise": "group"}).advantages
    hi, lo, one = 0.729996, -0.405553, 0.162221
    torch.testing.assert_close(z, per_token([[one, lo, lo, hi], [lo, hi, lo]]), atol=1e-5, rtol=0)


def test_distance_milestones_on_a_guess_style_rollout():
    # guess_distance per turn, milestones "within 3", "within 1", "right": new [0, 1, 0, 2] and [1, 0, 1]
    batch = batch_of([[5.0, 3.0, None, 0.0], [2.0, 4.0, 1.0]], column="guess_distance")
    a = run_plugin(MiRA, batch, {"column": "guess_distance", "values": "distance", "thresholds": [3, 1, 0]}).advantages
    torch.testing.assert_close(a, per_token([[0, 0.5, 0, 1.0], [0.5, 0, 0.5]]))


def test_edge_cases_keep_the_outcome():
    outcome_only = per_token([[0] * 4, [0] * 3])
    # nothing recorded on any turn
    torch.testing.assert_close(run_plugin(MiRA, batch_of([[None] * 4, [None] * 3])).advantages, outcome_only)
    # a constant group under the z-score: every turn reaches one milestone
    torch.testing.assert_close(run_plugin(MiRA, batch_of([[1] * 4, [1] * 3]), {"normalise": "group"}).advantages,
                               outcome_only)
    # single-turn batch (no tool mask): the bonus on the one turn
    single = make_batch([1.0, 0.0, 0.0, 1.0], 4, lengths=[3, 2, 3, 1], columns={"turn_milestones": [[2], [0], None, [1]]})
    a = run_plugin(MiRA, single).advantages
    plain = run_plugin(MiRA, single, {"bonus": 0.0}).advantages
    torch.testing.assert_close((a - plain)[:, 0], torch.tensor([1.0, 0.0, 0.0, 0.5]))


def test_one_turn_rows_mixed_with_multi_turn_rows():
    tool = [TOOL[0], [1] * 8]
    turn_of = [TURN_OF[0], [0] * 8]
    a = run_plugin(MiRA, batch_of([[1, None, 0, 2], [3]], tool=tool, mask=[[1] * 8] * 2)).advantages
    torch.testing.assert_close(a, per_token([[0.5, 0, 0, 1.0], [1.5]], turn_of=turn_of))


class DropSecond(Plugin):
    """Drops the second completion of each group."""

    @hookimpl
    def filter_rollouts(self, batch):
        return torch.arange(batch.num_completions) % batch.num_generations != 1


def test_dropped_completions_get_nothing_and_leave_the_baseline():
    batch = make_batch([1.0, 0.0, 1.0, 0.0], 4, completion_mask=[[1] * 8] * 4, tool_mask=[[1] * 8] * 4,
                       columns={"turn_milestones": [[2], [4], [0], [1]]})
    result = run_plugin(MiRA, batch, {"normalise": "mean", "bonus": 1.0}, others=[DropSecond])
    assert torch.equal(result.advantages[1], torch.zeros(8))
    plain = run_plugin(MiRA, make_batch([1.0, 0.0, 1.0, 0.0], 4, completion_mask=[[1] * 8] * 4,
                                        tool_mask=[[1] * 8] * 4, columns={"turn_milestones": [[2], [4], [0], [1]]}),
                       {"bonus": 0.0}, others=[DropSecond])
    credit = (result.advantages - plain.advantages)[:, 0]
    torch.testing.assert_close(credit, torch.tensor([1.0, 0.0, -1.0, 0.0]))  # mean of the kept [2, 0, 1] is 1


def test_an_unscored_row_gets_nothing_and_leaves_the_baseline():
    columns = {"turn_milestones": [[2], [4], [0], [1]]}
    batch = make_batch([1.0, None, 1.0, 0.0], 4, completion_mask=[[1] * 8] * 4, tool_mask=[[1] * 8] * 4,
                       columns=columns)
    result = run_plugin(MiRA, batch, {"normalise": "mean", "bonus": 1.0})
    plain = run_plugin(MiRA, make_batch([1.0, None, 1.0, 0.0], 4, completion_mask=[[1] * 8] * 4,
                                        tool_mask=[[1] * 8] * 4, columns=columns), {"bonus": 0.0})
    credit = (result.advantages - plain.advantages)[:, 0]
    # row 1's rewards are all None (NaN): no credit, and the mean is of the scored [2, 0, 1]
    torch.testing.assert_close(credit, torch.tensor([1.0, 0.0, -1.0, 0.0]))


def test_a_batch_without_the_column_is_refused_by_the_host():
    assert plugin_set(MiRA, {"column": "guess_distance", "values": "distance", "thresholds": [0]}
                      ).plugins[0].members.required_turn_values == ("guess_distance",)
    batch = make_batch([1.0, 0.0], 2, completion_mask=MASK, tool_mask=TOOL, columns={"other": [[1], [2]]})
    with pytest.raises(PluginRuntimeError, match=r"plugin 'mira' needs per-turn values \['turn_milestones'\] "
                                                 r"\(required_turn_values\).*step 0"):
        run_plugin(MiRA, batch)


def test_negative_counts_are_refused():
    with pytest.raises(RuntimeError, match="negative milestone count"):
        run_plugin(MiRA, batch_of([[1, -1, 0, 0], [0, 0, 0]]))


@pytest.mark.parametrize("options, text", [
    ({"values": "distance"}, "values: distance needs `thresholds`"),
    ({"thresholds": [1]}, "thresholds is read only with values: distance"),
    ({"bonus": -0.1}, "bonus"),
    ({"gamma": 2}, "gamma"),
])
def test_options_are_checked_at_construction(options, text):
    with pytest.raises(ConfigError, match=r"plugins\[0\] \(mira\)") as info:
        plugin_set(MiRA, options, name="mira")
    assert text in str(info.value)


def test_normalise_outside_the_pool_is_zero():
    x = torch.tensor([[1.0, 3.0], [5.0, 9.0]])
    pool = torch.tensor([[True, True], [True, False]])
    torch.testing.assert_close(group_normalise(x, pool, 2, "mean"), torch.tensor([[-2.0, 0.0], [2.0, 0.0]]))


def test_contract_on_a_multi_turn_batch():
    check_plugin(MiRA, {"values": "total"}, batches=[lambda: batch_of([[1, None, 1, 3], [0, 2, 1]]),
                                                     lambda: batch_of([[None] * 4, [None] * 3])])
    check_plugin(MiRA, {"normalise": "group", "credit": "return"},
                 batches=[lambda: batch_of([[1, None, 0, 2], [0, 2, 0]])])
    check_plugin(MiRA)  # the kit's edge cases, with the declared turn_milestones filled in (0.5, 1.0, ... per turn)


class Record(Plugin):
    """Keeps every final batch and its advantages."""

    seen: list = []

    @hookimpl
    def on_batch_end(self, batch, advantages):
        Record.seen.append((batch, advantages.clone()))


def test_trains_on_scripted_turns(tmp_path, monkeypatch):
    # ScriptedTurns records checks passed per turn (0..3); read as milestones reached so far
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    Record.seen.clear()
    options = {"column": "turn_checks", "values": "total"}
    trainer = train_tiny([{"name": "mira", **options}, Record], output_dir=tmp_path, rollout_func=ScriptedTurns(),
                         reward_funcs=[scripted_turns_reward], max_completion_length=32)
    logs = trainer.state.log_history[0]
    assert math.isfinite(logs["loss"]) and logs["trl_credit/mira/recorded"] == 1.0
    assert 0.0 <= logs["trl_credit/mira/milestone_turns"] <= 1.0 and logs["trl_credit/mira/milestones"] >= 0
    batch, advantages = Record.seen[-1]
    assert int(batch.turns().count.max()) > 1 and advantages.dim() == 2
    torch.testing.assert_close(advantages, run_plugin(MiRA, batch, options).advantages)
    credit = (advantages - run_plugin(MiRA, batch, {**options, "bonus": 0.0}).advantages)[batch.turns().model]
    assert credit.min() >= 0 and credit.max() > 0  # bonuses only, and some turn reached a milestone
