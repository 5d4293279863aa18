"""Answer extraction shared by rewards and plugins: the text of a completion, the last number in it, the answer
part of a probe cue."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from decimal import Decimal
from typing import Any

__all__ = ["NUMBER_PATTERN", "answer_prefix", "completion_text", "has_answer", "last_number"]

# A number: optional minus (only when not glued to a preceding digit, so "5-3" reads as 5 and 3),
# digits with optional thousands separators, optional decimals (so "12.0" reads as 12).
NUMBER_PATTERN = re.compile(r"(?:(?<!\d)-)?\d+(?:,\d{3})*(?:\.\d+)?")


def completion_text(completion: Any) -> str:
    """Text of one completion: a string, or the last message's ``content`` of a message list."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    if isinstance(completion, Sequence) and completion:
        content = completion[-1].get("content", "") if isinstance(completion[-1], dict) else completion[-1]
        if isinstance(content, list):  # multimodal parts: keep the text ones
            return "".join(p.get("text", "") for p in content if isinstance(p, dict))
        return "" if content is None else str(content)
    return ""


def last_number(text: str) -> Decimal | None:
    """The last number written in ``text`` (e.g. ``"12 + 7 = 19."`` -> Decimal("19")), or None."""
    matches = NUMBER_PATTERN.findall(text)
    if not matches:
        return None
    return Decimal(matches[-1].replace(",", ""))


def answer_prefix(cue: str) -> str:
    """The part of a probe cue that is scored with the sampled answer: the text after the cue's last ``</think>``,
    leading whitespace stripped (``"\\n</think>\\nThe final answer is"`` -> ``"The final answer is"``).

    A forced answer (MRT, TACO) is sampled after ``prefix + cue`` but judged as a completion of its own: the
    reward functions then see ``answer_prefix(cue) + answer``, the answer with the words that introduce it.
    """
    return cue.rsplit("</think>", 1)[-1].lstrip()


def has_answer(value: Any) -> bool:
    """A dataset's gold answer is present: not None, not a float NaN (a missing cell), not empty after stripping."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return False
    return bool(str(value).strip())
