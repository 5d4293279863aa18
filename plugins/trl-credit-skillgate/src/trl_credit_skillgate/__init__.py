"""SkillGate: disjoint credit channels for the skill-naming tokens and the execution tokens.

Method. An agent that reads skills (instruction files) on demand names the skill it reads in a few tokens. Under a
broadcast sequence advantage those tokens carry a vanishing share of the loss and inherit the outcome's sign: a
correct choice is punished whenever the execution after it fails ("selector credit starvation"). SkillGate
partitions the token support into two disjoint channels: the outcome advantage reaches only the execution tokens,
and a separate action-local advantage reaches exactly the skill-naming tokens, positive only when the trajectory's
single read is the correct one.

Formula (completion ``i``, ``A_it`` the run's outcome advantage, ``m_it`` the model's tokens, ``[a, b)`` the
character spans of the pattern's matches in the completion's text that overlap a model token, ``R_i`` their number,
``n_i`` the skill each names, ``S_i`` the row's correct skills from ``gold_column``)::

    sel_it  = m_it and token t's characters overlap a read span        (tokens: match, or the `skill` group: name)
    s_i     = correct   if R_i = 1 and n_i in S_i                      (> 0)
            = wrong     if R_i = 1 and n_i not in S_i                  (<= 0)
            = multiple  if R_i > 1                                     (<= 0: not a single read)
            = 0         if R_i = 0                                     (no selector tokens)
    b_i     = s_i (baseline: none) | s_i - mean_g s | (s_i - mean_g s) / (sigma_g s + 1e-6)   over the group's kept
              rows with a read (population sigma; below 1e-6 it counts as 1)
    A'_it   = coef * b_i   on selector tokens
            = A_it         on every other token (the execution tokens; environment tokens are ignored by the loss)

Source: the SkillGate abstract ("SkillGate: Training In-Policy Skill Selection in Long-Horizon Agents",
/work/shared/papers/004), no code found: [abstract-inferred]. Established there: two disjoint channels over the
token support, outcome credit only on execution tokens, an action-local advantage only on the skill-naming tokens,
positive only when the trajectory's single read is the correct one. Chosen here: the read is a regex match in the
completion text (mapped to tokens by their character offsets, `trl_credit.token_char_offsets`), correctness is a
name match against a dataset column, the action-local advantage is the raw signed reward (no group baseline;
`baseline` offers the group-centred and z-scored readings), a wrong single read and several reads both get -1.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trl_credit import Plugin, Regex, completion_text, hookimpl, token_char_offsets

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch

__all__ = ["SkillGate", "find_reads", "gold_names", "selector_rewards", "span_tokens"]

DEFAULT_PATTERN = r"<skill>(?P<skill>[^<]*)</skill>"


def find_reads(texts: list[str], regex: re.Pattern, tokens: str = "match") -> tuple[list[list[tuple[int, int]]],
                                                                                    list[list[str]]]:
    """Per text, the credited character spans of the pattern's non-empty matches and the skill each names (group
    ``skill`` when the pattern has it, else the whole match; stripped). ``tokens: name`` credits the ``skill`` group
    only. Spans are trimmed of surrounding whitespace. A loop over rows and matches, never over tokens."""
    grouped = "skill" in regex.groupindex
    spans, names = [], []
    for text in texts:
        row_spans, row_names = [], []
        for match in regex.finditer(text):
            if match.end() == match.start():
                continue
            name = match.group("skill") if grouped else match.group(0)
            lo, hi = match.span("skill") if tokens == "name" else match.span()
            piece = text[lo:hi]
            lo, hi = lo + len(piece) - len(piece.lstrip()), hi - (len(piece) - len(piece.rstrip()))
            row_spans.append((lo, max(lo, hi)))
            row_names.append((name or "").strip())
        spans.append(row_spans)
        names.append(row_names)
    return spans, names


def gold_names(values: list, ignore_case: bool = False) -> list[set[str]]:
    """Each row's correct skills: a name, a list of names, or None / "" / [] (no skill is correct)."""
    out = []
    for v in values:
        items = [] if v is None else [v] if isinstance(v, str) else list(v)
        names = {str(x).strip() for x in items if x is not None and str(x).strip()}
        out.append({x.casefold() for x in names} if ignore_case else names)
    return out


def span_tokens(starts: torch.Tensor, ends: torch.Tensor, model: torch.Tensor, spans: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(selector (N, T), touched (N, M))``: model tokens (with text) that overlap a span, and which spans overlap a
    model token. ``spans`` ``(N, M, 2)`` character ``[lo, hi)``, empty (``lo == hi``) where a row has fewer."""
    lo, hi = spans[..., 0].unsqueeze(1), spans[..., 1].unsqueeze(1)  # (N, 1, M)
    token = (model & (ends > starts)).unsqueeze(2)
    overlap = token & (starts.unsqueeze(2) < hi) & (ends.unsqueeze(2) > lo) & (hi > lo)  # (N, T, M)
    return overlap.any(2), overlap.any(1)


def selector_rewards(reads: torch.Tensor, single_correct: torch.Tensor, correct: float, wrong: float,
                     multiple: float) -> torch.Tensor:
    """``(N,)`` s_i: ``correct`` for a single correct read, ``wrong`` for a single wrong one, ``multiple`` for
    several reads, 0 without a read."""
    import torch

    one = torch.where(single_correct, correct, wrong)
    return torch.where(reads == 0, 0.0, torch.where(reads > 1, multiple, one))


def centre(values: torch.Tensor, pool: torch.Tensor, num_generations: int, mode: str) -> torch.Tensor:
    """``values`` ``(N,)`` against the pooled rows of their group: as is (none), minus the pool mean (mean), or
    z-scored (group: population sigma + 1e-6, a sigma below 1e-6 counts as 1); 0 outside the pool."""
    import torch

    if mode == "none":
        return torch.where(pool, values, 0.0)
    v, m = values.reshape(-1, num_generations), pool.reshape(-1, num_generations).to(values.dtype)
    count = m.sum(1, keepdim=True).clamp(min=1)
    mean = (v * m).sum(1, keepdim=True) / count
    out = v - mean
    if mode == "group":
        sigma = ((out ** 2 * m).sum(1, keepdim=True) / count).sqrt()
        out = out / torch.where(sigma < 1e-6, 1.0, sigma + 1e-6)
    return torch.where(m > 0, out, 0.0).reshape(-1)


class SkillGate(Plugin):
    """SkillGate: A'_it = coef * b_i on the skill-naming tokens (b_i > 0 only for a single correct read), the run's
    outcome advantage A_it on every other token. Source: the SkillGate abstract [abstract-inferred]."""

    name = "skillgate"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        pattern: Regex = Field(DEFAULT_PATTERN, description="regex of one skill read in the completion text; the "
                               "named group `skill` is the skill's name (without it: the whole match)")
        tokens: Literal["match", "name"] = Field("match", description="the selector tokens: those of the whole "
                                                 "match (match) or of the `skill` group only (name)")
        gold_column: str = Field("gold_skill", description="dataset column with each row's correct skill: a name, "
                                 "a list of names, or null / [] when no skill is correct")
        ignore_case: bool = Field(False, description="compare skill names case-insensitively")
        correct: float = Field(1.0, gt=0.0, description="selector reward of a single read of a correct skill")
        wrong: float = Field(-1.0, le=0.0, description="selector reward of a single read of a wrong skill")
        multiple: float = Field(-1.0, le=0.0, description="selector reward of a trajectory with several reads (not "
                                "a single read, so never positive)")
        baseline: Literal["none", "mean", "group"] = Field(
            "none", description="the action-local advantage: the selector reward as is (none), minus the mean over "
            "the group's rows with a read (mean), or z-scored over them (group)")
        coef: float = Field(1.0, ge=0.0, description="weight of the selector channel (its tokens never see the "
                            "outcome advantage)")

        @model_validator(mode="after")
        def _consistent(self):
            regex = re.compile(self.pattern)
            if regex.search("") is not None:
                raise ValueError(f"pattern {self.pattern!r} matches the empty string, so every position would be a "
                                 "read; fix: make it match the read's text, e.g. <skill>(?P<skill>[^<]*)</skill>")
            if self.tokens == "name" and "skill" not in regex.groupindex:
                raise ValueError("tokens: name credits the pattern's `skill` group, which it lacks; fix: add "
                                 "(?P<skill>...) to the pattern or set tokens: match")
            if not self.gold_column.strip():
                raise ValueError("gold_column must name the dataset column of correct skills, e.g. gold_skill")
            if self.baseline != "none" and self.wrong != self.multiple:
                # centred, the higher of the two is positive in a group whose other reads all score the lower
                raise ValueError(f"baseline: {self.baseline} with wrong ({self.wrong}) != multiple ({self.multiple}) "
                                 "can make a read that is not a single correct one positive; fix: set wrong and "
                                 "multiple equal, or baseline: none")
            return self

    def required_columns(self) -> list[str]:
        return [self.config.gold_column]

    def reads(self, batch: RolloutBatch) -> dict[str, torch.Tensor]:
        """The selector channel of ``batch``: ``selector`` ``(N, T)`` tokens, ``reads`` ``(N,)``, ``single_correct``
        ``(N,)`` and the selector rewards ``s`` ``(N,)``, all on ``batch.device``."""
        import torch

        cfg = self.config
        multi = [i for i, c in enumerate(batch.completions) if isinstance(c, (list, tuple)) and len(c) > 1]
        if multi:
            raise ValueError(f"completion {multi[0]} is a list of {len(batch.completions[multi[0]])} messages (TRL's "
                             "tools / environment_factory path): the host's token offsets cover only the last "
                             "message's text, so skill spans cannot be mapped to tokens; fix: use a rollout_func "
                             "(one decoded text per completion) or a single-turn completion")
        texts = [completion_text(c) for c in batch.completions]
        spans, names = find_reads(texts, re.compile(cfg.pattern), cfg.tokens)
        n, device = batch.num_completions, batch.device
        most = max((len(s) for s in spans), default=0)
        padded = torch.zeros(n, max(most, 1), 2, dtype=torch.long)
        hit = torch.zeros(n, max(most, 1), dtype=torch.bool)
        gold = gold_names(batch.column(cfg.gold_column), cfg.ignore_case)
        for i, (row_spans, row_names) in enumerate(zip(spans, names)):  # rows and matches, bounded by the batch
            if row_spans:
                padded[i, : len(row_spans)] = torch.tensor(row_spans, dtype=torch.long)
                hit[i, : len(row_names)] = torch.tensor(
                    [(x.casefold() if cfg.ignore_case else x) in gold[i] for x in row_names])
        starts, ends = token_char_offsets(batch)
        model = batch.turns().model.to(starts.device)
        selector, touched = span_tokens(starts, ends, model, padded.to(starts.device))
        touched, hit = touched.to(device), hit.to(device)
        reads = touched.sum(1)
        single_correct = (reads == 1) & (touched & hit).any(1)
        s = selector_rewards(reads, single_correct, cfg.correct, cfg.wrong, cfg.multiple)
        return {"selector": selector.to(device), "reads": reads, "single_correct": single_correct, "s": s}

    @hookimpl
    def transform_advantages(self, batch: RolloutBatch, advantages: torch.Tensor) -> torch.Tensor:
        import torch

        cfg = self.config
        channel = self.reads(batch)
        device = advantages.device
        selector = channel["selector"].to(device)
        reads = channel["reads"].to(device)
        kept = batch.kept.to(device)
        pool = kept & batch.scorable.to(device) & (reads > 0)  # scored rows: the others get 0
        b = centre(channel["s"].to(device).to(advantages.dtype), pool, batch.num_generations, cfg.baseline)
        base = advantages if advantages.dim() == 2 else advantages.unsqueeze(1).expand(-1, batch.width)
        out = torch.where(selector, cfg.coef * b.unsqueeze(1), base)
        self._metrics(batch, channel, base, kept, selector, reads)
        return out.float()

    def _metrics(self, batch, channel, base, kept, selector, reads) -> None:
        model = batch.turns().model.to(base.device) & kept.unsqueeze(1)
        rows = kept & (reads > 0)
        self.log_metric(batch, "read_rate", float(rows.float().sum() / kept.float().sum().clamp(min=1)))
        self.log_metric(batch, "selector_token_share", float((selector & model).sum() / model.sum().clamp(min=1)))
        if bool(rows.any()):
            s = channel["s"].to(base.device)
            self.log_metric(batch, "reads", float(reads[rows].float().mean()))
            self.log_metric(batch, "correct_rate", float(channel["single_correct"].to(base.device)[rows].float().mean()))
            self.log_metric(batch, "multiple_rate", float((reads[rows] > 1).float().mean()))
            # what a broadcast outcome advantage would have given the selector tokens: the sign it disagrees with
            inherited = (base * selector).sum(1) / selector.sum(1).clamp(min=1)
            opposed = rows & (s != 0) & (inherited * s < 0)
            self.log_metric(batch, "outcome_sign_errors", float(opposed[rows].float().mean()))
            self.log_metric(batch, "selector_reward", float(s[rows].mean()))
