"""ExPO: which groups get self-explanations, the positives-only filter, the joint baseline, checks, a real run."""

from __future__ import annotations

import pytest
import torch

from trl_credit import ConfigError
from trl_credit.testing import check_args, check_plugin, make_batch, plugin_set, run_plugin, train_tiny
from trl_credit_expo import CONTEXT, ExPO, explained_prompt, joint_advantages

G = 4
AUG, SRC = "trl_credit_augmented", "trl_credit_source_prompt"
QUESTIONS = [[{"role": "user", "content": f"What is {i} + {i}?"}] for i in range(3)]
ANSWERS = ["0", "2", "4"]
FAIL, ONE = [0, 0, 0, 0], [1, 0, 0, 0]


def batch(plain, explained=(), answers=ANSWERS, marks=None, **kw):
    """Plain groups 0.. (prompt i, dataset row i), then explanation groups ``(source, rewards)``."""
    groups = [(i, None, r) for i, r in enumerate(plain)] + [(s, marks or CONTEXT, r) for s, r in explained]
    rows = [(i, m, v) for i, m, r in groups for v in r]
    return make_batch([v for _, _, v in rows], G, prompt_index=[i for i, _, _ in rows],
                      prompts=[QUESTIONS[i] if m is None else explained_prompt(QUESTIONS[i], answers[i], "{answer}")
                               for i, m, _ in rows],
                      columns={"answer": [answers[i] for i, _, _ in rows], AUG: [m for _, m, _ in rows],
                               SRC: [None if m is None else QUESTIONS[i] for i, m, _ in rows]}, **kw)


def plain(rewards, answers=ANSWERS, **kw):
    g = len(rewards)
    return make_batch([v for r in rewards for v in r], G, prompts=[QUESTIONS[i] for i in range(g) for _ in range(G)],
                      columns={"answer": [answers[i] for i in range(g) for _ in range(G)]}, **kw)


def requests(b, config=None):
    plugin = plugin_set(ExPO, config).plugins[0].instance
    return plugin.augment_rollouts(b)


def test_failed_groups_get_an_answer_conditioned_prompt():
    out = requests(plain([FAIL, ONE, [0, None, 0, 0]]))  # NaN counts as a fail
    assert [r.group for r in out] == [0, 2]
    assert out[0].prompt == [{"role": "user", "content": "What is 0 + 0? The answer is 0. Explain how to get it."}]
    assert out[0].context == CONTEXT and out[0].train_on_source and not out[0].replace
    # max_pass_rate 0.25: the group with 1 of 4 right is triggered too; a group without an answer is skipped
    out = requests(plain([FAIL, ONE, [1, 1, 0, 0]], answers=["", "2", "4"]), {"max_pass_rate": 0.25})
    assert [r.group for r in out] == [1]


def test_options_reach_the_requests():
    out = requests(plain([FAIL, FAIL]), {"placement": "replace", "baseline": "own", "train_on_source": False,
                                         "max_groups": 1, "template": "(answer: {answer}) Why?"})
    assert len(out) == 1 and out[0].replace and not out[0].train_on_source
    assert out[0].prompt[-1]["content"] == "What is 0 + 0? (answer: 0) Why?"
    assert explained_prompt("Q", "7", "The answer is {answer}.") == "Q The answer is 7."
    system = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Q"}]
    assert explained_prompt(system, "7", "A={answer}") == [system[0], {"role": "user", "content": "Q A=7"}]


def test_only_correct_drops_wrong_explanations_per_completion():
    b = batch([FAIL, ONE], [(0, [1, 0, None, 1])])
    plugin = plugin_set(ExPO).plugins[0].instance
    keep = plugin.filter_rollouts(b)
    assert keep.tolist() == [True] * 8 + [True, False, False, True]  # plain rows untouched, NaN is wrong
    other = batch([FAIL], [(0, FAIL)], marks="guide hint")  # another plugin's augmented rows are not ours
    assert plugin.filter_rollouts(other) is None
    assert plugin.filter_rollouts(plain([FAIL])) is None


def test_joint_baseline_makes_the_right_explanations_positives():
    # group 0 (prompt 0) all-fail, group 1 [1,0,1,1], group 2: explanations of prompt 0, [1,0,1,0]
    b = batch([FAIL, [1, 0, 1, 1]], [(0, [1, 0, 1, 0])])
    result = run_plugin(ExPO, b)
    # joint u = (0,0,0,0, 1,0,1,0): mean 0.25, unbiased var (6*0.25^2 + 2*0.75^2)/7, std 0.4629100
    #   -> right: 0.75/(0.4629100+1e-4) = 1.6198353, plain: -0.25/(0.4629100+1e-4) = -0.5399451
    # wrong explanations dropped (advantage 0; they still count in the baseline)
    # group 1 untouched (TRL's): mean 0.75, std 0.5 -> 0.25/0.5001 = 0.4999000, -0.75/0.5001 = -1.4997001
    hi, lo = 1.6198353, -0.5399451
    expected = [lo] * 4 + [0.4999000, -1.4997001, 0.4999000, 0.4999000] + [hi, 0.0, hi, 0.0]
    torch.testing.assert_close(result.advantages, torch.tensor(expected), rtol=0, atol=1e-6)
    assert result.metrics["expo/dropped_explanations"] == 2.0
    assert result.metrics["expo/explanation_pass_rate"] == 0.5
    assert result.metrics["expo/explanation_advantage"] == pytest.approx(hi, abs=1e-6)
    # keep every explanation: the wrong ones are pushed down like the plain failures
    adv = run_plugin(ExPO, b, {"only_correct": False}).advantages
    torch.testing.assert_close(adv[8:], torch.tensor([hi, lo, hi, lo]), rtol=0, atol=1e-6)
    # baseline own: the explanations are their own GRPO group: +0.5/(0.5773503+1e-4) = 0.8658754; plain stays 0
    adv = run_plugin(ExPO, b, {"baseline": "own"}).advantages
    torch.testing.assert_close(adv[[0, 8, 9]], torch.tensor([0.0, 0.8658754, 0.0]), rtol=0, atol=1e-6)
    # every explanation right: own gives 0 (no signal); joint: mean 0.5, std sqrt(8*0.25/7) = 0.5345225,
    # 0.5/(0.5345225+1e-4) = 0.9352394
    all_right = batch([FAIL], [(0, [1, 1, 1, 1])])
    assert run_plugin(ExPO, all_right, {"baseline": "own"}).advantages.abs().max() == 0
    adv = run_plugin(ExPO, all_right).advantages
    torch.testing.assert_close(adv, torch.tensor([-0.9352394] * 4 + [0.9352394] * 4), rtol=0, atol=1e-6)
    # every explanation wrong: dropped whole, the failed group stays at 0
    assert run_plugin(ExPO, batch([FAIL], [(0, FAIL)])).advantages.abs().max() == 0
    # per-token advantages: the pair's rows get the value on every token
    out = joint_advantages(b, torch.full((12, 3), 7.0), {CONTEXT})
    assert out[8].tolist() == pytest.approx([hi] * 3, abs=1e-6) and out[4].tolist() == [7.0] * 3


def test_check_args_and_declarations():
    with pytest.raises(ConfigError, match=r"\(expo\).*template.*no \{answer\} placeholder.*The answer is \{answer\}"):
        check_args(ExPO, {"template": "Explain."})
    with pytest.raises(ConfigError, match=r"\(expo\).*baseline.*'replace' removes.*baseline: own"):
        check_args(ExPO, {"placement": "replace"})
    with pytest.raises(ConfigError, match="solution"):  # the host checks the declared column
        check_args(ExPO, {"answer_column": "solution"})
    check_args(ExPO, {})
    check_args(ExPO, {"placement": "replace", "baseline": "own"})
    assert plugin_set(ExPO, {"only_correct": False, "baseline": "own"}).plugins[0].instance.disabled_hooks() == [
        "filter_rollouts", "transform_advantages"]
    factories = [lambda: batch([FAIL, ONE], [(0, [1, 0, 1, 0])]), lambda: batch([FAIL, FAIL], [(1, FAIL)]),
                 lambda: batch([[None] * 4], [(0, [None, 1, 1, 1])]), lambda: plain([FAIL, ONE])]
    check_plugin(ExPO, batches=factories)
    check_plugin(ExPO, {"only_correct": False}, batches=factories)


def explained_half(completions, **kwargs):
    """1.0 for every other explanation, 0 elsewhere (the tiny model never answers right by itself)."""
    marks = kwargs.get(AUG) or [None] * len(completions)
    return [1.0 if m is not None and i % 2 == 0 else 0.0 for i, m in enumerate(marks)]


def test_a_real_run_explains_failed_groups_and_trains(tmp_path):
    trainer = train_tiny(["expo"], output_dir=tmp_path, reward_funcs=[explained_half], train=False)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2
    for h in logs:  # every plain group fails: 2 explanation groups, half of their completions right
        assert h["trl_credit/expo/triggered_groups"] == 1.0 and h["trl_credit/expo/explained_groups"] == 2.0
        assert h["trl_credit/augmented_groups"] == 2.0 and h["trl_credit/expo/explanation_pass_rate"] == 0.5
        assert h["trl_credit/expo/dropped_explanations"] == 4.0 and h["trl_credit/expo/explanation_advantage"] > 0
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, trainer.model.parameters()))
