"""SPAE: step potential from answer probes, as a transform of the advantages.

Method. After every reasoning step the policy is asked for its answer: the probe cue
(``"**Final Answer**\\n\\\\boxed{"``) is appended to the prefix that ends the step and a few short answers are
sampled. How much probability the sampled positions put on the gold answer's tokens (accuracy) and how peaked
those positions are (confidence) give the step a potential. Steps that raise the potential earn credit, steps
that lower it lose credit, and once the potential saturates (the answer is found) the outcome credit of the
tokens that follow (post-solution checking) is scaled down.

Potential (``cii030/SPAE-RL@ed529f8a`` ``inference/probe_mechanism_example.py``, run here as written below).
Completion ``i``, step ``k`` ending at token ``e_ik`` (`trl_credit.step_ends`), ``S`` probe samples ``s`` of at most
``L`` tokens sampled after ``prompt + y_i[:e_ik] + cue``, gold answer tokens ``g_1 .. g_G`` (the dataset column,
tokenised alone without special tokens), ``n_iks = min(G, length of sample s)`` positions used::

    lp_l   = log p(g_l) read from position l's top-k list, -10 when g_l is not in it   (positions are sampled,
             (the sampled token counts as listed, as vLLM's top-logprobs dict holds it)  not teacher-forced)
    H_l    = -sum_{v in top-k at l} p_v log p_v          raw top-k probabilities, not renormalised (the code)
    acc_ik  = (1/S) sum_s exp(sum_{l <= n_iks} lp_l) / n_iks            the division AFTER exp: the repo's quirk,
    conf_ik = (1/S) sum_s exp(-sum_{l <= n_iks} H_l) / n_iks            reproduced (a sample with n = 0 adds 0)
    Phi_ik  = 1.5 * acc_ik * conf_ik + 0.5 * acc_ik - conf_ik           in [-1, 1]
    dPhi_ik = Phi_ik - Phi_i,k-1,   dPhi_i0 = 0                          "solved" at the first k with Phi_ik > 0.9

Advantage (abstract-inferred; methods.md 2.28's suggested form). ``A_i`` the incoming advantage (GRPO's, or a
previous transform's per token), ``k(t)`` the step of token ``t``, ``k*_i`` the first solved step::

    sat_it = 1[k(t) > k*_i]                                   tokens after the solving step
    A_it   = A_i * (1 - kappa * sat_it) + alpha * dPhi_i,k(t)      saturation: all (the suggested form)
    A_it   = the same, the factor only where A_i > 0             saturation: positive (default)
    A_it   = A_i - kappa * |A_i| * sat_it + alpha * dPhi_i,k(t)     saturation: subtract

Source: methods.md 2.28 (potential [code], advantage [abstract-inferred]); the official potential code read for
this plugin: ``cii030/SPAE-RL@ed529f8a`` ``inference/probe_mechanism_example.py`` (the training recipe folder of
that repository is empty).

Established (code): probe cue, N = 5 samples, T = 0.6, 10 tokens, top-20 log-probs; -10 for a gold token absent
from a position's list; acc and conf with the division by the positions used after the exponential; the raw,
unrenormalised top-k entropy; Phi and dPhi (0 at the first step); solved at Phi > 0.9; steps end at a token ending
in ".\\n\\n". Chosen here (the source is silent): the advantage form and ``kappa = 0.5``, ``alpha = 0.5``
(options, with ``saturation`` readings); the gold token is matched by id (the code looks the token's raw string up
among vLLM's decoded strings, which differ for byte-level tokens with a leading space); ``fallback_pattern`` (a
completion without SPAE's ".\\n\\n" boundaries is cut into lines, so plain newline-separated reasoning still gets
steps); ``max_steps`` (the last steps are kept, earlier ones merge into the first kept one: bounds the probes);
the whole completion is probed (the code stops at ``</think>``), its last step too (the code probes only after
".\\n\\n" tokens), without the EOS that closes it; ``saturation: positive`` by default (the code marks the solving
step only in correct answers, and scaling a negative A by ``1 - kappa`` would soften, not penalise, the checking
that overturned a found answer; ``all`` is the suggested form, ``subtract`` penalises both signs); rows without a
reward or dropped by a filter are not probed and keep their advantage; log-probs are the model's at temperature 1
(`RolloutBatch.probe`); ``entropy: renormalised`` reads the renormalised top-k distribution
(`Probes.topk_entropy`) instead; ``first_delta: prompt`` probes after the prompt alone too and gives the first
step ``Phi_i0 - Phi_prompt``.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from trl_credit import ConfigError, Plugin, Regex, hookimpl, step_ends, token_steps

if TYPE_CHECKING:
    import torch

    from trl_credit import Probes, RolloutBatch, RunInfo

__all__ = ["SPAE", "SPAE_CUE", "SPAE_PATTERN", "potential", "potential_deltas", "probe_scores", "segments"]

SPAE_CUE = "**Final Answer**\n\\boxed{"
SPAE_PATTERN = r"\.\n\n"


def potential(acc: torch.Tensor, conf: torch.Tensor) -> torch.Tensor:
    """SPAE's step potential ``Phi = 1.5 acc conf + 0.5 acc - conf`` (elementwise)."""
    return 1.5 * acc * conf + 0.5 * acc - conf


def potential_deltas(phi: torch.Tensor, valid: torch.Tensor, before: torch.Tensor | None = None) -> torch.Tensor:
    """``(N, K)`` ``dPhi_k = Phi_k - Phi_k-1`` over valid neighbours, 0 at the first step (or ``Phi_0 - before``)."""
    import torch

    if before is None:
        prev, prev_ok = torch.cat([phi[:, :1], phi[:, :-1]], 1), torch.cat([valid[:, :1], valid[:, :-1]], 1)
    else:
        prev = torch.cat([before[:, :1], phi[:, :-1]], 1)
        prev_ok = torch.cat([torch.isfinite(before[:, :1]), valid[:, :-1]], 1)
    return torch.where(valid & prev_ok, phi - prev, 0.0)


def probe_scores(probes: Probes, gold: torch.Tensor, entropy: str = "raw",
                 floor: float = -10.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(acc, conf)``, each ``(N, K)``, from the probes and the gold ids ``(N, G)`` (-1 padded); 0 where not probed."""
    import torch

    n, length = probes.tokens.shape[0], probes.tokens.shape[-1]
    target = torch.full((n, length), -1, dtype=torch.long, device=probes.tokens.device)
    width = min(gold.shape[1], length)
    target[:, :width] = gold[:, :width].to(target.device)
    mask = probes.mask.bool()
    sampled = probes.tokens == target[:, None, None, :]
    lp = torch.where(sampled & mask, probes.logps, probes.token_logp(target, floor))
    used = (torch.arange(length, device=mask.device) < (target >= 0).sum(1)[:, None, None, None]) & mask
    count = used.sum(-1)
    if entropy == "raw":  # the code: the listed probabilities as they are, the sampled token among them
        top = probes.topk_logps
        h = -torch.where(torch.isfinite(top), top.exp() * top, 0.0).sum(-1)
        listed = (probes.topk_ids == probes.tokens.unsqueeze(-1)).any(-1)
        h = h - torch.where(mask & ~listed, probes.logps.exp() * probes.logps, 0.0)
    else:
        h = probes.topk_entropy()
    per = count.clamp(min=1).to(lp.dtype)
    acc = torch.where(count > 0, (lp * used).sum(-1).exp() / per, 0.0).mean(-1)
    conf = torch.where(count > 0, (-(h * used).sum(-1)).exp() / per, 0.0).mean(-1)
    return acc, conf


def _split(batch: RolloutBatch, pattern: str, max_steps: int | None):
    import torch

    index, steps = token_steps(batch, pattern, fill=True)
    counts = torch.tensor([len(x) for x in steps], dtype=torch.long, device=index.device)
    return step_ends(batch, pattern, max_steps).to(index.device), index, counts


def _pad(x: torch.Tensor, k: int) -> torch.Tensor:
    import torch

    return torch.nn.functional.pad(x, (0, k - x.shape[1]), value=-1) if x.shape[1] < k else x


def segments(batch: RolloutBatch, pattern: str, fallback: str | None,
             max_steps: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ends (N, K), step (N, T), count (N,))``: the probed prefix ends, the kept step of each token (-1 outside
    every step) and the kept steps per row. Rows where ``pattern`` finds fewer than two steps use ``fallback``
    when it finds more. The EOS that closes a completion is not part of a prefix."""
    import torch

    ends, index, counts = _split(batch, pattern, max_steps)
    if fallback is not None and fallback != pattern:
        f_ends, f_index, f_counts = _split(batch, fallback, max_steps)
        use = (counts < 2) & (f_counts > counts)
        k = max(ends.shape[1], f_ends.shape[1])
        ends = torch.where(use[:, None], _pad(f_ends, k), _pad(ends, k))
        index = torch.where(use[:, None], f_index, index)
        counts = torch.where(use, f_counts, counts)
    kept = counts if max_steps is None else counts.clamp(max=max_steps)
    ends = ends[:, : int(kept.max()) if kept.numel() else 0]
    step = torch.where(index >= 0, (index - (counts - kept)[:, None]).clamp(min=0), -1)
    lengths = batch.completion_lengths.to(index.device)
    eos = getattr(batch.tokenizer, "eos_token_id", None)
    content = lengths
    if eos is not None and lengths.numel():
        last = batch.completion_ids.to(index.device).gather(1, (lengths - 1).clamp(min=0)[:, None])[:, 0]
        content = lengths - ((lengths > 0) & (last == eos)).long()
    ends = torch.where(ends >= 0, torch.minimum(ends, content[:, None]), -1)
    return ends, step, kept


def _empty_match(pattern: str) -> bool:
    return re.compile(pattern).fullmatch("") is not None


class SPAE(Plugin):
    """SPAE: answer probes after each step give a potential; shape the advantages by its differences and damp the
    credit of tokens after the potential saturates (a transform: it runs after GRPO's or another estimator)."""

    name = "spae"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        column: str = Field("answer", description="dataset column with the gold answer (tokenised alone, "
                            "no special tokens)")
        cue: str = Field(SPAE_CUE, description="probe text appended after each step prefix (SPAE's)")
        pattern: Regex = Field(SPAE_PATTERN, description="regex ending a step (SPAE: a paragraph ending in '.')")
        fallback_pattern: Regex | None = Field(r"\n+", description="rows where `pattern` finds fewer than two steps "
                                             "are cut with this regex instead when it finds more (lines); null: "
                                             "no fallback")
        max_steps: int | None = Field(8, ge=1, description="probed steps per completion at most (the last ones; "
                                      "earlier steps merge into the first kept); null: every step (SPAE)")
        num_samples: int = Field(5, ge=1, description="probe samples per step (SPAE: 5)")
        max_new_tokens: int = Field(10, ge=1, description="tokens per probe sample at most (SPAE: 10)")
        temperature: float = Field(0.6, gt=0, description="probe sampling temperature (SPAE: 0.6)")
        top_k: int = Field(20, ge=1, description="log-probs kept per probe position (SPAE: 20)")
        floor: float = Field(-10.0, le=0, description="log-prob of a gold token absent from a position's top-k "
                             "list (SPAE: -10)")
        entropy: Literal["raw", "renormalised"] = Field("raw", description="confidence entropy from the raw top-k "
                                                       "probabilities (SPAE's code) or the renormalised top-k")
        solved_threshold: float = Field(0.9, description="potential above which a step counts as solved (SPAE: 0.9)")
        kappa: float = Field(0.5, ge=0, le=1, description="saturation penalty: share of the outcome credit taken "
                             "from tokens after the first solved step")
        alpha: float = Field(0.5, ge=0, description="weight of the potential difference added to each step's tokens")
        saturation: Literal["positive", "all", "subtract"] = Field(
            "positive", description="positive: scale A_i by (1 - kappa) after saturation where A_i > 0; all: "
            "wherever (the suggested form); subtract: A_i - kappa |A_i| whatever its sign")
        first_delta: Literal["zero", "prompt"] = Field("zero", description="dPhi of the first step: 0 (SPAE) or "
                                                       "Phi after it minus Phi after the prompt alone (one more probe)")


    def required_columns(self):
        return [self.config.column]

    def check_args(self, run: RunInfo) -> None:
        for key in ("pattern", "fallback_pattern"):
            value = getattr(self.config, key)
            if value is not None and _empty_match(value):
                raise ConfigError.for_key(key, f"{value!r} matches the empty string, so every character would end "
                                          "a step (one probe each)",
                                          "use a delimiter that needs at least one character, e.g. '\\n+' or "
                                          "'\\.\\n\\n', or a lookahead such as '(?=Step \\d)'")

    def gold_ids(self, batch: RolloutBatch, width: int) -> torch.Tensor:
        """``(N, width)`` long: the gold answer's ids (batch tokenizer, no special tokens), -1 padded, cut at ``width``."""
        import torch

        golds = [str(v) for v in batch.column(self.config.column)]
        unique = list(dict.fromkeys(golds))
        table = torch.full((len(unique), max(width, 1)), -1, dtype=torch.long)
        if unique:
            for u, ids in enumerate(batch.tokenizer(unique, add_special_tokens=False)["input_ids"]):
                ids = list(ids)[:width]
                table[u, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        where = {g: u for u, g in enumerate(unique)}
        return table[torch.tensor([where[g] for g in golds], dtype=torch.long)]

    @hookimpl
    def transform_advantages(self, batch: RolloutBatch, advantages: torch.Tensor) -> torch.Tensor | None:
        import torch

        cfg = self.config
        device = advantages.device
        ends, step, count = (x.to(device) for x in segments(batch, cfg.pattern, cfg.fallback_pattern, cfg.max_steps))
        # rows no reward function judged keep GRPO's 0, dropped rows get 0: neither is probed
        judged = ~torch.isnan(batch.rewards.to(device)).all(1) & batch.kept.to(device)
        count = torch.where(judged, count, 0)
        ends = torch.where(judged[:, None], ends, -1)
        n, width = step.shape
        k = ends.shape[1]
        self.log_metric(batch, "steps", float(count.float().mean()) if n else 0.0)
        if k == 0 or not bool((ends >= 0).any()):  # no step to probe
            return None
        prompt = cfg.first_delta == "prompt"
        probe_ends = torch.cat([torch.where(count > 0, 0, -1)[:, None], ends], 1) if prompt else ends
        probes = batch.probe(probe_ends, cfg.cue, num_samples=cfg.num_samples, max_new_tokens=cfg.max_new_tokens,
                             temperature=cfg.temperature, top_k=cfg.top_k)
        acc, conf = (x.to(device) for x in probe_scores(probes, self.gold_ids(batch, cfg.max_new_tokens), cfg.entropy,
                                                        cfg.floor))
        phi_all, valid_all = potential(acc, conf), probes.valid.to(device)
        phi, valid = phi_all[:, -k:], valid_all[:, -k:]
        before = torch.where(valid_all[:, :1], phi_all[:, :1], torch.nan) if prompt else None
        delta = potential_deltas(phi, valid, before)
        solved = valid & (phi > cfg.solved_threshold)
        first = torch.where(solved.any(1), solved.long().argmax(1), k)  # the first solved step, k: none
        inside = (step >= 0) & (count > 0)[:, None]
        after = inside & (step > first[:, None])
        shaping = torch.where(inside, delta.gather(1, step.clamp(min=0)), 0.0)
        a = advantages.float()
        a = a[:, None].expand(n, width) if a.dim() == 1 else a
        if cfg.saturation == "subtract":
            scaled = a - cfg.kappa * a.abs() * after
        else:
            damp = after & (a > 0) if cfg.saturation == "positive" else after
            scaled = torch.where(damp, a * (1.0 - cfg.kappa), a)
        real = batch.completion_mask.to(device).bool()
        moved = valid if prompt else valid & (torch.arange(k, device=device) > 0)
        self.log_metric(batch, "potential", float(phi[valid].mean()))
        self.log_metric(batch, "accuracy", float(acc[:, -k:][valid].mean()))
        self.log_metric(batch, "confidence", float(conf[:, -k:][valid].mean()))
        self.log_metric(batch, "delta_potential", float(delta[moved].mean()) if moved.any() else 0.0)
        self.log_metric(batch, "solved", float(solved.any(1)[count > 0].float().mean()))
        self.log_metric(batch, "saturated_tokens", float((after & real).sum() / real.sum().clamp(min=1)))
        self.log_metric(batch, "probes_per_completion", float(valid_all.sum()) * cfg.num_samples / max(n, 1))
        return scaled + cfg.alpha * shaping
