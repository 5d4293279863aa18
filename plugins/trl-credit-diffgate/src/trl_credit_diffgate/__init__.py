"""DiffGate: GRPO plus bounded teacher guidance on failed trajectories, scaled by group difficulty.

Paper: "DiffGate: Difficulty-Gated Teacher Guidance for On-Policy Distillation". Method (abstract):
on-policy distillation (OPD) gives dense token-level guidance that is weakly aligned with rollout
correctness; GRPO gives outcome-level credit that vanishes on all-failure groups. DiffGate combines
GRPO with teacher supervision that is "applied only to failed trajectories, scaled by group
difficulty, and smoothly bounded to prevent extreme teacher-student discrepancies from dominating
optimization". The verifier decides which trajectories get teacher guidance; the teacher gives the
token-level direction inside them. GRPO itself is TRL's loss, untouched; this plugin adds one term.

Formula, as the code runs it (``loss_terms``, per micro-batch; ``i`` a completion of group ``g`` with
``G`` completions, ``t`` its sampled tokens, ``m_it`` TRL's loss mask, ``sg`` stop-gradient)::

    r_i      = outcome reward (column `outcome_reward`, or TRL's weighted total); NaN: no reward
    fail_i   = r_i < threshold                      (finite rewards only)
    p_g      = #{j in g : r_j >= threshold} / #{j in g : r_j finite}         group pass rate
    w_g      = (1 - p_g) ** difficulty_power                                 group difficulty
    a_i      = fail_i * w_g * [teacher exists for i]                         row gate and weight
    d_it     = logp_it - sg(logp^T_it)       student minus teacher, on the sampled token
    rho(d)   = tau^2 * log cosh(d / tau)          bound = "tanh"  (default)   rho'(d) = tau * tanh(d / tau)
             = huber_tau(d)                       bound = "clip"              rho'(d) = clamp(d, -tau, tau)
             = d^2 / 2                            bound = "none"              rho'(d) = d
    term     = coef * aggregate_{loss_type}(a_i * rho(d_it))                 "distill"

``aggregate`` is ``loss.aggregate``: the run's own ``loss_type`` reduction of TRL's per-token loss
(so under ``dapo`` the term is a sum over gated tokens divided by TRL's token normaliser).

Why this objective (derived, checked by the tests against autograd). Its gradient is
``coef * aggregate(a_i * rho'(d_it) * grad logp_it)``: a per-token policy gradient with advantage
``-rho'(d_it)``. With ``bound="none"`` that is ``(log s - log t) grad log s`` on sampled tokens, the
on-policy reverse-KL distillation gradient (``E_s[(log s - log t) grad log s]`` = ``grad KL(s||t)``;
``rho = d^2/2`` is the k2 estimator, whose on-policy gradient is the reverse-KL gradient, per token
with no reward-to-go, as OPD implementations use it). The bounded forms keep that direction and
sign but cap each token's weight at ``tau``: a token the teacher finds 10 nats less likely than the
student pulls no harder than one that is ``tau`` nats off ("smoothly bounded"). Written as an
objective of ``logp`` (not as ``sg(rho'(d)) * logp``), its value is a meaningful, non-negative
discrepancy (0 when student and teacher agree) and the gradient is the same at every point,
including the later, off-policy updates of ``num_iterations > 1``.

Teacher. ``teacher: reference``: the frozen reference model (``batch.ref_logps()``; TRL's when
``beta > 0``, with PEFT the base model with adapters disabled). ``teacher: hint``: the policy itself
under a privileged prompt, ``hint_template`` with the dataset column ``hint_column`` added to the
prompt (``batch.completion_logps``: the sampled tokens re-scored, no-grad, no re-tokenisation).
A hint that contains the row's answer (column ``answer_column``, matched as a whole word, case
insensitive) is refused with an error unless ``allow_answer_in_hint: true``: a teacher that reads
the answer is not guidance but a leak. Rows without a hint (None or empty) get no guidance.
Teacher scores are computed once per generation batch, in ``on_batch_end`` (a collective call on
every rank), and read from the batch's cache in every micro-batch.

Source: reconstructed from the abstract only (no paper body, no official code found). Established
there: GRPO + an added teacher term; only failed trajectories; scaled by group difficulty; smoothly
bounded. Chosen here (options offer the alternatives): ``fail`` = reward below ``threshold`` (0.5,
the host's ``PromptStats.pass_threshold``, so 0/1 rewards split at 0.5); difficulty ``w_g = (1 -
p_g)^difficulty_power`` (power 1; 0 = gate only); the bound ``tau * tanh(d/tau)`` (``clip``: Huber,
``none``: plain OPD), ``tau = 1`` nat; ``coef = 1`` (per-token weight up to 1, like a normalised GRPO
advantage); the k2-style objective above rather than the ``sg`` policy-gradient surrogate (same
gradient); the teacher choices available through the host (the paper distils from a separate,
larger teacher model, which the host cannot load: the frozen reference or a privileged context of
the policy stand in).
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from trl_credit import ConfigError, Plugin, RunInfo, hookimpl, with_context

if TYPE_CHECKING:
    import torch

    from trl_credit import LossInputs, RolloutBatch

__all__ = ["DiffGate", "bounded_discrepancy", "difficulty_gate", "with_context"]


def bounded_discrepancy(d: torch.Tensor, bound: str, tau: float) -> torch.Tensor:
    """``rho(d)``: ``tau^2 log cosh(d/tau)`` (tanh), Huber at ``tau`` (clip) or ``d^2/2`` (none); elementwise.

    ``rho'(d)`` is ``tau tanh(d/tau)``, ``clamp(d, -tau, tau)`` and ``d`` respectively.
    """
    import torch

    if bound == "tanh":
        x = (d / tau).abs()
        return tau**2 * (x + torch.nn.functional.softplus(-2.0 * x) - math.log(2.0))  # log cosh, overflow-free
    if bound == "clip":
        return torch.nn.functional.huber_loss(d, torch.zeros_like(d), reduction="none", delta=tau)
    return 0.5 * d**2


def difficulty_gate(reward: torch.Tensor, num_generations: int, threshold: float, power: float) -> torch.Tensor:
    """``(N,)`` ``a_i = [r_i < threshold] * (1 - p_g)^power``; 0 for passed rows and NaN rewards."""
    import torch

    finite = ~torch.isnan(reward)
    passed = finite & (reward >= threshold)
    failed = finite & (reward < threshold)
    g = num_generations
    pass_rate = passed.reshape(-1, g).sum(1) / finite.reshape(-1, g).sum(1).clamp(min=1)   # (Q,)
    weight = (1.0 - pass_rate.to(torch.float32)) ** power                                # 0**0 = 1
    return failed.to(torch.float32) * weight.repeat_interleave(g)


def _contains_answer(hint: str, answer: str) -> bool:
    """The answer occurs in the hint as a whole word (not inside a longer number or word), any case."""
    pattern = rf"(?<![0-9A-Za-z_]){re.escape(answer)}(?![0-9A-Za-z_])"
    return re.search(pattern, hint, re.IGNORECASE) is not None


class DiffGate(Plugin):
    """DiffGate: term = coef * aggregate([r_i < thr] (1 - p_g)^k * rho(logp - sg(logp_teacher))), rho bounded."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        teacher: Literal["reference", "hint"] = Field(
            "reference",
            description="reference: the frozen reference model (beta > 0, or the PEFT base with adapters off); "
            "hint: the policy itself re-scoring its sampled tokens under the prompt plus the hint column",
        )
        coef: float = Field(1.0, ge=0.0, description="weight of the distillation term added to TRL's GRPO loss")
        bound: Literal["tanh", "clip", "none"] = Field(
            "tanh",
            description="per-token pull rho'(d): tanh = tau*tanh(d/tau) (objective tau^2 log cosh(d/tau)); "
            "clip = clamp(d, -tau, tau) (Huber objective); none = d (plain reverse-KL OPD, d^2/2)",
        )
        tau: float = Field(1.0, gt=0.0, description="bound of the per-token pull |rho'(d)|, in nats")
        outcome_reward: str | None = Field(
            None, description="reward column that decides failure; null = TRL's weighted total reward",
        )
        threshold: float = Field(
            0.5, description="a trajectory failed iff its outcome reward < threshold (and passed iff >= threshold)",
        )
        difficulty_power: float = Field(
            1.0, ge=0.0,
            description="group weight (1 - pass rate)^difficulty_power; 0 = no difficulty scaling (gate only)",
        )
        hint_column: str = Field("hint", description="dataset column with the privileged hint (teacher: hint)")
        hint_template: str = Field(
            "Hint: {hint}", description="text added to the prompt for the teacher; {hint} is the hint column",
        )
        hint_position: Literal["user", "system"] = Field(
            "user",
            description="user: append to the last user message; system: append to (or add) the system message; "
            "plain-string prompts get the hint after them (user) or in front (system)",
        )
        answer_column: str = Field(
            "answer", description="dataset column with the answer; a hint containing it is refused (teacher: hint)",
        )
        allow_answer_in_hint: bool = Field(
            False, description="allow hints that contain the answer (otherwise a run-time error names the row)",
        )

        @field_validator("hint_template")
        @classmethod
        def _has_placeholder(cls, value: str) -> str:
            if "{hint}" not in value:
                raise ValueError("must contain the placeholder {hint}")
            return value

    def __init__(self, config: Config | None = None):
        super().__init__(config)
        self._batch: Any = None  # the generation batch the cached values below belong to
        self._gate: torch.Tensor | None = None
        self._teacher: torch.Tensor | None = None  # (N, T) no-grad teacher log-probs of that batch

    def required_rewards(self) -> list[str]:
        """The outcome reward column, when one is named."""
        return [self.config.outcome_reward] if self.config.outcome_reward is not None else []

    def check_args(self, run: RunInfo) -> None:
        """A reference teacher needs a reference model; a hint teacher needs its columns."""
        cfg = self.config
        if cfg.teacher == "reference":
            beta = float(getattr(run.args, "beta", 0.0) or 0.0)
            if beta <= 0.0 and not run.peft:
                raise ConfigError.for_key(
                    "teacher", f"'reference' needs a reference model, but beta is {beta} and no PEFT adapter is "
                    "trained", "set `beta` > 0 (TRL keeps a frozen copy of the model), train a PEFT adapter "
                    "(`use_peft: true`; the base model is the teacher), or use `teacher: hint`")
            return
        if run.columns is None:
            return
        if cfg.hint_column not in run.columns:
            raise ConfigError.for_key(
                "hint_column", f"'{cfg.hint_column}' is not a dataset column (columns: {', '.join(run.columns)})",
                "add the hint column to the dataset or set `hint_column` to the column that holds the hints")
        if not cfg.allow_answer_in_hint and cfg.answer_column not in run.columns:
            raise ConfigError.for_key(
                "answer_column", f"'{cfg.answer_column}' is not a dataset column, so hints cannot be checked for "
                f"the answer (columns: {', '.join(run.columns)})",
                "set `answer_column` to the column with the answers, or `allow_answer_in_hint: true`")

    # ------------------------------------------------------------------ per generation batch
    def _prepare(self, batch: RolloutBatch) -> None:
        """Row gates ``a_i`` and (through the batch's scorer cache) the teacher log-probs, once per batch."""
        import torch

        if self._batch is batch:
            return
        cfg = self.config
        reward = batch.reward(cfg.outcome_reward) if cfg.outcome_reward is not None else batch.total_reward()
        gate = difficulty_gate(reward.to(torch.float32), batch.num_generations, cfg.threshold, cfg.difficulty_power)
        gate = gate * batch.kept.to(gate)
        if cfg.teacher == "hint":
            hints = [h if isinstance(h, str) else "" for h in batch.column(cfg.hint_column)]
            if not cfg.allow_answer_in_hint:
                self._refuse_answers(batch, hints)
            has_hint = torch.tensor([bool(h.strip()) for h in hints], device=gate.device)
            gate = gate * has_hint.to(gate)
            prompts = [with_context(p, cfg.hint_template.replace("{hint}", h), cfg.hint_position) if h.strip() else p
                       for p, h in zip(batch.prompts, hints)]
            teacher = batch.completion_logps(prompts, model="policy")
        else:
            teacher = batch.ref_logps()
        # the scorer pass runs here, in on_batch_end: a collective call on every rank, outside TRL's loss
        self._batch, self._gate, self._teacher = batch, gate, teacher

    def _refuse_answers(self, batch: RolloutBatch, hints: list[str]) -> None:
        answers = batch.column(self.config.answer_column)
        for row, (hint, answer) in enumerate(zip(hints, answers)):
            text = "" if answer is None else str(answer).strip()
            if text and hint and _contains_answer(hint, text):
                raise ValueError(
                    f"the hint of completion {row} (dataset row {int(batch.prompt_index[row])}) contains its answer "
                    f"{text!r} (column '{self.config.answer_column}'): {hint!r}; a teacher that reads the answer "
                    "leaks it. Remove the answer from the hints, or set `allow_answer_in_hint: true`")

    @hookimpl
    def on_batch_end(self, batch: RolloutBatch, advantages: torch.Tensor) -> None:
        self._prepare(batch)
        kept = batch.kept.sum().clamp(min=1)
        gated = self._gate > 0
        self.log_metric(batch, "gated_fraction", (gated.sum() / kept).item())
        if gated.any():
            self.log_metric(batch, "mean_weight", self._gate[gated].mean().item())

    # ------------------------------------------------------------------ per micro-batch
    @hookimpl
    def loss_terms(self, loss: LossInputs) -> dict[str, torch.Tensor]:
        import torch

        cfg = self.config
        self._prepare(loss.batch)
        width = loss.completion_ids.shape[1]
        logp = loss.logps
        teacher = self._teacher.to(logp.device)[loss.rows][:, :width].to(logp)
        a = self._gate.to(logp.device)[loss.rows].to(logp).unsqueeze(1)                 # (B, 1)
        on = (loss.mask > 0) & (a > 0)
        d = torch.where(on, logp - teacher.detach(), torch.zeros_like(logp))         # padded teacher values unused
        term = cfg.coef * loss.aggregate(a * bounded_discrepancy(d, cfg.bound, cfg.tau))
        if on.any():
            self.log_metric(loss.batch, "mean_abs_d", (d.detach().abs().sum() / on.sum()).item())
        return {"distill": term}
