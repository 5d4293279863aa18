"""endogenous_reward: the inverse soft-Bellman reward on hand-computed logits, the telescoping identity, the
terminal rule, the check, the contract and a real run that reads the reference's logits."""

from __future__ import annotations

import math

import pytest
import torch
from peft import LoraConfig

from trl_credit import ConfigError
from trl_credit.testing import check_args, check_plugin, make_batch, run_plugin, train_tiny
from trl_credit_endogenous_reward import EndogenousReward, endogenous_rewards

EOS = 9
IDS = [[3, EOS], [4, 5]]  # row 0 ended with EOS, row 1 was cut at the width (no EOS)
Q = torch.tensor([[2.0, 1.0], [0.5, 1.5]])
V = torch.tensor([[3.0, 2.5, 1.0], [1.0, 2.0, 4.0]])  # V(s_0), V(s_1), V(s_2 = after the last token)


def batch(**kw):
    return make_batch([1.0, 0.0], 2, completion_ids=IDS, pad_token_id=0, eos_token_id=EOS, soft_values=(Q, V),
                      reward_names=["accuracy"], **kw)


def test_token_rewards_vector_and_terminal_rule():
    mask = torch.ones(2, 2)
    r = endogenous_rewards(Q, V, mask, torch.tensor([True, False]))
    # row 0: [2 - 2.5, 1 - 0 (ended: V after EOS = 0)] ; row 1: [0.5 - 2, 1.5 - 4] (cut: the model's V)
    torch.testing.assert_close(r, torch.tensor([[-0.5, 1.0], [-1.5, -2.5]]))
    kept = endogenous_rewards(Q, V, mask, torch.tensor([True, False]), terminal="logits")
    assert kept[0, 1].item() == pytest.approx(0.0)  # 1 - V(s_2) = 1 - 1
    # a shorter row (one token) that ended: V after its own last token is 0, not V after the batch's width
    short = endogenous_rewards(Q, V, torch.tensor([[1.0, 1.0], [1.0, 0.0]]), torch.tensor([True, True]))
    torch.testing.assert_close(short, torch.tensor([[-0.5, 1.0], [0.5, 0.0]]))  # row 1: 0.5 - 0, then padding


def test_the_sum_telescopes_to_log_likelihood_plus_values():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, generator=g)  # (N, T + 1, vocab): states s_0 .. s_T
    ids = torch.randint(0, 7, (3, 4), generator=g)
    q = logits[:, :4].gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    v = torch.logsumexp(logits, -1)
    mask = torch.ones(3, 4)
    r = endogenous_rewards(q, v, mask, torch.zeros(3, dtype=torch.bool))
    logp = torch.log_softmax(logits[:, :4], -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(r.sum(1), logp.sum(1) + v[:, 0] - v[:, 4])


def test_reward_column_sum_and_mean():
    result = run_plugin(EndogenousReward, batch())
    assert result.reward_names == ["accuracy", "endogenous_reward"]
    torch.testing.assert_close(result.rewards[:, 1], torch.tensor([0.5, -4.0]))
    mean = run_plugin(EndogenousReward, batch(), {"reduce": "mean", "column": "accuracy"})
    torch.testing.assert_close(mean.rewards[:, 0], torch.tensor([0.25, -2.0]))  # replaces the column


def test_check_and_contract():
    with pytest.raises(ConfigError, match=r"\(endogenous_reward\) reads the reference model with these options, but this run has none \(no PEFT adapter, beta 0\): train a PEFT adapter"):
        check_args(EndogenousReward, {}, peft=False)
    check_args(EndogenousReward, {}, peft=True)
    check_args(EndogenousReward, {"model": "policy"}, peft=False)

    def edge():
        n = 8
        g = torch.Generator().manual_seed(1)
        return make_batch([1, 0, 1, 0, None, 1, 0, 0], 4, lengths=[3, 0, 2, 4, 1, 4, 4, 2],
                          soft_values=(torch.randn(n, 4, generator=g), torch.randn(n, 5, generator=g)))

    check_plugin(EndogenousReward, batches=[edge])


def test_reads_the_reference_logits_in_a_real_run(tmp_path):
    trainer = train_tiny(["endogenous_reward"], output_dir=tmp_path, peft_config=LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0), max_steps=1)
    logs = trainer.state.log_history[0]
    assert math.isfinite(logs["trl_credit/endogenous_reward/reward"]) and logs["trl_credit/endogenous_reward/reward"] < 0
    assert logs["trl_credit/cost/soft_values_seconds"] > 0
