"""CorrGRPO: the methods.md vectors, edge cases, parity with a per-group transcription, contract, a real run."""

from __future__ import annotations

import math

import pytest
import torch

from trl_credit import ConfigError, PluginRuntimeError, completion_text
from trl_credit.testing import answer_reward, check_args, check_plugin, make_batch, plugin_set, run_plugin, train_tiny
from trl_credit_corrgrpo import CorrGRPO, corrgrpo_advantages

EPS = 1e-6
TIGHT = dict(rtol=1e-6, atol=1e-6)


def run(rewards, g=4, config=None, **kwargs):
    return run_plugin(CorrGRPO, make_batch(rewards, g, **kwargs), config)


def per_group_reference(rewards, weights, g, eps=EPS, norm=True):
    """The official per-group loop, transcribed literally (float64, rows with NaN not supported)."""
    R = rewards.double() * weights.double()
    out = torch.zeros(R.shape[0], dtype=torch.float64)
    for start in range(0, R.shape[0], g):
        grp = R[start:start + g]
        C = grp - grp.mean(0, keepdim=True)
        total = C.sum(-1)
        if not norm:
            out[start:start + g] = total
            continue
        if grp.shape[0] > 1:
            cov = C.T @ C / (grp.shape[0] - 1)
            var = cov.diagonal()
            inv = torch.where(var > 0, var.rsqrt(), torch.zeros_like(var))
            s = (cov * inv[:, None] * inv[None, :]).sum().clamp_min(0)
        else:
            s = torch.zeros((), dtype=torch.float64)
        out[start:start + g] = total / torch.sqrt(s + eps)
    return out.float()


# ------------------------------------------------------------------------- methods.md 2.2 vectors
@pytest.mark.parametrize("rewards, corr_sum, expected", [
    ([(1, 1), (0, 0), (1, 1), (0, 0)], 4.0, [0.5, -0.5, 0.5, -0.5]),                        # correlated
    ([(1, 1), (0, 1), (1, 0), (0, 0)], 2.0, [0.707107, 0.0, 0.0, -0.707107]),               # uncorrelated
    ([(1, 10), (0, 10), (1, 0), (0, 0)], 2.0, [3.889087, 3.181980, -3.181980, -3.889087]),  # 2nd x10
    ([(1, 1)] * 4, 0.0, [0.0] * 4),                                                          # all equal
    ([1, 0, 0, 0], 1.0, [0.75, -0.25, -0.25, -0.25]),                                        # one component
])
def test_methods_md_vectors(rewards, corr_sum, expected):
    result = run(rewards)
    # the rounded methods.md values (they drop eps), then the exact value with eps
    torch.testing.assert_close(result.advantages, torch.tensor(expected), rtol=1e-6, atol=2e-6)
    r = torch.tensor(rewards, dtype=torch.float64).reshape(4, -1)
    centred_total = (r - r.mean(0)).sum(-1)
    exact = centred_total / math.sqrt(corr_sum + EPS)
    torch.testing.assert_close(result.advantages, exact.float(), **TIGHT)
    if corr_sum:
        assert result.metrics["corrgrpo/min_corr_sum"] == pytest.approx(corr_sum, abs=1e-12)
    assert result.metrics["corrgrpo/clamped_fraction"] == 0.0


def test_x10_scale_is_not_normalised_away():
    """Scaling one component by 10 changes the numerator, never the correlations."""
    base = run([(1, 1), (0, 1), (1, 0), (0, 0)]).advantages
    scaled = run([(1, 10), (0, 10), (1, 0), (0, 0)]).advantages
    torch.testing.assert_close(scaled, (torch.tensor([5.5, 4.5, -4.5, -5.5]) / math.sqrt(2 + EPS)), **TIGHT)
    torch.testing.assert_close(base, torch.tensor([1.0, 0.0, 0.0, -1.0]) / math.sqrt(2 + EPS), **TIGHT)
    # the same scaling through reward_weights gives the same advantages
    weighted = run([(1, 1), (0, 1), (1, 0), (0, 0)], reward_weights=[1.0, 10.0]).advantages
    torch.testing.assert_close(weighted, scaled, **TIGHT)


def test_anti_correlated_components_hit_sqrt_eps():
    """(1,0),(0,10),(1,0),(0,10): rho_12 = -1, sum rho = 0, divisor sqrt(1e-6): A = +-4500, warned."""
    with pytest.warns(RuntimeWarning, match="correlation sum"):
        result = run([(1, 0), (0, 10), (1, 0), (0, 10)])
    torch.testing.assert_close(result.advantages, torch.tensor([-4500.0, 4500.0, -4500.0, 4500.0]),
                               rtol=1e-6, atol=1e-3)
    assert result.metrics["corrgrpo/clamped_fraction"] == 1.0
    assert abs(result.metrics["corrgrpo/min_corr_sum"]) < 1e-12
    # a larger epsilon bounds the blow-up: 4.5 / sqrt(1e-2) = 45
    with pytest.warns(RuntimeWarning):
        bounded = run([(1, 0), (0, 10), (1, 0), (0, 10)], config={"epsilon": 1e-2})
    torch.testing.assert_close(bounded.advantages, torch.tensor([-45.0, 45.0, -45.0, 45.0]), **TIGHT)


def test_warning_is_given_once_and_metric_mixes_groups():
    plugins = plugin_set(CorrGRPO, name="corrgrpo")
    rows = [(1, 0), (0, 10), (1, 0), (0, 10),  (1, 1), (0, 0), (1, 1), (0, 0)]
    with pytest.warns(RuntimeWarning):
        first = run_plugin(CorrGRPO, make_batch(rows, 4), plugins=plugins)
    assert first.metrics["corrgrpo/clamped_fraction"] == 0.5
    assert first.metrics["corrgrpo/min_corr_sum"] == pytest.approx(0.0, abs=1e-12)
    assert first.metrics["corrgrpo/mean_corr_sum"] == pytest.approx(2.0)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_plugin(CorrGRPO, make_batch(rows, 4), plugins=plugins)   # no second warning


def test_dr_grpo_switch_returns_centred_total():
    rows = [(1, 10), (0, 10), (1, 0), (0, 0),  (1, 0), (0, 10), (1, 0), (0, 10)]
    result = run(rows, config={"norm_by_correlation": False})
    torch.testing.assert_close(result.advantages,
                               torch.tensor([5.5, 4.5, -4.5, -5.5, -4.5, 4.5, -4.5, 4.5]), **TIGHT)
    assert not any(k.endswith("corr_sum") or k.endswith("clamped_fraction") for k in result.metrics)


# ------------------------------------------------------------------------- parity and structure
@pytest.mark.parametrize("g, k", [(2, 1), (4, 3), (8, 2), (5, 4)])
def test_matches_the_per_group_loop(g, k):
    gen = torch.Generator().manual_seed(g * 10 + k)
    rewards = torch.randint(0, 3, (6 * g, k), generator=gen).float() * torch.rand(k, generator=gen)
    rewards[: 2 * g] = torch.rand(2 * g, k, generator=gen)           # some continuous groups
    rewards[2 * g: 3 * g, 0] = 0.7                                   # a component constant in a group
    weights = torch.tensor([1.0, -0.5, 2.0, 0.25][:k])
    for norm in (True, False):
        got, _, _ = corrgrpo_advantages(rewards, weights, g, norm_by_correlation=norm)
        torch.testing.assert_close(got, per_group_reference(rewards, weights, g, norm=norm), rtol=1e-5, atol=1e-5)


def test_constant_component_is_excluded():
    """A component constant in the group adds nothing to the numerator or the correlation sum."""
    plain = run([1, 0, 0, 0]).advantages
    with_constant = run([(1, 0.3), (0, 0.3), (0, 0.3), (0, 0.3)]).advantages
    torch.testing.assert_close(with_constant, plain, rtol=0, atol=0)
    # three times 0.1: our float64 masked mean is not exactly 0.1 (centred residue ~1e-17); the
    # exact max == min rule still calls the component constant, so nothing changes
    alone = run([1, 0, 0], g=3).advantages
    with_tenth = run([(1, 0.1), (0, 0.1), (0, 0.1)], g=3).advantages
    torch.testing.assert_close(with_tenth, alone, rtol=0, atol=0)
    torch.testing.assert_close(alone, torch.tensor([2 / 3, -1 / 3, -1 / 3]) / math.sqrt(1 + EPS), **TIGHT)


def test_constant_groups_give_zero():
    result = run([(1, 0)] * 4 + [(0, 0.5)] * 4)
    assert torch.equal(result.advantages, torch.zeros(8))
    assert result.metrics["corrgrpo/active_fraction"] == 0.0
    assert result.metrics["corrgrpo/clamped_fraction"] == 0.0


def test_single_completion_per_group_gives_zero():
    result = run([(1, 3), (0, 1), (1, 0)], g=1)
    assert torch.equal(result.advantages, torch.zeros(3))


def test_batch_of_groups_is_independent():
    a = run([(1, 1), (0, 1), (1, 0), (0, 0)]).advantages
    b = run([(1, 10), (0, 10), (1, 0), (0, 0)]).advantages
    both = run([(1, 1), (0, 1), (1, 0), (0, 0), (1, 10), (0, 10), (1, 0), (0, 0)]).advantages
    torch.testing.assert_close(both, torch.cat([a, b]), rtol=0, atol=0)


# ------------------------------------------------------------------------- NaN policy
NAN = None


def test_nan_zero_policy():
    # row 1's second component missing -> 0 (as TRL's nansum); row 3 fully missing -> A = 0, left out
    rows = [(1, 1), (0, NAN), (1, 0), (NAN, NAN)]
    result = run(rows)
    # statistics over rows 0..2: components (1,0,1) and (1,0,0): centred (1/3,-2/3,1/3), (2/3,-1/3,-1/3)
    # norms^2 2/3 and 2/3, cross 1/3 -> rho_12 = 1/2, sum rho = 3
    expected = torch.tensor([1.0, -1.0, 0.0, 0.0]) / math.sqrt(3 + EPS)
    torch.testing.assert_close(result.advantages, expected, **TIGHT)


def test_nan_group_mean_policy():
    rows = [(1, 1), (0, NAN), (1, 0), (NAN, NAN)]
    result = run(rows, config={"nan_policy": "group_mean"})
    # second component of row 1 imputed as mean(1, 0) = 0.5: centred (1/3,-2/3,1/3), (1/2,0,-1/2)
    # norms^2 2/3, 1/2; cross 0 -> sum rho = 2; totals 5/6, -2/3, -1/6
    expected = torch.tensor([5 / 6, -2 / 3, -1 / 6, 0.0]) / math.sqrt(2 + EPS)
    torch.testing.assert_close(result.advantages, expected, **TIGHT)


def test_all_nan_group_and_single_scorable_row():
    rows = [(NAN, NAN)] * 4 + [(1, 2), (NAN, NAN), (NAN, NAN), (NAN, NAN)]
    for policy in ("zero", "group_mean"):
        result = run(rows, config={"nan_policy": policy})
        assert torch.equal(result.advantages, torch.zeros(8))


# ------------------------------------------------------------------------- config and columns
def test_reward_columns_selection():
    rows = [(1, 1, 5), (0, 1, 7), (1, 0, 5), (0, 0, 9)]
    names = ["accuracy", "format", "length"]
    picked = run(rows, config={"reward_columns": ["accuracy", "format"]}, reward_names=names).advantages
    torch.testing.assert_close(picked, torch.tensor([1.0, 0.0, 0.0, -1.0]) / math.sqrt(2 + EPS), **TIGHT)
    with pytest.raises(ConfigError, match=r"plugins\[0\] \(corrgrpo\): needs reward column 'acc'"):
        check_args(CorrGRPO, {"reward_columns": ["acc"]}, reward_names=names,
                   per_device_train_batch_size=8, num_generations=4)
    check_args(CorrGRPO, {"reward_columns": ["accuracy", "format"]}, reward_names=names,
               per_device_train_batch_size=8, num_generations=4)
    with pytest.raises(PluginRuntimeError, match="no reward column 'acc'"):
        run(rows, config={"reward_columns": ["acc"]}, reward_names=names)


@pytest.mark.parametrize("options, key", [({"epsilon": 0.0}, "epsilon"), ({"nan_policy": "drop"}, "nan_policy"),
                                          ({"near_zero_corr_sum": -1}, "near_zero_corr_sum"),
                                          ({"scale_rewards": "group"}, "scale_rewards")])
def test_bad_options(options, key):
    with pytest.raises(ConfigError, match=key):
        plugin_set(CorrGRPO, options)


def test_contract():
    check_plugin(CorrGRPO)
    check_plugin(CorrGRPO, {"norm_by_correlation": False, "nan_policy": "group_mean"})
    continuous = torch.rand(8, 3, generator=torch.Generator().manual_seed(0))
    multi = [
        lambda: make_batch(continuous, 4, lengths=[3, 1, 4, 0, 2, 5, 6, 1]),
        lambda: make_batch([(1, None), (None, None), (0, 2), (1, 2)], 2),
        lambda: make_batch([(1, 0), (0, 10), (1, 0), (0, 10)], 4),
    ]
    with pytest.warns(RuntimeWarning):
        check_plugin(CorrGRPO, batches=multi)


# ------------------------------------------------------------------------- a real run
def short_answer(completions, **kwargs):
    """A second, deterministic component: 1 for completions of at most 12 characters."""
    return [float(len(completion_text(c)) <= 12) for c in completions]


def test_training_two_steps(tmp_path):
    trainer = train_tiny([{"name": "corrgrpo", "reward_columns": ["answer_reward", "short_answer"]}],
                         output_dir=tmp_path, reward_funcs=[answer_reward, short_answer])
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert trainer.state.global_step == 2
    assert len(logs) == 2
    for entry in logs:
        assert "trl_credit/corrgrpo/seconds" in entry
        assert "trl_credit/corrgrpo/clamped_fraction" in entry
        assert math.isfinite(entry["loss"])
