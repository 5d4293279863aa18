"""PPPO: the prefix mask (methods.md 2.21's vector), the ramp, the loss weights through the host, the
continuation-accumulated reward on hand-made probes and scores, the contract, and a real training run."""

from __future__ import annotations

import math

import pytest
import torch

from trl_credit.testing import (check_args, check_plugin, loss_inputs, make_batch, run_loss, run_plugin,
                                tiny_tokenizer, train_tiny)
from trl_credit_pppo import PPPO, prefix_lengths, prefix_mask


def test_prefix_mask_vector_and_ceil():
    mask = torch.ones(1, 10)
    assert prefix_mask(mask, 0.3)[0].tolist() == [1, 1, 1, 0, 0, 0, 0, 0, 0, 0]  # |o| = 10, rho = 0.3
    assert prefix_lengths(torch.tensor([10, 7, 0, 1]), 0.25).tolist() == [3, 2, 0, 1]  # ceil(2.5), ceil(1.75)
    # loss tokens only are counted: an environment reply (mask 0) in the middle is skipped
    gappy = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0]])
    assert prefix_mask(gappy, 0.75)[0].tolist() == [1, 1, 0, 0, 1, 0, 0]  # ceil(0.75 * 4) = 3 loss tokens


def test_ramp_is_linear_and_reads_max_steps():
    plugin = PPPO(PPPO.Config(rho_start=0.2, rho_end=0.6, ramp_steps=10))
    assert [plugin.rho(s) for s in (0, 5, 10, 50)] == pytest.approx([0.2, 0.4, 0.6, 0.6])
    check_args(PPPO, {}, max_steps=40)  # a valid run
    from trl_credit import RunInfo
    from trl_credit.testing import default_args

    p = PPPO()
    p.check_args(RunInfo(args=default_args(max_steps=40)))
    assert p.rho(20) == pytest.approx(0.35)  # halfway from 0.2 to 0.5 over 40 steps
    with pytest.raises(ValueError, match="rho_end"):
        PPPO.Config(rho_start=0.5, rho_end=0.2)


def test_loss_weights_through_the_host():
    batch = make_batch([1, 0, 1, 0], 2, lengths=[10, 4, 0, 7], step=0)
    li = loss_inputs(batch, torch.tensor([1.0, -1.0, 1.0, -1.0]))
    result = run_loss(PPPO, li, {"rho_start": 0.3, "rho_end": 0.3})
    token = result.weights.token
    assert token[0].tolist() == [1, 1, 1, 0, 0, 0, 0, 0, 0, 0]
    assert token[1].tolist()[:4] == [1, 1, 0, 0]  # ceil(1.2) = 2
    assert token[2].sum() == 0 and token[3].tolist()[:7] == [1, 1, 1, 0, 0, 0, 0]  # ceil(2.1) = 3


def test_the_trained_prefix_is_the_scored_one_when_a_generation_serves_several_steps():
    import dataclasses

    batch = make_batch([1, 0], 2, lengths=[10, 10], step=0)  # generated at step 0 (rho 0.2), trained at step 20
    li = dataclasses.replace(loss_inputs(batch, torch.tensor([1.0, -1.0])), step=20)
    token = run_loss(PPPO, li, {"ramp_steps": 40}).weights.token
    assert token[0].tolist() == [1, 1] + [0] * 8  # rho(0) = 0.2 of 10 tokens, not rho(20) = 0.35


def test_continuation_accumulated_reward():
    # prefix texts come from the ids via the tokenizer: use a real one so decode works


    tok = tiny_tokenizer()
    texts = ["1 2 3 4", "5 6 7 8"]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]

    def probe_fn(row, end, cue, model):  # two continuations per prefix
        return {"tokens": [[5, 5], [6, 6]], "texts": [" good", " bad"]}

    def score_fn(row, text):
        return 1.0 if text.endswith("good") else 0.0

    batch = make_batch([0.0, 1.0], 2, completion_ids=ids, completions=texts, tokenizer=tok, probe_fn=probe_fn,
                       score_fn=score_fn)
    result = run_plugin(PPPO, batch, {"continuations": 2, "rho_start": 0.5, "rho_end": 0.5})
    # mean over {own reward, 1 (good), 0 (bad)}: row 0 (0 + 1 + 0) / 3, row 1 (1 + 1 + 0) / 3
    torch.testing.assert_close(result.rewards[:, 0], torch.tensor([1 / 3, 2 / 3]))
    alone = run_plugin(PPPO, batch, {"continuations": 2, "include_original": False})
    torch.testing.assert_close(alone.rewards[:, 0], torch.tensor([0.5, 0.5]))
    # no continuation of row 1 can be scored: it keeps its own reward (a NaN there would stop the run)
    seen = []

    def unscorable(row, text):
        seen.append((row, text))
        return None if row == 1 else score_fn(row, text)

    batch = make_batch([0.0, 1.0], 2, completion_ids=ids, completions=texts, tokenizer=tok, probe_fn=probe_fn,
                       score_fn=unscorable)
    kept = run_plugin(PPPO, batch, {"continuations": 2, "include_original": False, "rho_start": 0.5, "rho_end": 0.5})
    torch.testing.assert_close(kept.rewards[:, 0], torch.tensor([0.5, 1.0]))
    # each continuation is scored after the decoded kept prefix (half of the row's tokens)
    assert [t for r, t in seen if r == 0] == [tok.decode(ids[0][: (len(ids[0]) + 1) // 2]) + s for s in (" good", " bad")]


def test_contract():
    check_plugin(PPPO)
    check_plugin(PPPO, {"rho_start": 1.0, "rho_end": 1.0})


def test_trains_on_the_tiny_model(tmp_path):
    trainer = train_tiny([{"name": "pppo", "continuations": 1}], output_dir=tmp_path, max_steps=2)
    logs = trainer.state.log_history[0]
    assert 0.0 < logs["trl_credit/pppo/retained_fraction"] <= 0.5 and logs["trl_credit/pppo/rho"] >= 0.2
    assert math.isfinite(logs["trl_credit/pppo/continuation_reward"]) and logs["trl_credit/cost/probe_tokens"] > 0
