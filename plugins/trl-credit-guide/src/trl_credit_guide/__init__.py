"""Guide: hints for the groups whose rollouts all failed, trained for the context without the hint.

Method (Guide-GRPO). When every completion of a prompt fails, sample the prompt again with a hint in
the context, and train those hinted completions with an importance ratio that replaces the hinted
context by the plain one, so the policy learns to produce them *without* the hint::

    failed(g)  = all_i r_{g,i} < threshold                       (r: outcome_reward, or the total reward)
    request    = G completions y ~ pi_old(. | x (+) h)           for each failed group g with a usable hint
    rho_t      = pi_theta(y_t | x, y_<t) / pi_old(y_t | x (+) h, y_<t)

``rho_t`` is TRL's own ratio: the host trains the hinted rows after the plain prompt ``x`` with the
hinted log-probs as the behaviour policy (`trl_credit.Augmentation` ``train_on_source``), and TRL
clips and aggregates it as for every row. Example (methods.md 2.32): log pi_theta(y_t | x) = -1.2,
log pi_old(y_t | x (+) h) = -0.8 gives rho_t = e^-0.4 = 0.670320.

Source: "Adaptive Guidance Accelerates Reinforcement Learning of Reasoning Models" (abstract,
``papers/000``); methods.md 2.32 **[abstract-inferred]**. Established: hints only for problems whose
rollouts were all incorrect; the importance ratio adjusted so the policy is optimised for contexts
without the hint. CHOSEN here (not established): the hinted completions form a group of their own
(``placement: own_group``; GRPO's baseline over the hinted group) or take the failed group's place
(``placement: replace``), where the paper mixes them into one group (a mixed baseline: not offered,
the host augments whole groups); the hint is a dataset column appended to the last user message as
``"Hint: <hint>"`` (``template``); a hint that contains the reference answer is skipped unless
``allow_answer_in_hint`` (it would teach copying); ``correction: false`` trains after the hinted
prompt instead (no off-context ratio), for comparison.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from trl_credit import Augmentation, ConfigError, Plugin, RunInfo, hookimpl, with_context

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch

__all__ = ["Guide", "failed_groups", "hinted_prompt"]

AUGMENTED = "trl_credit_augmented"  # the host's batch column marking augmented rows (documented in augment_rollouts)


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


class Guide(Plugin):
    """Guide: all-fail groups get G hinted completions, trained with rho = pi(y | x) / pi_old(y | x + hint)."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        hint_column: str = Field("hint", description="dataset column holding each prompt's hint")
        template: str = Field("Hint: {hint}", description="text appended to the last user message; {hint} = hint")
        outcome_reward: str | None = Field(
            None, description="reward column that decides failure; null = the weighted total reward (TRL's)")
        threshold: float = Field(0.5, description="a completion fails when its reward is below this")
        placement: Literal["own_group", "replace"] = Field(
            "own_group", description="own_group: the hinted completions are a new group; replace: they take the "
            "failed group's place (the failed completions, all-zero advantage, leave the batch)")
        correction: bool = Field(
            True, description="train the hinted completions after the plain prompt with the hinted log-probs as "
            "behaviour policy (Guide's un-hinted ratio); false: train after the hinted prompt")
        answer_column: str | None = Field(
            "answer", description="reference answer column for the leak check; null: no check")
        allow_answer_in_hint: bool = Field(False, description="use hints that contain the reference answer")
        max_groups: int | None = Field(None, ge=1, description="at most this many hinted groups per round; null: all")

    def required_rewards(self) -> list[str]:
        return [self.config.outcome_reward] if self.config.outcome_reward else []

    def required_columns(self) -> list[str]:
        cfg = self.config
        return [cfg.hint_column] + ([cfg.answer_column] if cfg.answer_column and not cfg.allow_answer_in_hint else [])

    def check_args(self, run: RunInfo) -> None:
        """The template must contain {hint}; the rest (columns, reward) the host checks from the declarations."""
        if "{hint}" not in self.config.template:
            raise ConfigError.for_key("template", f"{self.config.template!r} has no {{hint}} placeholder",
                                      "write it like 'Hint: {hint}'")

    @hookimpl
    def augment_rollouts(self, batch: RolloutBatch) -> list[Augmentation]:
        cfg, g = self.config, batch.num_generations
        rewards = batch.reward(cfg.outcome_reward) if cfg.outcome_reward else batch.total_reward()
        failed = failed_groups(rewards, g, cfg.threshold).nonzero().squeeze(1).tolist()
        hints = batch.column(cfg.hint_column)
        answers = batch.column(cfg.answer_column) if cfg.answer_column and not cfg.allow_answer_in_hint else None
        requests, leaky = [], 0
        for group in failed:  # a loop over groups, bounded by the batch's group count
            first = group * g
            hint = hints[first]
            if not hint:
                continue
            if answers is not None and str(answers[first]).strip() and str(answers[first]).strip() in str(hint):
                leaky += 1
                continue
            requests.append(Augmentation(group, hinted_prompt(batch.prompts[first], str(hint), cfg.template),
                                         context="guide hint", replace=cfg.placement == "replace",
                                         train_on_source=cfg.correction))
        if cfg.max_groups is not None:
            requests = requests[: cfg.max_groups]
        self.log_metric(batch, "failed_groups", len(failed) / max(batch.num_groups, 1))
        self.log_metric(batch, "hinted_groups", float(len(requests)))
        if answers is not None:
            self.log_metric(batch, "leaky_hints_skipped", float(leaky))
        return requests

    @hookimpl
    def on_batch_end(self, batch: RolloutBatch, advantages: torch.Tensor) -> None:
        """The pass rate of the hinted completions in the final batch (NaN-free; logged only when some exist)."""
        import torch

        marks = batch.columns.get(AUGMENTED)
        if not marks:
            return
        hinted = torch.tensor([m == "guide hint" for m in marks], dtype=torch.bool, device=batch.device)
        if bool(hinted.any()):
            cfg = self.config
            rewards = batch.reward(cfg.outcome_reward) if cfg.outcome_reward else batch.total_reward()
            passed = torch.nan_to_num(rewards[hinted], nan=float("-inf")) >= cfg.threshold
            self.log_metric(batch, "hinted_pass_rate", passed.float().mean().item())
