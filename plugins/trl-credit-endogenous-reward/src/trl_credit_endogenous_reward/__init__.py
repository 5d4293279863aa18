"""Endogenous reward: the reward a next-token-trained model already holds, by inverse soft Bellman.

Method. A language model's logits can be read as soft Q-values of the token MDP: ``pi(a|s) ∝ exp(Q(s, a) / alpha)``.
Offline inverse RL then recovers, without any reward-model training, the reward that makes those Q-values
soft-optimal: ``r(s_t, a_t) = Q(s_t, a_t) - gamma * V(s_{t+1})`` with the soft value
``V(s) = alpha * log sum_a exp(Q(s, a) / alpha)``. The paper elicits it from a base (pre-trained or SFT)
model and trains the policy with it.

Formula (completion ``i`` with ``L_i`` tokens, the model's logits ``Q`` at temperature ``alpha``)::

    r_it = Q(s_it, a_it) - V(s_i,t+1)                   t = 0 .. L_i - 1   (gamma = 1)
    V(s_i,L_i) = 0 when the completion ended with EOS   (``terminal: zero``, a terminal state has no future;
                                                          ``terminal: logits`` keeps the model's value)
    R_i  = sum_t r_it  (``reduce: sum``)   or   R_i / L_i  (``reduce: mean``)
    reward column ``column`` <- R_i

Because ``Q_t - V_t = alpha * log pi(a_t | s_t)``, the sum telescopes:
``R_i = alpha * sum_t log pi(a_it | s_it) + V(s_i0) - V(s_i,L_i)``: the completion's log-likelihood under the
model plus the prompt's soft value (the same for every completion of a group, so under ``reduce: sum`` it cancels
in GRPO's group baseline; under ``reduce: mean`` it is divided by each row's length and does not) minus the value
of where it stopped.

How the logits are obtained: TRL 1.16's own passes keep only per-token log-probs and entropies, so the plugin
asks the host for `RolloutBatch.soft_values`: one extra no-grad forward pass of the chosen model that keeps the
logits of the completion positions only (``logits_to_keep``), chunked so that ``(B, T + 1, vocab)`` stays
bounded, and reduces them at once to the sampled token's logit and the logsumexp.

Source: "Generalist Reward Models: Found Inside Large Language Models" (abstract, ``papers/004``): the
endogenous reward is equivalent to a reward learned by offline inverse RL and can be elicited from a base model
without training. Established by the abstract: the reward comes from the model's own logits through inverse RL,
no training. Chosen (the abstract gives no formula): the standard inverse soft-Bellman form above with
``gamma = 1`` and ``alpha = 1``; the reference (the base model with adapters off) as the model read, so the
reward is the base model's and does not drift with the policy; a zero value after EOS; the sum (``mean`` is the
length-normalised alternative).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from trl_credit import Plugin, hookimpl

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch

__all__ = ["EndogenousReward", "endogenous_rewards"]


def endogenous_rewards(q: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, ended: torch.Tensor,
                       terminal: str = "zero") -> torch.Tensor:
    """``(N, T)`` ``r_t = Q_t - V_{t+1}`` on the completion's tokens (0 elsewhere); ``V`` after the last token of
    an ended completion is 0 under ``terminal: zero``."""
    import torch

    lengths = mask.sum(1).long()
    nxt = v[:, 1:].clone()  # V(s_t+1) for t = 0 .. T-1
    if terminal == "zero":
        last = (lengths - 1).clamp(min=0)
        rows = torch.arange(q.shape[0], device=q.device)
        stop = ended & (lengths > 0)
        nxt[rows[stop], last[stop]] = 0.0
    return (q - nxt) * mask


class EndogenousReward(Plugin):
    """The inverse soft-Bellman reward of a model's logits as a reward column (a reward-shaping plugin)."""

    name = "endogenous_reward"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        model: Literal["reference", "policy"] = Field("reference", description="model whose logits are read: the "
                                                      "reference (the base, adapters off) or the current policy")
        temperature: float = Field(1.0, gt=0, description="alpha of the soft value V = alpha logsumexp(Q / alpha)")
        terminal: Literal["zero", "logits"] = Field("zero", description="value after EOS: 0 (a terminal state) or "
                                                    "the model's logsumexp there")
        reduce: Literal["sum", "mean"] = Field("sum", description="sum of the token rewards or their mean")
        column: str = Field("endogenous_reward", description="reward column written (appended, or replaced)")
        weight: float = Field(1.0, description="weight of an appended column in the total reward")

    def needs_reference(self) -> bool:
        return self.config.model == "reference"

    @hookimpl
    def shape_rewards(self, batch: RolloutBatch) -> dict:
        import torch

        cfg = self.config
        q, v = batch.soft_values(cfg.model, cfg.temperature)
        mask = batch.completion_mask.to(q.dtype)
        lengths = batch.completion_lengths.to(q.device)
        eos = getattr(batch.tokenizer, "eos_token_id", None)
        rows = torch.arange(batch.num_completions, device=q.device)
        last_token = batch.completion_ids.to(q.device)[rows, (lengths - 1).clamp(min=0)]
        ended = (last_token == eos) & (lengths > 0) if eos is not None else torch.zeros_like(lengths, dtype=torch.bool)
        r = endogenous_rewards(q, v, mask, ended, cfg.terminal)
        total = r.sum(1)
        reward = total / lengths.clamp(min=1).to(q.dtype) if cfg.reduce == "mean" else total
        if reward.numel():
            self.log_metric(batch, "reward", float(reward.mean()))
            self.log_metric(batch, "ended", float(ended.float().mean()))
        reward = reward.to(torch.float32)
        return {cfg.column: reward} if cfg.column in batch.reward_names else {cfg.column: (reward, cfg.weight)}
