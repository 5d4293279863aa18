"""``RolloutBatch.completion_logps``: the batch's own completion tokens re-scored under other prompts."""

from __future__ import annotations

import copy

import pytest
import torch

from trl_credit import Plugin, hookimpl
from trl_credit.testing import make_batch


class Rescore(Plugin):
    """Scores every completion under its own prompt and under the prompt with a privileged hint."""

    seen: dict = {}

    @hookimpl
    def on_batch_end(self, batch, advantages):
        hinted = [[{"role": "system", "content": "Hint: add the two numbers."}, *p] for p in batch.prompts]
        Rescore.seen = {"batch": batch, "own": batch.completion_logps(batch.prompts),
                        "hinted": batch.completion_logps(hinted), "hinted_prompts": hinted,
                        "policy": batch.policy_logps(), "again": batch.completion_logps(hinted)}


def _round(make_trainer, arithmetic, **overrides):
    trainer = make_trainer(plugins=[Rescore], **overrides)
    trainer.model.train()
    torch.manual_seed(0)
    trainer._generate_and_score_completions([copy.deepcopy(arithmetic[i // 4]) for i in range(8)])
    return trainer, Rescore.seen


def _independent(trainer, prompts, batch):
    """Log-softmax of one plain forward pass per row: prompt ids from the chat template + the completion ids."""
    tok = trainer.processing_class
    out = torch.zeros(batch.completion_ids.shape)
    for i, prompt in enumerate(prompts):
        prompt_ids = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)
        ids = torch.tensor([list(prompt_ids["input_ids"]) + batch.completion_ids[i].tolist()])
        with torch.no_grad():
            logits = trainer.model(input_ids=ids).logits[0, :-1] / trainer.temperature
        t = batch.completion_ids.shape[1]
        logps = torch.log_softmax(logits[-t:].float(), -1).gather(-1, batch.completion_ids[i].unsqueeze(-1)).squeeze(-1)
        out[i] = logps * batch.completion_mask[i]
    return out


def test_under_its_own_prompt_it_is_the_policy_logps(make_trainer, arithmetic):
    trainer, seen = _round(make_trainer, arithmetic)
    mask = seen["batch"].completion_mask.float()
    torch.testing.assert_close(seen["own"], seen["policy"] * mask, rtol=1e-4, atol=1e-5)


def test_under_another_prompt_it_is_an_independent_forward_pass(make_trainer, arithmetic):
    trainer, seen = _round(make_trainer, arithmetic)
    expected = _independent(trainer, seen["hinted_prompts"], seen["batch"])
    torch.testing.assert_close(seen["hinted"], expected, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(seen["hinted"], seen["own"])  # the context changed the scores
    assert seen["again"] is not seen["hinted"] and torch.equal(seen["again"], seen["hinted"])  # cached values


def test_the_reference_scores_with_adapters_disabled(make_trainer, arithmetic):
    from peft import LoraConfig

    class RefRescore(Plugin):
        @hookimpl
        def on_batch_end(self, batch, advantages):
            RefRescore.out = (batch.completion_logps(batch.prompts, model="reference"), batch.ref_logps())

    trainer = make_trainer(plugins=[RefRescore], peft_config=LoraConfig(r=4, target_modules="all-linear",
                                                                         init_lora_weights=False))
    trainer.model.train()
    torch.manual_seed(0)
    out = trainer._generate_and_score_completions([copy.deepcopy(arithmetic[i // 4]) for i in range(8)])
    ours, ref = RefRescore.out
    torch.testing.assert_close(ours, ref * out["completion_mask"].float(), rtol=1e-4, atol=1e-5)


def test_the_kit_takes_a_function_and_checks_lengths():
    batch = make_batch([1, 0, 0, 1], 2, lengths=[2, 3, 1, 3],
                       completion_logps_fn=lambda row, prompt, model: [float(row), -1.0, len(str(prompt))])
    out = batch.completion_logps(["a", "bb", "ccc", "d"])
    assert out[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0] and out[:, 2].tolist() == [1.0, 2.0, 3.0, 1.0]
    view = batch.select(torch.tensor([2, 3]))
    assert view.completion_logps(["ccc", "d"])[:, 0].tolist() == [2.0, 3.0]  # root rows, shared cache
    with pytest.raises(ValueError, match="3 prompts for 4 completions"):
        batch.completion_logps(["a", "b", "c"])
    with pytest.raises(RuntimeError, match="completion_logps_fn="):
        make_batch([1, 0], 2).completion_logps(["a", "b"])
