"""Guide: which groups get hints, the leak check, the options, and a real run through the host's augmentation."""

from __future__ import annotations

import pytest
import torch

from trl_credit import ConfigError
from trl_credit.testing import check_args, check_plugin, make_batch, plugin_set, tiny_dataset, train_tiny
from trl_credit_guide import Guide, failed_groups, hinted_prompt

G = 4
PROMPTS = [[{"role": "user", "content": f"What is {i} + {i}?"}] for i in range(3) for _ in range(G)]


def batch(rewards, hints=("add them", "double it", "twice"), answers=("0", "2", "4")):
    return make_batch(rewards, G, prompts=PROMPTS, columns={"hint": [h for h in hints for _ in range(G)],
                                                            "answer": [a for a in answers for _ in range(G)]})


def requests(b, config=None):
    plugin = plugin_set(Guide, config).plugins[0].instance
    return plugin.augment_rollouts(b), plugin


def test_only_all_fail_groups_get_a_hint():
    # group 0: all fail; group 1: one success; group 2: all fail (NaN counts as a fail)
    out, _ = requests(batch([0, 0, 0, 0, 0, 1, 0, 0, 0, None, 0, 0]))
    assert [r.group for r in out] == [0, 2]
    assert out[0].prompt == [{"role": "user", "content": "What is 0 + 0? Hint: add them"}]
    assert out[0].train_on_source and not out[0].replace and out[0].context == "guide hint"
    assert failed_groups(torch.tensor([0.0, 0.4, 0.6, 0.0]), 2, 0.5).tolist() == [True, False]
    nan = float("nan")  # a NaN fails beside a scored 0; a group with no reward at all is not a failure
    assert failed_groups(torch.tensor([nan, 0.0, nan, nan]), 2, 0.5).tolist() == [True, False]


def test_a_hint_that_contains_the_answer_is_skipped_unless_allowed():
    leaky = batch([0] * 12, hints=("add them", "the answer is 2", "twice"))
    out, plugin = requests(leaky)
    assert [r.group for r in out] == [0, 2]
    out, _ = requests(leaky, {"allow_answer_in_hint": True})
    assert [r.group for r in out] == [0, 1, 2]


def test_options_reach_the_requests():
    out, _ = requests(batch([0] * 12), {"placement": "replace", "correction": False, "max_groups": 1,
                                        "template": "(hint: {hint})"})
    assert len(out) == 1 and out[0].replace and not out[0].train_on_source
    assert out[0].prompt[-1]["content"].endswith("(hint: add them)")
    assert hinted_prompt("What is 1 + 1?", "add", "Hint: {hint}") == "What is 1 + 1? Hint: add"
    system = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Q"}]
    assert hinted_prompt(system, "h", "Hint: {hint}") == [system[0], {"role": "user", "content": "Q Hint: h"}]


def test_check_args_and_declarations():
    with pytest.raises(ConfigError, match=r"\(guide\).*template.*no \{hint\} placeholder.*Hint: \{hint\}"):
        check_args(Guide, {"template": "a hint"}, columns=["prompt", "answer", "hint"])
    with pytest.raises(ConfigError, match="hint"):  # the host checks the declared column
        check_args(Guide, {}, columns=["prompt", "answer"])
    check_args(Guide, {}, columns=["prompt", "answer", "hint"])
    check_plugin(Guide, batches=[lambda: batch([0] * 12), lambda: batch([1, 0, 0, 0] * 3)])


def test_a_real_run_generates_hinted_groups_and_trains_on_the_plain_prompt(tmp_path):
    data = tiny_dataset(32)
    data = data.add_column("hint", ["add the two numbers"] * len(data))
    trainer = train_tiny(["guide"], output_dir=tmp_path, dataset=data, max_steps=2)  # the tiny model never scores
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2
    for h in logs:  # every group fails, so every group gets a hinted one: 2 more groups, 8 completions
        assert h["trl_credit/guide/failed_groups"] == 1.0 and h["trl_credit/guide/hinted_groups"] == 2.0
        assert h["trl_credit/augmented_groups"] == 2.0 and h["trl_credit/augmented_ratio"] > 0
        assert h["trl_credit/guide/hinted_pass_rate"] == 0.0
