"""SIOP: a hand-computed vector (clusters, q, own-cluster log potentials, step rewards, the group z-score and the
return), the mixture and probability readings, references, calibration and truncation of q, answer extraction,
the scored prefixes (EOS, min_steps, skipped rows), edge cases, the check, the contract and a real training run."""

from __future__ import annotations

import math
import re

import pytest
import torch
from peft import LoraConfig

from trl_credit import ConfigError, Plugin, hookimpl, step_ends
from trl_credit.testing import check_args, check_plugin, make_batch, run_plugin, tiny_tokenizer, train_tiny
from trl_credit_siop import SIOP, cluster_ranks, extract_answer, normalise, target_distribution

LN2 = math.log(2.0)
# one group of four (the SmolLM2 tokenizer): step ends [8, 16] (row 0 ends with an EOS: its last state is read at
# 15), [7, 12], [5, 8], [3, 5]; answers 5, 5.0 (the same cluster as 5), 7, none
TEXTS = ["1 + 1 = 2\n2 + 3 = 5", "So 2 + 3\nis 5.0", "3 + 4\n= 7", "hmm\nnot sure"]
# P[row][text]: the scorer's probability of the answer text after state k = 0 (the prompt), 1, 2
P = [
    {"5": [0.1, 0.2, 0.8], "7": [0.3, 0.2, 0.1], "5.0": [0.1, 0.2, 0.4]},
    {"5": [0.1, 0.05, 0.4], "7": [0.2, 0.2, 0.2], "5.0": [0.1, 0.1, 0.1]},
    {"5": [0.2, 0.1, 0.1], "7": [0.2, 0.4, 0.4]},
    {"5": [0.1, 0.1, 0.5], "7": [0.1, 0.3, 0.1]},
]
RAW = {"normalise": "none", "credit": "step", "coef": 1.0}


def make(texts=TEXTS, rewards=(1.0, 0.0, 0.0, 0.0), probs=P, *, eos=(0,), calls=None, num_generations=None, **kw):
    """A batch of real token ids; the scorer gives ``probs[row][text][k]`` after state k (as a per-token log-prob,
    so the mean is log P whatever the length; the host passes the scored text alone, never the cue)."""
    tok = tiny_tokenizer()
    ids = [tok(t, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if i in eos else [])
           for i, t in enumerate(texts)]
    ends: dict[int, list[int]] = {}

    def fn(row, end, text, model):
        if calls is not None:
            calls.append((row, end, text, model))
        assert "enough information" not in text  # the cue is context, not scored
        k = 0 if end == 0 else sum(e < end for e in ends[row]) + 1  # the state (an EOS-adjusted last end too)
        n_tokens = len(tok(text, add_special_tokens=False)["input_ids"])
        return [math.log(probs[row][text][k])] * n_tokens

    n = len(texts)
    batch = make_batch(list(rewards), num_generations or n, completion_ids=ids, completions=list(texts),
                       tokenizer=tok, prefix_logps_fn=fn, reward_names=["accuracy"], **kw)
    ends.update({i: [e for e in row if e >= 0] for i, row in enumerate(step_ends(batch).tolist())})
    return batch


def extra(config, *args, others=(), calls=None, **kw):
    """``(credit, result)``: the advantages minus the outcome advantages (what coef adds), and the run (whose
    scoring calls go to ``calls``)."""
    def run(cfg, **more):
        batch = make(*args, **kw, **more)
        return run_plugin(SIOP, batch, cfg, others=others) if others else run_plugin(SIOP, batch, cfg)

    result = run(config, calls=calls)
    base = run({**config, "coef": 0.0})
    return result.advantages - base.advantages, result


def per_token(values, ends, width=16):
    """Step values spread over tokens [e_k-1, e_k), 0 past the last end (padding)."""
    out, start = [], 0
    for v, e in zip(values, ends):
        out += [v] * (e - start)
        start = e
    return torch.tensor(out + [0.0] * (width - start))


def test_the_hand_computed_vector():
    calls = []
    credit, result = extra(RAW, calls=calls)
    # clusters: {5, 5.0} (rows 0, 1) and {7} (row 2) of 3 answered: m = q = (2/3, 1/3); row 3 has no answer.
    # own potential, log space: Phi_ik = q_c log(P(ref_c | state k) + 1e-8), the reference of cluster 5 is "5"
    # (its first member's text, also for row 1 whose own text is "5.0"), r_k = Phi_k - Phi_k-1:
    #   row 0: 2/3 [ln(.2/.1), ln(.8/.2)]  = [2/3 ln2, 4/3 ln2] = [0.462098, 0.924196]
    #   row 1: 2/3 [ln(.05/.1), ln(.4/.05)] = [-2/3 ln2, 2 ln2]  = [-0.462098, 1.386294]
    #   row 2: 1/3 [ln(.4/.2), ln(.4/.4)]  = [1/3 ln2, 0]        = [0.231049, 0]
    #   row 3: no answer, no credit, not scored
    expected = [[2 / 3 * LN2, 4 / 3 * LN2], [-2 / 3 * LN2, 2 * LN2], [LN2 / 3, 0.0]]
    for row, (r, ends) in enumerate(zip(expected, [[8, 16], [7, 12], [5, 8]])):
        torch.testing.assert_close(credit[row], per_token(r, ends), atol=1e-6, rtol=0)
    assert credit[3].abs().sum() == 0
    # scored: 3 states per answered row, the cluster's reference only; row 0's last state before its EOS (15)
    assert sorted(calls) == sorted([(0, e, "5", "reference") for e in (0, 8, 15)] +
                                   [(1, e, "5", "reference") for e in (0, 7, 12)] +
                                   [(2, e, "7", "reference") for e in (0, 5, 8)])
    m = result.metrics
    assert m["siop/answered"] == 0.75 and m["siop/clusters"] == 2.0 and m["siop/top_share"] == pytest.approx(2 / 3)
    assert m["siop/scored"] == 0.75 and m["siop/steps"] == 2.0
    assert m["siop/step_reward"] == pytest.approx(11 * LN2 / 18, abs=1e-6)  # mean of the six rewards
    # potential gain Phi_K - Phi_0: 2/3 ln 8, 2/3 ln 4, 1/3 ln 2 -> mean (2 ln2 + 4/3 ln2 + 1/3 ln2) / 3
    assert m["siop/potential_gain"] == pytest.approx((2 + 4 / 3 + 1 / 3) * LN2 / 3, abs=1e-6)


def test_default_group_z_score_return_and_coef():
    credit, result = extra({})
    # pool of the six rewards above: mu = 11 ln2 / 18 = 0.423590, unbiased sigma = 0.660278;
    # z = (r - mu) / (sigma + 1e-6) = [0.058321, 0.758174], [-1.341385, 1.458027], [-0.291605, -0.641532];
    # return (gamma 1): c_1 = z_1 + z_2, c_2 = z_2; coef 0.5
    z = [[0.058321, 0.758174], [-1.341385, 1.458027], [-0.291605, -0.641532]]
    for row, (zr, ends) in enumerate(zip(z, [[8, 16], [7, 12], [5, 8]])):
        torch.testing.assert_close(credit[row], per_token([0.5 * (zr[0] + zr[1]), 0.5 * zr[1]], ends),
                                   atol=1e-5, rtol=0)
    assert credit[3].abs().sum() == 0
    outcome = result.advantages - credit
    assert outcome[0, 0] > 0 > outcome[1, 0]  # GRPO's outcome advantage underneath, unchanged
    assert result.metrics["siop/credit_abs"] > 0 and result.metrics["siop/outcome_abs"] > 0


def test_normalise_modes():
    r = torch.tensor([[2.0, -1.0], [1.0, 0.0]])
    valid = torch.tensor([[True, True], [True, False]])
    # group: pool {2, -1, 1}, mu = 2/3, unbiased sigma = sqrt(((4/3)^2 + (5/3)^2 + (1/3)^2) / 2) = sqrt(7/3)
    s = math.sqrt(7 / 3) + 1e-6
    torch.testing.assert_close(normalise(r, valid, 2, "group"),
                               torch.tensor([[(4 / 3) / s, (-5 / 3) / s], [(1 / 3) / s, 0.0]]), atol=1e-6, rtol=0)
    # scale: RMS = sqrt((4 + 1 + 1) / 3 + 1e-8) = sqrt(2)
    torch.testing.assert_close(normalise(r, valid, 2, "scale"), torch.tensor([[2.0, -1.0], [1.0, 0.0]]) /
                               (math.sqrt(2 + 1e-8) + 1e-6), atol=1e-6, rtol=0)
    # a group with one valid reward gets 0 (group); equal rewards: sigma 0 -> 1, z = 0
    one = torch.tensor([[True, False], [False, False]])
    assert normalise(r, one, 2, "group").abs().sum() == 0
    same = normalise(torch.tensor([[1.0, 1.0]]), torch.ones(1, 2, dtype=torch.bool), 1, "group")
    assert same.abs().sum() == 0


def test_mixture_potential_in_probability_space():
    credit, _ = extra({**RAW, "potential": "mixture", "space": "prob"})
    # Phi_ik = 2/3 P_i(5 | k) + 1/3 P_i(7 | k), the same two clusters for every row of the group:
    #   row 0: [.1*2/3+.3/3, .2*2/3+.2/3, .8*2/3+.1/3] = [1/6, 0.2, 17/30]   -> r = [1/30, 11/30]
    #   row 1: [2/15, 0.1, 1/3]                                             -> r = [-1/30, 7/30]
    #   row 2: [0.2, 0.2, 0.2]                                              -> r = [0, 0]
    #   row 3 (no answer of its own, credited in this reading): [0.1, 1/6, 11/30] -> r = [1/15, 1/5]
    expected = [[1 / 30, 11 / 30], [-1 / 30, 7 / 30], [0.0, 0.0], [1 / 15, 1 / 5]]
    for row, (r, ends) in enumerate(zip(expected, [[8, 16], [7, 12], [5, 8], [3, 5]])):
        torch.testing.assert_close(credit[row], per_token(r, ends), atol=1e-6, rtol=0)
    # log space: r = ln(Phi_k + 1e-8) - ln(Phi_k-1 + 1e-8); row 0: [ln(0.2 * 6), ln(17/30 / 0.2)]
    log_credit, _ = extra({**RAW, "potential": "mixture"})
    torch.testing.assert_close(log_credit[0], per_token([math.log(1.2), math.log(17 / 6)], [8, 16]), atol=1e-6,
                               rtol=0)


def test_own_potential_in_probability_space_and_two_references():
    credit, _ = extra({**RAW, "space": "prob"})
    # Phi = q_c P: row 0 2/3 [.2 - .1, .8 - .2] = [1/15, 0.4]; row 2 1/3 [.2, 0]
    torch.testing.assert_close(credit[0], per_token([1 / 15, 0.4], [8, 16]), atol=1e-6, rtol=0)
    torch.testing.assert_close(credit[2], per_token([0.2 / 3, 0.0], [5, 8]), atol=1e-6, rtol=0)
    calls = []
    two, _ = extra({**RAW, "num_refs": 2}, calls=calls)
    # cluster 5's references "5", "5.0", alpha = 1/2: S_0 = [.1, .2, .6], S_1 = [.1, .075, .25]
    #   row 0: 2/3 [ln 2, ln 3] = [0.462098, 0.732408]; row 1: 2/3 [ln .75, ln(10/3)] = [-0.191788, 0.802648]
    torch.testing.assert_close(two[0], per_token([2 / 3 * LN2, 2 / 3 * math.log(3)], [8, 16]), atol=1e-6, rtol=0)
    torch.testing.assert_close(two[1], per_token([2 / 3 * math.log(0.75), 2 / 3 * math.log(10 / 3)], [7, 12]),
                               atol=1e-6, rtol=0)
    assert {t for row, _, t, _ in calls if row == 1} == {"5", "5.0"} and {t for row, _, t, _ in calls if row == 2} \
        == {"7"}  # cluster 7 has one text: 2 slots, the second skips it


def test_target_distribution_calibration_and_truncation():
    ranks = cluster_ranks(["5", "5", "7", None], 4)
    assert ranks.tolist() == [0, 0, 1, -1]
    torch.testing.assert_close(target_distribution(ranks, 4), torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]]))
    # tau = 0.5: q ∝ m^2 = (4/9, 1/9) -> (0.8, 0.2)
    torch.testing.assert_close(target_distribution(ranks, 4, 0.5), torch.tensor([[0.8, 0.2, 0.0, 0.0]]))
    # eta = 1 on a column [1, 0, 1, NaN]: rbar_5 = 0.5, rbar_7 = 1 -> q ∝ (2/3 e^0.5, 1/3 e) = 2 : e^0.5
    evidence = torch.tensor([1.0, 0.0, 1.0, math.nan])
    q5 = 2 / (2 + math.exp(0.5))  # 0.548137
    torch.testing.assert_close(target_distribution(ranks, 4, 1.0, evidence, 1.0),
                               torch.tensor([[q5, 1 - q5, 0.0, 0.0]]))
    # max_clusters 1: the second cluster is dropped, the first keeps 2/3 (no renormalisation)
    torch.testing.assert_close(target_distribution(ranks, 4, max_clusters=1), torch.tensor([[2 / 3, 0, 0, 0.0]]))
    # ties: the cluster seen first ranks first; no answers: all 0
    assert cluster_ranks(["a", "b", "b", "a", "c", None], 6).tolist() == [0, 1, 1, 0, 2, -1]
    assert cluster_ranks(["a", "b", "b"], 3).tolist() == [1, 0, 0]  # the larger cluster first
    assert target_distribution(torch.tensor([-1, -1]), 2).abs().sum() == 0


def test_calibrated_q_and_max_clusters_in_the_hook():
    credit, _ = extra({**RAW, "reliability_reward": "accuracy"}, rewards=[1.0, 0.0, 1.0, math.nan])
    # q_7 = e^0.5 / (2 + e^0.5) = 0.451863: row 2's first step earns 0.451863 ln 2 = 0.313207
    torch.testing.assert_close(credit[2], per_token([0.313207, 0.0], [5, 8]), atol=1e-6, rtol=0)
    calls = []
    top, result = extra({**RAW, "max_clusters": 1}, calls=calls)
    assert {row for row, *_ in calls} == {0, 1} and top[2:].abs().sum() == 0  # cluster 7 dropped: row 2 unscored
    torch.testing.assert_close(top[0], per_token([2 / 3 * LN2, 4 / 3 * LN2], [8, 16]), atol=1e-6, rtol=0)
    assert result.metrics["siop/clusters"] == 2.0  # counted before truncation


def test_answer_extraction():
    assert extract_answer("so 12.0 apples") == ("12", "12.0")
    assert extract_answer("1,000 then -0") == ("0", "-0")  # -0 clusters with 0, its text is kept
    assert extract_answer("a total of 1,000") == ("1000", "1000")
    assert extract_answer("no number") is None
    pattern = re.compile(r"(?i)answer:(.*)")
    assert extract_answer("Answer:  New   York ", pattern) == ("new york", "New   York")
    assert extract_answer("answer: ", pattern) is None and extract_answer("nothing", pattern) is None
    assert extract_answer("x=3, y=4", re.compile(r"\d")) == ("4", "4")  # no group: the whole last match


def test_regex_answers_cluster_case_and_space_insensitively():
    texts = ["think\nAnswer: Paris", "so\nanswer:  PARIS", "hmm\nAnswer: Lyon", "no idea\nat all"]
    probs = [{"Paris": [0.1, 0.2, 0.4], "Lyon": [0.5, 0.5, 0.5]}, {"Paris": [0.1, 0.1, 0.1]},
             {"Lyon": [0.1, 0.1, 0.2]}, {}]
    calls = []
    credit, result = extra({**RAW, "answer_pattern": r"(?i)answer:(.*)"}, texts, probs=probs, eos=(), calls=calls)
    assert result.metrics["siop/clusters"] == 2.0  # {Paris, PARIS}, {Lyon}
    assert {(row, t) for row, _, t, _ in calls} == {(0, "Paris"), (1, "Paris"), (2, "Lyon")}
    ends = step_ends(result.batch)[0].tolist()
    torch.testing.assert_close(credit[0, : ends[-1]], per_token([2 / 3 * LN2, 2 / 3 * LN2], ends, ends[-1]),
                               atol=1e-6, rtol=0)


def test_eos_min_steps_and_terminal_weight():
    calls, batch_calls = [], []
    credit, _ = extra({**RAW, "after_eos": True}, calls=batch_calls)
    assert (0, 16, "5", "reference") in batch_calls and (0, 15, "5", "reference") not in batch_calls
    # a one-step completion is not scored (min_steps 2), unless min_steps 1
    texts = ["2 + 3 = 5", "3 + 2\n= 5", "5", "7"]
    probs = [{"5": [0.1, 0.4]}, {"5": [0.1, 0.2, 0.4]}, {"5": [0.2, 0.2]}, {"7": [0.1, 0.3]}]
    credit, _ = extra(RAW, texts, probs=probs, eos=(), calls=calls)
    assert {row for row, *_ in calls} == {1} and credit[[0, 2, 3]].abs().sum() == 0
    one, _ = extra({**RAW, "min_steps": 1}, texts, probs=probs, eos=())
    # row 0: q_5 = 3/4, one step: 3/4 ln 4; row 3: q_7 = 1/4, 1/4 ln 3
    assert one[0, 0].item() == pytest.approx(0.75 * math.log(4), abs=1e-6)
    assert one[3, 0].item() == pytest.approx(0.25 * math.log(3), abs=1e-6)
    # terminal_weight 0.5: (1 - lambda) q on the last step of every answered completion, scored or not
    term, _ = extra({**RAW, "terminal_weight": 0.5}, texts, probs=probs, eos=())
    assert term[0, 0].item() == pytest.approx(0.375) and term[3, 0].item() == pytest.approx(0.125)
    e = step_ends(make(texts, probs=probs, eos=()))[1].tolist()  # row 1: 3/4 [ln 2, ln 2 + 0.5]
    torch.testing.assert_close(term[1, : e[-1]], per_token([0.75 * LN2, 0.75 * LN2 + 0.375], e, e[-1]), atol=1e-6,
                               rtol=0)


class DropSecond(Plugin):
    """Keeps every completion but the second."""

    @hookimpl
    def filter_rollouts(self, batch):
        keep = torch.ones(batch.num_completions, dtype=torch.bool)
        keep[1] = False
        return keep


def test_dropped_rows_count_in_clusters_but_get_no_credit():
    calls = []
    credit, result = extra(RAW, calls=calls, others=[DropSecond])
    assert {row for row, *_ in calls} == {0, 2} and (result.advantages[1] == 0).all()
    # cluster 5 still holds rows 0 and 1: q_5 = 2/3
    torch.testing.assert_close(credit[0], per_token([2 / 3 * LN2, 4 / 3 * LN2], [8, 16]), atol=1e-6, rtol=0)


def test_edge_cases_no_answers_one_cluster_empty_and_no_steps():
    calls = []
    texts = ["a\nb", "c\nd", "", " \n "]
    result = run_plugin(SIOP, make(texts, probs=[{}] * 4, eos=(), calls=calls), RAW)
    base = run_plugin(SIOP, make(texts, probs=[{}] * 4, eos=()), {**RAW, "coef": 0.0})
    assert not calls and torch.equal(result.advantages, base.advantages)  # no answer in the group: no credit
    assert result.metrics["siop/answered"] == 0.0 and "siop/clusters" not in result.metrics
    # all agree: one cluster, q = 1; empty and step-less completions are not scored
    texts = ["1 + 4\n= 5", "2 + 3\n= 5", "", " \n "]
    probs = [{"5": [0.1, 0.2, 0.4]}, {"5": [0.2, 0.2, 0.1]}, {}, {}]
    credit, result = extra(RAW, texts, rewards=[1.0, 0.0, 0.0, None], probs=probs, eos=(), calls=calls)
    assert {row for row, *_ in calls} == {0, 1} and result.metrics["siop/top_share"] == 1.0
    e0, e1 = (step_ends(result.batch)[i].tolist() for i in (0, 1))
    torch.testing.assert_close(credit[0, : e0[-1]], per_token([LN2, LN2], e0, e0[-1]), atol=1e-6, rtol=0)
    torch.testing.assert_close(credit[1, : e1[-1]], per_token([0.0, -LN2], e1, e1[-1]), atol=1e-6, rtol=0)
    assert credit[2:].abs().sum() == 0 and torch.isfinite(result.advantages).all()
    # a completion no reward function scored (row 1 here) is not scored and gets 0 (as TRL gives it)
    calls.clear()
    credit, result = extra(RAW, texts, rewards=[1.0, None, 0.0, None], probs=probs, eos=(), calls=calls)
    assert {row for row, *_ in calls} == {0} and (result.advantages[1] == 0).all()
    torch.testing.assert_close(credit[0, : e0[-1]], per_token([LN2, LN2], e0, e0[-1]), atol=1e-6, rtol=0)


def test_check_args():
    check_args(SIOP, peft=True)
    check_args(SIOP, peft=False, beta=0.04)
    check_args(SIOP, {"model": "policy"}, peft=False)
    with pytest.raises(ConfigError, match=r"\(siop\) reads the reference model with these options, but this run has none \(no PEFT adapter, beta 0\): train a PEFT adapter.*policy option"):
        check_args(SIOP, peft=False)
    with pytest.raises(ConfigError, match="judge"):  # the reliability column must be a reward column
        check_args(SIOP, {"reliability_reward": "judge"})
    with pytest.raises(ConfigError, match="not a valid regex"):
        check_args(SIOP, {"answer_pattern": "(unclosed"})
    with pytest.raises(ConfigError, match="no {answer} placeholder"):
        check_args(SIOP, {"template": "the answer"})


def edge_batches():
    def batch(rewards, g, texts, eos=(0, 3)):
        n = len(rewards)
        probs = [{str(v): [0.1 + 0.05 * ((i + k + v) % 7) for k in range(12)] for v in range(12)} for i in range(n)]
        return make(texts, rewards, probs, eos=eos, num_generations=g)

    lines = ["1\n2\n3", "1 + 1 = 2", "a\n\nb\n3\n", "", "x\ny 4", "1\n2\n3\n4\n5\n6\n7\n8\n9\n10", "z", " \n "]
    return [
        lambda: batch([1, 0, 1, 0, 1, 1, 0, 0], 4, lines),                                # mixed
        lambda: batch([1, 1, 1, 1, 0, 0, 0, 0], 4, ["1 + 1 = 2\n2"] * 8),                 # constant, all agree
        lambda: batch([1, None, 0, 1, None, None, None, None], 4, lines),                 # NaN rewards
        lambda: batch([1, 0, 1], 1, ["1\n2", "", "9"]),                                   # G = 1
        lambda: batch([0.5, 0.25, 0.75, 0.0], 2, ["", "a\nb", " \n", "c"]),               # no answers, no steps
    ]


def test_contract():
    check_plugin(SIOP, batches=edge_batches())
    check_plugin(SIOP, {"potential": "mixture", "space": "prob", "credit": "step", "normalise": "scale",
                        "max_steps": 2, "min_steps": 1, "num_refs": 2, "max_clusters": None, "terminal_weight": 0.5,
                        "reliability_reward": "accuracy", "temperature": 0.5}, batches=edge_batches())


def test_trains_with_a_lora_reference(tmp_path):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    # the tiny random model writes no numbers: its last word is the answer; every word a step
    plugin = {"name": "siop", "answer_pattern": r"(\S+)\s*$", "pattern": " ", "max_steps": 2, "max_clusters": 2,
              "min_steps": 1}
    trainer = train_tiny([plugin], output_dir=tmp_path, max_steps=2, peft_config=lora)
    logs = trainer.state.log_history[0]
    assert logs["trl_credit/siop/answered"] > 0 and logs["trl_credit/siop/scored"] > 0
    assert math.isfinite(logs["trl_credit/siop/potential_gain"]) and math.isfinite(logs["trl_credit/siop/credit_abs"])
    assert logs["trl_credit/cost/prefix_sequences"] > 0


def test_turn_mode_scores_at_the_turn_boundaries():
    from trl_credit import turn_ends

    # two rollouts of one group with the same answer "5": model turns at 0-1 and 4-5 (reply at 2-3)
    tool = [[1, 1, 0, 0, 1, 1], [1, 1, 0, 0, 1, 1]]
    batch = make_batch([1.0, 1.0], 2, completion_mask=[[1] * 6] * 2, tool_mask=tool,
                       completions=["a 5", "b 5"], columns={"answer": ["5", "5"]},
                       prefix_logps_fn=lambda row, end, text, model: [{0: -2.0, 4: -1.0, 6: -0.5}[end]])
    assert turn_ends(batch).tolist() == [[4, 6], [4, 6]]  # after turn 1 (its reply included), after turn 2
    result = run_plugin(SIOP, batch, {"segments": "turns", "normalise": "none", "coef": 1.0, "credit": "step",
                                      "min_steps": 1})
    assert result.metrics["siop/scored"] == 1.0 and result.metrics["siop/steps"] == 2.0
    # one cluster (q = 1): Phi = log S = [-2, -1, -0.5] -> r = [1, 0.5] on the tokens of turn 1 and turn 2, none on
    # the reply; both outcomes are 1, so GRPO's advantage is 0 and the advantages are the credit
    torch.testing.assert_close(result.advantages, torch.tensor([[1.0, 1, 0, 0, 0.5, 0.5]] * 2), atol=1e-5, rtol=0)


def test_turn_mode_on_a_real_multi_turn_run_is_what_trains(tmp_path):
    """A real run on the kit's scripted multi-turn rollouts: what TRL's loss trained on (row by row, from its
    micro-batches) is SIOP's output on the recorded batch, whose turn-boundary scores the host cached in the real
    prefix pass. TRL's loss masks the environment's tokens."""
    from trl_credit.testing import train_scripted_turns

    options = {"segments": "turns", "answer_pattern": r"(\S+)\s*$", "max_clusters": 2, "min_steps": 1}
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    trainer, batch, trained = train_scripted_turns({"name": "siop", **options}, output_dir=tmp_path, peft_config=lora)
    logs = trainer.state.log_history[0]
    assert math.isfinite(logs["loss"]) and logs["trl_credit/cost/prefix_sequences"] > 0
    turns = batch.turns()
    seen = ~trained.isnan()  # the positions the loss received (the kit checked them against run_plugin)
    assert trained.dim() == 2
    assert trained[seen & turns.model].abs().sum() > 0
