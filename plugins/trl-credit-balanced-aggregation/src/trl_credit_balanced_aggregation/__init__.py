"""Balanced Aggregation (BA): positives and negatives of a group get equal say, tokens are averaged inside each.

Method. How GRPO sums its token terms inside a group biases the update. Sequence aggregation
(per-completion token mean, then mean over completions) gives every completion the same total
weight, so each token of a long completion counts less. Token aggregation (one mean over all
tokens) gives every token the same weight, so whichever sign has the longer completions (often the
wrong ones) dominates the group: sign-length coupling. BA splits a group into its positive
(A_i > 0) and negative (A_i < 0) completions, takes a token mean inside each subset, and weights
the two subset means by their share of the group's completions. Completions with A_i = 0 take no
part. The outer average runs over the groups of the batch.

Formula (group of n completions, P+ / P- its positive / negative completions, n+- = |P+-|,
T+- = sum_{i in P+-} |o_i| their tokens, l_{i,t} the usual clipped token term, which carries A_i)::

    L_group = (n+/n) * (1/T+) * sum_{i in P+} sum_t l_{i,t}  +  (n-/n) * (1/T-) * sum_{i in P-} sum_t l_{i,t}
    L       = (1/Q) * sum_{groups} L_group                                   (Q groups in the batch)

i.e. every token of completion i gets the weight ``w_i = (n^s/n) / T^s / Q`` with s = sign(A_i)
(0 when A_i = 0 or |o_i| = 0). Positives and negatives of a group each carry total weight n^s/n.

In TRL. The loss is a fixed aggregation of ``-A_{i,t} * ratio_{i,t}``, so BA is obtained by feeding
``A'_{i,t} = A_{i,t} * w_i * M_i`` where ``M_i`` cancels the normaliser of ``loss_type``. Counting a
whole generation batch (N completions gathered over P processes, GA accumulation steps,
``steps_per_generation`` = S, N_tok its loss tokens), TRL's effective weight of token (i, t) in
the gradient, at ratio 1, is ``S/GA`` times::

    grpo, sapo   A'_{i,t} / (N * |o_i|)        ->  M_i = N * |o_i|
    dr_grpo      A'_{i,t} / (N * L_max)        ->  M_i = N * L_max     (L_max = max_completion_length)
    dapo, cispo  A'_{i,t} / N_tok              ->  M_i = N_tok         (N_tok = num_items_in_batch)

so the effective weight becomes ``A_{i,t} * w_i`` (times S/GA, the optimiser steps per generation
batch, the same factor every TRL loss has). M_i and w_i are per completion, so an ``(N,)`` input is returned
as ``(N,)`` (TRL broadcasts it over tokens) and an ``(N, T)`` input is scaled row by row. Refused: ``bnpo`` (its normaliser is the token count of
each micro-batch, which depends on how TRL shuffles rows into micro-batches after this hook runs),
``luspo`` and ``vespo`` (not derived here), per-sequence losses (grpo, sapo, dr_grpo) together with an
enabled filter (``filter_rollouts``): when it drops completions the host rescales every micro-batch by
its own kept-row count. Both are refused by ``check_args`` before the model loads; the transform
still raises if such a batch reaches it.

Source: "Balanced Aggregation: Understanding and Fixing Aggregation Bias in GRPO" (OpenMOSS),
**[reconstructed from the abstract]**: "computes token-level means separately within the positive
and negative subsets and then combines them with sequence-count-based weights". No official code
was found. Not established from the abstract, chosen here: n counts every completion of the group
(so a group with only positives puts weight n+/n, not 1, on them; ``group_size="signed"`` uses
n = n+ + n-), and the outer average is over groups (Q = groups in the batch, constant-reward groups
included).

Defaults: ``group_size = "all"`` (methods.md 2.20: "group with only positives -> weight n+/n").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from trl_credit import ConfigError, Plugin, hookimpl

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch, RunInfo

__all__ = ["BalancedAggregation", "ba_weights", "check_loss_type", "loss_multiplier", "SUPPORTED_LOSS_TYPES"]

#: loss_type -> which TRL normaliser it uses ("row": token mean per row then row mean, "rowmax": sum over
#: rows * max_completion_length, "tokens": num_items_in_batch).
SUPPORTED_LOSS_TYPES = {"grpo": "row", "sapo": "row", "dr_grpo": "rowmax", "dapo": "tokens", "cispo": "tokens"}
REFUSED_LOSS_TYPES = {
    "bnpo": "its normaliser is the token count of each micro-batch, which depends on how TRL shuffles and "
            "splits the generation batch into micro-batches after advantages are computed",
    "luspo": "its sequence-sum aggregation (and sequence-level importance weights) are not derived here",
    "vespo": "its gamma weights are not derived here",
}


def ba_weights(advantages: torch.Tensor, lengths: torch.Tensor, num_generations: int,
               group_size: str = "all") -> torch.Tensor:
    """BA weight ``w_i = (n^s/n) / T^s / Q`` of every token of completion i, shape ``(N,)``.

    :param advantages: ``(N,)`` sequence advantages; s = sign(A_i).
    :param lengths: ``(N,)`` loss tokens |o_i| per completion (0 for dropped or empty completions).
    """
    import torch

    length = lengths.to(torch.float32)
    live = length > 0
    sign = torch.stack([(advantages > 0) & live, (advantages < 0) & live])      # (2, N): P+, P-
    q = advantages.shape[0] // num_generations                                   # Q groups
    grouped = sign.reshape(2, q, num_generations).to(torch.float32)              # (2, Q, G)
    n_s = grouped.sum(dim=2)                                                     # (2, Q): n+, n-
    t_s = (grouped * length.reshape(1, q, num_generations)).sum(dim=2)           # (2, Q): T+, T-
    n = float(num_generations) if group_size == "all" else n_s.sum(dim=0, keepdim=True).clamp(min=1.0)
    per_set = n_s / n / t_s.clamp(min=1.0) / max(q, 1)                           # (2, Q); 0 where n^s = 0
    per_row = per_set.repeat_interleave(num_generations, dim=1)                  # (2, N)
    return (per_row * sign).sum(dim=0)                                           # (N,)


def _loss_type_problem(loss_type: str) -> str | None:
    """Why BA cannot be exact with ``loss_type``, or None when it can."""
    if loss_type in SUPPORTED_LOSS_TYPES:
        return None
    why = REFUSED_LOSS_TYPES.get(loss_type, "it is not a loss type this plugin knows")
    return f"balanced_aggregation cannot reproduce BA exactly with loss_type={loss_type!r}: {why}"


def check_loss_type(loss_type: str) -> str:
    """The normaliser kind of ``loss_type``; ValueError saying why for a loss type BA cannot be exact with."""
    problem = _loss_type_problem(loss_type)
    if problem is not None:
        raise ValueError(f"{problem}. Use one of {sorted(SUPPORTED_LOSS_TYPES)} (dapo, TRL's default, is exact "
                         "in every case)")
    return SUPPORTED_LOSS_TYPES[loss_type]


def loss_multiplier(loss_type: str, lengths: torch.Tensor, max_completion_length: int) -> torch.Tensor:
    """``M_i`` of the module docstring, shape ``(N,)``: undoes TRL's normaliser for ``loss_type``.

    :param lengths: ``(N,)`` loss tokens per completion of the whole (gathered) batch.
    """
    import torch

    kind = check_loss_type(loss_type)
    length = lengths.to(torch.float32)
    n = float(length.shape[0])
    if kind == "row":                                          # grpo, sapo: N * |o_i|
        return n * length.clamp(min=1.0)
    if kind == "rowmax":                                       # dr_grpo: N * L_max
        return torch.full_like(length, n * float(max_completion_length))
    return length.sum().clamp(min=1.0).expand_as(length)       # dapo, cispo: N_tok


class BalancedAggregation(Plugin):
    """Balanced Aggregation: token weight w_i = (n^s/n) / T^s / Q, s = sign(A_i), folded into the advantages."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        group_size: Literal["all", "signed"] = Field(
            "all",
            description="n in n^s/n: 'all' = every completion of the group (a group with only positives puts "
            "weight n+/n on them; methods.md 2.20), 'signed' = n+ + n- (zero-advantage and empty completions "
            "not counted, so the two subsets always share weight 1)",
        )

    def check_args(self, run: RunInfo) -> None:
        """Refuse a loss type BA cannot be exact with, and per-sequence losses next to a filter."""
        loss_type = getattr(run.args, "loss_type", "dapo")
        problem = _loss_type_problem(loss_type)
        if problem is not None:
            raise ConfigError.for_key("loss_type", problem, f"set `loss_type: dapo` (exact in every case) or "
                                      f"another of {sorted(SUPPORTED_LOSS_TYPES)}")
        filters = run.with_hook("filter_rollouts")              # this plugin has none: every one is another's
        if SUPPORTED_LOSS_TYPES[loss_type] in ("row", "rowmax") and filters:
            names = ", ".join(f"plugins[{p.index}] ({p.key})" for p in filters)
            raise ConfigError.for_key(
                "loss_type",
                f"balanced_aggregation cannot be exact with the per-sequence loss_type={loss_type!r} next to a "
                f"filter ({names}): when it drops completions the host rescales each micro-batch by its own "
                "kept-row count, which depends on how TRL splits the batch",
                "set `loss_type: dapo` (exact with filters) or remove the filter",
            )

    @hookimpl
    def transform_advantages(self, batch: RolloutBatch, advantages: torch.Tensor) -> torch.Tensor:
        import torch

        loss_type = getattr(batch.args, "loss_type", "dapo")
        if SUPPORTED_LOSS_TYPES.get(loss_type) in ("row", "rowmax") and not bool(batch.root.kept.all()):
            # safety net: check_args refuses this combination before the model loads
            raise ValueError(
                f"balanced_aggregation cannot be exact with loss_type={loss_type!r} when a filter drops "
                "completions: the host rescales each micro-batch by its own kept-row count, which depends "
                "on how TRL splits the batch; use loss_type='dapo'"
            )
        mask = batch.completion_mask
        lengths = mask.sum(dim=1) * batch.kept                                     # (N,) loss tokens |o_i|
        if advantages.dim() == 2:                                                  # sign of the token mean
            a = (advantages * mask).sum(dim=1) / lengths.clamp(min=1)
        else:
            a = advantages
        w = ba_weights(a, lengths, batch.num_generations, self.config.group_size)  # (N,)
        scale = w * loss_multiplier(loss_type, lengths, batch.max_completion_length)
        # per-row factors: an (N,) input stays (N,) (TRL broadcasts it over tokens, exactly as an (N, T)
        # copy would, without writing N x T floats); an (N, T) input is scaled row by row.
        out = advantages * (scale if advantages.dim() == 1 else scale.unsqueeze(1))
        token_weight = w * lengths                                                 # total weight of completion i
        stats = torch.stack([token_weight[a > 0].sum(), token_weight.sum(), (w > 0).float().mean()]).tolist()
        self.log_metric(batch, "positive_weight", stats[0])   # sum over the batch of (1/Q) n+/n
        self.log_metric(batch, "total_weight", stats[1])      # 1 when every group has both signs (group_size=all)
        self.log_metric(batch, "active_fraction", stats[2])   # completions with a nonzero BA weight
        return out
