"""GRPO-CARE: a consistency bonus for accurate completions whose answer a slow (EMA) reference finds likely.

Method. GRPO rewards a correct answer whether or not the reasoning before it supports it. GRPO-CARE keeps a
slow reference model, an exponential moving average (EMA) of the policy, and reads how likely it finds each
completion's *answer* given the completion's own reasoning: ``p_i``, the geometric-mean probability of the
answer tokens. Among the group's accurate completions, those whose ``p_i`` is not below the accurate ones'
mean (minus a margin) get a bonus on top of their rewards: answers that follow from their reasoning are
preferred. Here the EMA reference is the auxiliary LoRA adapter ``ema`` on the policy's base model, which the
host keeps as an EMA of the policy adapter.

Formula (group of G completions ``i``; ``acc`` the accuracy reward column; ``A_i`` the answer-span tokens)::

    p_i   = min(exp(mean_{t in A_i} log pi_ema(y_it | prompt, y_i<t)), confidence_upper_bound)
    S_g   = {i : acc_i > min_accuracy and acc_i >= mean_g(acc)}              accurate set
    mu_g  = mean_{i in S_g, A_i non-empty} p_i
    b_i   = bonus_coefficient * acc_i   if i in S_g, A_i non-empty and p_i >= mu_g - margin,   else 0
    R_i   = sum_k w_k r_ik + b_i        (the bonus is the reward column ``care_bonus``, weight 1)
    EMA, after every ``ema_every`` optimiser steps: w_ema <- ema_decay * w_ema + (1 - ema_decay) * w_policy

Source: methods.md 2.24; official code ``TencentARC/GRPO-CARE@b0628fcc``
``src/r1-v/src/open_r1/trainer/grpo_trainer_ref_ema.py`` (``get_thinking_answer_masks`` and the ``use_care``
block, ~L560-610: answer-span mean of the reference log-probs, ``exp``, clamp to ``confidence_upper_bound``,
accurate mask ``acc > 0.1 and acc >= mean(acc)``, ``confident = p >= mean_accurate(p) - consistency_margin``,
bonus ``acc * bonus_coefficient`` added to the summed rewards), ``ema_trainer.py`` (``moving_average``:
``lerp(w, w_ema, decay)`` after every ``ref_ema_update_every``-th optimiser step) and
``scripts/run_grpo_care_margin0.01_seed_bench_r1.sh`` (decay 0.995 every 10 steps, bonus 0.5, upper bound
0.95, margin 0.01, beta 0, G = 8).

Established (code): everything in the formula above but the answer span and the rules below marked chosen;
the accuracy column is the first reward function's; the reference is the EMA, scored on the completion's own
tokens; the run has no KL term (beta = 0). The code's group is one device's batch, which its script makes one
prompt's G completions: here the mean and ``mu`` are per group.

Chosen here (the code is template-specific or silent):

- answer span: the code takes the tokens after the last ``<answer>`` token up to EOS - 3 (``</answer>`` in its
  template). Here the span is the *last match* of the regex ``answer_pattern`` in the completion text (its
  group ``answer`` or its first group when it has groups, else the whole match); the default is the text after
  the last ``<answer>`` up to ``</answer>`` or the end. Text after ``</answer>`` is left out (the code keeps it
  but for 3 tokens). Tokens are in the span when their text overlaps it; tokens of only whitespace are not.
- fallback when ``answer_pattern`` does not match: ``last_number`` (default: the last number, as the host's
  answer reward reads it), ``last_line`` (the last non-blank line) or ``none`` (no span).
- an empty span (no match, blank answer) is *not confident* (no bonus) and left out of ``mu``; the code would
  score ``exp(0) = 1``, clamped to 0.95 (methods.md: treat as not confident).
- no accurate completion with a span in a group: ``mu`` is undefined and the group gets no bonus (the code's
  mean of an empty set is NaN, so no comparison holds: the same outcome).
- a NaN accuracy ("no reward") is never accurate and is left out of the group mean.
- the span mean is exact (the code divides by ``count + 1e-6``); ``margin: 0`` is the code's margin-free run.

The answer's character span (trimmed of surrounding whitespace) selects the tokens whose text overlaps it
(`trl_credit.token_char_offsets`).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from trl_credit import Adapter, ConfigError, Plugin, Regex, completion_text, hookimpl, token_char_offsets

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch, RunInfo

__all__ = ["ANSWER_PATTERN", "GRPOCARE", "accurate_set", "answer_spans", "answer_token_mask", "care_bonus"]

#: The code's template: after the last ``<answer>``, up to ``</answer>`` or the end of the completion.
ANSWER_PATTERN = r"(?s)<answer>((?:(?!</answer>).)*)"
#: The fallbacks: the last number (the host's answer reward reads it), the last non-blank line.
FALLBACKS = {"last_number": r"(?:(?<!\d)-)?\d+(?:,\d{3})*(?:\.\d+)?", "last_line": r"[^\n]*\S[^\n]*", "none": None}


def _last_span(regex: re.Pattern, text: str) -> tuple[int, int] | None:
    matches = list(regex.finditer(text))
    if not matches:
        return None
    last = matches[-1]
    if "answer" in regex.groupindex:
        return last.span("answer")
    return last.span(1) if regex.groups else last.span()


def answer_spans(texts: list[str], pattern: str = ANSWER_PATTERN, fallback: str = "last_number"
                 ) -> list[tuple[int, int] | None]:
    """Character span ``[start, end)`` of each text's answer: the last match of ``pattern`` (group ``answer``,
    else group 1, else the whole match), else the last match of the ``fallback`` pattern, else None."""
    regex = re.compile(pattern)
    backup = re.compile(FALLBACKS[fallback]) if FALLBACKS[fallback] else None
    spans = []
    for text in texts:
        span = _last_span(regex, text)
        if span is None and backup is not None:
            span = _last_span(backup, text)
        spans.append(span)
    return spans


def answer_token_mask(batch: RolloutBatch, spans: list[tuple[int, int] | None]) -> torch.Tensor:
    """``(N, T)`` bool: the completion tokens whose text overlaps row ``i``'s character span, the span trimmed
    of surrounding whitespace (not masked tokens, not tokens without text). Blank spans and None select nothing."""
    import torch

    starts, ends = token_char_offsets(batch)  # (N, T) character span of every token
    texts = [completion_text(c) for c in batch.completions]
    bounds = []
    for text, span in zip(texts, spans):
        if span is None:
            bounds.append((0, 0))
            continue
        lo, hi = span
        inner = text[lo:hi]
        lo, hi = lo + (len(inner) - len(inner.lstrip())), hi - (len(inner) - len(inner.rstrip()))
        bounds.append((lo, max(hi, lo)))
    lo, hi = torch.tensor(bounds, dtype=torch.long, device=starts.device).reshape(-1, 2).unbind(1)
    real = batch.completion_mask.bool().to(starts.device) & (ends > starts)
    return real & (starts < hi.unsqueeze(1)) & (ends > lo.unsqueeze(1)) & (hi > lo).unsqueeze(1)


def accurate_set(accuracy: torch.Tensor, num_generations: int, min_accuracy: float = 0.1) -> torch.Tensor:
    """``(N,)`` bool: ``acc_i > min_accuracy and acc_i >= mean_g(acc)``; a NaN accuracy is never accurate and
    stays out of its group's mean."""
    acc = accuracy.reshape(-1, num_generations)
    mean_acc = acc.nanmean(1, keepdim=True)  # an all-NaN group: NaN, and no comparison with NaN holds
    return ((acc > min_accuracy) & (acc >= mean_acc)).reshape(-1)


def care_bonus(accuracy: torch.Tensor, confidence: torch.Tensor, has_span: torch.Tensor, num_generations: int,
               coefficient: float = 0.5, margin: float = 0.01, min_accuracy: float = 0.1) -> torch.Tensor:
    """``(N,)`` bonus ``coefficient * acc_i`` for the accurate completions (`accurate_set`) with a span whose
    (clamped) confidence is ``>= mu_g - margin``, ``mu_g`` the mean confidence of the group's accurate
    completions with a span (none: no bonus in the group); 0 elsewhere."""
    import torch

    g = num_generations
    accurate = accurate_set(accuracy, g, min_accuracy).reshape(-1, g)
    p, span = confidence.reshape(-1, g), has_span.reshape(-1, g)
    scored = accurate & span
    count = scored.sum(1, keepdim=True)
    mu = torch.where(scored, p, 0.0).sum(1, keepdim=True) / count.clamp(min=1)
    confident = span & (p >= mu - margin) & (count > 0)
    return torch.where(accurate & confident, coefficient * accuracy.reshape(-1, g).nan_to_num(0.0), 0.0).reshape(-1)


class GRPOCARE(Plugin):
    """GRPO-CARE's reward shaper: a consistency bonus from the answer likelihood under an EMA reference adapter."""

    name = "grpo_care"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        reward: str | None = Field(None, description="accuracy reward column (acc); null: the first reward column")
        bonus_coefficient: float = Field(0.5, ge=0, description="bonus = bonus_coefficient * acc (the script's 0.5)")
        margin: float = Field(0.01, ge=0, description="confident when p >= mu - margin (consistency_margin; "
                              "0: the code's margin-free run)")
        confidence_upper_bound: float | None = Field(0.95, gt=0, le=1, description="clamp p to at most this "
                                                     "(null: no clamp)")
        min_accuracy: float = Field(0.1, description="accurate when acc > min_accuracy and acc >= the group mean "
                                    "(the code's 0.1)")
        ema_decay: float = Field(0.995, gt=0, lt=1, description="EMA reference: w <- d * w + (1 - d) * w_policy "
                                 "(ref_ema_decay)")
        ema_every: int = Field(10, ge=1, description="EMA update period in optimiser steps (ref_ema_update_every)")
        answer_pattern: Regex = Field(ANSWER_PATTERN, description="regex whose last match is the answer span (its "
                                    "group 'answer', else group 1, else the whole match); default: after the "
                                    "last <answer> up to </answer> or the end")
        fallback: Literal["last_number", "last_line", "none"] = Field(
            "last_number", description="answer span when answer_pattern does not match: the last number, the "
            "last non-blank line, or none (no span: no bonus)")


    def adapters(self):
        return [Adapter("ema", ema_decay=self.config.ema_decay, ema_every=self.config.ema_every)]

    def required_rewards(self):
        return [self.config.reward] if self.config.reward else []

    def check_args(self, run: RunInfo) -> None:
        if self.config.reward is None and not run.reward_names:
            raise ConfigError.for_key("reward", "no reward column to read the accuracy from (the run has no "
                                      "reward functions)", "add an accuracy reward function or set `reward:`")
        aggregation = getattr(run.args, "multi_objective_aggregation", "sum_then_normalize")
        if aggregation != "sum_then_normalize":
            raise ConfigError.for_key(
                "multi_objective_aggregation", f"{aggregation!r} normalises the care_bonus column on its own, so "
                "the advantage is not GRPO-CARE's (the normalised sum of the rewards and the bonus)",
                "use `multi_objective_aggregation: sum_then_normalize` (TRL's default)")

    @hookimpl
    def shape_rewards(self, batch: RolloutBatch) -> dict:
        import torch

        cfg = self.config
        accuracy = batch.reward(cfg.reward) if cfg.reward else batch.rewards[:, 0]
        spans = answer_spans([completion_text(c) for c in batch.completions], cfg.answer_pattern, cfg.fallback)
        mask = answer_token_mask(batch, spans)
        has_span = mask.any(1)
        accurate = accurate_set(accuracy, batch.num_generations, cfg.min_accuracy)
        confidence = torch.zeros(batch.num_completions, device=batch.device)
        if (accurate & has_span).any():  # otherwise no bonus is possible: the EMA pass is skipped
            logps = self.adapter("ema").logps(batch)
            weight = mask.to(logps.dtype)
            mean = (logps * weight).sum(1) / weight.sum(1).clamp(min=1)
            confidence = mean.exp()
            if cfg.confidence_upper_bound is not None:
                confidence = confidence.clamp(max=cfg.confidence_upper_bound)
            confidence = torch.where(has_span, confidence, 0.0)
            self.log_metric(batch, "confidence", float(confidence[has_span].mean()))
        bonus = care_bonus(accuracy, confidence, has_span, batch.num_generations, cfg.bonus_coefficient, cfg.margin,
                           cfg.min_accuracy)
        self.log_metric(batch, "span_rate", float(has_span.float().mean()))
        self.log_metric(batch, "accurate_rate", float(accurate.float().mean()))
        self.log_metric(batch, "bonus_rate", float((bonus > 0).float().mean()))
        self.log_metric(batch, "bonus_mean", float(bonus.mean()))
        return {"care_bonus": (bonus.to(batch.rewards.dtype), 1.0)}
