"""G-RA: methods.md 2.14 vectors, replace/append, gate edge cases, config errors, contract, a real run."""

from __future__ import annotations

import math

import pytest
import torch
from trl_credit_g_ra import GatedRewardAccumulation, gated_accumulation

from trl_credit import ConfigError, grpo_advantages
from trl_credit.testing import answer_reward, check_args, check_plugin, make_batch, plugin_set, run_plugin, train_tiny

NAN = None
SCORER = "test_g_ra:text_scores"


def text_scores(prompts, completions, steps, columns):
    """Test scorer: a step written ``s=0.2 ...`` scores 0.2."""
    return [[float(step.split()[0][2:]) for step in row] for row in steps]


def fixed_step_scores(prompts, completions, steps, columns):
    """Test scorer for the training run: every step scores 0.25."""
    return [[0.25] * len(row) for row in steps]


def batch_of(rewards, texts, num_generations=2, **kwargs):
    kwargs.setdefault("reward_names", ["arithmetic_accuracy"])
    return make_batch(rewards, num_generations, completions=texts, **kwargs)


# ------------------------------------------------------------------------- methods.md 2.14 vectors
def test_vectors():
    assert gated_accumulation([1.0], [0.2 + 0.3], tau=1.0).tolist() == pytest.approx([0.5])
    result = run_plugin(GatedRewardAccumulation, batch_of([1.0, 0.0], ["s=0.2 a\ns=0.3 b"] * 2), {"scorer": SCORER})
    torch.testing.assert_close(result.rewards[:, 0], torch.tensor([1.5, 0.0]), rtol=0, atol=1e-7)
    assert result.reward_names == ["arithmetic_accuracy"]
    assert result.metrics["g_ra/gate_open"] == 0.5
    assert result.metrics["g_ra/step_reward"] == pytest.approx(0.5)
    assert result.metrics["g_ra/gated_bonus"] == pytest.approx(0.25)
    # the shaped column feeds the estimator: GRPO on [1.5, 0]
    expected = grpo_advantages(torch.tensor([[1.5], [0.0]]), torch.tensor([1.0]), 2, "group", "sum_then_normalize")
    torch.testing.assert_close(result.advantages, expected)


def test_arithmetic_checker_default_and_mean():
    texts = ["12 + 7 = 19\nThen 19 * 2 = 38\nSo 38", "2 + 2 = 5\n5 - 1 = 4", "3 * 3 = 9", "3 * 3 = 9"]
    result = run_plugin(GatedRewardAccumulation, batch_of([1.0, 1.0, 0.0, 0.5], texts))
    # steps [1, 1, 0] -> 2; [0, 1] -> 1; gate closed for 0 and 0.5 (tau 1)
    torch.testing.assert_close(result.rewards[:, 0], torch.tensor([3.0, 2.0, 0.0, 0.5]))
    result = run_plugin(GatedRewardAccumulation, batch_of([1.0, 1.0, 0.0, 0.5], texts),
                        {"accumulate": "mean", "tau": 0.5, "process_weight": 2.0})
    torch.testing.assert_close(result.rewards[:, 0], torch.tensor([1.0 + 2 * 2 / 3, 2.0, 0.0, 2.5]))


def test_append_column():
    batch = batch_of([[1.0, 0.3], [0.0, 0.1]], ["s=0.2 a\ns=0.3 b"] * 2,
                     reward_names=["arithmetic_accuracy", "format"], reward_weights=[2.0, 1.0])
    result = run_plugin(GatedRewardAccumulation, batch, {"scorer": SCORER, "append_column": "g_ra_steps"})
    assert result.reward_names == ["arithmetic_accuracy", "format", "g_ra_steps"]
    torch.testing.assert_close(result.rewards, torch.tensor([[1.0, 0.3, 0.5], [0.0, 0.1, 0.0]]))
    assert batch.reward_weights.tolist() == [2.0, 1.0, 1.0]
    # replace mode keeps the outcome column's weight
    batch = batch_of([[1.0, 0.3], [0.0, 0.1]], ["s=0.2 a\ns=0.3 b"] * 2,
                     reward_names=["arithmetic_accuracy", "format"], reward_weights=[2.0, 1.0])
    result = run_plugin(GatedRewardAccumulation, batch, {"scorer": SCORER})
    torch.testing.assert_close(result.rewards, torch.tensor([[1.5, 0.3], [0.0, 0.1]]))
    assert batch.reward_weights.tolist() == [2.0, 1.0]


# ------------------------------------------------------------------------- edge cases
def test_nan_outcome_stays_nan_and_never_opens_the_gate():
    texts = ["s=0.2 a", "s=0.9 b", "s=0.5 c", "s=0.5 d"]
    result = run_plugin(GatedRewardAccumulation, batch_of([NAN, 1.0, NAN, NAN], texts), {"scorer": SCORER})
    r = result.rewards[:, 0]
    assert math.isnan(r[0]) and r[1].item() == pytest.approx(1.9) and torch.isnan(r[2:]).all()
    assert torch.isfinite(result.advantages).all() and (result.advantages[2:] == 0).all()
    appended = run_plugin(GatedRewardAccumulation, batch_of([NAN, 1.0, NAN, NAN], texts),
                          {"scorer": SCORER, "append_column": "bonus"})
    torch.testing.assert_close(appended.rewards[:, 1], torch.tensor([0.0, 0.9, 0.0, 0.0]))  # no NaN in a new column


def test_no_steps_and_constant_groups():
    result = run_plugin(GatedRewardAccumulation, batch_of([1.0, 1.0, 0.0, 0.0], ["", "  \n\n", "s=0.5 x", ""]),
                        {"scorer": SCORER})
    torch.testing.assert_close(result.rewards[:, 0], torch.tensor([1.0, 1.0, 0.0, 0.0]))
    assert torch.equal(result.advantages, torch.zeros(4))
    # a constant-outcome group becomes informative through the gated step rewards
    result = run_plugin(GatedRewardAccumulation, batch_of([1.0, 1.0], ["s=0.1 a", "s=0.9 b"]), {"scorer": SCORER})
    assert result.advantages[1] > 0 > result.advantages[0]


def test_single_completion_per_group_and_negative_scores():
    result = run_plugin(GatedRewardAccumulation, batch_of([1.0, 0.0, 1.0], ["s=-0.4 a\ns=0.1 b", "s=1 c", ""], 1),
                        {"scorer": SCORER, "tau": 0.5})
    torch.testing.assert_close(result.rewards[:, 0], torch.tensor([0.7, 0.0, 1.0]))
    assert torch.equal(result.advantages, torch.zeros(3))


GRPO_ARGS = {"per_device_train_batch_size": 8, "num_generations": 4}


def test_missing_outcome_column_is_a_config_error():
    with pytest.raises(ConfigError, match=r"plugins\[0\] \(g_ra\).*'accuracy'"):
        check_args("g_ra", {"outcome": "accuracy"}, reward_names=["arithmetic_accuracy"], **GRPO_ARGS)
    check_args("g_ra", reward_names=["arithmetic_accuracy"], **GRPO_ARGS)              # default column: fine
    assert GatedRewardAccumulation().required_rewards() == ["arithmetic_accuracy"]


def test_check_args_scorer_kwargs_the_scorer_does_not_take():
    with pytest.raises(ConfigError) as info:
        check_args(GatedRewardAccumulation, {"outcome": "answer_reward", "scorer_kwargs": {"neutrall": 0.5}},
                   reward_names=["answer_reward"], **GRPO_ARGS)
    message = str(info.value)
    assert "plugins[0] (g_ra): scorer_kwargs:" in message and "'neutrall'" in message
    assert "fix: pass only keyword options the scorer takes" in message and "neutral=0.0" in message
    # the positional arguments are the host's: an option may not take their place either
    with pytest.raises(ConfigError, match=r"\(g_ra\): scorer_kwargs: .*'steps'.*fix: pass only keyword options"):
        check_args(GatedRewardAccumulation, {"scorer": SCORER, "scorer_kwargs": {"steps": []}},
                   reward_names=["arithmetic_accuracy"], **GRPO_ARGS)
    check_args(GatedRewardAccumulation, {"scorer_kwargs": {"neutral": 0.5}}, reward_names=["arithmetic_accuracy"],
               **GRPO_ARGS)
    check_args(GatedRewardAccumulation, {"scorer": "test_g_ra:any_options", "scorer_kwargs": {"x": 1}},
               reward_names=["arithmetic_accuracy"], **GRPO_ARGS)                  # **options take anything


def any_options(prompts, completions, steps, columns, **options):
    return [[0.0] * len(row) for row in steps]


def test_check_args_append_column_that_a_reward_function_produces():
    options = {"outcome": "answer_reward", "append_column": "format_reward"}
    with pytest.raises(ConfigError) as info:
        check_args(GatedRewardAccumulation, options, reward_names=["answer_reward", "format_reward"], **GRPO_ARGS)
    message = str(info.value)
    assert "plugins[0] (g_ra): append_column: 'format_reward' is already a reward column" in message
    assert "fix: name a new column, or omit append_column" in message
    check_args(GatedRewardAccumulation, options, reward_names=["answer_reward"], **GRPO_ARGS)


def test_config_errors():
    with pytest.raises(ConfigError, match=r"scorer.*unknown step scorer 'prm'"):
        plugin_set(GatedRewardAccumulation, {"scorer": "prm"})
    with pytest.raises(ConfigError, match="pattern.*not a valid regex"):
        plugin_set(GatedRewardAccumulation, {"pattern": "[oops"})
    with pytest.raises(ConfigError, match="append_column must differ"):
        plugin_set(GatedRewardAccumulation, {"append_column": "arithmetic_accuracy"})
    with pytest.raises(ConfigError, match="accumulate"):
        plugin_set(GatedRewardAccumulation, {"accumulate": "max"})
    with pytest.raises(ConfigError, match="gate"):
        plugin_set(GatedRewardAccumulation, {"gate": 1.0})


def edge_batches():
    texts = ["1 + 1 = 2\n2 + 2 = 4", "3 * 3 = 10", "", "hmm\n4 - 1 = 3"] * 2
    return [
        lambda: batch_of([1, 0, 1, 0, 1, 1, 0, 0], texts, 4),
        lambda: batch_of([1, 1, 1, 1, 0, 0, 0, 0], texts, 4),                  # constant groups
        lambda: batch_of([1, NAN, 0, 1, NAN, NAN, NAN, NAN], texts, 4),        # NaN rewards
        lambda: batch_of([1, 0, 1], texts[:3], 1),                             # one completion per group
        lambda: batch_of([[1, 0.5], [0, 0.2]], texts[:2], 2, reward_names=["arithmetic_accuracy", "fmt"]),
    ]


def test_contract():
    check_plugin(GatedRewardAccumulation, {"outcome": "accuracy"})            # the kit's edge cases
    check_plugin(GatedRewardAccumulation, batches=edge_batches())
    check_plugin(GatedRewardAccumulation, {"append_column": "g_ra", "accumulate": "mean"}, batches=edge_batches())


# ------------------------------------------------------------------------- a real run
def test_training_run(tmp_path):
    # tau = 0 opens the gate for every completion (answer_reward >= 0), so every step adds 0.25
    plugin = {"name": "g_ra", "outcome": "answer_reward", "tau": 0.0, "scorer": "test_g_ra:fixed_step_scores"}
    trainer = train_tiny([plugin], output_dir=tmp_path, reward_funcs=[answer_reward])
    assert trainer.state.global_step == 2
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2
    for entry in logs:
        assert math.isfinite(entry["loss"])
        assert entry["trl_credit/g_ra/gate_open"] == 1.0
        assert entry["trl_credit/g_ra/gated_bonus"] == pytest.approx(entry["trl_credit/g_ra/step_reward"])
        assert entry["trl_credit/g_ra/gated_bonus"] > 0                  # the outcome column was raised
