"""The built-in step scorer ``arithmetic``: a rule-based checker of integer equations.

The deterministic stand-in for a process reward model that the built-in arithmetic task, the tests
and the benchmarks use. It is registered as a step scorer under the entry-point group
``trl_credit.step_scorers`` (name ``arithmetic``), so ``StepConfig(scorer="arithmetic")`` finds it.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Sequence
from functools import lru_cache
from itertools import accumulate
from typing import Any

__all__ = ["arithmetic_step_scores", "check_equations"]

_OP = r"[-+*×·]"
_NUM = r"-?\d+"
# lhs: operand (op operand)+ with optional parentheses and a leading minus; rhs: an integer
_EQUATION = re.compile(
    rf"(?P<lhs>(?:-\s*)?(?:\(\s*)*{_NUM}(?:(?:\s*\))*\s*{_OP}\s*(?:\(\s*)*{_NUM})+(?:\s*\))*)"
    rf"\s*=\s*(?P<rhs>{_NUM})"
    r"(?![\w.,]\d|\w)"
)
_OPERATORS = frozenset("+-*×·/÷^%")  # an expression continuing past the match: not a plain equation
_GLUED = frozenset("._(),")  # "3.5 + 2", "f(3 + 4": the match is part of something else
_LEADING_ZERO = re.compile(r"(?<!\d)0+(?=\d)")


@lru_cache(maxsize=65536)
def _evaluate(lhs: str) -> int | None:
    """Integer value of ``lhs`` (+, -, *, parentheses, unary minus), or None if it does not parse.

    ``lhs`` comes from ``_EQUATION``, so it holds only digits, spaces, parentheses and single
    operators between operands (never ``**``); Python's own parser evaluates it.
    """
    expr = lhs.replace("×", "*").replace("·", "*")
    depth = expr.count("(") - expr.count(")")
    if depth > 0:  # drop unmatched parentheses at the edges: "(3 + 4 = 7)" checks "3 + 4"
        expr = expr.lstrip()
        while depth > 0 and expr.startswith("("):
            expr, depth = expr[1:].lstrip(), depth - 1
    elif depth < 0:
        expr = expr.rstrip()
        while depth < 0 and expr.endswith(")"):
            expr, depth = expr[:-1].rstrip(), depth + 1
    if "**" in expr or not set(expr) <= _SAFE:
        return None
    expr = _LEADING_ZERO.sub("", expr)
    try:
        value = eval(compile(expr, "<equation>", "eval"), {"__builtins__": {}}, {})
    except (SyntaxError, ValueError, TypeError):
        return None
    return value if isinstance(value, int) else None


_SAFE = frozenset("0123456789+-*() \t")


def check_equations(text: str) -> list[bool]:
    """Every integer equation ``a op b [op c ...] = d`` (ops ``+ - *``, also ``×`` and ``·``;
    parentheses optional) in ``text``, in order: True where it is arithmetically right.

    Left sides that continue an expression the checker cannot read (a variable, a division, a
    decimal, an exponent: ``x - 3 = 4``, ``8 / 2 + 1 = 5``) and right sides that continue
    (``3 + 4 = 10 - 3``, ``= 7.5``) are skipped, not judged.
    """
    return [ok for _, ok in _equations(text)]


def _equations(text: str) -> list[tuple[int, bool]]:
    """``(start, right)`` of every checkable equation in ``text`` (see :func:`check_equations`)."""
    if "=" not in text:
        return []
    results = []
    size = len(text)
    for match in _EQUATION.finditer(text):
        start, end = match.span()
        if start:
            before = text[start - 1]
            if before.isalnum() or before in _GLUED:
                continue  # glued to a word, a decimal or a call: "x-3 + 4 = 1", "3.5 + 2 = 5"
            j = start - 1
            while j >= 0 and text[j] in " \t":
                j -= 1
            if j >= 0 and text[j] in _OPERATORS:
                continue  # the expression goes on to the left: "8 / 2 + 1 = 5"
        k = end
        while k < size and text[k] in " \t":
            k += 1
        if k < size and text[k] in _OPERATORS:
            continue  # the right side goes on: "3 + 4 = 10 - 3"
        value = _evaluate(match.group("lhs"))
        if value is not None:
            results.append((start, value == int(match.group("rhs"))))
    return results


def arithmetic_step_scores(prompts: Sequence[Any], completions: Sequence[Any], steps: Sequence[Sequence[str]],
                           columns: dict[str, list] | None = None, *, neutral: float = 0.0) -> list[list[float]]:
    """Built-in step scorer ``arithmetic``: a rule-based checker standing in for a PRM.

    Each step scores 1.0 when it holds at least one integer equation (:func:`check_equations`)
    and every equation in it is right, 0.0 when any is wrong, and ``neutral`` when it holds none.

    ``neutral`` defaults to 0.0: a step the checker cannot verify earns nothing, so padding a
    solution with unverifiable text is never rewarded (the reward hacking that Clip/Delta and
    gated accumulation guard against). This scorer is deterministic and model-free; it is the
    stand-in for a learned PRM in tests and benchmarks, not a PRM.
    """
    neutral = float(neutral)
    scores = []
    for row in steps:
        out = [neutral] * len(row)
        if row:
            # one regex pass per completion: steps joined by NUL, which no equation can cross
            found = _equations("\x00".join(row))
            if found:
                starts = list(accumulate((len(step) + 1 for step in row[:-1]), initial=0))
                right: dict[int, bool] = {}
                for pos, ok in found:
                    k = bisect_right(starts, pos) - 1
                    right[k] = right.get(k, True) and ok
                for k, ok in right.items():
                    out[k] = 1.0 if ok else 0.0
        scores.append(out)
    return scores


