"""PRIME accuracy-band filter: the methods.md vector, bounds, thresholds, NaN, the contract and a real run."""

from __future__ import annotations

import math

import pytest
import torch
from trl_credit_accuracy_band import AccuracyBand, group_accuracy

from trl_credit import ConfigError, PluginRuntimeError, Refill
from trl_credit.testing import check_args, check_plugin, make_batch, plugin_set, run_plugin, train_tiny

NAN = None  # make_batch turns None into NaN


def groups(*rows):
    return [r for row in rows for r in row]


def kept_groups(result, g):
    return result.keep.reshape(-1, g)[:, 0].tolist()


# ------------------------------------------------------------------------- the rule
def test_methods_vector():
    # n = 4, band [0.2, 0.8]: accuracies {0, 0.25, 0.5, 0.75, 1} -> keep {0.25, 0.5, 0.75}
    rewards = groups([0, 0, 0, 0], [1, 0, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1], [1, 1, 1, 1])
    result = run_plugin(AccuracyBand, make_batch(rewards, num_generations=4))
    assert kept_groups(result, 4) == [False, True, True, True, False]
    m = result.metrics
    assert m["accuracy_band/kept_fraction"] == pytest.approx(0.6)      # logged by the host
    assert m["accuracy_band/too_hard"] == pytest.approx(0.2)
    assert m["accuracy_band/too_easy"] == pytest.approx(0.2)
    assert m["accuracy_band/no_reward_groups"] == 0.0
    # the kept groups get TRL's group advantages, the dropped ones 0
    a = result.advantages.reshape(5, 4)
    assert torch.equal(a[[0, 4]], torch.zeros(2, 4))
    r = torch.tensor([1.0, 0, 0, 0], dtype=torch.float64)
    expected = ((r - r.mean()) / (r.std() + 1e-4)).float()            # 1.5 / (0.5 + 1e-4), -0.5 / ...
    torch.testing.assert_close(a[1], expected)
    torch.testing.assert_close(a[1, 0], torch.tensor(1.49970006), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("low, high, keep", [
    (0.25, 0.75, [False, True, True, True, False]),     # bounds inclusive
    (0.3, 0.7, [False, False, True, False, False]),
    (0.0, 1.0, [True] * 5),
    (0.5, 0.5, [False, False, True, False, False]),
    (0.8, 1.0, [False, False, False, False, True]),
])
def test_band_bounds(low, high, keep):
    rewards = groups([0, 0, 0, 0], [1, 0, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1], [1, 1, 1, 1])
    result = run_plugin(AccuracyBand, make_batch(rewards, num_generations=4), {"low": low, "high": high})
    assert kept_groups(result, 4) == keep


@pytest.mark.parametrize("threshold, accuracy, kept", [(0.5, 0.5, True), (0.65, 0.25, True), (0.8, 0.0, False),
                                                       (0.1, 1.0, False), (0.4, 0.75, True)])
def test_threshold_for_non_binary_rewards(threshold, accuracy, kept):
    rewards = [0.4, 0.6, 0.7, 0.2]
    batch = make_batch(rewards, num_generations=4)
    assert group_accuracy(batch.grouped(batch.rewards[:, 0]), threshold).tolist() == [accuracy]
    result = run_plugin(AccuracyBand, make_batch(rewards, num_generations=4), {"threshold": threshold})
    assert kept_groups(result, 4) == [kept]


def test_nan_rewards_left_out_by_default():
    rewards = groups([1, NAN, 0, NAN],      # finite {1, 0}: accuracy 0.5, kept
                     [NAN] * 4,             # no reward: no accuracy, dropped
                     [1, NAN, 1, 1],        # finite all pass: 1.0, dropped
                     [1, 1, NAN, NAN])      # 1.0, dropped
    result = run_plugin(AccuracyBand, make_batch(rewards, num_generations=4))
    assert kept_groups(result, 4) == [True, False, False, False]
    m = result.metrics
    assert m["accuracy_band/no_reward_groups"] == 0.25
    assert m["accuracy_band/too_easy"] == 0.5
    assert m["accuracy_band/too_hard"] == 0.0
    a = 0.5 / (math.sqrt(0.5) + 1e-4)                                   # TRL's nan-aware group advantage
    torch.testing.assert_close(result.advantages[:4], torch.tensor([a, 0, -a, 0]))


def test_nan_counts_as_fail():
    rewards = groups([1, NAN, 0, NAN], [NAN] * 4, [1, NAN, 1, 1], [1, 1, NAN, NAN])
    result = run_plugin(AccuracyBand, make_batch(rewards, num_generations=4), {"nan_counts_as_fail": True})
    # accuracies 0.25, 0, 0.75, 0.5
    assert kept_groups(result, 4) == [True, False, True, True]
    assert result.metrics["accuracy_band/too_hard"] == 0.25
    assert result.metrics["accuracy_band/no_reward_groups"] == 0.0


def test_group_accuracy_helper():
    x = torch.tensor([[1.0, math.nan, 0.0, 0.7], [math.nan] * 4, [0.2, 0.49, 0.5, 0.51]])
    out = group_accuracy(x, 0.5)
    torch.testing.assert_close(out[[0, 2]], torch.tensor([2 / 3, 0.5]))
    assert math.isnan(out[1])
    assert group_accuracy(x, 0.5, nan_counts_as_fail=True).tolist() == [0.5, 0.0, 0.5]


def test_single_completion_per_group_drops_all():
    # G = 1: accuracy is 0 or 1, never inside [0.2, 0.8]; every advantage is 0
    result = run_plugin(AccuracyBand, make_batch([1, 0, 1, 0.5], num_generations=1))
    assert result.keep.tolist() == [False] * 4
    assert torch.equal(result.advantages, torch.zeros(4))
    assert result.metrics["accuracy_band/too_easy"] == 0.75          # 1, 1 and 0.5 >= 0.5 pass
    assert result.metrics["accuracy_band/too_hard"] == 0.25


def test_empty_completions_do_not_matter():
    result = run_plugin(AccuracyBand, make_batch([1, 0, 0, 0, 1, 1], num_generations=2, lengths=[0, 3, 0, 0, 2, 5]))
    assert kept_groups(result, 2) == [True, False, False]


# ------------------------------------------------------------------------- which reward
def two_column_batch(weights=(1.0, 1.0)):
    accuracy = [1, 0, 0, 0,  1, 1, 1, 1]
    fmt = [0, 1, 1, 1,  0, 0, 0, 0]
    return make_batch([[a, f] for a, f in zip(accuracy, fmt)], num_generations=4,
                      reward_names=["accuracy", "format"], reward_weights=weights)


def test_metric_column_selection():
    total = run_plugin(AccuracyBand, two_column_batch())                    # totals [1,1,1,1], [1,1,1,1]
    assert kept_groups(total, 4) == [False, False]
    acc = run_plugin(AccuracyBand, two_column_batch(), {"metric": "accuracy"})
    assert kept_groups(acc, 4) == [True, False]                            # 0.25 and 1.0
    fmt = run_plugin(AccuracyBand, two_column_batch(), {"metric": "format"})
    assert kept_groups(fmt, 4) == [True, False]                            # 0.75 and 0.0
    weighted = run_plugin(AccuracyBand, two_column_batch(weights=(1.0, 0.0)))  # the total is weighted
    assert kept_groups(weighted, 4) == [True, False]


def test_unknown_metric_column_is_a_config_error():
    assert AccuracyBand(AccuracyBand.Config(metric="acc")).required_rewards() == ["acc"]
    with pytest.raises(ConfigError, match=r"\(accuracy_band\).*reward column 'acc'.*\['accuracy', 'format'\]"):
        check_args(AccuracyBand, {"metric": "acc"}, reward_names=["accuracy", "format"],
                   per_device_train_batch_size=8, num_generations=4)
    check_args(AccuracyBand, {}, reward_names=["accuracy"], per_device_train_batch_size=8, num_generations=4)
    with pytest.raises(PluginRuntimeError, match="no reward column 'acc'"):
        run_plugin(AccuracyBand, two_column_batch(), {"metric": "acc"})


@pytest.mark.parametrize("options, key", [({"low": -0.1}, "low"), ({"high": 1.5}, "high"),
                                          ({"low": 0.9, "high": 0.1}, "low"),
                                          ({"max_refill_rounds": -1}, "max_refill_rounds"),
                                          ({"max_refill_tokens": -5}, "max_refill_tokens"),
                                          ({"accuracy_lower_bound": 0.2}, "accuracy_lower_bound")])
def test_bad_options(options, key):
    with pytest.raises(ConfigError, match=key):
        plugin_set(AccuracyBand, options)


def refill_seen_by_the_host(options):
    """The `Refill` the host reads for this configuration (`RunInfo.plugins`, as `trl-credit validate`)."""
    run = check_args(AccuracyBand, options, per_device_train_batch_size=8, num_generations=4)
    return run.plugins[0].refill


def test_refill_config_reaches_the_host():
    assert refill_seen_by_the_host({}) == Refill(max_rounds=3, max_tokens=None)
    assert refill_seen_by_the_host({"max_refill_rounds": 5}) == Refill(max_rounds=5, max_tokens=None)
    assert refill_seen_by_the_host({"max_refill_tokens": 512}) == Refill(max_rounds=3, max_tokens=512)
    assert refill_seen_by_the_host({"refill": False}) is None
    assert refill_seen_by_the_host({"refill": False, "max_refill_tokens": 512}) is None
    assert AccuracyBand(AccuracyBand.Config(max_refill_rounds=1, max_refill_tokens=0)).refill() == Refill(1, 0)


def test_contract():
    check_plugin(AccuracyBand)
    check_plugin(AccuracyBand, {"low": 0.0, "high": 0.5, "threshold": 0.3, "nan_counts_as_fail": True})
    check_plugin("accuracy_band", {"metric": "accuracy"})             # the installed entry point


# ------------------------------------------------------------------------- a real run
def band_reward():
    """Deterministic reward, whatever the model writes: each call (one generation round of 2 groups
    of 4) gives group 0 one pass in four on even calls (accuracy 0.25: in band) and none on odd
    calls (0: too hard), and group 1 always four passes (1.0: too easy)."""
    calls = [0]

    def band(completions, **kwargs):
        calls[0] += 1
        first = 1.0 if calls[0] % 2 == 0 else 0.0
        return [(first if i % 4 == 0 else 0.0) if i % 8 < 4 else 1.0 for i in range(len(completions))]

    return band, calls


def test_training_with_refill(tmp_path):
    reward, calls = band_reward()
    trainer = train_tiny([{"name": "accuracy_band", "max_refill_rounds": 2}], output_dir=tmp_path,
                         reward_funcs=[reward], max_completion_length=4)
    assert trainer.state.global_step == 2
    logs = [e for e in trainer.state.log_history if "trl_credit/generation_rounds" in e]
    assert len(logs) == 2
    first, second = logs
    # step 1, calls 1-3: (too hard, too easy), (in band, too easy), (too hard, too easy): quota 2 not met
    # step 2, calls 4-6: (in band, too easy), (too hard, too easy), (in band, too easy): quota met
    for entry, kept_groups_found in ((first, 1), (second, 2)):
        # without a token budget step 1 runs every allowed round: 1 + max_refill_rounds
        assert entry["trl_credit/generation_rounds"] == 3.0
        assert "trl_credit/refill_budget_hit" not in entry
        assert entry["trl_credit/accuracy_band/kept_fraction"] == pytest.approx(kept_groups_found / 6)
        assert entry["trl_credit/accuracy_band/too_easy"] == 0.5
        assert entry["trl_credit/accuracy_band/too_hard"] == pytest.approx((3 - kept_groups_found) / 6)
        assert entry["trl_credit/kept_fraction"] == kept_groups_found / 2   # step 1: one masked filler group
        assert entry["trl_credit/skipped_update"] == 0.0
    assert calls[0] == 6


def test_refill_token_budget_stops_refill(tmp_path):
    calls = [0]

    def too_hard(completions, **kwargs):      # accuracy 0 in every group: refill always wanted
        calls[0] += 1
        return [0.0] * len(completions)

    # budget 1 token: refill round 1 generates >= 8 tokens (each completion: its EOS at least), so no round 2
    trainer = train_tiny([{"name": "accuracy_band", "max_refill_rounds": 3, "max_refill_tokens": 1}],
                         output_dir=tmp_path, reward_funcs=[too_hard], max_completion_length=4)
    assert trainer.state.global_step == 2
    logs = [e for e in trainer.state.log_history if "trl_credit/generation_rounds" in e]
    assert len(logs) == 2
    for entry in logs:
        assert entry["trl_credit/generation_rounds"] == 2.0
        assert entry["trl_credit/refill_budget_hit"] == 1.0
        assert entry["trl_credit/extra_tokens"] >= 8
        assert entry["trl_credit/accuracy_band/too_hard"] == 1.0
        assert entry["trl_credit/skipped_update"] == 1.0
    assert calls[0] == 4
