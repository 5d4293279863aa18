r"""SALT: step-level advantages from a trajectory graph of the group, derived from the outcome advantages alone.

Method. The trajectories of one prompt are merged into a graph whose nodes are their steps (model turns): two
trajectories pass through the same node when they took the same step from the same history. A step shared by
several trajectories is not to be credited with any single one's outcome: its advantage aggregates the outcome
advantages of every trajectory through it (their mean), so a shared step gets the group's verdict on what follows
it, and the steps where the trajectories part keep their own. A plug-in transform after any group-based estimator
(GRPO, RLOO, ...): no extra rollout, no extra forward pass.

Formula (group ``g``, trajectory ``i`` with model turns ``k = 0 .. c_i - 1``, ``A_i`` the incoming advantage, or
``a_ik`` the mean of incoming token advantages over turn ``k``'s tokens when they are per token)::

    e_ik      = the completion position just past turn k's own tokens (its start + its length; the
                environment's reply to it is not part of the step)
    merge "prefix":  (i, k) ~ (j, k)  iff  i, j in g,  e_ik = e_jk  and  x_i[:e_ik] = x_j[:e_jk]
                (the same token ids and the same model / environment mask: identical histories up to and
                including the turn; the graph is a prefix tree)
    merge "step":    (i, k) ~ (j, l)  iff  i, j in g,  [k = 0] = [l = 0]  and  x_i[e_i,k-1 : e_ik] = x_j[e_j,l-1 : e_jl]
                (the same step answering the same observation, e_i,-1 = 0, whatever came before, at any depth:
                states reached by different histories merge, the graph is a DAG)
    node(i, k) = the class of (i, k);  M = the member trajectories: kept by the filters, some reward not NaN
    aggregate "mean": A'_ik = mean_{(j, l) in node(i, k), j in M} a_jl          ("max", "min": the extreme)
                (a mean over visits: under "step" a trajectory that takes the node's step twice counts twice)
    A'_it = A_it + (A'_ik(t) - a_ik(t))  on the tokens of turn k   (= A'_ik when the input is per sequence)

Rows outside ``M`` keep their incoming advantages (the host zeroes dropped rows anyway). A single-turn batch
merges only identical completions, so with distinct completions it is GRPO (the incoming advantages) as is.

Source: the abstract (arXiv 2510.20022, Li et al., Findings of EACL 2026): "constructing a graph from trajectories
of the same prompt, which allows us to quantify the quality of each step and assign advantages accordingly",
"derived solely from outcome rewards", "plug-and-play ... with existing group-based RL algorithms", "negligible
computational overhead"; no official code was found. Provenance: [abstract-inferred].

Established (abstract): a graph over the group's trajectories, step advantages from the outcome advantages only,
a drop-in module after group-based estimators. Chosen here: a node is an identical history through the turn
(a prefix tree; "step" is the alternative reading of "graph": equal (observation, step) pairs merge at any
depth); the step's advantage is the mean of the member trajectories' advantages (max / min as options); the
reply to a turn is outside its node (the step is the model's action; what the environment answered is the next
node's history); within-turn token structure of per-token inputs is kept (shifted by the node's correction).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from trl_credit import Plugin, hookimpl

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch

__all__ = ["SALT", "aggregate", "prefix_nodes", "step_nodes", "turn_bounds", "turn_means"]


def turn_bounds(batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(starts, ends)`` ``(N, K)``: where each model turn begins and the position just past its own tokens
    (-1 past a row's turns)."""
    import torch

    turns = batch.turns()
    starts = turns.starts()
    ends = torch.where(starts >= 0, starts + turns.lengths, -1)
    return starts, ends


def _codes(batch: RolloutBatch) -> torch.Tensor:
    """``(N, T)`` one integer per token: its id and whether the model wrote it (0 outside the completion)."""
    import torch

    turns = batch.turns()
    valid = batch.completion_mask.bool()
    return torch.where(valid, batch.completion_ids.long() * 2 + turns.model.long() + 1, 0)


def prefix_nodes(batch: RolloutBatch) -> torch.Tensor:
    """``(N, K)`` long node ids, merge "prefix": the same id for turns of one group with identical histories up to
    and including the turn (-1 past a row's turns). Pairwise first-mismatch positions within each group:
    ``(N, G, T)`` booleans, no loop."""
    import torch

    g = batch.num_generations
    _, ends = turn_bounds(batch)
    n, k = ends.shape
    codes = batch.grouped(_codes(batch))  # (B, G, T)
    differ = codes.unsqueeze(2) != codes.unsqueeze(1)  # (B, G, G, T)
    width = codes.shape[-1]
    common = torch.where(differ.any(-1), differ.to(torch.uint8).argmax(-1), width)  # (B, G, G) common prefix
    e = batch.grouped(ends)  # (B, G, K)
    same = (e.unsqueeze(2) == e.unsqueeze(1)) & (e.unsqueeze(2) >= 0) & (common.unsqueeze(-1) >= e.unsqueeze(2))
    member = torch.arange(g, device=ends.device).view(1, 1, g, 1)
    first = torch.where(same, member, g).amin(2)  # (B, G, K): the first trajectory of the group in the node
    base = (torch.arange(n // g, device=ends.device) * g).view(-1, 1, 1)
    ids = ((base + first) * k + torch.arange(k, device=ends.device).view(1, 1, -1)).reshape(n, k)
    return torch.where(ends >= 0, ids, -1)


def step_nodes(batch: RolloutBatch) -> torch.Tensor:
    """``(N, K)`` long node ids, merge "step": the same id for turns of one group that answer the same observation
    (the tokens since the previous turn's end; the prompt for a first turn) with the same tokens, at any depth
    (-1 past a row's turns). One ``torch.unique`` over the padded segments."""
    import torch

    _, ends = turn_bounds(batch)
    n, k = ends.shape
    if k == 0:
        return ends
    begin = torch.cat([torch.zeros(n, 1, dtype=torch.long, device=ends.device), ends[:, :-1]], dim=1).clamp(min=0)
    size = torch.where(ends >= 0, ends - begin, 0)
    span = max(int(size.max()), 1)
    codes = _codes(batch)
    position = begin.unsqueeze(-1) + torch.arange(span, device=ends.device)  # (N, K, L)
    inside = position < (begin + size).unsqueeze(-1)
    flat = codes.gather(1, position.clamp(max=codes.shape[1] - 1).reshape(n, -1)).reshape(n, k, span)
    segment = torch.where(inside, flat, 0)
    column = torch.arange(k, device=ends.device).expand(n, k)
    keys = torch.cat([batch.group_ids.to(ends.device).view(n, 1, 1).expand(n, k, 1), (column == 0).long().unsqueeze(-1),
                      size.unsqueeze(-1), segment], dim=-1)
    valid = ends >= 0
    ids = torch.full((n, k), -1, dtype=torch.long, device=ends.device)
    if bool(valid.any()):
        ids[valid] = torch.unique(keys[valid], dim=0, return_inverse=True)[1]
    return ids


def turn_means(batch: RolloutBatch, advantages: torch.Tensor) -> torch.Tensor:
    """``a`` ``(N, K)``: the incoming advantage of each turn: ``A_i`` for per-sequence advantages, the mean over the
    turn's own tokens for per-token ones (0 past a row's turns)."""
    import torch

    turns = batch.turns()
    k = turns.max_turns
    if advantages.dim() == 1:
        return advantages.unsqueeze(1).expand(-1, k) * (turns.lengths > 0)
    sums = torch.zeros(advantages.shape[0], k, dtype=advantages.dtype, device=advantages.device)
    sums.scatter_add_(1, turns.index.clamp(min=0), torch.where(turns.model, advantages, 0.0))
    return sums / turns.lengths.clamp(min=1)


def aggregate(values: torch.Tensor, nodes: torch.Tensor, members: torch.Tensor, how: str = "mean") -> torch.Tensor:
    """``A'`` ``(N, K)``: per turn, the mean (max, min) of ``values`` over the member turns of its node; turns of
    non-members, or of nodes without a member, keep their value."""
    import torch

    valid = nodes >= 0
    counted = valid & members.unsqueeze(1)
    if not bool(counted.any()):
        return values
    size = int(nodes.max()) + 1
    idx, vals = nodes[counted], values[counted]
    weight = torch.zeros(size, dtype=values.dtype, device=values.device).index_add_(0, idx, torch.ones_like(vals))
    if how == "mean":
        pooled = torch.zeros(size, dtype=values.dtype, device=values.device).index_add_(0, idx, vals)
        pooled = pooled / weight.clamp(min=1)
    else:
        pooled = torch.zeros(size, dtype=values.dtype, device=values.device).scatter_reduce_(
            0, idx, vals, reduce="amax" if how == "max" else "amin", include_self=False)
    has = weight[nodes.clamp(min=0)] > 0
    return torch.where(counted & has, pooled[nodes.clamp(min=0)], values)


class SALT(Plugin):
    """SALT's step advantages: each turn gets the aggregate (mean) outcome advantage of every trajectory of its
    group through the same node of the trajectory graph (identical history up to and including the turn).
    Source: arXiv 2510.20022 (abstract only) [abstract-inferred].
    """

    name = "salt"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        merge: Literal["prefix", "step"] = Field("prefix", description="when two turns are one node: identical "
                                                 "histories up to and including the turn (prefix), or the same "
                                                 "turn answering the same observation at any depth (step)")
        aggregate: Literal["mean", "max", "min"] = Field("mean", description="how a node combines the advantages "
                                                         "of the trajectories through it")

    @hookimpl
    def transform_advantages(self, batch: RolloutBatch, advantages: torch.Tensor) -> torch.Tensor | None:
        import torch

        turns = batch.turns()
        if turns.max_turns == 0:  # every completion is empty: nothing to credit
            return None
        device = advantages.device
        values = turn_means(batch, advantages)
        nodes = (prefix_nodes(batch) if self.config.merge == "prefix" else step_nodes(batch)).to(device)
        members = (batch.kept & ~torch.isnan(batch.rewards).all(dim=1)).to(device)
        pooled = aggregate(values, nodes, members, self.config.aggregate)
        if advantages.dim() == 1:
            out = turns.broadcast(pooled)
        else:
            out = advantages + turns.broadcast(pooled - values)
        counted = (nodes >= 0) & members.unsqueeze(1)
        if bool(counted.any()):
            sizes = torch.zeros(int(nodes.max()) + 1, device=device).index_add_(
                0, nodes[counted], torch.ones(int(counted.sum()), device=device))
            self.log_metric(batch, "shared_turns", float((sizes[nodes[counted]] > 1).float().mean()))
            self.log_metric(batch, "nodes_per_group", float((sizes > 0).sum()) / batch.num_groups)
            self.log_metric(batch, "shift", float((pooled - values)[counted].abs().mean()))
        return out.float()
