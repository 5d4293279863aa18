"""Search-E1: vanilla GRPO interleaved with on-policy self-distillation (OPSD) towards a more efficient sibling.

Paper: "Search-E1: Self-Distillation Drives Self-Evolution in Search-Augmented Reasoning". Method
(abstract): a search agent improves "through only vanilla GRPO interleaved with on-policy
self-distillation (OPSD). After each GRPO round, the policy rolls out on its own training
questions. A token-level forward KL objective then aligns the policy's inference-time distribution
to its own distribution under a privileged context that exposes a more efficient sibling
trajectory." GRPO is TRL's loss, untouched; this plugin adds the OPSD term and, in the alternating
schedule, mutes TRL's loss on the distillation steps.

Formula, as the code runs it (group ``g`` of ``G`` completions, completion ``i``, its sampled tokens
``a_it``, loss mask ``m_it``, ``sg`` stop-gradient, ``x_i`` the prompt)::

    correct_i   = r_i >= threshold   (r: column `outcome_reward`, or TRL's weighted total; NaN: not correct)
    cand_i      = correct_i * kept_i * [|o_i| > 0]                          may serve as a sibling
    key_i       = |o_i|                        shortest_by = "tokens" (default): completion tokens
                = turns_i * (T + 1) + |o_i|    shortest_by = "turns": fewest model turns, then tokens
    b_g         = argmin_{j in g, cand_j} key_j          (ties: the lower row); the "more efficient sibling"
    sib_i       = b_g for i != b_g;  for i = b_g: none (sibling_row = "skip", default) or the
                  second-best candidate of g (sibling_row = "next")
    s_i         = kept_i * [|o_i| > 0] * [sib_i exists] * [o_i != o_sib_i] * [students = "all" or not correct_i]
    x+_i        = x_i with sibling_template(text(o_sib_i)) added          the privileged context
    q_it        = log pi(a_it | x+_i, a_i<t)      no-grad teacher: the policy (batch.completion_logps(x+))
    l_it        = log pi(a_it | x_i, a_i<t)       the student, TRL's own forward pass (with gradient)
    l~_it       = old_logps_it if TRL kept them else sg(l_it)                  the sampler's log-prob
    w_it        = min(exp(q_it - l~_it), ratio_clip)                           truncated IS weight T/S
    J_it        = sg(w_it) * (q_it - l_it) + baseline * (l_it - sg(l_it))     estimator = "forward" (default)
                = (l_it - q_it)^2 / 2                                          estimator = "reverse"
    term        = coef * aggregate_{loss_type}(s_i * J_it)          "opsd", on the steps the schedule picks

Why this estimator. Forward KL at position t, ``KL(T || S) = sum_v T(v) (log T(v) - log S(v))`` with
``T = pi(. | x+, a<t)`` and ``S = pi(. | x, a<t)``, needs the teacher's whole next-token distribution;
the host's scorer (``completion_logps``) gives only the log-prob of the *sampled* token under the
privileged context, so the exact forward KL is not computable here. On the token ``a ~ S`` that was
sampled, importance weighting gives unbiased estimates of both the value and the gradient:
``E_{a~S}[r log r] = KL(T || S)`` with ``r = T(a)/S(a)``, and ``grad KL(T || S) = -sum_v T(v) grad
log S(v) = -E_{a~S}[r grad log S(a)]``. ``J`` above has exactly that value (``w (q - l)``) and
gradient (``-w grad l``); ``baseline = True`` adds the zero-valued control variate ``l - sg(l)``
(``E_S[grad log S] = 0``), so the per-token gradient is ``(1 - w) grad l``: tokens the privileged
teacher finds likelier than the student (``w > 1``) are pushed up, the others down. The weight is
truncated at ``ratio_clip`` (default 2, so ``|1 - w| <= 1``, a per-token pull no larger than a
normalised advantage) because ``r`` is unbounded where the sibling makes a token near-certain; the
truncation biases the estimate towards smaller pulls. ``estimator = "reverse"`` is the usual
on-policy distillation gradient instead, ``(l - q) grad l`` (reverse KL ``KL(S || T)``, k2 objective).
Per position only: the KL of each next-token distribution along the student's own prefix (a
"token-level" objective), no sum over future tokens.

Schedule. ``joint``: the term is added to TRL's GRPO loss at every step. ``alternate`` (default, the
abstract's "after each GRPO round"): optimiser step ``loss.step`` distils iff ``(step + 1) % every ==
0`` (``every = 2``: GRPO, OPSD, GRPO, ...); on those steps the rollouts are fresh samples of the
policy the GRPO rounds produced, and, with ``mute_grpo`` (default), TRL's loss is switched off through
``loss_weights`` (token weight 0: policy term, KL term and entropy bonus) so the step is pure
self-distillation. A distillation step whose generation batch has nothing to distil (no group with a
correct completion) is not muted: it trains GRPO as usual.

Source: reconstructed from the abstract (the code is "to be made public"). Established there: vanilla
GRPO; interleaved with OPSD after each GRPO round, on fresh rollouts of the training questions; a
token-level forward KL; the teacher is the policy itself under a privileged context that exposes a
more efficient sibling trajectory. Chosen (options offer alternatives): the sibling is the group's
shortest correct, kept completion (``shortest_by: tokens``; ``turns``: fewest search/tool turns);
groups without one get no term; the sibling itself gets none (``sibling_row: next``: it distils
towards the second shortest), nor do completions identical to their sibling (a completion never
distils towards itself); every other kept completion is a student, correct or not (``students:
failed``: only the incorrect ones); the sampled-token IS estimator with baseline and truncation at 2
(``reverse`` offered); ``coef = 1``; ``every = 2``; the sibling appended to the last user message as
``sibling_template``. The teacher is scored once per generation batch with the generation-time
weights (a fixed teacher snapshot for all optimiser steps on that batch).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from trl_credit import ConfigError, Plugin, RunInfo, hookimpl, with_context

if TYPE_CHECKING:
    import torch

    from trl_credit import LossInputs, LossWeights, RolloutBatch

__all__ = ["SearchE1", "choose_siblings", "trajectory_text", "with_context"]


def choose_siblings(candidate: torch.Tensor, key: torch.Tensor, num_generations: int,
                    sibling_row: str = "skip") -> torch.Tensor:
    """``(N,)`` long: the row each completion distils towards, -1 for none.

    ``candidate``: ``(N,)`` bool, rows that may serve as a sibling; ``key``: ``(N,)`` efficiency, lower is
    better. The best candidate ``b_g`` of each group (ties: the lower row) is every other row's sibling;
    ``b_g`` itself gets none (``skip``) or the group's second-best candidate (``next``).
    """
    import torch

    g = num_generations
    n = candidate.shape[0]
    ranked = torch.where(candidate, key.to(torch.float64), torch.full_like(key, math.inf, dtype=torch.float64))
    order = torch.sort(ranked.reshape(-1, g), dim=1, stable=True).indices                 # (Q, G)
    base = torch.arange(0, n, g, device=candidate.device).unsqueeze(1)
    best = (order[:, 0:1] + base).squeeze(1)                                              # (Q,) root rows
    second = (order[:, 1:2] + base).squeeze(1) if g > 1 else best
    has_best = candidate[best]
    has_second = candidate[second] & (g > 1) & (sibling_row == "next")
    best, second = best.repeat_interleave(g), second.repeat_interleave(g)
    has_best, has_second = has_best.repeat_interleave(g), has_second.repeat_interleave(g)
    rows = torch.arange(n, device=candidate.device)
    is_best = rows == best
    sibling = torch.where(is_best, second, best)
    has = torch.where(is_best, has_second, has_best)
    return torch.where(has, sibling, torch.full_like(sibling, -1))


def trajectory_text(completion: Any) -> str:
    """The whole trajectory as text: a string as is; a message list as its messages' contents, one per
    paragraph, messages other than the assistant's (tool / search results) labelled with their role."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    parts = []
    for message in completion or []:
        if not isinstance(message, dict):
            parts.append(str(message))
            continue
        content = message.get("content")
        if isinstance(content, list):  # multimodal parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        content = "" if content is None else str(content)
        role = message.get("role", "assistant")
        parts.append(content if role == "assistant" else f"[{role}] {content}")
    return "\n\n".join(parts)


class SearchE1(Plugin):
    """Search-E1: GRPO + coef * aggregate(s_i [sg(w)(q - l) + l - sg(l)]), q = log pi(a | prompt + shortest
    correct sibling), w = min(e^(q - l), c); alternating with GRPO steps (schedule) or joint."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        schedule: Literal["alternate", "joint"] = Field(
            "alternate",
            description="alternate: every `every`-th optimiser step distils (after each GRPO round); joint: the "
            "term is added to the GRPO loss at every step",
        )
        every: int = Field(2, ge=2, description="alternate: step s distils iff (s + 1) % every == 0 (2: GRPO, OPSD, ...)")
        mute_grpo: bool = Field(
            True,
            description="alternate: switch TRL's loss off on the distillation steps (token weight 0), so they are "
            "pure self-distillation; false: the term is added to GRPO on those steps",
        )
        coef: float = Field(1.0, ge=0.0, description="weight of the OPSD term")
        estimator: Literal["forward", "reverse"] = Field(
            "forward",
            description="forward: importance-weighted forward KL(teacher||student) on the sampled tokens; reverse: "
            "on-policy reverse-KL distillation, (l - q)^2 / 2",
        )
        ratio_clip: float = Field(2.0, ge=1.0, description="forward: truncation c of the IS weight min(e^(q - l), c)")
        baseline: bool = Field(
            True,
            description="forward: add the zero-valued control variate l - sg(l), per-token gradient (1 - w) instead "
            "of -w (same expectation, lower variance)",
        )
        outcome_reward: str | None = Field(
            None, description="reward column that decides correctness; null = TRL's weighted total reward",
        )
        threshold: float = Field(0.5, description="a completion is correct iff its outcome reward >= threshold")
        shortest_by: Literal["tokens", "turns"] = Field(
            "tokens",
            description="the more efficient sibling: fewest completion tokens; or fewest model turns (search / tool "
            "calls), then fewest tokens",
        )
        sibling_row: Literal["skip", "next"] = Field(
            "skip",
            description="the chosen sibling's own row: skip = no term; next = distil towards the group's second "
            "shortest correct completion, when there is one",
        )
        students: Literal["all", "failed"] = Field(
            "all", description="rows that distil: every kept completion of the group, or only the incorrect ones",
        )
        sibling_template: str = Field(
            "A correct and efficient solution to this question from an earlier attempt:\n{sibling}\n\n"
            "Solve the question yourself, as efficiently.",
            description="text added to the prompt for the privileged context; {sibling} is the sibling trajectory",
        )
        sibling_position: Literal["user", "system"] = Field(
            "user",
            description="user: append to the last user message; system: append to (or add) the system message; "
            "plain-string prompts get it after them (user) or in front (system)",
        )

        @field_validator("sibling_template")
        @classmethod
        def _has_placeholder(cls, value: str) -> str:
            if "{sibling}" not in value:
                raise ValueError("must contain the placeholder {sibling}")
            return value

    def __init__(self, config: Config | None = None):
        super().__init__(config)
        self._batch: Any = None  # the generation batch the cached values below belong to
        self._sibling: torch.Tensor | None = None  # (N,) sibling row, -1 none
        self._weight: torch.Tensor | None = None  # (N,) s_i
        self._teacher: torch.Tensor | None = None  # (N, T) q, None until scored

    def disabled_hooks(self) -> list[str]:
        """``loss_weights`` only mutes GRPO on distillation steps of the alternating schedule."""
        cfg = self.config
        return [] if cfg.schedule == "alternate" and cfg.mute_grpo else ["loss_weights"]

    def check_args(self, run: RunInfo) -> None:
        """A named outcome reward column must be produced by the reward functions (``num_generations >= 2``,
        so that a group has a sibling, is already enforced by TRL's GRPOConfig)."""
        cfg = self.config
        if cfg.outcome_reward is not None and cfg.outcome_reward not in run.reward_names:
            raise ConfigError.for_key(
                "outcome_reward", f"'{cfg.outcome_reward}' is not a reward column (reward functions: "
                f"{', '.join(run.reward_names) or 'none'})",
                "set `outcome_reward` to the column that says whether a completion is correct, or null for TRL's "
                "weighted total reward")

    # ------------------------------------------------------------------ schedule
    def _distills(self, step: int) -> bool:
        cfg = self.config
        return cfg.schedule == "joint" or (step + 1) % cfg.every == 0

    def _trains_distillation(self, batch: RolloutBatch) -> bool:
        """Does any optimiser step that trains on this generation batch distil?"""
        args = batch.args
        spg = getattr(args, "steps_per_generation", None) or 1
        iterations = getattr(args, "num_iterations", None) or 1
        accumulation = getattr(args, "gradient_accumulation_steps", None) or 1
        span = max(1, math.ceil(spg * iterations / accumulation))
        return any(self._distills(batch.step + k) for k in range(span))

    # ------------------------------------------------------------------ per generation batch
    def _select(self, batch: RolloutBatch) -> None:
        """Siblings and row weights ``s_i`` of a new generation batch."""
        import torch

        if self._batch is batch:
            return
        cfg = self.config
        reward = batch.reward(cfg.outcome_reward) if cfg.outcome_reward is not None else batch.total_reward()
        reward = reward.to(torch.float32)
        correct = ~torch.isnan(reward) & (reward >= cfg.threshold)
        lengths = batch.completion_lengths.to(batch.device)
        kept = batch.kept.to(batch.device)
        if cfg.shortest_by == "turns":
            key = batch.turns().count.to(batch.device) * (batch.width + 1) + lengths
        else:
            key = lengths
        sibling = choose_siblings(correct & kept & (lengths > 0), key, batch.num_generations, cfg.sibling_row)
        has = sibling >= 0
        safe = sibling.clamp(min=0)
        ids = batch.completion_ids.to(batch.device) * batch.completion_mask.to(batch.device)
        same = (ids == ids[safe]).all(dim=1) & (lengths == lengths[safe])        # a copy of its own sibling
        student = torch.ones_like(has) if cfg.students == "all" else ~correct
        weight = (kept & has & ~same & student & (lengths > 0)).to(torch.float32)
        self._batch, self._sibling, self._weight, self._teacher = batch, torch.where(weight > 0, sibling, -1), weight, None

    def _prepare(self, batch: RolloutBatch) -> None:
        """The no-grad teacher pass (``batch.completion_logps`` under the privileged prompts), once per batch."""
        import torch

        self._select(batch)
        if self._teacher is not None:
            return
        cfg = self.config
        teacher = torch.zeros(batch.num_completions, batch.width, device=batch.device)
        rows = torch.nonzero(self._weight > 0).squeeze(1)
        if rows.numel():
            view = batch.select(rows)
            siblings = self._sibling[rows].tolist()
            prompts = [with_context(batch.prompts[i], cfg.sibling_template.replace(
                "{sibling}", trajectory_text(batch.completions[j])), cfg.sibling_position)
                for i, j in zip(rows.tolist(), siblings)]
            teacher[rows] = view.completion_logps(prompts, model="policy").to(teacher)  # collective, every rank
        self._teacher = teacher

    @hookimpl
    def on_batch_end(self, batch: RolloutBatch, advantages: torch.Tensor) -> None:
        self._select(batch)
        if self._trains_distillation(batch):
            self._prepare(batch)  # outside TRL's loss, on every rank
        w = self._weight
        self.log_metric(batch, "distilled_fraction", (w.sum() / batch.kept.sum().clamp(min=1)).item())
        siblings = self._sibling[w > 0]
        if siblings.numel():
            self.log_metric(batch, "sibling_tokens", batch.completion_lengths[siblings].float().mean().item())

    # ------------------------------------------------------------------ per micro-batch
    @hookimpl
    def loss_weights(self, loss: LossInputs) -> LossWeights | None:
        """Alternate + mute_grpo: token weight 0 on the distillation steps (TRL's loss off), if anything distils."""
        import torch

        from trl_credit import LossWeights

        if not self._distills(loss.step):
            return None
        self._select(loss.batch)
        if not bool((self._weight > 0).any()):
            return None
        self.log_metric(loss.batch, "grpo_muted", 1.0)
        return LossWeights(token=torch.zeros_like(loss.mask))

    @hookimpl
    def loss_terms(self, loss: LossInputs) -> dict[str, torch.Tensor] | None:
        import torch

        cfg = self.config
        if not self._distills(loss.step):
            return None
        self._prepare(loss.batch)  # scored in on_batch_end already, unless the span guess missed this step
        logp = loss.logps
        width = logp.shape[1]
        q = self._teacher.to(logp.device)[loss.rows][:, :width].to(logp)
        s = self._weight.to(logp.device)[loss.rows].to(logp).unsqueeze(1)                  # (B, 1)
        on = (loss.mask > 0) & (s > 0)
        zero = torch.zeros_like(logp)
        sampler = loss.old_logps.to(logp) if loss.old_logps is not None else logp.detach()
        log_r = torch.where(on, q - sampler, zero)                                         # log T/S, sampled token
        if cfg.estimator == "forward":
            w = log_r.clamp(max=math.log(cfg.ratio_clip)).exp().detach()                   # min(r, c)
            per_token = w * torch.where(on, q - logp, zero)
            if cfg.baseline:
                per_token = per_token + (logp - logp.detach())
        else:
            per_token = 0.5 * torch.where(on, logp - q, zero) ** 2
        term = cfg.coef * loss.aggregate(s * per_token)
        if on.any():
            count = on.sum()
            self.log_metric(loss.batch, "mean_log_ratio", (log_r.sum() / count).item())
            if cfg.estimator == "forward":
                clipped = ((log_r > math.log(cfg.ratio_clip)) & on).sum() / count
                self.log_metric(loss.batch, "clipped_fraction", clipped.item())
        return {"opsd": term}
