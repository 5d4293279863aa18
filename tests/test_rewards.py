"""Tests for trl_credit.app.rewards."""

from __future__ import annotations

import sys

import pytest

from trl_credit.app.rewards import arithmetic_accuracy, known_reward_names, resolve_reward_funcs


@pytest.mark.parametrize(
    ("text", "answer", "expected"),
    [
        ("19", "19", 1.0),
        ("12 + 7 = 19.", "19", 1.0),  # last integer wins
        ("19, no wait: 12 + 7 = 21", "19", 0.0),  # ... even when an earlier one is right
        ("The answer is -5", "-5", 1.0),  # negative numbers
        ("The answer is 5", "-5", 0.0),
        ("8-3", "3", 1.0),  # a minus glued to a digit is subtraction, not a sign
        ("x = -3", "-3", 1.0),
        ("no digits here", "0", 0.0),  # no integer at all
        ("", "0", 0.0),
        ("1,000", "1000", 1.0),  # thousands separator
        ("12.0", "12", 1.0),
        ("12.5", "12", 0.0),
        ("0019", "19", 1.0),
        ("19", " 19 ", 1.0),
        ("19", "not a number", 0.0),
    ],
)
def test_arithmetic_accuracy_strings(text, answer, expected):
    assert arithmetic_accuracy([text], [answer]) == [expected]


def test_arithmetic_accuracy_conversational_and_batch():
    completions = [
        [{"role": "assistant", "content": "It is 7"}],
        [{"role": "assistant", "content": "It is 8"}],
        [{"role": "assistant", "content": "7"}, {"role": "assistant", "content": "no idea"}],  # last message
        [{"role": "assistant", "content": [{"type": "text", "text": "= 7"}]}],
    ]
    assert arithmetic_accuracy(completions, ["7", "7", "7", "7"], prompts=["p"] * 4) == [1.0, 0.0, 0.0, 1.0]
    assert arithmetic_accuracy(["3", "4"], [3, 5]) == [1.0, 0.0]  # int answers too


def test_arithmetic_accuracy_length_mismatch_raises():
    with pytest.raises(ValueError):
        arithmetic_accuracy(["1", "2"], ["1"])


def test_resolve_builtin_and_trl_names():
    from trl import rewards as trl_rewards

    funcs = resolve_reward_funcs(
        ["arithmetic_accuracy", "accuracy_reward", "reasoning_accuracy_reward", "think_format_reward"]
    )
    assert funcs == [
        arithmetic_accuracy,
        trl_rewards.accuracy_reward,
        trl_rewards.reasoning_accuracy_reward,
        trl_rewards.think_format_reward,
    ]
    think = funcs[3]
    good = [[{"role": "assistant", "content": "<think>\nhmm\n</think>\n19"}]]
    assert think(good) == [1.0] and think([[{"role": "assistant", "content": "19"}]]) == [0.0]
    assert set(known_reward_names()) >= {"arithmetic_accuracy", "get_soft_overlong_punishment"}


def test_resolve_soft_overlong_punishment_uses_lengths():
    (default,) = resolve_reward_funcs(["get_soft_overlong_punishment"])
    assert default(completion_ids=[[1] * 1024, [1] * 2000]) == [0.0, -1.0]  # TRL script's 1280 / 256
    (short,) = resolve_reward_funcs(["get_soft_overlong_punishment"], max_completion_len=100, soft_punish_cache=20)
    assert short(completion_ids=[[1] * 10, [1] * 90, [1] * 101]) == [0.0, -0.5, -1.0]


def test_resolve_dotted_paths_and_callables(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod_xyz.py").write_text(
        "def const_reward(completions, **kw):\n    return [0.5] * len(completions)\n"
    )
    monkeypatch.chdir(tmp_path)  # like `trl grpo`, modules in the working directory are importable
    monkeypatch.setattr(sys, "path", list(sys.path))
    dotted, colon, direct = resolve_reward_funcs(
        ["my_rewards_mod_xyz.const_reward", "my_rewards_mod_xyz:const_reward", len]
    )
    assert dotted(["a", "b"]) == [0.5, 0.5] and colon is dotted and direct is len
    assert resolve_reward_funcs(["trl_credit.app.rewards.arithmetic_accuracy"]) == [arithmetic_accuracy]
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        resolve_reward_funcs(["trl_credit.app.rewards.nope"])
    with pytest.raises(ModuleNotFoundError):
        resolve_reward_funcs(["no_such_module_xyz.func"])
    sys.modules.pop("my_rewards_mod_xyz", None)


def test_resolve_unknown_name_lists_known():
    with pytest.raises(ValueError, match="unknown reward function 'acuracy'") as info:
        resolve_reward_funcs(["acuracy"])
    for name in known_reward_names():
        assert name in str(info.value)
