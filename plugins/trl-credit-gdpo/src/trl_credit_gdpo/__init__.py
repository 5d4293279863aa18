"""GDPO: normalise every reward separately within its group, add them up, whiten over the batch.

Method. With several rewards (format, correctness, ...) GRPO adds them first and normalises the sum
per group, so different reward combinations that give the same sum collapse onto the same advantage
and a reward with a small spread is drowned by one with a large spread. GDPO (Group reward-Decoupled
normalisation Policy Optimisation) normalises each reward column within its group first, takes the
weighted sum of these per-reward advantages, and then whitens the sum over the whole (gathered)
batch so its scale does not grow with the number of rewards.

Formula (group g of G completions, reward k with weight w_k, eps = 1e-4, std unbiased)::

    A_ik = (r_ik - mean_{j in g} r_jk) / (std_{j in g} r_jk + eps)
    S_i  = sum_k w_k A_ik
    A_i  = (S_i - mean_batch S) / (std_batch S + eps)

With a single reward column (K = 1) the official code does not apply GDPO and falls back to plain
GRPO on the weighted reward, ``(r_i - mean_g r) / (std_g r + eps)`` scaled as ``scale_rewards`` says.

Source: NVIDIA 2026, "GDPO: Group reward-Decoupled Normalization Policy Optimization for
Multi-reward RL Optimization" (arXiv 2601.05242 as cited by third-party code; the official README
leaves the paper link empty). [code] NVlabs/GDPO@b080e63d
``trl-GDPO/trl-0.18.0-gdpo/trl/trainer/grpo_trainer.py`` (``apply_gdpo``, block after the reward
gather; same block at 41f74c53). TRL 1.16 (huggingface/trl@f2cd577) ships the identical maths as
``GRPOConfig(multi_objective_aggregation="normalize_then_sum")``; this plugin equals it on every
input under ``nan_policy="trl"``.

NaN rewards (a reward function returned ``None``). ``nan_policy="trl"`` (default): NaN entries are
left out of every mean and std (nan-aware statistics, as TRL), a NaN per-reward advantage adds 0 to
the sum, and a completion whose rewards are all NaN gets advantage 0 and is left out of the batch
statistics. ``nan_policy="zero"``: NaN is replaced by a real reward of 0 before anything else, as
the official code does (``torch.nan_to_num``); such a completion is then scored as a zero reward.

Defaults: ``eps = 1e-4`` at both stages (a constant in the official code and TRL, so here too);
``nan_policy = "trl"`` (parity with TRL's option; the official behaviour is one switch away);
``single_reward_fallback = True`` (official code: GDPO only when there is more than one reward).
Official TRL recipe: Qwen2.5-1.5B-Instruct on GSM8K, G = 16, lr 5e-6, three binary rewards
(format, correctness, integer answer), weights 1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from trl_credit import Plugin, hookimpl

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch

__all__ = ["GDPO", "gdpo_advantages"]

EPS = 1e-4  # both stages, official code and TRL


def _nan_mean_std(x: torch.Tensor, dim: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """NaN-ignoring mean and unbiased std over ``dim`` (all dims if None), keepdim; std NaN if < 2 values."""
    import torch

    dims = dim if dim is not None else tuple(range(x.ndim))
    mean = torch.nanmean(x, dim=dims, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dims, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dims, keepdim=True) * count / (count - 1)
    return mean, var.masked_fill(count < 2, float("nan")).sqrt()


def gdpo_advantages(r: torch.Tensor, w: torch.Tensor, G: int, eps: float = EPS) -> torch.Tensor:
    """``(N, K)`` rewards (NaN = missing), ``(K,)`` weights, group size G -> ``(N,)`` GDPO advantages.

    NaN-aware throughout; rows whose rewards are all NaN get 0 (TRL's convention).
    """
    import torch

    N, K = r.shape
    missing = torch.isnan(r).all(dim=1)                               # (N,) no reward at all
    grouped = r.reshape(N // G, G, K)                                 # (M, G, K)
    mean_k, std_k = _nan_mean_std(grouped, dim=1)                     # (M, 1, K) per group and reward
    if G == 1:
        std_k = torch.zeros_like(mean_k)                              # a lone completion: A_ik = 0
    A_k = ((grouped - mean_k) / (std_k + eps)).reshape(N, K)          # A_ik
    S = (A_k * w.to(r).unsqueeze(0)).nansum(dim=1)                    # S_i = sum_k w_k A_ik
    S = S.masked_fill(missing, float("nan"))
    mean_S, std_S = _nan_mean_std(S, dim=None)                        # whole-batch statistics
    if N < 2:
        std_S = torch.zeros_like(std_S)
    A = (S - mean_S) / (std_S + eps)
    return torch.nan_to_num(A, nan=0.0)


class GDPO(Plugin):
    """GDPO advantages: A_i = whiten_batch(sum_k w_k (r_ik - mean_g r_k) / (std_g r_k + eps))."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        nan_policy: Literal["trl", "zero"] = Field(
            "trl",
            description="NaN rewards (a reward function returned None): 'trl' leaves them out of every "
            "mean/std and gives all-NaN completions advantage 0 (TRL's normalize_then_sum); 'zero' "
            "replaces them by a reward of 0 before normalising (official NVlabs code)",
        )
        single_reward_fallback: bool = Field(
            True,
            description="with one reward column use plain GRPO (weighted reward normalised per group as "
            "GRPOConfig.scale_rewards says), as the official code does; false = GDPO also for K = 1 "
            "(group normalisation, then batch whitening)",
        )

    @hookimpl
    def compute_advantages(self, batch: RolloutBatch) -> torch.Tensor:
        import torch

        r = batch.rewards.to(torch.float32)
        w = batch.reward_weights
        if self.config.nan_policy == "zero":
            r = torch.nan_to_num(r, nan=0.0)
        if r.shape[1] == 1 and self.config.single_reward_fallback:
            from trl_credit import grpo_advantages

            scale = getattr(batch.args, "scale_rewards", "group")
            self.log_metric(batch, "gdpo_applied", 0.0)
            return grpo_advantages(r, w, batch.num_generations, scale, "sum_then_normalize")
        self.log_metric(batch, "gdpo_applied", 1.0)
        return gdpo_advantages(r, w, batch.num_generations)

