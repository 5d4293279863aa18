"""Outcome-based exploration: methods.md vectors, the count table, edge cases, checkpoint and resume."""

from __future__ import annotations

import io
import math
import random
import sys
from typing import ClassVar

import pytest
import torch
from trl_credit_outcome_exploration import (
    UNPARSEABLE,
    OutcomeExploration,
    batch_penalty,
    canonical_last_number,
    canonical_last_numbers,
    historical_bonus,
)

from trl_credit import ConfigError, PluginRuntimeError, hookimpl, last_number
from trl_credit.testing import (
    STATE_FILE,
    check_args,
    check_plugin,
    edge_case_batches,
    make_batch,
    plugin_set,
    run_plugin,
    train_tiny,
)

HIST_ONLY = {"batch": False}
BATCH_ONLY = {"historical": False}


def run(completions, config=None, *, plugin=None, g=None, rewards=None, **kw):
    """Run the plugin (optionally an existing instance, to keep its table) on one batch."""
    g = g or len(completions)
    rewards = rewards if rewards is not None else [0.0] * len(completions)
    batch = make_batch(rewards, g, completions=completions, **kw)
    if plugin is None:
        return run_plugin(OutcomeExploration, batch, config)
    assert config is None, "an existing plugin brings its own config"
    return run_plugin(plugin, batch)


def bonus_of(result):
    return result.rewards[:, result.reward_names.index("exploration_bonus")]


# ------------------------------------------------------------------------- methods.md vectors
def test_historical_vector():
    torch.testing.assert_close(historical_bonus(torch.tensor([1, 4, 100])), torch.tensor([1.0, 0.5, 0.1]))
    torch.testing.assert_close(historical_bonus(torch.tensor([0, 1, 4]), c=0.3), torch.tensor([0.3, 0.3, 0.15]))


def test_historical_vector_through_the_table():
    plugin = OutcomeExploration(OutcomeExploration.Config(**HIST_ONLY))
    plugin.load_state_dict({"table": [(0, [("1", 1), ("2", 4), ("3", 100)])]})
    result = run(["x = 1", "so 2", "it is 3"], plugin=plugin)
    torch.testing.assert_close(bonus_of(result), torch.tensor([1.0, 0.5, 0.1]))
    # counts are updated after the bonus: this round's sightings are added
    assert [plugin.count(0, a) for a in "123"] == [2, 5, 101]
    assert result.metrics["outcome_exploration/historical_bonus"] == pytest.approx(1.6 / 3)
    assert result.metrics["outcome_exploration/new_answer_fraction"] == 0.0


def test_batch_vector():
    torch.testing.assert_close(batch_penalty(torch.tensor([0, 0, 1, 2]), 4), torch.tensor([-0.25, -0.25, 0.0, 0.0]))
    result = run(["3", "3", "5", "7"], BATCH_ONLY)
    torch.testing.assert_close(bonus_of(result), torch.tensor([-0.25, -0.25, 0.0, 0.0]))
    # c_batch scales; all-equal group of 4: each has 3 others -> -3/4
    result = run(["3", "3", "3", "3"], {**BATCH_ONLY, "c_batch": 2.0})
    torch.testing.assert_close(bonus_of(result), torch.full((4,), -1.5))


def test_both_parts_over_two_rounds():
    plugin = OutcomeExploration()
    first = run(["3", "3", "5", "7"], plugin=plugin)
    # first sighting: N = 0 -> bonus 1, plus the group penalty
    torch.testing.assert_close(bonus_of(first), torch.tensor([0.75, 0.75, 1.0, 1.0]))
    assert first.metrics["outcome_exploration/new_answer_fraction"] == 1.0
    second = run(["3", "5", "9", "9"], plugin=plugin)
    r2 = 1 / math.sqrt(2)
    torch.testing.assert_close(bonus_of(second), torch.tensor([r2, 1.0, 0.75, 0.75]))
    assert dict(plugin.table[0]) == {"3": 3, "5": 2, "7": 1, "9": 2}
    assert plugin.total_count == 8
    assert second.metrics["outcome_exploration/table_answers"] == 4.0
    assert second.metrics["outcome_exploration/table_prompts"] == 1.0


def test_count_current_batch():
    result = run(["3", "3", "5", "7"], {**HIST_ONLY, "count_current_batch": True})
    r2 = 1 / math.sqrt(2)
    torch.testing.assert_close(bonus_of(result), torch.tensor([r2, r2, 1.0, 1.0]))
    plugin = OutcomeExploration(OutcomeExploration.Config(**HIST_ONLY, count_current_batch=True))
    plugin.load_state_dict({"table": [(0, [("3", 2)])]})
    result = run(["3", "3", "5", "7"], plugin=plugin)
    torch.testing.assert_close(bonus_of(result), torch.tensor([0.5, 0.5, 1.0, 1.0]))   # N = 2 + 2
    assert plugin.count(0, "3") == 4


# ------------------------------------------------------------------------- per-prompt separation
def test_prompts_never_mix():
    plugin = OutcomeExploration(OutcomeExploration.Config(**HIST_ONLY))
    # two groups (prompts 0 and 1) with the same answers
    result = run(["4", "4", "4", "4"], plugin=plugin, g=2)
    torch.testing.assert_close(bonus_of(result), torch.ones(4))
    assert dict(plugin.table[0]) == {"4": 2} and dict(plugin.table[1]) == {"4": 2}
    # prompt 7 has never been seen: its "4" is new although prompts 0 and 1 produced it
    result = run(["4", "4"], plugin=plugin, prompt_index=[7, 7])
    torch.testing.assert_close(bonus_of(result), torch.ones(2))
    result = run(["4", "4"], plugin=plugin, prompt_index=[0, 0])
    torch.testing.assert_close(bonus_of(result), torch.full((2,), 1 / math.sqrt(2)))
    assert {k: dict(v) for k, v in plugin.table.items()} == {1: {"4": 2}, 7: {"4": 2}, 0: {"4": 4}}


def test_batch_penalty_stays_inside_the_group():
    result = run(["3", "3", "3", "5"], BATCH_ONLY, g=2)        # groups ['3','3'] and ['3','5']
    torch.testing.assert_close(bonus_of(result), torch.tensor([-0.5, -0.5, 0.0, 0.0]))


def test_prompt_text_key_when_index_unknown():
    plugin = OutcomeExploration(OutcomeExploration.Config(**HIST_ONLY))
    prompts = ["what is 2+2?"] * 2 + ["what is 3+1?"] * 2
    run(["4", "4", "4", "4"], plugin=plugin, g=2, prompts=prompts, prompt_index=[-1] * 4)
    assert {k: dict(v) for k, v in plugin.table.items()} == {"what is 2+2?": {"4": 2}, "what is 3+1?": {"4": 2}}
    # the same text comes back (index still unknown): same entry
    result = run(["4", "5"], plugin=plugin, prompts=["what is 2+2?"] * 2, prompt_index=[-1, -1])
    torch.testing.assert_close(bonus_of(result), torch.tensor([1 / math.sqrt(2), 1.0]))
    # chat prompts are keyed by their JSON; a known index is keyed by the row, separate from texts
    chat = [[{"role": "user", "content": "what is 2+2?"}]] * 2
    run(["4", "4"], plugin=plugin, prompts=chat, prompt_index=[-1, -1])
    run(["4", "4"], plugin=plugin, prompts=["what is 2+2?"] * 2, prompt_index=[3, 3])
    assert len(plugin.table) == 4 and plugin.count(3, "4") == 2 and plugin.count("what is 2+2?", "4") == 3


# ------------------------------------------------------------------------- unparseable, NaN, empty
def test_unparseable_bucket():
    plugin = OutcomeExploration()
    completions = ["no answer", "", "none at all", "it is 4"]
    result = run(completions, plugin=plugin)
    # 3 unparseable share "∅": first sighting +1, and 2 others each -> -0.5
    torch.testing.assert_close(bonus_of(result), torch.tensor([0.5, 0.5, 0.5, 1.0]))
    assert dict(plugin.table[0]) == {UNPARSEABLE: 3, "4": 1}
    assert result.metrics["outcome_exploration/unparseable_fraction"] == 0.75
    result = run(completions, plugin=plugin)
    r3 = 1 / math.sqrt(3)
    torch.testing.assert_close(bonus_of(result), torch.tensor([r3 - 0.5] * 3 + [1.0]))


def test_unparseable_no_bonus():
    plugin = OutcomeExploration(OutcomeExploration.Config(unparseable="no_bonus"))
    result = run(["no answer", "", "nothing", "4"], plugin=plugin)
    torch.testing.assert_close(bonus_of(result), torch.tensor([0.0, 0.0, 0.0, 1.0]))
    assert dict(plugin.table[0]) == {"4": 1}
    assert result.metrics["outcome_exploration/new_answer_fraction"] == 1.0      # of the parsed ones


def test_nan_rewards_appended_column():
    # rows with every reward NaN get no bonus (stay 'no verdict'); a NaN in one column does not matter
    rewards = [[None, None], [1.0, None], [None, 0.0], [0.0, 1.0]]
    result = run(["3", "5", "7", "9"], rewards=rewards)
    assert torch.isnan(result.rewards[0]).all()  # the bonus column too: the row stays unscorable
    torch.testing.assert_close(bonus_of(result)[1:], torch.tensor([1.0, 1.0, 1.0]))
    assert torch.isfinite(result.advantages).all() and result.advantages[0] == 0 and not result.batch.scorable[0]
    assert result.plugin.count(0, "3") == 1          # still counted as a sighting


def test_add_to_column_keeps_nan_and_weights():
    rewards = [[1.0, 0.5], [None, 0.5], [0.0, 0.5], [0.0, 0.5]]
    result = run(["3", "3", "5", "7"], {"add_to": "acc", "weight": 0.5}, rewards=rewards,
                 reward_names=["acc", "fmt"])
    assert result.reward_names == ["acc", "fmt"]
    acc = result.rewards[:, 0]
    assert torch.isnan(acc[1])
    torch.testing.assert_close(acc[[0, 2, 3]], torch.tensor([1.0 + 0.5 * 0.75, 0.5, 0.5]))
    torch.testing.assert_close(result.rewards[:, 1], torch.full((4,), 0.5))


def test_appended_column_weight():
    result = run(["3", "5"], {"weight": 0.25, "column": "explore"})
    assert result.reward_names == ["reward_0", "explore"]
    assert result.batch.reward_weights.tolist() == [1.0, 0.25]


def test_single_completion_per_group_and_empty():
    result = run(["3", "3", ""], g=1)
    torch.testing.assert_close(bonus_of(result), torch.ones(3))            # no group mates: no penalty
    assert result.plugin.count(2, UNPARSEABLE) == 1


# ------------------------------------------------------------------------- variants
def test_historical_on_correct_only():
    rewards = [[1.0], [0.0], [None], [1.0]]
    cfg = {**HIST_ONLY, "historical_on": "correct", "correct_column": "acc"}
    result = run(["3", "4", "5", "6"], cfg, rewards=rewards, reward_names=["acc"])
    torch.testing.assert_close(bonus_of(result), torch.tensor([1.0, 0.0, float("nan"), 1.0]), equal_nan=True)
    assert result.plugin.total_count == 4                   # every answer is counted (row 2 has no verdict: NaN)
    assert result.plugin.required_rewards() == ["acc"]


def test_baselines():
    plugin = OutcomeExploration(OutcomeExploration.Config(**HIST_ONLY, baseline="constant", baseline_value=0.25))
    plugin.load_state_dict({"table": [(0, [("1", 1), ("2", 4), ("3", 100)])]})
    result = run(["1", "2", "3"], plugin=plugin)
    torch.testing.assert_close(bonus_of(result), torch.tensor([0.75, 0.25, -0.15]))
    plugin = OutcomeExploration(OutcomeExploration.Config(**HIST_ONLY, baseline="group_mean"))
    plugin.load_state_dict({"table": [(0, [("1", 1), ("2", 4), ("3", 100)])]})
    result = run(["1", "2", "3"], plugin=plugin)
    torch.testing.assert_close(bonus_of(result), torch.tensor([1.0, 0.5, 0.1]) - 1.6 / 3)
    # the group mean is taken over eligible (correct) completions only
    cfg = {**HIST_ONLY, "baseline": "group_mean", "historical_on": "correct", "correct_column": "acc"}
    plugin = OutcomeExploration(OutcomeExploration.Config(**cfg))
    plugin.load_state_dict({"table": [(0, [("1", 1), ("2", 4), ("3", 100)])]})
    result = run(["1", "2", "3"], plugin=plugin, rewards=[1.0, 1.0, 0.0], reward_names=["acc"])
    torch.testing.assert_close(bonus_of(result), torch.tensor([0.25, -0.25, 0.0]))


def test_math_verify_canonicalizer():
    completions = ["so \\boxed{\\frac{1}{2}}", "\\boxed{\\dfrac12}", "the answer is 2", "nothing here"]
    plugin = OutcomeExploration(OutcomeExploration.Config(canonicalizer="math_verify", **HIST_ONLY))
    run(completions, plugin=plugin)
    assert dict(plugin.table[0]) == {"1/2": 2, "2": 1, UNPARSEABLE: 1}
    # last_number reads "2", "12" and "2" here instead
    plugin = OutcomeExploration(OutcomeExploration.Config(**HIST_ONLY))
    run(completions, plugin=plugin)
    assert dict(plugin.table[0]) == {"2": 2, "12": 1, UNPARSEABLE: 1}


# ------------------------------------------------------------------------- canonical last number
@pytest.mark.parametrize("text, expected", [
    ("12 + 7 = 19.", "19"), ("it is 12.0", "12"), ("1,000 apples", "1000"), ("x = -0", "0"),
    ("100", "100"), ("2.50", "2.5"), ("5-3", "3"), ("so -4", "-4"), ("none", None), ("", None),
])
def test_canonical_last_number(text, expected):
    assert canonical_last_number(text) == expected


def test_tail_window_equals_full_last_number():
    rng = random.Random(0)
    alphabet = "0123456789,.--- ab\x00é"
    for trial in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        full = last_number(text)
        expected = None if full is None else ("0" if full == 0 else format(full.normalize(), "f"))
        for window in (1, 2, 3, 5, 17):
            assert canonical_last_number(text, window=window) == expected, (text, window)
    # the batch version: one scan over all tails (and the per-tail path when a text holds the separator)
    texts = ["".join(rng.choice(alphabet[:-2]) for _ in range(rng.randint(0, 80))) for _ in range(500)]
    expected = [canonical_last_number(t, window=1000) for t in texts]
    assert canonical_last_numbers(texts, window=7) == expected
    assert canonical_last_numbers(texts + ["a\x00 1"], window=7) == expected + ["1"]


# ------------------------------------------------------------------------- the table: bounds, state
def test_prompt_bound_evicts_least_recently_seen():
    plugin = OutcomeExploration(OutcomeExploration.Config(max_prompts=2, **HIST_ONLY))
    for p in (0, 1):
        run(["4"], plugin=plugin, prompt_index=[p])
    run(["4"], plugin=plugin, prompt_index=[0])     # 0 seen again: 1 is now the oldest
    run(["4"], plugin=plugin, prompt_index=[2])
    assert list(plugin.table) == [0, 2]
    assert plugin.count(0, "4") == 2
    result = run(["4"], plugin=plugin, prompt_index=[1])     # evicted: new again
    assert bonus_of(result).tolist() == [1.0]
    assert list(plugin.table) == [2, 1]
    assert result.metrics["outcome_exploration/table_prompts"] == 2.0


def test_answer_bound_evicts_least_recently_seen():
    plugin = OutcomeExploration(OutcomeExploration.Config(max_answers_per_prompt=2, **HIST_ONLY))
    run(["1", "2"], plugin=plugin)
    run(["1"], plugin=plugin, prompt_index=[0])     # "2" is now the oldest
    run(["3"], plugin=plugin, prompt_index=[0])
    assert dict(plugin.table[0]) == {"1": 2, "3": 1}
    result = run(["2", "1"], plugin=plugin)
    torch.testing.assert_close(bonus_of(result), torch.tensor([1.0, 1 / math.sqrt(2)]))
    # one round with more distinct answers than the bound keeps the most recent ones
    plugin = OutcomeExploration(OutcomeExploration.Config(max_answers_per_prompt=3))
    run([str(i) for i in range(8)], plugin=plugin)
    assert list(plugin.table[0]) == ["5", "6", "7"]
    assert max(len(a) for a in plugin.table.values()) <= 3


def test_state_round_trip_and_trim_on_load():
    plugin = OutcomeExploration()
    run(["1", "2", "2", "3"], plugin=plugin, g=2)
    state = plugin.state_dict()
    assert state["table"] == [[0, [["1", 1], ["2", 1]]], [1, [["2", 1], ["3", 1]]]]     # plain lists
    fresh = OutcomeExploration()
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    small = OutcomeExploration(OutcomeExploration.Config(max_prompts=1, max_answers_per_prompt=1))
    small.load_state_dict(state)
    assert small.state_dict()["table"] == [[1, [["3", 1]]]]
    # what a checkpoint holds: plain data, loaded as the host loads it (weights_only)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == state


# ------------------------------------------------------------------------- config and contract
def test_config_errors():
    with pytest.raises(ConfigError, match="correct_column"):
        plugin_set(OutcomeExploration, {"historical_on": "correct"})
    with pytest.raises(ConfigError, match="both off"):
        plugin_set(OutcomeExploration, {"historical": False, "batch": False})
    with pytest.raises(ConfigError, match="max_prompts"):
        plugin_set(OutcomeExploration, {"max_prompts": 0})
    with pytest.raises(ConfigError, match="bonus_scale"):
        plugin_set(OutcomeExploration, {"bonus_scale": 1.0})


def test_missing_reward_column_is_named():
    with pytest.raises(ConfigError, match=r"\(outcome_exploration\).*reward column 'accuracy'"):
        check_args(OutcomeExploration, {"add_to": "accuracy"}, reward_names=["format"])
    with pytest.raises(ConfigError, match="reward column 'acc'"):
        check_args(OutcomeExploration, {"historical_on": "correct", "correct_column": "acc"}, reward_names=["format"])
    check_args(OutcomeExploration, reward_names=["format"])                # appends: needs nothing
    with pytest.raises(PluginRuntimeError, match="no reward column 'accuracy'"):
        run(["3", "4"], {"add_to": "accuracy"})


def test_existing_column_name_is_refused():
    # before the model loads: a reward function already produces the column
    with pytest.raises(ConfigError) as error:
        check_args(OutcomeExploration, reward_names=["accuracy", "exploration_bonus"],
                   per_device_train_batch_size=8, num_generations=4)
    message = str(error.value)
    assert "(outcome_exploration)" in message and "column: the bonus column 'exploration_bonus'" in message
    assert "fix: set `column` to another name, or `add_to: exploration_bonus`" in message
    check_args(OutcomeExploration, {"column": "explore"}, reward_names=["exploration_bonus"])
    check_args(OutcomeExploration, {"add_to": "exploration_bonus"}, reward_names=["exploration_bonus"])
    # at run time too (an earlier shaper may have appended it)
    with pytest.raises(PluginRuntimeError, match="'exploration_bonus' already exists"):
        run(["3", "4"], rewards=[[1.0], [0.0]], reward_names=["exploration_bonus"])


def test_math_verify_must_be_installed(monkeypatch):
    check_args(OutcomeExploration, {"canonicalizer": "math_verify"})      # installed here
    monkeypatch.setitem(sys.modules, "math_verify", None)                  # as if it were not
    with pytest.raises(ConfigError) as error:
        check_args(OutcomeExploration, {"canonicalizer": "math_verify"}, per_device_train_batch_size=8,
                   num_generations=4)
    message = str(error.value)
    assert "(outcome_exploration)" in message and "canonicalizer: 'math_verify' needs the math_verify" in message
    assert "fix: `pip install math-verify`, or set `canonicalizer: last_number`" in message
    check_args(OutcomeExploration)                                          # last_number needs nothing


def test_contract():
    numeric = [lambda: make_batch([1, 0, 1, 0, None, 1, 0, 0], 4, completions=["3", "3", "", "x 5", "5", "5", "1", "2"],
                                  reward_names=["accuracy"])]
    check_plugin(OutcomeExploration)
    check_plugin(OutcomeExploration, batches=edge_case_batches() + numeric)
    check_plugin(OutcomeExploration, {"historical_on": "correct", "correct_column": "accuracy",
                                      "baseline": "group_mean", "unparseable": "no_bonus"},
                 batches=edge_case_batches() + numeric)
    check_plugin(OutcomeExploration, {"add_to": "accuracy", "count_current_batch": True},
                 batches=edge_case_batches() + numeric)


# ------------------------------------------------------------------------- real runs: checkpoint and resume
class Snapshot:
    """Records the outcome_exploration table when training begins (after a resume has loaded state)."""

    tables: ClassVar[list] = []

    @hookimpl
    def on_train_begin(self, trainer):
        plugin = next(p.instance for p in trainer.credit_plugins.plugins if p.name == "outcome_exploration")
        Snapshot.tables.append((trainer.state.global_step, plugin.state_dict()))


PLUGINS = [{"name": "outcome_exploration"}, Snapshot]


def table_total(state):
    return sum(count for _, answers in state["table"] for _, count in answers)


def test_counts_survive_checkpoint_and_resume(tmp_path):
    Snapshot.tables = []
    trainer = train_tiny(PLUGINS, output_dir=tmp_path, save_strategy="steps", save_steps=2)
    assert trainer.state.global_step == 2
    logs = [e for e in trainer.state.log_history if "trl_credit/outcome_exploration/bonus" in e]
    assert len(logs) == 2
    assert all(math.isfinite(e["loss"]) for e in logs)
    assert logs[-1]["trl_credit/outcome_exploration/table_prompts"] >= 2     # 2 prompts per step
    assert logs[0]["trl_credit/outcome_exploration/new_answer_fraction"] == 1.0  # empty table at step 1
    assert Snapshot.tables == [(0, {"version": 1, "table": []})]

    checkpoint = tmp_path / "checkpoint-2"
    saved = torch.load(checkpoint / STATE_FILE, weights_only=True)["plugins"]["outcome_exploration"]
    live = trainer.credit_plugins.plugins[0].instance
    assert saved == live.state_dict()
    assert table_total(saved) == 16                        # 2 steps x 2 prompts x 4 completions
    assert all(isinstance(key, int) and 0 <= key < 32 for key, _ in saved["table"])   # dataset rows

    Snapshot.tables = []
    resumed = train_tiny(PLUGINS, output_dir=tmp_path / "resumed", train=False, max_steps=4)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 4
    # the table was loaded before training went on: at train begin it equals the saved one
    assert Snapshot.tables == [(2, saved)]
    after = resumed.credit_plugins.plugins[0].instance
    assert after.total_count == table_total(saved) + 16    # + steps 3 and 4
    for key, answers in saved["table"]:
        for answer, count in answers:
            assert after.count(key, answer) >= count
