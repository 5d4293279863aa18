"""Turn baseline: per-turn advantages of multi-turn rollouts whose baseline stays unbiased when the policy
itself decides when to stop.

Method. Completion ``i`` of a group of ``G`` is a trajectory of ``c_i`` model turns (`RolloutBatch.turns`); the
tokens of turn ``k`` are the action taken in the history ``h_ik`` (prompt, earlier turns, the environment's
replies), and the last turn's tokens also hold the decision to stop. Each turn is credited with its return-to-go
minus a baseline taken from the *other* trajectories of the group only::

    G_ik   = sum_{j=k}^{c_i-1} gamma^(j-k) u_ij + gamma^(c_i-1-k) R_i     u: per-turn rewards (optional), R: outcome
    F_j    = G_j,c_j-1  (F_j = R_j when c_j = 0)                          the value of "having stopped"
    X_jk   = G_jk if k < c_j else F_j                                     what j holds at turn k
    reached (default):  b_ik = mean { G_jk : j != i, k < c_j }            the others that reached turn k;
                        when none did: b_ik = mean { X_jk : j != i }      (they all stopped earlier: their F_j)
    extended:           b_ik = mean { X_jk : j != i }
    group:              b_ik = mean { X_j0 : j != i }                     one baseline for every turn
    A_ik   = (G_ik - b_ik) / s,   s = 1 (scale: none) or one std of all the batch's A_ik + epsilon (scale: batch)
    A_it   = A_i,k(t)                                                     `Turns.broadcast`: tokens of turn k

The set "reached turn k" holds the others with ``k < c_j``: those that stop at turn ``k`` too, since stopping
is part of turn ``k``'s action; those that stopped earlier enter (fallback, ``extended``) with the value of
having stopped, their final return.

Why it is unbiased. The G trajectories of a prompt are independent draws, and every ``b_ik`` is a function of
the others alone (who reached turn ``k`` is decided by the others' own earlier turns), so it is independent of
trajectory ``i``'s action at turn ``k`` given ``h_ik``:
``E[grad log pi(a_ik | h_ik) b_ik] = E[b_ik] E[E[grad log pi(a_ik | h_ik) | h_ik]] = 0``. Hence
``E[sum_k grad log pi(a_ik | h_ik) A_ik] = E[sum_k grad log pi(a_ik | h_ik) G_ik]``, the policy gradient
(``gamma = 1``: exactly ``grad E[R + sum u]``). The naive survivor-normalised advantage
``(G_ik - mean_{j: k < c_j} G_jk) / std`` includes ``G_ik`` itself in a mean over a set whose size depends
on the others' stopping: the ``1/n_k`` self-share shrinks turn ``k``'s term by a factor that differs per turn
(a lone survivor gets 0), so its expectation is not the policy gradient (the tests compute both exactly).
``scale: batch`` divides every advantage of the batch by one positive number (their std): the direction of
the update is kept, up to the O(1/N) dependence of that number on each row (as TRL's ``scale_rewards: batch``).
The argument takes the loss as a sum of token terms with a divisor independent of the trajectory: exact with
TRL's ``loss_type: dr_grpo`` (a constant), O(1/N) with ``dapo`` / ``bnpo`` (the batch's token count); ``grpo``'s
per-row ``1 / |o_i|`` depends on i's later turns and biases every baseline (GRPO's too, Dr. GRPO's point).
A leave-one-out std per turn would keep each term unbiased but weight turns unequally and explode where the
others agree (binary rewards), so it is not offered.

Source: no paper; designed here for multi-turn agents that choose when to stop. The leave-one-out baseline is
RLOO's (Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!") [paper-recalled], applied per
turn; the argument above is the standard baseline lemma. Rows whose outcome is NaN take part in no baseline
and get 0; turns with no other trajectory to compare with (``G = 1``, or every other row NaN) get 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from trl_credit import Plugin, discounted_returns, hookimpl

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch

__all__ = ["TurnBaseline", "loo_mean", "turn_advantages", "turn_returns"]


def turn_returns(outcome: torch.Tensor, rewards: torch.Tensor, count: torch.Tensor, gamma: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(G (N, K), valid (N, K), final (N,))``: return-to-go of every turn, which turns exist (and have a
    finite outcome), and each trajectory's final return ``F`` (NaN where the outcome is NaN).

    ``outcome`` ``(N,)``; ``rewards`` ``(N, K)`` per-turn rewards (0 where none); ``count`` ``(N,)`` turns.
    """
    import torch

    n, k = rewards.shape
    position = torch.arange(k, device=rewards.device).unsqueeze(0)
    finite = torch.isfinite(outcome)
    exists = position < count.unsqueeze(1)
    last = position == (count - 1).unsqueeze(1)
    r = torch.where(exists, rewards, 0.0) + torch.where(last, outcome.nan_to_num(0.0).unsqueeze(1), 0.0)
    returns = discounted_returns(r, gamma) if k else r
    valid = exists & finite.unsqueeze(1)
    last_return = (returns * last).sum(1) if k else torch.zeros(n, dtype=rewards.dtype, device=rewards.device)
    final = torch.where(count > 0, last_return, outcome.to(rewards.dtype))
    final = torch.where(finite, final, torch.nan)
    return torch.where(valid, returns, 0.0), valid, final


def loo_mean(x: torch.Tensor, mask: torch.Tensor, num_generations: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Leave-one-out ``(count, mean)`` of ``x`` ``(N, K)`` over the *other* masked rows of each row's group,
    per column (mean 0 where the count is 0)."""
    m = mask.to(x.dtype)
    xm = x * m
    shape = (x.shape[0] // num_generations, num_generations, x.shape[1])
    total = xm.reshape(shape).sum(1, keepdim=True).expand(shape).reshape(x.shape)
    members = m.reshape(shape).sum(1, keepdim=True).expand(shape).reshape(x.shape)
    count = members - m
    return count, ((total - xm) / count.clamp(min=1)).masked_fill(count == 0, 0.0)


def turn_advantages(returns: torch.Tensor, valid: torch.Tensor, final: torch.Tensor, num_generations: int,
                    baseline: str = "reached", scale: str = "none", epsilon: float = 1e-4
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A (N, K), source (N, K) long)``: the advantages above and where each baseline came from (0: the
    others that reached the turn, 1: the fallback / extended set, 2: no other trajectory, A = 0; -1: no turn)."""
    import torch

    stopped = torch.isfinite(final).unsqueeze(1).expand_as(returns)
    extended = torch.where(valid, returns, final.nan_to_num(0.0).unsqueeze(1))  # X_jk
    if baseline == "group" and returns.shape[1]:
        extended = extended[:, :1].expand_as(returns)  # X_j0 for every turn
    n_ext, b_ext = loo_mean(extended, stopped, num_generations)
    if baseline == "reached":
        n_on, b_on = loo_mean(returns, valid, num_generations)
        on = n_on > 0
        b, n, source = torch.where(on, b_on, b_ext), torch.where(on, n_on, n_ext), torch.where(on, 0, 1)
    elif baseline in ("extended", "group"):
        b, n, source = b_ext, n_ext, torch.ones_like(returns, dtype=torch.long)
    else:
        raise ValueError(f"turn_baseline: baseline must be reached, extended or group, got {baseline!r}")
    scored = valid & (n > 0)
    advantage = torch.where(scored, returns - b, 0.0)
    if scale == "batch":
        if int(scored.sum()) >= 2:
            advantage = advantage / (advantage[scored].std() + epsilon)
    elif scale != "none":
        raise ValueError(f"turn_baseline: scale must be none or batch, got {scale!r}")
    source = torch.where(n > 0, source, 2).masked_fill(~valid, -1)
    return advantage, source


class TurnBaseline(Plugin):
    """Per-turn advantages with a leave-one-out baseline, unbiased when the policy decides when to stop.

    ``A_ik = G_ik - b_ik``, ``b_ik`` the mean return of the group's other trajectories that reached turn ``k`` (their
    final returns when none did). See the module docstring for the formula and the argument."""

    name = "turn_baseline"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        baseline: Literal["reached", "extended", "group"] = Field(
            "reached", description="others that reached the turn (fallback: their final returns), all others "
            "with stopped ones at their final return (extended), or all others' whole return for every turn (group)")
        gamma: float = Field(1.0, ge=0.0, le=1.0, description="turn-level discount of the return-to-go")
        reward: str | None = Field(None, description="outcome reward column; null: the total (weighted) reward")
        turn_rewards: str | None = Field(None, min_length=1, description="per-turn reward column read with "
                                         "batch.turn_values (one value per model turn, None/NaN: 0); null: none")
        turn_coef: float = Field(1.0, description="weight of the per-turn rewards (negative for a cost such as "
                                 "guess_distance)")
        scale: Literal["none", "batch"] = Field("none", description="divide by nothing (unbiased) or by one "
                                                "std of all the batch's turn advantages (a batch-wide factor)")
        epsilon: float = Field(1e-4, gt=0.0, description="added to the std under scale: batch (TRL's 1e-4)")

    def required_rewards(self):
        return [self.config.reward] if self.config.reward else []

    def required_turn_values(self) -> list[str]:
        """The per-turn reward column when set; the host refuses a run or batch without it."""
        return [self.config.turn_rewards] if self.config.turn_rewards else []

    @hookimpl
    def compute_advantages(self, batch: RolloutBatch) -> torch.Tensor:
        import torch

        cfg = self.config
        turns = batch.turns()
        outcome = (batch.reward(cfg.reward) if cfg.reward else batch.total_reward()).to(torch.float64)
        count = turns.count.to(outcome.device)
        if cfg.turn_rewards:
            rewards = cfg.turn_coef * batch.turn_values(cfg.turn_rewards).to(torch.float64).nan_to_num(0.0)
        else:
            rewards = torch.zeros(batch.num_completions, turns.max_turns, dtype=torch.float64, device=outcome.device)
        returns, valid, final = turn_returns(outcome, rewards.to(outcome.device), count, cfg.gamma)
        advantage, source = turn_advantages(returns, valid, final, batch.num_generations, cfg.baseline, cfg.scale,
                                            cfg.epsilon)
        scored = source >= 0
        if bool(scored.any()):
            self.log_metric(batch, "fallback", float((source[scored] == 1).double().mean()))
            self.log_metric(batch, "lone", float((source[scored] == 2).double().mean()))
            self.log_metric(batch, "advantage_abs", float(advantage[scored].abs().mean()))
        self.log_metric(batch, "turns", float(count.double().mean()))
        return turns.broadcast(advantage.float().to(turns.index.device))
