"""SPAE: methods.md 2.28's potential vectors, acc/conf from hand-made probes (the repo's division after exp, the
-10 floor, the raw top-k entropy), the advantage on the tokens of each step (saturation readings, first_delta,
max_steps, the line fallback), edge cases, the check, the contract and a real training run."""

from __future__ import annotations

import math

import pytest
import torch

from trl_credit import ConfigError, Plugin, hookimpl, token_steps
from trl_credit.testing import check_args, check_plugin, make_batch, run_plugin, tiny_tokenizer, train_tiny
from trl_credit_spae import SPAE, SPAE_CUE, potential, potential_deltas, probe_scores

E10 = math.exp(-10)


def test_potential_vectors():
    phi = potential(torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([1.0, 1.0, 0.0, 0.0]))
    torch.testing.assert_close(phi, torch.tensor([1.0, -1.0, 0.0, 0.5]))  # (acc, conf) = (1,1) (0,1) (0,0) (1,0)
    phi = potential(torch.tensor([[0.1, 0.6, 0.95]]), torch.tensor([[0.2, 0.7, 0.95]]))
    torch.testing.assert_close(phi, torch.tensor([[-0.12, 0.23, 0.87875]]))
    delta = potential_deltas(phi, torch.ones(1, 3, dtype=torch.bool))
    torch.testing.assert_close(delta, torch.tensor([[0.0, 0.35, 0.64875]]))
    # before the first step: Phi_prompt = -0.2 -> dPhi_0 = -0.12 + 0.2 = 0.08
    torch.testing.assert_close(potential_deltas(phi, torch.ones(1, 3, dtype=torch.bool), torch.tensor([[-0.2]])),
                               torch.tensor([[0.08, 0.35, 0.64875]]))


GOLD, OTHER = 33, 50  # "1" (the first token of "12") and some other id


def hand_probes(fn, s, length, k=2):
    class Grab(Plugin):
        @hookimpl
        def shape_rewards(self, batch):
            Grab.probes = batch.probe(torch.tensor([[0]]), SPAE_CUE, num_samples=s, max_new_tokens=length, top_k=k)

    run_plugin(Grab, make_batch([1.0], 1, lengths=[2], probe_fn=fn))
    return Grab.probes


def test_acc_and_conf_divide_after_the_exponential():
    lg = math.log

    def fn(row, end, cue, model):
        # sample 0: both gold tokens [33, 34] listed at p 0.5 and 0.8; sample 1: one position (then EOS-masked),
        # gold listed at p 0.3 beside the sampled token at 0.6
        return {"tokens": [[GOLD, 34, 9], [7, 8, 9]], "mask": [[1, 1, 1], [1, 0, 0]],
                "logps": [[lg(0.5), lg(0.8), lg(0.9)], [lg(0.6), 0.0, 0.0]],
                "topk_ids": [[[GOLD, OTHER], [34, 51], [9, 52]], [[7, GOLD], [8, 1], [9, 1]]],
                "topk_logps": [[[lg(0.5), lg(0.25)], [lg(0.8), lg(0.1)], [lg(0.9), lg(0.05)]],
                               [[lg(0.6), lg(0.3)], [0.0, 0.0], [0.0, 0.0]]]}

    probes = hand_probes(fn, 2, 3)
    acc, conf = probe_scores(probes, torch.tensor([[GOLD, 34]]))
    # sample 0: 2 positions used (gold has 2 tokens): acc = exp(log .5 + log .8) / 2 = 0.2
    #           H = 0.693147 + 0.408774 = 1.101921 (raw -sum p log p) -> conf = exp(-1.101921) / 2 = 0.166116
    # sample 1: 1 position (its length): acc = 0.3 / 1, H = 0.667687 -> conf = 0.512893
    # averaged over the 2 samples: acc = 0.25, conf = 0.339505
    assert acc.item() == pytest.approx(0.25, abs=1e-6) and conf.item() == pytest.approx(0.339505, abs=1e-5)
    # renormalised top-k: sample 1's position [.6, .3] -> [2/3, 1/3], conf 0.529134; sample 0's
    # [.5, .25] -> [2/3, 1/3] and [.8, .1] -> [8/9, 1/9]: H = 0.636514 + 0.348832 -> conf exp(-0.985346) / 2 = 0.186655
    _, renorm = probe_scores(probes, torch.tensor([[GOLD, 34]]), entropy="renormalised")
    assert renorm.item() == pytest.approx((0.186655 + 0.529134) / 2, abs=1e-5)


def test_gold_absent_floor_and_sampled_token_counts_as_listed():
    lg = math.log

    def fn(row, end, cue, model):  # sample 0: gold sampled at p .05 but not in the top-2; sample 1: gold nowhere
        return {"tokens": [[GOLD], [OTHER]], "logps": [[lg(0.05)], [lg(0.5)]],
                "topk_ids": [[[OTHER, 51]], [[OTHER, 51]]], "topk_logps": [[[lg(0.5), lg(0.4)]], [[lg(0.5), lg(0.4)]]]}

    acc, conf = probe_scores(hand_probes(fn, 2, 1), torch.tensor([[GOLD]]))
    # sample 0: acc 0.05 (vLLM's dict holds the sampled token), H = .346574 + .366516 + .149787 -> conf 0.421947
    # sample 1: acc exp(-10) (the floor), H = .346574 + .366516 -> conf exp(-0.713090) = 0.490127
    assert acc.item() == pytest.approx((0.05 + E10) / 2, abs=1e-7)
    assert conf.item() == pytest.approx((0.421947 + 0.490127) / 2, abs=1e-5)


# -- the advantage on a batch: row 0 has four ".\n\n" steps, row 1 none (two lines: the fallback)
TEXTS = ["First.\n\nSecond.\n\nThird.\n\nCheck 12", "3 + 4 = 7\n7"]
ANSWERS = ["12", "7"]
P = {(0, 4): 0.0, (0, 8): 0.5, (0, 12): 1.0, (0, 16): 1.0, (1, 8): 0.5, (1, 9): 0.0, (0, 0): 0.5, (1, 0): 0.0}


def spae_batch(rewards=(1.0, 0.0), texts=TEXTS, answers=ANSWERS, p=P, calls=None, eos_on=(0,), **kw):
    """A batch whose probe after (row, end) lists the gold's first token at p (p = 0: absent, another token at 1):
    acc = p, conf = p^p (1-p)^(1-p); so p 0 -> Phi = 2e-10 - 1, p .5 -> Phi .125, p 1 -> Phi 1."""
    tok = tiny_tokenizer()
    ids = [tok(t, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if i in eos_on else [])
           for i, t in enumerate(texts)]
    gold = {i: tok(a, add_special_tokens=False)["input_ids"][0] for i, a in enumerate(answers)}

    def fn(row, end, cue, model):
        if calls is not None:
            calls.append((row, end, cue))
        q = p[(row, end)]
        if q == 0.0:
            return {"tokens": [[OTHER]], "logps": [[0.0]], "topk_ids": [[[OTHER]]], "topk_logps": [[[0.0]]]}
        if q == 1.0:
            return {"tokens": [[gold[row]]], "logps": [[0.0]], "topk_ids": [[[gold[row]]]], "topk_logps": [[[0.0]]]}
        return {"tokens": [[gold[row]]], "logps": [[math.log(q)]], "topk_ids": [[[gold[row], OTHER]]],
                "topk_logps": [[[math.log(q), math.log(1 - q)]]]}

    batch = make_batch(list(rewards), len(texts), completion_ids=ids, completions=texts, tokenizer=tok,
                       columns={"answer": list(answers)}, probe_fn=fn, scale_rewards="none", **kw)
    return batch, ids


def per_step(advantages, batch, row, n_tokens, pattern):
    index, _ = token_steps(batch, pattern, fill=True)
    out = {}
    for t in range(n_tokens):
        out.setdefault(int(index[row, t]), set()).add(round(advantages[row, t].item(), 6))
    return out


OPTIONS = {"num_samples": 1, "max_new_tokens": 1}


def test_advantage_on_the_tokens_of_each_step():
    calls = []
    batch, ids = spae_batch(calls=calls)
    result = run_plugin(SPAE, batch, OPTIONS)
    a = result.advantages
    # row 0 (A = +0.5): Phi = [2e-10 - 1, .125, 1, 1], dPhi = [0, 1.125 - 2e-10, .875, 0], solved at step 2:
    # step 0: .5; step 1: .5 + .5 * 1.1249092 = 1.0624546; step 2: .5 + .4375 = .9375; step 3 (after): .5 * .5 = .25
    assert per_step(a, batch, 0, len(ids[0]), r"\.\n\n") == {0: {0.5}, 1: {1.062455}, 2: {0.9375}, 3: {0.25}}
    # row 1 (A = -0.5) has no ".\n\n": its lines are steps; Phi = [.125, 2e-10 - 1]: step 1: -.5 - .5 * 1.1249092
    assert per_step(a, batch, 1, len(ids[1]), r"\n+") == {0: {-0.5}, 1: {-1.062455}}
    # probed after each step; the EOS closing row 0 is not in its last prefix (16 tokens of text, 17 with EOS)
    assert sorted({(r, e) for r, e, _ in calls}) == [(0, 4), (0, 8), (0, 12), (0, 16), (1, 8), (1, 9)]
    assert {c for _, _, c in calls} == {SPAE_CUE}
    m = result.metrics
    assert m["spae/potential"] == pytest.approx((0.25 + 4 * E10) / 6, abs=1e-6)
    assert m["spae/solved"] == 0.5 and m["spae/steps"] == 3.0 and m["spae/probes_per_completion"] == 3.0
    assert m["spae/saturated_tokens"] == pytest.approx(5 / 26)  # row 0's step 3 and its EOS, of 17 + 9 tokens
    assert m["spae/delta_potential"] == pytest.approx((1.125 + 0.875 + 0 - 1.125) / 4, abs=1e-6)


def test_saturation_readings_on_a_negative_advantage():
    batch, ids = spae_batch(rewards=(0.0, 1.0))  # row 0 now has A = -0.5; its step 3 is after the solved step 2
    last = {}
    for mode in ("positive", "all", "subtract"):
        a = run_plugin(SPAE, spae_batch(rewards=(0.0, 1.0))[0], {**OPTIONS, "saturation": mode}).advantages
        last[mode] = a[0, len(ids[0]) - 1].item()
    # positive: no damping of a negative A (-.5); all: -.5 * (1 - .5) = -.25; subtract: -.5 - .5 * .5 = -.75
    assert last == pytest.approx({"positive": -0.5, "all": -0.25, "subtract": -0.75})
    a = run_plugin(SPAE, batch, {**OPTIONS, "kappa": 1.0, "alpha": 2.0}).advantages
    # step 1 of row 0: -.5 + 2 * 1.1249092 = 1.7498184; step 3 with A > 0 only damped: -.5 stays
    assert a[0, 5].item() == pytest.approx(1.749818, abs=1e-5) and a[0, len(ids[0]) - 1].item() == -0.5


def test_first_delta_from_the_prompt_alone():
    calls = []
    batch, ids = spae_batch(calls=calls)
    a = run_plugin(SPAE, batch, {**OPTIONS, "first_delta": "prompt"}).advantages
    # row 0: Phi_prompt = .125 -> dPhi_0 = 2e-10 - 1 - .125; step 0: .5 + .5 * (-1.1249092) = -.0624546
    # row 1: Phi_prompt = 2e-10 - 1 -> dPhi_0 = .125 + 1 - 2e-10; step 0: -.5 + .5 * 1.1249092 = .0624546
    assert per_step(a, batch, 0, len(ids[0]), r"\.\n\n")[0] == {-0.062455}
    assert per_step(a, batch, 1, len(ids[1]), r"\n+")[0] == {0.062455}
    assert (0, 0) in {(r, e) for r, e, _ in calls} and (1, 0) in {(r, e) for r, e, _ in calls}


def test_max_steps_keeps_the_last_steps():
    calls = []
    batch, ids = spae_batch(calls=calls)
    a = run_plugin(SPAE, batch, {**OPTIONS, "max_steps": 2}).advantages
    # row 0 keeps the boundaries 12 and 16: steps 0-2 merge into the first kept step (Phi 1, solved, dPhi 0),
    # the last step is after it: .5 * .5 = .25
    assert per_step(a, batch, 0, len(ids[0]), r"\.\n\n") == {0: {0.5}, 1: {0.5}, 2: {0.5}, 3: {0.25}}
    assert sorted({(r, e) for r, e, _ in calls if r == 0}) == [(0, 12), (0, 16)]


def test_no_fallback_and_plain_lines_pattern():
    batch, ids = spae_batch()
    a = run_plugin(SPAE, batch, {**OPTIONS, "fallback_pattern": None}).advantages
    # row 1 is one step (the whole completion, ends 9): p(1, 9) = 0 -> its only step has dPhi 0: A stays -.5
    assert set(a[1, : len(ids[1])].tolist()) == {-0.5}


def test_edge_cases_nan_reward_empty_completion_constant_group():
    texts = ["First.\n\nSecond.\n\nThird.\n\nCheck 12", "", "3 + 4 = 7\n7", "3 + 4 = 7\n7"]
    p = {**P, (2, 8): 0.5, (2, 9): 0.0, (3, 8): 0.5, (3, 9): 0.0}
    calls = []
    batch, ids = spae_batch(rewards=(None, 1.0, 1.0, 1.0), texts=texts, answers=["12", "7", "7", "7"], p=p,
                            calls=calls, eos_on=())
    a = run_plugin(SPAE, batch, OPTIONS).advantages
    assert torch.isfinite(a).all()
    assert not {r for r, _, _ in calls} & {0, 1}  # the NaN-reward row and the empty completion are not probed
    assert (a[0] == 0).all()  # no reward: GRPO's 0 is kept
    # rows 2, 3 form a constant group (A = 0): the shaping alone, -.5 * 1.1249092 on their second line
    assert per_step(a, batch, 2, len(ids[2]), r"\n+") == {0: {0.0}, 1: {-0.562455}}


def test_no_step_anywhere_leaves_the_advantages():
    batch = spae_batch(rewards=(1.0, 0.0), texts=["", ""], answers=["1", "2"], p={}, eos_on=())[0]
    result = run_plugin(SPAE, batch, OPTIONS)
    assert result.advantages.dim() == 1 and result.metrics["spae/steps"] == 0.0


def test_check_refuses_a_pattern_that_matches_nothing():
    with pytest.raises(ConfigError) as err:
        check_args(SPAE, {"pattern": r"\n*"}, reward_names=["answer_reward"], per_device_train_batch_size=8,
                   num_generations=4)
    text = str(err.value)
    assert "(spae)" in text and "pattern" in text and "empty string" in text and "fix:" in text
    with pytest.raises(ConfigError, match="fallback_pattern"):
        check_args(SPAE, {"fallback_pattern": "x?"}, per_device_train_batch_size=8, num_generations=4)
    with pytest.raises(ConfigError, match="answer"):  # the gold column is required before the model loads
        check_args(SPAE, {}, columns=("prompt",), per_device_train_batch_size=8, num_generations=4)
    check_args(SPAE, {"pattern": "(?=Step \\d)"}, per_device_train_batch_size=8, num_generations=4)


def test_contract():
    check_plugin(SPAE, OPTIONS, batches=[lambda: spae_batch()[0], lambda: spae_batch(rewards=(None, 1.0))[0],
                                         lambda: spae_batch(rewards=(1.0, 1.0))[0]])


def test_trains_on_the_tiny_model(tmp_path):
    trainer = train_tiny([{"name": "spae", "num_samples": 2, "max_new_tokens": 3, "max_steps": 2}],
                         output_dir=tmp_path, max_steps=2)
    logs = trainer.state.log_history[0]
    assert math.isfinite(logs["trl_credit/spae/steps"]) and math.isfinite(logs["trl_credit/spae/potential"])
    assert logs["trl_credit/cost/probe_tokens"] > 0 and logs["trl_credit/cost/probe_seconds"] > 0
    assert trainer.state.log_history[-1]["train_loss"] is not None
