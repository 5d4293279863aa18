"""P2S: path-faithfulness step credit: how likely the gold chain of thought is after each reasoning prefix.

Method. A correct final answer says nothing about which reasoning steps helped. P2S scores each step of a
completion by the *path-faithfulness reward* (PFR): the teacher-forced, length-normalised probability of the
gold chain of thought (CoT) given the model's reasoning up to that step. A step that keeps the reasoning on
the gold path raises it; a step that leaves the path lowers it. The dense step signal is combined with the
outcome reward. Here a step is a segment of the completion between delimiters (`trl_credit.step_ends`), the
gold CoT is a dataset column, and the step credit is added to the outcome advantage token by token.

Formula (completion ``i`` with ``K_i`` steps, ``e_ik`` the token position just past step ``k``, ``e_i0 = 0``;
``gold_i`` the gold CoT; ``G`` completions per group)::

    PFR_ik = exp(mean_{t in c_ik} log pi(c_ik,t | prompt_i, y_i[:e_ik], c_ik,<t))      k = 0 .. K_i
             alignment "full":          c_ik = gold_i                    (the whole gold CoT after every prefix)
             alignment "proportional":  c_ik = gold_i from its step s_ik = min(floor(k * M_i / K_i), M_i - 1)
                                        (M_i gold steps: the part of the gold path still ahead, in proportion)
    d_ik   = PFR_ik - PFR_i,k-1                                                     k = 1 .. K_i (step k's gain)
    normalize "group": z_ik = (d_ik - mean_g d) / (std_g d + 1e-6), pooled over every gain of the group
                       (population std; a std below 1e-6 counts as 1: `trl_credit.group_normalise`);
                       normalize "none": z_ik = d_ik
    A_it   = A_i(t) + coef * z_ik(t) * m_it          t in step k(t); A the incoming (outcome) advantage

The prefixes never include the completion's EOS token (the gold text continues the reasoning, not a finished
sequence), so the last prefix is the whole completion without EOS. ``max_steps`` keeps the last ``max_steps``
steps of a long completion (earlier ones merge into the first kept step), bounding the scored sequences.

Source: methods.md 2.29, from the P2S abstract only: PFR as the conditional probability of the gold-CoT suffix
given the model's reasoning prefix, teacher-forced and length-normalised; combined with an outcome reward.

Established (abstract): the teacher-forced, length-normalised probability of the gold CoT suffix after the
reasoning prefix, as a dense reward beside the outcome. Not established, and CHOSEN here: how model step k is
aligned with the start of the gold suffix (``alignment``: the whole gold CoT, default, or the proportional
remainder); reading the probability as ``exp`` of the mean token log-prob (the geometric mean, IGPO's form);
rewarding a step by its PFR gain (a potential difference: the gains of a completion telescope to
``PFR_K - PFR_0``, and ``PFR_0`` is shared by the group); group normalisation of the gains; the additive
combination with weight ``coef`` (default 0.1: the outcome's sign dominates unless a step's normalised gain
is 10 times the outcome advantage); the gold CoT from a dataset column (P2S synthesises and filters it
during RL: that pipeline is not established). Rows with a blank gold CoT, and completions without steps, get
no step credit; dropped completions count in their group's pool, as in GRPO's baseline.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from trl_credit import Plugin, Regex, group_normalise, hookimpl, split_steps, step_ends

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch

__all__ = ["P2S", "prefix_ends", "proportional_suffixes", "step_credit", "token_step_index"]


def prefix_ends(batch: RolloutBatch, pattern: str, max_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ends, scored)``, both ``(N, K)`` long, -1 past a row's steps: the token position just past each step
    (`trl_credit.step_ends`), and the prefix lengths to score after, which leave out a final EOS token."""
    import torch

    ends = step_ends(batch, pattern, max_steps)
    ids = batch.completion_ids
    lengths = batch.completion_lengths.to(ids.device)
    eos = getattr(batch.tokenizer, "eos_token_id", None)
    last = ids.gather(1, (lengths - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    ends_in_eos = (lengths > 0) & (last == eos) if eos is not None else torch.zeros_like(lengths, dtype=torch.bool)
    body = (lengths - ends_in_eos.long()).to(ends.device)
    scored = torch.where(ends >= 0, torch.minimum(ends, body.unsqueeze(1)), -1)
    return ends, scored


def token_step_index(ends: torch.Tensor, width: int) -> torch.Tensor:
    """``(N, T)`` long: the step of each token position (``e_k-1 <= t < e_k``), ``K_i`` (no step) past the last."""
    import torch

    position = torch.arange(width, device=ends.device).view(1, width, 1)
    e = ends.unsqueeze(1)
    return ((e >= 0) & (e <= position)).sum(-1)


def step_credit(pfr: torch.Tensor, num_generations: int, normalize: str = "group") -> tuple[torch.Tensor, torch.Tensor]:
    """``(z, gains)``, both ``(N, K)``: the PFR gains ``PFR_k - PFR_k-1`` (NaN where not scored) and the step
    credit (group-normalised or raw; 0 where not scored), from ``pfr`` ``(N, K + 1)`` (NaN past a row's steps)."""
    import torch

    gains = pfr[:, 1:] - pfr[:, :-1]
    return group_normalise(gains, ~torch.isnan(gains), num_generations, normalize), gains


def proportional_suffixes(gold: str, steps: int, prefixes: int, pattern: str = r"\n+") -> list[str]:
    """The gold text from step ``min(floor(k * M / steps), M - 1)`` on, for ``k = 0 .. prefixes - 1`` (``M`` the
    gold's steps, `trl_credit.split_steps`); k > ``steps`` gives ""."""
    _, spans = split_steps(gold, pattern)
    m = len(spans)
    if m == 0 or steps == 0:
        return [""] * prefixes
    return [gold[spans[min(k * m // steps, m - 1)][0]:] if k <= steps else "" for k in range(prefixes)]


class P2S(Plugin):
    """P2S's path-faithfulness step credit: the gold CoT's probability after each step, its gains added to A."""

    name = "p2s"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        column: str = Field("gold_cot", description="dataset column with the gold chain of thought")
        alignment: Literal["full", "proportional"] = Field(
            "full", description="continuation after prefix k: the whole gold CoT (full) or the gold CoT from its "
            "step floor(k * M / K) on (proportional; M gold steps, K model steps)")
        pattern: Regex = Field(r"\n+", description="regex separating the steps of a completion")
        gold_pattern: Regex = Field(r"\n+", description="regex separating the steps of the gold CoT (proportional)")
        max_steps: int = Field(8, ge=1, description="at most this many steps per completion (the last ones; earlier "
                               "steps merge into the first kept): K + 1 scored sequences per completion")
        model: Literal["policy", "reference"] = Field("policy", description="model that scores the gold CoT")
        coef: float = Field(0.1, ge=0, description="weight of the step credit added to the outcome advantage")
        normalize: Literal["group", "none"] = Field("group", description="step credit: PFR gains normalised over "
                                                    "the group's gains (group) or raw (none)")


    def required_columns(self):
        return [self.config.column]

    def needs_reference(self) -> bool:
        return self.config.model == "reference"

    def path_faithfulness(self, batch: RolloutBatch, before: torch.Tensor, gold: list[str],
                          steps: torch.Tensor) -> torch.Tensor:
        """``(N, K + 1)`` PFR after each prefix ``before`` (-1: not scored -> NaN)."""
        import torch

        cfg = self.config
        if cfg.alignment == "full":
            return batch.prefix_logps(before, gold, model=cfg.model, reduce="mean").exp()
        width = before.shape[1]
        suffixes = [proportional_suffixes(g, int(k), width, cfg.gold_pattern) for g, k in zip(gold, steps.tolist())]
        columns = [batch.prefix_logps(before[:, j:j + 1], [s[j] for s in suffixes], model=cfg.model, reduce="mean")
                   for j in range(width)]  # one continuation per row and call: at most max_steps + 1 calls
        return torch.cat(columns, dim=1).exp()

    @hookimpl
    def transform_advantages(self, batch: RolloutBatch, advantages: torch.Tensor) -> torch.Tensor | None:
        import torch

        cfg = self.config
        n, width = batch.num_completions, batch.width
        ends, scored = prefix_ends(batch, cfg.pattern, cfg.max_steps)
        gold = ["" if g is None else str(g) for g in batch.column(cfg.column)]
        has_gold = torch.tensor([bool(g.strip()) for g in gold], dtype=torch.bool, device=ends.device)
        steps = (ends >= 0).sum(1) * has_gold
        active = (steps > 0) & batch.scorable.to(ends.device)  # unscorable: not scored, no statistics, 0
        self.log_metric(batch, "steps", float(steps.float().mean()) if n else 0.0)
        if not bool(active.any()):
            return None
        before = torch.cat([torch.zeros(n, 1, dtype=torch.long, device=ends.device), scored], dim=1)
        before = torch.where(active.unsqueeze(1), before, -1)
        pfr = self.path_faithfulness(batch, before, gold, steps).to(batch.device)
        z, gains = step_credit(pfr, batch.num_generations, cfg.normalize)  # (N, K), K >= 1 here
        index = token_step_index(ends, width).to(batch.device)
        inside = (index < steps.to(batch.device).unsqueeze(1)) & batch.completion_mask.bool()
        credit = torch.where(inside, z.gather(1, index.clamp(max=z.shape[1] - 1)), 0.0)
        outcome = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        rows = torch.arange(n, device=batch.device)
        last = (steps.to(batch.device) - 1).clamp(min=0)
        self.log_metric(batch, "pfr_prompt", float(pfr[active, 0].mean()))
        self.log_metric(batch, "pfr_final", float(pfr[rows, last + 1][active].mean()))
        self.log_metric(batch, "gain", float(gains[~torch.isnan(gains)].mean()))
        tokens = batch.completion_mask.bool() & active.to(batch.device).unsqueeze(1)
        self.log_metric(batch, "credit_abs", float((cfg.coef * credit).abs()[tokens].mean()))
        return (outcome + cfg.coef * credit).to(torch.float32)
