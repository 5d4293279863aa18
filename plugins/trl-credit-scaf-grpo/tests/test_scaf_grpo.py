"""Scaf-GRPO: warm-up, stagnation, tier choice (both readings), the joint baseline, checks, and a real run."""

from __future__ import annotations

import pytest
import torch

from trl_credit import ConfigError
from trl_credit.testing import check_args, check_plugin, make_batch, plugin_set, run_plugin, tiny_dataset, train_tiny
from trl_credit_scaf_grpo import ScafGRPO, failed_groups, hinted_prompt, joint_advantages

G = 4
AUG, SRC = "trl_credit_augmented", "trl_credit_source_prompt"
TIERS = ("hint_concept", "hint_strategy", "hint_step")
CTX = [f"scaf_grpo tier {k + 1}: {c}" for k, c in enumerate(TIERS)]
QUESTIONS = [[{"role": "user", "content": f"What is {i} + {i}?"}] for i in range(3)]
HINTS = {"hint_concept": ["addition", "sums", "plus"], "hint_strategy": ["add them", "double it", "twice"],
         "hint_step": ["0 + 0 = ?", "1 + 1 = ?", "2 + 2 = ?"]}
ANSWERS = ["0", "2", "4"]
COLUMNS = {**HINTS, "answer": ANSWERS}


def batch(plain, hinted=(), step=5, columns=None, **kw):
    """Plain groups 0..len(plain)-1 (prompt i, dataset row i), then hinted groups ``(source, tier, rewards)``."""
    cols = {**COLUMNS, **(columns or {})}
    groups = [(i, None, r) for i, r in enumerate(plain)] + [(s, CTX[t], r) for s, t, r in hinted]
    rows = [(i, mark, v) for i, mark, r in groups for v in r]
    return make_batch([v for _, _, v in rows], G, step=step, prompt_index=[i for i, _, _ in rows],
                      prompts=[QUESTIONS[i] if m is None else hinted_prompt(QUESTIONS[i], "h", "Hint: {hint}")
                               for i, m, _ in rows],
                      columns={**{k: [v[i] for i, _, _ in rows] for k, v in cols.items()},
                               AUG: [m for _, m, _ in rows], SRC: [None if m is None else QUESTIONS[i]
                                                                   for i, m, _ in rows]}, **kw)


def plain(rewards, step=5, **kw):
    """Only plain groups (what augment_rollouts sees): ``rewards`` is a list of per-group lists."""
    g = len(rewards)
    return make_batch([v for r in rewards for v in r], G, step=step, prompts=[QUESTIONS[i] for i in range(g)
                                                                              for _ in range(G)],
                      columns={k: [v[i] for i in range(g) for _ in range(G)] for k, v in {**COLUMNS, **kw.pop(
                          "columns", {})}.items()}, **kw)


def plugin(config=None):
    return plugin_set(ScafGRPO, {"warmup_steps": 0, **(config or {})}).plugins[0].instance


FAIL, ONE = [0, 0, 0, 0], [1, 0, 0, 0]


def test_no_hints_during_the_warm_up_and_only_for_stagnant_groups():
    p = plugin({"warmup_steps": 2})
    assert p.augment_rollouts(plain([FAIL, ONE, FAIL], step=1)) == []  # step 1 < W = 2: guidance-free
    assert p.streak == {0: 1, 2: 1}  # the diagnosis runs during the warm-up too
    out = p.augment_rollouts(plain([FAIL, ONE, [0, None, 0, 0]], step=2))  # NaN counts as a fail
    assert [r.group for r in out] == [0, 2] and p.streak == {0: 2, 2: 2}
    # a group with no verdict at all is no failure: no hint is spent on it, and its streak resets
    q = plugin()
    assert [r.group for r in q.augment_rollouts(plain([FAIL, [None] * 4], step=2))] == [0] and q.streak == {0: 1}
    assert out[0].prompt == [{"role": "user", "content": "What is 0 + 0? Hint: addition"}]
    assert out[0].context == CTX[0] and out[0].train_on_source and not out[0].replace
    assert failed_groups(torch.tensor([0.0, 0.4, 0.6, 0.0]), 2, 0.5).tolist() == [True, False]
    nan = float("nan")  # a NaN fails beside a scored 0; a group with no reward at all is not a failure
    assert failed_groups(torch.tensor([nan, 0.0, nan, nan]), 2, 0.5).tolist() == [True, False]
    # warmup_fraction: W = ceil(0.15 * 20) = 3
    p = plugin_set(ScafGRPO, {}).plugins[0].instance
    assert p.augment_rollouts(plain([FAIL], step=2, max_steps=20)) == []
    assert len(p.augment_rollouts(plain([FAIL], step=3, max_steps=20))) == 1


def test_patience_counts_consecutive_all_fail_visits_per_dataset_row():
    p = plugin({"patience": 2})
    assert p.augment_rollouts(plain([FAIL, ONE, ONE])) == []  # prompt 0: first all-fail visit
    assert [r.group for r in p.augment_rollouts(plain([FAIL, FAIL, ONE]))] == [0]  # prompt 0: 2nd; prompt 1: 1st
    assert [r.group for r in p.augment_rollouts(plain([ONE, FAIL, ONE]))] == [1]  # prompt 1: 2nd in a row
    assert p.streak == {1: 2}  # prompt 0's success reset its streak
    assert [r.group for r in p.augment_rollouts(plain([FAIL, FAIL, ONE]))] == [1]  # prompt 0 starts again at 1
    assert p.streak == {0: 1, 1: 3}


def test_across_visits_escalates_one_tier_after_an_all_fail_hinted_group():
    p = plugin()
    (r,) = p.augment_rollouts(plain([FAIL, ONE]))
    assert r.context == CTX[0] and r.prompt[-1]["content"].endswith("Hint: addition")
    p.on_batch_end(batch([FAIL, ONE], [(0, 0, FAIL)]), None)  # the concept hint still all-fail: one tier up
    assert p.level == {0: 1}
    (r,) = p.augment_rollouts(plain([FAIL, ONE]))
    assert r.context == CTX[1] and r.prompt[-1]["content"].endswith("Hint: add them")
    p.on_batch_end(batch([FAIL, ONE], [(0, 1, ONE)]), None)  # strategy worked: stays the minimal tier
    assert p.level == {0: 1}
    p.on_batch_end(batch([FAIL, ONE], [(0, 2, FAIL)]), None)  # a failed top tier stays at the top
    assert p.level == {0: 2}
    p.augment_rollouts(plain([ONE, ONE]))  # the prompt is solved without hints: back to the concept tier
    assert p.level == {} and p.streak == {}


def test_leaky_or_empty_tiers_are_skipped():
    p = plugin()
    p.level = {0: 2, 1: 0}
    # prompt 0's step hint contains its answer "0": the highest usable tier below is used instead;
    # prompt 1 has no concept hint: the first usable tier >= 0 is the strategy
    cols = {"hint_step": ["0 + 0 = 0", "1 + 1 = ?", "x"], "hint_concept": ["addition", "", "plus"]}
    out = p.augment_rollouts(plain([FAIL, FAIL], columns=cols))
    assert [(r.group, r.context) for r in out] == [(0, CTX[1]), (1, CTX[1])]
    out = plugin({"allow_answer_in_hint": True, "escalation": "all_tiers"}).augment_rollouts(
        plain([FAIL, ONE, ONE], columns=cols))
    assert [r.context for r in out] == CTX  # the answer check is off: every tier (3 fit in a round of 3 groups)


def test_all_tiers_requests_tier_major_and_the_filter_keeps_the_lowest_successful_tier():
    p = plugin({"escalation": "all_tiers", "placement": "replace", "baseline": "own"})
    out = p.augment_rollouts(plain([FAIL, ONE, FAIL]))
    # 2 stagnant groups x 3 tiers = 6, cut to the round's 3 groups, concept tiers first
    assert [(r.group, r.context, r.replace) for r in out] == [(0, CTX[0], True), (2, CTX[0], True),
                                                              (0, CTX[1], False)]
    # prompt 0: tier 1 fails, tiers 2 and 3 succeed -> keep tier 2; prompt 2: every tier fails -> drop all
    b = batch([FAIL, ONE, FAIL], [(0, 0, FAIL), (0, 1, ONE), (0, 2, [1, 1, 0, 0]), (2, 0, FAIL), (2, 1, FAIL)])
    keep = plugin({"escalation": "all_tiers"}).filter_rollouts(b)
    assert keep.tolist() == [True, True, True, False, True, False, False, False]
    result = run_plugin(ScafGRPO, b, {"warmup_steps": 0, "escalation": "all_tiers"})
    assert result.metrics["scaf_grpo/kept_hinted_groups"] == 1.0
    assert result.metrics["scaf_grpo/solved_prompts"] == 0.5


def test_joint_baseline_hand_computed():
    # group 0 (prompt 0) all-fail, group 1 (prompt 1) [1,0,1,1], group 2: concept hints for prompt 0, [1,0,1,0]
    b = batch([FAIL, [1, 0, 1, 1]], [(0, 0, [1, 0, 1, 0])])
    adv = run_plugin(ScafGRPO, b, {"warmup_steps": 0}).advantages
    # joint u = (0,0,0,0, 1,0,1,0): mean 0.25, unbiased var (6*0.25^2 + 2*0.75^2)/7 = 1.5/7, std 0.4629100
    #   -> 0.75/(0.4629100+1e-4) = 1.6198353, -0.25/(0.4629100+1e-4) = -0.5399451
    # group 1 untouched (TRL): mean 0.75, std 0.5 -> 0.25/0.5001 = 0.4999000, -0.75/0.5001 = -1.4997001
    hi, lo = 1.6198353, -0.5399451
    expected = [lo] * 4 + [0.4999000, -1.4997001, 0.4999000, 0.4999000] + [hi, lo, hi, lo]
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=0, atol=1e-6)
    # scale_rewards none: u - 0.25
    adv = run_plugin(ScafGRPO, batch([FAIL, [1, 0, 1, 1]], [(0, 0, [1, 0, 1, 0])], scale_rewards="none"),
                     {"warmup_steps": 0}).advantages
    torch.testing.assert_close(adv[[0, 8, 9]], torch.tensor([-0.25, 0.75, -0.25]))
    # baseline own: the hinted group is its own GRPO group, +-0.5/(0.5773503+1e-4) = +-0.8658754
    adv = run_plugin(ScafGRPO, b, {"warmup_steps": 0, "baseline": "own"}).advantages
    torch.testing.assert_close(adv[[0, 8, 9]], torch.tensor([0.0, 0.8658754, -0.8658754]), rtol=0, atol=1e-6)
    # per-token advantages: the pair's rows take the joint value on every token; other rows are kept
    tokens = torch.full((12, 4), 7.0)
    out = joint_advantages(b, tokens, set(CTX))
    assert out[8].tolist() == pytest.approx([hi] * 4, abs=1e-6) and out[4].tolist() == [7.0] * 4
    # no source group in the batch (e.g. dropped by a filter): nothing to pair
    assert joint_advantages(batch([], [(0, 0, [1, 0, 1, 0])]), torch.zeros(4), set(CTX)) is None


def test_check_args_and_declarations():
    cols = ["prompt", "answer", *TIERS]
    with pytest.raises(ConfigError, match=r"\(scaf_grpo\).*template.*no \{hint\} placeholder.*Hint: \{hint\}"):
        check_args(ScafGRPO, {"template": "a hint", "warmup_steps": 0}, columns=cols)
    with pytest.raises(ConfigError, match=r"\(scaf_grpo\).*tier_columns.*twice.*list each hint column once"):
        check_args(ScafGRPO, {"tier_columns": ["a", "a"], "warmup_steps": 0}, columns=["prompt", "answer", "a"])
    with pytest.raises(ConfigError, match=r"\(scaf_grpo\).*baseline.*'replace' removes.*baseline: own"):
        check_args(ScafGRPO, {"placement": "replace", "warmup_steps": 0}, columns=cols)
    with pytest.raises(ConfigError, match=r"\(scaf_grpo\).*warmup_steps.*max_steps > 0 \(got -1.*set `warmup_steps`"):
        check_args(ScafGRPO, {}, columns=cols)
    with pytest.raises(ConfigError, match="hint_step"):  # the host checks the declared columns
        check_args(ScafGRPO, {"warmup_steps": 0}, columns=["prompt", "answer", *TIERS[:2]])
    check_args(ScafGRPO, {}, columns=cols, max_steps=100)
    check_args(ScafGRPO, {"placement": "replace", "baseline": "own", "warmup_steps": 0}, columns=cols)
    assert plugin().disabled_hooks() == ["filter_rollouts"]
    assert plugin({"escalation": "all_tiers", "baseline": "own"}).disabled_hooks() == ["transform_advantages"]
    factories = [lambda: batch([FAIL, ONE], [(0, 0, [1, 0, 1, 0]), (0, 1, FAIL)]), lambda: batch([FAIL, FAIL]),
                 lambda: batch([ONE, [None] * 4], [(1, 2, [None, 1, 0, 0])])]
    check_plugin(ScafGRPO, {"warmup_steps": 0}, batches=factories)  # state round-trip included
    check_plugin(ScafGRPO, {"warmup_steps": 0, "escalation": "all_tiers"}, batches=factories)


def test_state_round_trip():
    p = plugin({"patience": 3})
    p.augment_rollouts(plain([FAIL, FAIL]))
    p.on_batch_end(batch([FAIL, FAIL], [(1, 0, FAIL)]), None)
    state = p.state_dict()
    assert state == {"streak": {0: 1, 1: 1}, "level": {1: 1}}
    fresh = plugin({"patience": 3})
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state


def hinted_half(completions, **kwargs):
    """1.0 for every other hinted completion, 0 elsewhere (the tiny model never answers right by itself)."""
    marks = kwargs.get(AUG) or [None] * len(completions)
    return [1.0 if m is not None and i % 2 == 0 else 0.0 for i, m in enumerate(marks)]


def test_a_real_run_warms_up_then_hints_and_trains(tmp_path):
    data = tiny_dataset(32)
    for col, hint in zip(TIERS, ["addition counts on", "add the tens and the ones", "count up from the first"]):
        data = data.add_column(col, [hint] * len(data))
    trainer = train_tiny([{"name": ScafGRPO, "warmup_steps": 1}], output_dir=tmp_path, dataset=data,
                         reward_funcs=[hinted_half], train=False)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2
    assert logs[0]["trl_credit/scaf_grpo/in_warmup"] == 1.0 and logs[0]["trl_credit/scaf_grpo/hinted_groups"] == 0.0
    assert "trl_credit/augmented_groups" not in logs[0]
    h = logs[1]  # step 1: both (all-fail) prompts get a concept hint, half of the hinted completions pass
    assert h["trl_credit/scaf_grpo/in_warmup"] == 0.0 and h["trl_credit/scaf_grpo/hinted_groups"] == 2.0
    assert h["trl_credit/scaf_grpo/tier1_groups"] == 2.0 and h["trl_credit/scaf_grpo/tier_mean"] == 1.0
    assert h["trl_credit/augmented_groups"] == 2.0 and h["trl_credit/scaf_grpo/tier1_pass_rate"] == 0.5
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, trainer.model.parameters()))
