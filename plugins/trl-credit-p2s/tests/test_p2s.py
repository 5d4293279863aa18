"""P2S: hand-computed vectors (no methods.md vector exists) for both normalisations and both alignments, the
prefixes (EOS left out, max_steps), edge cases, the checks, the contract, and a real training run."""

from __future__ import annotations

import math

import pytest
import torch

from trl_credit import ConfigError, group_normalise
from trl_credit.testing import (check_args, check_plugin, make_batch, plugin_set, run_plugin, tiny_dataset,
                                tiny_tokenizer, train_tiny)
from trl_credit_p2s import P2S, proportional_suffixes, token_step_index

# two completions of one prompt, two steps each; with one character per token, "ab\ncd" has step ends [3, 5]
TEXTS = ["ab\ncd", "xy\nzw"]
# PFR after the prompt, after step 1, after step 2
PFR = {(0, 0): 0.2, (0, 3): 0.5, (0, 5): 0.6, (1, 0): 0.2, (1, 3): 0.1, (1, 5): 0.4}
A_OUT = 0.5 / (math.sqrt(0.5) + 1e-4)  # GRPO on rewards [1, 0]: (r - 0.5) / (unbiased std + 1e-4) = 0.707007


def batch_of(texts=TEXTS, rewards=(1.0, 0.0), gold=None, pfr=PFR, calls=None, lengths=None, num_generations=2):
    def fn(row, end, text, model):
        if calls is not None:
            calls.append((row, end, text, model))
        return [math.log(pfr[(row, end)])] * 2  # two gold tokens, both log PFR: the mean is log PFR

    return make_batch(list(rewards), num_generations, completions=texts,
                      lengths=lengths if lengths is not None else [len(t) for t in texts],
                      columns={"gold_cot": gold if gold is not None else ["g1\ng2\ng3"] * len(texts)},
                      prefix_logps_fn=fn, reward_names=["accuracy"])


def test_group_normalised_gains_broadcast_to_their_steps():
    # gains c0 [0.5 - 0.2, 0.6 - 0.5] = [0.3, 0.1], c1 [-0.1, 0.3]; pooled mean 0.15,
    # population std sqrt((0.15^2 + 0.05^2 + 0.25^2 + 0.15^2) / 4) = 0.165831
    # z = [0.904529, -0.301510, -1.507548, 0.904529]; steps: tokens 0-2 ("ab\n"), tokens 3-4 ("cd")
    result = run_plugin(P2S, batch_of())
    z = torch.tensor([[0.904529, -0.301510], [-1.507548, 0.904529]])
    credit = z[:, [0, 0, 0, 1, 1]]
    expected = torch.tensor([[A_OUT], [-A_OUT]]) + 0.1 * credit
    torch.testing.assert_close(result.advantages, expected, atol=1e-5, rtol=0)
    m = result.metrics
    assert m["p2s/pfr_prompt"] == pytest.approx(0.2) and m["p2s/pfr_final"] == pytest.approx(0.5)
    assert m["p2s/gain"] == pytest.approx(0.15) and m["p2s/steps"] == 2.0
    assert m["p2s/credit_abs"] == pytest.approx(0.1 * (3 * 0.904529 + 2 * 0.301510 + 3 * 1.507548 + 2 * 0.904529) / 10,
                                                abs=1e-6)


def test_raw_gains_and_the_coefficient():
    # normalize none, coef 2: credit = 2 * gain: c0 [0.6, 0.2], c1 [-0.2, 0.6]
    result = run_plugin(P2S, batch_of(), {"normalize": "none", "coef": 2.0})
    expected = torch.tensor([[A_OUT + 0.6] * 3 + [A_OUT + 0.2] * 2, [-A_OUT - 0.2] * 3 + [-A_OUT + 0.6] * 2])
    torch.testing.assert_close(result.advantages, expected, atol=1e-5, rtol=0)
    # coef 0: the outcome advantage, broadcast
    flat = run_plugin(P2S, batch_of(), {"coef": 0.0}).advantages
    torch.testing.assert_close(flat, torch.tensor([[A_OUT] * 5, [-A_OUT] * 5]), atol=1e-6, rtol=0)


def test_group_normalise_pools_each_group_apart():  # the host's, as P2S normalises its gains
    gains = torch.tensor([[0.3, 0.1], [-0.1, 0.3], [0.2, 0.0], [0.4, 0.0]])
    valid = torch.tensor([[True, True], [True, True], [True, False], [True, False]])
    z = group_normalise(gains, valid, 2)
    # group 2: gains [0.2, 0.4], mean 0.3, std 0.1 -> [-1, 1] (over std + 1e-6); invalid entries 0
    torch.testing.assert_close(z[2:], torch.tensor([[-0.99999, 0.0], [0.99999, 0.0]]), atol=1e-5, rtol=0)
    torch.testing.assert_close(z[:2], torch.tensor([[0.904529, -0.301510], [-1.507548, 0.904529]]), atol=1e-5, rtol=0)


def test_full_alignment_scores_the_whole_gold_cot_after_every_prefix():
    calls = []
    run_plugin(P2S, batch_of(calls=calls))
    assert sorted((row, end) for row, end, _, _ in calls) == sorted(PFR)
    assert {text for _, _, text, _ in calls} == {"g1\ng2\ng3"} and {m for *_, m in calls} == {"policy"}
    calls.clear()
    run_plugin(P2S, batch_of(calls=calls), {"model": "reference"})
    assert {m for *_, m in calls} == {"reference"}


def test_proportional_alignment_scores_the_remaining_gold_steps():
    # M = 3 gold steps, K = 2 model steps: s_k = min(floor(k * 3 / 2), 2) = 0, 1, 2
    assert proportional_suffixes("g1\ng2\ng3", 2, 3) == ["g1\ng2\ng3", "g2\ng3", "g3"]
    # M = 2, K = 3: s_k = min(floor(2k / 3), 1) = 0, 0, 1, 1; past K: ""
    assert proportional_suffixes("u\n\nv", 3, 5) == ["u\n\nv", "u\n\nv", "v", "v", ""]
    assert proportional_suffixes("  ", 2, 2) == ["", ""]
    calls = []
    result = run_plugin(P2S, batch_of(calls=calls), {"alignment": "proportional"})
    assert sorted((row, end, text) for row, end, text, _ in calls) == [
        (0, 0, "g1\ng2\ng3"), (0, 3, "g2\ng3"), (0, 5, "g3"), (1, 0, "g1\ng2\ng3"), (1, 3, "g2\ng3"), (1, 5, "g3")]
    # the same PFR table, so the same advantages as the full alignment
    torch.testing.assert_close(result.advantages, run_plugin(P2S, batch_of()).advantages)


def test_max_steps_merges_early_steps_into_the_first_kept_one():
    # "a\nb\nc\nd": 4 steps, ends [2, 4, 6, 7]; max_steps 2 keeps the ends [6, 7]: prefixes 0, 6, 7
    texts = ["a\nb\nc\nd", "w\nx\ny\nz"]
    table = {(r, e): p for r in (0, 1) for e, p in ((0, 0.2), (6, 0.3 + 0.2 * r), (7, 0.5))}
    calls = []
    result = run_plugin(P2S, batch_of(texts=texts, pfr=table, calls=calls), {"max_steps": 2, "normalize": "none",
                                                                            "coef": 1.0})
    assert sorted({end for _, end, _, _ in calls}) == [0, 6, 7]
    # gains c0 [0.1, 0.2], c1 [0.3, 0.0]: tokens 0-5 take step 1's gain (the merged steps), token 6 step 2's
    delta = result.advantages - torch.tensor([[A_OUT], [-A_OUT]])
    torch.testing.assert_close(delta, torch.tensor([[0.1] * 6 + [0.2], [0.3] * 6 + [0.0]]), atol=1e-5, rtol=0)


def test_token_step_index():
    ends = torch.tensor([[3, 5], [2, -1]])
    assert token_step_index(ends, 5).tolist() == [[0, 0, 0, 1, 1], [0, 0, 1, 1, 1]]  # 1 past row 1's only step


def test_the_prefixes_leave_out_eos():


    tok = tiny_tokenizer()  # the tiny model's (SmolLM2) tokenizer
    texts = ["First step\nthen 42", "One line"]
    ids = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    calls = []
    batch = make_batch([1.0, 0.0], 2, completions=texts, completion_ids=ids, tokenizer=tok,
                       columns={"gold_cot": ["a\nb", "a\nb"]},
                       prefix_logps_fn=lambda row, end, text, model: calls.append((row, end)) or [-1.0])
    result = run_plugin(P2S, batch)
    first = len(tok("First step\n", add_special_tokens=False)["input_ids"])
    assert sorted(calls) == [(0, 0), (0, first), (0, len(ids[0]) - 1), (1, 0), (1, len(ids[1]) - 1)]
    assert torch.isfinite(result.advantages).all()


def test_rows_without_gold_or_steps_get_no_step_credit():
    # c1 has no gold CoT, c3 is empty: neither is scored; c0 and c2 (two groups of 2) are; constant PFR -> gains 0
    texts = ["ab\ncd", "xy\nzw", "ab\ncd", ""]
    calls = []
    table = {(r, e): 0.5 for r in range(4) for e in (0, 3, 5)}
    result = run_plugin(P2S, batch_of(texts=texts, rewards=(1.0, 0.0, 1.0, 0.0), gold=["g", None, "g", "g"],
                                      pfr=table, calls=calls, lengths=[5, 5, 5, 0]))
    assert {row for row, *_ in calls} == {0, 2}
    base = run_plugin(P2S, batch_of(texts=texts, rewards=(1.0, 0.0, 1.0, 0.0), gold=[""] * 4, pfr=table,
                                    lengths=[5, 5, 5, 0]))
    assert base.metrics["p2s/steps"] == 0.0  # nothing scored: the advantages pass through
    torch.testing.assert_close(result.advantages, base.advantages.unsqueeze(1).expand(4, 5))
    assert torch.isfinite(result.advantages).all()
    # c2 unscored (every reward None): not scored either, and GRPO's 0 stands
    calls.clear()
    result = run_plugin(P2S, batch_of(texts=texts, rewards=(1.0, 0.0, None, 0.0), gold=["g", None, "g", "g"],
                                      pfr=table, calls=calls, lengths=[5, 5, 5, 0]))
    assert {row for row, *_ in calls} == {0} and (result.advantages[2] == 0).all()


def test_per_token_incoming_advantages():
    instance = plugin_set(P2S, {"normalize": "none"}).plugins[0].instance
    batch = batch_of()
    incoming = torch.arange(10, dtype=torch.float32).reshape(2, 5)
    out = instance.transform_advantages(batch, incoming)
    gains = torch.tensor([[0.3, 0.3, 0.3, 0.1, 0.1], [-0.1, -0.1, -0.1, 0.3, 0.3]])
    torch.testing.assert_close(out, incoming + 0.1 * gains, atol=1e-6, rtol=0)


def test_checks():
    check_args(P2S, columns=("prompt", "gold_cot"))
    check_args(P2S, {"model": "reference"}, columns=("prompt", "gold_cot"))  # PEFT: the base model
    check_args(P2S, {"model": "reference"}, columns=("prompt", "gold_cot"), peft=False, beta=0.04)
    with pytest.raises(ConfigError, match=r"\(p2s\) reads the reference model with these options, but this run has none \(no PEFT adapter, beta 0\): train a PEFT adapter"):
        check_args(P2S, {"model": "reference"}, columns=("prompt", "gold_cot"), peft=False)
    with pytest.raises(ConfigError, match="gold_cot"):
        check_args(P2S, columns=("prompt", "answer"))  # the host: the dataset has no such column
    with pytest.raises(ConfigError, match="pattern"):
        check_args(P2S, {"gold_pattern": "("}, columns=("prompt", "gold_cot"))
    with pytest.raises(ConfigError, match="max_steps"):
        check_args(P2S, {"max_steps": 0}, columns=("prompt", "gold_cot"))


def contract_batches():
    def scored(rewards, g, texts):
        def fn(row, end, text, model):
            return [-0.1 * (1 + row) - 0.05 * end - 0.01 * len(text)] * 3

        return lambda: make_batch(rewards, g, completions=texts, lengths=[len(t) for t in texts],
                                  columns={"gold_cot": ["s1\ns2\ns3"] * len(texts)}, prefix_logps_fn=fn,
                                  reward_names=["accuracy"])

    mixed = ["a\nbb\nc", "dd", "e\nf", "", "g\nh\ni\nj", "k", "l\nm", "n\n\no"]
    return [scored([1, 0, 1, 0, 1, 1, 0, 0], 4, mixed),             # mixed groups, an empty completion
            scored([1, 1, 1, 1, 0, 0, 0, 0], 4, mixed),             # constant groups
            scored([1, None, 0, 1, None, None, None, None], 4, mixed),  # NaN rewards
            scored([1, 0, 1], 1, ["a\nb", "c", "d\ne\nf"])]           # one completion per group


def test_contract():
    check_plugin(P2S, batches=contract_batches())
    check_plugin(P2S, {"alignment": "proportional", "normalize": "none", "max_steps": 2}, batches=contract_batches())


def test_trains_on_the_tiny_model(tmp_path):
    dataset = tiny_dataset(32)
    dataset = dataset.add_column("gold_cot", [f"Add the two numbers.\nThe sum is {a}." for a in dataset["answer"]])
    trainer = train_tiny([{"name": "p2s", "max_steps": 2}], output_dir=tmp_path, dataset=dataset)
    logs = [entry for entry in trainer.state.log_history if "trl_credit/p2s/steps" in entry]
    assert logs and all(math.isfinite(entry["trl_credit/p2s/steps"]) for entry in logs)
    assert any(math.isfinite(entry.get("trl_credit/p2s/pfr_prompt", math.nan)) for entry in logs)
    assert any(entry.get("trl_credit/cost/prefix_sequences", 0) > 0 for entry in logs)
