"""Reward noise: flip rates, determinism across processes/steps/rounds, identities, NaN, non-binary
values, the host contract and a short real run."""

from __future__ import annotations

import copy
import math
from typing import ClassVar

import pytest
import torch
from trl_credit_reward_noise import RewardNoise, flip_draws

from trl_credit import ConfigError, PluginRuntimeError, hookimpl
from trl_credit.testing import (
    answer_reward,
    check_args,
    check_plugin,
    edge_case_batches,
    make_batch,
    plugin_set,
    run_plugin,
    train_tiny,
)

NAN = None


def binary_batch(n=8192, g=8, seed=0, step=0, columns=1, prompt_offset=0):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 2, (n, columns), generator=gen).float()
    return make_batch(rewards, g, step=step, prompt_index=[prompt_offset + i // g for i in range(n)],
                      reward_names=[f"r{j}" for j in range(columns)])


def flips(result, original):
    return result.rewards[:, 0] != original[:, 0]


# ------------------------------------------------------------------------- rates
@pytest.mark.parametrize("p", [0.1, 0.4, 0.75])
def test_completion_flip_rate(p):
    batch = binary_batch()
    original = batch.rewards.clone()
    result = run_plugin(RewardNoise, batch, {"p": p, "unit": "completion"})
    rate = flips(result, original).float().mean().item()
    assert abs(rate - p) < 4 * math.sqrt(p * (1 - p) / 8192)           # 4 sigma
    assert result.metrics["reward_noise/flipped_fraction"] == pytest.approx(rate)
    # a flip is the complement, nothing else changes
    torch.testing.assert_close(result.rewards[:, 0], torch.where(flips(result, original), 1 - original[:, 0],
                                                                 original[:, 0]))


def test_group_flip_rate_and_whole_groups():
    batch = binary_batch(n=8192, g=4)
    original = batch.rewards.clone()
    result = run_plugin(RewardNoise, batch)                             # defaults: p = 0.4, per group
    flipped = flips(result, original).reshape(-1, 4)
    assert (flipped.all(dim=1) | ~flipped.any(dim=1)).all()           # a group flips as a whole
    rate = flipped[:, 0].float().mean().item()
    assert abs(rate - 0.4) < 4 * math.sqrt(0.24 / 2048)
    assert result.metrics["reward_noise/flipped_fraction"] == pytest.approx(rate)


# ------------------------------------------------------------------------- identities
def test_p0_identity_and_p1_complement():
    rewards = [1, 0, NAN, 1, 0, 0, 1, NAN]
    same = run_plugin(RewardNoise, make_batch(rewards, 4), {"p": 0.0})
    torch.testing.assert_close(same.rewards, make_batch(rewards, 4).rewards, equal_nan=True)
    assert same.metrics["reward_noise/flipped_fraction"] == 0.0
    for unit in ("group", "completion"):
        flipped = run_plugin(RewardNoise, make_batch(rewards, 4), {"p": 1.0, "unit": unit})
        torch.testing.assert_close(flipped.rewards[:, 0], torch.tensor([0, 1, math.nan, 0, 1, 1, 0, math.nan]),
                                   equal_nan=True)
        assert flipped.metrics["reward_noise/flipped_fraction"] == 1.0      # of the 6 finite rewards


def test_nan_stays_nan_and_is_not_counted():
    rewards = [NAN] * 4 + [1, 0, 1, 0]
    result = run_plugin(RewardNoise, make_batch(rewards, 4), {"p": 1.0})
    assert torch.isnan(result.rewards[:4, 0]).all()
    assert result.rewards[4:, 0].tolist() == [0, 1, 0, 1]
    assert result.metrics["reward_noise/flipped_fraction"] == 1.0
    every = run_plugin(RewardNoise, make_batch([NAN] * 4, 4), {"p": 1.0})
    assert torch.isnan(every.rewards).all()
    assert every.metrics["reward_noise/flipped_fraction"] == 0.0


def test_other_levels_and_columns():
    signed = run_plugin(RewardNoise, make_batch([1, -1, -1, 1], 2), {"p": 1.0, "low": -1.0, "high": 1.0})
    assert signed.rewards[:, 0].tolist() == [-1, 1, 1, -1]
    two = make_batch([[1, 1], [0, 0], [1, 0], [0, 1]], 2, reward_names=["accuracy", "format"])
    result = run_plugin(RewardNoise, two, {"p": 1.0, "column": "format"})
    assert result.rewards.tolist() == [[1, 0], [0, 1], [1, 1], [0, 0]]      # accuracy untouched
    first = run_plugin(RewardNoise, make_batch([[1, 1], [0, 0]], 2, reward_names=["accuracy", "format"]),
                       {"p": 1.0})
    assert first.rewards.tolist() == [[0, 1], [1, 0]]                       # default: the first column


def test_non_binary_values():
    with pytest.raises(PluginRuntimeError, match=r"reward column 'accuracy' is not binary \(0.5.*non_binary"):
        run_plugin(RewardNoise, make_batch([1, 0.5, 0, 1], 4, reward_names=["accuracy"]))
    keep = run_plugin(RewardNoise, make_batch([0.7, 0.2, 0.5, NAN], 4), {"p": 0.0, "non_binary": "threshold"})
    torch.testing.assert_close(keep.rewards[:, 0], torch.tensor([1, 0, 1, math.nan]), equal_nan=True)
    flip = run_plugin(RewardNoise, make_batch([0.7, 0.2, 0.5, NAN], 4), {"p": 1.0, "non_binary": "threshold"})
    torch.testing.assert_close(flip.rewards[:, 0], torch.tensor([0, 1, 0, math.nan]), equal_nan=True)


# ------------------------------------------------------------------------- determinism
def noisy(batch, config=None, plugins=None):
    return run_plugin(RewardNoise, batch, {"unit": "completion", **(config or {})}, plugins=plugins).rewards[:, 0]


def test_same_flips_on_every_process_and_reproducible():
    batch = binary_batch(n=512)
    rank0, rank1 = noisy(copy.deepcopy(batch)), noisy(copy.deepcopy(batch))   # two independent instances
    assert torch.equal(rank0, rank1)
    assert not torch.equal(rank0, batch.rewards[:, 0])
    assert torch.equal(flip_draws(16, 3, 5, 0, torch.arange(4)), flip_draws(16, 3, 5, 0, torch.arange(4)))


def test_draws_change_with_seed_step_round_and_prompts():
    base = noisy(binary_batch(n=512))
    assert not torch.equal(base, noisy(binary_batch(n=512), {"seed": 1}))
    assert not torch.equal(base, noisy(binary_batch(n=512, step=1)))
    assert not torch.equal(base, noisy(binary_batch(n=512, prompt_offset=1000)))
    # two generation rounds of one step (refill): fresh draws; a new step restarts the round count
    plugins = plugin_set(RewardNoise, {"unit": "completion"})
    first = noisy(binary_batch(n=512), plugins=plugins)
    second = noisy(binary_batch(n=512), plugins=plugins)
    assert torch.equal(first, base) and not torch.equal(second, base)
    noisy(binary_batch(n=512, step=1), plugins=plugins)
    assert torch.equal(noisy(binary_batch(n=512, step=1)), noisy(binary_batch(n=512, step=1)))
    draws = flip_draws(4096, 0, 0, 0, torch.arange(512))
    assert 0.0 <= draws.min().item() and draws.max().item() < 1.0 and abs(draws.mean().item() - 0.5) < 0.02


# ------------------------------------------------------------------------- config and contract
def test_missing_column_and_bad_options():
    with pytest.raises(ConfigError, match=r"\(reward_noise\).*reward column 'acc'.*\['accuracy'\]"):
        check_args(RewardNoise, {"column": "acc"}, reward_names=["accuracy"])
    check_args(RewardNoise, reward_names=["accuracy"])                     # the first column: nothing named
    with pytest.raises(PluginRuntimeError, match="no reward column 'acc'"):
        run_plugin(RewardNoise, make_batch([1, 0], 2), {"column": "acc"})
    for options, key in (({"p": 1.5}, "p"), ({"low": 1.0}, "low and high"), ({"unit": "batch"}, "unit"),
                         ({"flip_prob": 0.4}, "flip_prob")):
        with pytest.raises(ConfigError, match=key):
            plugin_set(RewardNoise, options)


def test_contract():
    check_plugin(RewardNoise, {"non_binary": "threshold"})                 # the kit's batches include 0.25, 0.75
    binary = [make for i, make in enumerate(edge_case_batches()) if i != 4]
    check_plugin(RewardNoise, batches=binary)
    check_plugin(RewardNoise, {"unit": "completion", "p": 0.5}, batches=binary)


# ------------------------------------------------------------------------- a real run
class Observer:
    """Test plugin: records the shaped accuracy column and the accuracy recomputed from the texts."""

    seen: ClassVar[list] = []

    @hookimpl
    def on_batch_end(self, batch, advantages):
        clean = answer_reward(batch.completions, batch.column("answer"))
        Observer.seen.append((batch.reward("answer_reward").tolist(), clean))


def test_training_run(tmp_path):
    Observer.seen.clear()
    trainer = train_tiny([{"name": "reward_noise", "p": 1.0, "unit": "completion"}, Observer], output_dir=tmp_path)
    assert trainer.state.global_step == 2
    logs = [entry for entry in trainer.state.log_history if "trl_credit/reward_noise/flipped_fraction" in entry]
    assert len(logs) == 2
    for entry in logs:
        assert entry["trl_credit/reward_noise/flipped_fraction"] == 1.0
        assert math.isfinite(entry["loss"])
    assert len(Observer.seen) == 2
    for shaped, clean in Observer.seen:                                 # the estimator saw 1 - accuracy
        assert len(shaped) == 8
        assert shaped == [1.0 - c for c in clean]
