"""``RolloutBatch.prefix_logps`` (a continuation after each completion prefix) and ``step_ends`` (the prefixes)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from trl_credit import Plugin, hookimpl, step_ends
from trl_credit.testing import make_batch, run_plugin


class AfterSteps(Plugin):
    """Scores " 42" after the prompt, after each step and after the whole completion, under policy and adapter."""

    seen: dict = {}

    @hookimpl
    def on_batch_end(self, batch, advantages):
        ends = torch.cat([torch.zeros(batch.num_completions, 1, dtype=torch.long), step_ends(batch)], dim=1)
        gold = [" 42"] * batch.num_completions
        AfterSteps.seen = {"batch": batch, "ends": ends, "mean": batch.prefix_logps(ends, gold),
                           "none": batch.prefix_logps(ends, gold, reduce="none"),
                           "ref": batch.prefix_logps(ends, gold, model="reference", reduce="sum"),
                           "context": batch.prefix_logps(ends, gold, reduce="none", context="\nThe answer is")}


def _independent(trainer, batch, row, end, text, adapters=True, context=""):
    tok = trainer.processing_class
    prompt = tok.apply_chat_template(batch.prompts[row], add_generation_prompt=True, tokenize=True, return_dict=True)
    cont = tok(text, add_special_tokens=False)["input_ids"]
    ctx = tok(context, add_special_tokens=False)["input_ids"] if context else []
    ids = torch.tensor([list(prompt["input_ids"]) + batch.completion_ids[row, :end].tolist() + ctx + cont])
    with torch.no_grad():
        if adapters:
            logits = trainer.model(input_ids=ids).logits[0, :-1]
        else:
            with trainer.model.disable_adapter():
                logits = trainer.model(input_ids=ids).logits[0, :-1]
    logps = torch.log_softmax(logits[-len(cont):].float() / trainer.temperature, -1)
    return logps.gather(-1, torch.tensor(cont).unsqueeze(-1)).squeeze(-1)


def test_continuations_after_each_prefix_equal_independent_forward_passes(make_trainer, arithmetic):
    from peft import LoraConfig

    trainer = make_trainer(plugins=[AfterSteps], max_completion_length=12,
                           peft_config=LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    trainer.model.train()
    torch.manual_seed(0)
    trainer._generate_and_score_completions([copy.deepcopy(arithmetic[i // 4]) for i in range(8)])
    seen = AfterSteps.seen
    batch, ends = seen["batch"], seen["ends"]
    checked = 0
    for row in (0, 3, 6):
        for k, end in enumerate(ends[row].tolist()):
            if end < 0:
                assert math.isnan(seen["mean"][row, k]) and seen["none"][row, k].abs().sum() == 0
                continue
            expected = _independent(trainer, batch, row, end, " 42")
            torch.testing.assert_close(seen["none"][row, k, : len(expected)], expected, rtol=1e-4, atol=1e-5)
            assert seen["mean"][row, k].item() == pytest.approx(expected.mean().item(), abs=1e-5)
            with_context = _independent(trainer, batch, row, end, " 42", context="\nThe answer is")
            torch.testing.assert_close(seen["context"][row, k, : len(with_context)], with_context, rtol=1e-4, atol=1e-5)
            ref = _independent(trainer, batch, row, end, " 42", adapters=False)
            assert seen["ref"][row, k].item() == pytest.approx(ref.sum().item(), abs=1e-4)
            checked += 1
    assert checked >= 6
    logs = trainer._metrics["train"]
    assert logs["trl_credit/cost/prefix_sequences"] and logs["trl_credit/cost/prefix_seconds"][0] > 0


def test_step_ends_are_the_token_positions_just_past_each_step():
    from transformers import AutoTokenizer

    from trl_credit.testing.tiny import local_tokenizer_path

    tok = AutoTokenizer.from_pretrained(local_tokenizer_path())
    texts = ["1 + 2 = 3\n3 + 4 = 7\n7", "just one step", "a\n\nb"]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    batch = make_batch([1, 0, 1], 1, completion_ids=ids, completions=texts, tokenizer=tok)
    ends = step_ends(batch)
    for row, text in enumerate(texts):
        count = len([line for line in text.split("\n") if line.strip()])
        got = [e for e in ends[row].tolist() if e >= 0]
        assert len(got) == count and got[-1] == len(ids[row]) and got == sorted(got)
        for e in got[:-1]:  # each prefix ends on a newline: the delimiter closes its step
            assert tok.decode(ids[row][:e]).endswith("\n")
    eos_ids = [ids[0] + [tok.eos_token_id], ids[1]]
    finished = make_batch([1, 0], 1, completion_ids=eos_ids, completions=texts[:2], tokenizer=tok)
    assert step_ends(finished)[0].max().item() == len(ids[0]) + 1  # the EOS is in the last step
    assert step_ends(finished, eos=False)[0].max().item() == len(ids[0])  # ... or left out
    assert step_ends(finished, eos=False)[1].max().item() == len(ids[1])  # a row without EOS is unchanged
    capped = step_ends(batch, max_steps=2)
    assert capped.shape == (3, 2)
    assert capped[0].tolist() == [e for e in ends[0].tolist() if e >= 0][-2:]
    assert capped[1].tolist() == [len(ids[1]), -1]


def test_the_kit_and_views_use_the_same_cache():
    calls = []

    def fn(row, end, text, model):
        calls.append((row, end))
        return [-0.5 * (end + 1), -1.0]

    class Uses(Plugin):
        @hookimpl
        def shape_rewards(self, batch):
            ends = torch.tensor([[0, 2], [0, -1], [1, 3], [0, 0]])
            Uses.out = batch.prefix_logps(ends, ["x"] * 4, reduce="sum")
            Uses.again = batch.select(torch.arange(2, 4)).prefix_logps(ends[2:], ["x"] * 2, reduce="mean")

    run_plugin(Uses, make_batch([1, 0, 1, 0], 2, lengths=[3, 3, 3, 3], prefix_logps_fn=fn))
    torch.testing.assert_close(Uses.out[0], torch.tensor([-1.5, -2.5]))
    assert math.isnan(Uses.out[1, 1])
    torch.testing.assert_close(Uses.again, torch.tensor([[-1.0, -1.5], [-0.75, -0.75]]))
    assert len(calls) == len(set(calls)) == 6  # every (row, end) once, the view's from the cache
    with pytest.raises(ValueError, match="past the completion width"):
        make_batch([1, 0], 2, lengths=[2, 2], prefix_logps_fn=fn).prefix_logps(torch.tensor([[5], [0]]), ["x", "x"])
