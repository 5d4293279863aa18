"""ETR: hand-computed bounds, both levels and their options, micro-batch invariance, edge cases, the clipped
objective it produces, check_args, the contract, and a real (off-policy) training run."""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch

from trl_credit import ConfigError, LossInputs
from trl_credit.testing import check_args, check_plugin, loss_inputs, make_batch, plugin_set, run_loss, run_plugin, \
    train_tiny
from trl_credit_etr import ETR, group_variance, row_advantages

G = 4
# GRPO advantages of [1, 0, 0, 0] and [1, 1, 0, 0] (TRL: (r - mean) / (unbiased std + 1e-4))
A1 = 0.75 / (0.5 + 1e-4)                  # 1.4997
A2 = 0.25 / (0.5 + 1e-4)                  # 0.4999
A3 = 0.5 / (math.sqrt(1 / 3) + 1e-4)      # 0.865875
ADV = torch.tensor([A1, -A2, -A2, -A2, A3, A3, -A3, -A3])


def bounds(config=None, rewards=(1, 0, 0, 0, 1, 1, 0, 0), advantages=ADV, eps=0.2, eps_high=0.28, lengths=None,
           **loss):
    """Run ETR's loss_weights through the host's checks on the whole batch as one micro-batch."""
    batch = make_batch(list(rewards), G, lengths=lengths)
    li = loss_inputs(batch, advantages, epsilon=eps, epsilon_high=eps_high, **loss)
    result = run_loss(ETR, li, config)
    return result.weights.epsilon_low, result.weights.epsilon_high


def test_vector_default():
    low, high = bounds()
    # variance: group 1 p = 1/4 -> v = 3/16, u = v / 0.25 = 0.75 -> macro 1 + 0.5 (0.75 - 0.5) = 1.125
    #           group 2 p = 1/2 -> v = 1/4,  u = 1                 -> macro 1 + 0.5 (1 - 0.5)    = 1.25
    # micro 1 + 0.5 tanh|A|: tanh(1.4997) = 0.905094, tanh(0.4999) = 0.462039, tanh(0.865875) = 0.699272
    # side gradient: A > 0 scales eps_high (0.28), A < 0 scales eps_low (0.2); the other bound stays
    h0 = 0.28 * (1 + 0.5 * math.tanh(A1)) * 1.125        # 0.457552
    l1 = 0.2 * (1 + 0.5 * math.tanh(A2)) * 1.125         # 0.276979
    h4 = 0.28 * (1 + 0.5 * math.tanh(A3)) * 1.25         # 0.472373
    l6 = 0.2 * (1 + 0.5 * math.tanh(A3)) * 1.25          # 0.337409
    torch.testing.assert_close(high, torch.tensor([h0, .28, .28, .28, h4, h4, .28, .28]), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(low, torch.tensor([.2, l1, l1, l1, .2, .2, l6, l6]), rtol=1e-6, atol=1e-7)
    assert h0 == pytest.approx(0.457552, abs=1e-6) and l6 == pytest.approx(0.337409, abs=1e-6)


def test_side_both_scales_both_bounds():
    low, high = bounds({"side": "both"})
    f = torch.tensor([(1 + 0.5 * math.tanh(abs(a))) * (1.125 if i < 4 else 1.25) for i, a in enumerate(ADV.tolist())])
    torch.testing.assert_close(low, 0.2 * f, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(high, 0.28 * f, rtol=1e-6, atol=1e-7)


def test_each_level_alone_and_strengths():
    low, high = bounds({"macro": "none", "alpha": 1.0})
    assert high[0].item() == pytest.approx(0.28 * (1 + math.tanh(A1)), rel=1e-6)       # 0.533426
    assert low[1].item() == pytest.approx(0.2 * (1 + math.tanh(A2)), rel=1e-6)         # 0.292408
    low, high = bounds({"micro": "none", "gamma": 1.0, "center": 0.0})                  # macro only widens
    torch.testing.assert_close(high, torch.tensor([.28 * 1.75, .28, .28, .28, .56, .56, .28, .28]))
    torch.testing.assert_close(low, torch.tensor([.2, .35, .35, .35, .2, .2, .4, .4]))
    low, high = bounds({"micro": "tanh", "adv_scale": 2.0, "macro": "none"})
    assert high[0].item() == pytest.approx(0.28 * (1 + 0.5 * math.tanh(A1 / 2)), rel=1e-6)


def test_micro_max_uses_the_generation_batch_max():
    batch = make_batch([1, 0, 0, 0, 1, 1, 0, 0], G)
    plugins = plugin_set(ETR, {"micro": "max", "macro": "none", "alpha": 1.0})
    result = run_plugin(ETR, batch, plugins=plugins)         # on_batch_end sees the whole batch
    torch.testing.assert_close(result.advantages, ADV, rtol=1e-5, atol=1e-6)
    # m = |A| / max|A| = |A| / 1.4997: row 0 -> 1, rows 1..3 -> 1/3, group 2 -> 0.577366
    full = run_loss(ETR, loss_inputs(batch, result.advantages, epsilon_high=0.28), plugins=plugins).weights
    torch.testing.assert_close(full.epsilon_high[[0, 4]], torch.tensor([0.56, 0.28 * (1 + A3 / A1)]), rtol=1e-5,
                               atol=1e-6)
    torch.testing.assert_close(full.epsilon_low[[1, 6]], torch.tensor([0.2 * (1 + A2 / A1), 0.2 * (1 + A3 / A1)]),
                               rtol=1e-5, atol=1e-6)
    # a micro-batch of rows 6, 4, 5 (TRL shuffles): the same bounds, although its own max |A| is 0.866
    part = micro_batch(loss_inputs(batch, result.advantages, epsilon_high=0.28), [6, 4, 5])
    sub = run_loss(ETR, part, plugins=plugins).weights
    torch.testing.assert_close(sub.epsilon_high, full.epsilon_high[[6, 4, 5]])
    torch.testing.assert_close(sub.epsilon_low, full.epsilon_low[[6, 4, 5]])
    # a LossInputs whose batch on_batch_end never saw falls back to its own max (documented)
    alone = run_loss(ETR, micro_batch(loss_inputs(make_batch([1, 0, 0, 0, 1, 1, 0, 0], G), ADV,
                                                  epsilon_high=0.28), [6, 4, 5]),
                     {"micro": "max", "macro": "none", "alpha": 1.0}).weights
    torch.testing.assert_close(alone.epsilon_high, torch.tensor([0.28, 0.56, 0.56]))


def micro_batch(li: LossInputs, rows: list[int]) -> LossInputs:
    """Rows ``rows`` of a whole-batch LossInputs, as the host hands a shuffled micro-batch to the hook."""
    idx = torch.tensor(rows)
    return dataclasses.replace(
        li, rows=idx, prompt_ids=li.prompt_ids[idx], prompt_mask=li.prompt_mask[idx],
        completion_ids=li.completion_ids[idx], mask=li.mask[idx], advantages=li.advantages[idx],
        logps=None if li.logps is None else li.logps.detach()[idx], entropies=None)


def test_macro_level_reads_the_group_through_rows():
    batch = make_batch([1, 0, 0, 0, 1, 1, 0, 0], G)
    full = run_loss(ETR, loss_inputs(batch, ADV, epsilon_high=0.28)).weights
    part = run_loss(ETR, micro_batch(loss_inputs(batch, ADV, epsilon_high=0.28), [7, 0, 2])).weights
    torch.testing.assert_close(part.epsilon_low, full.epsilon_low[[7, 0, 2]])
    torch.testing.assert_close(part.epsilon_high, full.epsilon_high[[7, 0, 2]])


def test_zero_advantages_and_all_equal_groups_keep_the_config_bounds():
    low, high = bounds(rewards=(1, 1, 1, 1, 0, 0, 0, 0), advantages=torch.zeros(8))
    torch.testing.assert_close(low, torch.full((8,), 0.2))
    torch.testing.assert_close(high, torch.full((8,), 0.28))
    # side both: no micro push (m = 0), zero variance -> macro 1 + 0.5 (0 - 0.5) = 0.75: tighter
    low, high = bounds({"side": "both"}, rewards=(1, 1, 1, 1, 0, 0, 0, 0), advantages=torch.zeros(8))
    torch.testing.assert_close(high, torch.full((8,), 0.21))


def test_group_variance_population_nan_aware_and_variance_ref():
    r = torch.tensor([1.0, math.nan, 0.0, 0.0, 2.0, 0.0, 2.0, 0.0, math.nan, math.nan, math.nan, math.nan])
    # [1, 0, 0] -> p = 1/3, v = 2/9; [2, 0, 2, 0] -> v = 1; all NaN -> 0
    torch.testing.assert_close(group_variance(r, 4), torch.tensor([2 / 9, 1.0, 0.0]))
    adv = torch.tensor([1.0, 0.0, -1.0, -1.0])
    low, high = bounds({"micro": "none"}, rewards=(1, None, 0, 0), advantages=adv)
    u = (2 / 9) / 0.25                                                      # 0.888889
    assert high[0].item() == pytest.approx(0.28 * (1 + 0.5 * (u - 0.5)), rel=1e-6)  # NaN row: config bounds
    torch.testing.assert_close(low[1:], torch.tensor([0.2, 0.2 * (1 + 0.5 * (u - 0.5)), 0.2 * (1 + 0.5 * (u - 0.5))]))
    # variance_ref null: u = v / max_g v -> group 1 (v = 3/16 of max 1/4) gets u = 0.75, group 2 u = 1, as with 0.25
    a, b = bounds({"variance_ref": None}), bounds()
    torch.testing.assert_close(a[1], b[1])
    # non-binary rewards: u is clamped to 1 above variance_ref
    low, high = bounds({"micro": "none"}, rewards=(3, 0, 0, 0, 1, 1, 0, 0))   # v = 27/16 > 0.25
    assert high[0].item() == pytest.approx(0.28 * 1.25, rel=1e-6)


def test_reward_column_option():
    batch = make_batch([[1, 0], [0, 0], [0, 1], [0, 1]], G, reward_names=["accuracy", "format"])
    adv = torch.tensor([1.0, -1.0, 1.0, 1.0])
    acc = run_loss(ETR, loss_inputs(batch, adv), {"micro": "none", "reward": "accuracy"}).weights
    tot = run_loss(ETR, loss_inputs(batch, adv), {"micro": "none"}).weights
    # accuracy [1, 0, 0, 0]: u = 0.75 -> 1.125; total [1, 0, 1, 1]: also p = 3/4 -> 1.125; format alone p = 1/2
    fmt = run_loss(ETR, loss_inputs(batch, adv), {"micro": "none", "reward": "format"}).weights
    assert acc.epsilon_high[0].item() == pytest.approx(0.225) and tot.epsilon_high[0].item() == pytest.approx(0.225)
    assert fmt.epsilon_high[0].item() == pytest.approx(0.25)
    assert plugin_set(ETR, {"reward": "format"}).plugins[0].instance.required_rewards() == ["format"]


def test_eps_min_and_eps_max_bound_every_row():
    low, high = bounds({"eps_max": 0.4, "eps_min": 0.25})
    assert high.max().item() == pytest.approx(0.4) and low.min().item() == pytest.approx(0.25)
    assert high[1].item() == pytest.approx(0.28)          # inside the limits: unchanged


def test_per_token_advantages_use_the_masked_row_mean_and_masked_rows_are_not_logged():
    batch = make_batch([1, 0], 2, lengths=[2, 4])
    adv = torch.tensor([[2.0, 1.0, 9.0, 9.0], [-1.0, -1.0, 1.0, -3.0]])    # row 0: tokens 2.. are padding
    torch.testing.assert_close(row_advantages(adv, batch.completion_mask), torch.tensor([1.5, -1.0]))
    li = loss_inputs(batch, adv)
    weights = run_loss(ETR, li, {"macro": "none"}).weights
    torch.testing.assert_close(weights.epsilon_high, torch.tensor([0.2 * (1 + 0.5 * math.tanh(1.5)), 0.2]))
    torch.testing.assert_close(weights.epsilon_low, torch.tensor([0.2, 0.2 * (1 + 0.5 * math.tanh(1.0))]))
    # a row without tokens (dropped / masked) is left out of the logged means
    li = dataclasses.replace(li, mask=li.mask * torch.tensor([[1.0], [0.0]]))
    plugins = plugin_set(ETR, {"macro": "none"})
    weights = run_loss(ETR, li, plugins=plugins).weights
    logged = {k: v for k, v in li.batch.metrics.items() if k.startswith("etr/")}
    assert logged["etr/epsilon_high"][-1] == pytest.approx(0.2 * (1 + 0.5 * math.tanh(1.5)), rel=1e-6)
    assert logged["etr/epsilon_low"][-1] == pytest.approx(0.2)


def test_the_bounds_change_the_clipped_objective():
    """TRL's dapo surrogate, written out, with ratio 1.3 on every token: the config's eps_high = 0.28 clips the
    positive row (no gradient), ETR's 0.4576 does not; the negative rows (ratio above 1) never clip."""
    batch = make_batch([1, 0, 0, 0], G)
    li = loss_inputs(batch, ADV[:4], epsilon_high=0.28)
    weights = run_loss(ETR, li).weights
    old = li.logps.detach() - math.log(1.3)

    def grad(low, high):
        ratio = torch.exp(li.logps - old)
        a = li.advantages.unsqueeze(1)
        clipped = torch.clamp(ratio, 1 - low.unsqueeze(1), 1 + high.unsqueeze(1))
        loss = (-torch.min(ratio * a, clipped * a) * li.mask).sum() / li.num_items
        return torch.autograd.grad(loss, li.logps)[0]

    config = grad(torch.full((4,), 0.2), torch.full((4,), 0.28))
    etr = grad(weights.epsilon_low, weights.epsilon_high)
    assert (config[0] == 0).all() and (etr[0] != 0).all()
    # d/dlogp of -1.3 A / num_items = -1.3 * 1.4997 / 16 per token of row 0
    torch.testing.assert_close(etr[0], torch.full((4,), -1.3 * A1 / 16))
    torch.testing.assert_close(etr[1:], config[1:])


# ------------------------------------------------------------------ checks and contract
@pytest.mark.parametrize("loss_type", ["sapo", "vespo"])
def test_check_args_refuses_loss_types_without_clip_bounds(loss_type):
    with pytest.raises(ConfigError) as error:
        check_args(ETR, per_device_train_batch_size=8, num_generations=4, loss_type=loss_type, num_iterations=2)
    message = str(error.value)
    assert "plugins[0] (etr): loss_type:" in message
    assert f"loss_type {loss_type!r} has none" in message
    assert "fix: set `loss_type: dapo`" in message


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo"])
def test_check_args_accepts_clipped_losses_and_warns_on_policy(loss_type):
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="etr:")
        check_args(ETR, per_device_train_batch_size=8, num_generations=4, loss_type=loss_type, num_iterations=2)
        check_args(ETR, per_device_train_batch_size=4, num_generations=4, loss_type=loss_type,
                   gradient_accumulation_steps=1, steps_per_generation=2)
    with pytest.warns(UserWarning, match="ETR changes nothing"):
        check_args(ETR, per_device_train_batch_size=8, num_generations=4, loss_type=loss_type)


@pytest.mark.parametrize("options, key", [
    ({"eps_min": 0.3, "eps_max": 0.2}, "eps_min"), ({"gamma": 3.0, "center": 0.5}, "gamma"),
    ({"micro": "abs"}, "micro"), ({"alpha": -1.0}, "alpha"), ({"variance_ref": 0.0}, "variance_ref"),
    ({"sides": "both"}, "sides"),
])
def test_bad_options(options, key):
    with pytest.raises(ConfigError, match=key):
        plugin_set(ETR, options)


def test_contract():
    check_plugin(ETR)
    check_plugin(ETR, {"micro": "max", "side": "both", "variance_ref": None})
    assert plugin_set(ETR).plugins[0].hooks == ["loss_weights"]                # on_batch_end only for micro: max
    assert sorted(plugin_set(ETR, {"micro": "max"}).plugins[0].hooks) == ["loss_weights", "on_batch_end"]


# ------------------------------------------------------------------ a real run
class SpyETR(ETR):
    """ETR recording what it logs (the host's log history is checked separately)."""

    name = "etr"
    logged: list = []

    def log_metric(self, batch, name, value):
        SpyETR.logged.append((name, value))
        super().log_metric(batch, name, value)


def test_training_run(tmp_path):
    def half_right(completions, **kwargs):
        """Every group of 4 gets rewards [0, 1, 0, 1]: A = +-0.866, p = 1/2."""
        return [float(i % 2) for i in range(len(completions))]

    SpyETR.logged.clear()
    trainer = train_tiny([{"name": SpyETR, "alpha": 1.0}], output_dir=tmp_path, reward_funcs=[half_right],
                         loss_type="dapo", num_iterations=2, learning_rate=1e-3, train=False)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.global_step == 2
    assert any(not torch.equal(before[n], p.detach()) for n, p in trainer.model.named_parameters())
    highs = [v for name, v in SpyETR.logged if name == "epsilon_high"]
    # every micro-batch: rows with A > 0 get 0.2 (1 + tanh 0.866) 1.25 = 0.424818, the others 0.2
    assert highs and all(v == pytest.approx((0.2 * (1 + math.tanh(A3)) * 1.25 + 0.2) / 2, rel=1e-4) for v in highs)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert all(math.isfinite(h["loss"]) for h in logs)
    assert all(h["trl_credit/etr/epsilon_high"] == pytest.approx(highs[0], rel=1e-4) for h in logs)  # logged
