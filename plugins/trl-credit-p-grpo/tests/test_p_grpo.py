"""P-GRPO: methods.md 2.7 vector, gating, NaN handling, weights, config errors, contract and a real run."""

from __future__ import annotations

import math

import pytest
import torch
from trl_credit_p_grpo import PosteriorGRPO, gated_process_reward

from trl_credit import ConfigError, PluginRuntimeError, completion_text, grpo_advantages, hookimpl
from trl_credit.testing import check_args, check_plugin, make_batch, plugin_set, run_plugin, train_tiny

NAN = None  # make_batch turns None into NaN
TIGHT = {"rtol": 1e-6, "atol": 1e-6}
NAMES = ["accuracy_reward", "process_reward"]


def batch(outcome, process, G=4, **kwargs):
    return make_batch([[o, p] for o, p in zip(outcome, process)], G, reward_names=NAMES, **kwargs)


# ------------------------------------------------------------------------- methods.md 2.7
def test_vector():
    result = run_plugin(PosteriorGRPO, batch([1, 1, 0, 0], [0.9, 0.2, 0.8, 0.1]))
    torch.testing.assert_close(result.batch.total_reward(), torch.tensor([1.9, 1.2, 0.0, 0.0]), **TIGHT)
    # the process column holds the gated term, the outcome column is untouched
    torch.testing.assert_close(result.rewards[:, 1], torch.tensor([0.9, 0.2, 0.0, 0.0]), **TIGHT)
    torch.testing.assert_close(result.rewards[:, 0], torch.tensor([1.0, 1.0, 0.0, 0.0]), **TIGHT)
    assert result.reward_names == NAMES
    assert result.metrics["p_grpo/gate_rate"] == 0.5
    assert result.metrics["p_grpo/process_term_mean"] == pytest.approx(0.275)
    # advantages: GRPO on the shaped total [1.9, 1.2, 0, 0]
    r = torch.tensor([1.9, 1.2, 0.0, 0.0])
    torch.testing.assert_close(result.advantages, (r - r.mean()) / (r.std() + 1e-4), rtol=1e-5, atol=1e-5)


def test_equals_paper_formula_on_random_binary_outcomes():
    g = torch.Generator().manual_seed(0)
    out = (torch.rand(64, generator=g) < 0.5).float()
    proc = torch.rand(64, generator=g)
    fmt = (torch.rand(64, generator=g) < 0.7).float()
    w = 0.7
    b = make_batch(torch.stack([fmt, out, proc], 1), 8, reward_names=["format_reward", *NAMES])
    result = run_plugin(PosteriorGRPO, b, {"format_reward": "format_reward", "weight": w})
    torch.testing.assert_close(result.batch.total_reward(), fmt + out + out * w * proc, **TIGHT)


def test_format_term_enters_total():
    rewards = [[1, 1, 0.9], [0, 1, 0.2], [1, 0, 0.8], [1, 0, 0.1]]
    b = make_batch(rewards, 4, reward_names=["fmt", *NAMES])
    result = run_plugin(PosteriorGRPO, b, {"format_reward": "fmt"})
    torch.testing.assert_close(result.batch.total_reward(), torch.tensor([2.9, 1.2, 1.0, 1.0]), **TIGHT)
    assert plugin_set(PosteriorGRPO, {"format_reward": "fmt"}).plugins[0].instance.required_rewards() == [
        "accuracy_reward", "process_reward", "fmt"]


# ------------------------------------------------------------------------- gate, weight, threshold
def test_non_binary_outcome_gate_and_weight():
    outcome, process = [0.9, 0.6, 0.4, 1.0], [0.5, 0.5, 0.5, 0.2]
    result = run_plugin(PosteriorGRPO, batch(outcome, process), {"weight": 0.5})
    torch.testing.assert_close(result.rewards[:, 1], torch.tensor([0.25, 0.25, 0.0, 0.1]), **TIGHT)
    torch.testing.assert_close(result.batch.total_reward(), torch.tensor([1.15, 0.85, 0.4, 1.1]), **TIGHT)
    strict = run_plugin(PosteriorGRPO, batch(outcome, process), {"threshold": 0.95})
    torch.testing.assert_close(strict.rewards[:, 1], torch.tensor([0.0, 0.0, 0.0, 0.2]), **TIGHT)
    assert strict.metrics["p_grpo/gate_rate"] == 0.25


def test_reward_weights_are_kept():
    b = batch([1, 1, 0, 0], [0.9, 0.2, 0.8, 0.1], reward_weights=[1.0, 2.0])
    result = run_plugin(PosteriorGRPO, b)
    assert result.batch.reward_weights.tolist() == [1.0, 2.0]
    torch.testing.assert_close(result.batch.total_reward(), torch.tensor([2.8, 1.4, 0.0, 0.0]), **TIGHT)


def test_wrong_group_gets_no_gradient_from_process_scores():
    # all wrong: process scores differ, yet the shaped rewards are constant -> advantage 0 (no hacking)
    # all correct: the process score ranks the completions
    result = run_plugin(PosteriorGRPO, batch([0, 0, 0, 0, 1, 1, 1, 1], [0.9, 0.1, 0.5, 0.3, 0.9, 0.1, 0.5, 0.3]))
    assert torch.equal(result.advantages[:4], torch.zeros(4))
    assert result.advantages[4] > result.advantages[6] > result.advantages[7] > result.advantages[5]


# ------------------------------------------------------------------------- NaN, edge cases
def test_nan_process_score_is_zero_for_gating():
    result = run_plugin(PosteriorGRPO, batch([1, 1, 0, 0], [NAN, 0.5, NAN, 0.3]))
    torch.testing.assert_close(result.rewards[:, 1], torch.tensor([0.0, 0.5, 0.0, 0.0]), **TIGHT)
    torch.testing.assert_close(result.batch.total_reward(), torch.tensor([1.0, 1.5, 0.0, 0.0]), **TIGHT)


def test_nan_outcome_closes_gate_and_unscored_row_stays_unscored():
    result = run_plugin(PosteriorGRPO, batch([NAN, 1, NAN, 0], [0.7, 0.7, NAN, 0.3]))
    col = result.rewards[:, 1]
    assert col[0] == 0.0 and col[1] == pytest.approx(0.7) and math.isnan(col[2]) and col[3] == 0.0
    assert math.isnan(result.rewards[0, 0])                   # the outcome itself is not touched
    assert torch.isnan(result.batch.total_reward()).tolist() == [False, False, True, False]
    assert torch.isfinite(result.advantages).all() and result.advantages[2] == 0.0


def test_helper_matches_definition():
    out = torch.tensor([1.0, 0.0, math.nan, 0.5, math.nan])
    proc = torch.tensor([0.4, 0.9, 0.3, math.nan, math.nan])
    term = gated_process_reward(out, proc, weight=2.0, threshold=0.5)
    torch.testing.assert_close(term[:4], torch.tensor([0.8, 0.0, 0.0, 0.0]), **TIGHT)
    assert math.isnan(term[4])


def test_single_completion_per_group_and_all_constant():
    result = run_plugin(PosteriorGRPO, batch([1, 0, 1], [0.3, 0.9, 0.0], G=1))
    torch.testing.assert_close(result.batch.total_reward(), torch.tensor([1.3, 0.0, 1.0]), **TIGHT)
    assert torch.equal(result.advantages, torch.zeros(3))
    const = run_plugin(PosteriorGRPO, batch([1, 1, 1, 1], [0.5] * 4))
    assert torch.equal(const.advantages, torch.zeros(4))


# ------------------------------------------------------------------------- config
def test_missing_column_is_named():
    with pytest.raises(ConfigError, match=r"\(p_grpo\).*reward column 'process_reward'"):
        check_args(PosteriorGRPO, reward_names=["accuracy_reward", "format"])
    with pytest.raises(ConfigError, match=r"\(p_grpo\).*reward column 'fmt'"):
        check_args(PosteriorGRPO, {"format_reward": "fmt"}, reward_names=NAMES)
    check_args(PosteriorGRPO, reward_names=NAMES, per_device_train_batch_size=8, num_generations=4)
    with pytest.raises(PluginRuntimeError, match="no reward column 'process_reward'"):
        run_plugin(PosteriorGRPO, make_batch([1, 0], 2, reward_names=["accuracy_reward"]))


@pytest.mark.parametrize("options, key", [({"weight": -1.0}, "weight"), ({"gate": 1}, "gate"),
                                          ({"process_reward": "accuracy_reward"}, "must differ")])
def test_bad_options(options, key):
    with pytest.raises(ConfigError, match=key):
        plugin_set(PosteriorGRPO, options)


def contract_batches():
    return [
        lambda: batch([1, 0, 1, 0, 1, 1, 0, 0], [0.9, 0.2, 0.1, 0.7, 0.5, 0.5, 0.3, 0.3]),
        lambda: batch([1, 1, 1, 1, 0, 0, 0, 0], [0.2] * 8),
        lambda: batch([1, NAN, 0, 1, NAN, NAN, NAN, NAN], [NAN, 0.3, 0.4, NAN, NAN, 0.1, NAN, NAN]),
        lambda: batch([1, 0, 1], [0.5, 0.5, 0.1], G=1),
        lambda: batch([0.5, 0.25, 0.75, 0.0], [0.3, 0.6, 0.2, 0.9], G=2, lengths=[6, 0, 6, 1],
                      completions=["a", "", "b", "c"]),
    ]


def test_contract():
    check_plugin(PosteriorGRPO, batches=contract_batches())
    check_plugin(PosteriorGRPO, {"weight": 0.5, "threshold": 1.0}, batches=contract_batches())


# ------------------------------------------------------------------------- a real run
class Spy:
    """Records what the host trained on: the shaped reward matrix and the advantages."""

    def __init__(self):
        self.seen = []

    @hookimpl
    def on_batch_end(self, batch, advantages):
        self.seen.append((list(batch.reward_names), batch.rewards.clone(), batch.reward_weights.clone(),
                          advantages.clone()))


def test_training_run(tmp_path):
    raw = {"outcome": [], "process": []}

    def outcome(completions, **kwargs):        # deterministic: every other completion is "correct"
        values = [float(i % 2) for i in range(len(completions))]
        raw["outcome"].append(values)
        return values

    def process(completions, **kwargs):        # deterministic score of the text, in [0, 0.9]
        values = [(len(completion_text(c)) % 10) / 10 for c in completions]
        raw["process"].append(values)
        return values

    trainer = train_tiny([{"name": "p_grpo", "outcome_reward": "outcome", "process_reward": "process"}, Spy],
                         output_dir=tmp_path, reward_funcs=[outcome, process])
    assert trainer.state.global_step == 2
    spy = trainer.credit_plugins.plugins[1].instance
    assert len(spy.seen) == 2 == len(raw["outcome"])
    for (names, rewards, weights, advantages), out, proc in zip(spy.seen, raw["outcome"], raw["process"]):
        out, proc = torch.tensor(out), torch.tensor(proc)
        assert names == ["outcome", "process"]
        assert proc[out == 0].sum() > 0                       # the gate really removed process credit
        torch.testing.assert_close(rewards[:, 0], out)
        torch.testing.assert_close(rewards[:, 1], out * proc)  # gated term = R_out * R_proc
        # the advantages trained on are GRPO's on the shaped total R_out + R_out * R_proc
        expected = grpo_advantages(rewards, weights, 4, "group", "sum_then_normalize")
        torch.testing.assert_close(advantages, expected)
        shaped_total = out + out * proc
        torch.testing.assert_close(expected, grpo_advantages(shaped_total[:, None], torch.ones(1), 4, "group",
                                                             "sum_then_normalize"), rtol=1e-5, atol=1e-6)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2
    for entry, proc in zip(logs, raw["process"]):
        assert entry["trl_credit/p_grpo/gate_rate"] == 0.5
        gated = sum(p for i, p in enumerate(proc) if i % 2) / len(proc)
        assert entry["trl_credit/p_grpo/process_term_mean"] == pytest.approx(gated, abs=1e-6)
        assert math.isfinite(entry["loss"])
