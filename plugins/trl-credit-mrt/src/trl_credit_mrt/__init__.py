"""MRT: meta reinforcement fine-tuning's forced-termination reward, as a baseline or as a dense progress bonus.

Method. At a budget point the policy is forced to stop thinking and answer: a termination cue
(``"\\n</think>\\nThe final answer is"``) is appended to the completion prefix and short answers are sampled. The
run's own reward functions judge them; their mean is ``J(z_<=j)``, the success probability when forced to answer
after the prefix. ``baseline`` mode replaces GRPO's group baseline by this termination reward; ``progress`` mode
credits each step (episode) with the change of ``J`` it caused, on top of GRPO's advantage.

Formula. Completion ``i`` with outcome ``R_i`` (the total reward, or the column ``reward``), steps
``j = 1 .. c_i`` ending at token ``e_ij`` (`trl_credit.step_ends`; ``e_i0 = 0``: after the prompt alone), ``m``
forced answers ``a_ijs`` sampled after ``prompt + y_i[:e_ij] + cue``, ``r(.)`` the run's rewards on a text::

    scored text   = answer_prefix + a_ijs          answer_prefix: the cue after its last "</think>", stripped of
                                                   leading whitespace ("The final answer is"), unless given
    J_ij          = mean_s r(answer_prefix + a_ijs)           NaN scores are skipped (all NaN: J = NaN)
    baseline:     A_i  = R_i - R_term_i,  R_term_i = J at the completion's end (e_i = its last text token), or
                  at the start of its last step (baseline_at: last_step)          (N,) advantages, no std scaling
    progress:     A_it = A^GRPO_i + bonus_coef * (J_ij - J_i,j-1)   for every token t of step j        (N, T)

Source: methods.md 2.30. The baseline form is ``CMU-AIRe/MRT@1815a8c5`` ``train/rl/README.md`` (read for this
plugin: "replace the group-based baseline with a termination reward baseline, A = R - R_termination"); the
progress bonus ``J(z_<=j) - J(z_<=j-1)`` is recalled from the paper (weight not established). The same repo's
``analysis/code/pass_at_k_given_prefix.py`` forces termination after the prompt alone and after every episode
prefix (cue ``"\\n</think>"``, or a longer "Time is up." cue), which fixes ``J_i0`` here.

Established: A = R - R_termination with no group baseline; J as the success rate of answers forced after a
prefix (prompt alone included); progress as its difference per episode. Chosen here: the termination cue and the
scored text (the cue's answer part + the sample: a reward that reads the last number sees the forced answer, not a
number left in the prefix; a format reward sees no ``<think>`` block); ``R_term`` at the completion's end (the
brief's reading; for a completion that already states its answer ``J(end) ~ R``: ``same_as_outcome`` reports it,
``baseline_at: last_step`` compares with stopping one step earlier); ``num_samples`` 1 in baseline mode and 4 in
progress mode; answers of at most 16 tokens at the run's temperature; ``bonus_coef = 0.5``; steps are lines
(``\\n+``) and ``max_steps`` keeps the last 8 (earlier ones merge into the first kept); the EOS closing a
completion is left out of the prefix; rows without a reward or dropped by a filter are not probed (advantage 0).
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from trl_credit import ConfigError, Plugin, Regex, answer_prefix, hookimpl, step_ends, token_steps

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch, RunInfo

__all__ = ["MRT", "MRT_CUE", "answer_prefix", "segments"]

MRT_CUE = "\n</think>\nThe final answer is"


def _content(batch: RolloutBatch) -> torch.Tensor:
    """``(N,)`` completion tokens before a closing EOS (the prefix a forced answer continues at the end)."""
    lengths = batch.completion_lengths
    eos = getattr(batch.tokenizer, "eos_token_id", None)
    if eos is None or not lengths.numel():
        return lengths
    last = batch.completion_ids.to(lengths.device).gather(1, (lengths - 1).clamp(min=0)[:, None])[:, 0]
    return lengths - ((lengths > 0) & (last == eos)).long()


def segments(batch: RolloutBatch, pattern: str,
             max_steps: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ends (N, K), step (N, T), count (N,))``: the kept step ends (a closing EOS left out), the kept step of
    every token (-1 outside) and the kept steps per row; earlier steps merge into the first kept one."""
    import torch

    index, steps = token_steps(batch, pattern, fill=True)
    counts = torch.tensor([len(x) for x in steps], dtype=torch.long, device=index.device)
    kept = counts if max_steps is None else counts.clamp(max=max_steps)
    ends = step_ends(batch, pattern, max_steps).to(index.device)[:, : int(kept.max()) if kept.numel() else 0]
    step = torch.where(index >= 0, (index - (counts - kept)[:, None]).clamp(min=0), -1)
    content = _content(batch).to(index.device)
    return torch.where(ends >= 0, torch.minimum(ends, content[:, None]), -1), step, kept


class MRT(Plugin):
    """MRT: answers forced at budget points and judged by the run's rewards; ``baseline`` mode is an estimator
    (A = R - R_termination), ``progress`` mode a transform adding the per-step change of J to GRPO's advantage."""

    name = "mrt"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        mode: Literal["baseline", "progress"] = Field(
            "baseline", description="baseline: A = R - R_termination (replaces GRPO's estimator); progress: GRPO's "
            "advantage + bonus_coef * (J after step j - J before it) on the tokens of step j")
        cue: str = Field(MRT_CUE, description="termination cue appended after a prefix before the forced answer")
        answer_prefix: str | None = Field(None, description="text put before each sampled answer when it is scored; "
                                          "null: the cue after its last '</think>', leading whitespace stripped")
        num_samples: int | None = Field(None, ge=1, description="forced answers per budget point (J is their mean "
                                        "reward); null: 1 in baseline mode, 4 in progress mode")
        max_new_tokens: int = Field(16, ge=1, description="tokens per forced answer at most")
        temperature: float | None = Field(None, gt=0, description="forced-answer sampling temperature; null: the "
                                          "run's temperature")
        baseline_at: Literal["end", "last_step"] = Field(
            "end", description="baseline mode: R_termination forced at the completion's end, or at the start of its "
            "last step (the end of the one before; the prompt alone for one step)")
        budget: Literal["steps", "end"] = Field("steps", description="progress mode: budget points at every step end, "
                                                "or the completion's end only (one episode)")
        pattern: Regex = Field(r"\n+", description="regex separating steps (episodes) in a completion")
        max_steps: int | None = Field(8, ge=1, description="steps per completion at most (the last ones; earlier "
                                      "steps merge into the first kept): bounds the forced answers")
        bonus_coef: float = Field(0.5, ge=0, description="progress mode: weight of the progress bonus")
        reward: str | None = Field(None, description="reward column for R and J; null: the weighted total reward")


    def required_rewards(self):
        return [self.config.reward] if self.config.reward else []

    def disabled_hooks(self):
        return ("transform_advantages",) if self.config.mode == "baseline" else ("compute_advantages",)

    def check_args(self, run: RunInfo) -> None:
        cfg = self.config
        unused = {"baseline": ("budget", "bonus_coef"), "progress": ("baseline_at",)}[cfg.mode]
        for key in unused:
            if key in cfg.model_fields_set:
                other = "progress" if cfg.mode == "baseline" else "baseline"
                raise ConfigError.for_key(key, f"{key} = {getattr(cfg, key)!r} has no effect in mode {cfg.mode!r} "
                                          f"(it applies to mode {other!r})",
                                          f"remove `{key}`, or set `mode: {other}`")
        if re.compile(cfg.pattern).fullmatch("") is not None:
            raise ConfigError.for_key("pattern", f"{cfg.pattern!r} matches the empty string, so every character "
                                      "would end a step (a forced answer each)",
                                      "use a delimiter that needs at least one character, e.g. '\\n+' or '\\n\\n+'")

    @property
    def num_samples(self) -> int:
        value = self.config.num_samples
        return value if value is not None else (1 if self.config.mode == "baseline" else 4)

    def forced_success(self, batch: RolloutBatch, ends: torch.Tensor) -> torch.Tensor:
        """``(N, K)`` J: the mean reward of the answers forced after each prefix (NaN where ``ends < 0`` or unscored)."""
        import torch

        cfg = self.config
        s = self.num_samples
        temperature = cfg.temperature if cfg.temperature is not None else float(getattr(batch.args, "temperature",
                                                                                         None) or 1.0)
        probes = batch.probe(ends, cfg.cue, num_samples=s, max_new_tokens=cfg.max_new_tokens, temperature=temperature,
                             top_k=1)
        prefix = cfg.answer_prefix if cfg.answer_prefix is not None else answer_prefix(cfg.cue)
        entries = [(i, k, j) for i, k in probes.valid.nonzero().tolist() for j in range(s)]
        keys = [(i, prefix + probes.texts[i][k][j]) for i, k, j in entries]
        unique = list(dict.fromkeys(keys))
        n, width = ends.shape
        per = torch.full((n, width, s), math.nan, device=batch.device)
        if unique:
            scores = batch.score_texts([r for r, _ in unique], [t for _, t in unique])
            if cfg.reward:
                value = scores[:, batch.reward_names.index(cfg.reward)]
            else:  # as `total_reward`: weighted sum of the columns, NaN where every column is NaN
                value = (scores * batch.reward_weights.to(scores).unsqueeze(0)).nansum(1)
                value = value.masked_fill(torch.isnan(scores).all(1), math.nan)
            where = {key: u for u, key in enumerate(unique)}
            index = torch.tensor([where[key] for key in keys], device=value.device)
            at = torch.tensor(entries, device=per.device).T
            per[at[0], at[1], at[2]] = value[index].to(per)
        return torch.nanmean(per, dim=-1)

    def _judged(self, batch: RolloutBatch) -> torch.Tensor:
        """``(N,)`` rows worth probing: a finite outcome and kept by the filters."""
        import torch

        return torch.isfinite(self._outcome(batch)) & batch.kept.to(batch.device)

    def _outcome(self, batch: RolloutBatch) -> torch.Tensor:
        return batch.reward(self.config.reward) if self.config.reward else batch.total_reward()

    @hookimpl
    def compute_advantages(self, batch: RolloutBatch) -> torch.Tensor:
        import torch

        cfg = self.config
        outcome = self._outcome(batch).float()
        if cfg.baseline_at == "end":
            point = _content(batch).to(batch.device)
        else:
            ends, _, count = (x.to(batch.device) for x in segments(batch, cfg.pattern, cfg.max_steps))
            point = torch.zeros_like(count)  # one step (or none): the prompt alone
            if ends.shape[1] > 1:  # the end of the step before the last
                point = torch.where(count >= 2, ends.gather(1, (count - 2).clamp(min=0)[:, None])[:, 0], 0)
        judged = self._judged(batch)
        term = self.forced_success(batch, torch.where(judged, point, -1)[:, None])[:, 0]
        advantages = outcome - term
        ok = torch.isfinite(advantages)
        if ok.any():
            self.log_metric(batch, "termination_reward", float(term[ok].mean()))
            self.log_metric(batch, "same_as_outcome", float(((outcome - term).abs() < 1e-6)[ok].float().mean()))
        self.log_metric(batch, "scored_fraction", float(ok.float().mean()) if ok.numel() else 0.0)
        return torch.where(ok, advantages, 0.0)

    @hookimpl
    def transform_advantages(self, batch: RolloutBatch, advantages: torch.Tensor) -> torch.Tensor | None:
        import torch

        cfg = self.config
        device = advantages.device
        judged = self._judged(batch).to(device)
        if cfg.budget == "steps":
            ends, step, count = (x.to(device) for x in segments(batch, cfg.pattern, cfg.max_steps))
        else:
            content = _content(batch).to(device)
            count = (content > 0).long()
            ends = torch.where(count > 0, content, -1)[:, None]
            step = torch.where(batch.completion_mask.to(device).bool() & (count > 0)[:, None], 0, -1)
        count = torch.where(judged, count, 0)
        n, width = step.shape
        self.log_metric(batch, "episodes", float(count.float().mean()) if n else 0.0)
        if ends.shape[1] == 0 or not bool((count > 0).any()):
            return None
        points = torch.cat([torch.zeros(n, 1, dtype=torch.long, device=device), ends], 1)
        points = torch.where((count > 0)[:, None], points, -1)
        j = self.forced_success(batch, points).to(device)  # (N, K + 1): J_0 (the prompt alone) .. J_K
        progress = j[:, 1:] - j[:, :-1]
        scored = torch.isfinite(progress)
        progress = torch.where(scored, progress, 0.0)
        inside = (step >= 0) & (count > 0)[:, None]
        bonus = torch.where(inside, progress.gather(1, step.clamp(min=0)), 0.0)
        a = advantages.float()
        a = a[:, None].expand(n, width) if a.dim() == 1 else a
        rows = count > 0
        last = j.gather(1, count[:, None])[:, 0]
        for name, values in (("j_prompt", j[rows, 0]), ("j_end", last[rows])):
            if torch.isfinite(values).any():
                self.log_metric(batch, name, float(values[torch.isfinite(values)].mean()))
        self.log_metric(batch, "progress", float(progress[scored].mean()) if scored.any() else 0.0)
        return a + cfg.bonus_coef * bonus
