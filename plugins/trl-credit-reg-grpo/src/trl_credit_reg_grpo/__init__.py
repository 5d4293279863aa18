"""Reg-GRPO (Regressive GRPO, DeepVideo-R1): GRPO's objective as a regression onto the advantage.

Method. "Reg-GRPO reformulates the GRPO objective as a regression task, directly predicting the
advantage in GRPO. This design eliminates the need for safeguards like clipping and min functions"
(DeepVideo-R1 abstract). The policy itself is the predictor: the advantage it implies for a
completion is the (group-normalised) log-ratio of the current to the rollout policy, and the loss is
the squared error between that prediction and GRPO's advantage. On-policy the prediction is 0 and
the gradient pushes each completion's log-probability along its advantage; once the policy has
moved far enough that its log-ratios reproduce the advantages, the gradient vanishes (the regression
is solved), which plays the role of PPO's clipping.

Formula (per micro-batch, as the code runs it; row i, tokens t, m = the loss mask, V = rows with at
least one token, g(i) = the rows of i's group present in this micro-batch and in V)::

    old_t  = loss.old_logps, or logp.detach() when TRL stores none (on-policy)
    r_i    = sum_t m_it (logp_it - old_it) / sum_t m_it        log_ratio = "mean"   (default)
    r_i    = sum_t m_it (logp_it - old_it)                     log_ratio = "sum"
    a_hat_i = (r_i - mean_g(i) r) / (std_g(i) r + eps)         predictor = "normalized" (default; std unbiased)
    a_hat_i = reward_beta * (r_i - mean_g(i) r)                predictor = "centered"
    a_hat_i = reward_beta * r_i                                predictor = "raw"
    A_i    = loss.advantages (masked token mean where they are per token)
    regression = scale * (1 / |V|) sum_{i in V} (a_hat_i - A_i)^2
    kl     = beta * aggregate_loss_type(k3_t * w_t)                only when beta > 0
    k3_t   = exp(ref_t - logp_t) - (ref_t - logp_t) - 1,  w_t = exp(logp_t - old_t) (TRL's
             use_bias_correction_kl, its default; exp of the row-mean log-ratio at sequence level) or 1

``loss_weights`` gives every token weight 0, which removes TRL's clipped surrogate and with it
TRL's KL term and entropy bonus; the ``kl`` term above is TRL's own KL term re-added (same
estimator and bias correction, same ``loss_type`` reduction, the batch's ``beta``, so a
``kl_coefficient`` plugin still works); an entropy bonus is refused in ``check_args``.

Source: [abstract-inferred] the DeepVideo-R1 abstract (papers/000, "Reg-GRPO (Regressive GRPO)");
no official code was found. Established: regression of the GRPO advantage, no clipping, no min.
Chosen (the abstract is silent; the alternatives are options): the predictor is the implicit reward
beta * log(pi_theta / pi_old) of a KL-regularised policy step (pi* = pi_old e^{A/beta} / Z, so
A = beta log(pi*/pi_old) + beta log Z), normalised per group as GRPO normalises rewards, which
cancels both beta and log Z (``normalized``; the unnormalised readings are ``centered`` and ``raw``);
the per-token mean log-ratio (``sum`` offered); the unbiased group std and ``eps = 1e-4`` as TRL's
advantage normalisation; the mean over rows. Groups: TRL shuffles a generation batch and splits it
into micro-batches, so a micro-batch may hold part of a group; the group statistics are taken over
the rows of each group that this micro-batch holds (a row alone in the micro-batch has a_hat = 0
and no gradient under ``normalized`` / ``centered``; ``paired_fraction`` logs how many rows have a
partner). Whole groups per micro-batch: ``steps_per_generation: 1`` on one process.

On-policy point (r = 0; always the case with TRL's defaults): a_hat = 0, the regression equals
mean A^2 and its gradient is, for ``centered``, ``-(2 reward_beta / |V|) sum_i (A_i - mean_g(i) A)
grad r_i``; with whole groups (GRPO advantages sum to 0 per group), ``reward_beta = 0.5``,
``log_ratio = mean`` this is exactly the gradient of TRL's ``loss_type=grpo`` surrogate. For
``normalized`` the same holds with ``reward_beta`` replaced by ``1 / eps``: the group normalisation
is singular at r = 0 (the std of equal log-ratios is 0), so the on-policy gradient is the centred
REINFORCE direction scaled by ``2 / (|V| eps)`` (gradient clipping and Adam absorb the scale).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from trl_credit import ConfigError, LossWeights, Plugin, RunInfo, hookimpl

if TYPE_CHECKING:
    import torch

    from trl_credit import LossInputs

__all__ = ["RegGRPO", "predicted_advantages", "sequence_log_ratio", "trl_kl"]

_TINY_VAR = 1e-20  # floor of the group variance under the square root (its gradient is undefined at 0)


def sequence_log_ratio(logps: torch.Tensor, old_logps: torch.Tensor | None, mask: torch.Tensor,
                       reduce: str = "mean") -> torch.Tensor:
    """``(B,)`` r_i: masked mean (or sum) over tokens of ``logp - old``; ``old = logp.detach()`` when None."""
    import torch

    logp = logps.to(torch.float32)
    old = logp.detach() if old_logps is None else old_logps.to(logp)
    m = mask.to(logp)
    total = ((logp - old) * m).sum(-1)
    return total / m.sum(-1).clamp(min=1.0) if reduce == "mean" else total


def predicted_advantages(r: torch.Tensor, groups: torch.Tensor, valid: torch.Tensor, predictor: str = "normalized",
                         reward_beta: float = 1.0, eps: float = 1e-4) -> torch.Tensor:
    """``(B,)`` a_hat from the ``(B,)`` log-ratios, with statistics over the valid rows of each group present."""
    if predictor == "raw":
        return reward_beta * r
    same = ((groups[:, None] == groups[None, :]) & valid[:, None] & valid[None, :]).to(r)  # (B, B)
    count = same.sum(-1)                                       # valid rows of i's group here, i included
    mean = (same @ r) / count.clamp(min=1.0)
    centred = r - mean
    if predictor == "centered":
        return reward_beta * centred
    var = (same * (r[None, :] - mean[:, None]) ** 2).sum(-1) / (count - 1.0).clamp(min=1.0)
    return centred / (var.clamp(min=_TINY_VAR).sqrt() + eps)


def trl_kl(logps: torch.Tensor, ref_logps: torch.Tensor, old_logps: torch.Tensor | None, mask: torch.Tensor,
           args) -> torch.Tensor:
    """``(B, T)`` TRL 1.16's per-token KL term (k3 to the reference), times the importance ratio when
    ``args.use_bias_correction_kl`` (TRL's default: differentiable, so it changes the gradient even at ratio 1),
    at ``args.importance_sampling_level`` (token: per token; sequence: exp of the row's mean log-ratio)."""
    import torch

    logp = logps.to(torch.float32)
    delta = ref_logps.to(logp) - logp
    kl = torch.exp(delta) - delta - 1.0
    if getattr(args, "use_bias_correction_kl", False):
        log_ratio = logp - (logp.detach() if old_logps is None else old_logps.to(logp))
        if getattr(args, "importance_sampling_level", "token") == "sequence":
            m = mask.to(logp)
            log_ratio = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        kl = kl * torch.exp(log_ratio)
    return kl


class RegGRPO(Plugin):
    """Reg-GRPO: token weights 0 (no clipped surrogate) + scale * mean_i (a_hat_i - A_i)^2, a_hat from log pi/pi_old."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        predictor: Literal["normalized", "centered", "raw"] = Field(
            "normalized",
            description="predicted advantage from the log-ratio r_i: normalized = (r_i - mean_g r) / (std_g r + eps) "
            "as GRPO normalises rewards (beta cancels); centered = reward_beta (r_i - mean_g r); raw = reward_beta r_i",
        )
        log_ratio: Literal["mean", "sum"] = Field(
            "mean", description="r_i = masked mean (mean) or sum (sum) over tokens of log pi_theta - log pi_old",
        )
        reward_beta: float = Field(
            1.0, gt=0.0,
            description="beta of the implicit reward beta * r_i (centered, raw); unused by normalized; 0.5 with "
            "centered and log_ratio mean gives exactly GRPO's on-policy gradient",
        )
        eps: float = Field(
            1e-4, gt=0.0, description="added to the group std of the log-ratios (normalized), as TRL adds 1e-4",
        )
        scale: float = Field(1.0, gt=0.0, description="multiplies the regression loss")

    def check_args(self, run: RunInfo) -> None:
        """The zero token weights also remove TRL's entropy bonus, which this plugin does not re-add: refuse it."""
        args = run.args
        coef, adaptive = getattr(args, "entropy_coef", 0.0) or 0.0, bool(getattr(args, "use_adaptive_entropy", False))
        if float(coef) != 0.0 or adaptive:
            raise ConfigError.for_key(
                "entropy_coef", f"reg_grpo gives every token of TRL's loss weight 0, which also removes TRL's entropy "
                f"bonus (entropy_coef={coef}, use_adaptive_entropy={adaptive}), and it does not re-add one",
                "set `entropy_coef: 0.0` and `use_adaptive_entropy: false`")
        scale_rewards = getattr(args, "scale_rewards", "group")
        if self.config.predictor == "normalized" and scale_rewards not in ("group", True):
            warnings.warn(f"reg_grpo: predictor 'normalized' predicts group-std-normalised advantages but "
                          f"scale_rewards={scale_rewards!r}; consider predictor 'centered'", stacklevel=2)

    @hookimpl
    def loss_weights(self, loss: LossInputs) -> LossWeights:
        import torch

        return LossWeights(token=torch.zeros_like(loss.mask))

    @hookimpl
    def loss_terms(self, loss: LossInputs) -> dict[str, torch.Tensor]:
        import torch

        cfg = self.config
        m = loss.mask.to(torch.float32)
        valid = m.sum(-1) > 0
        r = sequence_log_ratio(loss.logps, loss.old_logps, m, cfg.log_ratio)
        groups = loss.rows.to(r.device) // loss.batch.num_generations
        a_hat = predicted_advantages(r, groups, valid, cfg.predictor, cfg.reward_beta, cfg.eps)
        adv = loss.advantages.to(r)
        target = adv if adv.dim() == 1 else (adv * m).sum(-1) / m.sum(-1).clamp(min=1.0)
        v = valid.to(r)
        n = v.sum().clamp(min=1.0)
        terms = {"regression": cfg.scale * (((a_hat - target) ** 2) * v).sum() / n}
        if loss.beta > 0.0:
            if loss.ref_logps is None:
                raise RuntimeError("reg_grpo: beta > 0 but the micro-batch has no reference log-probs")
            terms["kl"] = loss.beta * loss.aggregate(trl_kl(loss.logps, loss.ref_logps, loss.old_logps, m,
                                                            loss.batch.args))
        same = (groups[:, None] == groups[None, :]) & valid[:, None] & valid[None, :]
        paired = ((same.sum(-1) > 1) & valid).to(r).sum() / n
        stats = torch.stack([paired, (r.detach().abs() * v).sum() / n]).tolist()  # one host sync
        self.log_metric(loss.batch, "paired_fraction", stats[0])
        self.log_metric(loss.batch, "abs_log_ratio", stats[1])
        return terms
