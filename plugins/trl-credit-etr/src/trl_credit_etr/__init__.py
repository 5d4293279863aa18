"""ETR: outcome-guided elastic trust regions, as per-sample clip bounds of TRL's loss.

Method. GRPO clips every sample's probability ratio to the same static range ``[1 - eps_low,
1 + eps_high]``. ETR makes the range elastic, per sample, at two levels: the *micro* level widens
the clip boundary of samples with a large advantage magnitude (high-confidence paths learn faster),
the *macro* level gives groups with a high reward variance (tasks in the "optimal learning zone",
``p(1 - p)`` large for binary rewards) a larger update budget and groups with a low variance a
smaller one.

Formula, exactly as the code runs it (row ``i`` of group ``g``, ``eps_low`` / ``eps_high`` the
config's ``epsilon`` / ``epsilon_high``)::

    a_i   = A_i                    (sequence advantages; per-token ones: masked token mean of A_it)
    m_i   = tanh(|a_i| / adv_scale)                     micro: tanh   (default)
          = |a_i| / max_j |a_j|   (j over the whole generation batch)   micro: max
          = 0                                           micro: none
    v_g   = (1/n_g) sum_{k in g} (r_k - mean_g r)^2     population variance, NaN rewards left out
                                                        (binary rewards: v_g = p_g (1 - p_g))
    u_g   = clamp(v_g / variance_ref, 0, 1)             variance_ref null: max_g v_g of the batch
    f_i   = (1 + alpha * m_i) * (1 + gamma * (u_g - center))           (macro: none -> 1 + alpha * m_i)
    side "gradient" (default):  eps_high_i = eps_high * f_i  if a_i > 0  else eps_high
                                eps_low_i  = eps_low  * f_i  if a_i < 0  else eps_low
    side "both":                eps_high_i = eps_high * f_i,  eps_low_i = eps_low * f_i
    eps_*_i <- clamp(eps_*_i, eps_min, eps_max)                        (each bound when given)

TRL then clips ``1 - eps_low_i <= ratio <= 1 + eps_high_i`` for row ``i`` (``cispo``: its IS-weight
cap ``ratio <= eps_high_i``).

Source: "ETR: Outcome-Guided Elastic Trust Regions for Policy Optimization", abstract only
(``papers/000``); methods.md lists it in the loss-hook family without a formula. No code found.

Established by the abstract: per-sample clip boundaries; scaled by the advantage magnitude (micro);
group variance allocates larger budgets to the optimal learning zone (macro); the aim is to exploit
high-quality signals and suppress noise. CHOSEN here (the abstract gives no formula or constants):
the multiplicative form above, its constants (``alpha = gamma = 0.5``, ``center = 0.5``,
``variance_ref = 0.25`` = the maximum of ``p(1 - p)``, so at ``epsilon = 0.2`` every bound lies in
``[0.15, 0.375)``), the bounded ``tanh`` normalisation of ``|A|`` (alternative: ``micro: max``), the
population variance of the total reward (alternative: ``reward:`` one column), and widening only the
bound that can bind for the sample's sign (``side: gradient``: in TRL's ``min(r A, clip(r) A)`` only
the upper bound acts when ``A > 0`` and only the lower when ``A < 0``; ``side: both`` scales both,
which differs only under ``cispo``, whose cap acts on both signs). ``center`` makes the macro level
tighten low-variance groups (the "suppress noise" half of the abstract); ``center: 0`` only widens.

On-policy (``num_iterations = 1`` and ``steps_per_generation <= gradient_accumulation_steps``)
every ratio is exactly 1 and no clip bound ever acts: ETR then changes nothing (warned by
``check_args``).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trl_credit import CLIPPED_LOSSES, ConfigError, LossWeights, Plugin, RunInfo, hookimpl

if TYPE_CHECKING:
    import torch

    from trl_credit import LossInputs, RolloutBatch

__all__ = ["ETR", "etr_bounds", "group_variance", "row_advantages"]


def row_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(B,)`` a_i: the sequence advantages, or the masked token mean of ``(B, T)`` advantages (0 without tokens)."""
    if advantages.dim() == 1:
        return advantages
    m = mask.to(advantages.dtype)
    return (advantages * m).sum(-1) / m.sum(-1).clamp(min=1.0)


def group_variance(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """``(N // G,)`` population variance of each group's rewards, NaN rewards left out (0 when none is finite)."""
    import torch

    r = rewards.reshape(-1, num_generations).to(torch.float32)
    valid = ~torch.isnan(r)
    n = valid.sum(1).clamp(min=1)
    mean = torch.where(valid, r, 0.0).sum(1) / n
    return torch.where(valid, (r - mean.unsqueeze(1)) ** 2, 0.0).sum(1) / n


def etr_bounds(a: torch.Tensor, m: torch.Tensor, u: torch.Tensor | None, eps_low: float, eps_high: float, *,
               alpha: float, gamma: float, center: float, side: str, eps_min: float | None = None,
               eps_max: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row ``(eps_low_i, eps_high_i)`` from the row advantages ``a``, micro terms ``m`` in [0, 1] and
    macro terms ``u`` in [0, 1] (None: no macro level); see the module docstring."""
    import torch

    f = 1.0 + alpha * m
    if u is not None:
        f = f * (1.0 + gamma * (u - center))
    low_scaled, high_scaled = eps_low * f, eps_high * f
    if side == "gradient":
        high = torch.where(a > 0, high_scaled, torch.full_like(f, eps_high))
        low = torch.where(a < 0, low_scaled, torch.full_like(f, eps_low))
    else:
        low, high = low_scaled, high_scaled
    if eps_min is not None or eps_max is not None:
        low, high = low.clamp(min=eps_min, max=eps_max), high.clamp(min=eps_min, max=eps_max)
    return low, high


class ETR(Plugin):
    """ETR: eps_i = eps * (1 + alpha m_i) * (1 + gamma (u_g - center)), m_i = tanh(|A_i|), u_g = var_g / 0.25."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        side: Literal["gradient", "both"] = Field(
            "gradient",
            description="gradient: scale epsilon_high of rows with A > 0 and epsilon_low of rows with A < 0 (the "
            "bound that can bind for that sign); both: scale both bounds of every row (differs only under cispo)",
        )
        micro: Literal["tanh", "max", "none"] = Field(
            "tanh",
            description="micro level m_i: tanh = tanh(|A_i| / adv_scale); max = |A_i| / max |A| over the "
            "generation batch; none = no micro level",
        )
        alpha: float = Field(0.5, ge=0.0, description="micro strength: the factor is 1 + alpha * m_i, m_i in [0, 1]")
        adv_scale: float = Field(
            1.0, gt=0.0, description="|A| at which tanh reaches 0.76 (micro: tanh); unused otherwise")
        macro: Literal["variance", "none"] = Field(
            "variance",
            description="macro level: variance = scale by the group's reward variance u_g; none = no macro level",
        )
        gamma: float = Field(0.5, ge=0.0, description="macro strength: the factor is 1 + gamma * (u_g - center)")
        center: float = Field(
            0.5, ge=0.0, le=1.0,
            description="u_g at which the macro factor is 1: groups below it get tighter bounds, above it wider; "
            "0 = the macro level only widens",
        )
        variance_ref: float | None = Field(
            0.25, gt=0.0,
            description="reward variance that counts as the full budget, u_g = clamp(var_g / variance_ref, 0, 1); "
            "0.25 = max p(1 - p) of binary rewards; null = the largest group variance in the generation batch",
        )
        reward: str | None = Field(
            None, description="reward column whose group variance is used; null = the weighted total reward (TRL's)")
        eps_min: float | None = Field(None, ge=0.0, description="lower limit of every per-sample bound; null: none")
        eps_max: float | None = Field(None, gt=0.0, description="upper limit of every per-sample bound; null: none")

        @model_validator(mode="after")
        def _consistent(self):
            if self.eps_min is not None and self.eps_max is not None and self.eps_min > self.eps_max:
                raise ValueError(f"eps_min ({self.eps_min}) must be <= eps_max ({self.eps_max})")
            if self.gamma * self.center > 1.0:
                raise ValueError(f"gamma * center = {self.gamma * self.center} > 1 would make the macro factor "
                                 "1 + gamma * (u - center) negative for low-variance groups; lower gamma or center")
            return self

    def __init__(self, config: Config | None = None):
        super().__init__(config)
        self._seen: tuple[Any, torch.Tensor] | None = None  # (generation batch, max |a| over it), micro: max

    def required_rewards(self) -> list[str]:
        return [self.config.reward] if self.config.reward is not None and self.config.macro != "none" else []

    def disabled_hooks(self) -> list[str]:
        return [] if self.config.micro == "max" else ["on_batch_end"]

    def check_args(self, run: RunInfo) -> None:
        """Refuse loss types without clip bounds; warn when every ratio is 1 (no bound ever acts)."""
        loss_type = getattr(run.args, "loss_type", None)
        if loss_type not in CLIPPED_LOSSES:
            raise ConfigError.for_key(
                "loss_type", f"ETR sets per-sample clip bounds, but loss_type {loss_type!r} has none (only "
                f"{', '.join(CLIPPED_LOSSES)} clip the ratio)", "set `loss_type: dapo` (or grpo, bnpo, dr_grpo, "
                "luspo, cispo)")
        iterations = getattr(run.args, "num_iterations", 1) or 1
        per_generation = getattr(run.args, "steps_per_generation", None)
        accumulation = getattr(run.args, "gradient_accumulation_steps", 1) or 1
        if iterations == 1 and (per_generation is None or per_generation <= accumulation):
            warnings.warn("etr: num_iterations=1 and steps_per_generation <= gradient_accumulation_steps: every "
                          "update is on-policy (ratio = 1), so no clip bound ever acts and ETR changes nothing; "
                          "set num_iterations > 1 or steps_per_generation > gradient_accumulation_steps",
                          UserWarning, stacklevel=2)

    @hookimpl
    def on_batch_end(self, batch: RolloutBatch, advantages: torch.Tensor) -> None:
        """micro: max needs max_j |a_j| over the whole generation batch, not over one micro-batch."""
        a = row_advantages(advantages, batch.completion_mask)
        self._seen = (batch, a.abs().max() if a.numel() else a.new_zeros(()))

    @hookimpl
    def loss_weights(self, loss: LossInputs) -> LossWeights:
        import torch

        cfg = self.config
        a = row_advantages(loss.advantages, loss.mask).to(torch.float32)      # (B,)
        mag = a.abs()
        if cfg.micro == "tanh":
            m = torch.tanh(mag / cfg.adv_scale)
        elif cfg.micro == "max":
            # the generation batch's max (on_batch_end); a hand-built LossInputs whose batch was never
            # seen falls back to the micro-batch's own max
            amax = self._seen[1].to(mag) if self._seen is not None and self._seen[0] is loss.batch else mag.max()
            m = torch.where(amax > 0, mag / amax.clamp(min=1e-12), 0.0).clamp(max=1.0)
        else:
            m = torch.zeros_like(mag)
        u = None
        if cfg.macro == "variance":
            batch = loss.batch
            r = batch.reward(cfg.reward) if cfg.reward is not None else batch.total_reward()
            var = group_variance(r, batch.num_generations)                     # (N // G,)
            ref = torch.as_tensor(cfg.variance_ref if cfg.variance_ref is not None else var.max(), dtype=var.dtype,
                                  device=var.device)
            u_group = torch.where(ref > 0, var / ref.clamp(min=1e-12), 0.0).clamp(0.0, 1.0)
            u = u_group[loss.rows.to(var.device) // batch.num_generations].to(a.device)
        low, high = etr_bounds(a, m, u, loss.epsilon_low, loss.epsilon_high, alpha=cfg.alpha, gamma=cfg.gamma,
                               center=cfg.center, side=cfg.side, eps_min=cfg.eps_min, eps_max=cfg.eps_max)
        trained = (loss.mask.sum(-1) > 0).to(torch.float32)                    # rows with tokens in the loss
        n = trained.sum().clamp(min=1.0)
        stats = torch.stack([(low * trained).sum() / n, (high * trained).sum() / n]).tolist()  # one host sync
        self.log_metric(loss.batch, "epsilon_low", stats[0])
        self.log_metric(loss.batch, "epsilon_high", stats[1])
        return LossWeights(epsilon_low=low, epsilon_high=high)
