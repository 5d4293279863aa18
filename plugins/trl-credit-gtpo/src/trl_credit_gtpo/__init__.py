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

Tokens: ``completion_mask`` alone decides what is padding. Every position inside it votes, can
conflict, is weighted and counted, EOS included even when the tokenizer's pad id is also its EOS id
(SmolLM2 and many others: TRL's mask runs up to and including the first EOS); positions outside it
never take part. The code tests ``ids != PAD_ID`` with ``PAD_ID = 128004`` (Llama-3's
``<|finetune_right_pad_id|>``, which is not its EOS and is never generated), i.e. exactly the
padding its mask excludes, so its EOS is weighted and counted too. Completions the filters dropped do
not vote.

Loss. The code's objective is a per-completion token mean, ``(1/|o_i|) sum_t -A_{i,t} ratio_{i,t}``
(then ``/ max(1, n_i)``, folded into ``A_{i,t}`` here), over completions; among TRL's loss types only
``loss_type="grpo"`` aggregates that way with the clipped-ratio surrogate, so ``check_args`` refuses
the others (see ``LOSS_TYPE_PROBLEMS``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from trl_credit import ConfigError, Plugin, hookimpl

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch, RunInfo

__all__ = ["GTPO", "LOSS_TYPE_PROBLEMS", "conflict_counts", "conflict_delta", "conflict_runs", "window_runs"]

#: The one TRL loss type that gives GTPO's objective: token mean per completion, mean over completions,
#: clipped ratio (the code's ratio exp(logp - sg(logp)) at num_iterations = 1).
LOSS_TYPE = "grpo"
#: Why each other TRL loss type does not give GTPO's objective.
LOSS_TYPE_PROBLEMS = {
    "dapo": "it divides by the loss tokens of the whole batch, so a completion weighs in proportion to its "
            "length instead of the code's per-completion token mean (sum_t / |o_i|)",
    "cispo": "it divides by the loss tokens of the whole batch (not per completion) and replaces the clipped "
             "ratio by a clipped importance weight",
    "bnpo": "it divides by the loss tokens of each micro-batch, not per completion",
    "dr_grpo": "it divides by max_completion_length, not by each completion's length",
    "sapo": "it averages per completion as grpo does but replaces the clipped ratio by SAPO's soft gate, "
            "another surrogate than the paper's",
    "luspo": "it is a sequence-level loss that scales each completion by its length (no per-completion token mean)",
    "vespo": "it is a sequence-level loss with gamma weights on sequence importance ratios",
}


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


def window_runs(ids: torch.Tensor, lengths: torch.Tensor, positive: torch.Tensor, negative: torch.Tensor,
                group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Conflict runs inside the leading window ``w`` of each direction, never touching all ``T`` positions.

    A run ends at its first non-conflict position, so only the first ``w`` positions from the start,
    and the last ``w`` of the right-aligned tokens, are compared: ``w`` starts at 16 and doubles while
    some run still reaches the window's edge. Same runs as comparing every position.

    :param lengths: ``(N,)`` long ``|o_i|`` (the completion mask is a right-padded prefix).
    :return: ``(start, end_reversed, ids_start, ids_end)``, each ``(N, w)``: ``start[i, j] = r^f_{i,j}``,
        ``end_reversed[i, j] = r^b_{i, L_i - 1 - j}``, and the ids at those positions.
    """
    import torch

    n, t = ids.shape
    voting = (positive | negative)[:, None]
    w = min(t, 16)
    while True:
        j = torch.arange(w, device=ids.device)[None, :]
        inside = j < lengths[:, None]                                      # (N, w): j-th token exists
        ids_start = ids[:, :w]
        ids_end = ids.gather(1, (lengths[:, None] - 1 - j).clamp(min=0))   # j-th token from the end
        # both directions in one comparison: (N, 2w) = [first w tokens | last w tokens, reversed]
        keys = torch.cat([ids_start, ids_end], dim=1).to(torch.int32)
        voter = torch.cat([inside, inside], dim=1) & voting
        both = _conflicts(keys, voter, positive, negative, group)
        start, end_reversed = _initial_run(both[:, :w]) & inside, _initial_run(both[:, w:]) & inside
        if w == t or not (start[:, -1].any() or end_reversed[:, -1].any()):
            return start, end_reversed, ids_start, ids_end
        w = min(2 * w, t)


def conflict_runs(ids: torch.Tensor, mask: torch.Tensor, positive: torch.Tensor, negative: torch.Tensor,
                  group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Conflict runs from the start and from the end of each completion, as full ``(N, T)`` masks.

    :param ids: ``(N, T)`` long completion ids (< 2**30); ``mask``: ``(N, T)`` completion mask (a
        right-padded prefix); ``positive``/``negative``: ``(N,)`` bool sets of their group (``N = M G``).
    :return: ``(start, end, end_reversed)``, ``(N, T)`` bool: ``start[i, t] = r^f_{i,t}``,
        ``end[i, t] = r^b_{i,t}`` in token order, ``end_reversed[i, j] = end[i, L_i - 1 - j]`` (the
        order in which the official code merged it into its conflict count).
    """
    import torch

    n, t = ids.shape
    lengths = mask.bool().sum(dim=1)
    start_w, end_rev_w, _, _ = window_runs(ids, lengths, positive, negative, group)
    w = start_w.shape[1]
    start = torch.nn.functional.pad(start_w, (0, t - w))
    end_reversed = torch.nn.functional.pad(end_rev_w, (0, t - w))
    flip = (lengths[:, None] - 1 - torch.arange(t, device=ids.device)[None, :]).clamp(min=0)
    end = end_reversed.gather(1, flip) & mask.bool()                      # back to token order
    return start, end, end_reversed


def conflict_counts(ids: torch.Tensor, mask: torch.Tensor, positive: torch.Tensor, negative: torch.Tensor,
                    group: int, count_mode: str = "aligned") -> tuple[torch.Tensor, torch.Tensor]:
    """``k`` ``(N, T)`` long: how many runs (0, 1, 2) cover a token; ``n_conflict`` ``(N,)`` long.

    The mask alone decides what is padding: every token inside it (EOS included, whatever its id)
    can be weighted and counted, none outside. ``delta_{i,t} = W^k`` on positives, ``0^k`` on negatives.
    """
    start, end, end_reversed = conflict_runs(ids, mask, positive, negative, group)
    if count_mode == "aligned":
        counted = start | end
    elif count_mode == "code":
        counted = start | (end_reversed & mask.bool())                    # reversed order, as the code
    else:
        raise ValueError(f"count_mode must be 'aligned' or 'code', got {count_mode!r}")
    return start.long() + end, counted.sum(dim=1)


def conflict_delta(ids: torch.Tensor, mask: torch.Tensor, positive: torch.Tensor, negative: torch.Tensor,
                   group: int, weight: float = 2.0,
                   count_mode: str = "aligned") -> tuple[torch.Tensor, torch.Tensor]:
    """``delta`` ``(N, T)`` float32 (0 outside the mask) and ``n_conflict`` ``(N,)`` long (before ``max(1, .)``)."""
    import torch

    k, n_conflict = conflict_counts(ids, mask, positive, negative, group, count_mode)
    delta = _power_table(torch.ones(ids.shape[0], device=ids.device), positive, weight).gather(1, k)
    return delta * mask.to(torch.float32), n_conflict


def _power_table(scale: torch.Tensor, positive: torch.Tensor, weight: float) -> torch.Tensor:
    """``(N, 3)``: ``scale_i * [1, w_i, w_i^2]`` with ``w_i = W`` on positives and 0 otherwise."""
    import torch

    w = torch.where(positive, weight, 0.0).to(scale)
    return scale[:, None] * torch.stack([torch.ones_like(w), w, w * w], dim=1)


class GTPO(Plugin):
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

    def check_args(self, run: RunInfo) -> None:
        """GTPO's objective is a per-completion token mean with the clipped ratio: TRL's ``loss_type="grpo"``."""
        loss_type = getattr(run.args, "loss_type", "dapo")
        if loss_type != LOSS_TYPE:
            why = LOSS_TYPE_PROBLEMS.get(loss_type, "it is not a TRL loss type this plugin knows")
            raise ConfigError.for_key(
                "loss_type",
                f"gtpo needs the per-completion token mean of the GTPO code (loss_type 'grpo'), got "
                f"{loss_type!r}: {why}",
                "set `loss_type: grpo` (GRPOConfig(loss_type=\"grpo\"))",
            )

    @hookimpl
    def transform_advantages(self, batch: RolloutBatch, advantages: torch.Tensor) -> torch.Tensor:
        import torch

        cfg = self.config
        mask = batch.completion_mask
        maskf = mask.to(torch.float32, copy=True)             # one (N, T) pass; becomes the output buffer
        lengths = batch.completion_lengths.to(maskf.device)                     # (N,) |o_i|
        length = lengths.clamp(min=1).to(torch.float32)
        adv = advantages.to(torch.float32)
        token_level = adv.dim() == 2

        def token_mean(x):                                                      # masked row means, one kernel
            return torch.bmm(x.to(maskf).unsqueeze(1), maskf.unsqueeze(2)).reshape(-1) / length

        seq_adv = token_mean(adv) if token_level else adv
        kept = batch.kept.to(adv.device)
        positive, negative = (seq_adv > 0) & kept, (seq_adv < 0) & kept       # P, N: before shaping

        stats = []
        if cfg.entropy:
            h = token_mean(batch.policy_entropies())                           # H_i
            high = h > cfg.ent_threshold
            off = high | ~batch.scorable.to(adv.device)                         # unscorable: 0, as TRL gives it
            shaped = torch.where(off, 0.0, seq_adv - cfg.ent_scale * h)        # A~_i
            adv = torch.where(off[:, None], 0.0, adv - cfg.ent_scale * h[:, None]) if token_level else shaped
            live = kept & batch.scorable.to(adv.device)
            if bool(live.any()):
                stats += [("entropy_mean", h[live].mean()), ("entropy_filtered", high[live].float().mean())]
        if not cfg.protect_conflicts:
            self._log(batch, stats)
            return maskf.mul_(adv if token_level else adv[:, None])

        # the mask alone decides what is padding: the runs cover only positions inside it (EOS included)
        start, end_rev, _, _ = window_runs(batch.completion_ids, lengths, positive, negative, batch.num_generations)
        w = start.shape[1]
        j = torch.arange(w, device=adv.device)[None, :]
        mirror = lengths[:, None] - 1 - j                     # the start-window position j seen from the end
        end_at_start = end_rev.gather(1, mirror.clamp(0, w - 1)) & (mirror >= 0) & (mirror < w)
        if cfg.count_mode == "aligned":                       # |start run u end run|, overlap counted once
            n_conflict = start.sum(1) + end_rev.sum(1) - (start & end_at_start).sum(1)
        elif cfg.count_mode == "code":                       # the code's merge of the reversed end run
            n_conflict = (start | end_rev).sum(1)
        else:
            raise ValueError(f"count_mode must be 'aligned' or 'code', got {cfg.count_mode!r}")
        per_conflict = 1.0 / n_conflict.clamp(min=1).to(torch.float32)          # 1 / max(1, n_i)
        out = maskf.mul_(adv * per_conflict[:, None] if token_level else (adv * per_conflict)[:, None])
        weight = torch.where(positive, cfg.conflict_weight, 0.0).to(out)  # d(r = 1): W or 0
        out[:, :w] *= torch.where(start, weight[:, None], 1.0)                 # start run, token order
        rows, js = end_rev.nonzero(as_tuple=True)                              # end run: few positions
        out[rows, lengths[rows] - 1 - js] *= weight[rows]
        active = (positive | negative).float()
        n_active = active.sum().clamp(min=1.0)
        stats += [("conflict_tokens", (n_conflict * active).sum() / n_active),
                  ("conflict_fraction", (n_conflict / length * active).sum() / n_active)]
        self._log(batch, stats)
        return out

    def _log(self, batch: RolloutBatch, stats: list) -> None:
        import torch

        if stats:
            values = torch.stack([v.float() for _, v in stats]).tolist()         # one host sync
            for (name, _), value in zip(stats, values):
                self.log_metric(batch, name, value)
