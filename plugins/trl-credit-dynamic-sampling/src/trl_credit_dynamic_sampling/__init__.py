"""DAPO dynamic sampling: drop groups whose rewards are all equal, refill the batch with new prompts.

Method. Under group-normalised advantages ``A_i = (r_i - mean_g r) / std_g r`` a group whose G
rewards are all equal (accuracy all 0 or all 1) gets ``A_i = 0`` for every completion: it adds no
policy gradient, yet it still counts in the batch, so the effective batch shrinks as the model
solves (or gives up on) more prompts. DAPO over-samples: such groups are filtered out and
generation continues with new prompts until the batch holds enough informative groups.

Rule (``r`` = the tested reward column, NaN entries ignored)::

    keep group g  <=>  max_{i in g} r_i - min_{i in g} r_i > tol        (tol = 0: std_g(r) > 0)

The paper writes it as the constraint ``0 < |{o_i : is_equivalent(a, o_i)}| < G`` under the DAPO
objective. A group with no finite reward, or whose finite rewards are constant, is dropped; so is
every group of a single completion (G = 1). Two modes:

- ``replace`` (DAPO, verl's ``filter_groups``): the host draws further generation batches (at most
  ``max_refill_rounds`` extra ones and, with ``max_refill_tokens``, no new one once the refill rounds
  have generated that many completion tokens) until the number of kept groups reaches the number of
  groups of one generation batch, so dropped groups are replaced by informative ones;
- ``filter``: dropped groups are only masked (advantage 0, out of the loss and its normaliser); the
  step trains on the informative groups of the one generation batch, a smaller effective batch at
  no extra generation cost.

``refill: true|false`` is accepted as an alias of ``mode: replace|filter``.

Source: Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
arXiv 2503.14476, section "Dynamic Sampling". Official code: volcengine/verl ``recipe/dapo``
(``dapo_ray_trainer.py``): with ``algorithm.filter_groups.enable`` the per-prompt population std
of ``algorithm.filter_groups.metric`` (``acc``, ``score``, ``seq_reward``, ``seq_final_reward``) is
computed and prompts with std > 0 are kept; generation batches are accumulated until
``data.train_batch_size`` prompts are kept, raising after ``max_num_gen_batches`` batches
(``<= 0``: no limit). Facts read there, not code copied.

Defaults: ``metric = None`` (the weighted total reward, which is what TRL normalises; verl's
scripts use ``acc``); ``tolerance = 0.0`` (verl's ``std > 0``); ``mode = replace``;
``max_refill_rounds = 3`` (verl: config default 0 = unlimited, the DAPO-Qwen2.5-32B script 10
generation batches of 3x the train batch; a round here is one train batch, and on a CPU every round
costs about one step, so the cap is 4x a step's generation, enough whenever >= 25 % of groups are
informative); ``max_refill_tokens = None`` (no token budget: only the round cap bounds the cost).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trl_credit import Plugin, Refill, hookimpl

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch

__all__ = ["DynamicSampling", "group_range"]


def group_range(grouped: torch.Tensor) -> torch.Tensor:
    """``(M, G)`` rewards -> ``(M,)`` NaN-ignoring range ``max - min`` (-inf for a group with no finite reward)."""
    import torch

    nan = torch.isnan(grouped)
    high = grouped.masked_fill(nan, -torch.inf).amax(dim=1)
    low = grouped.masked_fill(nan, torch.inf).amin(dim=1)
    return high - low


class DynamicSampling(Plugin):
    """DAPO dynamic sampling: keep group g iff max_g r - min_g r > tolerance; refill the batch."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        metric: str | None = Field(
            None,
            description="reward column whose within-group range is tested (verl: filter_groups.metric); "
            "None = the weighted total reward, summed as TRL does",
        )
        tolerance: float = Field(
            0.0, ge=0.0,
            description="a group whose reward range (max - min over non-NaN rewards) is <= tolerance "
            "counts as constant and is dropped; 0 = DAPO's std > 0",
        )
        mode: Literal["replace", "filter"] = Field(
            "replace",
            description="replace: draw more prompts until the batch holds as many kept groups as one "
            "generation batch has groups (DAPO dynamic sampling); filter: only mask the dropped groups "
            "and train on the rest (no extra generation). Alias: refill: true|false",
        )
        max_refill_rounds: int = Field(
            3, ge=0,
            description="extra generation rounds per step at most (verl's max_num_gen_batches minus 1, "
            "there 10 batches of 3x the train batch); each round costs one generation batch",
        )
        max_refill_tokens: int | None = Field(
            None, ge=0,
            description="budget of extra generated completion tokens (all processes) that refill may spend "
            "per optimiser batch: no new refill round starts once it is reached (one round may overshoot; "
            "logged as trl_credit/refill_budget_hit); None = no budget, only max_refill_rounds",
        )

        @model_validator(mode="before")
        @classmethod
        def _refill_alias(cls, data):
            if isinstance(data, dict) and "refill" in data:
                data = dict(data)
                refill = data.pop("refill")
                if not isinstance(refill, bool):
                    raise ValueError(f"option 'refill' must be true or false, got {refill!r} (or use mode: replace|filter)")
                mode = "replace" if refill else "filter"
                if data.setdefault("mode", mode) != mode:
                    raise ValueError(f"option 'refill: {str(refill).lower()}' contradicts 'mode: {data['mode']}'; give only mode")
            return data

        @property
        def refill(self) -> bool:
            """Refill rounds are wanted (mode replace); the alias ``refill: true|false`` reads back."""
            return self.mode == "replace"

    def refill(self) -> Refill | None:
        """Mode replace: refill rounds up to ``max_refill_rounds`` within ``max_refill_tokens``; filter: none."""
        cfg = self.config
        if cfg.mode != "replace":
            return None
        return Refill(max_rounds=cfg.max_refill_rounds, max_tokens=cfg.max_refill_tokens)

    def required_rewards(self) -> list[str]:
        """The reward column the host must find among the reward functions (none for the total)."""
        return [self.config.metric] if self.config.metric is not None else []

    @hookimpl
    def filter_rollouts(self, batch: RolloutBatch) -> torch.Tensor:
        import torch

        r = batch.reward(self.config.metric) if self.config.metric is not None else batch.total_reward()
        grouped = batch.grouped(r.to(torch.float32))                  # (M, G)
        spread = group_range(grouped)                                  # (M,), -inf: no finite reward
        keep = spread > self.config.tolerance                          # (M,) bool
        if not keep.numel():
            return keep
        finite = ~torch.isnan(grouped)
        any_finite = finite.any(dim=1)
        level = grouped.nan_to_num(0.0).sum(dim=1) / finite.sum(dim=1).clamp(min=1)  # group mean
        constant = ~keep
        stats = torch.stack([
            constant,                                                  # every dropped group
            constant & any_finite & (level > 0),                       # all high (e.g. all correct)
            constant & any_finite & (level <= 0),                      # all low (e.g. all wrong)
            ~any_finite,                                               # no reward at all
        ]).float().mean(dim=1).tolist()                                # one host sync
        for name, value in zip(("constant_groups", "constant_high", "constant_low", "no_reward_groups"), stats):
            self.log_metric(batch, name, value)
        return keep
