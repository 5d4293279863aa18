"""Balanced Aggregation: methods.md vector, TRL's effective token weights per loss_type, edge cases, a real run."""

from __future__ import annotations

import math

import pytest
import torch

from trl_credit_balanced_aggregation import (
    REFUSED_LOSS_TYPES,
    SUPPORTED_LOSS_TYPES,
    BalancedAggregation,
    ba_weights,
    check_loss_type,
)

from trl_credit import ConfigError, PluginRuntimeError, grpo_advantages, hookimpl
from trl_credit.testing import check_args, check_plugin, make_batch, plugin_set, run_plugin, train_tiny

TIGHT = dict(rtol=1e-6, atol=1e-9)


def lens(values):
    return torch.tensor(values)


# ------------------------------------------------------------------------- methods.md 2.20 vector
def test_methods_vector():
    lengths = [10, 30, 20, 60]
    w = ba_weights(torch.tensor([1.0, 1.0, -1.0, -1.0]), lens(lengths), num_generations=4)
    torch.testing.assert_close(w, torch.tensor([0.0125, 0.0125, 0.00625, 0.00625]), **TIGHT)
    # each subset carries total weight 0.5 (vs DAPO 1/120 per token, per-sequence mean 1/(4 |o_i|))
    total = w * torch.tensor(lengths, dtype=torch.float32)
    torch.testing.assert_close(total.reshape(2, 2).sum(1), torch.tensor([0.5, 0.5]), **TIGHT)


def test_methods_vector_through_the_host():
    # binary rewards -> GRPO advantages +-a; dapo: A' = A * w * N_tok (N_tok = 120)
    batch = make_batch([1, 1, 0, 0], 4, lengths=[10, 30, 20, 60])
    result = run_plugin(BalancedAggregation, batch)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    expected = torch.tensor([a * 0.0125, a * 0.0125, -a * 0.00625, -a * 0.00625]) * 120
    assert result.advantages.shape == (4,)            # per-row factors: TRL broadcasts (N,) over tokens
    torch.testing.assert_close(result.advantages, expected, rtol=1e-6, atol=1e-7)
    assert result.metrics["balanced_aggregation/positive_weight"] == pytest.approx(0.5)
    assert result.metrics["balanced_aggregation/total_weight"] == pytest.approx(1.0)
    assert result.metrics["balanced_aggregation/active_fraction"] == 1.0


# ------------------------------------------------------------------------- TRL's effective weights
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-step CreditGRPOTrainer run with the plugin (the training test), reused to call TRL's loss."""
    def parity(completions, **kwargs):  # mixed rewards in every group, whatever the model writes
        return [float(i % 2) for i in range(len(completions))]

    return train_tiny([{"name": "balanced_aggregation"}], output_dir=tmp_path_factory.mktemp("ba"),
                      reward_funcs=[parity])


def test_training_run(trained):
    logs = [e for e in trained.state.log_history if "trl_credit/balanced_aggregation/seconds" in e]
    assert trained.state.global_step == 2
    assert len(logs) == 2
    for entry in logs:
        assert math.isfinite(entry["loss"])
        assert entry["trl_credit/balanced_aggregation/active_fraction"] > 0


def trl_effective_weights(trainer, loss_type, advantages, mask, max_len, ga, spg, order):
    """-d(loss)/d(per_token_logps) summed over the micro-batches of one generation batch, from TRL's own
    ``GRPOTrainer._compute_loss`` (ratio 1, beta 0), with the rows split into ``spg`` micro-batches."""
    n, t = mask.shape
    logps = torch.zeros(n, t, requires_grad=True)
    trainer.loss_type = loss_type
    trainer.max_completion_length = max_len
    trainer.current_gradient_accumulation_steps = ga
    trainer.args.steps_per_generation = spg
    trainer.epsilon_high = 5.0 if loss_type == "cispo" else 0.28   # cispo clamps the ratio at epsilon_high
    trainer.model.train()
    rows_now = {}

    def fake_logps(model, input_ids, attention_mask, logits_to_keep, **kwargs):
        return logps[rows_now["rows"]], torch.zeros(len(rows_now["rows"]), t), None

    trainer._get_per_token_logps_and_entropies = fake_logps
    try:
        for rows in order.reshape(spg, -1):
            rows_now["rows"] = rows
            inputs = {"prompt_ids": torch.ones(len(rows), 2, dtype=torch.long),
                      "prompt_mask": torch.ones(len(rows), 2, dtype=torch.long),
                      "completion_ids": torch.ones(len(rows), t, dtype=torch.long),
                      "completion_mask": mask[rows], "advantages": advantages[rows],
                      "num_items_in_batch": mask.sum()}
            trainer._compute_loss(trainer.model, inputs).backward()
    finally:
        del trainer._get_per_token_logps_and_entropies
    return -logps.grad


def ba_batch(loss_type, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [7, 1, 10, 3, 0, 5, 9, 2,   4, 4, 8, 6, 10, 1, 3, 7]   # one empty completion
    rewards = [1, 0, 1, 0, 0.5, 0.25, 1, 0,   0, 0, 1, 0, 0.5, 0.5, 0.5, 0.5]  # last group constant: A = 0
    logps = -torch.rand(16, 10, generator=g)
    batch = make_batch(rewards, 4, lengths=lengths, logps=logps, loss_type=loss_type)
    batch.args.max_completion_length = 12     # L_max > padded width, as in TRL
    return batch


@pytest.mark.parametrize("ga, spg", [(1, 1), (2, 2), (2, 4)])
@pytest.mark.parametrize("loss_type", sorted(SUPPORTED_LOSS_TYPES))
def test_trl_effective_weights_equal_ba_weights(trained, loss_type, ga, spg):
    batch = ba_batch(loss_type)
    result = run_plugin(BalancedAggregation, batch)
    advantages = result.advantages                                               # fed to TRL as is
    sequence_adv = kept_grpo(batch)
    mask = batch.completion_mask
    order = torch.randperm(16, generator=torch.Generator().manual_seed(ga + spg))  # TRL shuffles rows
    effective = trl_effective_weights(trained, loss_type, advantages, mask, 12, ga, spg, order)

    w = ba_weights(sequence_adv, mask.sum(1), 4)
    expected = sequence_adv.unsqueeze(1) * w.unsqueeze(1) * mask * (spg / ga)
    torch.testing.assert_close(effective, expected, rtol=1e-5, atol=1e-8)
    # per unit advantage: the BA weight times sign(A) (zero for A = 0 and for padding)
    unit = effective / sequence_adv.abs().clamp(min=1e-12).unsqueeze(1) * (ga / spg)
    torch.testing.assert_close(unit, (torch.sign(sequence_adv) * w).unsqueeze(1) * mask, rtol=1e-5, atol=1e-8)
    # the BA bookkeeping: per group, positives and negatives each carry n^s/n, over Q = 4 groups
    totals = (w * mask.sum(1)).reshape(4, 4)
    pos = (sequence_adv.reshape(4, 4) > 0)
    torch.testing.assert_close((totals * pos).sum(1), torch.tensor([0.5, 0.25, 0.25, 0.0]) / 4, **TIGHT)
    torch.testing.assert_close((totals * ~pos).sum(1), torch.tensor([0.5, 0.5, 0.75, 0.0]) / 4, **TIGHT)


def kept_grpo(batch):
    return grpo_advantages(batch.rewards, batch.reward_weights, 4, "group", "sum_then_normalize")


def test_bnpo_depends_on_micro_batch_composition(trained):
    # why bnpo is refused: the same advantages give different token weights under two row orders
    batch = ba_batch("dapo")
    adv = run_plugin(BalancedAggregation, batch).advantages
    one = trl_effective_weights(trained, "bnpo", adv, batch.completion_mask, 12, 2, 2, torch.arange(16))
    two = trl_effective_weights(trained, "bnpo", adv, batch.completion_mask, 12, 2, 2,
                                torch.arange(16).flip(0).roll(3))
    assert not torch.allclose(one, two)
    with pytest.raises(PluginRuntimeError, match="bnpo.*micro-batch"):
        run_plugin(BalancedAggregation, ba_batch("bnpo"))


@pytest.mark.parametrize("loss_type", sorted(REFUSED_LOSS_TYPES) + ["no_such_loss"])
def test_refused_loss_types(loss_type):
    with pytest.raises(ValueError, match=f"loss_type='{loss_type}'"):
        check_loss_type(loss_type)
    # the run-time safety net (check_args refuses these before the model loads)
    with pytest.raises(PluginRuntimeError, match="cannot reproduce BA exactly"):
        run_plugin(BalancedAggregation, make_batch([1, 0], 2, loss_type=loss_type))


# ------------------------------------------------------------------------- settings (check_args)
RUN = dict(per_device_train_batch_size=8, num_generations=4)


@pytest.mark.parametrize("loss_type", sorted(REFUSED_LOSS_TYPES))
def test_check_args_refuses_loss_types_it_cannot_be_exact_with(loss_type):
    extra = {"importance_sampling_level": "sequence"} if loss_type == "luspo" else {}
    with pytest.raises(ConfigError) as error:
        check_args(BalancedAggregation, {}, loss_type=loss_type, **RUN, **extra)
    message = str(error.value)
    assert "(balanced_aggregation)" in message and "loss_type: balanced_aggregation cannot" in message
    assert f"loss_type={loss_type!r}" in message and REFUSED_LOSS_TYPES[loss_type] in message
    assert "fix: set `loss_type: dapo`" in message


@pytest.mark.parametrize("loss_type", sorted(SUPPORTED_LOSS_TYPES))
def test_check_args_accepts_supported_loss_types_without_a_filter(loss_type):
    check_args(BalancedAggregation, {"group_size": "signed"}, loss_type=loss_type, **RUN)


@pytest.mark.parametrize("loss_type", sorted(t for t, kind in SUPPORTED_LOSS_TYPES.items() if kind != "tokens"))
@pytest.mark.parametrize("others", [["dynamic_sampling"], [{"name": "dynamic_sampling", "mode": "filter"}]])
def test_check_args_refuses_per_sequence_losses_next_to_a_filter(loss_type, others):
    with pytest.raises(ConfigError) as error:
        check_args(BalancedAggregation, {}, others=others, loss_type=loss_type, **RUN)
    message = str(error.value)
    assert "(balanced_aggregation)" in message and "loss_type:" in message
    assert f"per-sequence loss_type={loss_type!r}" in message and "plugins[1] (dynamic_sampling)" in message
    assert "fix: set `loss_type: dapo` (exact with filters) or remove the filter" in message


@pytest.mark.parametrize("loss_type", sorted(t for t, kind in SUPPORTED_LOSS_TYPES.items() if kind == "tokens"))
def test_check_args_accepts_token_normalised_losses_next_to_a_filter(loss_type):
    check_args(BalancedAggregation, {}, others=["dynamic_sampling"], loss_type=loss_type, **RUN)


# ------------------------------------------------------------------------- edge cases
LEN = [10, 30, 20, 60]


def test_group_with_only_positives():
    a = torch.tensor([1.0, 0.5, 0.0, 0.0])
    torch.testing.assert_close(ba_weights(a, lens(LEN), 4), torch.tensor([0.0125, 0.0125, 0, 0]), **TIGHT)
    # group_size="signed": n = n+ + n- = 2, the positives share weight 1
    torch.testing.assert_close(ba_weights(a, lens(LEN), 4, "signed"), torch.tensor([0.025, 0.025, 0, 0]),
                               **TIGHT)


def test_empty_completion_is_skipped():
    w = ba_weights(torch.tensor([1.0, 1.0, -1.0, -1.0]), lens([10, 0, 20, 60]), 4)
    torch.testing.assert_close(w, torch.tensor([0.25 / 10, 0.0, 0.00625, 0.00625]), **TIGHT)
    all_empty = ba_weights(torch.tensor([1.0, -1.0]), lens([0, 0]), 2)
    assert torch.equal(all_empty, torch.zeros(2))


def test_zero_advantage_rows_and_outer_group_average():
    # group 0 as methods.md with one positive at A = 0; group 1 constant -> Q = 2 halves every weight
    a = torch.tensor([1.0, 0.0, -1.0, -1.0, 0.0, 0.0, 0.0, 0.0])
    w = ba_weights(a, lens(LEN * 2), 4)
    torch.testing.assert_close(w, torch.tensor([0.25 / 10, 0, 0.00625, 0.00625, 0, 0, 0, 0]) / 2, **TIGHT)


def test_constant_nan_and_single_completion_groups_give_zero():
    for rewards, g in (([1, 1, 1, 1, 0, 0, 0, 0], 4), ([1, None, None, None], 4), ([1, 0, 1], 1)):
        result = run_plugin(BalancedAggregation, make_batch(rewards, g, lengths=[3] * len(rewards)))
        assert torch.equal(result.advantages, torch.zeros_like(result.advantages))
        assert result.metrics["balanced_aggregation/active_fraction"] == 0.0
    # NaN row inside a mixed group: advantage 0, weight 0, still counted in n
    result = run_plugin(BalancedAggregation, make_batch([1, None, 0, 0], 4, lengths=LEN))
    assert result.advantages[1].abs().sum() == 0
    w = ba_weights(kept_grpo(result.batch), result.batch.completion_lengths, 4)
    torch.testing.assert_close(w, torch.tensor([0.25 / 10, 0, 0.5 / 80, 0.5 / 80]), **TIGHT)


def test_token_level_input_is_classified_by_its_token_mean():
    a = torch.tensor([[3.0, -1.0, 7.0], [-2.0, 1.0, 7.0]])  # token means +1, -0.5 (last column is padding)
    batch = make_batch([1, 0], 2, completion_mask=[[1, 1, 0], [1, 1, 0]])
    plugin = BalancedAggregation()
    plugin_set(plugin)                                      # registered as the host does: it owns its metrics
    out = plugin.transform_advantages(batch, a)
    torch.testing.assert_close(out, a * 0.25 * 4)           # w = (1/2)/2 each; dapo: M = N_tok = 4
    # an (N, T) input that is constant per row gives the (N,) result broadcast
    row = torch.tensor([0.7, -0.7])
    torch.testing.assert_close(plugin.transform_advantages(batch, row[:, None].expand(2, 3)),
                               plugin.transform_advantages(batch, row)[:, None].expand(2, 3))


def with_filter(keep):
    """BA plus a fixed keep mask, as if another enabled plugin's filter had dropped the other rows."""
    class FilteredBA(BalancedAggregation):
        name = "balanced_aggregation"

        @hookimpl
        def filter_rollouts(self, batch):
            return torch.tensor(keep)

    return FilteredBA


def test_dropped_completions_with_dapo_and_refusal_for_per_sequence_losses():
    # group 0 keeps 3 of 4 (row 3 dropped), group 1 is dropped entirely: Q = 1, N_tok = 60
    plugin = with_filter([True, True, True, False, False, False, False, False])
    batch = make_batch([1, 1, 0, 0, 1, 0, 1, 0], 4, lengths=LEN * 2)
    adv = run_plugin(plugin, batch).advantages
    a = kept_grpo(batch)
    # positives: n+ = 2, T+ = 40; negatives: only row 2 (20 tokens); n = 4
    w = torch.tensor([0.5 / 40, 0.5 / 40, 0.25 / 20, 0, 0, 0, 0, 0])
    torch.testing.assert_close(adv, a * w * 60, rtol=1e-6, atol=1e-7)
    for loss_type in ("grpo", "dr_grpo"):   # the run-time safety net behind check_args
        batch = make_batch([1, 1, 0, 0, 1, 0, 1, 0], 4, lengths=LEN * 2, loss_type=loss_type)
        with pytest.raises(PluginRuntimeError, match="drops completions"):
            run_plugin(plugin, batch)


def test_contract():
    check_plugin(BalancedAggregation)
    check_plugin(BalancedAggregation, {"group_size": "signed"})
    for loss_type in sorted(SUPPORTED_LOSS_TYPES):
        check_plugin(BalancedAggregation, batches=[lambda lt=loss_type: ba_batch(lt)])
