"""IGPO: information-gain policy optimisation, on the steps of single completions.

Method. Each turn of a trajectory is rewarded by how much it raised the policy's own belief in the gold
answer: the gold answer is teacher-forced after the prefix that ends each turn, and the turn's reward is the
gain in its (geometric-mean) token probability. The final turn gets the task's outcome. All turn rewards of a
group are normalised together and accumulated backwards, so an early turn is credited with what it enabled.
A "turn" is a step of a single completion (segments between delimiters, `trl_credit.step_ends`) or, with
``segments: turns``, a model turn of TRL's multi-turn rollouts (`RolloutBatch.turns`): the prefix before turn
``k`` then ends where turn ``k`` begins, after the environment's reply to turn ``k - 1``.

Formula (completion ``i`` with ``c_i`` turns, ``e_ik`` the token position just past turn ``k``)::

    P_ik = exp(mean_{t in gold tokens} log pi(gold_t | prompt, y_i[:e_ik], cue, gold_<t))   k = 0 .. c_i - 1
                                                                       (e_i0 = 0: before the first turn)
    r_ik = P_ik - P_i,k-1                        k = 1 .. c_i - 1   (information gain of turn k)
    r_ic = o_i                                   the last turn: the outcome
    mode "joint":    z = (r - mu_g) / (sigma_g + 1e-6) over every turn reward of the group,
                     sigma_g = sqrt(mean (r - mu_g)^2 + 1e-8)           (population)
    mode "separate": the same, over the group's IG rewards and its outcomes apart
    A_ik = z_ik + gamma * A_i,k+1                (accumulated backwards; gamma = 1)
    A_it = A_ik for every token t of turn k

``cue`` is the text between the prefix and the gold answer (IGPO's pseudo-response up to the answer:
``"\\nNow there's enough information to answer\\n</think>\\n<answer>\\n"``), teacher-forced as unscored context
(`RolloutBatch.prefix_logps` ``context=``); only the gold answer's own tokens are averaged.

Source: methods.md 2.26: pseudo-response and ``gt_probs`` from ``GuoqingWang1/IGPO@bff163b7``
(``scrl/llm_agent/generation.py``), joint normalisation and turn-level accumulation from the updated codebase
``debajoycs98/IGPO@86601963`` (``verl/trainer/ppo/core_algos.py::compute_grpo_outcome_advantage``).

Established: geometric-mean gold probability, IG = P_k - P_{k-1}, the outcome on the last turn, joint
normalisation with population sigma, backward accumulation with gamma. Chosen: turn boundaries are explicit
indices (the code detects turns by non-zero rewards, so an IG of exactly 0 merges its turn into the next;
here it stays a turn of its own); a completion with no step (empty) has one turn holding only its outcome; a
NaN outcome is left out of the pool and its turn gets 0; ``max_steps`` keeps the last ``max_steps`` steps of a
long completion (earlier steps merge into the first kept one), bounding the scored prefixes per completion.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from trl_credit import Plugin, Regex, discounted_returns, has_answer, hookimpl, step_ends, token_steps

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch

__all__ = ["IGPO", "accumulate", "information_gain", "normalise"]

IGPO_CUE = "\nNow there's enough information to answer\n</think>\n<answer>\n"


def information_gain(p: torch.Tensor, turns: torch.Tensor, outcome: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn rewards ``(N, K)`` and their validity: ``P_k - P_{k-1}`` for ``k < c_i``, the outcome at ``c_i - 1``.

    ``p`` ``(N, K)``: ``P_i0 .. P_i,K-1`` (entries past ``c_i - 1`` unused); ``turns`` ``(N,)`` = ``c_i >= 1``.
    """
    import torch

    n, k = p.shape
    position = torch.arange(k, device=p.device).unsqueeze(0)
    gain = torch.cat([p[:, 1:] - p[:, :-1], torch.zeros(n, 1, device=p.device)], dim=1)  # column j: P_j+1 - P_j
    # turn j (0-based) earns P_j+1 - P_j for j < c - 1; the last turn j = c - 1 earns the outcome
    last = position == (turns - 1).unsqueeze(1)
    rewards = torch.where(last, outcome.unsqueeze(1).to(p.dtype), gain)
    valid = (position < turns.unsqueeze(1)) & ~(last & torch.isnan(outcome).unsqueeze(1))
    return torch.where(valid, rewards, 0.0), valid


def normalise(rewards: torch.Tensor, valid: torch.Tensor, num_generations: int) -> torch.Tensor:
    """``(r - mu_g) / (sigma_g + 1e-6)`` over the valid turn rewards of each group (population sigma), 0 elsewhere."""
    n, k = rewards.shape
    r = rewards.reshape(-1, num_generations * k)
    m = valid.reshape(-1, num_generations * k).to(rewards.dtype)
    count = m.sum(1, keepdim=True).clamp(min=1)
    mean = (r * m).sum(1, keepdim=True) / count
    sigma = ((((r - mean) ** 2) * m).sum(1, keepdim=True) / count + 1e-8).sqrt()
    return (((r - mean) / (sigma + 1e-6)) * m).reshape(n, k)


def accumulate(z: torch.Tensor, gamma: float) -> torch.Tensor:
    """``A_k = z_k + gamma * A_{k+1}`` along the last dimension (entries past a row's turns are 0)."""
    return discounted_returns(z, gamma)


class IGPO(Plugin):
    """IGPO's estimator on step-segmented completions: information-gain step rewards, jointly normalised."""

    name = "igpo"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        column: str = Field("answer", description="dataset column with the gold answer")
        cue: str = Field(IGPO_CUE, description="text teacher-forced between a prefix and the gold answer "
                         "(IGPO's pseudo-response up to the answer); only the gold tokens are scored")
        segments: Literal["steps", "turns"] = Field("steps", description="what a turn is: a step of the text "
                                                    "(pattern) or a model turn of a multi-turn rollout (TRL's tool mask)")
        pattern: Regex = Field(r"\n+", description="regex separating steps (turns) in a completion")
        max_steps: int = Field(8, ge=1, description="at most this many turns per completion (the last ones; "
                               "earlier steps merge into the first kept): bounds the scored prefixes")
        mode: Literal["joint", "separate"] = Field("joint", description="normalise IG rewards and outcomes "
                                                   "together (joint) or apart (separate)")
        gamma: float = Field(1.0, ge=0.0, le=1.0, description="turn-level discount of the backward accumulation")
        model: Literal["policy", "reference"] = Field("policy", description="model whose gold probability is read")
        reward: str | None = Field(None, description="outcome reward column; null: the total reward")

    def required_columns(self):
        return [self.config.column]

    def needs_reference(self) -> bool:
        return self.config.model == "reference"

    def required_rewards(self):
        return [self.config.reward] if self.config.reward else []

    def gold_probability(self, batch: RolloutBatch, ends: torch.Tensor) -> torch.Tensor:
        """``(N, K)`` P: exp of the mean log-prob of the gold tokens after each prefix and the cue (NaN where
        ``ends < 0``); the cue is context, not scored."""
        gold = [str(a) for a in batch.column(self.config.column)]
        mean = batch.prefix_logps(ends, gold, model=self.config.model, reduce="mean", context=self.config.cue)
        return mean.exp()

    def _step_segments(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Steps as turns: ``(before (N, K) prefix ends, turns (N,), turn of each token (N, T), -1: none)``."""
        import torch

        cfg = self.config
        ends = step_ends(batch, cfg.pattern, cfg.max_steps)  # (N, K') ends of the kept steps
        n = batch.num_completions
        steps = (ends >= 0).sum(1)
        turns = steps.clamp(min=1)  # an empty completion: one turn, its outcome
        k = max(int(turns.max()) if n else 1, 1)
        # prefixes before each turn: 0, then the ends of all but the last step
        before = torch.full((n, k), -1, dtype=torch.long, device=ends.device)
        before[:, 0] = 0
        if ends.shape[1] > 1:
            inner = ends[:, : k - 1]
            keep = torch.arange(inner.shape[1], device=ends.device).unsqueeze(0) < (steps - 1).unsqueeze(1)
            before[:, 1: 1 + inner.shape[1]] = torch.where(keep, inner, -1)
        index, all_steps = token_steps(batch, cfg.pattern, fill=True)
        offset = (torch.tensor([len(s) for s in all_steps], device=index.device) - cfg.max_steps).clamp(min=0)
        token_turn = torch.where(index >= 0, (index - offset.unsqueeze(1)).clamp(min=0, max=k - 1), -1)
        return before, turns, token_turn  # merged early steps -> the first kept turn

    def _turn_segments(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The model's turns of a multi-turn rollout (`RolloutBatch.turns`): the prefix before turn ``k`` holds the
        environment's reply to turn ``k - 1`` (the information it gained); the last ``max_steps`` turns are kept."""
        import torch

        info = batch.turns()
        count = info.count.clamp(min=1)
        starts = info.starts()  # (N, K)
        n = batch.num_completions
        offset = (info.count - self.config.max_steps).clamp(min=0)  # early turns merge into the first kept one
        turns = count - offset
        k = max(int(turns.max()) if n else 1, 1)
        column = torch.arange(k, device=starts.device).unsqueeze(0)
        source = (column + offset.unsqueeze(1)).clamp(max=max(starts.shape[1] - 1, 0))
        before = starts.gather(1, source) if starts.shape[1] else torch.zeros(n, k, dtype=torch.long, device=starts.device)
        before[:, 0] = 0
        before = torch.where(column < turns.unsqueeze(1), before, -1)
        token_turn = torch.where(info.index >= 0, (info.index - offset.unsqueeze(1)).clamp(min=0, max=k - 1), -1)
        return before, turns, token_turn

    @hookimpl
    def compute_advantages(self, batch: RolloutBatch) -> torch.Tensor:
        import torch

        cfg = self.config
        before, turns, token_turn = (self._turn_segments(batch) if cfg.segments == "turns"
                                     else self._step_segments(batch))
        k = before.shape[1]
        scorable = batch.scorable.to(before.device)  # no reward function scored it: not scored, no statistics, 0
        has_gold = torch.tensor([has_answer(a) for a in batch.column(cfg.column)], dtype=torch.bool, device=before.device)
        # no gold answer: no IG, the outcome stays; one turn: it earns the outcome, so no P is read
        multi = turns.to(before.device) >= 2
        before = torch.where((scorable & has_gold & multi).unsqueeze(1), before, -1)
        p = self.gold_probability(batch, before).nan_to_num(0.0)
        outcome = batch.reward(cfg.reward) if cfg.reward else batch.total_reward()
        rewards, valid = information_gain(p, turns.to(p.device), outcome.to(p.device))
        last = torch.arange(k, device=p.device).unsqueeze(0) == (turns.to(p.device) - 1).unsqueeze(1)
        valid = valid & scorable.to(p.device).unsqueeze(1) & (has_gold.to(p.device).unsqueeze(1) | last)
        g = batch.num_generations
        if cfg.mode == "joint":
            z = normalise(rewards, valid, g)
        else:
            last = torch.arange(k, device=p.device).unsqueeze(0) == (turns.to(p.device) - 1).unsqueeze(1)
            z = normalise(rewards, valid & ~last, g) + normalise(rewards, valid & last, g)
        per_turn = accumulate(z, cfg.gamma)  # (N, K)
        advantages = per_turn.to(token_turn.device).gather(1, token_turn.clamp(min=0)) * (token_turn >= 0)
        gains = rewards[valid & (torch.arange(k, device=p.device).unsqueeze(0) < (turns.to(p.device) - 1).unsqueeze(1))]
        if gains.numel():
            self.log_metric(batch, "mean_information_gain", float(gains.mean()))
        self.log_metric(batch, "turns", float(turns.float().mean()))
        return advantages.float()
