"""FG-ExPO: the GCS test vector, AKL values by hand, the contract, and real training runs."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from trl_credit_fg_expo import FGExPO, akl_beta, gcs_weights

from trl_credit import ConfigError, PromptStats, hookimpl
from trl_credit.testing import (
    check_args,
    check_plugin,
    edge_case_batches,
    load_plugin,
    make_batch,
    plugin_set,
    run_curriculum,
    run_plugin,
    train_tiny,
)

RUN = dict(per_device_train_batch_size=8, num_generations=4)   # the GRPOConfig of the check_args tests


def enabled(config=None) -> FGExPO:
    """An FGExPO instance registered as the host registers it (so that it can log metrics)."""
    return plugin_set(FGExPO, config).plugins[0].instance


def stats_of(seen, passed) -> PromptStats:
    stats = PromptStats.empty(len(seen))
    stats.seen.copy_(torch.tensor(seen, dtype=torch.float64))
    stats.passed.copy_(torch.tensor(passed, dtype=torch.float64))
    return stats


# ------------------------------------------------------------------------- GCS
GCS_VECTOR = [0.043937, 0.457833, 1.0, 0.457833, 0.043937]  # methods.md §2.17, σ = 0.2, p̂ = 0, .25, .5, .75, 1


def test_gcs_vector_raw_accuracy():
    stats = stats_of([4] * 5, [0, 1, 2, 3, 4])                       # raw p̂ = 0, .25, .5, .75, 1
    plugin = FGExPO(FGExPO.Config(sigma=0.2, estimator="raw"))
    w = plugin.prompt_weights(stats, 0)
    torch.testing.assert_close(w, torch.tensor(GCS_VECTOR, dtype=torch.float64), rtol=0, atol=1e-6)
    # the host normalises
    normalised = run_curriculum(FGExPO, stats, {"sigma": 0.2, "estimator": "raw"})
    expected = torch.tensor(GCS_VECTOR, dtype=torch.float64) / sum(GCS_VECTOR)
    torch.testing.assert_close(normalised, expected, rtol=0, atol=1e-6)


def test_gcs_formula_direct():
    w = gcs_weights(torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0], dtype=torch.float64), mu=0.5, sigma=0.2)
    torch.testing.assert_close(w, torch.tensor(GCS_VECTOR, dtype=torch.float64), rtol=0, atol=1e-6)
    # off-centre μ: p̂ = 0.3 is the peak, p̂ = 0.7 is 2σ away -> exp(-2)
    w = gcs_weights(torch.tensor([0.3, 0.7], dtype=torch.float64), mu=0.3, sigma=0.2)
    torch.testing.assert_close(w, torch.tensor([1.0, math.exp(-2.0)], dtype=torch.float64), rtol=0, atol=1e-12)


def test_gcs_posterior_default_and_unseen():
    # default: Beta(1, 1) posterior mean p̂ = (passed + 1) / (seen + 2) = 1/6, 2/6, 3/6, 4/6, 5/6, and 1/2 unseen
    stats = stats_of([4, 4, 4, 4, 4, 0], [0, 1, 2, 3, 4, 0])
    w = FGExPO().prompt_weights(stats, 0)
    expected = [0.249352, 0.706648, 1.0, 0.706648, 0.249352, 1.0]
    torch.testing.assert_close(w, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-6)
    # raw: unseen prompts sit at the prior mean α / (α + β); Beta(1, 3) -> 0.25 -> 0.457833
    raw = FGExPO(FGExPO.Config(estimator="raw", prior_alpha=1.0, prior_beta=3.0)).prompt_weights(stats, 0)
    assert raw[5].item() == pytest.approx(0.457833, abs=1e-6)
    assert raw[2].item() == pytest.approx(1.0, abs=1e-12)                     # seen prompts: raw pass rate
    # every prompt unseen: uniform
    fresh = run_curriculum(FGExPO, PromptStats.empty(4))
    torch.testing.assert_close(fresh, torch.full((4,), 0.25, dtype=torch.float64), rtol=0, atol=1e-12)


def test_gcs_floor_keeps_far_prompts():
    stats = stats_of([10, 10], [0, 5])                                        # raw p̂ = 0, 0.5
    narrow = {"sigma": 0.05, "estimator": "raw"}                              # exp(-50) ~ 2e-22
    w = FGExPO(FGExPO.Config(**narrow)).prompt_weights(stats, 0)
    torch.testing.assert_close(w, torch.tensor([0.01, 1.0], dtype=torch.float64), rtol=0, atol=1e-12)
    bare = FGExPO(FGExPO.Config(floor=0.0, **narrow)).prompt_weights(stats, 0)
    assert bare[0].item() == pytest.approx(math.exp(-50.0), rel=1e-9)
    # with σ = 0.2 the default floor (0.01) is below every weight on [0, 1]: the formula is untouched
    assert FGExPO.Config().floor < gcs_weights(torch.tensor([0.0]), 0.5, 0.2).item()


def test_gcs_off_returns_none():
    stats = stats_of([4, 4], [0, 2])
    assert FGExPO(FGExPO.Config(gcs=False)).prompt_weights(stats, 3) is None
    assert run_curriculum(FGExPO, stats, {"gcs": False}) is None


# ------------------------------------------------------------------------- AKL
def binary_batch(passes: int, n: int = 8):
    return make_batch([1.0] * passes + [0.0] * (n - passes), 4, reward_names=["accuracy"])


# defaults β_min = 0, β_max = 0.04, k = 10, c = 0.5: β = 0.04 / (1 + exp(-10 (acc - 0.5))), by hand
AKL_DEFAULT = {0: 0.000267714, 2: 0.003034327, 4: 0.02, 6: 0.036965673, 8: 0.039732286}


@pytest.mark.parametrize("passes", sorted(AKL_DEFAULT))
def test_akl_default_values(passes):
    result = run_plugin(FGExPO, binary_batch(passes))
    assert result.beta == pytest.approx(AKL_DEFAULT[passes], abs=1e-9)
    assert result.metrics["fg_expo/accuracy"] == pytest.approx(passes / 8)
    assert result.metrics["fg_expo/beta"] == pytest.approx(AKL_DEFAULT[passes], abs=1e-9)


def test_akl_custom_constants():
    # β_min = 0.01, β_max = 0.1, k = 4, c = 0.6, acc = 0.25: 0.01 + 0.09 * sigmoid(-1.4) = 0.027803450
    config = {"beta_min": 0.01, "beta_max": 0.1, "k": 4.0, "c": 0.6}
    assert run_plugin(FGExPO, binary_batch(2), config).beta == pytest.approx(0.027803450, abs=1e-9)
    assert akl_beta(0.25, 0.01, 0.1, 4.0, 0.6) == pytest.approx(0.027803450, abs=1e-9)


def test_akl_monotone_and_bounded():
    grid = [i / 100 for i in range(101)]
    betas = [akl_beta(a, 0.0, 0.04, 10.0, 0.5) for a in grid]
    assert all(b2 > b1 for b1, b2 in itertools.pairwise(betas))                   # strictly increasing
    assert 0.0 < betas[0] < 0.001 and 0.039 < betas[-1] < 0.04
    # extreme steepness does not overflow
    assert akl_beta(0.0, 0.0, 0.04, 1e6, 0.5) == 0.0
    assert akl_beta(1.0, 0.0, 0.04, 1e6, 0.5) == pytest.approx(0.04)
    # on batches too: more correct completions -> larger β
    batch_betas = [run_plugin(FGExPO, binary_batch(p)).beta for p in range(9)]
    assert all(b2 > b1 for b1, b2 in itertools.pairwise(batch_betas))


def test_akl_counts_kept_finite_completions_only():
    plugin = enabled()
    batch = make_batch([1, 1, 1, 1, 0, 0, 1, None], 4, reward_names=["accuracy"])
    assert plugin.batch_accuracy(batch) == pytest.approx(5 / 7)               # NaN row not counted
    batch.kept = torch.tensor([False] * 4 + [True] * 4)
    assert plugin.batch_accuracy(batch) == pytest.approx(1 / 3)               # first group dropped
    assert plugin.kl_coefficient(batch) == pytest.approx(akl_beta(1 / 3, 0.0, 0.04, 10.0, 0.5), abs=1e-12)


def test_akl_through_a_filter():
    class DropFirstGroup(FGExPO):
        """FG-ExPO with a test filter that drops group 0 (the host runs filters before kl_coefficient)."""

        name = "fg_expo"

        @hookimpl
        def filter_rollouts(self, batch):
            return torch.arange(batch.num_groups) > 0

    result = run_plugin(DropFirstGroup, make_batch([1, 1, 1, 1, 1, 0, 0, 0], 4, reward_names=["accuracy"]))
    assert result.keep.tolist() == [False] * 4 + [True] * 4
    assert result.metrics["fg_expo/accuracy"] == pytest.approx(0.25)          # group 1 only: 1 of 4
    assert result.beta == pytest.approx(AKL_DEFAULT[2], abs=1e-9)


def test_akl_reward_column_and_threshold():
    rewards = [[0.9, 0.0], [0.6, 1.0], [0.3, 1.0], [0.0, 1.0]]                 # columns: score, format

    def batch():
        return make_batch(rewards, 4, reward_names=["score", "format"])

    # weighted total 0.9, 1.6, 1.3, 1.0 -> all >= 0.5
    assert run_plugin(FGExPO, batch()).metrics["fg_expo/accuracy"] == pytest.approx(1.0)
    # score column only, >= 0.5 -> 2 of 4
    result = run_plugin(FGExPO, batch(), {"accuracy_reward": "score"})
    assert result.metrics["fg_expo/accuracy"] == pytest.approx(0.5)
    assert result.beta == pytest.approx(0.02, abs=1e-12)
    # score column, >= 0.8 -> 1 of 4
    result = run_plugin(FGExPO, batch(), {"accuracy_reward": "score", "pass_threshold": 0.8})
    assert result.metrics["fg_expo/accuracy"] == pytest.approx(0.25)


def test_akl_no_countable_completion_reuses_last_accuracy():
    plugin = enabled()
    nan_batch = make_batch([None] * 4, 4, reward_names=["accuracy"])
    assert plugin.kl_coefficient(nan_batch) == pytest.approx(0.02, abs=1e-12)  # c = 0.5 before any batch
    plugin.kl_coefficient(binary_batch(8))
    assert plugin.kl_coefficient(make_batch([None] * 4, 4, reward_names=["accuracy"])) == \
        pytest.approx(AKL_DEFAULT[8], abs=1e-9)
    # the last accuracy survives a checkpoint
    restored = enabled()
    restored.load_state_dict(plugin.state_dict())
    assert restored.last_accuracy == 1.0


def test_parts_switched_off_are_absent_for_the_host():
    assert plugin_set(FGExPO, {"akl": False}).plugins[0].hooks == ["prompt_weights", "on_batch_end"]
    assert "prompt_weights" not in plugin_set(FGExPO, {"gcs": False}).plugins[0].hooks
    check_args(FGExPO, {"akl": False}, peft=False, beta=0.0, **RUN)                  # GCS only: no reference


def test_check_args_akl_needs_a_reference_model():
    """AKL sets the KL coefficient: with beta = 0 and no PEFT adapter TRL keeps no reference to score."""
    with pytest.raises(ConfigError) as error:
        check_args(FGExPO, peft=False, beta=0.0, **RUN)
    message = str(error.value)
    assert "plugins[0] (fg_expo) sets the KL coefficient, but this run has no reference model" in message
    assert "set `beta` > 0 in the config" in message and "(`use_peft: true`" in message
    with pytest.raises(ConfigError, match=r"\(fg_expo\) sets the KL coefficient"):
        check_args(FGExPO, {"gcs": False, "beta_max": 0.1}, peft=False, beta=0.0, **RUN)   # AKL alone: the same
    check_args(FGExPO, peft=True, beta=0.0, **RUN)                                 # the base model is the reference
    check_args(FGExPO, peft=False, beta=0.04, **RUN)                               # TRL keeps a reference copy


def test_akl_off_returns_none():
    result = run_plugin(FGExPO, binary_batch(3), {"akl": False})
    assert result.beta is None
    assert "fg_expo/beta" not in result.metrics
    assert torch.equal(result.advantages, run_plugin(FGExPO, binary_batch(3)).advantages)  # GRPO's, untouched


# ------------------------------------------------------------------------- config and contract
def test_config_errors_name_plugin_and_option():
    with pytest.raises(ConfigError, match=r"fg_expo.*beta_max"):
        plugin_set(FGExPO, {"beta_min": 0.05, "beta_max": 0.01}, name="fg_expo")
    with pytest.raises(ConfigError, match=r"option 'sigmaa'"):
        plugin_set(FGExPO, {"sigmaa": 0.1}, name="fg_expo")
    with pytest.raises(ConfigError, match=r"option 'sigma'"):
        plugin_set(FGExPO, {"sigma": 0.0}, name="fg_expo")


def test_missing_reward_column_is_named():
    with pytest.raises(ConfigError, match=r"plugins\[0\] \(fg_expo\): needs reward column 'correct'"):
        check_args(FGExPO, {"accuracy_reward": "correct"}, reward_names=["length_reward"], **RUN)
    check_args(FGExPO, {"accuracy_reward": "correct"}, reward_names=["correct"], **RUN)
    # AKL off: the column is not needed
    check_args(FGExPO, {"accuracy_reward": "correct", "akl": False}, reward_names=["x"], **RUN)


def test_entry_point_is_installed():
    assert load_plugin("fg_expo") is FGExPO


@pytest.mark.parametrize("config", [None, {"akl": False}, {"gcs": False}, {"estimator": "raw", "sigma": 0.1},
                                    {"accuracy_reward": "accuracy", "pass_threshold": 0.75}])
def test_check_plugin(config):
    check_plugin(FGExPO, config, batches=edge_case_batches())


def test_gcs_logs_effective_fraction():
    plugin = enabled()
    plugin.prompt_weights(stats_of([4, 4, 0], [4, 2, 0]), 0)                  # p̂ = 5/6, 1/2, 1/2 (unseen)
    w = torch.tensor([0.24935220877729616, 1.0, 1.0])
    expected = (w.sum() ** 2 / (w ** 2).sum() / 3).item()
    batch = binary_batch(4)
    plugin.on_batch_end(batch)
    assert batch.metrics["fg_expo/gcs_effective_fraction"] == [pytest.approx(expected, rel=1e-6)]


# ------------------------------------------------------------------------- real runs
def _staged_dataset(per_level: int):
    """``per_level`` questions "What is a + b?" per difficulty 1, 2, 3 (digits of a + b), in that order."""
    from datasets import Dataset

    pairs = {1: [(1, 2), (3, 4), (2, 5)], 2: [(10, 20), (30, 15), (12, 13)], 3: [(100, 200), (300, 150), (120, 130)]}
    rows = [(a, b) for level in (1, 2, 3) for a, b in pairs[level][:per_level]]
    ds = Dataset.from_dict({
        "prompt": [[{"role": "user", "content": f"What is {a} + {b}? Answer with just the number."}] for a, b in rows],
        "answer": [str(a + b) for a, b in rows],
        "difficulty": [len(str(a + b)) for a, b in rows],
    })
    assert ds["difficulty"] == [level for level in (1, 2, 3) for _ in range(per_level)]
    return ds


def _staged_reward(log: list):
    """Deterministic stand-in for a model that masters difficulty 1, is at 50 % on 2 and fails 3.

    The random tiny model solves nothing, so the reward ignores the completion text: 1 for a
    difficulty-1 row, 0 for a difficulty-3 row, and for a difficulty-2 row 1 when the completion's
    position in the reward call is even (every group holds consecutive positions, G even: exactly half
    of each group passes). Each call appends the difficulties it scored to ``log``.
    """
    def staged_reward(completions, difficulty, **kwargs):
        log.append(list(difficulty))
        return [1.0 if d == 1 else 0.0 if d == 3 else float(i % 2 == 0) for i, d in enumerate(difficulty)]

    return staged_reward


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM")


def test_training_run_both_parts_with_peft_scores_reference(tmp_path):
    """beta = 0 in the config, so TRL keeps no reference: the host scores it with adapters disabled.

    LoRA starts with B = 0, so at step 1 the policy is the base model and KL = 0 exactly; a large
    learning rate moves the adapter, so at step 2 KL > 0 and the loss is β_t · KL (the policy term
    vanishes: ratio 1, zero-mean advantages per group, equal lengths).
    """
    from trl_credit.testing import train_tiny

    log: list = []
    trainer = train_tiny([{"name": "fg_expo"}], output_dir=tmp_path, reward_funcs=[_staged_reward(log)],
                         dataset=_staged_dataset(2), peft_config=_lora(), train=False, max_completion_length=4,
                         beta=0.0, learning_rate=0.05)
    assert trainer.ref_model is None and trainer.beta == 0.0
    trainer.train()
    assert trainer.state.global_step == 2
    assert trainer.beta == 0.0                                               # restored after every loss
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2
    for entry, drawn in zip(logs, log):
        acc = sum(1.0 if d == 1 else 0.0 if d == 3 else float(i % 2 == 0) for i, d in enumerate(drawn)) / len(drawn)
        assert entry["trl_credit/fg_expo/accuracy"] == pytest.approx(acc)
        assert entry["trl_credit/beta"] == pytest.approx(akl_beta(acc, 0.0, 0.04, 10.0, 0.5), rel=1e-6)
        assert entry["trl_credit/fg_expo/beta"] == pytest.approx(entry["trl_credit/beta"])
        assert "kl" in entry and math.isfinite(entry["kl"]) and entry["kl"] >= 0.0   # TRL's KL metric: β_t > 0 was used
        assert 0.0 < entry["trl_credit/fg_expo/gcs_effective_fraction"] <= 1.0
        assert math.isfinite(entry["loss"])
    assert logs[0]["kl"] == pytest.approx(0.0, abs=1e-9)                     # reference = base model = policy
    assert logs[1]["kl"] > 1e-5                                              # the adapter moved away from it
    assert logs[1]["loss"] == pytest.approx(logs[1]["trl_credit/beta"] * logs[1]["kl"], rel=1e-3)


def test_training_without_reference_fails_early(tmp_path):
    with pytest.raises(ConfigError, match=r"plugins\[0\] \(fg_expo\) sets the KL coefficient"):
        train_tiny([{"name": "fg_expo"}], output_dir=tmp_path, reward_funcs=[_staged_reward([])],
                   dataset=_staged_dataset(2), beta=0.0, train=False)


def test_gcs_draws_frontier_prompts_more_often(tmp_path):
    """GCS moves the draws towards the ~50 % prompts, against TRL's uniform sampler with the same seed.

    6 prompts (2 per difficulty), 2 prompts of G = 2 completions per step, 8 steps. The stand-in reward (see
    `_staged_reward`) makes difficulty 1 always pass, difficulty 2 pass half the time and
    difficulty 3 never. The first 3 steps are warm-up (GCS prefers unseen prompts, at the prior
    0.5); over the last 5 steps uniform sampling draws difficulty 2 about a third of the time, GCS
    (raw accuracy: 1, 0.5 and 0 give weights 0.044, 1, 0.044) most of the time. The AKL part is off
    (switched off through disabled_hooks), so the run needs no reference model and no adapter.
    """
    steps, warmup = 8, 3

    def drawn_levels(plugins):
        log: list = []
        trainer = train_tiny(plugins, output_dir=tmp_path, reward_funcs=[_staged_reward(log)],
                             dataset=_staged_dataset(2), max_steps=steps, logging_steps=steps,
                             per_device_train_batch_size=4, num_generations=2, max_completion_length=4)
        assert trainer.state.global_step == steps and len(log) == steps
        return [call[::2] for call in log]                                   # one entry per prompt (G = 2)

    gcs = drawn_levels([{"name": "fg_expo", "akl": False, "estimator": "raw"}])
    uniform = drawn_levels(None)

    def frontier_share(levels):
        after = [d for call in levels[warmup:] for d in call]
        return sum(d == 2 for d in after) / len(after)

    assert sorted(d for call in uniform[:3] for d in call) == [1, 1, 2, 2, 3, 3]  # one uniform epoch
    assert frontier_share(uniform) <= 0.5
    assert frontier_share(gcs) >= 0.8
    assert frontier_share(gcs) >= 2 * frontier_share(uniform)
