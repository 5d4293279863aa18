"""Scaf-GRPO: tiered in-prompt hints (concept -> strategy -> concrete step) for prompts whose learning stagnated.

Method (Scaf-GRPO). Train guidance-free for a warm-up; afterwards, a prompt whose rollouts keep failing
(the "learning cliff": all rewards zero, so GRPO's advantages vanish) is sampled again with a hint in
its prompt, the *minimal* tier of a ladder concept -> strategy -> concrete step that yields a success.
As this plugin runs it, for a round at optimiser step ``s`` and a plain group ``g`` of prompt ``p``::

    failed(g)    = all_i r_{g,i} < threshold                    (r: outcome_reward, or the total reward)
    streak(p)    = consecutive visits of p with failed(g)       (this one included; 0 after a success)
    stagnant(g)  = s >= W  and  streak(p) >= patience           (W: warmup_steps, or ceil(warmup_fraction * max_steps))
    request      = G completions y ~ pi_old(. | x (+) h_k(p))   for each stagnant group, tier k chosen below
    rho_t        = pi_theta(y_t | x, y_<t) / pi_old(y_t | x (+) h_k, y_<t)      (train_on_source, Guide's correction)

Tier choice, "the minimal tier that yields a success" (one round cannot know before generating which
tier succeeds, so two readings are offered, ``escalation``):

- ``across_visits`` (default): ``level(p)`` starts at tier 1 (concept); each time the hinted group of
  ``p`` at tier ``k`` is still all-fail (read in ``on_batch_end`` from the augmented rows' rewards),
  ``level(p) = min(k + 1, K)``; a hinted success keeps ``level(p) = k``; a plain success of ``p``
  (stagnation over) resets it to tier 1. The request uses the first usable tier ``>= level(p)``
  (else the highest usable one below). One hinted group per stagnant prompt and round.
- ``all_tiers``: every usable tier is requested at once (tier-major order, so a host cut at the
  round's group count drops the higher tiers first), and ``filter_rollouts`` keeps, per prompt, only
  the hinted group of the lowest tier with a success, ``min {k : any_i r_{k,i} >= threshold}``;
  the other hinted groups of that prompt (and all of them when none succeeded) are dropped.

Baseline (``baseline``): ``joint`` (default; methods.md 2.32: "compute the baseline on the combined
group"): the hinted group ``a`` and its source group ``s`` share one GRPO baseline, written over the
estimator's values on those ``2G`` rows by ``transform_advantages``::

    u = (r_{s,1..G}, r_{a,1..G});   A_j = (u_j - mean(u)) / (std(u) + 1e-4)
    (std: NaN-aware unbiased over u for scale_rewards=group, over the batch for batch; no division for none)

so the hinted successes are positives against the failed plain completions (an all-success hinted
group in a group of its own would get advantage 0). ``own``: the estimator's advantages unchanged
(the hinted group is its own GRPO group, as Guide's plugin does).

Source: "Scaf-GRPO: Scaffolded Group Relative Policy Optimization for Enhancing LLM Reasoning"
(abstract, ``papers/000``); methods.md 2.32 **[abstract-inferred]**. Established (abstract): the
learning cliff (persistent zero reward zeroes GRPO's advantage); minimal guidance only when the
model's independent learning has plateaued, diagnosed first; tiered in-prompt hints from abstract
concepts to concrete steps, the model building the solution itself. methods.md: a guidance-free
warm-up; tiers concept -> strategy -> concrete step; the minimal tier that yields a success.
CHOSEN here (not established): the warm-up length (``warmup_fraction`` 0.15 is a recollection of the
full paper, not in the abstract: verify); stagnation = all-fail on ``patience`` consecutive visits
(default 1: all-fail now), counted by this plugin per dataset row (``batch.prompt_index``; the
host's ``PromptStats`` is not visible in ``augment_rollouts``) and checkpointed; the two escalation
readings above; the joint ``2G`` baseline (the paper's group mixing is not expressible with whole
augmented groups, so a hinted group joins its source's baseline instead); the hinted completions
are trained after the plain prompt (``train_on_source``, Guide's correction; the abstract does not
say how Scaf-GRPO treats the hint in the loss); hints are dataset columns appended to the last user
message with ``template``; a hint that contains the reference answer is skipped (it would teach
copying) unless ``allow_answer_in_hint``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from trl_credit import Augmentation, ConfigError, Plugin, RunInfo, hookimpl, joint_advantages, source_keys, with_context

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch

__all__ = ["ScafGRPO", "failed_groups", "hinted_prompt", "joint_advantages"]

AUGMENTED = "trl_credit_augmented"  # the host's batch column: the request's context on augmented rows
SOURCE_PROMPT = "trl_credit_source_prompt"  # the host's batch column: the prompt the augmented group came from


def failed_groups(rewards: torch.Tensor, num_generations: int, threshold: float) -> torch.Tensor:
    """``(N // G,)`` bool: every completion of the group scored below ``threshold`` (NaN counts as a fail), and
    some completion was scored (a group no reward function scored is no failure: no hint is spent on it)."""
    import torch

    ok = torch.nan_to_num(rewards, nan=float("-inf")) >= threshold
    scored = ~torch.isnan(rewards).reshape(-1, num_generations).all(dim=1)
    return ~ok.reshape(-1, num_generations).any(dim=1) & scored


def hinted_prompt(prompt: Any, hint: str, template: str) -> Any:
    """The prompt with ``template.format(hint=hint)`` appended to its last user message (or to the string)."""
    return with_context(prompt, template.format(hint=hint), "user", separator=" ")


class ScafGRPO(Plugin):
    """Scaf-GRPO: after a warm-up, stagnant all-fail prompts get the minimal tier of hints (concept/strategy/step)."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        tier_columns: list[str] = Field(
            ["hint_concept", "hint_strategy", "hint_step"], min_length=1,
            description="dataset columns with each prompt's hints, from the most abstract tier to the most concrete")
        template: str = Field("Hint: {hint}", description="text appended to the last user message; {hint} = hint")
        outcome_reward: str | None = Field(
            None, description="reward column that decides failure; null = the weighted total reward (TRL's)")
        threshold: float = Field(0.5, description="a completion fails when its reward is below this")
        warmup_steps: int | None = Field(
            None, ge=0, description="guidance-free optimiser steps before any hint; null: warmup_fraction of max_steps")
        warmup_fraction: float = Field(
            0.15, ge=0.0, le=1.0, description="warm-up as a fraction of max_steps when warmup_steps is null "
            "(0.15: recalled from the full paper, not in the abstract)")
        patience: int = Field(
            1, ge=1, description="a prompt stagnates when all-fail on this many consecutive visits (1: all-fail now)")
        escalation: Literal["across_visits", "all_tiers"] = Field(
            "across_visits", description="across_visits: one tier per visit, one tier up after an all-fail hinted "
            "group; all_tiers: every tier at once, only the lowest tier with a success is kept (filter)")
        placement: Literal["own_group", "replace"] = Field(
            "own_group", description="own_group: the hinted completions are a new group; replace: they take the "
            "stagnant group's place (its all-fail completions leave the batch)")
        baseline: Literal["joint", "own"] = Field(
            "joint", description="joint: a hinted group shares one GRPO baseline with its source group (2G rewards); "
            "own: the estimator's advantages (the hinted group is its own group)")
        train_on_source: bool = Field(
            True, description="train the hinted completions after the plain prompt with the hinted log-probs as "
            "behaviour policy (Guide's un-hinted ratio); false: train after the hinted prompt")
        answer_column: str | None = Field(
            "answer", description="reference answer column for the leak check; null: no check")
        allow_answer_in_hint: bool = Field(False, description="use hints that contain the reference answer")
        max_groups: int | None = Field(None, ge=1, description="at most this many hinted prompts per round; null: all")

    def __init__(self, config: BaseModel | None = None):
        super().__init__(config)
        self.streak: dict[int, int] = {}  # dataset row -> consecutive all-fail plain visits
        self.level: dict[int, int] = {}  # dataset row -> next tier (0-based) under across_visits

    # ------------------------------------------------------------------ declarations
    def contexts(self) -> dict[str, int]:
        """The ``Augmentation.context`` of each tier (stored in the host's augmented column) -> tier (0-based)."""
        return {f"scaf_grpo tier {k + 1}: {col}": k for k, col in enumerate(self.config.tier_columns)}

    def required_rewards(self) -> list[str]:
        return [self.config.outcome_reward] if self.config.outcome_reward else []

    def required_columns(self) -> list[str]:
        cfg = self.config
        leak = [cfg.answer_column] if cfg.answer_column and not cfg.allow_answer_in_hint else []
        return [*cfg.tier_columns, *leak]

    def disabled_hooks(self) -> list[str]:
        cfg = self.config
        return ([] if cfg.escalation == "all_tiers" else ["filter_rollouts"]) + \
            ([] if cfg.baseline == "joint" else ["transform_advantages"])

    def check_args(self, run: RunInfo) -> None:
        cfg = self.config
        if "{hint}" not in cfg.template:
            raise ConfigError.for_key("template", f"{cfg.template!r} has no {{hint}} placeholder",
                                      "write it like 'Hint: {hint}'")
        if len(set(cfg.tier_columns)) != len(cfg.tier_columns):
            raise ConfigError.for_key("tier_columns", f"{cfg.tier_columns} names a column twice",
                                      "list each hint column once, most abstract first")
        if cfg.baseline == "joint" and cfg.placement == "replace":
            raise ConfigError.for_key("baseline", "'joint' shares the baseline with the source group, which "
                                      "placement 'replace' removes from the batch",
                                      "set `baseline: own` or `placement: own_group`")
        max_steps = getattr(run.args, "max_steps", -1)
        if cfg.warmup_steps is None and cfg.warmup_fraction > 0 and (max_steps is None or max_steps <= 0):
            raise ConfigError.for_key("warmup_steps", f"null, and warmup_fraction {cfg.warmup_fraction} needs "
                                      f"max_steps > 0 (got {max_steps}: an epoch-based run)",
                                      "set `warmup_steps` to the number of guidance-free steps, or set max_steps")

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"streak": dict(self.streak), "level": dict(self.level)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.streak = {int(k): int(v) for k, v in state.get("streak", {}).items()}
        self.level = {int(k): int(v) for k, v in state.get("level", {}).items()}

    # ------------------------------------------------------------------ helpers
    def warmup(self, args: Any) -> int:
        """``W``: hints from optimiser step ``W`` on."""
        cfg = self.config
        if cfg.warmup_steps is not None:
            return cfg.warmup_steps
        max_steps = getattr(args, "max_steps", None)
        if cfg.warmup_fraction == 0:
            return 0
        if not max_steps or max_steps <= 0:
            raise ValueError(f"scaf_grpo: warmup_fraction {cfg.warmup_fraction} needs max_steps > 0 "
                             f"(got {max_steps}); set warmup_steps")
        return math.ceil(cfg.warmup_fraction * max_steps)

    def _outcome(self, batch: RolloutBatch) -> torch.Tensor:
        cfg = self.config
        return batch.reward(cfg.outcome_reward) if cfg.outcome_reward else batch.total_reward()

    def _passed(self, batch: RolloutBatch) -> torch.Tensor:
        import torch

        return torch.nan_to_num(self._outcome(batch), nan=float("-inf")) >= self.config.threshold

    def _row_tiers(self, batch: RolloutBatch) -> torch.Tensor | None:
        """``(N,)`` long: the tier (0-based) of this plugin's hinted rows, -1 elsewhere; None without marks."""
        import torch

        marks = batch.columns.get(AUGMENTED)
        if not marks:
            return None
        tier_of = self.contexts()
        return torch.tensor([tier_of.get(m, -1) for m in marks], dtype=torch.long, device=batch.device)

    def _usable(self, batch: RolloutBatch, first: int) -> tuple[list[int], int]:
        """Tiers (0-based) with a non-empty hint for the group starting at row ``first``; and leaky ones skipped."""
        cfg = self.config
        answer = None
        if cfg.answer_column and not cfg.allow_answer_in_hint:
            answer = str(batch.column(cfg.answer_column)[first]).strip() or None
        usable, leaky = [], 0
        for k, col in enumerate(cfg.tier_columns):  # a loop over the (few) tiers
            hint = batch.column(col)[first]
            if hint is None or not str(hint).strip():
                continue
            if answer is not None and answer in str(hint):
                leaky += 1
                continue
            usable.append(k)
        return usable, leaky

    # ------------------------------------------------------------------ hooks
    @hookimpl
    def augment_rollouts(self, batch: RolloutBatch) -> list[Augmentation]:
        import torch

        cfg, g = self.config, batch.num_generations
        failed = failed_groups(self._outcome(batch), g, cfg.threshold)  # (M,); a group with no verdict is no failure
        marks = batch.columns.get(AUGMENTED) or [None] * batch.num_completions
        index = batch.prompt_index.tolist()
        streaks = []
        for gi, f in enumerate(range(0, batch.num_completions, g)):  # per-prompt counters: a loop over groups
            p = int(index[f])
            if marks[f] is not None:  # already augmented (not a visit of the prompt)
                streaks.append(0)
                continue
            run = self.streak.get(p, 0) + 1 if bool(failed[gi]) else 0
            if p >= 0:
                if run:
                    self.streak[p] = run
                else:
                    self.streak.pop(p, None)
                    self.level.pop(p, None)  # stagnation over: the next one starts at the concept tier
            streaks.append(run)
        stagnant = failed & (torch.tensor(streaks, device=batch.device) >= cfg.patience)
        active = batch.step >= self.warmup(batch.args)
        self.log_metric(batch, "stagnant_groups", stagnant.float().mean().item() if batch.num_groups else 0.0)
        self.log_metric(batch, "in_warmup", float(not active))
        if not active:
            self.log_metric(batch, "hinted_groups", 0.0)
            return []
        per_group, leaky = [], 0
        for gi in stagnant.nonzero().squeeze(1).tolist():  # a loop over stagnant groups
            if cfg.max_groups is not None and len(per_group) >= cfg.max_groups:
                break
            first = gi * g
            usable, skipped = self._usable(batch, first)
            leaky += skipped
            if not usable:
                continue
            if cfg.escalation == "all_tiers":
                tiers = usable
            else:
                level = self.level.get(int(index[first]), 0)
                above = [k for k in usable if k >= level]
                tiers = [above[0] if above else usable[-1]]
            per_group.append((gi, tiers))
        contexts = list(self.contexts())
        requests = []
        for rank in range(max((len(t) for _, t in per_group), default=0)):  # tier-major: a cut drops high tiers
            for gi, tiers in per_group:
                if rank < len(tiers):
                    k = tiers[rank]
                    hint = str(batch.column(cfg.tier_columns[k])[gi * g])
                    requests.append(Augmentation(gi, hinted_prompt(batch.prompts[gi * g], hint, cfg.template),
                                                 context=contexts[k], replace=cfg.placement == "replace" and rank == 0,
                                                 train_on_source=cfg.train_on_source))
        requests = requests[: batch.num_groups]  # the host's bound: at most as many as the round's groups
        tier_of = self.contexts()
        used = torch.tensor([tier_of[r.context] for r in requests], dtype=torch.float32)
        self.log_metric(batch, "hinted_groups", float(len({r.group for r in requests})))
        self.log_metric(batch, "hint_requests", float(len(requests)))
        if cfg.answer_column and not cfg.allow_answer_in_hint:
            self.log_metric(batch, "leaky_hints_skipped", float(leaky))
        for k in range(len(contexts)):  # hinted groups asked for per tier (a loop over the few tiers)
            self.log_metric(batch, f"tier{k + 1}_groups", float((used == k).sum()))
        if requests:
            self.log_metric(batch, "tier_mean", (used + 1).mean().item())  # 1 = concept ... K = concrete step
        return requests

    @hookimpl
    def filter_rollouts(self, batch: RolloutBatch) -> torch.Tensor | None:
        """``all_tiers``: per prompt, keep only the hinted group of the lowest tier with a success."""
        import torch

        tiers = self._row_tiers(batch)
        if tiers is None:
            return None
        g = batch.num_generations
        group_tier = tiers[::g]
        mine = group_tier >= 0
        if not bool(mine.any()):
            return None
        solved = batch.grouped(self._passed(batch)).any(dim=1) & mine
        key_of: dict[tuple[int, str], int] = {}
        key_ids = torch.tensor([key_of.setdefault(k, len(key_of)) for k in source_keys(batch)],
                               dtype=torch.long, device=batch.device)
        never = len(self.config.tier_columns)
        best = torch.full((len(key_of),), never, dtype=torch.long, device=batch.device).scatter_reduce(
            0, key_ids, torch.where(solved, group_tier, torch.full_like(group_tier, never)), reduce="amin")
        keep = ~mine | (group_tier == best[key_ids])
        hinted_keys = key_ids[mine].unique()
        self.log_metric(batch, "kept_hinted_groups", float((keep & mine).sum()))
        self.log_metric(batch, "solved_prompts", (best[hinted_keys] < never).float().mean().item())
        return keep

    @hookimpl
    def transform_advantages(self, batch: RolloutBatch, advantages: torch.Tensor) -> torch.Tensor | None:
        """``joint``: each hinted group shares one GRPO baseline with its source group (see `joint_advantages`)."""
        return joint_advantages(batch, advantages, set(self.contexts()))

    @hookimpl
    def on_batch_end(self, batch: RolloutBatch, advantages: torch.Tensor) -> None:
        """Pass rate per tier of the hinted completions; ``across_visits``: one tier up after an all-fail group."""
        tiers = self._row_tiers(batch)
        if tiers is None or not bool((tiers >= 0).any()):
            return
        passed = self._passed(batch)
        mine = tiers >= 0
        self.log_metric(batch, "hinted_pass_rate", passed[mine].float().mean().item())
        for k in tiers[mine].unique().tolist():  # a loop over the (few) tiers present
            self.log_metric(batch, f"tier{k + 1}_pass_rate", passed[tiers == k].float().mean().item())
        if self.config.escalation != "across_visits":
            return
        g, top = batch.num_generations, len(self.config.tier_columns) - 1
        group_tier = tiers[::g]
        solved = batch.grouped(passed).any(dim=1)
        next_tier = group_tier.where(solved, (group_tier + 1).clamp(max=top))
        index = batch.prompt_index[::g]
        for p, k in zip(index[group_tier >= 0].tolist(), next_tier[group_tier >= 0].tolist()):  # hinted groups
            if p >= 0:
                self.level[int(p)] = int(k)
