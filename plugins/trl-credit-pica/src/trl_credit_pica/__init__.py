"""PiCA: pivot-based credit assignment, potential-based shaping with the success probability of the history.

Method. A search agent's trajectory is a sequence of steps (model turns, each answered by the environment) that
accumulate progress towards the answer. PiCA rewards each step by potential-based reward shaping (PBRS) whose
potential is the probability of final success given the history so far: a pivot step (a golden sub-query and its
sub-answer) is an information peak that raises that probability sharply and so earns a large step reward, and
every step reward is anchored to the task's outcome. The final (answer) turn is credited by the outcome alone.

Formula (group ``g``, completion ``i`` with model turns ``k = 0 .. K_i - 1``, ``h_i0`` the prompt alone, ``h_i,k+1``
the history after turn ``k``, ``A_i`` the run's outcome advantage, ``r_i`` the outcome reward)::

    Phi_ik   = S(h_ik)                  the estimated success probability of the history (`potential`):
        prefix:  the mean outcome of the group's members whose completion starts with h_ik (the same token ids
                 and model / environment mask; members: kept, outcome not NaN); S(h_i0) = the group's mean outcome
        gold:    exp(mean_t log pi(gold_t | prompt, h_ik, cue, gold_<t))     (the policy's belief in the gold answer)
        column:  the success probability recorded after turn k - 1 (`batch.turn_values(column)`; NaN carries the
                 last one), S(h_i0) = the group's mean outcome
    history after turn k:  state: reply  -> through the environment's reply to turn k (`trl_credit.turn_ends`)
                           state: action -> through turn k's own tokens (where PiCA's reward model scores a query)
    F_ik     = gamma * Phi_i,k+1 - Phi_ik - p_k       k = 0 .. K_i - 2 (the steps answered by the environment)
    p_k      = penalty * growth^(k - free_turns + 1)  for k >= free_turns, else 0   (the official step penalty; off)
    z_ik     = (F_ik - mu_g) / (sigma_g + 1e-6)       normalise: group, over the group's steps (member rows);
               sigma_g = sqrt(var_g + 1e-8), 1 when the group has <= 1 step   (mean: F - mu_g; none: F)
    C_ik     = sum_{j = k}^{K_i - 2} gamma^(j - k) z_ij    credit: return     (credit: reward: C_ik = z_ik)
    A'_it    = A_i + coef * C_i,k(t)                  on the tokens of turn k; the last turn keeps A_i

Source: the PiCA abstract ("PiCA: Pivot-Based Credit Assignment for Search Agentic Reinforcement Learning",
/work/shared/papers/004) and its official code ``novdream/PiCA@35b15c71dab0`` (read, not copied):
``Search-R1/verl/trainer/main_ppo.py`` (step rewards from a conditional reward model, one per search step at the
end of its query, the outcome at the last token, the step penalty ``0.3 * 1.5^(i - 2)`` from the fourth step),
``OpenRLHF/openrlhf/models/loss.py::CRMLoss`` (the reward model's hazard ``h``: survival ``S = prod (1 - h)``, so its
step reward ``1 - h = S_k / S_k-1`` is a success probability conditional on the history),
``Search-R1/verl/trainer/ppo/core_algos.py::compute_grpo_outcome_advantage`` (GRPO: step rewards and outcomes
normalised apart per group, std ``sqrt(var + 1e-8)``, then ``A_k = r_k + gamma A_k+1`` plus the outcome's). Provenance:
[code] for the structure and the normalisation; the potential is [abstract-inferred]: PiCA's reward model is trained
on pivot-annotated trajectories, which the host does not have, so it is estimated from what the batch offers.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trl_credit import Plugin, carry_forward, discounted_returns, hookimpl, turn_ends

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch

__all__ = ["PiCA", "normalise", "penalties", "prefix_success", "shaping", "state_ends"]


def state_ends(batch: RolloutBatch, state: str = "reply") -> torch.Tensor:
    """``(N, K + 1)`` completion-token prefix lengths of the histories ``h_0 .. h_K``: 0 (the prompt), then after
    each model turn (through its reply, or through its own tokens under ``state: action``); -1 past a row's turns."""
    import torch

    info = batch.turns()
    if state == "reply":
        after = turn_ends(batch)
    else:
        starts = info.starts()
        after = torch.where(starts >= 0, starts + info.lengths.to(starts.device), -1)
    zero = torch.zeros(after.shape[0], 1, dtype=torch.long, device=after.device)
    return torch.cat([zero, after.long()], dim=1)


def prefix_success(codes: torch.Tensor, ends: torch.Tensor, outcome: torch.Tensor, members: torch.Tensor,
                   num_generations: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(phi, count)`` ``(N, S)``: the mean outcome of the group's members whose codes start with row ``i``'s first
    ``ends[i, s]`` codes (NaN where no member shares it, or ``ends < 0``) and how many members that is. ``codes``
    ``(N, T)`` integers (0 outside the completion). Pairwise common-prefix lengths in ``(N / G, G, G, T)`` booleans,
    no loop."""
    import torch

    g = num_generations
    c = codes.reshape(-1, g, codes.shape[1])
    differ = c.unsqueeze(2) != c.unsqueeze(1)  # (B, G, G, T)
    common = torch.where(differ.any(-1), differ.to(torch.uint8).argmax(-1), codes.shape[1])  # (B, G, G)
    e = ends.reshape(-1, g, ends.shape[1])  # (B, G, S)
    shares = common.unsqueeze(-1) >= e.unsqueeze(2)  # (B, G_i, G_j, S): j's history starts with i's h
    weight = (members.reshape(-1, 1, g, 1) & shares).to(outcome.dtype)
    r = outcome.nan_to_num(0.0).reshape(-1, 1, g, 1)
    total, count = (weight * r).sum(2), weight.sum(2)
    phi = torch.where((count > 0) & (e >= 0), total / count.clamp(min=1), math.nan)
    return phi.reshape(ends.shape), torch.where(e >= 0, count, 0.0).reshape(ends.shape)


def penalties(k: int, penalty: float, growth: float, free_turns: int, device=None) -> torch.Tensor:
    """``(k,)`` the step penalty ``p_j = penalty * growth^(j - free_turns + 1)`` for ``j >= free_turns``, else 0."""
    import torch

    j = torch.arange(k, device=device, dtype=torch.float32)
    return torch.where(j >= free_turns, penalty * growth ** (j - free_turns + 1), 0.0)


def shaping(phi: torch.Tensor, count: torch.Tensor, gamma: float, penalty: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(F (N, K), valid (N, K))``: ``F_ik = gamma * Phi_i,k+1 - Phi_ik - p_k`` for the steps ``k < K_i - 1`` whose
    two potentials are finite; 0 elsewhere. ``phi`` ``(N, K + 1)``, ``count`` ``(N,)`` the turns ``K_i``."""
    import torch

    k = phi.shape[1] - 1
    step = torch.arange(k, device=phi.device).unsqueeze(0) < (count.to(phi.device) - 1).unsqueeze(1)
    f = gamma * phi[:, 1:] - phi[:, :-1]
    if penalty is not None:
        f = f - penalty.to(phi.device)
    valid = step & torch.isfinite(f)
    return torch.where(valid, f, 0.0), valid


def normalise(x: torch.Tensor, pool: torch.Tensor, num_generations: int, mode: str = "group") -> torch.Tensor:
    """``x`` ``(N, K)`` against the pooled entries of its group: ``(x - mu) / (sqrt(var + 1e-8) + 1e-6)`` (group;
    the std is 1 when the group pools <= 1 entry), ``x - mu`` (mean) or ``x`` (none); 0 outside the pool."""
    import torch

    if mode == "none":
        return torch.where(pool, x, 0.0)
    n, k = x.shape
    v = x.reshape(-1, num_generations * k)
    m = pool.reshape(v.shape).to(x.dtype)
    count = m.sum(1, keepdim=True)
    mean = (v * m).sum(1, keepdim=True) / count.clamp(min=1)
    out = v - mean
    if mode == "group":
        std = ((out ** 2 * m).sum(1, keepdim=True) / count.clamp(min=1) + 1e-8).sqrt()
        out = out / (torch.where(count <= 1, 1.0, std) + 1e-6)
    return torch.where(m > 0, out, 0.0).reshape(n, k)


class PiCA(Plugin):
    """PiCA: A'_it = A_i + coef * C_ik, C the (normalised, accumulated) PBRS step rewards
    F_k = gamma S(h_k+1) - S(h_k) with S the estimated success probability of the history. Source: the PiCA
    abstract and novdream/PiCA (structure [code], potential estimate [abstract-inferred])."""

    name = "pica"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        potential: Literal["prefix", "gold", "column"] = Field(
            "prefix", description="estimate of the success probability of a history: the group's mean outcome over "
            "the trajectories sharing it (prefix), the policy's probability of the gold answer after it (gold; one "
            "scoring pass), or a per-turn column recorded by the environment or a reward model (column)")
        state: Literal["reply", "action"] = Field(
            "reply", description="prefix / gold: the history after a turn ends after the environment's reply (reply) "
            "or after the turn's own tokens (action, where PiCA's reward model scores a query)")
        reward: str | None = Field(None, description="outcome reward column (the success of prefix and the prompt's "
                                   "potential); null: the total reward")
        column: str = Field("turn_success", description="potential: column: per-turn column with the success "
                            "probability after each model turn (None: not recorded, the last one carries)")
        answer_column: str = Field("answer", description="potential: gold: dataset column with the gold answer")
        cue: str = Field("", description="potential: gold: text teacher-forced between the history and the gold "
                         "answer, not scored (e.g. '<answer>' for Search-R1's format)")
        model: Literal["policy", "reference"] = Field("policy", description="potential: gold: the model whose "
                                                      "probability of the gold answer is read")
        gamma: float = Field(1.0, ge=0.0, le=1.0, description="discount of the shaping and of the accumulation "
                             "(official: 1.0)")
        credit: Literal["return", "reward"] = Field(
            "return", description="a turn's credit: its normalised step reward plus the discounted later ones "
            "(return, the official accumulation) or its own step reward only (reward)")
        normalise: Literal["group", "mean", "none"] = Field(
            "group", description="step rewards against the group's steps: z-score (group, official), mean-centred "
            "(mean) or raw (none)")
        coef: float = Field(1.0, ge=0.0, description="weight of the step credit added to the outcome advantage "
                            "(official GRPO path: 1.0; its PPO script weighs steps 0.3 against outcomes 1.5)")
        penalty: float = Field(0.0, ge=0.0, description="scale of the step penalty on every step after the first "
                               "free_turns (official: 0.3; 0: off)")
        growth: float = Field(1.5, ge=1.0, description="growth of the step penalty per later step (official: 1.5)")
        free_turns: int = Field(3, ge=0, description="steps without a penalty (official: 3)")

        @model_validator(mode="after")
        def _consistent(self):
            given = self.model_fields_set
            if self.potential == "column" and "state" in given:
                raise ValueError("state applies to potential: prefix / gold; potential: column reads the values the "
                                 "rollout recorded after each turn; fix: remove state")
            if self.potential != "column" and "column" in given:
                raise ValueError("column is read only with potential: column; fix: set potential: column or "
                                 "remove column")
            if self.potential != "gold" and {"answer_column", "cue", "model"} & given:
                raise ValueError("answer_column, cue and model apply to potential: gold; fix: set potential: gold "
                                 "or remove them")
            if not self.column.strip() or not self.answer_column.strip():
                raise ValueError("column and answer_column must name a column; fix: give the column's name, e.g. "
                                 "turn_success / answer")
            return self

    def required_turn_values(self) -> list[str]:
        return [self.config.column] if self.config.potential == "column" else []

    def required_columns(self) -> list[str]:
        return [self.config.answer_column] if self.config.potential == "gold" else []

    def required_rewards(self) -> list[str]:
        return [self.config.reward] if self.config.reward else []

    def needs_reference(self) -> bool:
        return self.config.potential == "gold" and self.config.model == "reference"

    def potentials(self, batch: RolloutBatch, outcome: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
        """``(N, K + 1)`` Phi of the histories ``h_0 .. h_K`` (NaN where not estimated), on ``batch.device``."""
        import torch

        cfg = self.config
        device = batch.device
        turns = batch.turns()
        g = batch.num_generations
        if cfg.potential == "column":
            recorded = batch.turn_values(cfg.column).to(device)
            bad = torch.isfinite(recorded) & ((recorded < 0) | (recorded > 1))
            if bool(bad.any()):
                row = int(bad.any(1).nonzero()[0])
                raise ValueError(f"column '{cfg.column}': row {row} holds {recorded[row].tolist()}, not success "
                                 "probabilities in [0, 1]; fix: record P(success | history) after each turn")
            m = members.reshape(-1, g).to(outcome.dtype)
            prior = ((outcome.nan_to_num(0.0).reshape(-1, g) * m).sum(1) / m.sum(1)).repeat_interleave(g)
            return carry_forward(torch.cat([prior.unsqueeze(1), recorded], dim=1))  # Phi_k+1: after turn k
        ends = state_ends(batch, cfg.state).to(device)
        if cfg.potential == "prefix":
            valid = batch.completion_mask.bool().to(device)
            codes = torch.where(valid, batch.completion_ids.to(device).long() * 2 + turns.model.to(device).long() + 1, 0)
            phi, sharers = prefix_success(codes, ends, outcome, members, g)
            # resolution of the tree: the step states (after turns 0 .. K_i - 2) of members that another member shares
            step = (torch.arange(1, ends.shape[1], device=device).unsqueeze(0) < turns.count.to(device).unsqueeze(1))
            step = step & members.unsqueeze(1)
            if bool(step.any()):
                self.log_metric(batch, "shared_states", float((sharers[:, 1:][step] > 1).float().mean()))
            return phi
        gold = [str(a) for a in batch.column(cfg.answer_column)]
        # only the histories a step reward reads: h_0 .. h_K-1 of members with a step (K >= 2; the last turn is
        # credited by the outcome, and a non-member's credit is 0)
        count = turns.count.to(device).unsqueeze(1)
        read = (torch.arange(ends.shape[1], device=device).unsqueeze(0) < count) & (count >= 2) & members.unsqueeze(1)
        needed = torch.where(read, ends, -1)
        mean = batch.prefix_logps(needed, gold, model=cfg.model, reduce="mean", context=cfg.cue or None)
        return mean.to(device).exp()

    @hookimpl
    def transform_advantages(self, batch: RolloutBatch, advantages: torch.Tensor) -> torch.Tensor | None:
        import torch

        cfg = self.config
        turns = batch.turns()
        if turns.max_turns == 0:
            return None
        device = advantages.device
        outcome = (batch.reward(cfg.reward) if cfg.reward else batch.total_reward()).to(device)
        members = batch.kept.to(device) & torch.isfinite(outcome)
        phi = self.potentials(batch, outcome, members).to(device)
        count = turns.count.to(device)
        pen = penalties(turns.max_turns, cfg.penalty, cfg.growth, cfg.free_turns, device) if cfg.penalty else None
        f, valid = shaping(phi, count, cfg.gamma, pen)
        pool = valid & members.unsqueeze(1)
        z = normalise(f, pool, batch.num_generations, cfg.normalise)
        c = discounted_returns(z, cfg.gamma) if cfg.credit == "return" else z
        c = torch.where(members.unsqueeze(1), c, 0.0)
        base = advantages if advantages.dim() == 2 else advantages.unsqueeze(1).expand(-1, batch.width)
        out = base + cfg.coef * turns.broadcast(c).to(device)
        self._metrics(batch, phi, f, pool, members, c, count)
        return out.float()

    def _metrics(self, batch, phi, f, pool, members, credit, count) -> None:
        import torch

        start = phi[members, 0]
        if bool(torch.isfinite(start).any()):  # the gold potential is read only where a step needs it
            self.log_metric(batch, "potential_start", float(start.nanmean()))
        if bool(pool.any()):
            self.log_metric(batch, "step_reward", float(f[pool].mean()))
            self.log_metric(batch, "positive_steps", float((f[pool] > 0).float().mean()))
            self.log_metric(batch, "credit_abs", float((self.config.coef * credit[pool]).abs().mean()))
        inside = torch.arange(f.shape[1], device=f.device).unsqueeze(0) < count.unsqueeze(1)
        rows = members.unsqueeze(1) & inside
        if bool(rows.any()):
            self.log_metric(batch, "credited_steps", float(pool[rows].float().mean()))
