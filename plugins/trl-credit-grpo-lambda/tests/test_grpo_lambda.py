"""GRPO-lambda (reconstructed): the methods.md 2.12 vector, selection and tie-breaking, the Kimi length
reward, NaN and edge cases, the host contract and a short real run."""

from __future__ import annotations

import math
from typing import ClassVar

import pytest
import torch
from trl_credit_grpo_lambda import GrpoLambda, kimi_length_reward, select_groups

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
VECTOR = ([1, 1, 0, 1], [100, 300, 200, 500])         # methods.md 2.12: one selected group


def shaped(rewards, lengths, g=4, config=None, **kwargs):
    result = run_plugin(GrpoLambda, make_batch(rewards, g, lengths=lengths, **kwargs), config)
    return result.rewards, result.metrics


# ------------------------------------------------------------------------- the vector
def test_methods_vector():
    rewards, metrics = shaped(*VECTOR)
    assert rewards[:, 0].tolist() == [1.5, 1.0, 0.0, 0.5]            # len_reward [0.5, 0, 0, -0.5]
    assert metrics["grpo_lambda/selected_fraction"] == 1.0
    assert metrics["grpo_lambda/length_reward_mean"] == 0.0          # (0.5 + 0 + 0 - 0.5) / 4


def test_unselected_group_keeps_its_0_1_rewards():
    # group 0 (ratio 3/4) outranks group 1 (ratio 2/4); fraction 0.5 of 2 groups -> only group 0
    rewards, metrics = shaped(VECTOR[0] + [1, 0, 1, 0], VECTOR[1] + [10, 20, 30, 40])
    assert rewards[:, 0].tolist() == [1.5, 1.0, 0.0, 0.5, 1, 0, 1, 0]
    assert metrics["grpo_lambda/selected_fraction"] == 0.5
    # listed second, the better group is still the one selected
    rewards, _ = shaped([1, 0, 1, 0] + VECTOR[0], [10, 20, 30, 40] + VECTOR[1])
    assert rewards[:, 0].tolist() == [1, 0, 1, 0, 1.5, 1.0, 0.0, 0.5]


def test_equal_lengths_give_no_length_reward():
    rewards, metrics = shaped([1, 1, 0, 1], [7, 7, 7, 7])
    assert rewards[:, 0].tolist() == [1, 1, 0, 1]
    assert metrics["grpo_lambda/selected_fraction"] == 1.0


def test_groups_without_a_correct_answer_are_never_selected():
    rewards, metrics = shaped([0, 0, 0, 0, 1, 0, 0, 0], [1, 2, 3, 4, 1, 2, 3, 4], config={"fraction": 1.0})
    # group 1: lam = 0.5 - [0, 1/3, 2/3, 1] -> correct +0.5; wrong min(0, lam) = [0, -1/6, -1/2]
    torch.testing.assert_close(rewards[:, 0], torch.tensor([0, 0, 0, 0, 1.5, 0, -1 / 6, -0.5]))
    assert metrics["grpo_lambda/selected_fraction"] == 0.5


def test_ties_go_to_the_earlier_group_and_rounding_is_up():
    same = [1, 1, 0, 0]
    lengths = [1, 3, 1, 3]                                          # lam = [0.5, -0.5, 0.5, -0.5]
    rewards, _ = shaped(same * 3, lengths * 3, config={"fraction": 0.5})   # ceil(1.5) = 2 of 3 groups
    torch.testing.assert_close(rewards[:, 0], torch.tensor([1.5, 0.5, 0, -0.5] * 2 + [1, 1, 0, 0]))
    rewards, _ = shaped(same * 3, lengths * 3, config={"fraction": 0.3})   # ceil(0.9) = 1
    torch.testing.assert_close(rewards[:, 0], torch.tensor([1.5, 0.5, 0, -0.5] + [1, 1, 0, 0] * 2))
    rewards, metrics = shaped(same * 3, lengths * 3, config={"fraction": 0.0})
    assert rewards[:, 0].tolist() == [1, 1, 0, 0] * 3 and metrics["grpo_lambda/selected_fraction"] == 0.0
    ratio = torch.tensor([0.5, 1.0, 0.5, math.nan, 1.0, 0.0])
    assert select_groups(ratio, "top_fraction", 0.5, 0.0).tolist() == [True, True, False, False, True, False]
    assert select_groups(ratio, "top_fraction", 1.0, 0.0).tolist() == [True, True, True, False, True, False]


def test_threshold_selection():
    rewards = [1, 1, 1, 0, 1, 1, 0, 0, 1, 0, 0, 0]                 # ratios 0.75, 0.5, 0.25
    lengths = [1, 3, 1, 3] * 3
    out, metrics = shaped(rewards, lengths, config={"selection": "threshold", "ratio_threshold": 0.5})
    torch.testing.assert_close(out[:, 0], torch.tensor([1.5, 0.5, 1.5, -0.5, 1.5, 0.5, 0, -0.5, 1, 0, 0, 0]))
    assert metrics["grpo_lambda/selected_fraction"] == pytest.approx(2 / 3)
    none, _ = shaped([0] * 4, [1, 2, 3, 4], config={"selection": "threshold", "ratio_threshold": 0.0})
    assert none[:, 0].tolist() == [0, 0, 0, 0]                      # ratio 0 never selected


# ------------------------------------------------------------------------- the length reward
def test_length_reward_options():
    only, _ = shaped(*VECTOR, config={"length_reward": "kimi_correct_only"})
    assert only[:, 0].tolist() == [1.5, 1.0, 0.0, 0.5]              # the wrong one had lam 0.25 -> 0 either way
    wrong_long, _ = shaped([1, 0, 0, 1], [100, 500, 200, 300], config={"length_reward": "kimi_correct_only"})
    assert wrong_long[:, 0].tolist() == [1.5, 0.0, 0.0, 1.0]
    kimi, _ = shaped([1, 0, 0, 1], [100, 500, 200, 300])
    assert kimi[:, 0].tolist() == [1.5, -0.5, 0.0, 1.0]
    half, _ = shaped(*VECTOR, config={"length_weight": 0.5})
    assert half[:, 0].tolist() == [1.25, 1.0, 0.0, 0.75]


def test_kimi_length_reward_helper():
    correct = torch.tensor([[True, False, True], [True, True, False]])
    lengths = torch.tensor([[10, 20, 30], [5, 5, 9]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    out = kimi_length_reward(correct, lengths, valid)
    torch.testing.assert_close(out, torch.tensor([[0.5, 0.0, -0.5], [0.0, 0.0, 0.0]]))


def test_separate_output_column():
    result = run_plugin(GrpoLambda, make_batch(VECTOR[0], 4, lengths=VECTOR[1], reward_names=["accuracy"]),
                        {"output_column": "length_reward"})
    assert result.reward_names == ["accuracy", "length_reward"]
    assert result.rewards.tolist() == [[1, 0.5], [1, 0.0], [0, 0.0], [1, -0.5]]
    assert result.batch.total_reward().tolist() == [1.5, 1.0, 0.0, 0.5]
    # a row no reward function scored stays unscored: NaN in the new column too, so GRPO still gives it 0
    unscored = run_plugin(GrpoLambda, make_batch([1, None, 0, 1], 4, lengths=[100, 900, 200, 300],
                                                 reward_names=["accuracy"]), {"output_column": "length_reward"})
    assert math.isnan(unscored.rewards[1, 1]) and not unscored.batch.scorable[1] and unscored.advantages[1] == 0


# ------------------------------------------------------------------------- edge cases
def test_nan_rows():
    # the NaN row counts neither in the ratio (2/3) nor in L_min/L_max (100..300); it stays NaN
    rewards, _ = shaped([1, NAN, 0, 1], [100, 900, 200, 300])
    out = rewards[:, 0]
    assert math.isnan(out[1].item())
    torch.testing.assert_close(out[[0, 2, 3]], torch.tensor([1.5, 0.0, 0.5]))
    every, metrics = shaped([NAN] * 4 + [1, 0, 0, 0], [1, 2, 3, 4] * 2)
    assert torch.isnan(every[:4, 0]).all()
    # lam = [0.5, 1/6, -1/6, -0.5]: correct +0.5, wrong min(0, lam)
    torch.testing.assert_close(every[4:, 0], torch.tensor([1.5, 0.0, -1 / 6, -0.5]))
    assert metrics["grpo_lambda/selected_fraction"] == 0.5


def test_single_completion_groups_and_empty_completions():
    rewards, _ = shaped([1, 0, 1], [3, 5, 0], g=1, config={"fraction": 1.0})
    assert rewards[:, 0].tolist() == [1, 0, 1]                      # one length per group: no spread
    rewards, _ = shaped([1, 1, 0, 1], [0, 4, 2, 4])                  # L_min = 0 (empty completion)
    assert rewards[:, 0].tolist() == [1.5, 0.5, 0.0, 0.5]


def test_non_binary_column_keeps_its_value():
    rewards, _ = shaped([0.9, 0.6, 0.2, 0.7], VECTOR[1])            # correct: >= 0.5
    torch.testing.assert_close(rewards[:, 0], torch.tensor([1.4, 0.6, 0.2, 0.2]))
    strict, _ = shaped([0.9, 0.6, 0.2, 0.7], VECTOR[1], config={"correct_threshold": 0.8})
    # only the first is correct: lam = [0.5, 0, 0.25, -0.5] -> [+0.5, +0, +0, -0.5]
    torch.testing.assert_close(strict[:, 0], torch.tensor([1.4, 0.6, 0.2, 0.2]))


def test_column_selection_and_missing_column():
    two = make_batch([[0, 1], [0, 1], [0, 0], [0, 1]], 4, lengths=VECTOR[1], reward_names=["format", "accuracy"])
    result = run_plugin(GrpoLambda, two, {"column": "accuracy"})
    assert result.rewards.tolist() == [[0, 1.5], [0, 1.0], [0, 0.0], [0, 0.5]]
    with pytest.raises(ConfigError, match=r"\(grpo_lambda\).*reward column 'acc'.*\['accuracy'\]"):
        check_args(GrpoLambda, {"column": "acc"}, reward_names=["accuracy"])
    check_args(GrpoLambda, reward_names=["accuracy"])                      # the first column: nothing named
    with pytest.raises(PluginRuntimeError, match="no reward column 'acc'"):
        run_plugin(GrpoLambda, two, {"column": "acc"})
    for options, key in (({"fraction": 1.5}, "fraction"), ({"selection": "top"}, "selection"),
                         ({"lambda": 0.2}, "lambda")):
        with pytest.raises(ConfigError, match=key):
            plugin_set(GrpoLambda, options)


def test_contract():
    check_plugin(GrpoLambda)
    check_plugin(GrpoLambda, {"selection": "threshold", "output_column": "length_reward"})
    check_plugin(GrpoLambda, {"fraction": 1.0, "length_reward": "kimi_correct_only"},
                 batches=edge_case_batches() + [lambda: make_batch(*VECTOR[:1], 4, lengths=VECTOR[1])])


# ------------------------------------------------------------------------- a real run
def three_of_four(completions, **kwargs):
    """Deterministic correctness: completions 0, 1, 3 of every group of 4 are 'correct'."""
    return [0.0 if i % 4 == 2 else 1.0 for i in range(len(completions))]


class Observer:
    """Test plugin: records the shaped column and the completion lengths of every batch."""

    seen: ClassVar[list] = []

    @hookimpl
    def on_batch_end(self, batch, advantages):
        Observer.seen.append((batch.reward("three_of_four").clone(), batch.completion_lengths.clone()))


def test_training_run(tmp_path):
    Observer.seen.clear()
    trainer = train_tiny([{"name": "grpo_lambda", "column": "three_of_four"}, Observer], output_dir=tmp_path,
                         reward_funcs=[answer_reward, three_of_four])
    assert trainer.state.global_step == 2
    logs = [entry for entry in trainer.state.log_history if "trl_credit/grpo_lambda/selected_fraction" in entry]
    assert len(logs) == 2
    for entry in logs:
        assert entry["trl_credit/grpo_lambda/selected_fraction"] == 0.5    # 2 groups of ratio 3/4: the first
        assert math.isfinite(entry["loss"])
    assert len(Observer.seen) == 2
    for values, lengths in Observer.seen:                              # recompute the first group by hand
        g0 = lengths[:4].float()
        spread = g0.max() - g0.min()
        lam = 0.5 - (g0 - g0.min()) / spread if spread > 0 else torch.zeros(4)
        correct = torch.tensor([True, True, False, True])
        expected = correct.float() + torch.where(correct, lam, lam.clamp(max=0.0))
        torch.testing.assert_close(values[:4], expected)
        assert values[4:].tolist() == [1.0, 1.0, 0.0, 1.0]
