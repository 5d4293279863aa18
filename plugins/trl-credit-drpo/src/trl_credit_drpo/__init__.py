"""DRPO / DisCO: a decoupled discriminative objective, turned into GRPO advantages.

Method. DisCO replaces GRPO's group-normalised surrogate by a discriminative objective per
question q: raise the score of every correct answer and lower a soft maximum (log-sum-exp at
temperature tau) of the scores of the wrong ones, with a KL trust-region constraint instead of
clipping. DRPO keeps the negative term and re-weights the positives by a softmax over their
length ratios, so that short correct answers get most of the push. Groups that are all correct or
all wrong carry no signal and are dropped. This plugin implements the objective through its
gradient: at the on-policy point (``num_iterations = 1``, ratio = 1) the gradient of TRL's
``loss_type="grpo"`` loss with the advantages below equals the gradient of the DRPO objective.

Objective (per question q; pos = {r_i = 1}, neg = {r_j = 0}; s_i = mean token log-prob of o_i
("logL") or mean token ratio pi/pi_old ("Lratio"); l_i = |o_i| / L_max)::

    J_q = sum_{i in pos} w_i s_i  -  tau * (sum_{j in neg} e^{s_j/tau}) / sg(sum_{j in neg} e^{s_j/tau})
    w_i = e^{(1 - l_i)/lambda} / sum_{i' in pos} e^{(1 - l_i')/lambda}        (DRPO)
    w_i = 1 / |pos|                                                            (DisCO)
    loss = -(1/Q) sum_q J_q   (+ KL constraint, not implemented here)

Advantage-equivalent form (grad s_i = grad of the per-sequence token-mean log-prob)::

    A_i = G * w_i                                     for i in pos
    A_j = -G * softmax_{j in neg}(s_j / tau)          for j in neg
    A   = 0                                           in groups without both a positive and a negative

The factor G (= num_generations) turns TRL's mean over the Q*G sequences into DRPO's 1/Q.

Papers: "DRPO: Efficient Reasoning via Decoupled Reward Policy Optimization"; "DisCO: Reinforcing
Large Reasoning Models with Discriminative Constrained Optimization".
Source: [code] Optimization-AI/DRPO@405f7026 ``verl/verl/trainer/ppo/core_algos.py::
compute_policy_loss_drpo`` (re-read at 28c75861: weight ``exp((1 - length_ratio)/tau2)``, length
ratio = mask sum / padded response width, positives ``reward == 1``, negatives ``reward == 0``,
questions without both dropped but counted in ``num_questions``); DisCO: Optimization-AI/DisCO@bd2b0781
same file, ``compute_policy_loss_disco_logL`` / ``_Lratio``. The advantage form is our derivation
(d/dtheta of tau * S / sg(S) is sum_j softmax_j(s/tau) grad s_j).

Defaults: ``lambda = 0.1`` (``tau2=0.1`` in ``scripts/train/run_drpo_1.5b_8k.sh``), ``tau = 10``
(``tau=10`` there, and in the DisCO-logL scripts; the DisCO-Lratio scripts use tau = 1, which does not change the
on-policy advantages because every Lratio score is then 1), ``score = "logL"``, ``L_max`` =
``GRPOConfig.max_completion_length`` (verl's padded width is ``max_response_length``; TRL pads only
to the batch's longest completion, so its width must not be used).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from trl_credit import ConfigError, Plugin, RunInfo, hookimpl

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch

__all__ = ["DRPO", "drpo_advantages"]


def drpo_advantages(
    rewards: torch.Tensor,
    scores: torch.Tensor,
    length_ratio: torch.Tensor,
    valid_rows: torch.Tensor,
    num_generations: int,
    *,
    lam: float | None,
    tau: float,
    threshold: float | None = None,
) -> torch.Tensor:
    """Per-sequence DRPO advantages, before the factor G.

    :param rewards: ``(N,)`` float rewards (NaN: no reward).
    :param scores: ``(N,)`` s_i (mean token log-prob, or 1 for Lratio at the on-policy point).
    :param length_ratio: ``(N,)`` l_i = |o_i| / L_max.
    :param valid_rows: ``(N,)`` bool; rows outside it are neither positive nor negative.
    :param lam: lambda of the length weights; ``None`` = uniform positive weights (DisCO).
    :param tau: temperature of the soft maximum over negatives.
    :param threshold: ``None``: positive iff r == 1, negative iff r == 0 (official code);
        else positive iff r >= threshold, negative iff r < threshold.
    :return: ``(N,)`` float32: +w_i on positives, -softmax_j(s/tau) on negatives, 0 elsewhere.
    """
    import torch

    g = num_generations
    r = rewards.reshape(-1, g)                                          # (Q, G)
    ok = valid_rows.reshape(-1, g) & ~torch.isnan(r)
    if threshold is None:
        pos, neg = ok & (r == 1), ok & (r == 0)
    else:
        pos, neg = ok & (r >= threshold), ok & (r < threshold)
    valid = (pos.any(dim=1) & neg.any(dim=1)).unsqueeze(1)               # (Q, 1): both sets non-empty
    s = scores.reshape(-1, g).to(torch.float32)
    l = length_ratio.reshape(-1, g).to(torch.float32)
    pos_logit = (1.0 - l) / lam if lam is not None else torch.zeros_like(l)
    w = torch.softmax(pos_logit.masked_fill(~pos, -torch.inf), dim=1)  # w_i over positives (NaN rows: no pos)
    p = torch.softmax((s / tau).masked_fill(~neg, -torch.inf), dim=1)  # softmax_j(s_j/tau) over negatives
    zero = torch.zeros_like(s)
    adv = torch.where(pos, w, zero) - torch.where(neg, p, zero)
    return torch.where(valid, adv, zero).reshape(-1)


class DRPO(Plugin):
    """DRPO/DisCO: A_i = G*w_i (positives), A_j = -G*softmax_neg(s_j/tau) (negatives), 0 otherwise."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid", populate_by_name=True)

        mode: Literal["drpo", "disco"] = Field(
            "drpo",
            description="drpo: positives weighted by softmax((1 - l_i)/lambda), l_i = |o_i|/max_completion_length; "
            "disco: uniform positive weights 1/|pos|",
        )
        lambda_: float = Field(
            0.1, gt=0.0, alias="lambda",
            description="DRPO length-weight temperature (official Lambda/tau2 = 0.1); smaller favours short "
            "correct answers more strongly; lambda -> inf gives DisCO; unused in disco mode",
        )
        tau: float = Field(
            10.0, gt=0.0,
            description="temperature of the soft maximum over negative scores (DRPO and DisCO-logL scripts: 10; "
            "DisCO-Lratio scripts: 1, equivalent on-policy)",
        )
        score: Literal["logL", "Lratio"] = Field(
            "logL",
            description="s_i: logL = mean token log-prob under the current policy (needs a no-grad policy scoring "
            "pass); Lratio = mean token ratio pi/pi_old, which is 1 for every completion at the on-policy point",
        )
        threshold: float | None = Field(
            None,
            description="null: positive iff reward == 1, negative iff reward == 0, other values ignored "
            "(official code); a number: positive iff reward >= threshold, negative otherwise",
        )
        reward: str | None = Field(
            None,
            description="reward column that decides correctness; null = the weighted total reward (as TRL sums it)",
        )

    def __init__(self, config: Config | None = None):
        super().__init__(config)
        self._warned: set[str] = set()

    def required_rewards(self) -> list[str]:
        """The reward column the host must find among the reward functions (none for the total)."""
        return [self.config.reward] if self.config.reward is not None else []

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"drpo: {message}", stacklevel=3)

    def check_args(self, run: RunInfo) -> None:
        """The advantages are DRPO's gradient only under TRL's ``loss_type="grpo"`` aggregation."""
        loss_type = getattr(run.args, "loss_type", None)
        if loss_type != "grpo":
            raise ConfigError.for_key(
                "loss_type", f"the advantages equal the DRPO gradient only with loss_type 'grpo' (per-sequence "
                f"token mean, mean over sequences); got {loss_type!r}", "set `loss_type: grpo` in the config")

    def _warn_args(self, args: Any) -> None:
        """Run-time warnings: settings that make the advantages an approximation (``check_args`` rejects the rest)."""
        loss_type = getattr(args, "loss_type", None)
        if loss_type != "grpo":  # only unit batches get here: a run with another loss_type fails check_args
            self._warn_once("loss_type", f"the advantages equal the DRPO gradient only with "
                            f"GRPOConfig(loss_type='grpo'); got loss_type={loss_type!r}")
        iterations = getattr(args, "num_iterations", 1)
        if iterations != 1:
            self._warn_once("num_iterations", f"num_iterations={iterations}: exact only for the first pass over a "
                            "batch (ratio = 1); later passes reuse these advantages under PPO clipping instead "
                            "of DRPO's KL constraint")
        per_generation = getattr(args, "steps_per_generation", None)
        accumulation = getattr(args, "gradient_accumulation_steps", None)
        if per_generation is not None and accumulation is not None and per_generation > accumulation:
            self._warn_once("steps_per_generation", f"steps_per_generation={per_generation} > "
                            f"gradient_accumulation_steps={accumulation}: only the first optimiser step of each "
                            "generation batch is on-policy, later ones are approximations")

    @hookimpl
    def compute_advantages(self, batch: RolloutBatch) -> torch.Tensor:
        import torch

        cfg = self.config
        self._warn_args(batch.args)
        r = batch.reward(cfg.reward) if cfg.reward is not None else batch.total_reward()
        lengths = batch.completion_lengths
        nonempty = lengths > 0                       # an empty completion has no tokens to train
        if cfg.score == "logL":
            s = batch.mean_policy_logps()
        else:                                        # on-policy: pi/pi_old = 1 for every token
            s = torch.ones(batch.num_completions, device=batch.device)
        ell = lengths.to(torch.float32) / float(batch.max_completion_length)
        lam = cfg.lambda_ if cfg.mode == "drpo" else None
        a = drpo_advantages(r.to(torch.float32), s, ell, nonempty, batch.num_generations,
                            lam=lam, tau=cfg.tau, threshold=cfg.threshold)
        g = batch.num_generations
        if cfg.threshold is None:
            finite = ~torch.isnan(r)
            other = finite & (r != 0) & (r != 1)
        else:
            other = torch.zeros_like(nonempty)
        used = batch.grouped(a != 0).any(dim=1)
        stats = torch.stack([used.float().mean(), other.float().mean()]).tolist()  # one host sync
        self.log_metric(batch, "valid_groups", stats[0])
        self.log_metric(batch, "ignored_rewards", stats[1])
        if stats[1] > 0:
            self._warn_once("non_binary", "rewards other than 0 and 1 are ignored (official code); set "
                            "`threshold` to split non-binary rewards into positives and negatives")
        return a * g
