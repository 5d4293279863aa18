"""ProCredit: hand-computed progress rewards and token advantages on tool-masked rollouts (turn and return
credit, the final-progress term, the totals, the distance reading of the guess task), edge cases, the options'
checks, the contract on a multi-turn batch and a real multi-turn training run."""

from __future__ import annotations

import math

import pytest
import torch

from trl_credit import ConfigError, Plugin, PluginRuntimeError, carry_forward, group_normalise, hookimpl
from trl_credit.testing import check_plugin, make_batch, plugin_set, run_plugin, train_tiny
from trl_credit.testing import ScriptedTurns, scripted_turns_reward
from trl_credit_procredit import ProCredit, progress_rewards

NAN = math.nan
# one group of two. c0: model turns at tokens 0-1, 3-4, 6 (replies at 2 and 5); c1: turns at 0 and 3-4 (reply at
# 1-2), padding at 5-6
TOOL = [[1, 1, 0, 1, 1, 0, 1], [1, 0, 0, 1, 1, 1, 1]]
MASK = [[1] * 7, [1, 1, 1, 1, 1, 0, 0]]
TURN_OF = [[0, 0, None, 1, 1, None, 2], [0, None, None, 1, 1, None, None]]  # None: not a model token
A = 0.5 / (math.sqrt(0.5) + 1e-4)  # TRL's GRPO advantage of outcomes [1, 0]: (r - 0.5) / (std + 1e-4) = 0.707007


def batch_of(checks, outcome=(1.0, 0.0), tool=TOOL, mask=MASK, column="turn_checks", **columns):
    return make_batch(list(outcome), len(outcome), completion_mask=mask, tool_mask=tool,
                      columns={column: checks, **columns}, reward_names=["solved"])


def per_token(credit, base=(A, -A), turn_of=TURN_OF, width=7):
    """Expected token advantages: the outcome advantage, plus the turn's credit on its model tokens."""
    return torch.tensor([[base[i] + (credit[i][k] if k is not None else 0.0) for k in row[:width]]
                         for i, row in enumerate(turn_of)])


def test_carry_forward_and_progress_rewards():
    c = torch.tensor([[NAN, 1.0, NAN, 3.0], [2.0, NAN, NAN, NAN]])
    torch.testing.assert_close(carry_forward(c, 0.0), torch.tensor([[0.0, 1.0, 1.0, 3.0], [2.0, 2.0, 2.0, 2.0]]))
    valid = torch.tensor([[True] * 4, [True, True, False, False]])
    # of 4 checks, f_-1 = 0; a NaN turn carries the last fraction (reward 0); nothing past a row's turns
    r = progress_rewards(c, torch.tensor([[4.0], [4.0]]), valid)
    torch.testing.assert_close(r, torch.tensor([[0.0, 0.25, 0.0, 0.5], [0.5, 0, 0, 0]]))


def test_hand_computed_turn_credit():
    # total 4 checks. c0 passes [1, -, 3] -> f [.25, .25, .75] -> r [.25, 0, .5]; c1 [0, 2] -> f [0, .5] -> r [0, .5]
    # pool [.25, 0, .5, 0, .5]: mu = .25, population sigma = sqrt(.05) = .2236068 -> z = +-.25 / (.2236068 + 1e-6)
    z = 0.25 / (math.sqrt(0.05) + 1e-6)  # 1.118029
    result = run_plugin(ProCredit, batch_of([[1, None, 3], [0, 2]]), {"total_checks": 4})
    torch.testing.assert_close(result.advantages, per_token([[0.0, -z, z], [-z, z]]), atol=1e-5, rtol=0)
    assert result.metrics["procredit/progress_credit"] == pytest.approx(1.25 / 5)  # mean r over the 5 turns
    assert result.metrics["procredit/progress_turns"] == pytest.approx(3 / 5)
    assert result.metrics["procredit/recorded"] == pytest.approx(4 / 5)  # c0's second turn ran no check
    assert result.metrics["procredit/final_progress"] == pytest.approx((0.75 + 0.5) / 2)


def test_return_credit_and_coef():
    # returns c0 [.75, .5, .5], c1 [.5, .5]: mu = .55, sigma = .1 -> z = [2, -.5, -.5], [-.5, -.5] (x 0.1 / (0.1 + 1e-6))
    s = 0.1 / (0.1 + 1e-6)
    result = run_plugin(ProCredit, batch_of([[1, None, 3], [0, 2]]), {"total_checks": 4, "credit": "return",
                                                                       "coef": 0.5})
    expected = per_token([[0.5 * 2 * s, -0.25 * s, -0.25 * s], [-0.25 * s, -0.25 * s]])
    torch.testing.assert_close(result.advantages, expected, atol=1e-5, rtol=0)


def test_raw_and_mean_centred_credit():
    batch = lambda: batch_of([[1, None, 3], [0, 2]])  # noqa: E731
    raw = run_plugin(ProCredit, batch(), {"total_checks": 4, "normalise": "none"}).advantages
    torch.testing.assert_close(raw, per_token([[0.25, 0.0, 0.5], [0.0, 0.5]]))
    centred = run_plugin(ProCredit, batch(), {"total_checks": 4, "normalise": "mean"}).advantages
    torch.testing.assert_close(centred, per_token([[0.0, -0.25, 0.25], [-0.25, 0.25]]))


def test_final_progress_term_on_every_model_token():
    # f_K = .75 and .5 -> z = +-.125 / (.125 + 1e-6); coef 0 leaves the final term alone
    zf = 0.125 / (0.125 + 1e-6)
    result = run_plugin(ProCredit, batch_of([[1, None, 3], [0, 2]]), {"total_checks": 4, "coef": 0.0,
                                                                       "final_weight": 2.0})
    torch.testing.assert_close(result.advantages, per_token([[2 * zf] * 3, [-2 * zf] * 2]), atol=1e-5, rtol=0)


def test_totals_batch_group_and_column():
    checks = [[1, None, 3], [0, 2]]
    raw = {"normalise": "none"}
    # batch (default): the most checks passed anywhere, 3 -> c0 f [1/3, 1/3, 1], c1 [0, 2/3]
    expected = per_token([[1 / 3, 0.0, 2 / 3], [0.0, 2 / 3]])
    torch.testing.assert_close(run_plugin(ProCredit, batch_of(checks), raw).advantages, expected)
    # a column of totals per completion: c0 of 6, c1 of 2
    by_column = run_plugin(ProCredit, batch_of(checks, n_checks=[6, 2]), {**raw, "total_column": "n_checks"})
    torch.testing.assert_close(by_column.advantages, per_token([[1 / 6, 0.0, 2 / 6], [0.0, 1.0]]))
    # group: two groups of one; each completion's own maximum (3 and 2)
    grouped = make_batch([1.0, 0.0], 1, completion_mask=MASK, tool_mask=TOOL, columns={"turn_checks": checks})
    a = run_plugin(ProCredit, grouped, {**raw, "total_checks": "group"}).advantages
    torch.testing.assert_close(a, per_token([[1 / 3, 0.0, 2 / 3], [0.0, 1.0]], base=(0.0, 0.0)))


def test_distance_reading_on_a_guess_style_rollout():
    # the guess task's guess_distance, checks = thresholds [3, 1, 0]: c0 distances [4, 1, 0] pass [0, 2, 3] checks
    # -> f [0, 2/3, 1] -> r [0, 2/3, 1/3]; c1 [2, -, 5] pass [1, -, 0] -> f [1/3, 1/3, 0] -> r [1/3, 0, -1/3]
    tool = [[1, 1, 0, 1, 1, 0, 1], [1, 0, 1, 0, 1, 1, 1]]
    turn_of = [[0, 0, None, 1, 1, None, 2], [0, None, 1, None, 2, 2, 2]]
    batch = make_batch([1.0, 0.0], 2, completion_mask=[[1] * 7] * 2, tool_mask=tool,
                       columns={"guess_distance": [[4.0, 1.0, 0.0], [2.0, None, 5.0]]})
    result = run_plugin(ProCredit, batch, {"column": "guess_distance", "values": "distance", "thresholds": [3, 1, 0]})
    pool = [0, 2 / 3, 1 / 3, 1 / 3, 0, -1 / 3]
    mu = sum(pool) / 6
    sigma = math.sqrt(sum((x - mu) ** 2 for x in pool) / 6)
    z = [(x - mu) / (sigma + 1e-6) for x in pool]  # [-0.522231, 1.566694, 0.522231, 0.522231, -0.522231, -1.566694]
    assert z[1] == pytest.approx(1.566694, abs=1e-6)
    torch.testing.assert_close(result.advantages, per_token([z[:3], z[3:]], turn_of=turn_of), atol=1e-5, rtol=0)
    # the guess task's one acceptance check (the right number): credit only on the solving turn, over the group
    one = run_plugin(ProCredit, batch, {"column": "guess_distance", "values": "distance", "thresholds": [0],
                                        "normalise": "none"}).advantages
    torch.testing.assert_close(one, per_token([[0, 0, 1.0], [0, 0, 0]], turn_of=turn_of))


def test_all_nan_constant_groups_and_single_turns_leave_the_outcome():
    outcome_only = per_token([[0, 0, 0], [0, 0]])
    # no check ran anywhere: every fraction carries 0
    torch.testing.assert_close(run_plugin(ProCredit, batch_of([[None] * 3, [None, None]])).advantages, outcome_only)
    # the same progress on every turn of the group: z = 0
    torch.testing.assert_close(run_plugin(ProCredit, batch_of([[1, 2, 3], [1, 2]]), {"total_checks": 3}).advantages,
                               outcome_only)
    # single-turn batch (no tool mask): r = f_0, compared across the group
    single = make_batch([1.0, 0.0, 0.0, 1.0], 4, lengths=[3, 2, 3, 1], columns={"turn_checks": [[2], [0], [1], None]})
    a = run_plugin(ProCredit, single, {"total_checks": 2, "normalise": "none"}).advantages
    assert a.shape == (4, 3)
    outcome = run_plugin(ProCredit, single, {"total_checks": 2, "coef": 0.0}).advantages
    torch.testing.assert_close((a - outcome)[:, 0], torch.tensor([1.0, 0.0, 0.5, 0.0]))  # None: no check, 0


def test_one_turn_rows_mixed_with_three_turn_rows():
    # c0: three turns (as before); c1: one turn over tokens 0-4. total 4: c0 r [.25, 0, .5], c1 passes 2 -> r [.5]
    tool = [TOOL[0], [1, 1, 1, 1, 1, 1, 1]]
    turn_of = [TURN_OF[0], [0, 0, 0, 0, 0, None, None]]
    a = run_plugin(ProCredit, batch_of([[1, None, 3], [2]], tool=tool), {"total_checks": 4}).advantages
    # pool [.25, 0, .5, .5]: mu = .3125, deviations [-.0625, -.3125, .1875, .1875], sigma = sqrt(.171875 / 4) = .2072906
    z = [-0.301511, -1.507557, 0.904534, 0.904534]
    torch.testing.assert_close(a, per_token([z[:3], z[3:]], turn_of=turn_of), atol=1e-5, rtol=0)


class DropSecond(Plugin):
    """Drops the second completion of each group."""

    @hookimpl
    def filter_rollouts(self, batch):
        return torch.arange(batch.num_completions) % batch.num_generations != 1


def test_dropped_completions_are_out_of_the_pool():
    checks = [[1, None, 3], [0, 4], [2], [4]]
    tool = TOOL + [[1] * 7, [1] * 7]
    mask = MASK + [[1] * 7, [1] * 7]
    batch = make_batch([1.0, 0.0, 1.0, 1.0], 4, completion_mask=mask, tool_mask=tool, columns={"turn_checks": checks})
    result = run_plugin(ProCredit, batch, {"total_checks": 4}, others=[DropSecond])
    assert torch.equal(result.advantages[1], torch.zeros(7))
    # pool: c0 [.25, 0, .5], c2 [.5], c3 [1.0] (c1 dropped): mu = .45, sigma = sqrt(.55 / 5) = .331662
    plain = run_plugin(ProCredit, make_batch([1.0, 0.0, 1.0, 1.0], 4, completion_mask=mask, tool_mask=tool,
                                             columns={"turn_checks": checks}), {"coef": 0.0}, others=[DropSecond])
    credit = result.advantages - plain.advantages
    assert credit[3, 0].item() == pytest.approx(1.658312, abs=1e-5)  # (1 - .45) / (.331662 + 1e-6)


def test_unscored_completions_are_out_of_the_pool():
    # c1 unscored (every reward None) instead of dropped: the same pool, and c1 gets 0
    checks = [[1, None, 3], [0, 4], [2], [4]]
    tool, mask = TOOL + [[1] * 7, [1] * 7], MASK + [[1] * 7, [1] * 7]

    def batch():
        return make_batch([1.0, None, 1.0, 1.0], 4, completion_mask=mask, tool_mask=tool,
                          columns={"turn_checks": checks})

    result = run_plugin(ProCredit, batch(), {"total_checks": 4})
    assert torch.equal(result.advantages[1], torch.zeros(7))
    credit = result.advantages - run_plugin(ProCredit, batch(), {"coef": 0.0}).advantages
    assert credit[3, 0].item() == pytest.approx(1.658312, abs=1e-5)


def test_a_batch_without_the_column_is_refused_by_the_host():
    assert plugin_set(ProCredit, {"column": "checks"}).plugins[0].members.required_turn_values == ("checks",)
    batch = make_batch([1.0, 0.0], 2, completion_mask=MASK, tool_mask=TOOL, columns={"other": [[1], [2]]})
    with pytest.raises(PluginRuntimeError, match=r"plugin 'procredit' needs per-turn values \['turn_checks'\] "
                                                 r"\(required_turn_values\).*step 0"):
        run_plugin(ProCredit, batch)


def test_bad_values_name_the_column_and_the_fix():
    with pytest.raises(RuntimeError, match="passed more checks than its total.*fix: total_checks"):
        run_plugin(ProCredit, batch_of([[1, None, 5], [0, 2]]), {"total_checks": 4})
    with pytest.raises(RuntimeError, match="negative number of checks"):
        run_plugin(ProCredit, batch_of([[1, None, -1], [0, 2]]))
    with pytest.raises(RuntimeError, match="total_column 'n' must hold a positive"):
        run_plugin(ProCredit, batch_of([[1, None, 1], [0, 2]], n=[3, 0]), {"total_column": "n"})


@pytest.mark.parametrize("options, text", [
    ({"values": "distance"}, "values: distance needs `thresholds`"),
    ({"thresholds": [0]}, "thresholds is read only with values: distance"),
    ({"values": "distance", "thresholds": [0], "total_checks": 3}, "counts its checks from `thresholds`"),
    ({"total_checks": 0}, "total_checks must be >= 1"),
    ({"total_checks": 3, "total_column": "n"}, "give total_checks or total_column, not both"),
    ({"coef": -1}, "coef"),
])
def test_options_are_checked_at_construction(options, text):
    with pytest.raises(ConfigError, match=r"plugins\[0\] \(procredit\)") as info:
        plugin_set(ProCredit, options, name="procredit")
    assert text in str(info.value)


def test_normalise_handles_sequences_too():
    x = torch.tensor([0.75, 0.5, 1.0, 1.0])
    z = group_normalise(x, torch.tensor([True, True, True, False]), 2, "group")
    torch.testing.assert_close(z, torch.tensor([0.125 / (0.125 + 1e-6), -0.125 / (0.125 + 1e-6), 0.0, 0.0]))


def test_contract_on_a_multi_turn_batch():
    check_plugin(ProCredit, {"total_checks": 4}, batches=[lambda: batch_of([[1, None, 3], [0, 2]]),
                                                          lambda: batch_of([[None] * 3, [None, None]])])
    check_plugin(ProCredit)  # the kit's edge cases, with the declared turn_checks filled in (0.5, 1.0, ... per turn)


class Record(Plugin):
    """Keeps every final batch and its advantages."""

    seen: list = []

    @hookimpl
    def on_batch_end(self, batch, advantages):
        Record.seen.append((batch, advantages.clone()))


def test_trains_on_scripted_turns(tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    Record.seen.clear()
    options = {"name": "procredit", "total_checks": 3}
    trainer = train_tiny([options, Record], output_dir=tmp_path, rollout_func=ScriptedTurns(),
                         reward_funcs=[scripted_turns_reward], max_completion_length=32)
    logs = trainer.state.log_history[0]
    assert math.isfinite(logs["loss"]) and 0.0 <= logs["trl_credit/procredit/progress_turns"] <= 1.0
    assert logs["trl_credit/procredit/recorded"] == 1.0 and math.isfinite(logs["trl_credit/procredit/progress_credit"])
    batch, advantages = Record.seen[-1]
    assert int(batch.turns().count.max()) > 1 and advantages.dim() == 2
    # what was trained on is the formula on that batch: the outcome advantage + the progress credit
    again = run_plugin(ProCredit, batch, {"total_checks": 3})
    torch.testing.assert_close(advantages, again.advantages)
    outcome = run_plugin(ProCredit, batch, {"total_checks": 3, "coef": 0.0}).advantages
    credit = (advantages - outcome)[batch.turns().model]
    assert credit.abs().max() > 0  # the checks passed in ScriptedTurns differ between turns
