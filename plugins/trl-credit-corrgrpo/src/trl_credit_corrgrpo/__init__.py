"""CorrGRPO: correlation-normalised GRPO advantages over several reward components.

Method. With K reward components GRPO sums them and divides the centred total by its group std;
that variance is the sum of all pairwise covariances, so a component with a large scale dominates
the divisor and shrinks the signal of the small ones. CorrGRPO keeps GRPO's numerator (the centred
weighted total) and replaces the covariances in the divisor by Pearson correlations, so the divisor
reflects how the components move together, not how large they are.

Formula, per group of n = G completions, ``R`` the (n x K) weighted components ``w_k r_ik``::

    C        = R - mean_g(R)                                   (centre each component)
    Sigma    = C^T C / (n - 1)
    rho_kl   = Sigma_kl / sqrt(Sigma_kk Sigma_ll)               (row/column := 0 if Sigma_kk = 0)
    A_i      = sum_k C_ik / sqrt(max(sum_kl rho_kl, 0) + eps)   (norm_by_correlation)
    A_i      = sum_k C_ik                                       (not norm_by_correlation: Dr.GRPO)

``(n - 1)`` cancels in ``rho``, so the code uses ``C^T C`` directly. ``sum_kl rho_kl = ||sum_k
C_k / ||C_k|| ||^2 >= 0``; it is 0 when the non-constant components cancel exactly (perfectly
anti-correlated), and then the divisor is ``sqrt(eps)``: such groups are counted in the metric
``clamped_fraction`` (and warned about once). The advantage is not scale-free: with one component
``rho = [[1]]`` and ``A = r - mean`` as in Dr.GRPO.

Source: Hu et al., "CorrGRPO: Correlation-Normalized GRPO for Multi-Reward Learning".
[code] HKUST-KnowComp/CorrGRPO@3586915ec333 ``verl/trainer/ppo/core_algos.py``
``compute_grpo_covariance_coefficient_outcome_advantage`` (estimator ``grpo_covariance_coefficient``,
also shown in its README); facts read there, code written anew and vectorised over groups.

Defaults: ``epsilon = 1e-6`` and ``norm_by_correlation = True`` (verl's ``epsilon`` and
``norm_adv_by_std_in_grpo`` defaults); all reward columns with TRL's ``reward_weights`` (verl:
``algorithm.gdpo_reward_keys`` / ``gdpo_reward_weights``). Not in the official code, our choices:
``nan_policy = "zero"`` (verl never sees NaN; TRL's ``nansum`` also counts a missing component as 0),
rows whose every component is NaN get advantage 0 and leave the group statistics (as in TRL),
a component counts as constant when its values in the group are exactly equal (verl tests
``variance > 0``, which rounding can fool), arithmetic in float64, and
``near_zero_corr_sum = 1e-3`` for the warning metric.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from trl_credit import Plugin, hookimpl

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch

__all__ = ["CorrGRPO", "corrgrpo_advantages"]


def corrgrpo_advantages(
    rewards: torch.Tensor,
    weights: torch.Tensor,
    num_generations: int,
    *,
    epsilon: float = 1e-6,
    norm_by_correlation: bool = True,
    nan_policy: str = "zero",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CorrGRPO on an ``(N, K)`` reward matrix (NaN = missing), groups of ``num_generations`` rows.

    :return: ``A`` float32 ``(N,)``; ``corr_sum`` float64 ``(N // G,)`` = ``sum_kl rho_kl`` before the
        clamp; ``active`` bool ``(N // G,)``: the group has at least one non-constant component.
    """
    import torch

    n, k = rewards.shape
    R = (rewards.to(torch.float64) * weights.to(rewards.device, torch.float64)).reshape(-1, num_generations, k)
    missing = torch.isnan(R)                                         # (M, G, K)
    scorable = ~missing.all(dim=-1, keepdim=True)                    # (M, G, 1): some component present
    if nan_policy == "zero":
        X = R.nan_to_num(0.0)
    elif nan_policy == "group_mean":                                 # impute the component's group mean
        seen = (~missing).to(R.dtype)
        mu = (R.nan_to_num(0.0) * seen).sum(1, keepdim=True) / seen.sum(1, keepdim=True).clamp_min(1.0)
        X = torch.where(missing, mu, R)
    else:
        raise ValueError(f"unknown nan_policy {nan_policy!r}")
    rows = scorable.to(R.dtype)
    mean = (X * rows).sum(1, keepdim=True) / rows.sum(1, keepdim=True).clamp_min(1.0)
    hi = X.masked_fill(~scorable, -torch.inf).amax(dim=1)           # (M, K)
    lo = X.masked_fill(~scorable, torch.inf).amin(dim=1)
    varying = hi > lo                                                # (M, K) non-constant component
    C = (X - mean) * rows * varying.unsqueeze(1).to(R.dtype)         # (M, G, K) centred, exact 0 if constant
    total = C.sum(dim=-1)                                            # (M, G) centred total
    active = varying.any(dim=-1)                                     # (M,)
    S = C.transpose(1, 2) @ C                                        # (M, K, K) = (n-1) Sigma
    var = S.diagonal(dim1=1, dim2=2)                                 # (M, K)
    ok = varying & (var > 0)
    inv_std = torch.where(ok, var.clamp_min(torch.finfo(R.dtype).tiny).rsqrt(), torch.zeros_like(var))
    rho = S * inv_std.unsqueeze(2) * inv_std.unsqueeze(1)            # (M, K, K) correlations
    corr_sum = rho.sum(dim=(1, 2))                                   # (M,)
    if norm_by_correlation:
        A = total / (corr_sum.clamp_min(0.0) + epsilon).sqrt().unsqueeze(1)
    else:
        A = total
    return A.reshape(n).to(torch.float32), corr_sum, active


class CorrGRPO(Plugin):
    """CorrGRPO: A_i = sum_k C_ik / sqrt(max(sum_kl rho_kl, 0) + eps), per group (HKUST-KnowComp/CorrGRPO)."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        norm_by_correlation: bool = Field(
            True,
            description="divide the centred weighted total by sqrt(max(sum of the group's component "
            "correlations, 0) + epsilon); false = the centred total alone (Dr.GRPO switch, verl's "
            "norm_adv_by_std_in_grpo=False)",
        )
        epsilon: float = Field(
            1e-6, gt=0.0, description="added inside the square root of the divisor (verl default 1e-6)")
        reward_columns: list[str] | None = Field(
            None,
            description="reward columns used as components (verl: algorithm.gdpo_reward_keys); "
            "None = every column. Each is multiplied by its TRL reward weight",
        )
        nan_policy: Literal["zero", "group_mean"] = Field(
            "zero",
            description="a NaN component (its reward function returned None) counts as 0 ('zero', "
            "as TRL's nansum) or as the group mean of that component ('group_mean': it then adds "
            "nothing to the centred total or the covariances). Rows with every component NaN "
            "always get advantage 0 and are left out of the group statistics",
        )
        near_zero_corr_sum: float = Field(
            1e-3, ge=0.0,
            description="a group whose correlation sum is <= this (clamped to 0 or nearly so, "
            "advantages amplified up to 1/sqrt(epsilon)) counts in the clamped_fraction metric "
            "and triggers a one-time warning; not from the paper",
        )

    def __init__(self, config: Config | None = None):
        super().__init__(config)
        self._warned = False

    def required_rewards(self) -> list[str]:
        """The reward columns the host must find among the reward functions."""
        return list(self.config.reward_columns or [])

    @hookimpl
    def compute_advantages(self, batch: RolloutBatch) -> torch.Tensor:
        import torch

        cfg = self.config
        rewards, weights = batch.rewards, batch.reward_weights
        if cfg.reward_columns is not None:
            unknown = [c for c in cfg.reward_columns if c not in batch.reward_names]
            if unknown:
                raise KeyError(f"no reward column {unknown[0]!r}; columns are {batch.reward_names}")
            idx = [batch.reward_names.index(c) for c in cfg.reward_columns]
            rewards, weights = rewards[:, idx], weights[idx]
        A, corr_sum, active = corrgrpo_advantages(
            rewards, weights, batch.num_generations, epsilon=cfg.epsilon,
            norm_by_correlation=cfg.norm_by_correlation, nan_policy=cfg.nan_policy)
        if cfg.norm_by_correlation and active.numel():
            near_zero = active & (corr_sum <= cfg.near_zero_corr_sum)
            stats = torch.stack([
                near_zero.sum(), active.sum(),
                corr_sum.masked_fill(~active, torch.inf).min(),
                corr_sum.masked_fill(~active, 0.0).sum(),
            ]).tolist()                                                  # one host sync
            n_near, n_active, low, total = stats
            self.log_metric(batch, "clamped_fraction", n_near / max(n_active, 1.0))
            self.log_metric(batch, "active_fraction", n_active / active.numel())
            if n_active:
                self.log_metric(batch, "min_corr_sum", low)
                self.log_metric(batch, "mean_corr_sum", total / n_active)
            if n_near and not self._warned:
                self._warned = True
                warnings.warn(
                    f"corrgrpo: {int(n_near)} of {int(n_active)} groups have a component-correlation sum "
                    f"<= {cfg.near_zero_corr_sum:g} (min {low:.3g}); their advantages are divided by about "
                    f"sqrt(epsilon) = {cfg.epsilon ** 0.5:.3g}. See the clamped_fraction metric.",
                    RuntimeWarning, stacklevel=2)
        return A
