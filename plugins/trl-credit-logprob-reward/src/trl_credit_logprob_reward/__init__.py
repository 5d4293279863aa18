r"""Log-probability of the reference answer as a reward ("likelihood-based reward designs").

Method. A verifier-free reward: keep completion ``i``'s chain of thought ``z_i``, cut off its own final answer,
teacher-force the dataset's reference answer ``y*`` after it and reward the completion with the log-probability
the model gives ``y*``. Of the likelihood-based designs the source compares, only the *log*-probability of the
reference answer was consistently good (probability rewards a la VeriFree flatline on long answers).

Formula (completion ``i`` of prompt ``x``, ``c_i`` its text, ``m`` the ``marker`` regex)::

    z_i  = c_i[: end of the last match of m]            (the marker stays: "... the answer is")
           c_i                                           no match, fallback "whole" (a truncated CoT is still scored)
           ""                                            no match, fallback "empty" (the completion is all answer)
           then trailing whitespace stripped
    R_i  = sum_t  log pi(y*_t | render(x) + z_i, y*_<t)      reduce "sum"  (the template's tokens: " {answer}")
         = (1/|y*|) sum_t ...                                 reduce "mean"
    pi   = the policy (no grad) or the reference (``model``); ``render``: the chat template with the
           generation prompt for message prompts, the string itself otherwise

``R_i`` is a new reward column (``reward_name``, weight ``weight`` or 1.0) or replaces the column ``replace``.

Source: methods.md 2.25, from the paper's abstract only ("Likelihood-Based Reward Designs"; no code).
Established: the reward is the log-probability of the reference answer teacher-forced after the model's own
reasoning, the answer part replaced by ``y*``; no gradient flows through it (the current policy, no-grad).
Not established, offered as options: sum vs per-token mean (``reduce``; sum is "the log-probability", mean is
length-invariant across prompts); the model (``model``).

Chosen here (the source is silent):

- the CoT/answer split: cut right after the *last* match of ``marker`` (default ``answer is:?|=``,
  case-insensitive); the model's own answer-introducing phrase stays in ``z_i`` and the template supplies the
  separator (" {answer}"), so the boundary between ``z_i`` and ``y*`` is the same text for every completion of
  a group. The continuation is tokenised on its own (the host's ``continuation_logps``), so every completion of
  a prompt scores the same ``y*`` tokens. Without a marker the whole completion is ``z_i`` (``fallback: whole``:
  a truncated CoT is still scored, as the spec asks) or nothing is (``fallback: empty``: answer-only outputs);
- ``template`` places the answer (``{answer}`` replaced literally): boxed answers use ``marker: '\\boxed\{'``
  and ``template: '{answer}}'``;
- a completion whose prompt has no reference answer (None, NaN, empty) gets the mean reward of the completions
  of its group that have one, 0 when none has: the host refuses NaN in a new reward column, and the group mean
  is neutral under the group baseline (a whole group without an answer is a constant column: no signal);
- under the run's per-group std scaling with this column alone, ``sum`` and ``mean`` give the same advantages
  (``|y*|`` is constant inside a group); they differ across prompts (``scale_rewards: batch``) and when the
  column is mixed with other rewards.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from trl_credit import AnswerTemplate, ConfigError, Plugin, Regex, RunInfo, completion_text, hookimpl

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch

__all__ = ["DEFAULT_MARKER", "LogprobReward", "fill_missing", "is_missing", "render_prompt", "split_reasoning"]

#: Default marker of the start of a completion's final answer (case-insensitive): "the answer is 7", "x = 7".
DEFAULT_MARKER = r"(?i)answer is:?|="


def split_reasoning(text: str, marker: str | re.Pattern, fallback: str = "whole") -> tuple[str, bool]:
    """``(z, found)``: ``text`` up to the end of the last match of ``marker`` (trailing whitespace stripped),
    and whether a match was found; without one, the whole text (``fallback="whole"``) or ``""`` (``"empty"``)."""
    regex = re.compile(marker) if isinstance(marker, str) else marker
    matches = list(regex.finditer(text))
    if not matches:
        return (text.rstrip() if fallback == "whole" else ""), False
    return text[: matches[-1].end()].rstrip(), True


def render_prompt(tokenizer: Any, prompt: Any) -> str:
    """The prompt as the model read it: chat messages through the chat template with the generation prompt,
    strings unchanged."""
    if isinstance(prompt, str):
        return prompt
    return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)


def is_missing(value: Any) -> bool:
    """No reference answer: None, a float NaN, or text that is empty after stripping."""
    if value is None:
        return True
    if isinstance(value, float) and math.isnan(value):
        return True
    return not str(value).strip()


def fill_missing(values: torch.Tensor, present: torch.Tensor, num_generations: int) -> torch.Tensor:
    """``values`` where ``present``, else the mean of the group's present values (0 when none is present)."""
    import torch

    v = values.reshape(-1, num_generations)
    p = present.reshape(-1, num_generations).to(values.dtype)
    mean = (v.nan_to_num(0.0) * p).sum(1) / p.sum(1).clamp(min=1)
    return torch.where(present, values, mean.repeat_interleave(num_generations))


class LogprobReward(Plugin):
    """A reward column R_i = log pi(y* | x, z_i): the reference answer teacher-forced after completion i's CoT."""

    name = "logprob_reward"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        column: str = Field("answer", description="dataset column with the reference answer y*")
        reduce: Literal["sum", "mean"] = Field("sum", description="sum (the log-probability) or per-token mean "
                                               "(length-invariant) of y*'s token log-probs; not established")
        model: Literal["policy", "reference"] = Field("policy", description="scoring model, no grad: the current "
                                                      "policy or the reference (needs PEFT or beta > 0)")
        marker: Regex = Field(DEFAULT_MARKER, description="regex of what introduces the final answer; the CoT z_i "
                            "is the completion up to the end of its last match (the answer after it is cut)")
        fallback: Literal["whole", "empty"] = Field("whole", description="no marker in a completion: z_i is the "
                                                    "whole completion (whole) or empty (empty)")
        template: AnswerTemplate = Field(" {answer}", description="the scored continuation; {answer} is replaced by y*")
        reward_name: str = Field("logprob_reward", description="name of the new reward column")
        replace: str | None = Field(None, description="an existing reward column to overwrite with R (its weight "
                                    "kept unless weight is set) instead of appending reward_name")
        weight: float | None = Field(None, description="weight of the column in the total reward; null: 1.0 for a "
                                     "new column, the existing weight with replace")



    def required_columns(self):
        return [self.config.column]

    def required_rewards(self):
        return [self.config.replace] if self.config.replace else []

    def needs_reference(self) -> bool:
        return self.config.model == "reference"

    def check_args(self, run: RunInfo) -> None:
        cfg = self.config
        if cfg.replace is None and cfg.reward_name in run.reward_names:
            raise ConfigError.for_key(
                "reward_name", f"'{cfg.reward_name}' is already a reward column ({', '.join(run.reward_names)}), "
                "so appending it would overwrite that column", f"set `replace: {cfg.reward_name}` to overwrite it "
                "on purpose, or choose another `reward_name`")

    def continuations(self, batch: RolloutBatch) -> tuple[list[str], list[str], torch.Tensor, torch.Tensor]:
        """``(prefixes, continuations, present, found)``: ``render(x) + z_i`` and ``template(y*)`` per row,
        whether the row has a reference answer, and whether its completion had a marker."""
        import torch

        cfg = self.config
        regex = re.compile(cfg.marker)
        answers = batch.column(cfg.column)
        rendered: dict[str, str] = {}  # the G completions of a prompt share its rendering
        prefixes, conts, present, found = [], [], [], []
        for prompt, completion, answer in zip(batch.prompts, batch.completions, answers):
            key = prompt if isinstance(prompt, str) else repr(prompt)
            if key not in rendered:
                rendered[key] = render_prompt(batch.tokenizer, prompt)
            z, hit = split_reasoning(completion_text(completion), regex, cfg.fallback)
            prefixes.append(rendered[key] + z)
            conts.append(cfg.template.replace("{answer}", "" if is_missing(answer) else str(answer).strip()))
            present.append(not is_missing(answer))
            found.append(hit)
        return (prefixes, conts, torch.tensor(present, dtype=torch.bool, device=batch.device),
                torch.tensor(found, dtype=torch.bool, device=batch.device))

    @hookimpl
    def shape_rewards(self, batch: RolloutBatch) -> dict[str, Any]:
        import torch

        cfg = self.config
        prefixes, conts, present, found = self.continuations(batch)
        rows = present.nonzero().flatten().tolist()
        values = torch.zeros(batch.num_completions, dtype=torch.float32, device=batch.device)
        if rows:  # one teacher-forced sequence per completion with a reference answer
            scores = batch.continuation_logps([prefixes[i] for i in rows], [conts[i] for i in rows],
                                              model=cfg.model, reduce=cfg.reduce)
            values[torch.tensor(rows, device=batch.device)] = scores.to(values)
            self.log_metric(batch, "mean", float(scores.mean()))
        reward = fill_missing(values, present, batch.num_generations)
        self.log_metric(batch, "group_std", float(batch.grouped(reward).std(1, unbiased=False).mean()))
        self.log_metric(batch, "marker_found", float(found.float().mean()))
        self.log_metric(batch, "missing", float((~present).float().mean()))
        target = cfg.replace or cfg.reward_name
        weight = cfg.weight if cfg.weight is not None else (None if cfg.replace else 1.0)
        return {target: reward if weight is None else (reward, weight)}
