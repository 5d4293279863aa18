"""DAPO dynamic sampling: hand-computed masks, edge cases, the host contract and a short real run."""

from __future__ import annotations

import math

import pytest
import torch

from trl_credit_dynamic_sampling import DynamicSampling, group_range

from trl_credit import ConfigError, PluginRuntimeError, Refill
from trl_credit.testing import check_args, check_plugin, make_batch, plugin_set, run_plugin, train_tiny

NAN = None  # make_batch turns None into NaN


def group_adv(rewards):
    """TRL's group advantage (r - mean) / (unbiased std + 1e-4), written out for one group."""
    r = torch.tensor(rewards, dtype=torch.float64)
    return ((r - r.mean()) / (r.std() + 1e-4)).float()


# ------------------------------------------------------------------------- the rule
def test_mixed_and_constant_groups():
    rewards = [1, 0, 1, 0,  1, 1, 1, 1,  0, 0, 0, 0,  0.5, 0.5, 1, 0.5]
    result = run_plugin(DynamicSampling, make_batch(rewards, num_generations=4))
    assert result.keep.tolist() == [True] * 4 + [False] * 8 + [True] * 4
    # kept groups: GRPO advantages computed on the kept groups only; dropped rows get 0
    expected = torch.cat([group_adv([1, 0, 1, 0]), torch.zeros(8), group_adv([0.5, 0.5, 1, 0.5])])
    torch.testing.assert_close(result.advantages, expected, rtol=1e-5, atol=1e-6)
    # hand values: +-0.5 / (sqrt(1/3) + 1e-4) and (-0.125, 0.375) / (0.25 + 1e-4)
    torch.testing.assert_close(result.advantages[[0, 1, 12, 14]],
                               torch.tensor([0.86588, -0.86588, -0.49980, 1.49940]), rtol=1e-4, atol=1e-5)
    m = result.metrics
    assert m["dynamic_sampling/kept_fraction"] == 0.5             # logged by the host
    assert m["dynamic_sampling/constant_groups"] == 0.5
    assert m["dynamic_sampling/constant_high"] == 0.25            # all 1
    assert m["dynamic_sampling/constant_low"] == 0.25             # all 0
    assert m["dynamic_sampling/no_reward_groups"] == 0.0


def test_all_groups_constant_drops_everything():
    result = run_plugin(DynamicSampling, make_batch([1, 1, 1, 0, 0, 0, 0.3, 0.3, 0.3], num_generations=3))
    assert not result.keep.any()
    assert torch.equal(result.advantages, torch.zeros(9))
    assert result.metrics["dynamic_sampling/constant_groups"] == 1.0
    assert result.metrics["dynamic_sampling/constant_high"] == pytest.approx(2 / 3)   # 1 and 0.3 are > 0
    assert result.metrics["dynamic_sampling/constant_low"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("tolerance, keep", [(0.0, [True, True]), (0.05, [False, True]),
                                             (0.2, [False, False]), (0.25, [False, False])])
def test_tolerance(tolerance, keep):
    # ranges: 0.02 and 0.2; a range <= tolerance counts as constant
    rewards = [0.5, 0.52, 0.5, 0.51,  0.0, 0.2, 0.1, 0.0]
    result = run_plugin(DynamicSampling, make_batch(rewards, num_generations=4), {"tolerance": tolerance})
    assert result.keep.reshape(2, 4)[:, 0].tolist() == keep


def test_nan_rewards_are_ignored():
    rewards = [1, NAN, 0, NAN,          # finite {1, 0}: kept
               NAN, NAN, NAN, NAN,      # no reward at all: dropped
               1, NAN, 1, 1,            # finite rewards constant: dropped
               NAN, 0, NAN, NAN]        # one finite reward: constant, dropped
    result = run_plugin(DynamicSampling, make_batch(rewards, num_generations=4))
    assert result.keep.reshape(4, 4)[:, 0].tolist() == [True, False, False, False]
    a = 0.5 / (math.sqrt(0.5) + 1e-4)   # nan-aware: mean 0.5, unbiased std over the two finite values
    torch.testing.assert_close(result.advantages, torch.tensor([a, 0, -a, 0] + [0.0] * 12))
    m = result.metrics
    assert m["dynamic_sampling/constant_groups"] == 0.75
    assert m["dynamic_sampling/no_reward_groups"] == 0.25
    assert m["dynamic_sampling/constant_high"] == 0.25
    assert m["dynamic_sampling/constant_low"] == 0.25


def test_group_range_helper():
    x = torch.tensor([[1.0, math.nan, 3.0], [math.nan] * 3, [2.0, 2.0, 2.0]])
    assert group_range(x).tolist() == [2.0, -math.inf, 0.0]


def test_single_completion_per_group_drops_all():
    result = run_plugin(DynamicSampling, make_batch([1, 0, 1, 0.5], num_generations=1))
    assert result.keep.tolist() == [False] * 4
    assert torch.equal(result.advantages, torch.zeros(4))           # host: all-zero advantages
    assert result.metrics["dynamic_sampling/constant_groups"] == 1.0


# ------------------------------------------------------------------------- which reward
def two_column_batch(weights=(1.0, 1.0)):
    accuracy = [1, 1, 1, 1,  1, 0, 0, 0]
    fmt = [0, 1, 0, 1,  1, 1, 1, 1]
    return make_batch([[a, f] for a, f in zip(accuracy, fmt)], num_generations=4,
                      reward_names=["accuracy", "format"], reward_weights=weights)


def test_metric_column_selection():
    total = run_plugin(DynamicSampling, two_column_batch())                      # totals [1,2,1,2], [2,1,1,1]
    assert total.keep.reshape(2, 4)[:, 0].tolist() == [True, True]
    acc = run_plugin(DynamicSampling, two_column_batch(), {"metric": "accuracy"})  # accuracy constant in group 0
    assert acc.keep.reshape(2, 4)[:, 0].tolist() == [False, True]
    fmt = run_plugin(DynamicSampling, two_column_batch(), {"metric": "format"})
    assert fmt.keep.reshape(2, 4)[:, 0].tolist() == [True, False]
    # the total is weighted as TRL weights it: weight 0 on format leaves the accuracy
    weighted = run_plugin(DynamicSampling, two_column_batch(weights=(1.0, 0.0)))
    assert weighted.keep.reshape(2, 4)[:, 0].tolist() == [False, True]


def test_unknown_metric_column_is_a_config_error():
    assert DynamicSampling(DynamicSampling.Config(metric="acc")).required_rewards() == ["acc"]
    with pytest.raises(ConfigError, match=r"\(dynamic_sampling\).*reward column 'acc'.*\['accuracy', 'format'\]"):
        check_args(DynamicSampling, {"metric": "acc"}, reward_names=["accuracy", "format"],
                   per_device_train_batch_size=8, num_generations=4)
    check_args(DynamicSampling, {}, reward_names=["accuracy"], per_device_train_batch_size=8, num_generations=4)
    # at run time (no startup check) the lookup still names the column
    with pytest.raises(PluginRuntimeError, match="no reward column 'acc'"):
        run_plugin(DynamicSampling, two_column_batch(), {"metric": "acc"})


@pytest.mark.parametrize("options, key", [({"max_refill_rounds": -1}, "max_refill_rounds"),
                                          ({"tolerance": -0.1}, "tolerance"),
                                          ({"max_refill_tokens": -1}, "max_refill_tokens"),
                                          ({"max_num_gen_batches": 10}, "max_num_gen_batches")])
def test_bad_options(options, key):
    with pytest.raises(ConfigError, match=key):
        plugin_set(DynamicSampling, options)


def refill_seen_by_the_host(options):
    """The `Refill` the host reads for this configuration (`RunInfo.plugins`, as `trl-credit validate`)."""
    run = check_args(DynamicSampling, options, per_device_train_batch_size=8, num_generations=4)
    return run.plugins[0].refill


def test_refill_config_reaches_the_host():
    assert refill_seen_by_the_host({}) == Refill(max_rounds=3, max_tokens=None)
    assert refill_seen_by_the_host({"max_refill_rounds": 7}) == Refill(max_rounds=7, max_tokens=None)
    assert refill_seen_by_the_host({"max_refill_tokens": 4096}) == Refill(max_rounds=3, max_tokens=4096)
    assert refill_seen_by_the_host({"refill": True, "max_refill_tokens": 0}) == Refill(max_rounds=3, max_tokens=0)
    assert refill_seen_by_the_host({"mode": "filter"}) is None
    assert refill_seen_by_the_host({"refill": False}) is None
    assert refill_seen_by_the_host({"mode": "filter", "max_refill_tokens": 100}) is None   # nothing to budget
    assert DynamicSampling(DynamicSampling.Config(max_refill_rounds=2)).refill() == Refill(2, None)


@pytest.mark.parametrize("options, mode", [({}, "replace"), ({"refill": True}, "replace"),
                                           ({"refill": False}, "filter"), ({"mode": "filter"}, "filter"),
                                           ({"mode": "filter", "refill": False}, "filter")])
def test_mode_and_its_refill_alias(options, mode):
    config = plugin_set(DynamicSampling, options).plugins[0].config
    assert config.mode == mode and config.refill == (mode == "replace")


@pytest.mark.parametrize("options, message", [({"mode": "refill"}, "mode"),
                                              ({"mode": "filter", "refill": True}, "contradicts"),
                                              ({"refill": "yes"}, "refill")])
def test_bad_modes_name_the_option(options, message):
    with pytest.raises(ConfigError, match=message):
        plugin_set(DynamicSampling, options)


def test_contract():
    check_plugin(DynamicSampling)
    check_plugin(DynamicSampling, {"tolerance": 0.3, "mode": "filter"})


# ------------------------------------------------------------------------- a real run
def alternating_reward():
    """Deterministic reward: each call (= one generation round of 2 groups of 4) makes group 0
    constant (all 1 on odd calls, all 0 on even calls) and group 1 mixed [0, 1, 0, 1].
    So every round keeps exactly 1 of its 2 groups whatever the model generates."""
    calls = [0]

    def alternating(completions, **kwargs):
        calls[0] += 1
        constant = 1.0 if calls[0] % 2 else 0.0
        return [constant if i % 8 < 4 else float(i % 2) for i in range(len(completions))]

    return alternating, calls


def train(tmp_path, plugin_options, reward=None):
    if reward is None:
        reward, calls = alternating_reward()
    else:
        reward, calls = reward
    trainer = train_tiny([{"name": "dynamic_sampling", **plugin_options}], output_dir=tmp_path,
                         reward_funcs=[reward])
    logs = [entry for entry in trainer.state.log_history if "trl_credit/generation_rounds" in entry]
    return trainer, logs, calls[0]


def test_training_with_refill(tmp_path):
    trainer, logs, calls = train(tmp_path, {"max_refill_rounds": 3})
    assert trainer.state.global_step == 2
    assert len(logs) == 2
    for entry in logs:
        # round 1 keeps 1 of 2 groups (quota 2), round 2 brings the second: exactly 2 rounds
        assert entry["trl_credit/generation_rounds"] == 2.0
        assert entry["trl_credit/extra_tokens"] > 0
        assert entry["trl_credit/kept_fraction"] == 1.0
        assert entry["trl_credit/skipped_update"] == 0.0
        assert entry["trl_credit/dynamic_sampling/constant_groups"] == 0.5
        assert entry["trl_credit/dynamic_sampling/kept_fraction"] == 0.5
        assert "trl_credit/dynamic_sampling/seconds" in entry
        assert "trl_credit/refill_budget_hit" not in entry          # no budget set
    assert calls == 4


def test_training_in_filter_mode(tmp_path):
    trainer, logs, calls = train(tmp_path, {"mode": "filter"})
    assert trainer.state.global_step == 2
    assert len(logs) == 2
    for entry in logs:
        assert entry["trl_credit/generation_rounds"] == 1.0
        assert entry["trl_credit/extra_tokens"] == 0.0
        assert entry["trl_credit/kept_fraction"] == 0.5
        assert entry["trl_credit/skipped_update"] == 0.0
    assert calls == 2


def constant_reward():
    """Every group constant (all 0) whatever the model writes: refill is wanted in every round."""
    calls = [0]

    def constant(completions, **kwargs):
        calls[0] += 1
        return [0.0] * len(completions)

    return constant, calls


def test_refill_token_budget_stops_refill(tmp_path):
    # budget 1 token: round 0 is free, refill round 1 generates >= 8 tokens (every completion has at
    # least its EOS or its 8 tokens), so no round 2 starts although 3 are allowed
    trainer, logs, calls = train(tmp_path, {"max_refill_rounds": 3, "max_refill_tokens": 1}, constant_reward())
    assert trainer.state.global_step == 2
    assert len(logs) == 2
    for entry in logs:
        assert entry["trl_credit/generation_rounds"] == 2.0
        assert entry["trl_credit/refill_budget_hit"] == 1.0
        assert entry["trl_credit/extra_tokens"] >= 8
        assert entry["trl_credit/dynamic_sampling/constant_groups"] == 1.0
        assert entry["trl_credit/kept_fraction"] == 0.0
        assert entry["trl_credit/skipped_update"] == 1.0             # nothing kept: the step is skipped
    assert calls == 4


def test_without_a_budget_refill_runs_every_allowed_round(tmp_path):
    trainer, logs, calls = train(tmp_path, {"max_refill_rounds": 2}, constant_reward())
    assert trainer.state.global_step == 2
    assert len(logs) == 2
    for entry in logs:
        assert entry["trl_credit/generation_rounds"] == 3.0         # round 0 + max_refill_rounds
        assert "trl_credit/refill_budget_hit" not in entry
        assert entry["trl_credit/skipped_update"] == 1.0
    assert calls == 6


def test_trainer_rejects_unknown_metric_column(tmp_path):
    reward, _ = alternating_reward()
    with pytest.raises(ConfigError, match=r"\(dynamic_sampling\).*reward column 'acc'.*\['alternating'\]"):
        train_tiny([{"name": "dynamic_sampling", "metric": "acc"}], output_dir=tmp_path, reward_funcs=[reward],
                   train=False)
