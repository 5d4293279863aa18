"""RiskPO: the methods.md vector, a loop reference, edge cases, the tracker state and a short real run."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from trl_credit import ConfigError, PluginRuntimeError
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
from trl_credit_riskpo import TRACKER_LEVELS, RiskPO

TIGHT = dict(rtol=1e-5, atol=1e-6)

# methods.md 2.3: bundle of K=2 prompts, n=4; q1=[1,0,1,0], q2=[1,1,0,0]; alpha=0.2, beta=0.8, w=1.5
VECTOR_REWARDS = [1, 0, 1, 0, 1, 1, 0, 0]
VECTOR_PAPER = [0.653195, 0.326598, 0.326598, -2.204527]        # m / (sigma + eps), S = [2, 1, 1, 0]
VECTOR_SUM_MEAN = [0.326598, 0.163299, 0.163299, -1.102264]     # per question


def run(rewards, g=4, **config):
    config.setdefault("bundle_size", 2)
    return run_plugin(RiskPO, make_batch(rewards, num_generations=g), config)


# ------------------------------------------------------------------------- methods.md vector
def test_vector_uniform():
    result = run(VECTOR_REWARDS, credit="uniform")
    torch.testing.assert_close(result.advantages, torch.tensor(VECTOR_PAPER * 2), **TIGHT)
    m = result.metrics
    assert m["riskpo/q_lo"] == pytest.approx(0.6, abs=1e-6)
    assert m["riskpo/q_hi"] == pytest.approx(1.4, abs=1e-6)
    assert m["riskpo/paper_score"] == pytest.approx(1.0)


def test_vector_sum_mean_is_the_default():
    result = run(VECTOR_REWARDS)   # defaults: sum-mean, alpha 0.2, beta 0.8, w 1.5, natural off
    torch.testing.assert_close(result.advantages, torch.tensor(VECTOR_SUM_MEAN * 2), **TIGHT)
    # the faithful quirk: q1's 2nd and q2's 3rd responses are wrong yet get a positive advantage
    assert result.advantages[1] > 0 and result.advantages[6] > 0


def test_vector_std_credit():
    # every question has unbiased std sqrt(1/3): A = m / (sqrt(1/3) + eps)
    result = run(VECTOR_REWARDS, credit="std")
    expected = torch.tensor(VECTOR_PAPER * 2) / (math.sqrt(1 / 3) + 1e-6)
    torch.testing.assert_close(result.advantages, expected, **TIGHT)
    torch.testing.assert_close(result.advantages[:4], torch.tensor([1.131366, 0.565683, 0.565683, -3.818346]),
                               **TIGHT)


def test_vector_options():
    sigma = math.sqrt(2 / 3) + 1e-6                      # std([2, 1, 1, 0]) = 0.816497
    # a = [0.8, 0.4, 0.4, 0] / 0.6, c = [0, 0, 0, -0.6] / 0.2
    a = torch.tensor([0.8, 0.4, 0.4, 0.0]) / (0.6 + 1e-6)
    c = torch.tensor([0.0, 0.0, 0.0, -0.6]) / (0.2 + 1e-6)
    no_std = run(VECTOR_REWARDS, credit="uniform", norm_adv_by_std=False).advantages[:4]
    torch.testing.assert_close(no_std, torch.tensor([0.533333, 0.266667, 0.266667, -1.8]), **TIGHT)
    rvar_only = run(VECTOR_REWARDS, credit="uniform", w=0.0).advantages[:4]
    torch.testing.assert_close(rvar_only, a / sigma, **TIGHT)
    natural = run(VECTOR_REWARDS, credit="uniform", natural_baseline_adv=True).advantages[:4]
    a_nat = (torch.tensor([0.8, 0.4, 0.4, 0.0]) - 0.8) / (0.6 + 1e-6)   # + q_lo - q_hi = -0.8
    torch.testing.assert_close(natural, (1.5 * c + a_nat) / 2.5 / sigma, **TIGHT)
    torch.testing.assert_close(natural, torch.tensor(VECTOR_PAPER) - 0.653197, rtol=1e-5, atol=2e-6)


# ------------------------------------------------------------------------- loop reference
def reference(rewards, k, g, alpha, beta, w, credit, natural, norm, eps=1e-6):
    """The official loop, written out per bundle and per paper in float64 (our own restatement)."""
    r = torch.tensor(rewards, dtype=torch.float64)
    out = torch.zeros_like(r)
    for b in range(len(rewards) // (k * g)):
        rows = [[(b * k + q) * g + p for p in range(g)] for q in range(k)]          # rows[q][p]
        S = torch.stack([sum(r[rows[q][p]] for q in range(k)) for p in range(g)])
        lo, hi = (torch.quantile(S, x) for x in (alpha, beta)) if g > 1 else (S[0], S[0])
        sd = S.std() if g > 1 else torch.tensor(1.0, dtype=torch.float64)
        for p in range(g):
            a = max(S[p] - lo, 0) - max(S[p] - hi, 0) + ((lo - hi) if natural else 0)
            a = a / (beta - alpha + eps)
            c = -max(lo - S[p], 0) / (alpha + eps)
            m = (w * c + a) / (w + 1)
            m = m / (sd + eps) if norm else m
            idx = [rows[q][p] for q in range(k)]
            if credit == "uniform":
                out[idx] = m
            elif credit == "std":
                for q in range(k):
                    s = r[rows[q]].std() if g > 1 else torch.tensor(0.0)
                    out[rows[q][p]] = m / ((s if s > 1e-3 else 1.0) + eps)
            else:
                ratios = [r[rows[q][p]] - r[rows[q]].mean() for q in range(k)]
                total = sum(ratios)
                for q in range(k):
                    out[rows[q][p]] = m * ratios[q] / total if abs(total) > 1e-6 else m / k
    return out.float()


@pytest.mark.parametrize("credit, natural, norm, k, g", [
    ("sum-mean", False, True, 5, 4), ("uniform", True, True, 3, 5), ("std", False, False, 2, 6),
    ("sum-mean", True, False, 1, 8), ("std", True, True, 4, 3),
])
def test_matches_loop_reference_on_random_bundles(credit, natural, norm, k, g):
    gen = torch.Generator().manual_seed(k * 10 + g)
    binary = (torch.rand(3 * k * g, generator=gen) > 0.5).float().tolist()
    graded = torch.rand(3 * k * g, generator=gen).round(decimals=1).tolist()
    for rewards, alpha, beta, w in ((binary, 0.2, 0.8, 1.5), (graded, 0.1, 0.9, 0.7)):
        config = dict(bundle_size=k, alpha=alpha, beta=beta, w=w, credit=credit,
                      natural_baseline_adv=natural, norm_adv_by_std=norm)
        got = run(rewards, g=g, **config).advantages
        torch.testing.assert_close(got, reference(rewards, k, g, alpha, beta, w, credit, natural, norm),
                                   rtol=1e-4, atol=1e-5)


def test_bundles_are_independent():
    other = [0, 0, 0, 1, 1, 0, 1, 1]
    both = run(VECTOR_REWARDS + other).advantages
    torch.testing.assert_close(both[:8], run(VECTOR_REWARDS).advantages)
    torch.testing.assert_close(both[8:], run(other).advantages)


# ------------------------------------------------------------------------- edge cases
@pytest.mark.parametrize("credit", ["uniform", "std", "sum-mean"])
def test_all_papers_equal_gives_zero(credit):
    # q1 = [1,0,1,0], q2 = [0,1,0,1]: every paper scores 1 -> q_lo = q_hi = S -> A = 0
    for rewards in ([1, 0, 1, 0, 0, 1, 0, 1], [1] * 8, [0] * 8, [0.3] * 8):
        assert torch.equal(run(rewards, credit=credit).advantages, torch.zeros(8))


@pytest.mark.parametrize("credit", ["uniform", "std", "sum-mean"])
def test_single_completion_per_group_gives_zero(credit):
    # one paper per bundle: q_lo = q_hi = S, sigma = 1 -> a = c = 0
    result = run([1, 0, 1, 1], g=1, credit=credit)
    assert torch.equal(result.advantages, torch.zeros(4))


def test_nan_rewards_score_zero_and_get_no_credit():
    with_nan = run([1, None, 1, 0, 1, 1, 0, 0], credit="uniform").advantages
    as_zero = run([1, 0, 1, 0, 1, 1, 0, 0], credit="uniform").advantages
    assert with_nan[1] == 0.0
    torch.testing.assert_close(with_nan[[0, 2, 3, 4, 5, 6, 7]], as_zero[[0, 2, 3, 4, 5, 6, 7]])
    assert torch.equal(run([None] * 8).advantages, torch.zeros(8))


def test_sum_mean_falls_back_to_an_equal_split():
    # paper 0: q1 = 1 (mean 0.5), q2 = 0 (mean 0.5): centred sum 0 -> m / K each
    result = run([1, 0, 1, 0, 0, 1, 1, 0], credit="sum-mean")
    uniform = run([1, 0, 1, 0, 0, 1, 1, 0], credit="uniform").advantages
    torch.testing.assert_close(result.advantages[[0, 4]], uniform[[0, 4]] / 2)


def test_weighted_reward_columns_are_summed():
    two = make_batch([[r, 1.0] for r in VECTOR_REWARDS], num_generations=4, reward_weights=[2.0, 0.5])
    total = make_batch([2 * r + 0.5 for r in VECTOR_REWARDS], num_generations=4)
    torch.testing.assert_close(run_plugin(RiskPO, two, {"bundle_size": 2}).advantages,
                               run_plugin(RiskPO, total, {"bundle_size": 2}).advantages)


def test_group_count_not_a_multiple_of_bundle_size():
    with pytest.raises(PluginRuntimeError, match=r"3 prompt groups.*bundle_size=2.*steps_per_generation"
                                                 r".*bundle_size \* num_generations = 8"):
        run([1, 0, 1, 0] * 3, bundle_size=2)
    with pytest.raises(PluginRuntimeError, match="multiple of bundle_size=5"):
        run(VECTOR_REWARDS, bundle_size=5)


# ------------------------------------------------------------------------- check_args
def test_check_args_groups_per_batch_must_be_a_multiple_of_bundle_size():
    # 8 completions of 4 = 2 groups per generation batch; the default bundle_size is 5
    with pytest.raises(ConfigError) as error:
        check_args(RiskPO, per_device_train_batch_size=8, num_generations=4)
    message = str(error.value)
    assert "plugins[0] (riskpo): bundle_size: a generation batch holds 2 prompt groups" in message
    assert "generation_batch_size=8 / num_generations=4), not a multiple of bundle_size=5" in message
    assert ("fix: make per_device_train_batch_size * num_processes * steps_per_generation (= generation_batch_size, "
            "now 8) a multiple of bundle_size * num_generations = 20, or set bundle_size to a divisor of 2") in message
    with pytest.raises(ConfigError, match=r"\(riskpo\): bundle_size: a generation batch holds 3 prompt groups"):
        check_args(RiskPO, {"bundle_size": 2}, per_device_train_batch_size=12, num_generations=4)
    # multiples pass: 2 groups in bundles of 2; 8 x 5 steps_per_generation = 40 = 10 groups in bundles of 5
    check_args(RiskPO, {"bundle_size": 2}, per_device_train_batch_size=8, num_generations=4)
    check_args(RiskPO, per_device_train_batch_size=8, num_generations=4, steps_per_generation=5)
    check_args(RiskPO, {"bundle_size": 1}, per_device_train_batch_size=12, num_generations=4)


def test_check_args_rejects_a_filter_that_drops_groups():
    with pytest.raises(ConfigError) as error:
        check_args(RiskPO, {"bundle_size": 2}, others=["dynamic_sampling"], per_device_train_batch_size=8,
                   num_generations=4)
    message = str(error.value)
    assert "plugins[0] (riskpo): bundle_size: bundles of 2 consecutive prompt groups need every group" in message
    assert "plugins[1] (dynamic_sampling) filters rollouts" in message
    assert "fix: remove plugins[1] (dynamic_sampling) from plugins:, or set bundle_size: 1" in message
    # without refill too (mode filter): a dropped group still leaves the estimator's batch
    with pytest.raises(ConfigError, match=r"plugins\[1\] \(dynamic_sampling\) filters rollouts"):
        check_args(RiskPO, {"bundle_size": 2}, others=[{"name": "dynamic_sampling", "mode": "filter"}],
                   per_device_train_batch_size=8, num_generations=4)
    # bundles of one group are the groups themselves: a filter cannot break them
    check_args(RiskPO, {"bundle_size": 1}, others=["dynamic_sampling"], per_device_train_batch_size=8,
               num_generations=4)


def test_check_args_lists_both_problems():
    with pytest.raises(ConfigError) as error:
        check_args(RiskPO, {"bundle_size": 3}, others=["dynamic_sampling"], per_device_train_batch_size=8,
                   num_generations=4)
    assert len(error.value.problems) == 2
    assert all(p.startswith("plugins[0] (riskpo): bundle_size: ") for p in error.value.problems)


@pytest.mark.parametrize("options, key", [({"alpha": 0.8, "beta": 0.2}, "alpha"), ({"bundle_size": 0}, "bundle_size"),
                                          ({"credit": "score"}, "credit"), ({"w_mix": 1.5}, "w_mix"),
                                          ({"beta": 1.0}, "beta")])
def test_bad_options(options, key):
    with pytest.raises(ConfigError, match=key):
        plugin_set(RiskPO, options)


def test_contract():
    check_plugin(RiskPO, {"bundle_size": 1})                        # the host's edge cases (1-3 groups)
    check_plugin(RiskPO, {"bundle_size": 1, "credit": "std", "track_quantiles": True})
    two = [f for f in edge_case_batches()[:3]] + [lambda: make_batch(VECTOR_REWARDS, 4)]
    for credit in ("uniform", "std", "sum-mean"):
        check_plugin(RiskPO, {"bundle_size": 2, "credit": credit, "natural_baseline_adv": True}, batches=two)


# ------------------------------------------------------------------------- quantile tracker
def enabled(**config):
    """A RiskPO instance registered as the host registers it (so that it can log metrics)."""
    return plugin_set(RiskPO, config).plugins[0].instance


def tracker_step(plugin, rewards, g=4):
    batch = make_batch(rewards, num_generations=g)
    return plugin.compute_advantages(batch), batch


def test_tracker_updates_and_leaves_advantages_alone():
    plugin = enabled(bundle_size=2, track_quantiles=True)
    assert plugin.state_dict()["tracked"] is None
    adv, batch = tracker_step(plugin, VECTOR_REWARDS)
    torch.testing.assert_close(adv, run(VECTOR_REWARDS).advantages)
    levels = torch.tensor(TRACKER_LEVELS)
    S = torch.tensor([2.0, 1.0, 1.0, 0.0])
    torch.testing.assert_close(plugin.tracked, torch.quantile(S, levels), **TIGHT)   # first batch: empirical
    assert batch.metrics["riskpo/tracked_q_lo"] == [pytest.approx(0.6, abs=1e-6)]     # level 0.2
    first = plugin.tracked.clone()
    tracker_step(plugin, [1, 1, 1, 0, 1, 1, 1, 1])                                   # S = [2, 2, 2, 1]
    below = (torch.tensor([2.0, 2.0, 2.0, 1.0]).unsqueeze(0) < first.unsqueeze(1)).float().mean(1)
    torch.testing.assert_close(plugin.tracked, first + 0.1 * (levels - below), **TIGHT)
    # hand value, level 0.05: q = 0.15, no score below it -> 0.15 + 0.1 * 0.05 = 0.155
    assert plugin.tracked[0].item() == pytest.approx(0.155, abs=1e-6)


def test_tracker_state_round_trip(tmp_path):
    batches = [VECTOR_REWARDS, [1, 1, 0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 0, 0, 0], [1] * 8]
    config = dict(bundle_size=2, track_quantiles=True, lr_q=0.3)
    a = enabled(**config)
    for rewards in batches[:2]:
        tracker_step(a, rewards)
    path = tmp_path / "state.pt"
    torch.save(a.state_dict(), path)                                 # as the host saves it
    b = enabled(**config)
    b.load_state_dict(torch.load(path, weights_only=True))
    assert torch.equal(b.tracked, a.tracked) and b.tracked is not a.tracked
    for rewards in batches[2:]:
        tracker_step(a, rewards)
        tracker_step(b, rewards)
    assert torch.equal(a.tracked, b.tracked)
    fresh = enabled(**config)
    fresh.load_state_dict(enabled(**config).state_dict())               # an untouched tracker stays empty
    assert fresh.tracked is None


def test_tracker_off_logs_no_tracked_metrics():
    result = run(VECTOR_REWARDS)
    assert "riskpo/tracked_q_lo" not in result.metrics
    assert result.plugin.tracked is None


# ------------------------------------------------------------------------- a real run
def test_training_run(tmp_path):
    calls = itertools.count()

    def alternating(completions, **kwargs):
        """Mixed rewards whatever the model writes, so the advantages are not all zero."""
        step = next(calls)
        return [float((i + step) % 3 == 0) for i in range(len(completions))]

    trainer = train_tiny([{"name": "riskpo", "bundle_size": 2, "track_quantiles": True}], output_dir=tmp_path,
                         reward_funcs=[answer_reward, alternating])
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert trainer.state.global_step == 2 and len(logs) == 2
    for entry in logs:
        assert math.isfinite(entry["loss"])
        assert "trl_credit/riskpo/seconds" in entry
        assert "trl_credit/riskpo/tracked_q_hi" in entry
    assert trainer.pipeline.state_dict()["riskpo"]["tracked"].shape == (19,)
