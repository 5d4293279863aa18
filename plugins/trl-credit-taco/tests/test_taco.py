"""TACO (`taco` on turns, `taco_probe` on steps): hand-computed DAPR and OGAR vectors with controlled probes and
scores, both scorings (the run's rewards, the answer column), NaN probes, the refusal of a reward that returns the
row's own outcome, the edge cases (single turn = GRPO, all probes unscorable, constant groups, one-turn rows
beside three-turn rows, rows without a reward or dropped), the checks, the contract for both keys and a real
training run of each plugin whose trained advantages are recomputed here with loops."""

from __future__ import annotations

import math
from decimal import Decimal

import pytest
import torch

from trl_credit import ConfigError, Plugin, PluginRuntimeError, hookimpl, step_ends
from trl_credit.testing import (ScriptedTurns, check_args, check_plugin, make_batch, plugin_set, run_plugin,
                                scripted_turns_reward, tiny_tokenizer, train_tiny)
from trl_credit_taco import (TACO, TACO_CUE, TacoProbe, answer_prefix, call_values, dapr, route,
                             token_advantages)

SIGMA = math.sqrt(0.5) + 1e-6  # the pool [1, 0, -1, .5, -.5] of the turn vector: mean 0, population sigma sqrt(.5)
Z1, Z5 = 1 / SIGMA, 0.5 / SIGMA  # 1.414212, 0.707106


def judge(row, text):
    """The stand-in answer checker: 1 when the last word is 5, None (unscorable) with a '?', else 0."""
    if "?" in text:
        return None
    words = text.split()
    return float(bool(words) and words[-1] == "5")


# -- pure pieces -------------------------------------------------------------------------------------------------

def test_answer_prefix_and_call_values():
    assert answer_prefix(TACO_CUE) == "My final answer is"
    assert answer_prefix("\n</think>\nThe answer is") == "The answer is"
    j = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, math.nan], [0.5, math.nan, math.nan]])
    d = call_values(j, torch.tensor([3, 2, 1]))
    # row 0: [1 - 0, 1 - 1] and its answer segment NaN; row 1: [0 - 1]; row 2: one segment, no call
    torch.testing.assert_close(d, torch.tensor([[1.0, 0.0, math.nan], [-1.0, math.nan, math.nan]] + [[math.nan] * 3]),
                               equal_nan=True)


def test_route_vector():
    outcome = torch.tensor([0.5, 0.5, -0.5, -0.5, 0.0])
    d = torch.tensor([[1.0, 0.0], [-1.0, math.nan], [0.5, -0.5], [0.0, math.nan], [1.0, -1.0]])
    # A > 0: useful kept, idle and misleading get 0; A < 0: useful not blamed (0), misleading and idle blamed;
    # NaN d (no call): A_i; A = 0: 0 either way
    expected = torch.tensor([[0.5, 0.0], [0.0, 0.5], [0.0, -0.5], [-0.5, -0.5], [0.0, 0.0]])
    torch.testing.assert_close(route(outcome, d), expected)
    torch.testing.assert_close(route(outcome, d, "broadcast"), outcome[:, None].expand(5, 2))


def test_dapr_vector():
    # one group of two rows: pool [1, 0, -1, nan] -> mean 0, population sigma sqrt(2/3) = 0.816497
    d = torch.tensor([[1.0, 0.0], [-1.0, math.nan]])
    z = dapr(d, 2)
    s = math.sqrt(2 / 3) + 1e-6
    torch.testing.assert_close(z, torch.tensor([[1 / s, 0.0], [-1 / s, 0.0]]))
    torch.testing.assert_close(dapr(d, 2, "mean"), d.nan_to_num(0.0))  # mean 0 already
    torch.testing.assert_close(dapr(torch.tensor([[0.5, 0.5], [0.5, math.nan]]), 2), torch.zeros(2, 2))  # constant
    torch.testing.assert_close(dapr(torch.tensor([[0.3, math.nan], [math.nan, math.nan]]), 2), torch.zeros(2, 2))


def test_token_advantages_vector():
    outcome = torch.tensor([0.5])
    d = torch.tensor([[1.0, math.nan]])
    routed, z = route(outcome, d), torch.tensor([[2.0, 0.0]])
    segment = torch.tensor([[0, 0, -1, 1, 1, -1]])
    model = torch.tensor([[True, True, False, True, True, False]])
    a = token_advantages(outcome, routed, z, d, segment, model, 0.5)
    torch.testing.assert_close(a, torch.tensor([[1.5, 1.5, 0.0, 0.5, 0.5, 0.0]]))  # .5 + .5 * 2; the answer: A


# -- taco on turns -------------------------------------------------------------------------------------------------
# One group of four, width 8. Rows 0 and 2: turns at tokens 0-1, 4-5 and 7 (replies 2-3 and 6): starts 0, 4, 7.
# Row 1: turns 0-1 and 4-5 (reply 2-3), padding 6-7: starts 0, 4. Row 3: one turn (tokens 0-3), no call.
MASK = [[1] * 8, [1] * 6 + [0, 0], [1] * 8, [1, 1, 1, 1, 0, 0, 0, 0]]
TOOL = [[1, 1, 0, 0, 1, 1, 0, 1], [1, 1, 0, 0, 1, 1, 1, 1], [1, 1, 0, 0, 1, 1, 0, 1], [1] * 8]
# probe answers at each turn start (2 samples): J row 0 [0, 1, 1], row 1 [1, 0], row 2 [0, .5, 0]
ANSWERS = {(0, 0): [" 4", " 4"], (0, 4): [" 5", " 5"], (0, 7): [" 5", " 5"], (1, 0): [" 5", " 5"],
           (1, 4): [" 4", " 4"], (2, 0): [" 4", " 4"], (2, 4): [" 5", " 4"], (2, 7): [" 4", " 4"]}


def turn_batch(rewards=(1.0, 1.0, 0.0, 0.0), answers=ANSWERS, calls=None, scored=None, score=judge, mask=MASK,
               tool=TOOL, **kw):
    def probe_fn(row, end, cue, model):
        if calls is not None:
            calls.append((row, end, cue))
        return {"tokens": [[1]] * len(answers[(row, end)]), "texts": list(answers[(row, end)])}

    def score_fn(row, text):
        if scored is not None:
            scored.append((row, text))
        return score(row, text)

    kw.setdefault("scale_rewards", "none")
    return make_batch(list(rewards), kw.pop("num_generations", len(mask)), completion_mask=mask, tool_mask=tool,
                      probe_fn=probe_fn, score_fn=score_fn, **kw)


def test_turn_vector_dapr_and_ogar():
    calls, scored = [], []
    result = run_plugin(TACO, turn_batch(calls=calls, scored=scored), {"num_samples": 2})
    # A (scale none) = [.5, .5, -.5, -.5]; d: row 0 [1, 0], row 1 [-1], row 2 [.5, -.5]; pooled over the group's
    # five calls: mean 0, sigma sqrt(.5) -> Z = d / 0.707108 = [1.414212, 0], [-1.414212], [.707106, -.707106].
    # OGAR: row 0 (success) keeps its useful call, not its idle one; row 1 (success) drops its misleading call;
    # row 2 (failure) does not blame its useful call, blames the misleading one; answers and row 3 get A.
    expected = torch.tensor([
        [0.5 + Z1, 0.5 + Z1, 0, 0, 0.0, 0.0, 0, 0.5],
        [-Z1, -Z1, 0, 0, 0.5, 0.5, 0, 0],
        [Z5, Z5, 0, 0, -0.5 - Z5, -0.5 - Z5, 0, -0.5],
        [-0.5, -0.5, -0.5, -0.5, 0, 0, 0, 0]])
    torch.testing.assert_close(result.advantages, expected, atol=1e-6, rtol=0)
    assert sorted((r, e) for r, e, _ in calls) == sorted(ANSWERS) and {c for _, _, c in calls} == {TACO_CUE}
    assert {t for _, t in scored} == {"My final answer is 5", "My final answer is 4"}  # the cue's answer part + sample
    m = result.metrics
    assert m["taco/calls"] == 1.25 and m["taco/scored_calls"] == 1.0 and m["taco/value"] == 0.0
    assert (m["taco/useful"], m["taco/misleading"], m["taco/idle"]) == pytest.approx((0.4, 0.4, 0.2))
    # |A| = .5 on each of 18 model tokens; 6 of them (row 0 turn 1, row 1 turn 0, row 2 turn 0) routed away
    assert m["taco/routed_away"] == pytest.approx(1 / 3) and m["taco/j_start"] == pytest.approx(1 / 3)


def test_turn_vector_broadcast_coef_and_normalise():
    a = run_plugin(TACO, turn_batch(), {"num_samples": 2, "routing": "broadcast"}).advantages
    # every model token keeps A_i: row 0 turn 1 .5 + 0; row 1 turn 0 .5 - 1.414212; row 2 turn 0 -.5 + .707106
    assert a[0, 4].item() == pytest.approx(0.5) and a[1, 0].item() == pytest.approx(0.5 - Z1, abs=1e-6)
    assert a[2, 0].item() == pytest.approx(-0.5 + Z5, abs=1e-6)
    a = run_plugin(TACO, turn_batch(), {"num_samples": 2, "probe_coef": 0.0}).advantages  # OGAR alone
    assert a[0].tolist() == [0.5, 0.5, 0, 0, 0, 0, 0, 0.5] and a[1, :2].tolist() == [0, 0]
    a = run_plugin(TACO, turn_batch(), {"num_samples": 2, "normalise": "none", "probe_coef": 0.5}).advantages
    assert a[0, 0].item() == pytest.approx(0.5 + 0.5 * 1.0) and a[2, 4].item() == pytest.approx(-0.5 - 0.25)


def test_score_answer_compares_numbers_with_the_answer_column():
    answers = {**ANSWERS, (0, 0): ["5.0", "about 4"], (0, 4): ["5", "I say 5"], (0, 7): ["x", "05"]}
    batch = turn_batch(answers=answers, columns={"answer": ["5", "5", "5", "5"]},
                       score=lambda r, t: pytest.fail("score: answer must not call the reward functions"))
    points = torch.tensor([[0, 4, 7], [0, 4, -1], [0, -1, -1], [-1, -1, -1]])
    j = TACO(TACO.Config(score="answer", num_samples=2)).success(batch, points)
    # "5.0" = 5 (numeric equality), "about 4" no; "5", "I say 5" yes; "x" (no number) no, "05" = 5
    expected = torch.tensor([[0.5, 1.0, 0.5], [1.0, 0.0, math.nan], [0.0, math.nan, math.nan], [math.nan] * 3])
    torch.testing.assert_close(j, expected, equal_nan=True)
    a = run_plugin(TACO, batch, {"score": "answer", "num_samples": 2}).advantages
    # d: row 0 [.5, -.5], row 1 [-1], row 2 [.5, -.5]; pool mean -.2, population sigma .6 -> Z = (d + .2) / .600001:
    # [1.166665, -.5], [-1.333331], [1.166665, -.5]. Row 0 (success): useful call .5 + 1.166665, misleading one
    # 0 - .5; row 1 (success): 0 - 1.333331; row 2 (failure): useful 0 + 1.166665, misleading -.5 - .5
    s = 0.6 + 1e-6
    expected = torch.tensor([
        [0.5 + 0.7 / s, 0.5 + 0.7 / s, 0, 0, -0.3 / s, -0.3 / s, 0, 0.5],
        [-0.8 / s, -0.8 / s, 0, 0, 0.5, 0.5, 0, 0],
        [0.7 / s, 0.7 / s, 0, 0, -0.5 - 0.3 / s, -0.5 - 0.3 / s, 0, -0.5],
        [-0.5, -0.5, -0.5, -0.5, 0, 0, 0, 0]])
    torch.testing.assert_close(a, expected, atol=1e-6, rtol=0)


def test_nan_probes_are_skipped_and_unscorable_calls_are_no_calls():
    answers = {**ANSWERS, (0, 4): [" 5", "?"], (2, 4): ["?", "?"]}
    result = run_plugin(TACO, turn_batch(answers=answers), {"num_samples": 2})
    a = result.advantages
    # row 0: J(4) = 1 from its one scorable sample: d still [1, 0]. Row 2: J(4) NaN -> both its calls unscored,
    # so they get A = -.5 and leave the pool [1, 0, -1] (mean 0, sigma sqrt(2/3))
    s = math.sqrt(2 / 3) + 1e-6
    assert a[0, 0].item() == pytest.approx(0.5 + 1 / s, abs=1e-6) and a[1, 0].item() == pytest.approx(-1 / s, abs=1e-6)
    assert a[2].tolist() == [-0.5, -0.5, 0, 0, -0.5, -0.5, 0, -0.5]
    assert result.metrics["taco/scored_calls"] == pytest.approx(3 / 5)


def test_a_reward_that_returns_the_rows_own_outcome_is_refused():
    outcome = [1.0, 1.0, 0.0, 0.0]
    with pytest.raises(PluginRuntimeError, match=r"own outcome.*score: answer"):
        run_plugin(TACO, turn_batch(score=lambda row, text: outcome[row]), {"num_samples": 2})
    # the same rollouts judged by the answer column instead
    a = run_plugin(TACO, turn_batch(score=lambda row, text: outcome[row], columns={"answer": ["5"] * 4}),
                   {"num_samples": 2, "score": "answer"}).advantages
    assert torch.isfinite(a).all()


# -- edge cases ----------------------------------------------------------------------------------------------------

def test_single_turn_batch_is_grpo_and_probes_nothing():
    from trl_credit import grpo_advantages

    calls = []
    batch = turn_batch(rewards=[1.0, 0.0, 0.0, 1.0, 0.5, 0.0], mask=[[1] * 4] * 6, tool=None, num_generations=3,
                       calls=calls, scale_rewards="group")
    a = run_plugin(TACO, batch).advantages
    grpo = grpo_advantages(batch.rewards, batch.reward_weights, 3, "group", "sum_then_normalize")
    assert a.dim() == 1 and torch.equal(a, grpo) and calls == []  # TRL's advantages exactly, no probe


def test_all_probes_unscorable_is_grpo_on_the_model_tokens():
    answers = {key: ["?", "?"] for key in ANSWERS}
    a = run_plugin(TACO, turn_batch(answers=answers), {"num_samples": 2}).advantages
    grpo = torch.tensor([0.5, 0.5, -0.5, -0.5])[:, None] * torch.tensor(TOOL) * torch.tensor(MASK)
    torch.testing.assert_close(a, grpo.float())


def test_constant_group_keeps_only_dapr():
    a = run_plugin(TACO, turn_batch(rewards=[1.0] * 4), {"num_samples": 2}).advantages
    # A = 0 everywhere: OGAR routes nothing, the call tokens carry Z alone
    assert a[0, 0].item() == pytest.approx(Z1, abs=1e-6) and a[0, 4].item() == 0.0 and a[0, 7].item() == 0.0
    assert a[3].abs().sum().item() == 0.0
    same = {key: [" 5", " 5"] for key in ANSWERS}  # every call idle: d = 0 -> Z = 0 -> all zero
    assert run_plugin(TACO, turn_batch(rewards=[1.0] * 4, answers=same), {"num_samples": 2}).advantages.abs().max() == 0


def test_rows_without_reward_or_dropped_are_not_probed():
    calls = []

    class DropRowTwo(Plugin):
        @hookimpl
        def filter_rollouts(self, batch):
            return torch.tensor([True, True, False, True])

    batch = turn_batch(rewards=[1.0, None, 0.0, 0.0], calls=calls)
    result = run_plugin(TACO, batch, {"num_samples": 2}, others=[DropRowTwo])
    assert {r for r, _, _ in calls} == {0} and (result.advantages[1:3] == 0).all()
    # row 0 is the only call-maker left: its calls alone form the pool, [1, 0] -> Z = [1, -1] / (0.5 + 1e-6)
    # A_0 = 1 - mean(1, 0, 0) = 2/3 (the dropped row counts in the baseline, the row without a reward does not)
    assert result.advantages[0, 0].item() == pytest.approx(2 / 3 + 0.5 / (0.5 + 1e-6), abs=1e-5)


def test_max_turns_merges_early_turns():
    calls = []
    a = run_plugin(TACO, turn_batch(calls=calls), {"num_samples": 2, "max_turns": 2}).advantages
    # rows 0 and 2 keep turns (0-1 merged, 2): probes at 0 and 7 only; d row 0 = [1], row 1 = [-1], row 2 = [0]
    assert sorted({(r, e) for r, e, _ in calls}) == [(0, 0), (0, 7), (1, 0), (1, 4), (2, 0), (2, 7)]
    # the pool [1, -1, 0]: mean 0, sigma sqrt(2/3) -> Z = +-1 / (sqrt(2/3) + 1e-6); row 2's idle call is blamed
    z = 1 / (math.sqrt(2 / 3) + 1e-6)
    expected = torch.tensor([
        [0.5 + z, 0.5 + z, 0, 0, 0.5 + z, 0.5 + z, 0, 0.5],
        [-z, -z, 0, 0, 0.5, 0.5, 0, 0],
        [-0.5, -0.5, 0, 0, -0.5, -0.5, 0, -0.5],
        [-0.5, -0.5, -0.5, -0.5, 0, 0, 0, 0]])
    torch.testing.assert_close(a, expected, atol=1e-6, rtol=0)


# -- taco_probe on steps -------------------------------------------------------------------------------------------
TEXTS = ["2 + 3 = 5\nso 5\n5", "7 - 2 = 5\n5"]  # steps start at tokens 0, 8, 12 (row 0) and 0, 8 (row 1)
# probe answers at each step start (2 samples): J row 0 [0, 1, .5], row 1 [.5, 1]
STEP_ANSWERS = {0: [[" 4", " 4"], [" 5", " 5"], [" 5", " 4"]], 1: [[" 5", " 4"], [" 5", " 5"]]}


def step_batch(rewards=(1.0, 0.0), answers=STEP_ANSWERS, calls=None, score=judge, **kw):
    tok = tiny_tokenizer()
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    table = {}

    def probe_fn(row, end, cue, model):
        if calls is not None:
            calls.append((row, end))
        return {"tokens": [[1]] * len(table[(row, end)]), "texts": table[(row, end)]}

    kw.setdefault("scale_rewards", "none")
    batch = make_batch(list(rewards), 2, completion_ids=ids, completions=TEXTS, tokenizer=tok, probe_fn=probe_fn,
                       score_fn=score, **kw)
    ends = step_ends(batch)
    for row, values in answers.items():
        starts = [0] + [e for e in ends[row].tolist() if e >= 0][:-1]
        for end, texts in zip(starts, values):
            table[(row, end)] = texts
    return batch, ids


def test_step_vector():
    calls = []
    batch, ids = step_batch(calls=calls)
    result = run_plugin(TacoProbe, batch, {"num_samples": 2})
    a = result.advantages
    # J row 0 [0, 1, .5] -> d [1, -.5]; row 1 [.5, 1] -> d [.5]. Pool [1, -.5, .5]: mean 1/3, population sigma
    # sqrt(7/18) = 0.623610 -> Z = [1.069045, -1.336306], [0.267261]. A = [.5, -.5] (scale none).
    # Row 0: step 0 useful in a success .5 + 1.069045; step 1 misleading, not rewarded: -1.336306; answer .5.
    # Row 1: its useful step is not blamed for the failure: 0 + 0.267261; its answer line -.5.
    s = math.sqrt(7 / 18) + 1e-6
    expected = [[0.5 + (2 / 3) / s] * 8 + [-(5 / 6) / s] * 4 + [0.5], [(1 / 6) / s] * 8 + [-0.5]]
    for row in range(2):
        torch.testing.assert_close(a[row, : len(ids[row])], torch.tensor(expected[row]), atol=1e-5, rtol=0)
    assert sorted(set(calls)) == [(0, 0), (0, 8), (0, 12), (1, 0), (1, 8)]  # the answer step's end is not probed
    assert result.metrics["taco_probe/calls"] == 1.5
    assert result.metrics["taco_probe/value"] == pytest.approx((1 - 0.5 + 0.5) / 3)


def test_step_max_steps_and_one_step_rows():
    calls = []
    batch, ids = step_batch(calls=calls)
    a = run_plugin(TacoProbe, batch, {"num_samples": 2, "max_steps": 2}).advantages
    # row 0 keeps 2 steps (lines 1-2 merged, then the answer): probes at 0 and 12; row 1 unchanged
    assert sorted(set(calls)) == [(0, 0), (0, 12), (1, 0), (1, 8)] and len(set(a[0, :12].tolist())) == 1
    a = run_plugin(TacoProbe, batch, {"num_samples": 2, "max_steps": 1}).advantages  # one step each: GRPO
    assert a.tolist() == [0.5, -0.5]


def test_step_pattern_and_answer_prefix():
    scored = []
    batch, _ = step_batch(score=lambda row, text: scored.append(text) or judge(row, text))
    run_plugin(TacoProbe, batch, {"num_samples": 2, "answer_prefix": "A:"})
    assert {t for t in scored} == {"A: 5", "A: 4"}


# -- checks and contract -------------------------------------------------------------------------------------------

def test_options_are_validated_at_construction():
    for options, key, words in (({"num_samples": 0}, "num_samples", "must be >= 1"),
                                ({"max_new_tokens": 0}, "max_new_tokens", "must be >= 1"),
                                ({"max_turns": 0}, "max_turns", "must be >= 1"),
                                ({"temperature": 0.0}, "temperature", "must be > 0"),
                                ({"probe_coef": -1.0}, "probe_coef", ">= 0"),
                                ({"cue": "  "}, "cue", "must not be empty"),
                                ({"routing": "all"}, "routing", "gated"),
                                ({"max_turn": 3}, "max_turn", "did you mean 'max_turns'")):
        with pytest.raises(ConfigError) as err:
            plugin_set(TACO, options)
        text = str(err.value)
        assert "(taco)" in text and f"option '{key}'" in text and words in text, text
    with pytest.raises(ConfigError, match=r"\(taco_probe\): option 'max_steps': Value error, must be >= 1"):
        plugin_set(TacoProbe, {"max_steps": 0})


def test_check_args():
    grpo = {"per_device_train_batch_size": 8, "num_generations": 4}
    for cls, options, key in ((TACO, {"score": "answer", "reward": "r"}, "reward"),
                              (TACO, {"score": "answer", "answer_prefix": "A:"}, "answer_prefix"),
                              (TACO, {"answer_column": "gold"}, "answer_column"),
                              (TacoProbe, {"pattern": "\n*"}, "pattern")):
        with pytest.raises(ConfigError) as err:
            check_args(cls, options, reward_names=["r"], **grpo)
        assert f"{key}:" in str(err.value) and "fix:" in str(err.value), str(err.value)
    with pytest.raises(ConfigError, match=r"guess_reward reads the rollout's outcome.*score: answer"):
        check_args(TACO, {}, reward_names=["guess_reward"], **grpo)
    check_args(TACO, {"score": "answer"}, reward_names=["guess_reward"], **grpo)
    with pytest.raises(ConfigError, match="gold"):  # score: answer needs its column in the dataset
        check_args(TACO, {"score": "answer", "answer_column": "gold"}, reward_names=["r"], **grpo)
    with pytest.raises(ConfigError, match="judge"):  # the reward column must be one a reward function produces
        check_args(TacoProbe, {"reward": "judge"}, reward_names=["r"], **grpo)


@pytest.mark.parametrize("key", ["taco", "taco_probe"])
def test_contract_for_both_keys(key):
    check_plugin(key)  # the kit's edge cases (single turns, single steps)
    check_plugin(key, {"num_samples": 2}, batches=[
        lambda: turn_batch(), lambda: turn_batch(rewards=[1.0, None, 0.0, 1.0]), lambda: turn_batch(rewards=[1.0] * 4),
        lambda: step_batch()[0], lambda: step_batch(rewards=(None, 1.0))[0]])


def test_plugins_are_installed_under_their_keys():
    from trl_credit.testing import load_plugin

    assert load_plugin("taco") is TACO and load_plugin("taco_probe") is TacoProbe


# -- real training runs --------------------------------------------------------------------------------------------

class Record(Plugin):
    """Keeps every final batch and its advantages."""

    name = "record"
    seen: list = []

    @hookimpl
    def on_batch_end(self, batch, advantages):
        Record.seen.append((batch, advantages.clone()))


def loop_reference(batch, options, temperature):
    """`taco` with `score: answer` written out with loops over rows, turns and tokens, from the batch's cached
    probes: J per turn start, d, the group z-score, the gate and the token advantages."""
    from trl_credit import grpo_advantages, last_number

    g, n = batch.num_generations, batch.num_completions
    a = grpo_advantages(batch.rewards, batch.reward_weights, g, "group", "sum_then_normalize").tolist()
    model = (batch.completion_mask * batch.tool_mask).tolist()
    turns = []  # per row: the token positions of each model turn
    for row in model:
        spans, previous = [], 0
        for t, m in enumerate(row):
            if m and not previous:
                spans.append([])
            if m:
                spans[-1].append(t)
            previous = m
        turns.append(spans)
    width = max(len(s) for s in turns)
    starts = torch.tensor([[s[0] for s in spans] + [-1] * (width - len(spans)) if len(spans) > 1 else [-1] * width
                           for spans in turns])
    probes = batch.probe(starts, TACO_CUE, num_samples=options["num_samples"],
                         max_new_tokens=options["max_new_tokens"], temperature=temperature, top_k=1)
    d = [[] for _ in range(n)]
    for i, spans in enumerate(turns):
        if len(spans) < 2 or not math.isfinite(float(batch.total_reward()[i])):
            continue
        gold = Decimal(str(batch.column("answer")[i]))
        j = [sum(float(last_number(x) == gold) for x in probes.texts[i][k]) / options["num_samples"]
             for k in range(len(spans))]
        d[i] = [j[k + 1] - j[k] for k in range(len(spans) - 1)]
    out = torch.zeros(n, batch.completion_ids.shape[1])
    for group in range(n // g):
        rows = range(group * g, group * g + g)
        pool = [x for i in rows for x in d[i]]
        mean = sum(pool) / len(pool) if pool else 0.0
        sigma = math.sqrt(sum((x - mean) ** 2 for x in pool) / len(pool)) if pool else 0.0
        scale = 1.0 if sigma < 1e-6 else sigma + 1e-6
        for i in rows:
            for k, span in enumerate(turns[i]):
                if k < len(d[i]):
                    gate = (a[i] > 0 and d[i][k] > 0) or (a[i] < 0 and d[i][k] <= 0)
                    value = (a[i] if gate else 0.0) + (d[i][k] - mean) / scale
                else:
                    value = a[i]
                for t in span:
                    out[i, t] = value
    return out, d


def test_taco_trains_on_scripted_turns(tmp_path):
    Record.seen.clear()
    options = {"score": "answer", "num_samples": 2, "max_new_tokens": 4}
    trainer = train_tiny([{"name": "taco", **options}, Record], output_dir=tmp_path, rollout_func=ScriptedTurns(),
                         reward_funcs=[scripted_turns_reward], max_completion_length=32)
    logs = trainer.state.log_history[0]
    assert math.isfinite(logs["loss"]) and logs["trl_credit/taco/calls"] > 0
    assert logs["trl_credit/cost/probe_tokens"] > 0 and 0.0 <= logs["trl_credit/taco/routed_away"] <= 1.0
    shares = logs["trl_credit/taco/useful"] + logs["trl_credit/taco/misleading"] + logs["trl_credit/taco/idle"]
    assert shares == pytest.approx(1.0)
    batch, advantages = Record.seen[-1]
    assert int(batch.turns().count.max()) > 1 and advantages.dim() == 2
    expected, d = loop_reference(batch, options, trainer.args.temperature)
    model = batch.turns().model
    torch.testing.assert_close(advantages[model], expected[model], atol=1e-5, rtol=0)
    # OGAR at work on the trained batch: calls that did not help a solved rollout lost their outcome credit
    assert any(x <= 0 for row in d for x in row) and logs["trl_credit/taco/routed_away"] > 0
    assert trainer.state.log_history[-1]["train_loss"] is not None


def parity_reward(completions, **kwargs):
    """A text reward that varies on the tiny random model's output (1 for an odd number of characters), beside the
    arithmetic answer reward that such a model never earns: groups and probe answers get different scores."""
    from trl_credit import completion_text

    return [float(len(completion_text(c)) % 2) for c in completions]


def test_taco_probe_trains_on_arithmetic_steps(tmp_path):
    from trl_credit import grpo_advantages
    from trl_credit.testing import answer_reward

    Record.seen.clear()
    options = {"num_samples": 2, "max_new_tokens": 4, "max_steps": 3, "pattern": r"\s+"}
    trainer = train_tiny([{"name": "taco_probe", **options}, Record], output_dir=tmp_path, max_completion_length=12,
                         reward_funcs=[answer_reward, parity_reward])
    logs = trainer.state.log_history[0]
    assert math.isfinite(logs["loss"]) and logs["trl_credit/taco_probe/calls"] > 0
    assert logs["trl_credit/cost/probe_tokens"] > 0 and logs["trl_credit/cost/score_texts_seconds"] >= 0
    m = {k.rsplit("/", 1)[-1]: v for k, v in logs.items() if k.startswith("trl_credit/taco_probe/")}
    assert m["useful"] + m["misleading"] + m["idle"] == pytest.approx(1.0) and math.isfinite(m["value"])
    assert m["idle"] < 1.0 and 0.0 <= m["routed_away"] <= 1.0  # the probes' scores moved: some calls have a value
    batch, advantages = Record.seen[-1]
    assert advantages.dim() == 2 and torch.isfinite(advantages).all()
    # what was trained on is the formula on that batch (probes cached; the run's rewards re-score the answers)
    torch.testing.assert_close(advantages, run_plugin(TacoProbe, batch, options).advantages)
    # with broadcast routing and no DAPR term it is GRPO's outcome advantage on every completion token, and
    # DAPR + OGAR changed the credit of some of them
    plain = run_plugin(TacoProbe, batch, {**options, "routing": "broadcast", "probe_coef": 0.0}).advantages
    grpo = grpo_advantages(batch.rewards, batch.reward_weights, batch.num_generations, "group", "sum_then_normalize")
    mask = batch.completion_mask.bool()
    torch.testing.assert_close(plain[mask], grpo[:, None].expand_as(plain)[mask])
    assert (advantages[mask] - plain[mask]).abs().max() > 0.1
    assert trainer.state.log_history[-1]["train_loss"] is not None
