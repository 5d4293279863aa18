"""PRIME: process reinforcement through implicit rewards, with an online implicit PRM as a second LoRA adapter.

Method. An implicit process reward model is a language model ``pi_phi`` read against a frozen reference
``pi_ref``: its per-token log-ratio ``q_t = log pi_phi(y_t | y_<t) - log pi_ref(y_t | y_<t)`` is a dense
reward whose sum is trained, online, on the outcome labels alone (cross-entropy), so no step labels are
ever needed. PRIME rewards every token with it and uses leave-one-out (RLOO) baselines over the K
completions of a prompt, for the process and the outcome reward. Here ``pi_phi`` is the auxiliary LoRA
adapter ``prm`` on the policy's (possibly 4-bit) base model and ``pi_ref`` is that base with adapters off.

Formula (group of K completions ``i``, ``o_i`` the outcome, ``m_it`` TRL's completion mask)::

    q_it   = (log pi_prm - log pi_ref)(y_it) * m_it
    PRM step (each batch, AdamW on the adapter only):
           L = mean_i BCE(sigmoid(beta * sum_t q_it), o_i)
    form "paper" (the paper's equations, gamma = 1):
           r_it = beta * q_it,  R_i = sum_t r_it,  b_i = (1/(K-1)) sum_{j != i} R_j
           A_it = sum_{s >= t} (r_is - b_i) m_is  +  o_i - (1/(K-1)) sum_{j != i} o_j
    form "code" (the released code, the default):
           q_it  <- q_it / (max_{batch} |sum_{s >= t} q_is| + 1e-6)                       (prime_norm=batch_norm)
           q~_it = (q_it * K/(K-1) - (1/(K-1)) sum_j mean_t(q_j)) * m_it                 (token-mean RLOO)
           o~_i  = o_i * K/(K-1) - (1/(K-1)) sum_j o_j, added at the last completion token
           A     = masked_whiten(reverse_cumsum(q~ + o~)) over every token of the batch   (unbiased variance)

``update: after`` (the script's setting, default) rewards with the PRM *before* this batch's step: the
scores come from the step's own forward pass, so scoring costs no extra pass. ``update: before`` trains
first and rescores with the updated PRM (one more no-grad pass).

Source: PRIME-RL/PRIME@18ad596f: ``training/verl/workers/actor/dp_prime.py`` (``compute_implicit_reward``
at token granularity, ``update_policy``: the CE step and the ``batch_norm`` rescale),
``training/verl/trainer/ppo/core_algos.py`` (``compute_rloo_returns``, ``compute_ce_dpo_loss_rm``,
``masked_whiten``), ``training/examples/run_prime_main.sh`` (beta 0.05, PRM lr 1e-6 at policy lr 5e-7,
grad clip 10, K = 4, ``update=after``). The paper form follows the paper's advantage equation
(methods.md 2.23 has both forms' test vectors).

Choices. The PRM's learning rate defaults to the run's ``learning_rate`` (PRIME's absolute 1e-6 is for
full fine-tuning; a LoRA adapter learns at LoRA rates). The outcome is the total reward (or the column
``reward``) and must lie in [0, 1] (a probability label); NaN outcomes ("no reward") count as 0 in the
advantages and are left out of the PRM loss. PRIME's accuracy filter ([0.2, 0.8] pass rate per prompt) is
not built in: enable ``accuracy_band`` before it, as PRIME's script does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from trl_credit import Adapter, Plugin, hookimpl

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch

__all__ = ["PRIME", "code_advantages", "code_returns", "leave_one_out_mean", "masked_whiten", "pairwise_auc",
           "paper_advantages", "reverse_cumsum"]


def reverse_cumsum(x: torch.Tensor) -> torch.Tensor:
    """``y_t = sum_{s >= t} x_s`` along the last dimension."""
    return x.flip(-1).cumsum(-1).flip(-1)


def leave_one_out_mean(x: torch.Tensor, k: int) -> torch.Tensor:
    """``(N,)`` the mean of the other ``k - 1`` values of each row's group of ``k``."""
    groups = x.reshape(-1, k)
    return ((groups.sum(1, keepdim=True) - groups) / (k - 1)).reshape(-1)


def paper_advantages(q: torch.Tensor, outcome: torch.Tensor, mask: torch.Tensor, k: int, beta: float) -> torch.Tensor:
    """``(N, T)``: ``sum_{s>=t} (beta q_is - b_i) m_is + o_i - LOO mean of o``, ``b_i`` the LOO mean of ``R_j``."""
    r = beta * q * mask
    baseline = leave_one_out_mean(r.sum(1), k)
    process = reverse_cumsum((r - baseline.unsqueeze(1)) * mask)
    return (process + (outcome - leave_one_out_mean(outcome, k)).unsqueeze(1)) * mask


def code_returns(q: torch.Tensor, outcome: torch.Tensor, mask: torch.Tensor, k: int, eps: float = 1e-6
                 ) -> torch.Tensor:
    """``(N, T)`` the released code's returns before whitening (batch_norm rescale, token-mean RLOO, outcome RLOO)."""
    import torch

    q = q * mask
    q = q / (reverse_cumsum(q).abs().max() + eps)
    lengths = mask.sum(1)
    means = q.sum(1) / lengths.clamp(min=1)
    group_sum = means.reshape(-1, k).sum(1, keepdim=True).expand(-1, k).reshape(-1)
    process = (q * k / (k - 1) - (group_sum / (k - 1)).unsqueeze(1)) * mask
    outcome_sum = outcome.reshape(-1, k).sum(1, keepdim=True).expand(-1, k).reshape(-1)
    last = (lengths.long() - 1).clamp(min=0)
    at_end = torch.zeros_like(process)
    at_end[torch.arange(q.shape[0], device=q.device), last] = (outcome * k / (k - 1) - outcome_sum / (k - 1))
    return reverse_cumsum(process + at_end * (lengths > 0).unsqueeze(1))


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the masked entries (unbiased variance), 0 off the mask."""
    n = mask.sum()
    mean = (x * mask).sum() / n.clamp(min=1)
    var = (((x - mean) ** 2) * mask).sum() / (n - 1).clamp(min=1)
    return (x - mean) * (var + eps).rsqrt() * mask


def code_advantages(q: torch.Tensor, outcome: torch.Tensor, mask: torch.Tensor, k: int) -> torch.Tensor:
    """The released code's advantages: batch-whitened `code_returns`."""
    return masked_whiten(code_returns(q, outcome, mask, k), mask)


def pairwise_auc(score: torch.Tensor, outcome: torch.Tensor, k: int) -> float | None:
    """Within-group AUC: of the pairs with different outcomes, the fraction the score orders like the outcome
    (ties count 1/2); None when no group has two different outcomes (PRIME's ``dpo_acc``). NaN outcomes
    are in no pair."""
    s, o = score.reshape(-1, k), outcome.reshape(-1, k)
    better = o.unsqueeze(2) > o.unsqueeze(1)  # [g, i, j]: o_i > o_j
    agree = (s.unsqueeze(2) > s.unsqueeze(1)).float() + 0.5 * (s.unsqueeze(2) == s.unsqueeze(1)).float()
    pairs = better.sum()
    return float((agree * better).sum() / pairs) if pairs > 0 else None


class PRIME(Plugin):
    """PRIME's estimator: implicit-PRM token rewards (an online "prm" LoRA adapter) and RLOO advantages."""

    name = "prime"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        beta: float = Field(0.05, gt=0, description="beta of the implicit PRM (beta_train): the CE logit is "
                                                   "beta * sum_t q_t; the paper form's token reward is beta * q_t")
        form: Literal["code", "paper"] = Field("code", description="advantage form: the released code's "
                                               "(batch_norm, token-mean RLOO, whitening) or the paper's equation")
        update: Literal["after", "before"] = Field("after", description="reward with the PRM before this "
                                                   "batch's step (after: free) or after it (before: one more pass)")
        lr: float | None = Field(None, gt=0, description="PRM adapter learning rate; null: the run's learning_rate")
        max_grad_norm: float = Field(10.0, gt=0, description="PRM gradient clip")
        init: Literal["policy", "fresh"] = Field("policy", description="PRM start: a copy of the policy adapter "
                                                 "(PRIME: the SFT model) or PEFT's fresh init (= the base model)")
        reward: str | None = Field(None, description="outcome reward column (values in [0, 1]); null: the total reward")

    def needs_reference(self) -> bool:
        return True  # q = log pi_prm - log pi_ref

    def adapters(self):
        return [Adapter("prm", init=self.config.init, lr=self.config.lr, max_grad_norm=self.config.max_grad_norm)]

    def required_rewards(self):
        return [self.config.reward] if self.config.reward else []

    def _outcome(self, batch: RolloutBatch) -> torch.Tensor:
        import torch

        outcome = batch.reward(self.config.reward) if self.config.reward else batch.total_reward()
        finite = outcome[~torch.isnan(outcome)]
        if finite.numel() and (finite.min() < 0 or finite.max() > 1):
            raise ValueError(f"the outcome ({self.config.reward or 'total reward'}) lies in [{float(finite.min()):g}, "
                             f"{float(finite.max()):g}]; PRIME's PRM is trained on labels in [0, 1]: set `reward:` to a "
                             "0/1 column or scale the reward")
        return outcome

    @hookimpl
    def compute_advantages(self, batch: RolloutBatch) -> torch.Tensor:
        import torch

        prm = self.adapter("prm")
        mask = batch.completion_mask.float()
        ref = batch.ref_logps()
        outcome = self._outcome(batch)
        labelled = (~torch.isnan(outcome)).float()
        label = outcome.nan_to_num(0.0)
        beta = self.config.beta

        def prm_loss(logps: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            logit = beta * ((logps - ref[rows]) * mask[rows]).sum(1)
            bce = torch.nn.functional.binary_cross_entropy_with_logits(logit, label[rows], reduction="none")
            return bce * labelled[rows]

        step = prm.update(batch, prm_loss)
        logps = step["logps"] if self.config.update == "after" else prm.logps(batch)
        q = (logps - ref) * mask
        before = ((step["logps"] - ref) * mask).sum(1)  # sequence score before the PRM saw these rollouts
        auc = pairwise_auc(before, outcome, batch.num_generations)  # pairs with a NaN outcome never count
        if auc is not None:  # an out-of-sample AUC of the implicit PRM
            self.log_metric(batch, "prm_auc", auc)
        self.log_metric(batch, "process_return", float((beta * q).sum(1).abs().mean()))
        k = batch.num_generations
        if k < 2:  # no leave-one-out baseline exists (TRL refuses num_generations < 2 anyway)
            return torch.zeros_like(q)
        if self.config.form == "paper":
            return paper_advantages(q, label, mask, k, beta)
        return code_advantages(q, label, mask, k)
