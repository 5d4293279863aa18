"""Hook families through the testing kit: order, combination, shapes, and loud failures."""

from __future__ import annotations

import math

import pytest
import torch

import plugins_for_tests as fx
from trl_credit.batch import PromptStats
from trl_credit.builtin import grpo_advantages
from trl_credit.config import build_plugins
from trl_credit.pipeline import Pipeline, PluginRuntimeError
from trl_credit.testing import check_plugin, make_batch, plugin_set, run_curriculum, run_plugin


def test_default_estimator_is_grpo_with_trl_eps():
    result = run_plugin(fx.Passthrough, make_batch([1, 0, 0, 0], num_generations=4))
    torch.testing.assert_close(result.advantages, torch.tensor([1.49970, -0.49990, -0.49990, -0.49990]),
                               atol=1e-5, rtol=0)


def test_gdpo_vector_from_methods_md_through_normalize_then_sum():
    batch = make_batch([[1, 1], [1, 0], [0, 1], [0, 0], [1, 1], [1, 1], [1, 1], [1, 0]], num_generations=4,
                       multi_objective_aggregation="normalize_then_sum")
    result = run_plugin(fx.Passthrough, batch)
    expected = torch.tensor([1.527404, 0, 0, -1.527404, 0.440912, 0.440912, 0.440912, -1.322735])
    torch.testing.assert_close(result.advantages, expected, atol=1e-5, rtol=0)


def test_shaper_adds_a_named_column_with_weight_one():
    result = run_plugin(fx.AddBonus, make_batch([1, 0, 1, 0], num_generations=2, reward_names=["acc"]),
                        {"bonus": 0.25, "column": "len"})
    assert result.reward_names == ["acc", "len"]
    torch.testing.assert_close(result.batch.reward_weights, torch.tensor([1.0, 1.0]))
    assert torch.equal(result.rewards[:, 1], torch.full((4,), 0.25))


def test_shapers_chain_in_config_order():
    plugins = build_plugins([{"name": fx.AddBonus, "bonus": 1.0, "column": "x"},
                             {"name": fx.AddBonus, "bonus": 2.0, "column": "x"}])
    batch = make_batch([0, 1], num_generations=2)
    Pipeline(plugins).shape_rewards(batch)
    assert batch.reward_names == ["reward_0", "x"] and torch.equal(batch.rewards[:, 1], torch.tensor([2.0, 2.0]))


def test_group_and_completion_masks_are_and_combined():
    plugins = build_plugins([fx.DropFirstGroup, fx.DropConstant])
    batch = make_batch([1, 0, 1, 1, 0, 1], num_generations=2)
    keep = Pipeline(plugins).filter_rollouts(batch)
    assert keep.tolist() == [False, False, False, False, True, True]
    assert batch.metrics["drop_first_group/kept_fraction"] == [pytest.approx(2 / 3)]


def test_estimator_sees_only_kept_groups_and_dropped_rows_get_zero():
    batch = make_batch([1, 0, 5, 5, 0, 1], num_generations=2, scale_rewards="batch")
    result = run_plugin(fx.DropConstant, batch)
    kept_only = grpo_advantages(torch.tensor([[1.0], [0.0], [0.0], [1.0]]), torch.ones(1), 2, "batch",
                                "sum_then_normalize")
    torch.testing.assert_close(result.advantages[[0, 1, 4, 5]], kept_only)
    assert result.advantages[2:4].tolist() == [0.0, 0.0]


def test_transform_may_return_token_level_advantages():
    batch = make_batch([1, 0], num_generations=2, lengths=[3, 1])
    result = run_plugin(fx.TokenCredit, batch)
    a = 0.70703  # (1 - 0.5) / (std 0.7071 + 1e-4)
    torch.testing.assert_close(result.advantages, torch.tensor([[a, 2 * a, 3 * a], [-a, 0, 0]]), atol=1e-4, rtol=0)


def test_plugin_estimator_replaces_the_default():
    assert run_plugin(fx.ConstantEstimator, make_batch([1, 0], num_generations=2)).advantages.tolist() == [1, 1]


@pytest.mark.parametrize("plugin, hook, what", [
    (fx.Broken, "compute_advantages", "advantages of shape (5,), expected (4,) or (4, 4)"),
    (fx.Raises, "shape_rewards", "ZeroDivisionError: boom"),
    (fx.MakesNaN, "transform_advantages", "NaN/inf"),
])
def test_runtime_failures_name_plugin_hook_and_step(plugin, hook, what):
    with pytest.raises(PluginRuntimeError) as info:
        run_plugin(plugin, make_batch([1, 0, 1, 0], num_generations=2, step=7))
    assert f"in {hook} at step 7" in str(info.value) or f"from {hook} at step 7" in str(info.value)
    assert what in str(info.value)


def test_shaper_may_not_introduce_nan():
    class Bad:
        """NaN shaper."""

        from trl_credit import hookimpl

        @hookimpl
        def shape_rewards(self, batch):
            return batch.rewards * math.nan

    with pytest.raises(PluginRuntimeError, match="NaN/inf rewards"):
        run_plugin(Bad, make_batch([1, 0], num_generations=2))


def test_a_new_column_may_stay_nan_on_unscored_rows_only():
    class Bonus:
        """Appends a bonus column: NaN on the rows given."""

        from trl_credit import hookimpl

        def __init__(self, nan_rows):
            self.nan_rows = nan_rows

        @hookimpl
        def shape_rewards(self, batch):
            bonus = torch.ones(batch.num_completions)
            bonus[self.nan_rows] = math.nan
            return {"bonus": bonus}

    # row 1 is unscored (its reward None): NaN there keeps it unscored, and GRPO gives it 0
    result = run_plugin(Bonus([1]), make_batch([1, None, 0, 1], num_generations=4))
    assert not result.batch.scorable[1] and result.advantages[1] == 0 and result.batch.scorable[[0, 2, 3]].all()
    with pytest.raises(PluginRuntimeError, match="NaN/inf rewards"):  # row 0 was scored: NaN there is refused
        run_plugin(Bonus([0, 1]), make_batch([1, None, 0, 1], num_generations=4))


def test_nan_rewards_are_kept_and_get_zero_advantage():
    result = run_plugin(fx.Passthrough, make_batch([1, None, 0, 1], num_generations=4))
    assert math.isnan(result.rewards[1, 0]) and result.advantages[1] == 0
    assert result.batch.scorable.tolist() == [True, False, True, True]
    torch.testing.assert_close(result.advantages[[0, 2, 3]], torch.tensor([0.57729, -1.15458, 0.57729]),
                               atol=1e-4, rtol=0)


def test_curriculum_weights_are_multiplied_and_normalised():
    stats = PromptStats.empty(10)
    weights = run_curriculum(fx.PreferLowIndex, stats)
    assert weights.tolist() == [0.125] * 8 + [0.0, 0.0]
    assert Pipeline(plugin_set(fx.Passthrough)).prompt_weights(stats, 0) is None


def test_prompt_stats_track_pass_rates_and_ignore_nan():
    stats = PromptStats.empty(3)
    stats.update(torch.tensor([0, 0, 1, 1, -1]), torch.tensor([1.0, 0.0, math.nan, 0.2, 1.0]), step=4)
    assert stats.seen.tolist() == [2, 1, 0]
    assert stats.pass_rate()[0] == 0.5 and stats.pass_rate()[1] == 0.0 and math.isnan(stats.pass_rate()[2])
    assert stats.last_step.tolist() == [4, 4, -1]


def test_prompt_stats_latest_counts_keep_only_the_step_a_prompt_was_last_scored_in():
    stats = PromptStats.empty(3)
    stats.update(torch.tensor([0, 0, 1, 1]), torch.tensor([1.0, 0.0, 0.0, 0.0]), step=1)
    stats.update(torch.tensor([0, 0]), torch.tensor([1.0, 1.0]), step=2)           # prompt 0 learned
    stats.update(torch.tensor([0, 2]), torch.tensor([1.0, 0.0]), step=2)           # a refill round of step 2
    assert stats.seen.tolist() == [5, 2, 1] and stats.passed.tolist() == [4, 0, 0]
    assert stats.latest_seen.tolist() == [3, 2, 1] and stats.latest_passed.tolist() == [3, 0, 0]
    assert [t.tolist() for t in stats.counts()] == [[5, 2, 1], [4, 0, 0]]
    assert [t.tolist() for t in stats.counts(latest=True)] == [[3, 2, 1], [3, 0, 0]]
    assert stats.pass_rate(latest=True)[0] == 1.0 and stats.pass_rate()[0] == 0.8
    torch.testing.assert_close(stats.posterior_mean(latest=True), torch.tensor([0.8, 0.25, 1 / 3], dtype=torch.float64))
    restored = PromptStats.empty(3)
    restored.load_state_dict(stats.state_dict())
    assert restored.latest_seen.tolist() == [3, 2, 1] and restored.latest_passed.tolist() == [3, 0, 0]
    old = {k: v for k, v in stats.state_dict().items() if not k.startswith("latest_")}  # a 0.2.2 checkpoint
    restored.load_state_dict(old)
    assert restored.latest_seen.tolist() == [5, 2, 1] and restored.latest_passed.tolist() == [4, 0, 0]


def test_select_keeps_scores_aligned():
    logps = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    batch = make_batch([1, 0, 1, 1], num_generations=2, logps=logps, lengths=[3, 3, 3, 3])
    view = batch.select(torch.tensor([2, 3]))
    assert torch.equal(view.policy_logps(), logps[2:])
    assert torch.equal(view.select(torch.tensor([1])).policy_logps(), logps[3:])


def test_missing_scores_in_tests_say_what_to_pass():
    with pytest.raises(RuntimeError, match="pass `entropies=`"):
        make_batch([1, 0], num_generations=2).policy_entropies()


def test_check_plugin_accepts_the_fixtures_and_rejects_a_bad_config():
    check_plugin(fx.DropConstant)
    check_plugin(fx.TokenCredit)

    class NoDescriptions(fx.AddBonus):
        """No descriptions."""

        from pydantic import BaseModel, ConfigDict

        class Config(BaseModel):
            model_config = {"extra": "forbid"}
            bonus: float = 0.5

    with pytest.raises(AssertionError, match="no description"):
        check_plugin(NoDescriptions)
    with pytest.raises(AssertionError, match="NaN/inf value"):
        check_plugin(fx.MakesNaN)


def test_completion_level_drops_keep_whole_groups_for_the_estimator():
    class DropFirstOfEachGroup:
        """Drops completion 0 of every group."""

        from trl_credit import hookimpl

        @hookimpl
        def filter_rollouts(self, batch):
            return torch.arange(batch.num_completions) % batch.num_generations != 0

    batch = make_batch([1, 0, 0, 0, 1, 1, 0, 1], num_generations=4)
    result = run_plugin(DropFirstOfEachGroup, batch)
    full = grpo_advantages(batch.rewards, torch.ones(1), 4, "group", "sum_then_normalize")
    expected = full.clone()
    expected[[0, 4]] = 0.0
    torch.testing.assert_close(result.advantages, expected)


def test_views_copy_token_tensors_only_when_read():
    import copy

    batch = make_batch([1, 0, 1, 1], num_generations=2, lengths=[3, 1, 2, 3])
    view = batch.select(torch.tensor([2, 3]))
    assert "completion_ids" not in view.__dict__ and view.width == 3
    assert torch.equal(view.completion_mask, batch.completion_mask[2:])
    assert torch.equal(view.select(torch.tensor([1])).completion_ids, batch.completion_ids[3:])
    assert torch.equal(copy.deepcopy(view).completion_lengths, torch.tensor([2, 3]))


def test_difficulty_reward_passes_the_stated_fraction_of_every_group():
    from trl_credit.testing import difficulty_reward

    log = []
    reward = difficulty_reward({1: 0.75, 2: 0.5, 3: 0.0}, 4, log)
    out = reward(["x"] * 12, difficulty=[1] * 4 + [2] * 4 + [3] * 4, trl_credit_prompt_index=[5] * 4 + [9] * 4 + [2] * 4)
    assert out == [1, 1, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0]
    assert log == [[5, 9, 2]] and reward.__name__ == "difficulty_reward"


@pytest.mark.parametrize("field, edit", [
    ("completion_mask", lambda b: b.completion_mask.zero_()),
    ("rewards", lambda b: b.rewards.mul_(2)),
    ("completion_ids", lambda b: b.completion_ids.fill_(0)),
    ("kept", lambda b: b.kept.fill_(False)),
])
def test_a_hook_that_edits_the_batch_in_place_is_stopped(field, edit):
    """Today's worst silent fault: `batch.completion_mask.zero_()` in a shaper trained nothing and exited 0."""
    from trl_credit import Plugin, PluginRuntimeError, hookimpl
    from trl_credit.testing import make_batch, run_plugin

    class Vandal(Plugin):
        """Edits the batch in place."""

        @hookimpl
        def shape_rewards(self, batch):
            edit(batch)

    with pytest.raises(PluginRuntimeError, match=rf"plugin 'vandal' modified batch.{field} in place in shape_rewards "
                                                 r"at step 0: the batch is read-only"):
        run_plugin(Vandal, make_batch([1, 0, 1, 0], 2))


def test_cached_scores_are_read_only_and_a_copy_is_fine():
    from trl_credit import Plugin, PluginRuntimeError, hookimpl
    from trl_credit.testing import make_batch, run_plugin

    class EditsScores(Plugin):
        """Writes into the shared log-prob cache."""

        @hookimpl
        def transform_advantages(self, batch, advantages):
            batch.policy_logps()  # cached now: the next plugin call would see the edit
            return None

        @hookimpl
        def on_batch_end(self, batch, advantages):
            batch.policy_logps().add_(1.0)

    with pytest.raises(PluginRuntimeError, match="modified the cached policy_logps scores in place in on_batch_end"):
        run_plugin(EditsScores, make_batch([1, 0], 2, lengths=[2, 2], logps=-torch.ones(2, 2)))

    class Copies(Plugin):
        """Edits its own copy."""

        @hookimpl
        def shape_rewards(self, batch):
            mask = batch.completion_mask.clone()
            mask.zero_()
            return batch.rewards * 2

    result = run_plugin(Copies, make_batch([1, 0], 2))
    assert result.rewards.flatten().tolist() == [2.0, 0.0]


def test_tensor_version_counter_exists():
    """The read-only check relies on torch's in-place version counter (a private name: pinned here)."""
    x = torch.zeros(2)
    v = x._version
    x.add_(1)
    assert x._version == v + 1


def test_a_plugin_that_exits_or_returns_a_non_number_beta_is_named():
    from trl_credit import Plugin, PluginRuntimeError, hookimpl
    from trl_credit.testing import make_batch, run_plugin

    class Exits(Plugin):
        """Calls sys.exit in a hook."""

        @hookimpl
        def shape_rewards(self, batch):
            raise SystemExit(0)

    with pytest.raises(PluginRuntimeError, match=r"plugin 'exits' raised in shape_rewards at step 0: SystemExit"):
        run_plugin(Exits, make_batch([1, 0], 2))

    class WordBeta(Plugin):
        """Returns a string as beta."""

        @hookimpl
        def kl_coefficient(self, batch):
            return "high"

    with pytest.raises(PluginRuntimeError, match=r"plugin 'word_beta' returned a str \(expected a number or None\) "
                                                 r"from kl_coefficient at step 4"):
        run_plugin(WordBeta, make_batch([1, 0], 2, step=4))
