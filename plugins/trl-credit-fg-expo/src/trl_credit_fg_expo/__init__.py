"""FG-ExPO: Gaussian curriculum sampling (GCS) and accuracy-conditioned KL scaling (AKL).

Method. FG-ExPO ("Frontier-Guided Exploration-Prioritized Policy Optimization") adds two light
parts to GRPO. GCS draws training questions with weights that follow a Gaussian of the question's
running accuracy centred at a moderate level (about 0.5), so training concentrates on the model's
learning frontier, where groups are mixed and carry the most gradient. AKL replaces the fixed KL
coefficient by a smooth, increasing function of the batch's average accuracy: the KL constraint is
loose while the model fails (room to explore away from the reference) and tight once it succeeds.

Formulas (``p̂_q`` = running accuracy of question q, ``acc`` = mean accuracy of the batch)::

    GCS:  w_q ∝ max(exp(-(p̂_q - μ)² / (2σ²)), floor)
          p̂_q = (passed_q + α) / (seen_q + α + β)          (estimator "posterior", Beta(α, β) prior)
              | passed_q / seen_q, α/(α+β) if never seen    (estimator "raw")
    AKL:  β_t = β_min + (β_max - β_min) · sigmoid(k · (acc - c))

GCS reads the host's ``PromptStats``: a completion passes when its weighted total reward is
``>= stats.pass_threshold`` (host default 0.5). AKL counts the kept completions of the batch whose
``accuracy_reward`` column (default: the weighted total) is ``>= pass_threshold``; completions with
a NaN reward do not count. The batch's ``β_t`` replaces ``GRPOConfig.beta`` in TRL's loss
(``loss += β_t · KL``, k3 estimator) through the host's ``kl_coefficient`` hook.

Source: arXiv 2605.11403, abstract only; no code found. **Reconstructed from the abstract.**
Established there: the Gaussian shape of GCS, its centre "around 0.5", AKL as "a smooth nonlinear
function of batch average accuracy", increasing. **Not established** (all config options): σ
(default 0.2, the value of the methods.md test vector), the accuracy estimate and its prior
(default Beta(1, 1) posterior mean, so unseen prompts sit at 0.5 and few samples are shrunk), the
floor (default 0.01, below every Gaussian weight on [0, 1] when σ = 0.2, so it only acts for
narrower σ), AKL's functional form (the suggested logistic), its range (default β_min = 0, β_max =
0.04: 0.04 is the DeepSeekMath GRPO coefficient and TRL's former default, 0 TRL's current default),
steepness k = 10 and centre c = 0.5 (the same moderate accuracy as GCS), the accuracy column and
the pass threshold (0.5, the host's own).

Both parts switch independently (``gcs``, ``akl``): a part switched off is reported to the host by
``disabled_hooks()`` and never called (``akl: false``: ``GRPOConfig.beta`` is used and no reference
model is needed; ``gcs: false``: TRL's uniform sampler).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trl_credit import Plugin, hookimpl

if TYPE_CHECKING:
    import torch

    from trl_credit import PromptStats, RolloutBatch

__all__ = ["FGExPO", "akl_beta", "gcs_weights"]


def gcs_weights(p_hat: torch.Tensor, mu: float, sigma: float, floor: float = 0.0) -> torch.Tensor:
    """``(P,)`` accuracies -> ``(P,)`` unnormalised weights ``max(exp(-(p̂ - μ)² / (2σ²)), floor)``."""
    w = p_hat - mu                                        # a fresh tensor: the rest runs in place
    return w.square_().mul_(-0.5 / (sigma * sigma)).exp_().clamp_(min=floor)


def akl_beta(acc: float, beta_min: float, beta_max: float, k: float, c: float) -> float:
    """``β = β_min + (β_max - β_min) · sigmoid(k · (acc - c))`` (overflow-safe logistic)."""
    x = k * (acc - c)
    s = 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))
    return beta_min + (beta_max - beta_min) * s


class FGExPO(Plugin):
    """FG-ExPO: w_q ∝ exp(-(p̂_q - μ)²/(2σ²)) prompt curriculum and β_t = β_min + Δβ·sigmoid(k(acc - c)).

    Reconstructed from the abstract of arXiv 2605.11403; σ, the accuracy prior, the floor and every
    AKL constant are not established there and are options.
    """

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        gcs: bool = Field(True, description="Gaussian curriculum sampling on (prompt_weights); false = uniform")
        akl: bool = Field(True, description="accuracy-conditioned KL on (kl_coefficient); false = GRPOConfig.beta")
        mu: float = Field(0.5, ge=0.0, le=1.0,
                          description="GCS centre μ: the accuracy favoured most (abstract: around 0.5)")
        sigma: float = Field(0.2, gt=0.0,
                             description="GCS width σ (not established; 0.2 = the methods.md test value)")
        estimator: Literal["posterior", "raw"] = Field(
            "posterior",
            description="running accuracy p̂_q: 'posterior' = Beta(prior_alpha, prior_beta) posterior mean "
            "(shrinks few samples, unseen = prior mean); 'raw' = passed/seen, unseen = prior mean")
        prior_alpha: float = Field(1.0, gt=0.0, description="Beta prior α (pseudo-passes) of p̂_q (not established)")
        prior_beta: float = Field(1.0, gt=0.0, description="Beta prior β (pseudo-fails) of p̂_q (not established)")
        floor: float = Field(
            0.01, ge=0.0, le=1.0,
            description="minimum unnormalised GCS weight so that no prompt is starved (not established; "
            "inactive for σ = 0.2, whose smallest weight on [0, 1] is 0.0439)")
        beta_min: float = Field(0.0, ge=0.0, description="AKL β at very low accuracy (not established)")
        beta_max: float = Field(0.04, ge=0.0, description="AKL β at very high accuracy (not established; "
                                "0.04 = DeepSeekMath GRPO)")
        k: float = Field(10.0, gt=0.0, description="AKL steepness k of the logistic (not established)")
        c: float = Field(0.5, description="AKL centre c: the accuracy where β is halfway (not established)")
        accuracy_reward: str | None = Field(
            None, description="reward column AKL's accuracy reads; None = the weighted total reward")
        pass_threshold: float = Field(
            0.5, description="a kept completion counts as correct for AKL when its reward is >= this")

        @model_validator(mode="after")
        def _ordered(self):
            if self.beta_max < self.beta_min:
                raise ValueError(f"beta_max ({self.beta_max}) must be >= beta_min ({self.beta_min})")
            return self

    def __init__(self, config: Config | None = None):
        super().__init__(config)
        self.last_accuracy = self.config.c  # used when a batch has no countable completion
        self._effective_fraction: float | None = None

    def required_rewards(self) -> list[str]:
        """The reward column AKL reads (none for the weighted total, or when AKL is off)."""
        cfg = self.config
        return [cfg.accuracy_reward] if cfg.akl and cfg.accuracy_reward is not None else []

    def disabled_hooks(self) -> list[str]:
        """The parts switched off: the host then never calls them (and a GCS-only run needs no reference)."""
        cfg = self.config
        off = [] if cfg.gcs else ["prompt_weights"]
        return off + ([] if cfg.akl else ["kl_coefficient"])

    # ------------------------------------------------------------------ GCS
    def accuracy_estimate(self, stats: PromptStats) -> torch.Tensor:
        """``(P,)`` float64 p̂_q from the host's statistics (see ``estimator``)."""
        import torch

        cfg = self.config
        if cfg.estimator == "posterior":
            return stats.posterior_mean(cfg.prior_alpha, cfg.prior_beta)
        prior = cfg.prior_alpha / (cfg.prior_alpha + cfg.prior_beta)
        return torch.nan_to_num(stats.pass_rate(), nan=prior)

    @hookimpl
    def prompt_weights(self, stats: PromptStats, step: int) -> torch.Tensor | None:
        cfg = self.config
        if not cfg.gcs:
            return None
        w = gcs_weights(self.accuracy_estimate(stats), cfg.mu, cfg.sigma, cfg.floor)   # (P,)
        if w.numel():
            self._effective_fraction = float(w.sum().square() / w.dot(w).clamp(min=1e-300)) / w.numel()
        return w

    # ------------------------------------------------------------------ AKL
    def batch_accuracy(self, batch: RolloutBatch) -> float | None:
        """Fraction of kept completions with a finite reward that pass; None when there are none."""
        import torch

        cfg = self.config
        r = batch.reward(cfg.accuracy_reward) if cfg.accuracy_reward is not None else batch.total_reward()
        counted = batch.kept & ~torch.isnan(r)
        passed = counted & (r >= cfg.pass_threshold)
        n, p = torch.stack([counted.sum(), passed.sum()]).tolist()   # one host sync
        return p / n if n else None

    @hookimpl
    def kl_coefficient(self, batch: RolloutBatch) -> float | None:
        cfg = self.config
        if not cfg.akl:
            return None
        acc = self.batch_accuracy(batch)
        if acc is None:  # nothing to measure: keep the last accuracy (c before the first batch)
            acc = self.last_accuracy
        self.last_accuracy = acc
        beta = akl_beta(acc, cfg.beta_min, cfg.beta_max, cfg.k, cfg.c)
        self.log_metric(batch, "accuracy", acc)
        self.log_metric(batch, "beta", beta)
        return beta

    @hookimpl
    def on_batch_end(self, batch: RolloutBatch) -> None:
        if self.config.gcs and self._effective_fraction is not None:
            # (Σw)² / Σw² / P: 1 = uniform; small = the curriculum concentrates on few prompts
            self.log_metric(batch, "gcs_effective_fraction", self._effective_fraction)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"last_accuracy": self.last_accuracy}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_accuracy = float(state["last_accuracy"])
