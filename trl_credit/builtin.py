"""Built-in plugins: the host eats its own cooking.

``grpo`` is TRL's own advantage computation expressed as an estimator plugin; it runs whenever no
enabled plugin implements ``compute_advantages``. Its parity with ``GRPOTrainer`` is a test.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from trl_credit.hookspecs import hookimpl
from trl_credit.plugin import Plugin


class GRPOAdvantage(Plugin):
    """TRL ``GRPOTrainer`` advantages, bit for bit (TRL 1.16).

    ``sum_then_normalize``: ``r_i = sum_k w_k r_ik`` (nansum), ``A_i = (r_i - mean_g r) / (std + 1e-4)``
    with ``std`` the group (``scale_rewards="group"``) or batch (``"batch"``) nan-aware unbiased std,
    or no division (``"none"``). ``normalize_then_sum`` (GDPO): each column normalised per group,
    weighted sum, then whitened over the batch. Rows whose rewards are all NaN get advantage 0.
    Settings come from the trainer's ``GRPOConfig`` unless given here.
    """

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        scale_rewards: Literal["group", "batch", "none"] | None = Field(
            None, description="std used to scale advantages; None: the GRPOConfig value")
        multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] | None = Field(
            None, description="how reward columns combine; None: the GRPOConfig value")

    @hookimpl
    def compute_advantages(self, batch):
        scale = self.config.scale_rewards or getattr(batch.args, "scale_rewards", "group")
        aggregation = self.config.multi_objective_aggregation or getattr(
            batch.args, "multi_objective_aggregation", "sum_then_normalize"
        )
        return grpo_advantages(batch.rewards, batch.reward_weights, batch.num_generations, scale, aggregation)


def grpo_advantages(rewards_per_func, reward_weights, num_generations: int, scale_rewards, aggregation):
    """TRL's formula on an ``(N, K)`` reward matrix (see `GRPOAdvantage`)."""
    import torch
    from trl.trainer.utils import nanstd

    if scale_rewards is True:  # GRPOConfig accepts booleans for backwards compatibility
        scale_rewards = "group"
    elif scale_rewards is False:
        scale_rewards = "none"
    weights = reward_weights.to(rewards_per_func).unsqueeze(0)
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    if aggregation == "sum_then_normalize":
        rewards = (rewards_per_func * weights).nansum(dim=1)
        rewards[unscorable] = torch.nan
        mean = torch.nanmean(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations)
        if scale_rewards in ("group", "none"):
            if num_generations > 1:
                std = nanstd(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations)
            else:
                std = torch.zeros_like(rewards)
        elif scale_rewards == "batch":
            std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        else:
            raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', got {scale_rewards!r}")
        advantages = rewards - mean
        if scale_rewards != "none":
            advantages = advantages / (std + 1e-4)
    elif aggregation == "normalize_then_sum":
        grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.shape[1])
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
        std_k = nanstd(grouped, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(mean_k)
        reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, rewards_per_func.shape[1])
        rewards = (reward_k * weights).nansum(dim=1)
        rewards[unscorable] = torch.nan
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        advantages = (rewards - torch.nanmean(rewards)) / (std + 1e-4)
    else:
        raise ValueError(f"unknown multi_objective_aggregation {aggregation!r}")
    return torch.nan_to_num(advantages, nan=0.0)


def group_normalise(x, pool, num_generations: int, mode: str = "group"):
    """``x`` ``(N, ...)`` (per completion, or per turn ``(N, K)``) against its group, over the entries where ``pool``
    is True: z-scored (``mode="group"``: population sigma + 1e-6; a sigma below 1e-6 counts as 1, so a constant
    group stays 0), mean-centred (``"mean"``) or as is (``"none"``); 0 outside the pool. Entries outside the pool
    are never read, so they may be NaN (a turn that was not scored)."""
    import torch

    shape = x.shape
    m = pool.reshape(-1, num_generations * (x[0].numel() if x.dim() > 1 else 1)).to(x.dtype)
    values = torch.where(m > 0, x.reshape(m.shape), torch.zeros((), dtype=x.dtype))
    if mode == "none":
        return values.reshape(shape)
    count = m.sum(1, keepdim=True).clamp(min=1)
    out = values - values.sum(1, keepdim=True) / count
    if mode == "group":
        sigma = ((out ** 2 * m).sum(1, keepdim=True) / count).sqrt()
        out = out / torch.where(sigma < 1e-6, 1.0, sigma + 1e-6)
    return torch.where(m > 0, out, torch.zeros((), dtype=x.dtype)).reshape(shape)
