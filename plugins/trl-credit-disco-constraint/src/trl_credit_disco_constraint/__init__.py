"""DisCO / DRPO KL constraint: a squared-hinge trust region on the KL to the rollout policy, as a loss term.

Method. DisCO ("DisCO: Reinforcing Large Reasoning Models with Discriminative Constrained
Optimization") drops PPO clipping and enforces a KL trust region with "a simple yet effective
constrained optimization approach" (abstract): a penalty that is zero while the KL between the
rollout policy pi_old and the current policy stays below delta and grows with the excess above it.
DRPO uses the same term. This plugin adds it to whatever loss the run has; paired with the ``drpo``
estimator it completes DRPO/DisCO (the ``drpo`` README lists this term as the missing piece).

Formula (per micro-batch, as the code runs it; ``m`` = the loss mask, tokens t of every row)::

    d_t  = logp_t - old_t                                  (old = loss.old_logps, or logp.detach())
    KL   = sum_t m_t * k(d_t) / sum_t m_t                  token mean over the whole micro-batch
    k(d) = -d                       kl_type = "kl"         (official scripts: ppo_kl_type=kl)
    k(d) = exp(d) - 1 - d           kl_type = "low_var_kl" (verl's k3, >= 0)
    term = sg(max(beta_c * (KL - delta), 0)) * KL          form = "sg"   (official code; default)
    term = beta_c * max(KL - delta, 0)^2                   form = "squared_hinge"

Gradients: ``sg`` gives ``beta_c * max(KL - delta, 0) * grad KL`` (the gradient of the squared
hinge ``(beta_c / 2) * max(KL - delta, 0)^2``; its value is ``beta_c * max(KL - delta, 0) * KL``);
``squared_hinge`` gives twice that, ``2 * beta_c * max(KL - delta, 0) * grad KL``.

Source: [code] methods.md section 2.4; ``Optimization-AI/DisCO@bd2b0781``
``verl/verl/trainer/ppo/core_algos.py::compute_policy_loss_disco_logL`` / ``_Lratio`` / ``discob_*`` and
``Optimization-AI/DRPO@405f7026`` same file ``compute_policy_loss_drpo`` (re-read here):
``constraint = torch.maximum(beta*(ppo_kl-delta), zeros).detach() * ppo_kl``, ``ppo_kl =
masked_mean(-(log_prob - old_log_prob), eos_mask)`` for ``kl_type='kl'`` and ``masked_mean(-neg_kl +
ratio - 1)`` for ``'low_var_kl'``, the mean over every token of the micro-batch (gathered over ranks).
Defaults from ``scripts/train/run_disco_*_8k.sh`` and ``run_drpo_1.5b_8k.sh``: ``delta=1e-4``,
``beta=1e3`` (here ``beta_c``, not GRPO's reference-KL ``beta``), ``ppo_kl_type=kl``.

Established: the ``sg`` form, the token-mean KL over the micro-batch, the two estimators, the
defaults. Chosen: the ``squared_hinge`` form is offered for the paper-style reading of the penalty
(the paper body was not read; only the abstract and the code); KL is the mean over this process's
rows of the micro-batch (verl all-gathers the micro-batch over ranks first: identical on one
process). On-policy (TRL stores no old log-probs, ``loss.old_logps is None``) ``old = logp.detach()``,
so KL = 0 exactly and the term is 0 with zero gradient: the constraint acts only on updates that
reuse a rollout after an optimiser step (``num_iterations > 1``, or ``steps_per_generation >
gradient_accumulation_steps``).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from trl_credit import Plugin, RunInfo, hookimpl

if TYPE_CHECKING:
    import torch

    from trl_credit import LossInputs

__all__ = ["DiscoConstraint", "disco_constraint", "stores_old_logps"]


def stores_old_logps(args) -> bool:
    """Whether TRL 1.16 keeps ``old_per_token_logps`` for this run (``_generate_and_score_completions``):
    when an optimiser step can fall between a rollout and its use, or vLLM importance sampling is on."""
    accumulation = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
    per_generation = int(getattr(args, "steps_per_generation", None) or accumulation)
    every = per_generation * int(getattr(args, "num_iterations", 1) or 1)
    vllm_is = bool(getattr(args, "use_vllm", False)) and bool(getattr(args, "vllm_importance_sampling_correction",
                                                                         False))
    return accumulation % every != 0 or vllm_is


def disco_constraint(logps: torch.Tensor, old_logps: torch.Tensor | None, mask: torch.Tensor, *, delta: float,
                     beta_c: float, kl_type: str = "kl", form: str = "sg") -> tuple[torch.Tensor, torch.Tensor]:
    """``(term, KL)`` for one micro-batch (see the module docstring); ``KL`` carries the gradient of ``logps``."""
    import torch

    logp = logps.to(torch.float32)
    old = logp.detach() if old_logps is None else old_logps.to(logp)
    m = mask.to(logp)
    d = logp - old
    per_token = -d if kl_type == "kl" else torch.exp(d) - 1.0 - d
    kl = (per_token * m).sum() / m.sum().clamp(min=1.0)
    excess = (kl - delta).clamp(min=0.0)
    term = (beta_c * excess).detach() * kl if form == "sg" else beta_c * excess**2
    return term, kl


class DiscoConstraint(Plugin):
    """DisCO/DRPO KL constraint: + sg(max(beta_c (KL - delta), 0)) * KL, KL = token mean of (old_logp - logp)."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        delta: float = Field(
            1e-4, ge=0.0,
            description="KL budget delta: the penalty is zero while KL <= delta (official scripts: 1e-4)",
        )
        beta_c: float = Field(
            1e3, gt=0.0,
            description="penalty coefficient beta_c (official `beta=1e3`; not GRPO's reference-KL beta)",
        )
        kl_type: Literal["kl", "low_var_kl"] = Field(
            "kl",
            description="KL estimator per token, d = logp - old_logp: kl = -d (official scripts, ppo_kl_type=kl, "
            "can be negative); low_var_kl = exp(d) - 1 - d (verl's k3, never negative)",
        )
        form: Literal["sg", "squared_hinge"] = Field(
            "sg",
            description="sg: sg(max(beta_c (KL - delta), 0)) * KL (official code; gradient beta_c [KL-delta]_+ "
            "grad KL); squared_hinge: beta_c max(KL - delta, 0)^2 (gradient twice that)",
        )

    def check_args(self, run: RunInfo) -> None:
        """Refuses nothing; warns when TRL keeps no old log-probs (then the term is always 0)."""
        if not stores_old_logps(run.args):
            warnings.warn(
                "disco_constraint: this run trains on-policy (num_iterations=1 and gradient_accumulation_steps a "
                "multiple of steps_per_generation), so TRL keeps no old log-probs: KL = 0 and the constraint term is "
                "always 0; it acts with num_iterations > 1 or steps_per_generation > gradient_accumulation_steps",
                stacklevel=2)

    @hookimpl
    def loss_terms(self, loss: LossInputs) -> dict[str, torch.Tensor]:
        cfg = self.config
        term, kl = disco_constraint(loss.logps, loss.old_logps, loss.mask, delta=cfg.delta, beta_c=cfg.beta_c,
                                    kl_type=cfg.kl_type, form=cfg.form)
        value = kl.item()  # the one host sync of this hook
        self.log_metric(loss.batch, "kl", value)
        self.log_metric(loss.batch, "active", float(value > cfg.delta))
        return {"constraint": term}
