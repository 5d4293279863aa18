"""Option types plugins share in their pydantic ``Config``: checked when the config is loaded.

    from trl_credit import AnswerTemplate, Regex

    class Config(BaseModel):
        pattern: Regex = Field(r"\\n+", description="step delimiter")
        template: AnswerTemplate = Field(" {answer}", description="text around the gold answer")
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator

__all__ = ["AnswerTemplate", "Regex"]


def _regex(value: str | None) -> str | None:
    if value is not None:
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"not a valid regex: {exc}") from None
    return value


def _answer_template(value: str) -> str:
    if "{answer}" not in value:
        raise ValueError(f"the template {value!r} has no {{answer}} placeholder")
    return value


#: A string that must compile as a regular expression.
Regex = Annotated[str, AfterValidator(_regex)]
#: A string with an ``{answer}`` placeholder (replaced literally by the gold answer).
AnswerTemplate = Annotated[str, AfterValidator(_answer_template)]
