"""PRM reward refinement, Clip and Delta, turned into token-level credit on top of GRPO.

Method. A process reward model (PRM) scores every reasoning step of a completion; summing those
scores as dense rewards invites reward hacking (repeat correct but unnecessary steps, collect more
reward). Gao et al. refine the step rewards so that the return of any trajectory is bounded above:
Clip subtracts a threshold and keeps only the negative part (a step can cost, never pay), Delta
replaces each step reward by its difference with the next one (the sum telescopes). The two
compose (Delta of the clipped rewards). Here each token's advantage is the estimator's outcome
advantage plus ``process_weight`` times the undiscounted reward-to-go of the refined step rewards
from the token's step on.

Formula (steps ``k = 1..K`` of one completion, PRM scores ``r_k``)::

    Clip(eta):   r~_k = min(r_k - eta, 0)
    Delta:       r~_k = r_k - r_{k+1}  (k < K),   r~_K = r_K  (last = keep)  or  0  (last = zero)
    Delta∘Clip:  Delta applied to the clipped rewards
    G_k        = sum_{j >= k} r~_j                                  (reward-to-go, gamma = 1)
    A_{i,t}    = A_i + process_weight * G_{step(t)}

With ``last = keep`` Delta's reward-to-go is ``G_k = r_k`` (the PRM score of the step itself); with
``last = zero`` it is ``r_k - r_K``. Optional (``normalize: group``): the raw step scores are first
normalised by the mean and std of all step scores of the completion's group, as in GRPO with process
supervision (DeepSeekMath, Shao et al. 2024, section 4.1.3); then ``eta`` is on that z-score scale.

Tokens: a completion is cut into steps at the regex ``pattern`` (default: newlines) with
``trl_credit.token_steps``. A token outside every step (a delimiter, leading/trailing whitespace, the
EOS token) takes the step before it (the first step for leading ones): the delimiter closes its step.
Padding gets no process credit; completions without steps, and completions whose every reward is
NaN (advantage 0 in GRPO), get the outcome advantage only.

Source: Gao, Xu, Ye, Liu, He, Fu, Mei, Wang, Wu 2024, "On Designing Effective RL Reward at Training
Time for LLM Reasoning", arXiv 2410.15115 (abstract and the review text; **paper-recalled**, no
official code located). The paper trains with PPO (a critic); this plugin adds the refined returns
to GRPO's group-normalised outcome advantage instead.

Defaults and constants **not established** (all options): ``eta = 0.5`` (the paper sweeps eta;
methods.md: pick about the mean PRM score; 0.5 is the midpoint of the built-in 0/1 checker, and
``eta: null`` uses the batch mean step score); ``mode = clip`` (the paper's first technique; which of
Clip, Delta or both it recommends is not established); ``last = keep`` (methods.md's reading, under
which the Delta sum telescopes to ``r_1``; some descriptions, and the paper's figure as described by
third parties, drop the last step, ``last = zero``); ``process_weight = 1.0``; ``normalize = none``
(re-centring the step rewards would make them positive for above-average steps, and a sum of
positive rewards can be farmed again, which is what Clip prevents). The step scorer defaults to the
built-in rule-based ``arithmetic`` checker, a deterministic stand-in for a PRM; plug a real PRM in
with ``scorer: my_pkg.prm:score_steps``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from trl_credit import Plugin, StepConfig, hookimpl

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch, RunInfo

__all__ = [
    "PRMClipDelta",
    "clip_rewards",
    "delta_rewards",
    "group_normalize_steps",
    "refine_rewards",
    "reward_to_go",
    "step_mask",
]


def _as_steps(r: Any) -> torch.Tensor:
    import torch

    r = torch.as_tensor(r, dtype=torch.float32)
    return r.unsqueeze(0) if r.dim() == 1 else r


def step_mask(r: torch.Tensor, counts: Any = None) -> torch.Tensor:
    """``(N, S)`` bool: True for real steps (the first ``counts[i]`` of row ``i``; all when None)."""
    import torch

    if counts is None:
        return torch.ones_like(r, dtype=torch.bool)
    counts = torch.as_tensor(counts, device=r.device)
    return torch.arange(r.shape[1], device=r.device).unsqueeze(0) < counts.unsqueeze(1)


def clip_rewards(r: Any, eta: float, counts: Any = None) -> torch.Tensor:
    """Clip: ``r~_k = min(r_k - eta, 0)``; ``r`` ``(S,)`` or ``(N, S)``, 0 past each row's ``counts``."""
    r = _as_steps(r)
    return (r - eta).clamp(max=0.0) * step_mask(r, counts)


def delta_rewards(r: Any, counts: Any = None, last: str = "keep") -> torch.Tensor:
    """Delta: ``r~_k = r_k - r_{k+1}`` for ``k < K``; ``r~_K = r_K`` (``last="keep"``) or 0 (``"zero"``)."""
    import torch

    r = _as_steps(r)
    valid = step_mask(r, counts)
    r = r * valid
    following = torch.cat([r[:, 1:], torch.zeros_like(r[:, :1])], dim=1)  # 0 past the last step
    out = r - following
    if last == "zero":
        is_last = valid & ~torch.cat([valid[:, 1:], torch.zeros_like(valid[:, :1])], dim=1)
        out = out.masked_fill(is_last, 0.0)
    elif last != "keep":
        raise ValueError(f"last must be 'keep' or 'zero', got {last!r}")
    return out * valid


def refine_rewards(r: Any, mode: str, eta: float = 0.5, last: str = "keep", counts: Any = None) -> torch.Tensor:
    """``mode`` in ``none | clip | delta | delta_clip`` (Delta of the clipped rewards)."""
    r = _as_steps(r)
    if mode == "none":
        return r * step_mask(r, counts)
    if mode == "clip":
        return clip_rewards(r, eta, counts)
    if mode == "delta":
        return delta_rewards(r, counts, last)
    if mode == "delta_clip":
        return delta_rewards(clip_rewards(r, eta, counts), counts, last)
    raise ValueError(f"unknown mode {mode!r}")


def reward_to_go(r: Any) -> torch.Tensor:
    """Undiscounted reward-to-go along the steps: ``G_k = sum_{j >= k} r_j`` (``(N, S)``)."""
    r = _as_steps(r)
    return r.flip(1).cumsum(1).flip(1)


def group_normalize_steps(r: Any, counts: Any, num_generations: int, eps: float = 1e-4) -> torch.Tensor:
    """``(r - mean) / (std + eps)`` with mean and std over every step of every completion in the
    group (DeepSeekMath process supervision); std unbiased, 0 when the group has < 2 steps."""
    import torch

    r = _as_steps(r)
    valid = step_mask(r, counts)
    n, s = r.shape
    vals = (r * valid).reshape(n // num_generations, num_generations * s)
    mask = valid.reshape_as(vals).to(r.dtype)
    count = mask.sum(1, keepdim=True)
    mean = vals.sum(1, keepdim=True) / count.clamp(min=1)
    var = (((vals - mean) * mask) ** 2).sum(1, keepdim=True) / (count - 1).clamp(min=1)
    std = torch.where(count > 1, var.sqrt(), torch.zeros_like(var))
    return (((vals - mean) / (std + eps)) * mask).reshape(n, s)



class PRMClipDelta(Plugin):
    """Token credit from refined PRM step rewards (Gao et al. 2024, arXiv 2410.15115).

    ``A_{i,t} = A_i + process_weight * sum_{j >= step(t)} r~_j`` with ``r~`` = Clip
    ``min(r - eta, 0)``, Delta ``r_k - r_{k+1}`` (last step kept or zeroed) or Delta of Clip, on
    the step scores of a configurable step scorer (default: the rule-based ``arithmetic`` checker).
    """

    class Config(StepConfig):
        mode: Literal["clip", "delta", "delta_clip", "none"] = Field(
            "clip",
            description="refinement of the step rewards: clip = min(r - eta, 0); delta = r_k - r_{k+1}; "
            "delta_clip = delta of the clipped rewards; none = raw step scores (the hackable baseline)",
        )
        eta: float | None = Field(
            0.5,
            description="Clip threshold (not established; the paper sweeps it, take about the mean step "
            "score); null = the batch mean step score",
        )
        last: Literal["keep", "zero"] = Field(
            "keep",
            description="Delta's last step: keep r_K (the sum telescopes to r_1) or zero (sum r_1 - r_K)",
        )
        process_weight: float = Field(
            1.0, description="weight of the process reward-to-go added to the outcome advantage (not established)"
        )
        normalize: Literal["none", "group"] = Field(
            "none",
            description="group = normalise the raw step scores by the mean/std over all steps of the group "
            "(DeepSeekMath process supervision) before refining; none = raw scores",
        )

    def check_args(self, run: RunInfo) -> None:
        """Refuse ``scorer_kwargs`` the step scorer does not take (it would fail at the first batch)."""
        self.config.check_scorer_kwargs()

    def process_returns(self, batch: RolloutBatch) -> torch.Tensor:
        """``(N, T)`` float32: ``G_{step(t)}`` for every completion token (0 on padding)."""
        import torch

        from trl_credit import pad_step_scores, step_scores, token_steps

        c = self.config
        _, scores = step_scores(batch, c.scorer, c.pattern, **c.scorer_kwargs)
        step_index, _ = token_steps(batch, c.pattern, fill=True)   # gap tokens take the step before them
        r, counts = pad_step_scores(scores, device=batch.device)
        scored = batch.scorable.to(batch.device)                                # GRPO gives unscorable rows 0
        counts = torch.where(scored, counts, 0)                                 # and they leave the statistics
        r = torch.where(scored.unsqueeze(1), r, 0.0)
        n, width = step_index.shape
        valid = step_mask(r, counts)
        has_steps = counts > 0
        self.log_metric(batch, "steps", counts.float().mean().item() if n else 0.0)
        if not bool(has_steps.any()):
            return torch.zeros((n, width), dtype=torch.float32, device=batch.device)
        self.log_metric(batch, "step_score", (r.sum() / valid.sum()).item())
        if c.normalize == "group":
            r = group_normalize_steps(r, counts, batch.num_generations)
        eta = c.eta
        if eta is None and c.mode in ("clip", "delta_clip"):
            eta = (r.sum() / valid.sum()).item()
            self.log_metric(batch, "eta", eta)
        refined = refine_rewards(r, c.mode, eta if eta is not None else 0.0, c.last, counts)
        returns = reward_to_go(refined)                                         # (N, S)
        per_token = returns.gather(1, step_index.clamp(min=0))                 # (N, T)
        per_token.masked_fill_((step_index < 0) | ~scored.unsqueeze(1), 0.0)
        self.log_metric(batch, "process_return", returns[:, 0][has_steps].mean().item())
        return per_token

    @hookimpl
    def transform_advantages(self, batch: RolloutBatch, advantages: torch.Tensor) -> torch.Tensor:
        base = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        process = self.process_returns(batch)                                   # fresh (N, T): update in place
        if self.config.process_weight != 1.0:
            process.mul_(self.config.process_weight)
        return process.add_(base.to(device=process.device, dtype=process.dtype))
