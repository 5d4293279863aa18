"""Fixed implicit PRM: step rewards from a saved, frozen LoRA adapter read against the reference.

Method. An implicit process reward model (Yuan et al., "Free Process Rewards without Process Labels"; PRIME)
is a language model ``pi_prm`` whose log-ratio to a reference, ``q_t = log pi_prm(y_t|y_<t) - log pi_ref(y_t|y_<t)``,
is a token-level reward; summed over a step it scores the step. PRIME trains it online; this plugin loads one
that is already trained (PRIME writes its adapter into every checkpoint as ``checkpoint-N/tc_prime_prm``; any
LoRA adapter of the same base trained as an implicit PRM works) and uses it, frozen, as a process-reward shaper.

Formula (completion ``i``, step ``k`` = the tokens `trl_credit.token_steps` maps to it, ``pi_ref`` the base
model with adapters off)::

    q_it  = log pi_prm(y_it | y_i<t) - log pi_ref(y_it | y_i<t)
    r_ik  = beta * sum_{t in step k} q_it                     (a completion without steps: one step, all tokens)
    R_i   = min_k r_ik | sum_k r_ik | mean_k r_ik | r_i,last  (aggregate)
    the reward column ``column`` <- R_i (appended with weight ``weight``, or replacing an existing column)

Source: the implicit-PRM parameterisation of methods.md 2.23 (PRIME, ``PRIME-RL/PRIME@18ad596f``,
``compute_implicit_reward``) read at step granularity. Chosen: ``min`` over steps is the default aggregate (a
solution is as good as its worst step, the usual PRM reading; ``sum`` is the implicit outcome reward
``beta * log pi_prm / pi_ref`` of the whole completion); beta defaults to PRIME's 0.05 and must be the beta
the adapter was trained with for the scores to be calibrated log-odds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from trl_credit import Adapter, Plugin, Regex, hookimpl, token_steps

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch

__all__ = ["FixedPRM", "aggregate_steps", "step_rewards"]


def step_rewards(q: torch.Tensor, index: torch.Tensor, mask: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(N, K)`` ``beta * sum_{t in step k} q_t`` and their validity; a row without steps is one step of all its tokens."""
    import torch

    n = q.shape[0]
    has_steps = (index >= 0).any(1)
    index = torch.where(has_steps.unsqueeze(1), index, torch.where(mask.bool(), 0, -1))
    k = max(int(index.max()) + 1 if index.numel() else 1, 1)
    total = torch.zeros(n, k + 1, dtype=q.dtype, device=q.device)
    total.scatter_add_(1, torch.where(index >= 0, index, k), torch.where(index >= 0, q, 0.0))
    counts = torch.zeros(n, k + 1, device=q.device).scatter_add_(1, torch.where(index >= 0, index, k),
                                                                 (index >= 0).float())
    return beta * total[:, :k], counts[:, :k] > 0


def aggregate_steps(r: torch.Tensor, valid: torch.Tensor, how: str) -> torch.Tensor:
    """``(N,)`` the aggregate of each row's valid step rewards (0 for a row with none)."""
    import torch

    count = valid.sum(1)
    if how == "min":
        out = torch.where(valid, r, torch.inf).amin(1)
    elif how == "sum":
        out = (r * valid).sum(1)
    elif how == "mean":
        out = (r * valid).sum(1) / count.clamp(min=1)
    else:  # last
        last = (torch.arange(r.shape[1], device=r.device) * valid).argmax(1)
        out = r.gather(1, last.unsqueeze(1)).squeeze(1)
    return torch.where(count > 0, out, 0.0)


class FixedPRM(Plugin):
    """Process rewards from a frozen implicit PRM adapter loaded from ``path`` (a reward-shaping plugin)."""

    name = "fixed_prm"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        path: str = Field("", description="saved PEFT adapter folder of the implicit PRM (adapter_config.json + "
                          "adapter_model.safetensors), e.g. out/checkpoint-200/tc_prime_prm")
        beta: float = Field(0.05, gt=0, description="implicit-PRM beta (the one it was trained with)")
        pattern: Regex = Field(r"\n+", description="regex separating steps in a completion")
        aggregate: Literal["min", "sum", "mean", "last"] = Field("min", description="how step rewards make one reward")
        column: str = Field("implicit_prm", description="reward column written (appended, or replaced if it exists)")
        weight: float = Field(1.0, description="weight of an appended column in the total reward")

    def needs_reference(self) -> bool:
        return True  # q = log pi_prm - log pi_ref

    def adapters(self):
        return [Adapter("prm", path=self.config.path)] if self.config.path else []  # check_args refuses no path

    def check_args(self, run):
        from trl_credit import ConfigError

        if not self.config.path:
            raise ConfigError.for_key("path", "is empty", "set path to a saved PEFT adapter folder, e.g. "
                                      "out/checkpoint-200/tc_prime_prm (what the prime plugin writes)")

    @hookimpl
    def shape_rewards(self, batch: RolloutBatch) -> dict:
        import torch

        cfg = self.config
        mask = batch.completion_mask.float()
        q = (self.adapter("prm").logps(batch) - batch.ref_logps()) * mask
        index, _ = token_steps(batch, cfg.pattern, fill=True)
        r, valid = step_rewards(q, index, mask, cfg.beta)
        reward = aggregate_steps(r, valid, cfg.aggregate)
        if reward.numel():
            self.log_metric(batch, "mean_step_reward", float((r * valid).sum() / valid.sum().clamp(min=1)))
            self.log_metric(batch, "reward", float(reward.mean()))
        if cfg.column in batch.reward_names:
            return {cfg.column: reward.to(torch.float32)}
        return {cfg.column: (reward.to(torch.float32), cfg.weight)}
