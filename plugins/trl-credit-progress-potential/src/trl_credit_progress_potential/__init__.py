"""Progress-potential reward shaping (PPRS): potential-based turn rewards from an environment's progress metric.

Method. An environment that can say how far a trajectory has got (Tev-Gym's latent-world progress; the guess
game's distance to the secret) gives a potential ``Phi`` of the state after each turn. Potential-based shaping
(Ng, Harada & Russell 1999) rewards each turn with the discounted change of the potential; the shaping terms of
a trajectory telescope, so with the terminal potential 0 every trajectory's return moves by the same ``-Phi_0``
and the optimal policy is unchanged, while the credit inside a trajectory follows the progress.

Formula (completion ``i`` with ``K_i`` model turns; ``p_ik`` the progress the environment recorded after turn
``k`` in the column ``column``, read with ``batch.turn_values``; ``r_i`` the outcome reward)::

    Phi(p)     = p  (direction: higher)   or  -p  (lower is better, e.g. a distance)
    Phi_i0     = Phi(initial)             the progress before the first turn (default 0), in the column's units,
                                          or Phi of the row's first record (initial: first)
    Phi_i,k+1  = Phi(p_ik)                the state after turn k; a turn that recorded nothing carries Phi_ik
    Phi_i,K_i  = 0                        terminal: zero (Ng's rule: the absorbing state has potential 0)
               = Phi(last carried p_i)    terminal: last
    F_ik       = gamma * Phi_i,k+1 - Phi_ik                              k = 0 .. K_i - 1
    sum_k gamma^k F_ik = gamma^K_i * Phi_i,K_i - Phi_i0                 (telescopes)
    credit: return   G_ik = sum_{j >= k} gamma^(j - k) F_ij = gamma^(K_i - k) Phi_i,K_i - Phi_ik
    credit: reward   G_ik = F_ik
    initial: first   G_ik = 0 for k <= j_i, the turn of row i's first record (Phi before those turns is that
                     record's potential, which their own result decided: it would be no state baseline)
    advantage: add     A_it = A_i + coef * G_i,k(t)            A_i the run's outcome advantage (a transform)
    advantage: index   R_ik = coef * G_ik + gamma^(K_i - 1 - k) r_i      (the shaped return-to-go)
                       A_it = (R_ik - mean_gk R) / (std_gk R + 1e-4)     over the group's rows with a turn k
                                                                        (an estimator; scale: none: no division)

Rows with no recorded value are not shaped (``G = 0``); rows whose outcome is NaN get 0. Environment tokens get 0.

With ``terminal: zero`` and ``credit: return`` the shaping of turn ``k`` is ``-Phi_ik``, a function of the state
*before* the turn: a state baseline, so the expected policy gradient is unchanged (the invariance) and only its
variance moves. ``terminal: last`` makes the return the progress still to come (``Phi_end - Phi_k`` at
``gamma = 1``): it rewards progress and so changes the objective, as a dense progress reward is meant to.

Source: the abstract of "Tev: Scaling Long-Horizon Agentic Environments with Dense Progress Rewards"
(/work/shared/papers/004: "via progress-potential reward shaping (PPRS), we convert progress into a dense per-step
reward") and Ng et al. 1999 for the shaping form and the terminal rule **[abstract-inferred]** (Tev's potential,
discount and advantage are not in the abstract). Chosen here: the identity potential with a direction, the
progress 0 before the first turn, ``gamma = 1``, Ng's terminal 0, the return-to-go added to the run's outcome
advantage with ``coef = 1`` (``advantage: index`` normalises the shaped returns per turn index instead).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from trl_credit import Plugin, carry_forward, discounted_returns, hookimpl

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch

__all__ = ["ProgressPotential", "index_normalise", "potentials", "shaping_rewards"]


def potentials(phi: torch.Tensor, count: torch.Tensor, initial: float | str = 0.0, terminal: str = "zero"
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Phi (N, K + 1), shaped (N,))`` from the potentials ``phi`` of the records and ``initial`` = ``Phi_0`` (a
    potential, or ``"first"``): ``Phi[:, k]`` the potential before turn ``k`` (column 0: ``Phi_0``;
    NaN entries of ``phi`` ``(N, K)`` carry the last one), ``Phi[i, K_i]`` the terminal potential and
    ``Phi[i, k > K_i] = 0``; ``shaped`` marks rows with at least one recorded value."""
    import torch

    n, k = phi.shape
    position = torch.arange(k + 1, device=phi.device).unsqueeze(0)
    count = count.to(phi.device).unsqueeze(1)
    recorded = ~torch.isnan(phi) & (position[:, :k] < count)
    phi = torch.where(recorded, phi, math.nan)
    if initial == "first" and k:
        start = phi.gather(1, recorded.float().argmax(dim=1, keepdim=True)).squeeze(1)
    else:
        start = torch.full((n,), 0.0 if initial == "first" else float(initial), device=phi.device)
    carried = carry_forward(torch.cat([start.unsqueeze(1), phi], dim=1)).nan_to_num(0.0)  # a row without a record: NaN start under "first" -> 0
    if terminal == "zero":
        carried = torch.where(position == count, 0.0, carried)
    return torch.where(position <= count, carried, 0.0), recorded.any(dim=1)


def shaping_rewards(phi: torch.Tensor, count: torch.Tensor, gamma: float) -> torch.Tensor:
    """``F_ik = gamma * Phi_i,k+1 - Phi_ik`` for ``k < K_i``, 0 past a row's turns (``phi`` from `potentials`)."""
    import torch

    k = phi.shape[1] - 1
    inside = torch.arange(k, device=phi.device).unsqueeze(0) < count.to(phi.device).unsqueeze(1)
    return torch.where(inside, gamma * phi[:, 1:] - phi[:, :-1], 0.0)


def index_normalise(returns: torch.Tensor, valid: torch.Tensor, num_generations: int, scale: str = "std"
                    ) -> torch.Tensor:
    """``(R - mean) / (std + 1e-4)`` over the valid rows of each group at each turn index (unbiased std, 0 for a
    single row, as TRL's GRPO); ``scale="none"``: ``R - mean``; 0 where not valid."""
    import torch

    n, k = returns.shape
    r = torch.where(valid, returns, 0.0).reshape(-1, num_generations, k)
    m = valid.reshape(-1, num_generations, k).to(returns.dtype)
    count = m.sum(1, keepdim=True)
    centred = (r - r.sum(1, keepdim=True) / count.clamp(min=1.0)) * m
    if scale == "std":
        std = ((centred**2).sum(1, keepdim=True) / (count - 1).clamp(min=1.0)).sqrt()
        centred = centred / (std + 1e-4)
    return centred.reshape(n, k)


class ProgressPotential(Plugin):
    """Potential-based shaping from per-turn progress: F_k = gamma Phi(s_k+1) - Phi(s_k), Phi after the end 0."""

    name = "progress_potential"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        column: str = Field("turn_progress", description="rollout column with one progress value (or None) per "
                            "model turn, read with batch.turn_values (e.g. guess_distance)")
        direction: Literal["higher", "lower"] = Field("higher", description="which way progress is better: "
                                                      "higher, or lower (a distance: Phi = -value)")
        initial: Union[float, Literal["first"]] = Field(0.0, description="the progress before the first turn, in "
                                                        "the column's units (Phi_0 = Phi(initial)), or 'first': the "
                                                        "row's first record")
        terminal: Literal["zero", "last"] = Field("zero", description="potential after the last turn: 0 (Ng's "
                                                  "rule, policy-invariant) or that of the last recorded state")
        gamma: float = Field(1.0, ge=0.0, le=1.0, description="discount of the shaping and of the returns")
        credit: Literal["return", "reward"] = Field("return", description="a turn's shaping credit: the "
                                                    "discounted return-to-go of F (return) or its own F (reward)")
        advantage: Literal["add", "index"] = Field("add", description="add coef * credit to the run's outcome "
                                                   "advantage (add, a transform), or normalise the shaped "
                                                   "return-to-go in the group per turn index (index, an estimator)")
        coef: float = Field(1.0, ge=0.0, description="weight of the shaping (in units of the column per unit of "
                            "outcome advantage, or of reward under advantage: index)")
        scale: Literal["std", "none"] = Field("std", description="advantage: index: divide by the std of the "
                                              "group's returns at the turn index (std) or not (none)")
        reward: str | None = Field(None, description="advantage: index: outcome reward column; null: the total "
                                   "reward")

        @field_validator("initial")
        @classmethod
        def _finite(cls, value):
            if value != "first" and not math.isfinite(value):
                raise ValueError("must be a finite number or 'first'; set initial: 0.0 or initial: first")
            return value

        @field_validator("column")
        @classmethod
        def _named(cls, value):
            if not value.strip():
                raise ValueError("must name the rollout column of per-turn progress, e.g. column: guess_distance")
            return value

    def required_turn_values(self) -> list[str]:
        """The per-turn progress column; the host refuses a run or batch without it."""
        return [self.config.column]

    def required_rewards(self):
        return [self.config.reward] if self.config.reward and self.config.advantage == "index" else []

    def disabled_hooks(self):
        return ("compute_advantages",) if self.config.advantage == "add" else ("transform_advantages",)

    def turn_credit(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(G (N, K), F (N, K), shaped (N,))`` on ``batch.device``."""
        import torch

        cfg = self.config
        sign = 1.0 if cfg.direction == "higher" else -1.0
        count = batch.turns().count.to(batch.device)
        initial = cfg.initial if cfg.initial == "first" else sign * cfg.initial  # Phi_0 = Phi(initial)
        phi, shaped = potentials(sign * batch.turn_values(cfg.column), count, initial, cfg.terminal)
        f = shaping_rewards(phi, count, cfg.gamma)
        g = discounted_returns(f, cfg.gamma) if cfg.credit == "return" else f
        if cfg.initial == "first":  # the turns up to a row's first record are not shaped (see the formula)
            k = f.shape[1]
            column = torch.arange(k, device=f.device).unsqueeze(0)
            recorded = ~torch.isnan(batch.turn_values(cfg.column).to(f.device)) & (column < count.unsqueeze(1))
            first = recorded.float().argmax(dim=1, keepdim=True)  # a row without a record is unshaped anyway
            g = torch.where(column <= first, 0.0, g)
        self.log_metric(batch, "valued_rows", float(shaped.float().mean()) if len(shaped) else 0.0)
        if shaped.any():
            turns = count[shaped]
            end = phi[shaped].gather(1, turns.unsqueeze(1)).squeeze(1)
            # the telescoped total sum_k gamma^k F_k = gamma^K Phi_end - Phi_0 (-Phi_0 for every row: terminal zero)
            self.log_metric(batch, "potential_gain", float((cfg.gamma ** turns.to(phi.dtype) * end
                                                            - phi[shaped, 0]).mean()))
            inside = torch.arange(f.shape[1], device=f.device).unsqueeze(0) < turns.unsqueeze(1)
            if inside.any():
                self.log_metric(batch, "shaping_reward", float(f[shaped][inside].mean()))
        return g * shaped.unsqueeze(1), f, shaped

    def _metrics(self, batch: RolloutBatch, credit: torch.Tensor, count: torch.Tensor) -> None:
        import torch

        inside = torch.arange(credit.shape[1], device=credit.device).unsqueeze(0) < count.unsqueeze(1)
        if inside.any():
            self.log_metric(batch, "credited_turns", float((credit != 0)[inside].float().mean()))
            self.log_metric(batch, "credit_abs", float(credit[inside].abs().mean()))

    @hookimpl
    def transform_advantages(self, batch: RolloutBatch, advantages: torch.Tensor) -> torch.Tensor:
        import torch

        g, _, _ = self.turn_credit(batch)
        device = advantages.device
        valid = torch.isfinite(batch.total_reward().to(device)).unsqueeze(1)
        credit = self.config.coef * g.to(device) * valid
        turns = batch.turns()
        self._metrics(batch, credit, turns.count.to(device))
        tokens = turns.broadcast(credit).to(device)
        base = advantages if advantages.dim() == 2 else advantages.unsqueeze(1).expand_as(tokens)
        return (base + tokens).float()

    @hookimpl
    def compute_advantages(self, batch: RolloutBatch) -> torch.Tensor:
        import torch

        cfg = self.config
        turns = batch.turns()
        device = batch.device
        count = turns.count.to(device)
        k = turns.max_turns
        g, _, _ = self.turn_credit(batch)
        outcome = (batch.reward(cfg.reward) if cfg.reward else batch.total_reward()).to(device)
        position = torch.arange(k, device=device).unsqueeze(0)
        to_end = (count.unsqueeze(1) - 1 - position).clamp(min=0).to(g.dtype)
        returns = cfg.coef * g + cfg.gamma**to_end * outcome.nan_to_num(0.0).unsqueeze(1)
        valid = (position < count.unsqueeze(1)) & torch.isfinite(outcome).unsqueeze(1)
        z = index_normalise(returns, valid, batch.num_generations, cfg.scale)
        self._metrics(batch, cfg.coef * g * valid, count)
        return turns.broadcast(z).to(device).float()
