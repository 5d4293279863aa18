r"""SIOP: Self-Induced Outcome Potential, turn (step) credit from the group's own answer clusters, no gold answer.

Method. The completions of a prompt are clustered by their final answers into outcome modes; a reliability-aware
target distribution ``q`` over the clusters (their frequencies, optionally calibrated) says how much each mode is
trusted. A cluster's answer is teacher-forced after every step prefix of a completion; the rise of its
(geometric-mean) probability from one prefix to the next is the step's potential-based reward, weighted by the
cluster's ``q``. The gold-answer limit (one cluster, ``q = 1``, the gold answer as its text) is IGPO's information
gain. The turns are the steps of single completions (segments between delimiters, `trl_credit.step_ends`) or,
with ``segments: turns``, the model turns of TRL's multi-turn rollouts (`trl_credit.turn_ends`: the state after a
turn includes the environment's reply to it).

Formula (group ``g`` of ``G`` completions, ``a_i`` completion ``i``'s extracted answer, ``e_ik`` the token position
just past its step ``k = 1..K_i``, ``e_i0 = 0`` the prompt alone, ``A_i`` the outcome advantage from the estimator)::

    clusters   c(i): exact match of the normalised a_i; ranked by size (ties: first occurrence); rank < M kept
    m_c        = n_c / n_answered                          (share of the group's answered completions)
    q_c        = softmax_c( log(m_c + 1e-12) / tau + eta * rbar_c )        rbar_c: nanmean of `reliability_reward`
                                                                           over c's members (0 without a column)
    w_c        = q_c if rank(c) < M else 0                 (no renormalisation: kept clusters keep their q)
    P_isk      = exp(mean_t log pi(y_s,t | prompt, x_i[:e_ik], cue, y_s,<t))     y_s: reference text s (template)
    potential "own" (the official one): the row's own cluster c = c(i), references R_c (<= num_refs distinct
              answer texts of c's members, alpha = 1 / |R_c|)
        S_ik   = sum_{s in R_c} alpha * P_isk          Phi_ik = w_c * log(S_ik + eps)  (space "prob": w_c * S_ik)
    potential "mixture": every kept cluster c of the group
        S_ik   = sum_c w_c * sum_{s in R_c} P_isk / |R_c|     Phi_ik = log(S_ik + eps)  (space "prob": S_ik)
    r_ik       = Phi_ik - Phi_i,k-1                  k = 1..K_i    (0 where a state has no finite score)
    r_iK_i    += terminal_weight * w_c(i)            (official: (1 - lambda) * q, lambda = 0.5)
    normalise "group": z = (r - mu_g) / (sigma_g + 1e-6) over the valid r of the group, sigma_g the unbiased
              std (1 when < 1e-6; a group with <= 1 valid r gets z = 0);  "scale": r / (sqrt(mean_g r^2 + 1e-8)
              + 1e-6);  "none": z = r
    credit "return": c_ik = sum_{j >= k} gamma^(j-k) z_ij;  "step": c_ik = z_ik
    A_it       = A_i + coef * c_ik(t) * m_it       tokens [e_i,k-1, e_ik) form step k

Source: the official code ``dl-m9/SIOP@a871ef90b4b165674855d2c7a8ca302981d301bc`` (read, not copied):
``verl/utils/siop/siop_process_reward.py`` (``siop_cluster_pass``: frequencies over the answered rollouts,
``_pick_refs``, the reliability calibration ``q ∝ m * exp(eta * r_c)``, the prompt-only state ``tau_0``, single-turn
rollouts get only the terminal reward; ``compute_siop_process_rewards``: ``p = sum alpha * exp(mean log-prob)`` over
finite scores, ``r_t = q * (log(p_t + eps) - log(p_t-1 + eps))``, 0 when a score is missing, ``(1 - lambda) * q``
added to the last turn), ``verl/utils/siop/scoring_server.py::score_batch`` (mean log-prob of the reference tokens
only, after the prompt, the turn prefix and the pseudo-response prefix), ``verl/utils/siop/nli_clustering.py``
(bidirectional-entailment clustering; a cluster's reference is its first member), ``verl/trainer/ppo/core_algos.py
::compute_siop_turn_level_advantage`` (per-group z-normalisation over the turn rewards, unbiased std, then the
return-to-go with gamma broadcast over each turn's tokens), ``verl/trainer/config/algorithm.py`` and
``train_siop.sh`` (lambda 0.5, eps 1e-8, eta 1.0, num_refs 3, gamma 1.0, the cue) and ``launch_siop_scorer.sh``
(the scorer is a separate, frozen model). The abstract (arXiv 2605.04984) gives the method in words.

Established (official code): the own-cluster potential weighted by the cluster's ``q``, log space with
``eps = 1e-8``, the mean log-prob of the reference tokens after an unscored cue, up to ``num_refs`` references per
cluster averaged in probability, the prompt-only state, 0 for missing scores, single-turn rollouts unscored, the
terminal ``(1 - lambda) * q``, group z-normalisation with the unbiased std, the gamma return, a frozen scorer.

Chosen here (the source is silent or does not apply; alternatives offered as options):

- clusters are exact matches of the normalised answer (the last number compared as a number, or a regex's last
  match case-folded with whitespace collapsed), not NLI entailment: no NLI model is loaded;
- the reliability evidence (official: NLI entailment of the answer by the rollout's tool observations, which single
  completions lack) is an optional reward column (``reliability_reward``, mean over the cluster's members); a
  sharpening temperature ``tau`` is added (1 = official). Default: frequencies alone (``eta`` has no effect
  without a column);
- ``max_clusters`` (3) keeps the most frequent clusters (official: all, ``null`` here): a row of a dropped cluster
  gets no step credit, the kept ones keep their ``q``; it bounds the scoring calls of ``mixture``;
- ``potential: mixture`` (one potential per row, ``Phi = sum_c w_c P(c | prefix)``, the same for every row of a
  group, credit also to completions without an answer) is the other reading of the abstract;
- the credit is *added* to the outcome advantage of the run's estimator with ``coef`` (official: the SIOP advantage
  alone, its outcome being ``(1 - lambda) q`` on the last turn). ``terminal_weight`` 0 by default, because the run's
  reward already gives the outcome; a reward-free run (a constant reward: GRPO's advantage is 0) with
  ``terminal_weight: 0.5, coef: 1, max_clusters: null`` runs the official advantage;
- ``coef`` 0.5 (not established): a z-normalised step credit of one std then moves a token's advantage by less
  than a typical outcome advantage (about 0.87 in a half-correct group of 4), so the outcome keeps its sign on most
  tokens and SIOP reorders credit inside a completion;
- the pool of the group normalisation holds the steps of the credited completions only (official: every turn end
  of every rollout, so unanswered rollouts get ``-mu / sigma``); completions without an answer in a kept cluster
  (own), without a step, with fewer than ``min_steps`` steps and no terminal reward, or dropped by a filter, get no
  credit and are not scored; a group where no completion has an answer gets none;
- the last state is the completion without its EOS (``after_eos: false``): after an end-of-turn token a chat model
  expects a new turn, not an answer (official: the turn's tokens as generated);
- the answers of dropped completions still count in the clusters (they are samples of the same outcome
  distribution); ``max_steps`` keeps the last ``max_steps`` steps (earlier ones merge into the first kept one).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from trl_credit import (AnswerTemplate, Plugin, Regex, completion_text, discounted_returns,
                        hookimpl, last_number, step_ends, turn_ends)

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch

__all__ = ["SIOP", "SIOP_CUE", "accumulate", "cluster_ranks", "extract_answer", "normalise", "potential_rewards",
           "step_of_tokens", "support", "target_distribution"]

#: The official pseudo-response before the reference answer (``siop_reference_prefix``), context, not scored.
SIOP_CUE = "\nNow there's enough information to answer\n</think>\n<answer>\n"


def extract_answer(text: str, pattern: re.Pattern | None = None) -> tuple[str, str] | None:
    """``(key, answer)`` of a completion text, or None: ``key`` is compared for clustering, ``answer`` is scored.

    No pattern: the last number (`trl_credit.last_number`), keyed as a number (``"12.0"`` and ``"12"`` share the key
    ``"12"``; the answer text keeps ``"12.0"``). A pattern: its last match (its first group when it has one),
    stripped; the key is case-folded with whitespace collapsed; an empty match is no answer.
    """
    if pattern is None:
        value = last_number(text)
        if value is None:
            return None
        return format((value + 0).normalize(), "f"), str(value)  # + 0 turns -0 into 0
    match = None
    for match in pattern.finditer(text):
        pass
    if match is None:
        return None
    answer = (match.group(1) if pattern.groups else match.group(0)) or ""
    answer = answer.strip()
    key = " ".join(answer.casefold().split())
    return (key, answer) if key else None


def cluster_ranks(keys: list[str | None], num_generations: int) -> torch.Tensor:
    """``(N,)`` long: the rank of each completion's cluster in its group by size (0 the largest; ties: the cluster
    seen first), -1 without an answer. Clusters are the distinct keys of a group."""
    import torch

    ranks: list[int] = []
    for start in range(0, len(keys), num_generations):  # one pass over the answers (strings), no tensor work
        group = keys[start: start + num_generations]
        count: dict[str, int] = {}
        for key in group:
            if key is not None:
                count[key] = count.get(key, 0) + 1
        order = {key: r for r, key in enumerate(sorted(count, key=lambda k: -count[k]))}  # stable: first seen
        ranks += [order[key] if key is not None else -1 for key in group]
    return torch.tensor(ranks, dtype=torch.long)


def target_distribution(ranks: torch.Tensor, num_generations: int, temperature: float = 1.0,
                        evidence: torch.Tensor | None = None, eta: float = 0.0,
                        max_clusters: int | None = None) -> torch.Tensor:
    """``(N // G, G)`` ``w``: the target weight of each group's cluster of rank ``c`` (0 past its clusters).

    ``q_c = softmax(log(m_c + 1e-12) / temperature + eta * rbar_c)`` over the group's clusters, ``m_c`` the share of
    answered completions in cluster ``c``, ``rbar_c`` the mean of ``evidence`` ``(N,)`` over ``c``'s members (NaN
    ignored; 0 when none); ranks ``>= max_clusters`` get 0 (the others keep their ``q``). No answer: all 0.
    """
    import torch

    g = num_generations
    r = ranks.reshape(-1, g)
    member = r.unsqueeze(-1) == torch.arange(g, device=r.device)  # (B, G members, G clusters)
    counts = member.sum(1).to(torch.float64)  # (B, G)
    share = counts / counts.sum(1, keepdim=True).clamp(min=1)
    logits = torch.log(share + 1e-12) / temperature
    if evidence is not None and eta != 0.0:
        e = evidence.reshape(-1, g, 1).to(torch.float64)
        has = member & ~torch.isnan(e)
        total = torch.where(has, e, 0.0).sum(1)
        n = has.sum(1)
        logits = logits + eta * torch.where(n > 0, total / n.clamp(min=1), 0.0)
    logits = logits.masked_fill(counts == 0, float("-inf"))
    q = torch.softmax(logits, dim=1).nan_to_num(0.0)  # a group without answers: all -inf -> 0
    if max_clusters is not None:
        q = torch.where(torch.arange(g, device=q.device) < max_clusters, q, 0.0)
    return q.to(torch.float32)


def support(logps: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(S (N, K+1), found (N, K+1))``: ``S = sum_s beta_s * exp(logps_s)`` over the finite scores of the ``s``
    slots (``logps`` ``(slots, N, K+1)`` mean log-probs, NaN unscored; ``beta`` ``(slots, N)``), ``found`` where
    at least one slot was scored."""
    import torch

    finite = torch.isfinite(logps)
    value = (beta.unsqueeze(-1) * torch.where(finite, logps, float("-inf")).exp()).sum(0)
    return value, finite.any(0)


def potential_rewards(phi: torch.Tensor, found: torch.Tensor) -> torch.Tensor:
    """``(N, K)`` ``r_k = Phi_k - Phi_k-1`` (``k = 1..K``) from ``Phi`` ``(N, K+1)``; 0 where either state has no
    score (the official code's 0.0)."""
    import torch

    ok = found[:, 1:] & found[:, :-1]
    return torch.where(ok, phi[:, 1:] - phi[:, :-1], 0.0)


def normalise(rewards: torch.Tensor, valid: torch.Tensor, num_generations: int, mode: str) -> torch.Tensor:
    """Step rewards ``(N, K)`` normalised over the valid steps of each group; 0 elsewhere.

    ``group``: ``(r - mu) / (sigma + 1e-6)``, ``sigma`` the unbiased std (1 when below 1e-6), 0 for a group with at
    most one valid reward (the official code); ``scale``: ``r / (sqrt(mean r^2 + 1e-8) + 1e-6)``; ``none``: ``r``.
    """
    import torch

    r = torch.where(valid, rewards, 0.0)
    if mode == "none":
        return r
    n, k = r.shape
    flat, m = r.reshape(-1, num_generations * k), valid.reshape(-1, num_generations * k).to(r.dtype)
    count = m.sum(1, keepdim=True)
    if mode == "scale":
        rms = ((flat ** 2 * m).sum(1, keepdim=True) / count.clamp(min=1) + 1e-8).sqrt()
        return (flat / (rms + 1e-6) * m).reshape(n, k)
    mean = (flat * m).sum(1, keepdim=True) / count.clamp(min=1)
    sigma = (((flat - mean) ** 2 * m).sum(1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
    sigma = torch.where(sigma < 1e-6, 1.0, sigma)
    z = (flat - mean) / (sigma + 1e-6) * m * (count > 1)
    return z.reshape(n, k)


def accumulate(z: torch.Tensor, gamma: float) -> torch.Tensor:
    """``c_k = sum_{j >= k} gamma^(j - k) z_j`` along the last dimension (entries past a row's steps are 0)."""
    return discounted_returns(z, gamma)


def step_of_tokens(ends: torch.Tensor, width: int) -> torch.Tensor:
    """``(N, T)`` long: the (0-based) step of each token position, ``K`` past the last step end.

    ``ends`` ``(N, K)`` increasing step ends, -1 padding; tokens ``[ends[k-1], ends[k])`` form step ``k``.
    """
    import torch

    bounded = torch.where(ends >= 0, ends, torch.iinfo(torch.long).max).contiguous()
    position = torch.arange(width, device=ends.device).expand(ends.shape[0], width).contiguous()
    return torch.searchsorted(bounded, position, right=True)


class SIOP(Plugin):
    """SIOP step mode: r_k = Phi_k - Phi_k-1, Phi = q_c log P(answer of cluster c | prefix), clusters of the group's
    own answers; z-normalised, accumulated and added to the outcome advantage."""

    name = "siop"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        answer_pattern: Regex | None = Field(None, description="regex whose last match (its first group if it has "
                                           "one) is a completion's final answer, clustered case-folded with "
                                           "whitespace collapsed; null: the last number, clustered as a number")
        max_clusters: int | None = Field(3, ge=1, description="keep the most frequent clusters of a group (ties: "
                                         "first seen); rows of the others get no credit; null: all (official)")
        num_refs: int = Field(1, ge=1, description="distinct answer texts of a cluster scored as its references, "
                              "averaged in probability (official default 1, its launcher 3)")
        temperature: float = Field(1.0, gt=0.0, description="tau: q proportional to share^(1/tau) (1: the "
                                   "frequencies; < 1 sharpens towards the majority)")
        reliability_reward: str | None = Field(None, description="reward column whose mean over a cluster's "
                                               "members calibrates q: q ∝ share^(1/tau) * exp(eta * mean); null: "
                                               "frequencies only")
        eta: float = Field(1.0, ge=0.0, description="weight of reliability_reward in q (official launcher 1.0, "
                           "on NLI evidence); no effect without reliability_reward")
        potential: Literal["own", "mixture"] = Field("own", description="own: Phi_i = q_c(i) f(P(c(i) | prefix)), "
                                                     "the row's own cluster (official); mixture: Phi = f(sum_c w_c "
                                                     "P(c | prefix)) over the kept clusters")
        space: Literal["log", "prob"] = Field("log", description="f: log(P + epsilon) (official) or the "
                                              "probability itself")
        epsilon: float = Field(1e-8, gt=0.0, description="eps in log(P + eps) (official 1e-8)")
        cue: str = Field(SIOP_CUE, description="text teacher-forced between a prefix and the answer (context, not "
                         "scored); the official pseudo-response prefix by default")
        template: AnswerTemplate = Field("{answer}", description="the scored reference text; {answer} is replaced by the "
                              "cluster's answer text")
        segments: Literal["steps", "turns"] = Field("steps", description="what a turn is: a segment of the text "
                                                    "(pattern) or a model turn of a multi-turn rollout (TRL's tool "
                                                    "mask; the state after a turn includes the environment's reply)")
        pattern: Regex = Field(r"\n+", description="regex separating the steps (turns) of a completion (delimiter "
                             "included in the step it closes)")
        max_steps: int = Field(8, ge=1, description="at most this many steps per completion (the last ones; "
                               "earlier steps merge into the first kept): max_steps + 1 scored prefixes")
        min_steps: int = Field(2, ge=1, description="completions with fewer steps are not scored (official: "
                               "single-turn rollouts get only the terminal reward)")
        after_eos: bool = Field(False, description="score the last state after the completion's EOS (official); "
                                "false: before it")
        normalise: Literal["group", "scale", "none"] = Field("group", description="step rewards over the group's "
                                                             "steps: z-scored with the unbiased std (group, "
                                                             "official), divided by their RMS (scale), raw (none)")
        credit: Literal["return", "step"] = Field("return", description="token credit of step k: the return "
                                                  "sum_{j>=k} gamma^(j-k) z_j (official) or z_k alone (step)")
        gamma: float = Field(1.0, ge=0.0, le=1.0, description="discount of the return (official 1.0)")
        terminal_weight: float = Field(0.0, ge=0.0, description="(1 - lambda): terminal_weight * q_c(i) added to "
                                       "the last step's reward (official 0.5, for runs without an outcome reward)")
        coef: float = Field(0.5, ge=0.0, description="weight of the step credit added to the outcome advantage "
                            "(not established)")
        model: Literal["reference", "policy"] = Field("reference", description="model that scores the answers: "
                                                      "the frozen reference (official: a frozen scorer) or the "
                                                      "current policy")



    def required_rewards(self):
        return [self.config.reliability_reward] if self.config.reliability_reward else []

    def needs_reference(self) -> bool:
        return self.config.model == "reference"  # the official code scores under a frozen model

    # ------------------------------------------------------------------ pieces of the hook
    def _clusters(self, batch: RolloutBatch):
        """Answers, cluster ranks, target weights ``w`` ``(B, G)`` and each cluster's reference texts."""
        cfg = self.config
        regex = re.compile(cfg.answer_pattern) if cfg.answer_pattern is not None else None
        found = [extract_answer(completion_text(c), regex) for c in batch.completions]
        g = batch.num_generations
        ranks = cluster_ranks([f[0] if f else None for f in found], g)
        evidence = batch.reward(cfg.reliability_reward).cpu() if cfg.reliability_reward else None
        w = target_distribution(ranks, g, cfg.temperature, evidence, cfg.eta, cfg.max_clusters)
        refs: dict[tuple[int, int], list[str]] = {}  # (group, rank) -> distinct answer texts, in row order
        for i, (f, rank) in enumerate(zip(found, ranks.tolist())):
            if f is not None:
                texts = refs.setdefault((i // g, rank), [])
                if f[1] not in texts and len(texts) < cfg.num_refs:
                    texts.append(f[1])
        return ranks, w, refs

    def _slots(self, ranks, w, refs, scored, g):
        """Per scoring slot: the reference text of each row (None: not scored) and its weight ``beta`` ``(S, N)``."""
        import torch

        cfg = self.config
        n = ranks.shape[0]
        per_cluster = cfg.num_refs
        clusters = 1 if cfg.potential == "own" else min(cfg.max_clusters or g, g)
        texts: list[list[str | None]] = [[None] * n for _ in range(clusters * per_cluster)]
        beta = torch.zeros(clusters * per_cluster, n)
        for i in torch.nonzero(scored).flatten().tolist():
            group = i // g
            for c in range(clusters):
                rank = int(ranks[i]) if cfg.potential == "own" else c
                answers = refs.get((group, rank), [])
                if not answers or w[group, rank] <= 0:
                    continue
                for j, answer in enumerate(answers):
                    texts[c * per_cluster + j][i] = cfg.template.replace("{answer}", answer)
                    # own: alpha = 1/|R_c| (q multiplies the log); mixture: w_c / |R_c|
                    beta[c * per_cluster + j, i] = (1.0 if cfg.potential == "own" else float(w[group, rank])) \
                        / len(answers)
        return texts, beta

    @hookimpl
    def transform_advantages(self, batch: RolloutBatch, advantages: torch.Tensor) -> torch.Tensor | None:
        import torch

        cfg = self.config
        n, width, g = batch.num_completions, batch.width, batch.num_generations
        ranks, w, refs = self._clusters(batch)
        answered = ranks >= 0
        group_answered = answered.reshape(-1, g).any(1)
        self.log_metric(batch, "answered", float(answered.float().mean()) if n else 0.0)
        if group_answered.any():
            distinct = (ranks.reshape(-1, g).max(1).values + 1).float()  # clusters per group, before max_clusters
            self.log_metric(batch, "clusters", float(distinct[group_answered].mean()))
            self.log_metric(batch, "top_share", float(w[group_answered, 0].mean()))
        q_row = w.gather(1, ranks.reshape(-1, g).clamp(min=0)).reshape(-1) * answered  # w of the row's cluster
        ends = (turn_ends(batch, cfg.max_steps) if cfg.segments == "turns"  # (N, K) ends of the kept steps
                else step_ends(batch, cfg.pattern, cfg.max_steps)).cpu()
        steps = (ends >= 0).sum(1)
        eligible = (q_row > 0) if cfg.potential == "own" else group_answered.repeat_interleave(g)
        base = eligible & (steps > 0) & (batch.kept & batch.scorable).cpu()  # unscorable rows get 0, as TRL
        scored = base & (steps >= cfg.min_steps)
        credited = scored | (base & (cfg.terminal_weight > 0))
        if not credited.any() or ends.shape[1] == 0:  # nothing to credit: the outcome advantages stand
            return None
        k = ends.shape[1]
        # the last state is the completion's text: an EOS closing the last step is left out unless after_eos
        lengths = batch.completion_lengths.cpu()
        eos = getattr(batch.tokenizer, "eos_token_id", None)
        last_id = batch.completion_ids.cpu().gather(1, (lengths - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
        ends_in_eos = (lengths > 0) & (last_id == eos) if eos is not None and not cfg.after_eos \
            else torch.zeros(n, dtype=torch.bool)
        read_at = ends - ((ends == lengths.unsqueeze(1)) & ends_in_eos.unsqueeze(1)).long()
        before = torch.cat([torch.zeros(n, 1, dtype=torch.long), read_at], dim=1)  # (N, K+1) states, 0 = prompt
        before = torch.where(scored.unsqueeze(1) & (torch.arange(k + 1) <= steps.unsqueeze(1)), before, -1)
        texts, beta = self._slots(ranks, w, refs, scored, g)
        logps = torch.full((len(texts), n, k + 1), float("nan"))
        for s, row_texts in enumerate(texts):  # one scoring call per slot: <= num_refs (own), x max_clusters (mixture)
            has = torch.tensor([t is not None for t in row_texts])
            if has.any():
                logps[s] = batch.prefix_logps(torch.where(has.unsqueeze(1), before, -1),
                                              [t or "" for t in row_texts], model=cfg.model, reduce="mean",
                                              context=cfg.cue or None).cpu()
        value, found = support(logps, beta)  # (N, K+1)
        f = torch.log(value + cfg.epsilon) if cfg.space == "log" else value
        phi = q_row.unsqueeze(1) * f if cfg.potential == "own" else f
        position = torch.arange(k).unsqueeze(0)
        process = scored.unsqueeze(1) & (position < steps.unsqueeze(1))
        rewards = torch.where(process, potential_rewards(phi, found), 0.0)  # (N, K)
        last = credited.unsqueeze(1) & (position == (steps - 1).unsqueeze(1))
        rewards = rewards + torch.where(last, cfg.terminal_weight * q_row.unsqueeze(1), 0.0)
        valid = credited.unsqueeze(1) & (position < steps.unsqueeze(1))
        z = normalise(rewards, valid, g, cfg.normalise)
        credit = accumulate(z, cfg.gamma) if cfg.credit == "return" else z
        credit = torch.cat([credit, torch.zeros(n, 1)], dim=1)  # tokens past the last step end: no credit
        mask = batch.turns().model.cpu().to(torch.float32)  # the model's tokens: not the environment's replies
        token_credit = credit.gather(1, step_of_tokens(ends, width)) * mask
        outcome = advantages.cpu().to(torch.float32)
        outcome = outcome.unsqueeze(1).expand(n, width) if outcome.dim() == 1 else outcome
        pairs = process & found[:, 1:] & found[:, :-1]
        if pairs.any():
            self.log_metric(batch, "step_reward", float(rewards[pairs].mean()))
            final = phi.gather(1, steps.clamp(max=k).unsqueeze(1)).squeeze(1) - phi[:, 0]
            self.log_metric(batch, "potential_gain", float(final[scored].mean()))
        self.log_metric(batch, "scored", float(scored.float().mean()))
        self.log_metric(batch, "steps", float(steps[credited].float().mean()))
        tokens = mask.sum().clamp(min=1)
        self.log_metric(batch, "credit_abs", float((cfg.coef * token_credit).abs().sum() / tokens))
        self.log_metric(batch, "outcome_abs", float((outcome * mask).abs().sum() / tokens))
        return (outcome + cfg.coef * token_credit).to(advantages.device)
