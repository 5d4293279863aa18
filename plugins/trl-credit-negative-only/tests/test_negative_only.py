"""Negative-only: the methods.md vector, schedules, both forms (advantage / loss weights) and how their objectives
differ, edge cases, check_args, the contract, and real training runs."""

from __future__ import annotations

import math

import pytest
import torch

from trl_credit import ConfigError, hookimpl
from trl_credit.testing import check_args, check_plugin, loss_inputs, make_batch, plugin_set, run_loss, run_plugin, \
    train_tiny
from trl_credit_negative_only import NegativeOnly

A = 0.25 / (0.5 + 1e-4)          # 0.4999: TRL's (0 - 0.25) / (unbiased std 0.5 + 1e-4), sign flipped
A_POS = 0.75 / (0.5 + 1e-4)      # 1.4997


def test_methods_md_vector_and_all_equal_group():
    # group 0: rewards [1, 0, 0, 0] -> GRPO A = [1.49970, -0.49990 x 3] -> [0, -0.49990 x 3]
    # group 1: all equal -> A = 0 -> 0
    result = run_plugin(NegativeOnly, make_batch([1, 0, 0, 0, 1, 1, 1, 1], 4))
    torch.testing.assert_close(result.advantages, torch.tensor([0.0, -A, -A, -A, 0, 0, 0, 0]))
    assert result.advantages[1].item() == pytest.approx(-0.49990, abs=1e-5)
    assert result.metrics["negative_only/positive_weight"] == 0.0
    assert result.metrics["negative_only/positive_fraction"] == 0.125          # 1 of 8 kept rows was positive


def test_without_eps_the_vector_is_exactly_methods_md():
    # scale_rewards none: A = r - mean = [0.75, -0.25 x 3]; with the group std (no eps) it would be [1.5, -0.5 x 3]
    result = run_plugin(NegativeOnly, make_batch([1, 0, 0, 0], 4, scale_rewards="none"))
    torch.testing.assert_close(result.advantages, torch.tensor([0.0, -0.25, -0.25, -0.25]))
    plugin = plugin_set(NegativeOnly).plugins[0].instance
    torch.testing.assert_close(plugin.transform_advantages(make_batch([1, 0, 0, 0], 4),
                                                           torch.tensor([1.5, -0.5, -0.5, -0.5])),
                               torch.tensor([0.0, -0.5, -0.5, -0.5]))


@pytest.mark.parametrize("config, step, lam", [
    ({"positive_weight": 0.25}, 7, 0.25),                                           # constant
    ({"schedule": "switch", "start_step": 10}, 9, 1.0),                             # GRPO before the switch
    ({"schedule": "switch", "start_step": 10}, 10, 0.0),                            # negative-only from it on
    ({"schedule": "linear", "start_step": 10, "end_step": 20}, 5, 1.0),
    ({"schedule": "linear", "start_step": 10, "end_step": 20}, 15, 0.5),            # 1 + (0 - 1) * 5/10
    ({"schedule": "linear", "start_step": 10, "end_step": 20, "positive_weight": 0.2}, 15, 0.6),  # 1 - 0.8 / 2
    ({"schedule": "linear", "start_step": 10, "end_step": 20}, 25, 0.0),
])  # fmt: skip
def test_schedules(config, step, lam):
    result = run_plugin(NegativeOnly, make_batch([1, 0, 0, 0], 4, step=step), config)
    torch.testing.assert_close(result.advantages, torch.tensor([lam * A_POS, -A, -A, -A]))
    assert result.metrics["negative_only/positive_weight"] == pytest.approx(lam)
    assert ("negative_only/positive_fraction" in result.metrics) == (lam != 1.0)   # lambda 1: no change, no work
    assert plugin_set(NegativeOnly, config).plugins[0].instance.positive_scale(step) == pytest.approx(lam)


def test_token_level_advantages_are_clipped_elementwise():
    plugin = plugin_set(NegativeOnly, {"positive_weight": 0.5}).plugins[0].instance
    batch = make_batch([1, 0], 2, lengths=[3, 3])
    out = plugin.transform_advantages(batch, torch.tensor([[1.0, -2.0, 0.5], [-1.0, 3.0, 0.0]]))
    torch.testing.assert_close(out, torch.tensor([[0.5, -2.0, 0.25], [-1.0, 1.5, 0.0]]))
    assert batch.metrics["negative_only/positive_fraction"] == [pytest.approx(3 / 6)]


def test_dropped_rows_are_not_counted():
    # group 2 is dropped by a filter: advantage 0 and not in the positive fraction (1 positive of 4 kept rows)
    class DropSecond:
        """Drop the second group."""

        @hookimpl
        def filter_rollouts(self, batch):
            return torch.tensor([True, False])

    result = run_plugin(NegativeOnly, make_batch([1, 0, 0, 0, 1, 0, 1, 0], 4), others=[DropSecond])
    torch.testing.assert_close(result.advantages, torch.tensor([0.0, -A, -A, -A, 0, 0, 0, 0]))
    assert result.metrics["negative_only/positive_fraction"] == 0.25


# ------------------------------------------------------------------ loss mode
def test_loss_mode_weights_tokens_with_non_negative_advantage():
    batch = make_batch([1, 0, 0, 0], 4, lengths=[4, 2, 4, 3])
    adv = torch.tensor([A_POS, -A, 0.0, -A])                  # row 2: A = 0 counts as "not negative"
    li = loss_inputs(batch, adv)
    weights = run_loss(NegativeOnly, li, {"mode": "loss", "positive_weight": 0.25}).weights
    assert weights.epsilon_low is None and weights.epsilon_high is None
    torch.testing.assert_close(weights.token, torch.tensor([0.25, 1, 0.25, 1]).unsqueeze(1).expand(4, 4))
    # weighted share: rows 0 and 2 hold 4 + 4 of the 13 mask tokens
    assert batch.metrics["negative_only/weighted_fraction"] == [pytest.approx(8 / 13)]
    assert batch.metrics["negative_only/positive_weight"] == [0.25]
    # per-token advantages: the sign of each token
    tok = torch.tensor([[1.0, -1.0, 0.0, 2.0]] * 4)
    weights = run_loss(NegativeOnly, loss_inputs(batch, tok), {"mode": "loss"}).weights
    torch.testing.assert_close(weights.token, torch.tensor([[0.0, 1.0, 0.0, 0.0]] * 4))
    # lambda 1 (before a switch): no weights at all
    assert run_loss(NegativeOnly, li, {"mode": "loss", "schedule": "switch", "start_step": 3}).weights is None
    # the loss hook reads loss.step (here the batch's step, 5) for the schedule
    late = loss_inputs(make_batch([1, 0, 0, 0], 4, step=5), adv)
    assert run_loss(NegativeOnly, late, {"mode": "loss", "schedule": "switch", "start_step": 3}).weights is not None


def _on_policy_grad(li, weights, advantages, loss_type):
    """Gradient w.r.t. the token log-probs of TRL's on-policy surrogate -ratio * A (ratio = e^(logp - sg logp) = 1),
    reduced the TRL way with the token weights multiplied into the mask (as the host does via tool_mask)."""
    mask = li.mask * weights
    per_token = -torch.exp(li.logps - li.logps.detach()) * advantages.unsqueeze(1)
    if loss_type == "dapo":
        loss = (per_token * mask).sum() / li.num_items
    else:  # bnpo: token mean over the micro-batch, the weights in the normaliser
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    return torch.autograd.grad(loss, li.logps)[0]


def test_the_two_forms_agree_under_dapo_and_differ_under_bnpo():
    batch = make_batch([1, 0, 0, 0, 1, 1, 0, 0], 4)
    grpo = run_plugin(NegativeOnly, batch, {"positive_weight": 1.0}).advantages           # plain GRPO A
    clipped = run_plugin(NegativeOnly, make_batch([1, 0, 0, 0, 1, 1, 0, 0], 4)).advantages  # min(A, 0)
    for loss_type in ("dapo", "bnpo"):
        li = loss_inputs(batch, grpo, loss_type=loss_type)
        token = run_loss(NegativeOnly, li, {"mode": "loss"}).weights.token
        by_weight = _on_policy_grad(li, token, grpo, loss_type)
        by_advantage = _on_policy_grad(loss_inputs(batch, clipped, loss_type=loss_type), torch.ones(8, 4), clipped,
                                       loss_type)
        if loss_type == "dapo":  # fixed normaliser: identical policy gradient (32 tokens)
            torch.testing.assert_close(by_weight, by_advantage)
            torch.testing.assert_close(by_weight[1], torch.full((4,), A / 32))        # d(-1 * (-A) / 32)/dlogp
        else:  # bnpo: the 12 tokens of the 3 positive rows leave the normaliser, negatives weigh 32/20 more
            torch.testing.assert_close(by_weight, by_advantage * 32 / 20)
            assert by_weight[1, 0].item() == pytest.approx(A / 20)


# ------------------------------------------------------------------ checks and contract
def test_check_args_refuses_a_schedule_that_never_acts():
    with pytest.raises(ConfigError) as error:
        check_args(NegativeOnly, {"schedule": "switch", "start_step": 100}, max_steps=50,
                   per_device_train_batch_size=8, num_generations=4)
    message = str(error.value)
    assert "plugins[0] (negative_only): start_step:" in message
    assert "max_steps=50" in message and "fix: set `start_step` below 50" in message
    check_args(NegativeOnly, {"schedule": "switch", "start_step": 10}, max_steps=50,
               per_device_train_batch_size=8, num_generations=4)
    check_args(NegativeOnly, {"start_step": 100}, max_steps=50, per_device_train_batch_size=8,
               num_generations=4)                                               # constant: start_step unused


@pytest.mark.parametrize("loss_type", ["grpo", "sapo"])
def test_check_args_refuses_loss_weights_that_the_sequence_normaliser_cancels(loss_type):
    for config in ({"mode": "loss", "positive_weight": 0.5},
                   {"mode": "loss", "schedule": "linear", "start_step": 0, "end_step": 10}):
        with pytest.raises(ConfigError) as error:
            check_args(NegativeOnly, config, loss_type=loss_type, per_device_train_batch_size=8, num_generations=4)
        message = str(error.value)
        assert "plugins[0] (negative_only): mode:" in message and "cancels out" in message
        assert "fix: use `mode: advantage`, or `positive_weight: 0`" in message
    # weight 0 removes the row (0 / clamp(0, 1) = 0): allowed; other loss types and advantage mode too
    check_args(NegativeOnly, {"mode": "loss"}, loss_type=loss_type, per_device_train_batch_size=8, num_generations=4)
    check_args(NegativeOnly, {"mode": "loss", "positive_weight": 0.5}, loss_type="bnpo",
               per_device_train_batch_size=8, num_generations=4)
    check_args(NegativeOnly, {"positive_weight": 0.5}, loss_type=loss_type, per_device_train_batch_size=8,
               num_generations=4)


@pytest.mark.parametrize("options, key", [
    ({"schedule": "linear", "start_step": 5}, "end_step"), ({"schedule": "linear", "start_step": 5, "end_step": 5},
                                                            "end_step"),
    ({"positive_weight": -0.1}, "positive_weight"), ({"mode": "tokens"}, "mode"), ({"start": 3}, "start"),
])  # fmt: skip
def test_bad_options(options, key):
    with pytest.raises(ConfigError, match=key):
        plugin_set(NegativeOnly, options)


def test_contract():
    check_plugin(NegativeOnly)
    check_plugin(NegativeOnly, {"schedule": "linear", "start_step": 0, "end_step": 4, "positive_weight": 0.1})
    check_plugin(NegativeOnly, {"mode": "loss"})
    assert plugin_set(NegativeOnly).plugins[0].hooks == ["transform_advantages"]
    assert plugin_set(NegativeOnly, {"mode": "loss"}).plugins[0].hooks == ["loss_weights"]


# ------------------------------------------------------------------ real runs
def one_right(completions, **kwargs):
    """Every group of 4 gets rewards [1, 0, 0, 0]: one positive, three negatives."""
    return [float(i % 4 == 0) for i in range(len(completions))]


def test_training_run_advantage_mode(tmp_path):
    trainer = train_tiny([{"name": "negative_only", "schedule": "switch", "start_step": 1}], output_dir=tmp_path,
                         reward_funcs=[one_right], learning_rate=1e-3, train=False)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["trl_credit/negative_only/positive_weight"] for h in logs] == [1.0, 0.0]   # GRPO, then negative-only
    assert logs[1]["trl_credit/negative_only/positive_fraction"] == 0.25
    assert any(not torch.equal(before[n], p.detach()) for n, p in trainer.model.named_parameters())
    assert all(math.isfinite(h["loss"]) for h in logs)


class SpyNegativeOnly(NegativeOnly):
    name = "negative_only"
    logged: list = []

    def log_metric(self, batch, name, value):
        SpyNegativeOnly.logged.append((name, value))
        super().log_metric(batch, name, value)


def test_training_run_loss_mode(tmp_path):
    SpyNegativeOnly.logged.clear()
    trainer = train_tiny([{"name": SpyNegativeOnly, "mode": "loss"}], output_dir=tmp_path, reward_funcs=[one_right],
                         learning_rate=1e-3, loss_type="bnpo", max_steps=1, train=False)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(before[n], p.detach()) for n, p in trainer.model.named_parameters())
    shares = [v for name, v in SpyNegativeOnly.logged if name == "weighted_fraction"]
    assert len(shares) == 1 and 0.0 < shares[0] < 1.0    # the positive rows' tokens were weighted 0
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs[0]["trl_credit/negative_only/weighted_fraction"] == pytest.approx(shares[0])  # reaches the logs
