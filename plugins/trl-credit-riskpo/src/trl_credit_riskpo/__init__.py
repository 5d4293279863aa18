"""RiskPO: Mixed-VaR advantages over bundles of questions.

Method. Instead of scoring each response against its own group, RiskPO bundles K consecutive
prompts into one "exam". With G responses per prompt, paper p (p = 0..G-1) is the p-th response to
every question of the bundle and its score is the sum of their rewards. The G paper scores of a
bundle form an empirical distribution; each paper is rewarded by a risk measure of that
distribution: a range-VaR term (credit for where the paper sits between the alpha- and
beta-quantiles) mixed with a lower-tail CVaR term (a penalty for papers below the alpha-quantile),
then scaled by the bundle's paper-score std. The paper's value is finally split among its K
responses (credit assignment). Risk-seeking in the bulk, risk-averse in the lower tail.

Formula (bundle b, question q = 1..K, paper p = 1..G, r the reward, eps = 1e-6)::

    S_p   = sum_q r_{q,p}
    q_lo  = Quantile_alpha(S),  q_hi = Quantile_beta(S)        (linear interpolation; = S if G = 1)
    sigma = std(S)                                             (unbiased; 1 if G = 1)
    a_p   = [ (S_p - q_lo)^+ - (S_p - q_hi)^+  (+ q_lo - q_hi  if natural_baseline_adv) ] / (beta - alpha + eps)
    c_p   = -(q_lo - S_p)^+ / (alpha + eps)
    m_p   = (w c_p + a_p) / (w + 1)                            (w = 0: RVaR only)
    m_p  /= sigma + eps                                        (if norm_adv_by_std)

    uniform:   A_{q,p} = m_p
    std:       A_{q,p} = m_p / (s_q + eps),  s_q = std_p r_{q,p} (unbiased), 1 if s_q <= 1e-3
    sum-mean:  A_{q,p} = m_p (r_{q,p} - rbar_q) / sum_q' (r_{q',p} - rbar_q'),  m_p / K if |sum| <= 1e-6

Source: Ren et al. 2025, "RiskPO: Risk-based Policy Optimization via Verifiable Reward for LLM
Post-Training". [code] RTkenny/RiskPO@65ec40c9 ``verl/trainer/ppo/core_algos.py``
(``compute_grpo_bundle_rvar_outcome_advantage_quantile_tracking``), ``verl/trainer/ppo/ray_trainer.py``
(bundles of consecutive prompts: prompt ``i`` in bundle ``i // bundle_size``; the SGD quantile tracker) and
``scripts/run_qwen2.5_1.5b_MVaR_dapomath.sh``. Facts read there, code written here.

Defaults from the hard-math (DAPO-math) script: alpha = 0.2, beta = 0.8, bundle_size = 5, w = 1.5
(``use_mixing_risk_measure=True``), natural_baseline_adv = False, credit = "sum-mean",
norm_adv_by_std = True, eps = 1e-6 (the function default), lr_q = 0.1.

Quantile tracker (optional, ``track_quantiles``). The official trainer keeps SGD-tracked quantiles
q_j of the pooled paper scores for 19 levels tau_j = 0.05..0.95 (initialised to the empirical
quantiles of the first batch, then q_j <- q_j + lr_q (tau_j - mean 1[S < q_j]) once per batch).
The values are written into the batch's ``meta_info`` after the advantage was computed, so the
advantage the official trainer trains on uses the per-bundle empirical quantiles; this plugin does
the same and keeps the tracker as checkpointed state for monitoring only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trl_credit import ConfigError, Plugin, RunInfo, hookimpl

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch

__all__ = ["RiskPO", "TRACKER_LEVELS", "mixed_var_advantages"]

#: The 19 quantile levels the official trainer tracks (0.05, 0.10, ..., 0.95).
TRACKER_LEVELS = tuple(round(0.05 * j, 2) for j in range(1, 20))


def mixed_var_advantages(r: torch.Tensor, alpha: float, beta: float, w: float, credit: str,
                         natural_baseline_adv: bool, norm_adv_by_std: bool, eps: float):
    """``r`` ``(B, K, G)`` rewards (bundle, question, paper) -> ``(A (B, K, G), S (B, G), q (2, B))``."""
    import torch

    n_bundles, k, g = r.shape
    S = r.sum(dim=1)                                                      # (B, G) paper scores
    if g > 1:
        levels = torch.tensor([alpha, beta], dtype=S.dtype, device=S.device)
        q_lo, q_hi = torch.quantile(S, levels, dim=1, keepdim=True)      # (B, 1) each
        sigma = S.std(dim=1, keepdim=True)                                # (B, 1) unbiased
    else:                                                                 # one paper: q = S, sigma = 1
        q_lo, q_hi, sigma = S, S, torch.ones_like(S)
    a = (S - q_lo).clamp(min=0) - (S - q_hi).clamp(min=0)
    if natural_baseline_adv:
        a = a + (q_lo - q_hi)
    a = a / (beta - alpha + eps)
    c = -(q_lo - S).clamp(min=0) / (alpha + eps)
    m = (w * c + a) / (w + 1)
    if norm_adv_by_std:
        m = m / (sigma + eps)
    m = m.unsqueeze(1)                                                    # (B, 1, G)
    if credit == "uniform":
        A = m.expand(n_bundles, k, g)
    elif credit == "std":
        s = r.std(dim=2, keepdim=True) if g > 1 else torch.zeros_like(r[..., :1])
        s = torch.where(s > 1e-3, s, torch.ones_like(s))                 # (B, K, 1)
        A = m / (s + eps)
    elif credit == "sum-mean":
        ratio = r - r.mean(dim=2, keepdim=True)                           # (B, K, G)
        total = ratio.sum(dim=1, keepdim=True)                            # (B, 1, G)
        split = total.abs() > 1e-6
        A = torch.where(split, m * ratio / torch.where(split, total, torch.ones_like(total)), m / k)
    else:
        raise ValueError(f"unknown credit mode {credit!r}")
    return A, S, torch.cat([q_lo, q_hi], dim=1).T


class RiskPO(Plugin):
    """RiskPO Mixed-VaR advantage: bundle K prompts, score papers S_p = sum_q r_qp, credit
    m_p = [w CVaR_alpha + RVaR_alpha,beta] / (w + 1) / std(S) back to each response.
    Source: RTkenny/RiskPO@65ec40c9 verl/trainer/ppo/core_algos.py (see the module docstring)."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        bundle_size: int = Field(
            5, ge=1,
            description="K: consecutive prompt groups per bundle (official algorithm.bundle_size; the "
            "batch's number of groups must be a multiple of it)")
        alpha: float = Field(
            0.2, gt=0.0, lt=1.0, description="lower quantile level (official quantile_down; hard-math script 0.2)")
        beta: float = Field(
            0.8, gt=0.0, lt=1.0, description="upper quantile level (official quantile_up; hard-math script 0.8, "
            "easy-math 0.9)")
        w: float = Field(
            1.5, ge=0.0, description="mixing weight of the lower-tail CVaR term (official w_mix; 0 = RVaR only, "
            "i.e. use_mixing_risk_measure=False)")
        credit: Literal["uniform", "std", "sum-mean"] = Field(
            "sum-mean", description="how a paper's advantage is split among its K responses (official "
            "credit_assign_mode; hard-math script sum-mean, easy-math std)")
        natural_baseline_adv: bool = Field(
            False, description="add q_lo - q_hi to the RVaR term (official natural_baseline_adv; hard-math False)")
        norm_adv_by_std: bool = Field(
            True, description="divide the paper advantage by std of the bundle's paper scores (official "
            "norm_adv_by_std_in_grpo)")
        eps: float = Field(1e-6, gt=0.0, description="epsilon of every denominator (official epsilon)")
        track_quantiles: bool = Field(
            False, description="keep the official SGD quantile tracker (19 levels) as checkpointed state and "
            "log it; it does not change the advantages (as in the official trainer)")
        lr_q: float = Field(0.1, gt=0.0, description="tracker SGD step size (official algorithm.lr_q)")

        @model_validator(mode="after")
        def _ordered(self):
            if not self.alpha < self.beta:
                raise ValueError(f"alpha ({self.alpha}) must be < beta ({self.beta})")
            return self

    def __init__(self, config: Config | None = None):
        super().__init__(config)
        self.tracked: torch.Tensor | None = None  # (19,) float32 once initialised

    def check_args(self, run: RunInfo) -> None:
        """Bundles of ``bundle_size`` consecutive groups must tile every batch the estimator sees."""
        k = self.config.bundle_size
        if k == 1:  # every group is its own bundle: any number of groups, any filter
            return
        problems = []
        groups, g = run.groups_per_batch, getattr(run.args, "num_generations", None)
        if groups and groups % k:
            gen = getattr(run.args, "generation_batch_size", None)
            problems += ConfigError.for_key(
                "bundle_size", f"a generation batch holds {groups} prompt groups (generation_batch_size={gen} / "
                f"num_generations={g}), not a multiple of bundle_size={k}",
                f"make per_device_train_batch_size * num_processes * steps_per_generation (= generation_batch_size, "
                f"now {gen}) a multiple of bundle_size * num_generations = {k * g}, or set bundle_size to a "
                f"divisor of {groups}").problems
        filters = run.with_hook("filter_rollouts")  # RiskPO has no filter: these are the others
        if filters:
            names = ", ".join(f"plugins[{p.index}] ({p.key})" for p in filters)
            problems += ConfigError.for_key(
                "bundle_size", f"bundles of {k} consecutive prompt groups need every group of the batch, but "
                f"{names} filters rollouts: a group it drops is left out of the estimator's batch, so the bundles "
                "change (or no longer tile the batch)",
                f"remove {names} from plugins:, or set bundle_size: 1").problems
        if problems:
            raise ConfigError(problems)

    # ------------------------------------------------------------------ the estimator
    @hookimpl
    def compute_advantages(self, batch: RolloutBatch) -> torch.Tensor:
        import torch

        cfg = self.config
        k, g, groups = cfg.bundle_size, batch.num_generations, batch.num_groups
        if groups % k:
            gen = getattr(batch.args, "generation_batch_size", None)
            raise ValueError(
                f"riskpo: the batch holds {groups} prompt groups, not a multiple of bundle_size={k}. "
                f"Set GRPOConfig so that per_device_train_batch_size * num_processes * steps_per_generation "
                f"(= generation_batch_size, now {gen}) is a multiple of bundle_size * num_generations = {k * g}, "
                f"or change bundle_size; a filter plugin that drops whole groups also breaks the bundles")
        total = batch.total_reward().to(torch.float32)
        unscored = torch.isnan(total)
        r = total.nan_to_num(0.0).reshape(groups // k, k, g)                 # (B, K, G)
        A, S, q = mixed_var_advantages(r, cfg.alpha, cfg.beta, cfg.w, cfg.credit,
                                       cfg.natural_baseline_adv, cfg.norm_adv_by_std, cfg.eps)
        A = A.reshape(-1).masked_fill(unscored, 0.0)
        stats = [q[0].mean(), q[1].mean(), S.mean()]
        if cfg.track_quantiles:
            self._track(S.reshape(-1))
            lo, hi = (self._level_index(x) for x in (cfg.alpha, cfg.beta))
            stats += [self.tracked[lo].to(S.device), self.tracked[hi].to(S.device)]
        names = ("q_lo", "q_hi", "paper_score", "tracked_q_lo", "tracked_q_hi")
        for name, value in zip(names, torch.stack(stats).tolist()):       # one host sync
            self.log_metric(batch, name, value)
        return A

    # ------------------------------------------------------------------ quantile tracker
    def _track(self, scores: torch.Tensor) -> None:
        """First batch: empirical quantiles; later: q_j += lr_q (tau_j - mean 1[S < q_j])."""
        import torch

        scores = scores.detach().float().cpu()
        levels = torch.tensor(TRACKER_LEVELS, dtype=torch.float32)
        if self.tracked is None:
            self.tracked = torch.quantile(scores, levels)
        else:
            below = (scores.unsqueeze(0) < self.tracked.unsqueeze(1)).float().mean(dim=1)
            self.tracked = self.tracked + self.config.lr_q * (levels - below)

    @staticmethod
    def _level_index(level: float) -> int:
        return min(range(len(TRACKER_LEVELS)), key=lambda j: abs(TRACKER_LEVELS[j] - level))

    def state_dict(self) -> dict[str, Any]:
        return {"tracked": None if self.tracked is None else self.tracked.clone(),
                "levels": list(TRACKER_LEVELS)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        tracked = state.get("tracked")
        self.tracked = None if tracked is None else tracked.detach().float().cpu().clone()
