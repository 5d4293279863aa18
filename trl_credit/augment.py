"""Extra generation inside a round: a plugin asks for more completions of chosen groups from a changed prompt.

After TRL has generated and scored a round, ``augment_rollouts`` plugins may return `Augmentation`
requests. For each one the host builds ``G`` input rows from the group's dataset row with the new
prompt, generates and scores them through TRL's own ``_generate_and_score_completions`` (so vLLM
and the run's reward functions apply), and adds them to the round as a group of its own, or in place
of the group it came from. Augmented rows carry two batch columns: `AUGMENTED` (the request's
``context``, e.g. the hint; None on ordinary rows) and `SOURCE_PROMPT` (the prompt of the group the
request came from, for off-context corrections with ``batch.completion_logps``). Prompt statistics
(curricula) do not count augmented completions.

Bounds: at most as many augmented groups per round as the round has groups; with ``P`` processes
the requests are cut to a multiple of ``P`` (each process generates an equal share). Metered:
``trl_credit/augmented_groups``, ``trl_credit/augmented_tokens`` and ``trl_credit/augmented_ratio``
(augmented completion tokens over the round's own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["AUGMENTED", "SOURCE_PROMPT", "Augmentation"]

AUGMENTED = "trl_credit_augmented"  # batch column: the request's context on augmented rows, None elsewhere
SOURCE_PROMPT = "trl_credit_source_prompt"  # batch column: the prompt the augmented group came from


@dataclass
class Augmentation:
    """One request of an ``augment_rollouts`` plugin: ``G`` more completions for group ``group``.

    ``prompt``: the prompt to generate from, in the dataset's format (a string or a list of chat
    messages), e.g. the group's prompt plus a hint. ``context``: what was changed (stored in the
    `AUGMENTED` column; never empty). ``replace``: the new group takes the place of ``group`` (its
    completions leave the batch); otherwise it is added as a group of its own.
    ``train_on_source``: the loss trains the new completions after the group's *own* prompt, with the
    prompt they were sampled from as the behaviour policy: TRL's importance ratio becomes
    ``pi_theta(y_t | x, y_<t) / pi_old(y_t | x + hint, y_<t)`` (Guide's off-context correction). The
    host then stores old log-probs for the whole batch (one no-grad pass where TRL skipped them) and,
    with a KL term, the reference log-probs of those rows after the group's own prompt.
    """

    group: int
    prompt: Any
    context: str = "augmented"
    replace: bool = False
    train_on_source: bool = False
