r"""EMPG: Entropy-Modulated Policy Gradients ("Harnessing Uncertainty", arXiv 2509.09265).

Method. The policy gradient's size is tied to the policy's entropy: confident steps get small updates, uncertain
ones large and noisy updates. EMPG re-scales each step's learning signal by the step's own certainty: confident
steps (low entropy) get their advantage amplified (a confident correct step is reinforced more, a confident error
punished more), uncertain steps get it attenuated, and a "future clarity" bonus rewards a step whose next step is
confident (a path towards predictable states). A step is a model turn of a multi-turn rollout (``segments: turns``,
the paper's agent turns; `RolloutBatch.turns`) or a reasoning step of a single completion (``segments: steps``,
segments between delimiters, `trl_credit.token_steps`).

Formula (completion ``i``, step ``k``, ``A_i`` the estimator's advantage, or ``A_it`` per token when an earlier
transform made it so; statistics over the steps with tokens of the kept completions of the batch)::

    H_ik   = mean_{t in step k} H_t                   H_t the policy's token entropy (nats, full distribution)
    Hn_ik  = (H_ik - H_min) / (H_max - H_min + 1e-8)  min-max over the batch's steps
    g_ik   = exp(-kappa Hn_ik) / mean_batch exp(-kappa Hn)        self-calibrating: mean 1 over the batch's steps
    f_ik   = exp(-kappa' Hn_i,k+1)                    future clarity; 0 for a completion's last step
    A_it   = g_ik(t) A_i + zeta f_ik(t)               every token t of step k(t); 0 on environment tokens
    normalise "steps":  A <- (A - mu) / sigma, mu and sigma (population) over the batch's steps (each step weighs 1,
                        its tokens 1 / n_ik each); "tokens": over the loss tokens; "none": not normalised
                        (sigma < 1e-6: only mu is subtracted)

Source: the abstract of arXiv 2509.09265 (``papers/004``: step-wise uncertainty, amplify confident correct actions,
penalise confident errors, attenuate uncertain steps, a future-clarity bonus) and methods.md 2.19, whose structure is
**[paper-recalled]** (no official code found; project page only). Test vector (methods.md, kappa = kappa' = 1,
zeta = 0.1, before the final normalisation): traj 1 ``A = +1``, step entropies ``[0, 1]`` -> ``[1.586609,
0.570148]``; traj 2 ``A = -1``, ``[0.5, 0.5]`` -> ``[-0.879362, -0.940015]``.

Established (abstract): the modulation by step-wise entropy in the direction above and a bonus for future clarity.
Recalled, not verified (methods.md): the min-max normalisation, the exponential ``g`` with batch mean 1, the bonus
``exp(-kappa' Hn_k+1)``, the final batch normalisation. Chosen here: ``kappa = kappa' = 1`` and ``zeta = 0.1``
(methods.md's test values; the paper's are not established); the statistics run over the steps of kept
completions (dropped ones get 0 anyway); a step's entropy is the mean over its tokens; a completion without a
delimiter (steps mode) is one step; a step that holds no token (one token spanning two steps) has no entropy and
gives no bonus; per-token input advantages are modulated token by token; the final normalisation weighs steps
equally (``normalise: steps``, the unit of ``g``'s mean), ``tokens`` and ``none`` are options.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from trl_credit import Plugin, Regex, hookimpl, token_steps

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch

__all__ = ["EMPG", "modulate", "normalise", "step_entropies"]

EPS = 1e-8


def step_entropies(entropies: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(H (N, K), n (N, K))``: the mean token entropy of each step and its token count.

    ``index`` ``(N, T)``: the step of each token, -1 on tokens of no step (environment, padding).
    """
    import torch

    n_rows = index.shape[0]
    k = max(int(index.max()) + 1 if index.numel() else 0, 1)
    inside = index >= 0
    where = index.clamp(min=0)
    total = torch.zeros(n_rows, k, dtype=torch.float32, device=index.device)
    total.scatter_add_(1, where, torch.where(inside, entropies.to(total), 0.0))
    count = torch.zeros_like(total).scatter_add_(1, where, inside.to(total.dtype))
    return total / count.clamp(min=1.0), count


def modulate(h: torch.Tensor, valid: torch.Tensor, kappa: float, kappa_future: float,
             zeta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g (N, K), bonus (N, K))``: the self-calibrated scale of each step and its future-clarity bonus
    ``zeta * exp(-kappa' Hn_k+1)`` (0 where step ``k + 1`` has no tokens or does not exist); 0 off ``valid``."""
    import torch

    if not valid.any():
        zero = torch.zeros_like(h)
        return zero, zero
    low, high = h[valid].min(), h[valid].max()
    hn = torch.where(valid, (h - low) / (high - low + EPS), 0.0)
    e = torch.exp(-kappa * hn)
    g = torch.where(valid, e / e[valid].mean(), 0.0)
    future = torch.where(valid[:, 1:], zeta * torch.exp(-kappa_future * hn[:, 1:]), 0.0)
    bonus = torch.cat([future, torch.zeros_like(h[:, :1])], dim=1)
    return g, torch.where(valid, bonus, 0.0)


def normalise(a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``(a - mu) / sigma`` on the tokens where ``weight > 0``, ``mu`` and the population ``sigma`` weighted by
    ``weight`` (``sigma < 1e-6``: ``a - mu``); 0 elsewhere."""
    import torch

    on = weight > 0
    if not on.any():
        return torch.zeros_like(a)
    total = weight.sum()
    mu = (weight * a).sum() / total
    sigma = ((weight * (a - mu) ** 2).sum() / total).sqrt()
    scale = sigma if float(sigma) >= 1e-6 else torch.ones_like(sigma)
    return torch.where(on, (a - mu) / scale, 0.0)


class EMPG(Plugin):
    """EMPG: A_it = g(Hn_ik) A_i + zeta f(Hn_i,k+1), g = exp(-kappa Hn) / mean_batch, f = exp(-kappa' Hn),
    Hn the batch min-max normalised mean entropy of step k (a model turn or a reasoning step); then batch-normalised."""

    name = "empg"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        segments: Literal["turns", "steps"] = Field(
            "turns", description="what a step is: a model turn of a multi-turn rollout (TRL's tool mask; a "
            "single-turn completion is one step) or a segment of a single completion's text between `pattern` matches")
        pattern: Regex = Field(r"\n+", description="segments: steps: regex separating the steps of a completion "
                               "(a delimiter closes the step before it)")
        kappa: float = Field(1.0, ge=0.0, description="kappa: sharpness of the confidence scale g = exp(-kappa Hn) "
                             "/ batch mean (0: g = 1); not established, methods.md's test value")
        kappa_future: float = Field(1.0, ge=0.0, description="kappa': sharpness of the future-clarity bonus "
                                    "exp(-kappa' Hn_k+1); not established, methods.md's test value")
        zeta: float = Field(0.1, ge=0.0, description="zeta: weight of the future-clarity bonus (0: off); not "
                            "established, methods.md's test value")
        normalise: Literal["steps", "tokens", "none"] = Field(
            "steps", description="final batch normalisation of the modulated advantages: z-score with every step "
            "weighing 1 (steps), every loss token weighing 1 (tokens), or none")

    def _step_index(self, batch: RolloutBatch) -> torch.Tensor:
        """``(N, T)`` the step of each completion token, -1 on environment tokens and padding."""
        import torch

        if self.config.segments == "turns":
            return batch.turns().index
        index, _ = token_steps(batch, self.config.pattern, fill=True)
        model = batch.turns().model.to(index.device)  # the completion mask less the environment's tokens
        return torch.where(model, index.clamp(min=0), -1)  # a completion without a step is one step

    @hookimpl
    def transform_advantages(self, batch: RolloutBatch, advantages: torch.Tensor) -> torch.Tensor:
        import torch

        cfg = self.config
        device = advantages.device
        index = self._step_index(batch).to(device)
        members = (batch.kept & batch.scorable).to(device)  # statistics over kept, scored completions
        index = torch.where(members.unsqueeze(1), index, -1)
        entropies = batch.policy_entropies().to(device)[:, : index.shape[1]]
        h, count = step_entropies(entropies, index)
        valid = count > 0
        g, bonus = modulate(h, valid, cfg.kappa, cfg.kappa_future, cfg.zeta)
        inside = index >= 0
        where = index.clamp(min=0)
        a = advantages.to(torch.float32)
        a = a.unsqueeze(1).expand(index.shape) if a.dim() == 1 else a[:, : index.shape[1]]
        modulated = torch.where(inside, g.gather(1, where) * a + bonus.gather(1, where), 0.0)
        if cfg.normalise != "none":
            if cfg.normalise == "steps":
                weight = torch.where(inside, 1.0 / count.gather(1, where).clamp(min=1.0), 0.0)
            else:
                weight = inside.to(torch.float32)
            modulated = normalise(modulated, weight)
        if valid.any():
            self.log_metric(batch, "step_entropy", float(h[valid].mean()))
            self.log_metric(batch, "scale_min", float(g[valid].min()))
            self.log_metric(batch, "scale_max", float(g[valid].max()))
            self.log_metric(batch, "bonus", float(bonus[valid].mean()))
            rows = valid.any(1)
            self.log_metric(batch, "steps", float(valid.sum(1)[rows].float().mean()))
        return modulated
