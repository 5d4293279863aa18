"""Throwaway plugins the host's tests register (never installed)."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field

from trl_credit import hookimpl


class Passthrough:
    """Observes every batch; changes nothing (forces the host's pipeline)."""

    def __init__(self, config=None):
        self.batches = 0

    @hookimpl
    def on_batch_end(self, batch, advantages):
        self.batches += 1


class AddBonus:
    """Adds a named reward column."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        bonus: float = Field(0.5, description="value of the new column")
        column: str = Field("bonus", description="column name")

    def __init__(self, config):
        self.config = config

    @hookimpl
    def shape_rewards(self, batch):
        return {self.config.column: torch.full((batch.num_completions,), self.config.bonus)}


class DropFirstGroup:
    """Drops group 0 of every batch."""

    def __init__(self, config=None):
        pass

    @hookimpl
    def filter_rollouts(self, batch):
        keep = torch.ones(batch.num_groups, dtype=torch.bool)
        keep[0] = False
        return keep


class DropAll:
    """Drops everything."""

    @hookimpl
    def filter_rollouts(self, batch):
        return torch.zeros(batch.num_groups, dtype=torch.bool)


class DropConstant:
    """Drops groups whose total rewards are all equal, with refill."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        refill: bool = Field(True, description="top up")
        max_refill_rounds: int = Field(3, description="bound")
        max_refill_tokens: int | None = Field(None, description="token budget")

    def __init__(self, config):
        self.config = config

    def refill(self):
        from trl_credit import Refill

        c = self.config
        return Refill(c.max_refill_rounds, c.max_refill_tokens) if c.refill else None

    @hookimpl
    def filter_rollouts(self, batch):
        r = batch.grouped(batch.total_reward())
        return (r.max(dim=1).values - r.min(dim=1).values) > 0


class TokenCredit:
    """(N,) -> (N, T): advantage times the token position weight 1..T (masked)."""

    @hookimpl
    def transform_advantages(self, batch, advantages):
        positions = torch.arange(1, batch.completion_ids.shape[1] + 1, dtype=torch.float32)
        return advantages.unsqueeze(1) * positions.unsqueeze(0) * batch.completion_mask


class ConstantEstimator:
    """Every completion gets advantage 1."""

    @hookimpl
    def compute_advantages(self, batch):
        return torch.ones(batch.num_completions)


class OtherEstimator(ConstantEstimator):
    """A second estimator."""


class Broken:
    """Returns a wrong shape."""

    @hookimpl
    def compute_advantages(self, batch):
        return torch.ones(batch.num_completions + 1)


class Raises:
    """Raises inside a hook."""

    @hookimpl
    def shape_rewards(self, batch):
        raise ZeroDivisionError("boom")


class MakesNaN:
    """Returns NaN advantages."""

    @hookimpl
    def transform_advantages(self, batch, advantages):
        return advantages * float("nan")


class UnknownHook:
    """Implements a hook that is not in the spec."""

    @hookimpl
    def compute_advantage(self, batch):  # typo: no such hook
        return None


class NeedsColumn:
    """Needs a dataset column."""

    def required_columns(self):
        return ["gold_entities"]

    @hookimpl
    def on_batch_end(self, batch, advantages):
        pass


class Counter:
    """Stateful: counts batches; state survives checkpoints."""

    def __init__(self, config=None):
        self.count = 0

    @hookimpl
    def on_batch_end(self, batch, advantages):
        self.count += 1

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


class PreferLowIndex:
    """Curriculum: only prompts 0..7 have weight."""

    @hookimpl
    def prompt_weights(self, stats, step):
        w = torch.zeros(stats.num_prompts)
        w[:8] = 1.0
        return w


class Scores:
    """Reads policy and reference scores and a continuation score; stores them for the test."""

    def __init__(self, config=None):
        self.seen = {}

    @hookimpl
    def on_batch_end(self, batch, advantages):
        self.seen["policy_logps"] = batch.policy_logps()
        self.seen["policy_entropies"] = batch.policy_entropies()
        self.seen["ref_logps"] = batch.ref_logps()
        self.seen["completion_ids"] = batch.completion_ids
        self.seen["completion_mask"] = batch.completion_mask
        self.seen["continuation"] = batch.continuation_logps(["What is 2 + 2?"], [" 4"], reduce="none")


class FixedBeta:
    """KL coefficient: a constant beta for every batch."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        beta: float = Field(0.05, description="the beta returned for every batch")

    def __init__(self, config=None):
        self.config = config or self.Config()

    @hookimpl
    def kl_coefficient(self, batch):
        return self.config.beta


class OtherBeta(FixedBeta):
    """A second KL-coefficient plugin (two are a startup error)."""


class Switchable:
    """A shaper and a KL coefficient, each switchable by an option (`disabled_hooks`)."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        shape: bool = Field(True, description="add a bonus column")
        kl: bool = Field(True, description="set beta")

    def __init__(self, config=None):
        self.config = config or self.Config()

    def disabled_hooks(self):
        return [h for h, on in (("shape_rewards", self.config.shape), ("kl_coefficient", self.config.kl)) if not on]

    @hookimpl
    def shape_rewards(self, batch):
        return {"bonus": torch.ones(batch.num_completions)}

    @hookimpl
    def kl_coefficient(self, batch):
        return 0.1


class AuxPRM:
    """Scores with an auxiliary "prm" adapter and takes one BCE step on the outcome each batch (a PRIME-like
    update); an optional "ema" adapter follows the policy. Changes no reward or advantage."""

    name = "aux_prm"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        init: str = "fresh"
        lr: float = 1e-2
        ema: float | None = None
        update: bool = True

    def __init__(self, config):
        self.config = config
        self.seen = []  # (prm log-probs before the update, loss) per batch

    def adapters(self):
        from trl_credit import Adapter

        found = [Adapter("prm", init=self.config.init, lr=self.config.lr)]
        if self.config.ema is not None:
            found.append(Adapter("ema", ema_decay=self.config.ema, ema_every=1))
        return found

    @hookimpl
    def shape_rewards(self, batch):
        from trl_credit.plugin import adapter_handle

        prm = adapter_handle(self, "prm")
        before = prm.logps(batch)
        label = batch.total_reward().nan_to_num(0.0).clamp(0, 1)
        ref = batch.ref_logps()
        mask = batch.completion_mask.float()

        def loss_fn(logps, rows):
            score = 0.05 * ((logps - ref[rows]) * mask[rows]).sum(1)
            return torch.nn.functional.binary_cross_entropy_with_logits(score, label[rows], reduction="none")

        expected = float(loss_fn(before, torch.arange(batch.num_completions)).mean())  # at the weights before the step
        result = prm.update(batch, loss_fn) if self.config.update else None
        self.seen.append((before.clone(), result, expected))
        return None
