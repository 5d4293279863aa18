"""Reward functions: the project's own, TRL's ``trl.rewards`` by name, and dotted import paths.

All follow TRL's reward-function protocol: ``f(completions, **columns) -> list[float | None]``, where
``completions`` are strings or, for conversational prompts, lists of message dicts.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Sequence
from decimal import Decimal, InvalidOperation
from typing import Any

from trl_credit.answers import completion_text, last_number
from trl_credit.app.guess import guess_reward

__all__ = ["arithmetic_accuracy", "arithmetic_steps", "completion_text", "known_reward_names", "last_number",
           "resolve_reward_funcs"]

RewardFunc = Callable[..., list[Any]]

def arithmetic_accuracy(completions: Sequence[Any], answer: Sequence[Any], **kwargs: Any) -> list[float]:
    """1.0 where the last integer in the completion equals ``answer``, else 0.0.

    A final ``12.0`` counts as 12; a final ``12.5`` (not an integer) or no number at all scores 0.
    """
    rewards: list[float] = []
    for completion, gold in zip(completions, answer, strict=True):
        predicted = last_number(completion_text(completion))
        try:
            target: Decimal | None = Decimal(str(gold).strip().replace(",", ""))
        except InvalidOperation:
            target = None
        ok = (
            predicted is not None
            and target is not None
            and predicted == predicted.to_integral_value()
            and predicted == target
        )
        rewards.append(1.0 if ok else 0.0)
    return rewards


def arithmetic_steps(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """Mean step score of each completion under the built-in ``arithmetic`` step checker.

    The completion is cut into steps at newlines (:func:`trl_credit.steps.split_steps`); a step
    scores 1.0 when every integer equation in it is right, 0.0 when one is wrong or it holds none
    (:func:`trl_credit.app.arithmetic_steps.arithmetic_step_scores`). A completion without steps scores 0.0. A
    deterministic process-score column (a stand-in for a PRM) for shapers such as P-GRPO or Trust-GRPO.
    """
    from trl_credit.app.arithmetic_steps import arithmetic_step_scores
    from trl_credit.steps import split_steps

    steps = [split_steps(completion_text(c))[0] for c in completions]
    scores = arithmetic_step_scores([None] * len(steps), list(completions), steps)
    return [sum(row) / len(row) if row else 0.0 for row in scores]


def _builtin_registry(max_completion_len: int, soft_punish_cache: int) -> dict[str, RewardFunc]:
    from trl import rewards as trl_rewards

    return {
        "arithmetic_accuracy": arithmetic_accuracy,
        "arithmetic_steps": arithmetic_steps,
        "guess_solved": guess_reward,
        "accuracy_reward": trl_rewards.accuracy_reward,
        "reasoning_accuracy_reward": trl_rewards.reasoning_accuracy_reward,
        "think_format_reward": trl_rewards.think_format_reward,
        "get_soft_overlong_punishment": trl_rewards.get_soft_overlong_punishment(
            max_completion_len=max_completion_len, soft_punish_cache=soft_punish_cache
        ),
    }


def known_reward_names() -> list[str]:
    """Names :func:`resolve_reward_funcs` accepts without a dotted path."""
    return ["arithmetic_accuracy", "arithmetic_steps", "guess_solved", "accuracy_reward", "reasoning_accuracy_reward",
            "think_format_reward", "get_soft_overlong_punishment"]  # fmt: skip


def _import_dotted(path: str) -> RewardFunc:
    module_path, sep, attr = path.replace(":", ".").rpartition(".")
    if not sep or not module_path or not attr:
        raise ValueError(f"not a dotted import path: {path!r}")
    if os.getcwd() not in sys.path:  # like `trl grpo`: modules next to the config are importable
        sys.path.insert(0, os.getcwd())
    module = importlib.import_module(module_path)
    try:
        func = getattr(module, attr)
    except AttributeError:
        raise ValueError(f"reward function {path!r}: module {module_path!r} has no attribute {attr!r}") from None
    if not callable(func):
        raise ValueError(f"reward function {path!r} is not callable")
    return func


def resolve_reward_funcs(
    names: Sequence[str | RewardFunc],
    *,
    max_completion_len: int = 1280,
    soft_punish_cache: int = 256,
) -> list[RewardFunc]:
    """Turn reward names into callables, in order.

    A name is one of :func:`known_reward_names` (the project's ``arithmetic_accuracy`` and TRL's
    ``accuracy_reward``, ``reasoning_accuracy_reward``, ``think_format_reward``,
    ``get_soft_overlong_punishment``), or a dotted import path ``pkg.module.func`` (``pkg.module:func``
    also works; the working directory is importable, as in ``trl grpo``). Callables pass through.

    ``get_soft_overlong_punishment`` is instantiated with ``max_completion_len`` and
    ``soft_punish_cache`` (defaults: TRL's grpo script's 1280 and 256; pass the run's
    ``max_completion_length`` to match it).

    Raises:
        ValueError: an unknown plain name (the message lists the known ones) or a bad dotted path.
    """
    registry: dict[str, RewardFunc] | None = None
    funcs: list[RewardFunc] = []
    for name in names:
        if callable(name):
            funcs.append(name)
            continue
        if name in known_reward_names():
            if registry is None:
                registry = _builtin_registry(max_completion_len, soft_punish_cache)
            funcs.append(registry[name])
        elif "." in name or ":" in name:
            funcs.append(_import_dotted(name))
        else:
            raise ValueError(
                f"unknown reward function {name!r}; known: {', '.join(known_reward_names())}, "
                "or a dotted import path such as 'my_pkg.rewards.my_reward'"
            )
    return funcs
