"""SEED: the skill-induced probability shift of the sampled tokens as a dense distillation term beside GRPO.

Paper: "SEED: Self-Evolving On-Policy Distillation for Agentic Reinforcement Learning". Method
(abstract): the policy, acting as an analyzer, turns completed on-policy trajectories into
natural-language hindsight skills (reusable workflows, decisive observations, failure-avoidance
rules); SEED then "re-scores the sampled actions under ordinary and skill-augmented contexts,
converting the skill-induced probability shift into a dense token-level on-policy distillation
signal", optimised jointly with outcome-based RL. GRPO is TRL's loss, untouched; this plugin adds
the distillation term.

**Stand-in for the skills.** The skill *generation* (the policy analysing its finished trajectories,
which needs an extra-generation hook the host does not have) is NOT implemented: the skills are
read from a dataset column (``skill_column``), one per prompt, written beforehand (by a stronger
model, by the policy in an earlier run, or by hand). Only the distillation part is SEED's.

Formula, as the code runs it (``loss_terms``, per micro-batch; completion ``i``, sampled token
``a_it``, loss mask ``m_it``, ``sg`` stop-gradient)::

    ctx_i       = the completion's own prompt;  ctx+skill_i = ctx_i with skill_template(skill_i) added
    q_it        = log pi(a_it | ctx+skill_i)         no-grad, the policy (batch.completion_logps)
    base_it     = log pi(a_it | ctx_i)               base = "current": sg(logp_it), TRL's own pass (default)
                                                     base = "rollout": batch.policy_logps(), generation weights
    delta_it    = q_it - base_it                     the skill-induced shift
    b(delta)    = clamp(delta, -tau, tau)            bound = "clip" (default)
                = tau * tanh(delta / tau)            bound = "tanh"
                = delta                              bound = "none"
    s_i         = [skill_i is non-empty] * kept_i
    term        = -coef * aggregate_{loss_type}(s_i * sg(b(delta_it)) * logp_it)          "distill"

Gradient: ``-coef * aggregate(s_i * b(delta_it) * grad logp_it)``, a per-token policy gradient with
advantage ``b(delta_it)``: tokens the skill makes more likely are pushed up, tokens it makes less
likely are pushed down, each by at most ``tau``. With ``base = "current"``, ``delta = q - sg(logp)``
is minus the student-teacher log-ratio, so the term is on-policy reverse-KL self-distillation
towards the skill-conditioned policy (the gradient ``(log s - log t) grad log s`` of OPD, bounded);
the shift shrinks as the policy absorbs the skill's effect. ``aggregate`` is ``loss.aggregate``,
the run's own ``loss_type`` reduction, so the term is normalised like the GRPO loss.

Source: reconstructed from the abstract (the code URL it names, github.com/jinyangwu/SEED, was
not available here). Established there: re-scoring the *sampled* actions under the ordinary and
the skill-augmented context with the current policy; the probability shift as a dense token-level
signal; joint optimisation with outcome RL. Chosen (options offer alternatives): the shift in
log-probabilities; the policy-gradient form with a clipped shift (``clip``, tau = 1 nat; ``tanh``,
``none``); ``coef = 1``; the ordinary context scored by TRL's own forward pass (``current``, free;
``rollout`` scores it with the generation-time weights, like ``q``); every kept completion with a
skill is distilled (successes and failures alike); the skill is appended to the last user message
as ``skill_template``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from trl_credit import ConfigError, Plugin, RunInfo, hookimpl, with_context

if TYPE_CHECKING:
    import torch

    from trl_credit import LossInputs, RolloutBatch

__all__ = ["SEED", "bounded_shift", "with_context"]


def bounded_shift(delta: torch.Tensor, bound: str, tau: float) -> torch.Tensor:
    """``b(delta)``: ``clamp(delta, -tau, tau)`` (clip), ``tau tanh(delta/tau)`` (tanh) or ``delta`` (none)."""
    import torch

    if bound == "clip":
        return delta.clamp(-tau, tau)
    if bound == "tanh":
        return tau * torch.tanh(delta / tau)
    return delta


class SEED(Plugin):
    """SEED: term = -coef * aggregate(sg(clip(logp(a|ctx+skill) - logp(a|ctx), -tau, tau)) * logp(a|ctx))."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        skill_column: str = Field(
            "skill", description="dataset column with a natural-language skill per prompt (stand-in for SEED's "
            "policy-generated hindsight skills); empty or missing: the row is not distilled",
        )
        skill_template: str = Field(
            "Useful skill from earlier attempts: {skill}",
            description="text added to the prompt for the skill-augmented context; {skill} is the skill column",
        )
        skill_position: Literal["user", "system"] = Field(
            "user",
            description="user: append to the last user message; system: append to (or add) the system message; "
            "plain-string prompts get the skill after them (user) or in front (system)",
        )
        coef: float = Field(1.0, ge=0.0, description="weight of the distillation term added to TRL's GRPO loss")
        bound: Literal["clip", "tanh", "none"] = Field(
            "clip",
            description="how the shift enters as a per-token advantage: clip = clamp(delta, -tau, tau); "
            "tanh = tau*tanh(delta/tau); none = delta",
        )
        tau: float = Field(1.0, gt=0.0, description="bound of the per-token advantage |b(delta)|, in nats")
        base: Literal["current", "rollout"] = Field(
            "current",
            description="ordinary-context log-prob: current = TRL's own forward pass, detached (free; "
            "self-distillation towards the skill-conditioned policy); rollout = batch.policy_logps() with the "
            "generation-time weights, like the skill-context score (one no-grad pass unless TRL kept them)",
        )

        @field_validator("skill_template")
        @classmethod
        def _has_placeholder(cls, value: str) -> str:
            if "{skill}" not in value:
                raise ValueError("must contain the placeholder {skill}")
            return value

    def __init__(self, config: Config | None = None):
        super().__init__(config)
        self._batch: Any = None  # the generation batch the cached values below belong to
        self._prompts: list | None = None
        self._rows: torch.Tensor | None = None  # (N,) s_i
        self._skilled: torch.Tensor | None = None  # (N, T) q: log-probs under the skill-augmented context

    def required_columns(self):
        return [self.config.skill_column]

    def check_args(self, run: RunInfo) -> None:
        """The skill column must be in the dataset (when its columns are known before loading)."""
        column = self.config.skill_column
        if run.columns is not None and column not in run.columns:
            raise ConfigError.for_key(
                "skill_column", f"'{column}' is not a dataset column (columns: {', '.join(run.columns)})",
                "add a column of skills to the dataset (SEED's skill generation is not implemented; the skills "
                "are read from the data) or set `skill_column` to the column that holds them")

    # ------------------------------------------------------------------ per generation batch
    def _prepare(self, batch: RolloutBatch) -> None:
        """Skill-augmented prompts, row weights ``s_i`` and the no-grad scoring passes, once per batch."""
        import torch

        if self._batch is batch:
            return
        cfg = self.config
        skills = [s if isinstance(s, str) else "" for s in batch.column(cfg.skill_column)]
        has = torch.tensor([bool(s.strip()) for s in skills], device=batch.kept.device)
        self._prompts = [with_context(p, cfg.skill_template.replace("{skill}", s), cfg.skill_position)
                         if s.strip() else p for p, s in zip(batch.prompts, skills)]
        self._rows = (has & batch.kept).to(torch.float32)
        self._skilled = batch.completion_logps(self._prompts, model="policy")  # collective: every rank, outside the loss
        if cfg.base == "rollout":
            batch.policy_logps()
        self._batch = batch

    @hookimpl
    def on_batch_end(self, batch: RolloutBatch, advantages: torch.Tensor) -> None:
        self._prepare(batch)
        self.log_metric(batch, "skill_fraction", (self._rows.sum() / batch.kept.sum().clamp(min=1)).item())

    # ------------------------------------------------------------------ per micro-batch
    @hookimpl
    def loss_terms(self, loss: LossInputs) -> dict[str, torch.Tensor]:
        import torch

        cfg = self.config
        self._prepare(loss.batch)
        width = loss.completion_ids.shape[1]
        logp = loss.logps
        skilled = self._skilled.to(logp.device)[loss.rows][:, :width].to(logp)
        if cfg.base == "current":
            base = logp.detach()
        else:
            base = loss.batch.policy_logps()[loss.rows][:, :width].to(logp)
        s = self._rows.to(logp.device)[loss.rows].to(logp).unsqueeze(1)                     # (B, 1)
        on = (loss.mask > 0) & (s > 0)
        delta = torch.where(on, skilled - base, torch.zeros_like(logp))                 # padded scores unused
        advantage = bounded_shift(delta, cfg.bound, cfg.tau).detach()
        term = -cfg.coef * loss.aggregate(s * advantage * logp)
        if on.any():
            count = on.sum()
            self.log_metric(loss.batch, "mean_shift", (delta.sum() / count).item())
            self.log_metric(loss.batch, "clipped_fraction", (((delta.abs() > cfg.tau) & on).sum() / count).item())
        return {"distill": term}
