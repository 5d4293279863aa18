"""PRIME: methods.md 2.23's vectors for both forms, the PRM's CE loss and its gradient, edge cases, the
contract, and real training runs on the tiny model (the PRM adapter trains, the policy trains)."""

from __future__ import annotations

import math
import zlib

import pytest
import torch
from peft import LoraConfig

from trl_credit.testing import check_plugin, make_batch, run_plugin, train_tiny
from trl_credit_prime import PRIME, code_returns, masked_whiten, pairwise_auc

Q = torch.tensor([[0.2, 0.1], [-0.1, 0.0], [0.0, -0.2], [0.1, 0.1]])  # log pi_prm - log pi_ref
OUTCOME = [1.0, 0.0, 0.0, 1.0]
REF = -torch.tensor([[1.0, 2.0], [0.5, 1.5], [2.0, 1.0], [0.25, 0.75]])


def run(config=None, q=Q, outcome=OUTCOME, ref=REF, lengths=None, **kw):
    batch = make_batch(outcome, 4, lengths=lengths or [2] * len(outcome), ref_logps=ref, adapters={"prm": ref + q},
                       reward_names=["accuracy"], **kw)
    return run_plugin(PRIME, batch, config)


def test_paper_form_vector():
    # R = 0.05 * [0.3, -0.1, -0.2, 0.2] = [0.015, -0.005, -0.010, 0.010]; c0's LOO baseline -0.001667,
    # subtracted at each of its tokens; outcome LOO [2/3, -1/3, -1/3, 2/3]
    result = run({"form": "paper"})
    expected = torch.tensor([[0.685, 0.673333], [-0.681667, -0.671667], [-0.69, -0.683333], [0.676667, 0.671667]])
    torch.testing.assert_close(result.advantages, expected, atol=1e-6, rtol=0)


def test_code_form_returns_and_whitening():
    returns = code_returns(Q, torch.tensor(OUTCOME), torch.ones(4, 2), 4)
    # q / (0.3 + 1e-6): c0 [0.666664, 0.333332]; token-mean RLOO; outcome RLOO on the last token; reverse cumsum
    expected = torch.tensor([[1.777774, 0.999999], [-1.333331, -0.777777], [-1.777774, -1.666663],
                             [1.333331, 0.999999]])
    torch.testing.assert_close(returns, expected, atol=2e-6, rtol=0)
    flat = expected.flatten()
    whitened = (expected - flat.mean()) / math.sqrt(flat.var(unbiased=True).item() + 1e-8)
    torch.testing.assert_close(run().advantages, whitened, atol=1e-5, rtol=0)
    assert run().advantages.mean().abs() < 1e-6  # whitened over the batch


def test_a_dropped_group_leaves_the_other_groups_vectors_unchanged():
    from trl_credit import Plugin, hookimpl

    class DropFirstGroup(Plugin):
        @hookimpl
        def filter_rollouts(self, batch):
            return torch.arange(batch.num_groups) != 0

    # the group of the paper-form vector comes second; the optimiser batch is a view of rows 4..7
    q, ref = torch.cat([torch.zeros(4, 2), Q]), torch.cat([-torch.ones(4, 2), REF])
    batch = make_batch([0.0, 1.0, 0.0, 1.0] + OUTCOME, 4, lengths=[2] * 8, ref_logps=ref, adapters={"prm": ref + q},
                       reward_names=["accuracy"])
    result = run_plugin(PRIME, batch, {"form": "paper"}, others=[DropFirstGroup])
    torch.testing.assert_close(result.advantages[4:], run({"form": "paper"}).advantages, atol=1e-6, rtol=0)
    assert (result.advantages[:4] == 0).all()
    logit = 0.05 * Q.sum(1)  # the PRM's step is on the view's rows, with their own labels
    bce = torch.nn.functional.binary_cross_entropy_with_logits(logit, torch.tensor(OUTCOME), reduction="none")
    torch.testing.assert_close(result.adapter_updates[0].losses, bce, atol=1e-6, rtol=0)


def test_the_prm_step_is_cross_entropy_on_the_outcome_with_its_gradient():
    result = run()
    update, = result.adapter_updates
    logit = 0.05 * Q.sum(1)  # [0.015, -0.005, -0.010, 0.010]
    o = torch.tensor(OUTCOME)
    bce = -(o * torch.log(torch.sigmoid(logit)) + (1 - o) * torch.log(1 - torch.sigmoid(logit)))
    torch.testing.assert_close(update.losses, bce, atol=1e-6, rtol=0)
    assert update.loss == pytest.approx(float(bce.mean()), abs=1e-7)
    assert update.losses[0].item() == pytest.approx(math.log(1 + math.exp(-0.015)), abs=1e-7)  # 0.685647
    # d mean_i BCE_i / d log pi_prm(y_it) = beta (sigmoid(logit_i) - o_i) / N on every token of row i
    grad = (0.05 * (torch.sigmoid(logit) - o) / 4).unsqueeze(1).expand(4, 2)
    torch.testing.assert_close(update.grad, grad, atol=1e-8, rtol=0)
    assert result.metrics["prime/prm_auc"] == 1.0  # both correct completions score above both wrong ones


def test_update_before_rescores_with_the_updated_prm():
    # the kit's adapter scores are fixed, so both settings reward with the same q; "before" reads them again
    assert torch.allclose(run({"update": "before"}).advantages, run().advantages)
    assert len(run({"update": "before"}).adapter_updates) == 1


def test_pairwise_auc_counts_ties_and_skips_nan_and_constant_groups():
    score = torch.tensor([0.3, 0.3, 0.1, 0.5, 1.0, 2.0, 3.0, 4.0])
    outcome = torch.tensor([1.0, 0.0, 0.0, float("nan"), 1.0, 1.0, 1.0, 1.0])
    # group 1: pairs (0 > 1) tie -> 0.5, (0 > 2) agree -> 1; the NaN row and the constant group 2 are in no pair
    assert pairwise_auc(score, outcome, 4) == pytest.approx(0.75)
    assert pairwise_auc(score[4:], outcome[4:], 4) is None


def test_ragged_lengths_empty_completions_and_nan_outcomes():
    q = torch.tensor([[0.2, 0.1, 0.4], [-0.1, 0.0, 0.0], [0.0, 0.0, 0.0], [0.1, 0.1, 0.1]])
    ref = torch.zeros(4, 3)
    result = run({"form": "paper"}, q=q, ref=ref, outcome=[1.0, None, 0.0, 1.0], lengths=[3, 1, 0, 2])
    a = result.advantages
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 0]], dtype=torch.float32)
    assert torch.isfinite(a).all() and torch.equal(a * (1 - mask), torch.zeros(4, 3))
    r = 0.05 * q * mask
    R = r.sum(1)
    b0 = (R[1] + R[2] + R[3]) / 3
    o0 = 1.0 - (0.0 + 0.0 + 1.0) / 3  # the NaN outcome counts as 0
    assert a[0, 0].item() == pytest.approx(float((r[0] - b0).sum() + o0), abs=1e-6)
    assert result.adapter_updates[0].losses[1].item() == 0.0  # no label: left out of the PRM loss
    code = run(q=q, ref=ref, outcome=[1.0, None, 0.0, 1.0], lengths=[3, 1, 0, 2]).advantages
    assert torch.isfinite(code).all() and torch.equal(code * (1 - mask), torch.zeros(4, 3))
    torch.testing.assert_close(masked_whiten(code, mask), code, atol=1e-5, rtol=0)  # already whitened


def test_outcomes_outside_zero_one_are_refused_with_the_plugin_named():
    from trl_credit import PluginRuntimeError

    with pytest.raises(PluginRuntimeError, match=r"prime.*compute_advantages.*lies in \[0, 2\].*set `reward:`"):
        run(outcome=[2.0, 0.0, 0.0, 1.0])


def test_contract():
    # a NaN outcome counts as 0 in PRIME's advantages (the README's choice), so such rows are credited
    check_plugin(PRIME, credits_unscorable=True)
    check_plugin(PRIME, {"form": "paper", "update": "before"}, credits_unscorable=True)


def parity_reward(completions, **kwargs):
    return [float(zlib.crc32(c[-1]["content"].encode()) % 2) for c in completions]


@pytest.mark.parametrize("form", ["code", "paper"])
def test_trains_the_prm_adapter_and_the_policy(tmp_path, form):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    trainer = train_tiny([{"name": "prime", "form": form}], output_dir=tmp_path, reward_funcs=[parity_reward],
                         peft_config=lora, learning_rate=1e-2)
    model = trainer.accelerator.unwrap_model(trainer.model)
    prm = [p for n, p in model.named_parameters() if "lora_B.tc_prime_prm." in n]
    policy = [p for n, p in model.named_parameters() if "lora_B.default." in n]
    assert prm and all(torch.isfinite(p).all() for p in prm)
    assert any(p.abs().sum() > 0 for p in prm) and any(p.abs().sum() > 0 for p in policy)  # both moved from B = 0
    assert not any(torch.equal(a, b) for a, b in zip(prm, policy))  # trained apart
    logs = trainer.state.log_history[0]
    assert logs["trl_credit/prime/prm_loss"] > 0 and "trl_credit/cost/prime/prm_update_seconds" in logs
    assert "trl_credit/cost/prime/prm_score_seconds" not in logs  # update: after scores in the step's own pass
