"""ExPO: answer-conditioned self-explanations as positive samples for the prompts the policy fails.

Method (Self-Explanation Policy Optimization). Where GRPO finds no positive sample, let the policy
itself explain the reference answer, and train those explanations as positives for the plain
prompt. As this plugin runs it, for a plain group ``g`` of prompt ``x`` with reference answer ``a``::

    pass(g)      = mean_i [r_{g,i} >= threshold]                 (r: outcome_reward, or the total reward)
    triggered(g) = pass(g) <= max_pass_rate                      (default 0: every completion failed)
    request      = G completions e ~ pi_old(. | x (+) "The answer is a. Explain how to get it.")
    rho_t        = pi_theta(e_t | x, e_<t) / pi_old(e_t | x (+) a, e_<t)       (train_on_source)
    keep(e_j)    = r(e_j) >= threshold                           (only_correct: filter_rollouts, per completion)

Baseline (``baseline``): ``joint`` (default): the explanation group ``e`` and its source group ``g``
share one GRPO baseline, written over the estimator's values on those ``2G`` rows by
``transform_advantages``::

    u = (r_{g,1..G}, r(e_1..e_G));   A_j = (u_j - mean(u)) / (std(u) + 1e-4)
    (std: NaN-aware unbiased over u for scale_rewards=group, over the batch for batch; no division for none)

so the explanations that reach the right answer are positives against the failed plain completions;
an explanation dropped by ``only_correct`` still counts in the baseline (the host's rule for dropped
completions) and gets advantage 0. In a group of its own (``own``) an all-correct explanation group
would get advantage 0. Example: plain ``(0, 0, 0, 0)``, explanations ``(1, 0, 1, 0)`` give mean 0.25,
std 0.4629100 and ``A = 1.6198353`` for the two correct explanations, ``-0.5399451`` for the plain
completions; the two wrong explanations are dropped (advantage 0).

Source: "ExPO: Unlocking Hard Reasoning with Self-Explanation-Guided Reinforcement Learning"
(abstract, ``papers/000``; methods.md Part 3 lists it under rollout augmentation, "answer-conditioned
self-explanations", with no section of its own) **[abstract-inferred]**. Established (abstract):
GRPO-style training depends on the model producing positive samples and fails where it cannot
(hard problems, early training); effective positives are (1) likely under the current policy and (2)
raise the likelihood of the correct answer; ExPO generates them by conditioning on the ground-truth
answer (self-explanations, closer to the policy than expert CoTs, better than its own incorrect
samples). CHOSEN here (not established): the trigger (pass rate at most ``max_pass_rate``); the prompt
(``template`` appended to the last user message); training after the plain prompt
(``train_on_source``: the positive is meant for the question without the answer, so the behaviour
policy is the answer-conditioned one, Guide's correction); keeping only the explanations whose own
outcome is right (``only_correct``: "positives"; a rationale that still ends on a wrong answer is
not one); the joint ``2G`` baseline (the host adds whole groups, so the explanations cannot be mixed
into the failed group; they join its baseline instead); own group vs ``replace``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from trl_credit import Augmentation, ConfigError, Plugin, RunInfo, hookimpl, joint_advantages, with_context

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch

__all__ = ["CONTEXT", "ExPO", "explained_prompt", "joint_advantages"]

AUGMENTED = "trl_credit_augmented"  # the host's batch column: the request's context on augmented rows
SOURCE_PROMPT = "trl_credit_source_prompt"  # the host's batch column: the prompt the augmented group came from
CONTEXT = "expo self-explanation"  # this plugin's Augmentation.context


def explained_prompt(prompt: Any, answer: str, template: str) -> Any:
    """The prompt with ``template.format(answer=answer)`` appended to its last user message (or to the string)."""
    return with_context(prompt, template.format(answer=answer), "user", separator=" ")


class ExPO(Plugin):
    """ExPO: failed groups get G answer-conditioned self-explanations, trained as positives for the plain prompt."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        answer_column: str = Field("answer", description="dataset column with each prompt's reference answer")
        template: str = Field(
            "The answer is {answer}. Explain how to get it.",
            description="text appended to the last user message; {answer} = the reference answer")
        outcome_reward: str | None = Field(
            None, description="reward column that decides success; null = the weighted total reward (TRL's)")
        threshold: float = Field(0.5, description="a completion succeeds when its reward is at least this")
        max_pass_rate: float = Field(
            0.0, ge=0.0, lt=1.0, description="a group gets explanations when its pass rate is at most this "
            "(0: only groups where every completion failed)")
        placement: Literal["own_group", "replace"] = Field(
            "own_group", description="own_group: the explanations are a new group; replace: they take the "
            "failed group's place (its completions leave the batch)")
        baseline: Literal["joint", "own"] = Field(
            "joint", description="joint: the explanations share one GRPO baseline with their source group (2G "
            "rewards); own: the estimator's advantages (the explanations are their own group)")
        train_on_source: bool = Field(
            True, description="train the explanations after the plain prompt with the answer-conditioned "
            "log-probs as behaviour policy; false: train after the answer-conditioned prompt")
        only_correct: bool = Field(
            True, description="drop explanations whose own outcome is wrong (per completion; they still count "
            "in their group's baseline), so only right ones train, as positives")
        max_groups: int | None = Field(None, ge=1, description="at most this many explained groups per round; null: all")

    def required_rewards(self) -> list[str]:
        return [self.config.outcome_reward] if self.config.outcome_reward else []

    def required_columns(self) -> list[str]:
        return [self.config.answer_column]

    def disabled_hooks(self) -> list[str]:
        cfg = self.config
        return ([] if cfg.only_correct else ["filter_rollouts"]) + \
            ([] if cfg.baseline == "joint" else ["transform_advantages"])

    def check_args(self, run: RunInfo) -> None:
        cfg = self.config
        if "{answer}" not in cfg.template:
            raise ConfigError.for_key("template", f"{cfg.template!r} has no {{answer}} placeholder",
                                      "write it like 'The answer is {answer}. Explain how to get it.'")
        if cfg.baseline == "joint" and cfg.placement == "replace":
            raise ConfigError.for_key("baseline", "'joint' shares the baseline with the failed group, which "
                                      "placement 'replace' removes from the batch",
                                      "set `baseline: own` or `placement: own_group`")

    def _passed(self, batch: RolloutBatch) -> torch.Tensor:
        import torch

        cfg = self.config
        rewards = batch.reward(cfg.outcome_reward) if cfg.outcome_reward else batch.total_reward()
        return torch.nan_to_num(rewards, nan=float("-inf")) >= cfg.threshold

    def _mine(self, batch: RolloutBatch) -> torch.Tensor | None:
        """``(N,)`` bool: this plugin's explanation rows; None when the batch has no augmented rows."""
        import torch

        marks = batch.columns.get(AUGMENTED)
        if not marks:
            return None
        return torch.tensor([m == CONTEXT for m in marks], dtype=torch.bool, device=batch.device)

    @hookimpl
    def augment_rollouts(self, batch: RolloutBatch) -> list[Augmentation]:
        cfg, g = self.config, batch.num_generations
        rate = batch.grouped(self._passed(batch).float()).mean(dim=1)
        triggered = rate <= cfg.max_pass_rate
        marks = batch.columns.get(AUGMENTED) or [None] * batch.num_completions
        answers = batch.column(cfg.answer_column)
        requests, missing = [], 0
        for group in triggered.nonzero().squeeze(1).tolist():  # a loop over groups, bounded by the group count
            first = group * g
            answer = "" if answers[first] is None else str(answers[first]).strip()
            if marks[first] is not None:
                continue
            if not answer:
                missing += 1
                continue
            requests.append(Augmentation(group, explained_prompt(batch.prompts[first], answer, cfg.template),
                                         context=CONTEXT, replace=cfg.placement == "replace",
                                         train_on_source=cfg.train_on_source))
        if cfg.max_groups is not None:
            requests = requests[: cfg.max_groups]
        requests = requests[: batch.num_groups]  # the host's bound: at most as many as the round's groups
        self.log_metric(batch, "triggered_groups", triggered.float().mean().item() if batch.num_groups else 0.0)
        self.log_metric(batch, "explained_groups", float(len(requests)))
        self.log_metric(batch, "missing_answers", float(missing))
        return requests

    @hookimpl
    def filter_rollouts(self, batch: RolloutBatch) -> torch.Tensor | None:
        """``only_correct``: drop the explanation completions whose outcome is wrong (per completion)."""
        mine = self._mine(batch)
        if mine is None or not bool(mine.any()):
            return None
        wrong = mine & ~self._passed(batch)
        self.log_metric(batch, "dropped_explanations", float(wrong.sum()))
        return ~wrong

    @hookimpl
    def transform_advantages(self, batch: RolloutBatch, advantages: torch.Tensor) -> torch.Tensor | None:
        """``joint``: each explanation group shares one GRPO baseline with its source group."""
        return joint_advantages(batch, advantages, {CONTEXT})

    @hookimpl
    def on_batch_end(self, batch: RolloutBatch, advantages: torch.Tensor) -> None:
        """The pass rate of the explanations (kept or dropped) and the mean advantage of the kept ones."""
        mine = self._mine(batch)
        if mine is None or not bool(mine.any()):
            return
        self.log_metric(batch, "explanation_pass_rate", self._passed(batch)[mine].float().mean().item())
        kept = mine & batch.kept
        if bool(kept.any()):
            if advantages.dim() == 2:  # per-token: the token mean of each completion
                mask = batch.completion_mask.to(advantages.dtype)
                advantages = (advantages * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
            self.log_metric(batch, "explanation_advantage", advantages[kept].float().mean().item())
