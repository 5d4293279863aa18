"""GDPO: methods.md vectors, parity with TRL's normalize_then_sum, NaN policies, fallback, a real run."""

from __future__ import annotations

import math

import pytest
import torch

from trl_credit import ConfigError, GRPOAdvantage, grpo_advantages
from trl_credit.testing import check_args, check_plugin, make_batch, plugin_set, run_plugin, train_tiny
from trl_credit_gdpo import GDPO, gdpo_advantages

NAN = None  # make_batch turns None into NaN
TIGHT = dict(rtol=1e-5, atol=1e-5)


def trl_gdpo(rewards, weights, G):
    """The host's TRL formula (parity-tested with GRPOTrainer) in normalize_then_sum mode."""
    return grpo_advantages(rewards, torch.as_tensor(weights, dtype=torch.float32), G, "group", "normalize_then_sum")


# ------------------------------------------------------------------------- methods.md 2.1 vectors
def test_vector_one_group():
    batch = make_batch([[1, 1], [1, 1], [1, 0], [0, 0]], num_generations=4)
    result = run_plugin(GDPO, batch)
    torch.testing.assert_close(result.advantages, torch.tensor([0.769054, 0.769054, -0.206077, -1.332031]), **TIGHT)
    # the intermediate S_i of methods.md, and plain GRPO on the summed reward for contrast
    A_k = (batch.rewards - batch.rewards.mean(0)) / (batch.rewards.std(0) + 1e-4)
    torch.testing.assert_close(A_k.sum(1), torch.tensor([1.365775, 1.365775, -0.365975, -2.365575]), **TIGHT)
    grpo = run_plugin(GRPOAdvantage, make_batch([2, 2, 1, 0], num_generations=4))
    torch.testing.assert_close(grpo.advantages, torch.tensor([0.783268, 0.783268, -0.261089, -1.305446]), **TIGHT)
    assert result.metrics["gdpo/gdpo_applied"] == 1.0


def test_vector_two_groups():
    rewards = [[1, 1], [1, 0], [0, 1], [0, 0],  [1, 1], [1, 1], [1, 1], [1, 0]]
    result = run_plugin(GDPO, make_batch(rewards, num_generations=4))
    expected = torch.tensor([1.527404, 0, 0, -1.527404, 0.440912, 0.440912, 0.440912, -1.322735])
    torch.testing.assert_close(result.advantages, expected, **TIGHT)


# ------------------------------------------------------------------------- parity with TRL
@pytest.mark.parametrize("seed", range(6))
def test_equals_trl_normalize_then_sum_on_random_rewards(seed):
    g = torch.Generator().manual_seed(seed)
    G = (2, 4, 8)[seed % 3]
    K = 2 + seed % 3
    M = 3 + seed
    r = torch.randn(M * G, K, generator=g)
    r[torch.rand(M * G, K, generator=g) < 0.5] = float(seed % 2)  # ties, some constant groups
    r[torch.rand(M * G, K, generator=g) < 0.2] = math.nan       # missing entries
    r[torch.rand(M * G, generator=g) < 0.1] = math.nan          # unscorable rows (every reward None)
    r[:G, 0] = math.nan                                         # a column missing in a whole group
    if G == 2:
        r[G, 1] = math.nan                                      # a column with one finite value in a group
    w = torch.rand(K, generator=g) * 2 - 0.5
    expected = trl_gdpo(r, w, G)
    assert torch.isnan(r).any() and torch.isfinite(expected).all()
    result = run_plugin(GDPO, make_batch(r, num_generations=G, reward_weights=w.tolist()))
    torch.testing.assert_close(result.advantages, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gdpo_advantages(r, w, G), expected, rtol=1e-5, atol=1e-6)


def test_equals_trl_without_nans_and_with_weights():
    rewards = [[1, 0.2, 0], [0, 0.9, 1], [1, 0.5, 1], [0, 0.1, 0], [1, 1, 1], [1, 0.3, 0]]
    w = [1.0, 0.5, 2.0]
    result = run_plugin(GDPO, make_batch(rewards, num_generations=3, reward_weights=w))
    expected = trl_gdpo(torch.tensor(rewards), w, 3)
    torch.testing.assert_close(result.advantages, expected, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------- NaN policy
NAN_REWARDS = [[1, 1], [1, NAN], [NAN, NAN], [0, 0],  [1, 0], [NAN, 1], [0, 1], [1, 1]]


def test_nan_policy_trl_ignores_missing_entries():
    result = run_plugin(GDPO, make_batch(NAN_REWARDS, num_generations=4))
    r = make_batch(NAN_REWARDS, num_generations=4).rewards
    torch.testing.assert_close(result.advantages, trl_gdpo(r, [1.0, 1.0], 4), **TIGHT)
    assert result.advantages[2] == 0.0                           # every reward NaN: advantage 0


def test_nan_policy_zero_is_nan_to_num_before_normalising():
    result = run_plugin(GDPO, make_batch(NAN_REWARDS, num_generations=4), {"nan_policy": "zero"})
    zeroed = [[0 if v is None else v for v in row] for row in NAN_REWARDS]
    torch.testing.assert_close(result.advantages, trl_gdpo(torch.tensor(zeroed, dtype=torch.float32), [1, 1], 4),
                               **TIGHT)
    # written out as the official code computes it: plain mean/std after nan_to_num
    r = torch.tensor(zeroed, dtype=torch.float32).view(2, 4, 2)
    S = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).sum(-1).view(-1)
    torch.testing.assert_close(result.advantages, (S - S.mean()) / (S.std() + 1e-4), **TIGHT)
    assert result.advantages[2] != 0.0                           # a None is a real 0 reward here
    trl = run_plugin(GDPO, make_batch(NAN_REWARDS, num_generations=4))
    assert not torch.allclose(result.advantages, trl.advantages)


def test_all_rewards_nan():
    for policy in ("trl", "zero"):
        result = run_plugin(GDPO, make_batch([[NAN, NAN]] * 8, num_generations=4), {"nan_policy": policy})
        assert torch.equal(result.advantages, torch.zeros(8))


# ------------------------------------------------------------------------- one reward column
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_single_reward_falls_back_to_grpo(scale):
    rewards = [1, 0, 0, 0,  1, 1, 0, NAN,  0.5, 0.2, 0.9, 0.1]
    batch = make_batch(rewards, num_generations=4, scale_rewards=scale, reward_weights=[2.0])
    result = run_plugin(GDPO, batch)
    expected = grpo_advantages(batch.rewards, torch.tensor([2.0]), 4, scale, "sum_then_normalize")
    torch.testing.assert_close(result.advantages, expected, rtol=0, atol=0)
    assert result.metrics["gdpo/gdpo_applied"] == 0.0
    builtin = run_plugin(GRPOAdvantage, make_batch(rewards, num_generations=4, scale_rewards=scale,
                                                   reward_weights=[2.0]))
    torch.testing.assert_close(result.advantages, builtin.advantages, rtol=0, atol=0)


def test_single_reward_without_fallback_is_gdpo():
    rewards = [1, 0, 0, 0,  1, 1, 0, 1]
    result = run_plugin(GDPO, make_batch(rewards, num_generations=4), {"single_reward_fallback": False})
    torch.testing.assert_close(result.advantages, trl_gdpo(torch.tensor(rewards).float()[:, None], [1.0], 4),
                               **TIGHT)
    # group-normalised values 1.4997/-0.4999 and 0.4999/-1.4997, whitened over the batch
    a = torch.tensor([1.49962, -0.49987, -0.49987, -0.49987, 0.49987, 0.49987, -1.49962, 0.49987])
    torch.testing.assert_close(result.advantages, (a - a.mean()) / (a.std() + 1e-4), rtol=1e-4, atol=1e-4)
    assert result.metrics["gdpo/gdpo_applied"] == 1.0


def test_single_reward_nan_policy_zero_matches_official_fallback():
    # official fallback: nansum of the weighted reward (a None becomes 0), then plain mean/std
    rewards = [1, NAN, 0, 1]
    result = run_plugin(GDPO, make_batch(rewards, num_generations=4), {"nan_policy": "zero"})
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    torch.testing.assert_close(result.advantages, (r - r.mean()) / (r.std() + 1e-4), **TIGHT)


# ------------------------------------------------------------------------- edge cases
def test_constant_component_contributes_nothing():
    # column 1 constant in both groups: GDPO reduces to whitened group advantages of column 0
    rewards = [[1, 3], [0, 3], [0, 3], [0, 3],  [1, 0], [1, 0], [0, 0], [1, 0]]
    both = run_plugin(GDPO, make_batch(rewards, num_generations=4)).advantages
    alone = run_plugin(GDPO, make_batch([r[0] for r in rewards], num_generations=4),
                       {"single_reward_fallback": False}).advantages
    torch.testing.assert_close(both, alone, **TIGHT)


def test_all_constant_groups_give_zero():
    rewards = [[1, 0]] * 4 + [[0, 1]] * 4
    assert torch.equal(run_plugin(GDPO, make_batch(rewards, num_generations=4)).advantages, torch.zeros(8))


def test_single_completion_per_group():
    rewards = [[1, 0], [0, 1], [1, 1]]
    result = run_plugin(GDPO, make_batch(rewards, num_generations=1))
    assert torch.equal(result.advantages, torch.zeros(3))          # no group spread: A_ik = 0
    torch.testing.assert_close(result.advantages, trl_gdpo(torch.tensor(rewards).float(), [1, 1], 1))
    one = run_plugin(GDPO, make_batch([[1, 0]], num_generations=1), {"nan_policy": "zero"})
    assert torch.equal(one.advantages, torch.zeros(1))             # N = 1: no batch std, still finite


def test_bad_options():
    with pytest.raises(ConfigError, match="nan_policy"):
        plugin_set(GDPO, {"nan_policy": "drop"})
    with pytest.raises(ConfigError, match="eps"):
        plugin_set(GDPO, {"eps": 1e-6})


def multi_column_batches():
    random = torch.rand(12, 3, generator=torch.Generator().manual_seed(1))
    return [
        lambda: make_batch([[1, 0], [0, 1], [1, 1], [0, 0], [1, 1], [1, 1], [1, 1], [1, 1]], 4),
        lambda: make_batch([[1, NAN], [NAN, NAN], [0, 1], [1, 0]], 2),
        lambda: make_batch([[1, 0, 0.5], [0, 1, 0.2], [1, 1, 0.0]], 1),
        lambda: make_batch(random, 6, reward_weights=[1.0, -0.5, 2.0]),
    ]


def test_contract():
    check_plugin(GDPO)
    # nan_policy: zero is the official code's reading: None counts as a real reward of 0, so those rows train
    check_plugin(GDPO, {"nan_policy": "zero", "single_reward_fallback": False}, credits_unscorable=True)
    check_plugin(GDPO, batches=multi_column_batches())
    check_plugin(GDPO, {"nan_policy": "zero"}, batches=multi_column_batches(), credits_unscorable=True)


# ------------------------------------------------------------------------- a real run
def test_check_args_accepts_one_or_several_reward_columns():
    """GDPO makes no check of its own: one reward column falls back to GRPO (single_reward_fallback)."""
    for names in (["accuracy"], ["accuracy", "format"]):
        for fallback in (True, False):
            check_args(GDPO, {"single_reward_fallback": fallback}, reward_names=names,
                       per_device_train_batch_size=8, num_generations=4)


def test_training_run(tmp_path):
    def length_reward(completions, **kwargs):
        return [min(len(c), 8) / 8 for c in completions]

    def parity_reward(completions, **kwargs):
        return [float(i % 2) if i % 3 else None for i in range(len(completions))]

    trainer = train_tiny([{"name": "gdpo"}], output_dir=tmp_path, reward_funcs=[length_reward, parity_reward])
    assert trainer.state.global_step == 2
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2
    for entry in logs:
        assert math.isfinite(entry["loss"])
        assert "trl_credit/gdpo/seconds" in entry
        assert entry["trl_credit/gdpo/gdpo_applied"] == 1.0
