"""GTPO: protect conflict tokens shared by good and bad completions; filter and shape by entropy.

Method. In a GRPO group, positive (``A_i > 0``) and negative (``A_i < 0``) completions often share
the same tokens at the same positions, typically the opening (restated question, "Let's think") and
the closing (answer template, EOS). GRPO pushes such a token up through the positives and down
through the negatives, and the negative push damages the shared structure. GTPO finds these
*conflict tokens*: token ``o_{i,t}`` conflicts when the same id sits at position ``t`` in at least
one positive and at least one negative completion of the group. Only the conflict run from the
start of the completion counts, and, with the completions right-aligned by their lengths, the run
from the end. On those runs negatives get no gradient and positives a doubled one; each
completion's loss is divided by its number of conflict tokens. Completions whose mean policy
entropy exceeds a threshold are dropped (advantage 0) and the others are shaped by
``A_i - ent_scale * H_i``.

Formula (paper notation; ``P``/``N`` = positive/negative completions of the group, ``W = 2``)::

    c_{i,t}   = [o_{i,t} in {o_{j,t} : j in P}] * [o_{i,t} in {o_{j,t} : j in N}]       (i in P u N)
    r^f_{i,t} = prod_{s <= t} c_{i,s}                      run from the start (cumprod)
    r^b_{i,t} = prod_{s >= t} c~_{i,s}                     run from the end, c~ on right-aligned tokens
    d(r)      = 1 if r = 0;  W if i in P;  0 if i in N
    delta_i,t = d(r^f_{i,t}) * d(r^b_{i,t})
    n_i       = sum_t [r^f_{i,t} or r^b_{i,t}]             (count_mode "aligned", see below)
    H_i       = (1 / |o_i|) sum_t H(pi_theta(. | q, o_{i,<t}))
    A~_i      = 0 if H_i > ent_threshold else A_i - ent_scale * H_i
    A_{i,t}   = A~_i * delta_{i,t} / max(1, n_i)           (returned as (N, T) advantages)

Source: [code] winstonsmith1897/GTPO@5d33811e8ea1 ``gtpo/gtpo_training.py`` (``build_conflict_mask``,
``UnslothEfficientGTPO.forward``, ``gtpo_compute_loss``), constants ``ENT_THRESHOLD = 0.7``,
``ENT_SCALE = 0.1``, ``W_RAW = 2.0`` there and in ``config.yaml: gtpo_runtime``. Paper: "GTPO:
Trajectory-Based Policy Optimization in Large Language Models", arXiv 2508.03772 (not the
entropy-weighted "GTPO" of arXiv 2508.04349). The positive/negative sets come from the advantages
before entropy shaping, as in the code; the shaping applies to every completion, zero-advantage ones
included (they get ``-ent_scale * H_i``), as in the code.

``count_mode``: the official code ORs the end-run mask while it is still in reversed order into the
forward mask, so ``n_i`` counts ``max(start run, end run)`` positions instead of their union;
``"aligned"`` (default, the method's intent) counts the union, ``"code"`` reproduces the code.

Tokens: only positions inside ``completion_mask`` vote and can conflict; a position whose id is the
tokenizer's pad id (``batch.pad_token_id``; the code hard-codes Llama-3's 128004) may continue a run
but is never weighted or counted. Completions the filters dropped do not vote.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from trl_credit import hookimpl

if TYPE_CHECKING:
    import torch

    from trl_credit.batch import RolloutBatch

__all__ = ["GTPO", "conflict_counts", "conflict_delta", "conflict_runs"]


def _conflicts(keys: torch.Tensor, voter: torch.Tensor, positive: torch.Tensor, negative: torch.Tensor,
               group: int) -> torch.Tensor:
    """``c_{i,t}``: ``(N, T')`` bool, id at ``t`` also at ``t`` in a positive and in a negative of the group.

    A positive completion always holds its own token, so it conflicts iff a *negative* holds it too,
    and vice versa. One ``(M, G, G, T')`` comparison does both: the query key of member ``i`` is
    ``2 o_{i,t} + [i in N]``, the stored key of voter ``j`` is ``2 o_{j,t} + [j in P]``; they match iff
    the ids match and the classes differ. Non-voters get keys (-1, -2) that never match.
    """
    import torch

    n, t = keys.shape
    twice = keys * 2                                                       # int32: ids < 2**30
    outside = ~voter
    query = (twice + negative.to(keys.dtype)[:, None]).masked_fill_(outside, -1).reshape(n // group, group, 1, t)
    stored = (twice + positive.to(keys.dtype)[:, None]).masked_fill_(outside, -2).reshape(n // group, 1, group, t)
    match = query == stored                                                # (M, G_i, G_j, T')
    return match.view(torch.uint8).amax(dim=2).view(torch.bool).reshape(n, t)


def _initial_run(c: torch.Tensor) -> torch.Tensor:
    """``prod_{s <= t} c_s`` along dim 1 of a bool ``(N, T)``: True up to the first False."""
    import torch

    stop = ~c
    first = torch.where(stop.any(dim=1), stop.view(torch.uint8).argmax(dim=1), c.shape[1])
    return torch.arange(c.shape[1], device=c.device)[None, :] < first[:, None]


def conflict_runs(ids: torch.Tensor, mask: torch.Tensor, positive: torch.Tensor, negative: torch.Tensor,
                  group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Conflict runs from the start and from the end of each completion.

    :param ids: ``(N, T)`` long completion ids (< 2**30); ``mask``: ``(N, T)`` completion mask (a
        right-padded prefix); ``positive``/``negative``: ``(N,)`` bool sets of their group (``N = M G``).
    :return: ``(start, end, end_reversed)``, ``(N, T)`` bool: ``start[i, t] = r^f_{i,t}``,
        ``end[i, t] = r^b_{i,t}`` in token order, ``end_reversed[i, j] = end[i, L_i - 1 - j]`` (the
        order in which the official code merged it into its conflict count).
    """
    import torch

    n, t = ids.shape
    inside = mask.bool()
    lengths = inside.sum(dim=1, keepdim=True)                              # (N, 1) L_i
    j = torch.arange(t, device=ids.device)[None, :]
    flip = (lengths - 1 - j).clamp_(min=0)                                 # reverse the first L_i tokens
    inside_rev = j < lengths                                               # right-aligned: j = L_i - 1 - t
    ids32 = ids.to(torch.int32)
    ids_rev = ids32.gather(1, flip)
    voting = (positive | negative)[:, None]
    # A run ends at its first non-conflict position, so only a window of leading positions (from the
    # start, and from the end of the right-aligned tokens) needs comparing: begin with 16 and double
    # the window while some run still reaches its edge. Same result as comparing all T positions.
    w = min(t, 16)
    while True:
        # both directions in one comparison: (N, 2w) = [first w tokens | last w tokens, reversed]
        keys = torch.cat([ids32[:, :w], ids_rev[:, :w]], dim=1)
        voter = torch.cat([inside[:, :w], inside_rev[:, :w]], dim=1) & voting
        both = _conflicts(keys, voter, positive, negative, group)
        run_start, run_end = _initial_run(both[:, :w]), _initial_run(both[:, w:])
        if w == t or not (run_start[:, -1].any() or run_end[:, -1].any()):
            break
        w = min(2 * w, t)
    start = torch.nn.functional.pad(run_start, (0, t - w)) & inside
    end_reversed = torch.nn.functional.pad(run_end, (0, t - w)) & inside_rev
    end = end_reversed.gather(1, flip) & inside                           # back to token order
    return start, end, end_reversed


def conflict_counts(ids: torch.Tensor, mask: torch.Tensor, positive: torch.Tensor, negative: torch.Tensor,
                    group: int, pad_token_id: int | None = None,
                    count_mode: str = "aligned") -> tuple[torch.Tensor, torch.Tensor]:
    """``k`` ``(N, T)`` long: how many runs (0, 1, 2) cover a weighted token; ``n_conflict`` ``(N,)`` long.

    Weighted tokens are inside the mask and not the pad id (pad ids may continue a run, as in the
    code, but get ``delta = 1`` and are not counted). ``delta_{i,t} = W^k`` on positives, ``0^k`` on
    negatives.
    """
    start, end, end_reversed = conflict_runs(ids, mask, positive, negative, group)
    if pad_token_id is not None:
        real = ids != pad_token_id
        start, end = start & real, end & real
    if count_mode == "aligned":
        counted = start | end
    elif count_mode == "code":
        counted = start | (end_reversed & mask.bool())                    # reversed order, as the code
        if pad_token_id is not None:
            counted &= real
    else:
        raise ValueError(f"count_mode must be 'aligned' or 'code', got {count_mode!r}")
    return start.long() + end, counted.sum(dim=1)


def conflict_delta(ids: torch.Tensor, mask: torch.Tensor, positive: torch.Tensor, negative: torch.Tensor,
                   group: int, weight: float = 2.0, pad_token_id: int | None = None,
                   count_mode: str = "aligned") -> tuple[torch.Tensor, torch.Tensor]:
    """``delta`` ``(N, T)`` float32 (0 at padding) and ``n_conflict`` ``(N,)`` long (before ``max(1, .)``)."""
    import torch

    k, n_conflict = conflict_counts(ids, mask, positive, negative, group, pad_token_id, count_mode)
    delta = _power_table(torch.ones(ids.shape[0], device=ids.device), positive, weight).gather(1, k)
    return delta * mask.to(torch.float32), n_conflict


def _power_table(scale: torch.Tensor, positive: torch.Tensor, weight: float) -> torch.Tensor:
    """``(N, 3)``: ``scale_i * [1, w_i, w_i^2]`` with ``w_i = W`` on positives and 0 otherwise."""
    import torch

    w = torch.where(positive, weight, 0.0).to(scale)
    return scale[:, None] * torch.stack([torch.ones_like(w), w, w * w], dim=1)


class GTPO:
    """GTPO: A_{i,t} = A~_i delta_{i,t} / max(1, n_i), conflict runs protected, high-entropy completions dropped."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        conflict_weight: float = Field(
            2.0, ge=0.0,
            description="W: factor on a positive completion's conflict-run tokens, per run (start and end "
            "runs multiply, so W^2 where they overlap); negatives get 0 there (code: W_RAW = 2.0)",
        )
        protect_conflicts: bool = Field(
            True, description="apply the conflict weights delta and the 1/max(1, n_conflict) scaling; "
            "false leaves only the entropy part (ablation)",
        )
        count_mode: Literal["aligned", "code"] = Field(
            "aligned",
            description="n_conflict: 'aligned' counts positions in the start run or the end run (the "
            "method's intent); 'code' reproduces the official build_conflict_mask, which merges the end "
            "run in reversed order (counts max(start run, end run))",
        )
        entropy: bool = Field(
            True, description="use the entropy filter and shaping (needs policy entropies: one extra "
            "no-grad forward pass); false skips both",
        )
        ent_threshold: float = Field(
            0.7, description="a completion whose mean token entropy (nats) exceeds this gets advantage 0 "
            "(code: ENT_THRESHOLD = 0.7; depends on model and temperature)",
        )
        ent_scale: float = Field(
            0.1, description="A_i <- A_i - ent_scale * H_i for the kept completions (code: ENT_SCALE = 0.1); "
            "0 disables the shaping but keeps the filter",
        )

    def __init__(self, config: Config | None = None):
        self.config = config or self.Config()

    @hookimpl
    def transform_advantages(self, batch: RolloutBatch, advantages: torch.Tensor) -> torch.Tensor:
        import torch

        cfg = self.config
        mask = batch.completion_mask
        inside = mask.bool()
        length = inside.sum(dim=1).clamp(min=1).to(torch.float32)               # (N,) |o_i|
        adv = advantages.to(torch.float32)
        token_level = adv.dim() == 2
        seq_adv = adv.masked_fill(~inside, 0.0).sum(1) / length if token_level else adv
        kept = batch.kept.to(adv.device)
        positive, negative = (seq_adv > 0) & kept, (seq_adv < 0) & kept       # P, N: before shaping

        stats = []
        if cfg.entropy:
            h = batch.policy_entropies().to(adv).masked_fill(~inside, 0.0).sum(1) / length   # H_i
            high = h > cfg.ent_threshold
            shaped = torch.where(high, 0.0, seq_adv - cfg.ent_scale * h)       # A~_i
            adv = torch.where(high[:, None], 0.0, adv - cfg.ent_scale * h[:, None]) if token_level else shaped
            stats += [("entropy_mean", h.mean()), ("entropy_filtered", high.float().mean())]
        if not cfg.protect_conflicts:
            self._log(batch, stats)
            out = adv if token_level else adv[:, None].expand(mask.shape)
            return out.masked_fill(~inside, 0.0)

        k, n_conflict = conflict_counts(batch.completion_ids, mask, positive, negative,
                                        batch.num_generations, batch.pad_token_id, cfg.count_mode)
        per_conflict = 1.0 / n_conflict.clamp(min=1).to(torch.float32)          # 1 / max(1, n_i)
        if token_level:
            factors = _power_table(per_conflict, positive, cfg.conflict_weight).gather(1, k)
            out = adv * factors
        else:   # A~_i delta_{i,t} / max(1, n_i) as a lookup of A~_i / max(1, n_i) * [1, W, W^2]
            out = _power_table(adv * per_conflict, positive, cfg.conflict_weight).gather(1, k)
        out.masked_fill_(~inside, 0.0)
        active = (positive | negative).float()
        n_active = active.sum().clamp(min=1.0)
        stats += [("conflict_tokens", (n_conflict * active).sum() / n_active),
                  ("conflict_fraction", (n_conflict / length * active).sum() / n_active)]
        self._log(batch, stats)
        return out

    @staticmethod
    def _log(batch: RolloutBatch, stats: list) -> None:
        import torch

        if stats:
            values = torch.stack([v.float() for _, v in stats]).tolist()         # one host sync
            for (name, _), value in zip(stats, values):
                batch.log_metric(name, value)
