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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from trl_credit.batch import RolloutBatch

__all__ = ["AUGMENTED", "SOURCE_PROMPT", "Augmentation", "joint_advantages", "source_keys", "with_context"]

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
    ``prompts``: instead of one ``prompt``, one prompt per new completion (``G`` of them), e.g. S-GRPO's
    serial exits: each a prefix of one completion plus a cue (`RolloutBatch.prefix_prompt`).
    """

    group: int
    prompt: Any = None
    context: str = "augmented"
    replace: bool = False
    train_on_source: bool = False
    prompts: list | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.prompts is None):
            raise ValueError("Augmentation: give prompt (one for the G new completions) or prompts (one each)")

    def prompt_of(self, j: int) -> Any:
        """The prompt of the ``j``-th new completion."""
        return self.prompt if self.prompts is None else self.prompts[j]


def with_context(prompt: Any, text: str, position: str = "user", separator: str = "\n\n") -> Any:
    """``prompt`` with ``text`` added (a hint, a skill, a privileged context; nothing is modified in place).

    Chat prompts get it appended to the last user message (``position="user"``) or to / as the system
    message (``"system"``); plain-string prompts get it appended (``user``) or in front (``system``).

    Raises:
        ValueError: ``position="user"`` and the prompt has no user message.
        TypeError: the message to extend has non-text content.
    """
    if isinstance(prompt, str):
        return f"{prompt}{separator}{text}" if position == "user" else f"{text}{separator}{prompt}"
    messages = [dict(m) for m in prompt]
    if position == "system":
        if not (messages and messages[0].get("role") == "system"):
            return [{"role": "system", "content": text}, *messages]
        index = 0
    else:
        users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
        if not users:
            raise ValueError("the prompt has no user message to add the context to; use position 'system'")
        index = users[-1]
    content = messages[index].get("content")
    if not isinstance(content, str):
        raise TypeError(f"can only add the context to text message content, got {type(content).__name__}")
    messages[index]["content"] = f"{content}{separator}{text}"
    return messages


def source_keys(batch: RolloutBatch) -> list[tuple[int, str]]:
    """Per group: (dataset row, repr of the *source* prompt); an augmented group shares its source's key."""
    g = batch.num_generations
    marks = batch.columns.get(AUGMENTED) or [None] * batch.num_completions
    sources = batch.columns.get(SOURCE_PROMPT) or [None] * batch.num_completions
    index = batch.prompt_index.tolist()
    return [(int(index[f]), repr(batch.prompts[f] if marks[f] is None else sources[f]))
            for f in range(0, batch.num_completions, g)]


def joint_advantages(batch: RolloutBatch, advantages: torch.Tensor, contexts: set[str]) -> torch.Tensor | None:
    """Advantages with each augmented group (context in ``contexts``) and its source group sharing one baseline.

    ``u`` = the ``2G`` total rewards of source and augmented group; ``A = (u - mean u) / (std + 1e-4)``
    (std per pair for ``scale_rewards`` group, of the batch for batch, none: no division), NaN rows 0.
    The pairs' rows take these values (broadcast over tokens for ``(N, T)`` advantages); other rows keep
    ``advantages``. None when no augmented group of ``contexts`` has its source group in the batch.
    """
    import torch

    marks = batch.columns.get(AUGMENTED)
    if not marks:
        return None
    g = batch.num_generations
    keys = source_keys(batch)
    firsts = range(0, batch.num_completions, g)
    plain: dict[tuple[int, str], int] = {}
    for gi, f in enumerate(firsts):  # a loop over groups, bounded by the batch's group count
        if marks[f] is None:
            plain.setdefault(keys[gi], gi)
    pairs, used = [], set()
    for gi, f in enumerate(firsts):
        source = plain.get(keys[gi]) if marks[f] in contexts else None
        if source is not None and source not in used:
            pairs.append((source, gi))
            used.add(source)
    if not pairs:
        return None
    device = batch.device
    groups = torch.tensor(pairs, dtype=torch.long, device=device)  # (A, 2): source, augmented
    offsets = torch.arange(g, device=device)
    rows = (groups.unsqueeze(2) * g + offsets).reshape(len(pairs), 2 * g)  # (A, 2G)
    total = batch.total_reward()
    u = total[rows]
    finite = ~torch.isnan(u)
    count = finite.sum(dim=1, keepdim=True)
    mean = torch.nansum(u, dim=1, keepdim=True) / count.clamp(min=1)
    centred = torch.where(finite, u - mean, torch.zeros_like(u))
    scale = getattr(batch.args, "scale_rewards", "group")
    scale = {True: "group", False: "none"}.get(scale, scale)
    if scale == "none":
        joint = centred
    else:
        if scale == "batch":
            ok = total[~torch.isnan(total)]
            std = ok.std() if ok.numel() > 1 else torch.zeros((), device=device)
        else:  # group: the pair's own (unbiased) std
            std = (centred.pow(2).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
        joint = centred / (std + 1e-4)
    out = advantages.clone()
    flat = rows.reshape(-1)
    values = joint.reshape(-1).to(out.dtype)
    out[flat] = values.unsqueeze(1).expand(-1, out.shape[1]) if out.dim() == 2 else values
    return out
