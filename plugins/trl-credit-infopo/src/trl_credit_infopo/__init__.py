r"""InfoPO: information-gain turn rewards from a masked-feedback counterfactual, variance-gated with the outcome.

Method. A multi-turn agent acts, the environment (a user, a tool) answers, the agent acts again. A turn is
worth crediting when the feedback it drew measurably changes what the agent does next: the policy scores its
own next action twice, once after the real feedback and once with the feedback masked, and the log-ratio is
the turn's information gain (its expectation over actions is a conditional mutual information). The gains,
z-scored within the group, are fused with GRPO's outcome advantage through a gate that turns information up
when the group's outcomes are tied (no outcome signal) and down when they are clearly spread.

Formula (completion ``i`` of group ``g`` with ``c_i`` model turns, numbered from 0 here; ``s_ik`` the token where
turn ``k`` begins, ``e_ik`` the token just past it, so ``o_ik = y_i[e_ik : s_i,k+1]`` is the environment's reply
to turn ``k``; ``a_i,k+1`` the text of turn ``k + 1``)::

    F_ik  = log pi(a_i,k+1 | prompt, y_i[:s_i,k+1])                 factual: the feedback seen
    M_ik  = log pi(a_i,k+1 | prompt, y_i[:e_ik], h + mask_text + t) masked: the feedback replaced; h, t: the
                                   token runs every reply of the batch begins and ends with (the template's wrap,
                                   `reply_wrap`; keep_wrap false: none)
    IG_ik = F_ik - M_ik            k = 0 .. c_i - 2   (reduce "sum" over a_i,k+1's tokens, or "mean")
                                   the last turn has no next action: no IG (0 credit)
    A_i   = GRPO's outcome advantage of the total reward (the run's scale_rewards / aggregation)
    Z_ik  = (IG_ik - mu_g) / (sigma_g + 1e-6)   over every IG turn of the group pooled (population sigma;
                                                a constant pool gives 0; turns without IG get 0)
    w_g   = exp(-std_g(R) / gate_tau)           std_g(R): population std of the group's outcomes
                                                (gate "none": w_g = 1)
    A_it  = A_i + info_coef * w_g * Z_ik        for every model token t of turn k; environment tokens 0

Both log-probs come from one scorer (`RolloutBatch.prefix_logps`: the sampled ids of the prefix, never
re-tokenised, then ``mask_text`` as unscored context, then the action's decoded text tokenised on its own),
so the factual and masked scores read exactly the same action tokens. Single-turn rows (and batches without
a tool mask) have no IG turn: their advantage is GRPO's, and a batch without any multi-turn row returns GRPO's
``(N,)`` advantages bit for bit.

Source: Kong et al., "InfoPO: Information-Driven Policy Optimization for User-Centric Agents", arXiv 2603.00656
(2026), [abstract-inferred]: the abstract gives the information-gain reward "that credits turns whose feedback
measurably changes the agent's subsequent action distribution compared to a masked-feedback counterfactual" and
an "adaptive variance-gated fusion" with the task outcome; secondary summaries add that the reward is the
log-likelihood ratio of the next action with vs without the feedback, one extra forward pass per turn and no
extra environment calls. The official code (github.com/kfq20/InfoPO) was not available. Chosen here: the mask
placeholder ``"[feedback hidden]"`` inside the wrap all replies share (``keep_wrap``: a chat template's role
header and the next assistant header stay, only the words of the feedback go; ``""`` drops them), the sum over the action's tokens, pooled group
z-scoring of the gains, the gate ``exp(-std / 0.25)`` (a binary group split in half: 0.135) and its additive
fusion with ``info_coef = 1``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from trl_credit import Plugin, group_normalise, grpo_advantages, hookimpl

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch

__all__ = ["InfoPO", "MASK_TEXT", "fuse", "gate", "outcome_spread", "reply_wrap"]

#: the default placeholder that stands for an environment reply in the masked counterfactual
MASK_TEXT = "[feedback hidden]"


def reply_wrap(replies: list[list[int]]) -> tuple[list[int], list[int]]:
    """``(head, tail)``: the longest token runs that every reply begins and ends with (a chat template's wrap, e.g.
    ``"\\n<|im_start|>user\\n"`` ... ``"<|im_end|>\\n<|im_start|>assistant\\n"``). What all replies share
    carries no feedback; fewer than two distinct replies give no wrap (nothing to tell it from the content)."""
    import torch

    if len({tuple(r) for r in replies}) < 2:
        return [], []
    shortest = min(len(r) for r in replies)
    if shortest == 0:
        return [], []
    heads = torch.tensor([r[:shortest] for r in replies])
    tails = torch.tensor([r[len(r) - shortest:] for r in replies])
    head = int(torch.cumprod((heads == heads[0]).all(0).long(), 0).sum())
    tail = int(torch.cumprod((tails == tails[0]).all(0).long().flip(0), 0).sum())
    tail = min(tail, shortest - head)  # a reply that is all wrap: the head keeps it
    first = replies[0]
    return first[:head], first[len(first) - tail:] if tail else []


def outcome_spread(total: torch.Tensor, num_generations: int) -> torch.Tensor:
    """``(N // G,)`` population std of each group's outcomes (NaN outcomes left out; 0 for a group without any)."""
    import torch

    r = total.reshape(-1, num_generations)
    ok = ~torch.isnan(r)
    count = ok.sum(1).clamp(min=1)
    mean = torch.where(ok, r, 0.0).sum(1) / count
    return ((torch.where(ok, r - mean.unsqueeze(1), 0.0) ** 2).sum(1) / count).sqrt()


def gate(sigma: torch.Tensor, tau: float, kind: str = "exp") -> torch.Tensor:
    """``w = exp(-sigma / tau)`` (``kind="exp"``): 1 for a tied group, small when outcomes are spread; ``"none"``: 1."""
    import torch

    return torch.exp(-sigma / tau) if kind == "exp" else torch.ones_like(sigma)


def fuse(outcome: torch.Tensor, z: torch.Tensor, w: torch.Tensor, coef: float) -> torch.Tensor:
    """``(N, K)`` per-turn advantages ``A_i + coef * w_i * Z_ik`` (``outcome`` and ``w`` ``(N,)``, ``z`` ``(N, K)``)."""
    return outcome.unsqueeze(1) + coef * w.unsqueeze(1) * z


class InfoPO(Plugin):
    """InfoPO's estimator: masked-feedback information gain of each turn's next action, gated by outcome spread."""

    name = "infopo"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        mask_text: str = Field(MASK_TEXT, description="text that replaces a turn's environment reply in the masked "
                               "counterfactual (unscored context); empty: the reply is dropped")
        keep_wrap: bool = Field(True, description="keep the tokens every reply of the batch begins and ends with "
                                "(the chat template's wrap, the next assistant header) around mask_text, so only the "
                                "feedback itself is masked; false: mask_text replaces the whole reply")
        reduce: Literal["sum", "mean"] = Field("sum", description="IG over the next action's tokens: the log-ratio "
                                               "of the whole action (sum) or its per-token mean (mean)")
        info_coef: float = Field(1.0, ge=0.0, description="weight of the z-scored information gain added to the "
                                 "outcome advantage")
        gate: Literal["exp", "none"] = Field("exp", description="variance gate per group: exp(-std of outcomes / "
                                             "gate_tau) (exp) or 1 (none)")
        gate_tau: float = Field(0.25, gt=0.0, description="temperature of the gate: a group with outcome std "
                                "sigma weighs information by exp(-sigma / gate_tau)")

    def information_gains(self, batch: RolloutBatch) -> torch.Tensor:
        """``(N, K)`` ``IG_ik = F_ik - M_ik``: the log-ratio of turn ``k + 1``'s action with turn ``k``'s reply seen
        vs masked; NaN for the last turn of each row, past its turns and for rows without an outcome (not scored)."""
        import torch

        cfg = self.config
        turns = batch.turns()
        n, k = turns.lengths.shape
        gains = torch.full((n, k), math.nan, device=batch.device)
        if k < 2:
            return gains
        starts, lengths, count = turns.starts().cpu(), turns.lengths.cpu(), turns.count.cpu()
        seen_end = starts + lengths  # just past each model turn: where its reply begins
        ids = batch.completion_ids.cpu()
        scorable = ~torch.isnan(batch.total_reward()).cpu()
        context = self.masked_context(batch, ids, seen_end, starts, count)
        for j in range(k - 1):  # turn j's feedback, turn j + 1's action; bounded by the batch's most turns
            has = (count > j + 1) & scorable
            rows = has.nonzero().flatten().tolist()
            if not rows:
                continue
            spans = [ids[i, starts[i, j + 1]: starts[i, j + 1] + lengths[i, j + 1]].tolist() for i in rows]
            texts = [""] * n
            decoded = batch.tokenizer.batch_decode(spans, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            for i, text in zip(rows, decoded):
                texts[i] = text
            factual = batch.prefix_logps(torch.where(has, starts[:, j + 1], -1).unsqueeze(1), texts,
                                         reduce=cfg.reduce)
            masked = batch.prefix_logps(torch.where(has, seen_end[:, j], -1).unsqueeze(1), texts,
                                        reduce=cfg.reduce, context=context)
            gains[:, j] = (factual - masked)[:, 0].to(gains.device)
        return gains

    def masked_context(self, batch: RolloutBatch, ids: torch.Tensor, seen_end: torch.Tensor, starts: torch.Tensor,
                       count: torch.Tensor) -> str:
        """What stands in for a reply: ``mask_text``, inside the wrap all of the batch's replies share (keep_wrap)."""
        cfg = self.config
        if not cfg.keep_wrap:
            return cfg.mask_text
        replies = [ids[i, seen_end[i, j]: starts[i, j + 1]].tolist()  # a loop over replies, bounded by the batch
                   for i in range(ids.shape[0]) for j in range(int(count[i]) - 1)]
        head, tail = reply_wrap(replies)
        decode = lambda part: batch.tokenizer.decode(part, skip_special_tokens=False,  # noqa: E731
                                                     clean_up_tokenization_spaces=False) if part else ""
        return decode(head) + cfg.mask_text + decode(tail)

    @hookimpl
    def compute_advantages(self, batch: RolloutBatch) -> torch.Tensor:
        import torch

        cfg = self.config
        g = batch.num_generations
        outcome = grpo_advantages(batch.rewards, batch.reward_weights, g, getattr(batch.args, "scale_rewards", "group"),
                                  getattr(batch.args, "multi_objective_aggregation", "sum_then_normalize"))
        total = batch.total_reward()
        w_group = gate(outcome_spread(total, g), cfg.gate_tau, cfg.gate)
        answered = (~torch.isnan(total)).reshape(-1, g).any(1)
        if answered.any():
            self.log_metric(batch, "gate", float(w_group[answered].mean()))
        turns = batch.turns()
        if turns.max_turns < 2:  # no row has a next action: GRPO exactly
            return outcome
        gains = self.information_gains(batch)
        pool = torch.isfinite(gains)
        z = group_normalise(gains, pool, g)
        per_turn = fuse(outcome.to(z), z, w_group.repeat_interleave(g).to(z), cfg.info_coef)
        if pool.any():
            self.log_metric(batch, "information_gain", float(gains[pool].mean()))
            self.log_metric(batch, "positive_fraction", float((gains[pool] > 0).float().mean()))
        return turns.broadcast(per_turn.to(batch.device)).float()
