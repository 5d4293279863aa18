"""``RolloutBatch.probe``: short sampled continuations after completion prefixes plus a cue (`trl_credit.Probes`)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from trl_credit import Plugin, Probes, hookimpl
from trl_credit.testing import make_batch, run_plugin


class Probe(Plugin):
    seen: dict = {}

    @hookimpl
    def on_batch_end(self, batch, advantages):
        ends = torch.tensor([[0, 3]] * batch.num_completions)
        state = torch.get_rng_state()
        probes = batch.probe(ends, " =", num_samples=3, max_new_tokens=4, top_k=5)
        Probe.seen = {"batch": batch, "ends": ends, "probes": probes, "rng_kept": torch.equal(state, torch.get_rng_state()),
                      "again": batch.probe(ends, " =", num_samples=3, max_new_tokens=4, top_k=5)}


def test_probe_samples_and_their_logps_are_the_models(make_trainer, arithmetic):
    trainer = make_trainer(plugins=[Probe], max_completion_length=8)
    trainer.model.train()
    torch.manual_seed(0)
    trainer._generate_and_score_completions([copy.deepcopy(arithmetic[i // 4]) for i in range(8)])
    seen = Probe.seen
    batch, probes = seen["batch"], seen["probes"]
    assert isinstance(probes, Probes) and probes.tokens.shape == (8, 2, 3, 4) and probes.topk_ids.shape == (8, 2, 3, 4, 5)
    assert seen["rng_kept"]  # TRL's random stream is untouched by the probes
    assert seen["again"] is not probes and torch.equal(seen["again"].tokens, probes.tokens)  # cached
    tok = trainer.processing_class
    checked = 0
    for row in (0, 5):
        prompt = tok.apply_chat_template(batch.prompts[row], add_generation_prompt=True, tokenize=True, return_dict=True)
        for k, end in enumerate(seen["ends"][row].tolist()):
            base = list(prompt["input_ids"]) + batch.completion_ids[row, :end].tolist() + tok(" =", add_special_tokens=False)["input_ids"]
            for s in range(3):
                n = int(probes.mask[row, k, s].sum())
                sampled = probes.tokens[row, k, s, :n].tolist()
                ids = torch.tensor([base + sampled])
                with torch.no_grad():
                    logits = trainer.model(input_ids=ids).logits[0, len(base) - 1: len(base) - 1 + n].float()
                logp = torch.log_softmax(logits, -1)
                expected = logp.gather(-1, torch.tensor(sampled).unsqueeze(-1)).squeeze(-1)
                torch.testing.assert_close(probes.logps[row, k, s, :n], expected, rtol=1e-4, atol=1e-4)
                top = logp.topk(5, -1)
                torch.testing.assert_close(probes.topk_logps[row, k, s, :n], top.values, rtol=1e-4, atol=1e-4)
                assert probes.texts[row][k][s] == tok.decode(sampled, skip_special_tokens=True)
                checked += 1
    assert checked == 12
    assert (probes.topk_logps[..., 0] >= probes.logps - 1e-5)[probes.mask.bool()].all()
    logs = trainer._metrics["train"]
    assert logs["trl_credit/cost/probe_tokens"][0] == float(probes.mask.sum())


def test_token_logp_and_topk_entropy_on_a_hand_made_probe():
    def fn(row, end, cue, model):  # one sample of two tokens; top-2 lists
        return {"tokens": [[7, 8]], "logps": [[math.log(0.5), math.log(0.25)]],
                "topk_ids": [[[7, 3], [9, 8]]], "topk_logps": [[[math.log(0.5), math.log(0.5)],
                                                             [math.log(0.75), math.log(0.25)]]]}

    class Uses(Plugin):
        @hookimpl
        def shape_rewards(self, batch):
            Uses.probes = batch.probe(torch.tensor([[0], [-1]]), " A:", num_samples=1, max_new_tokens=3, top_k=2)

    run_plugin(Uses, make_batch([1, 0], 2, lengths=[2, 2], probe_fn=fn))
    probes = Uses.probes
    assert probes.valid.tolist() == [[True], [False]] and probes.texts[1][0] is None
    assert probes.mask[0, 0, 0].tolist() == [1, 1, 0]
    gold = torch.tensor([[7, 9, -1], [7, 9, -1]])
    got = probes.token_logp(gold)[0, 0, 0]
    assert got.tolist() == pytest.approx([math.log(0.5), math.log(0.75), -10.0])
    missing = probes.token_logp(torch.tensor([[1, 2, 3], [1, 2, 3]]))[0, 0, 0]
    assert missing.tolist() == [-10.0, -10.0, -10.0]  # not among the top-k: SPAE's floor
    h = probes.topk_entropy()[0, 0, 0]
    assert h[0].item() == pytest.approx(math.log(2)) and h[2].item() == 0.0
    assert h[1].item() == pytest.approx(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)))


class Judge(Plugin):
    seen: dict = {}

    @hookimpl
    def on_batch_end(self, batch, advantages):
        answers = batch.column("answer")
        texts = [f"The answer is {answers[0]}", "The answer is -1", f"{answers[5]}"]
        Judge.seen = {"batch": batch, "texts": texts, "scores": batch.score_texts([0, 3, 5], texts)}


def test_score_texts_runs_the_runs_reward_functions(make_trainer, arithmetic):
    from trl_credit.app.rewards import arithmetic_accuracy

    trainer = make_trainer(plugins=[Judge])
    trainer.model.train()
    torch.manual_seed(0)
    trainer._generate_and_score_completions([copy.deepcopy(arithmetic[i // 4]) for i in range(8)])
    seen = Judge.seen
    batch = seen["batch"]
    expected = arithmetic_accuracy([[{"role": "assistant", "content": t}] for t in seen["texts"]],
                                   answer=[batch.column("answer")[r] for r in (0, 3, 5)])
    assert seen["scores"].shape == (3, 1) and seen["scores"][:, 0].tolist() == expected == [1.0, 0.0, 1.0]
    assert trainer._metrics["train"]["trl_credit/cost/score_texts_seconds"]


def test_score_texts_in_the_kit():
    class Uses(Plugin):
        @hookimpl
        def shape_rewards(self, batch):
            Uses.out = batch.select(torch.tensor([2, 3])).score_texts([1], ["x"])

    run_plugin(Uses, make_batch([1, 0, 1, 0], 2, score_fn=lambda row, text: [row, None]))
    assert Uses.out[0, 0].item() == 3.0 and math.isnan(Uses.out[0, 1])


class Soft(Plugin):
    seen: dict = {}

    @hookimpl
    def on_batch_end(self, batch, advantages):
        Soft.seen = {"batch": batch, "ref": batch.soft_values("reference"), "ref_logps": batch.ref_logps(),
                     "policy": batch.soft_values("policy", temperature=0.5), "logps": batch.policy_logps()}


def test_soft_values_are_the_logits_read_as_soft_q(make_trainer, arithmetic):
    from peft import LoraConfig

    trainer = make_trainer(plugins=[Soft], peft_config=LoraConfig(r=4, target_modules="all-linear",
                                                                  init_lora_weights=False))
    trainer.model.train()
    torch.manual_seed(0)
    trainer._generate_and_score_completions([copy.deepcopy(arithmetic[i // 4]) for i in range(8)])
    seen = Soft.seen
    batch = seen["batch"]
    mask = batch.completion_mask.bool()
    q, v = seen["ref"]
    assert q.shape == batch.completion_ids.shape and v.shape == (q.shape[0], q.shape[1] + 1)
    # Q_t - V_t is the token's log-prob at temperature 1: TRL's own reference log-probs (temperature 1 here)
    torch.testing.assert_close((q - v[:, :-1])[mask], seen["ref_logps"][mask], rtol=1e-4, atol=1e-4)
    # V after the last token: an independent forward pass of the reference (adapters off)
    tok = trainer.processing_class
    row = 0
    length = int(batch.completion_lengths[row])
    prompt = tok.apply_chat_template(batch.prompts[row], add_generation_prompt=True, tokenize=True, return_dict=True)
    ids = torch.tensor([list(prompt["input_ids"]) + batch.completion_ids[row, :length].tolist()])
    with torch.no_grad(), trainer.model.disable_adapter():
        last = trainer.model(input_ids=ids).logits[0, -1].float()
    assert v[row, length].item() == pytest.approx(torch.logsumexp(last, -1).item(), abs=1e-3)
    q2, v2 = seen["policy"]  # another temperature: V = 0.5 * logsumexp(logits / 0.5)
    assert not torch.allclose(v2, v) and torch.isfinite(v2).all()
    assert trainer._metrics["train"]["trl_credit/cost/soft_values_seconds"]


def test_answer_prefix_is_the_cue_after_its_last_think_close():
    from trl_credit import answer_prefix

    assert answer_prefix("\n</think>\nThe final answer is") == "The final answer is"  # MRT's cue
    assert answer_prefix("Time is up.\n</think>\n\n**Answer:**") == "**Answer:**"
    assert answer_prefix("a</think>b</think>  c") == "c"  # the last one
    assert answer_prefix("  My final answer is") == "My final answer is"  # no </think>: only stripped
    assert answer_prefix("\n</think>") == ""


def test_has_answer_reads_missing_cells_as_no_answer():
    from trl_credit import has_answer

    assert [has_answer(v) for v in (None, float("nan"), "", "  ", "5", 0, 0.0, "None")] == \
        [False, False, False, False, True, True, True, True]
