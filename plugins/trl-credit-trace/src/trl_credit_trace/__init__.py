r"""TRACE: gold-answer log-ratio state values from a frozen reference, TD action rewards as token credit.

Method. A frozen reference model reads the gold answer ``y*`` after every step boundary of a trajectory; the
log-probability it gives ``y*``, relative to its value before the first step, is the *state value*, and each
action (step) is rewarded by the change it made to that value (a TD difference with gamma = 1, so the rewards of
a trajectory telescope to its final value and a step that changes nothing earns 0). The dense rewards are
combined with the outcome. Steps are segments of a completion between delimiters (`trl_credit.step_ends`), or,
with ``segments: turns``, the model turns of TRL's multi-turn rollouts (`RolloutBatch.turns`): the state after
turn ``k`` is the prefix up to where turn ``k + 1`` begins (the environment's reply included), the last state
the whole completion.

Formula (completion ``i`` with kept steps ``k = 1..K_i``, ``e_ik`` the token position just past step ``k``,
``e_i0 = 0`` the prompt alone, ``g`` its group, ``A_i`` the outcome advantage from the estimator)::

    L_ik  = sum_{t in y*} log pi_ref(y*_t | prompt, y_i[:e'_ik], cue, y*_<t)     reduce "sum" (mean: / |y*|)
            e'_ik = e_ik, minus 1 when step K_i ends with the completion's EOS (y* is read after the text)
    V_ik  = L_ik - L_i0                                              (log-ratio state value, V_i0 = 0)
    r_ik  = V_ik - V_i,k-1                                           k = 1..K_i   (sum_k r_ik = V_iK)
    normalise "scale": z_ik = r_ik / (sqrt(mean_g r^2 + 1e-8) + 1e-6)   over the valid r of the group
              "group": z_ik = (r_ik - mu_g) / (sqrt(mean_g (r - mu_g)^2 + 1e-8) + 1e-6)
              "none":  z_ik = r_ik
    credit "reward": c_ik = z_ik;   "return": c_ik = sum_{j >= k} z_ij
    A_it  = A_i + coef * c_ik(t) * m_it          c_ik(t): the credit of the step token t lies in
                                                 (tokens [e_i,k-1, e_ik) form step k)

Only the tokens of ``y*`` (``template``) are summed: the ``cue`` between the prefix and the answer is context,
not scored (`RolloutBatch.prefix_logps` ``context=``: the cue is tokenised on its own).

Source: methods.md 2.27, from the paper's abstract only ("gold-answer log-probabilities from a frozen reference
model, transformed into log-ratio state values, per-action rewards as TD changes"). Established: the frozen
reference, log space, ``V(s_k) = log pi_ref(y* | s_k) - log pi_ref(y* | s_0)``, ``r_k = V(s_k) - V(s_k-1)``,
a combination with the outcome reward. Not established: how the action rewards become credit and the mixing
weight; sum vs mean over the answer's tokens.

Chosen here (offered as options where there is a reading to choose):

- the step reward ``r_k`` is broadcast to the tokens of step k (``credit: reward``; ``return``: the
  reward-to-go, ``V(s_K) - V(s_k-1)``, the gamma = 1 return of the TD rewards) and added to the outcome advantage;
- ``normalise: scale`` divides the step rewards by their root-mean-square over the group's steps: unit scale,
  comparable to the std-normalised outcome advantage, and the sign kept (a step that raised the reference's
  belief in ``y*`` gets positive credit, one that changed nothing 0). ``group`` also centres them (IGPO's
  joint normalisation, population sigma); ``none`` keeps the nats;
- ``coef`` 0.5: a step credit of one RMS then moves a token's advantage by less than a typical outcome
  advantage (about 0.87 in a half-correct group of 4), so the outcome keeps its sign on most tokens and the
  step credit reorders credit inside a completion; 1.0 weights the two equally;
- ``cue`` "\nThe answer is" and ``template`` " {answer}": the reference is asked for the answer the same way
  after every state (the last state is the completion without its EOS: after an end-of-turn token an instruct
  model expects a new turn, not an answer, which would penalise every finished completion);
- a completion without a step (empty), without a gold answer, or dropped by a filter gets no step credit and
  is not scored; ``max_steps`` keeps the last ``max_steps`` steps (earlier ones merge into the first kept one),
  bounding the scored prefixes to ``max_steps + 1`` per completion.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from trl_credit import AnswerTemplate, Plugin, Regex, has_answer, hookimpl, step_ends, turn_ends

if TYPE_CHECKING:
    import torch

    from trl_credit import RolloutBatch

__all__ = ["TRACE", "action_rewards", "normalise", "reward_to_go", "state_values",
           "step_of_tokens"]


def state_values(logp: torch.Tensor) -> torch.Tensor:
    """``(N, K+1)`` ``V_k = L_k - L_0`` from ``L`` ``(N, K+1)`` (NaN where a state was not scored)."""
    return logp - logp[:, :1]


def action_rewards(logp: torch.Tensor) -> torch.Tensor:
    """``(N, K)`` ``r_k = V_k - V_k-1`` (``k = 1..K``) from ``L`` ``(N, K+1)``; NaN where either state is missing."""
    values = state_values(logp)
    return values[:, 1:] - values[:, :-1]


def normalise(rewards: torch.Tensor, valid: torch.Tensor, num_generations: int, mode: str) -> torch.Tensor:
    """Step rewards ``(N, K)`` scaled over the valid steps of each group (``none`` | ``scale`` | ``group``); 0 elsewhere."""
    import torch

    r = torch.where(valid, rewards, 0.0)
    if mode == "none":
        return r
    n, k = r.shape
    flat, m = r.reshape(-1, num_generations * k), valid.reshape(-1, num_generations * k).to(r.dtype)
    count = m.sum(1, keepdim=True).clamp(min=1)
    mean = (flat * m).sum(1, keepdim=True) / count if mode == "group" else torch.zeros_like(count)
    sigma = ((((flat - mean) ** 2) * m).sum(1, keepdim=True) / count + 1e-8).sqrt()
    return (((flat - mean) / (sigma + 1e-6)) * m).reshape(n, k)


def reward_to_go(z: torch.Tensor) -> torch.Tensor:
    """``c_k = sum_{j >= k} z_j`` along the last dimension (gamma = 1)."""
    return z.flip(-1).cumsum(-1).flip(-1)


def step_of_tokens(ends: torch.Tensor, width: int) -> torch.Tensor:
    """``(N, T)`` long: the (0-based) step of each token position, ``K`` past the last step end.

    ``ends`` ``(N, K)`` increasing step ends, -1 padding; tokens ``[ends[k-1], ends[k])`` form step ``k``.
    """
    import torch

    bounded = torch.where(ends >= 0, ends, torch.iinfo(torch.long).max).contiguous()
    position = torch.arange(width, device=ends.device).expand(ends.shape[0], width).contiguous()
    return torch.searchsorted(bounded, position, right=True)


class TRACE(Plugin):
    """TRACE step mode: V(s_k) = log pi_ref(y*|s_k) - log pi_ref(y*|s_0), r_k = V(s_k) - V(s_k-1), as token credit."""

    name = "trace"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        column: str = Field("answer", description="dataset column with the gold answer y*")
        cue: str = Field("\nThe answer is", description="text teacher-forced between a state and y* (context, "
                         "not scored); empty: y* right after the state")
        template: AnswerTemplate = Field(" {answer}", description="the scored answer text; {answer} is replaced by y*")
        segments: Literal["steps", "turns"] = Field("steps", description="what a step is: a segment of the text "
                                                    "(pattern) or a model turn of a multi-turn rollout (TRL's tool "
                                                    "mask; the state after a turn includes the environment's reply)")
        pattern: Regex = Field(r"\n+", description="regex separating the steps of a completion (delimiter included "
                             "in the step it closes)")
        max_steps: int = Field(8, ge=1, description="at most this many steps per completion (the last ones; "
                               "earlier steps merge into the first kept): max_steps + 1 scored prefixes")
        reduce: Literal["sum", "mean"] = Field("sum", description="log pi_ref(y*|s) as the sum (the "
                                               "log-probability) or the per-token mean of y*'s token log-probs")
        credit: Literal["reward", "return"] = Field("reward", description="token credit of step k: its TD reward "
                                                    "r_k (reward) or the reward-to-go sum_{j>=k} r_j (return)")
        normalise: Literal["scale", "group", "none"] = Field("scale", description="step rewards over the group's "
                                                             "steps: divided by their RMS (scale), centred and "
                                                             "scaled (group) or raw nats (none)")
        coef: float = Field(0.5, ge=0.0, description="weight of the step credit added to the outcome advantage "
                            "(not established)")



    def required_columns(self):
        return [self.config.column]

    def needs_reference(self) -> bool:
        return True  # TRACE reads the gold answer under the frozen reference (the host checks one exists)

    def gold_logps(self, batch: RolloutBatch, ends: torch.Tensor, gold: list[str]) -> torch.Tensor:
        """``(N, K+1)`` ``L``: the reference's log-prob of each row's y* after each prefix and the cue (unscored
        context), NaN where ``ends < 0``."""
        cfg = self.config
        texts = [cfg.template.replace("{answer}", g) for g in gold]
        return batch.prefix_logps(ends, texts, model="reference", reduce=cfg.reduce, context=cfg.cue or None)

    @hookimpl
    def transform_advantages(self, batch: RolloutBatch, advantages: torch.Tensor) -> torch.Tensor | None:
        import torch

        cfg = self.config
        n, width = batch.num_completions, batch.width
        answers = batch.column(cfg.column)
        has_gold = torch.tensor([has_answer(a) for a in answers], dtype=torch.bool)
        gold = [str(a).strip() if ok else "" for a, ok in zip(answers, has_gold.tolist())]
        ends = (turn_ends(batch, cfg.max_steps) if cfg.segments == "turns"  # (N, K) ends of the kept steps
                else step_ends(batch, cfg.pattern, cfg.max_steps)).cpu()
        steps = (ends >= 0).sum(1)
        scored_row = (steps > 0) & has_gold & (batch.kept & batch.scorable).cpu()  # rows worth a scoring pass
        if not scored_row.any():  # nothing to score: the outcome advantages stand
            self.log_metric(batch, "steps", 0.0)
            return None
        ends = torch.where(scored_row.unsqueeze(1), ends, -1)
        # the last state is the completion's text: an EOS that closes the last step is left out of the prefix
        lengths = batch.completion_lengths.cpu()
        eos = getattr(batch.tokenizer, "eos_token_id", None)
        last_id = batch.completion_ids.cpu().gather(1, (lengths - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
        ends_in_eos = (lengths > 0) & (last_id == eos) if eos is not None else torch.zeros(n, dtype=torch.bool)
        read_at = ends - ((ends == lengths.unsqueeze(1)) & ends_in_eos.unsqueeze(1)).long()
        start = torch.where(scored_row, 0, -1).unsqueeze(1)
        logp = self.gold_logps(batch, torch.cat([start, read_at], dim=1), gold).cpu()  # (N, K+1)
        rewards = action_rewards(logp)  # (N, K)
        valid = ~torch.isnan(rewards)
        z = normalise(rewards, valid, batch.num_generations, cfg.normalise)
        credit = reward_to_go(z) if cfg.credit == "return" else z
        credit = torch.cat([credit, torch.zeros(n, 1)], dim=1)  # tokens past the last step end: no credit
        step = step_of_tokens(ends, width)  # tokens [e_k-1, e_k) form step k (the EOS is in the last step)
        mask = batch.turns().model.cpu().to(torch.float32)  # the model's tokens: not the environment's replies
        token_credit = credit.gather(1, step) * mask
        outcome = advantages.cpu().to(torch.float32)
        outcome = outcome.unsqueeze(1).expand(n, width) if outcome.dim() == 1 else outcome
        if valid.any():
            self.log_metric(batch, "step_reward", float(rewards[valid].mean()))
            final = logp.gather(1, steps.clamp(max=logp.shape[1] - 1).unsqueeze(1)).squeeze(1) - logp[:, 0]
            self.log_metric(batch, "final_value", float(final[scored_row].mean()))
        self.log_metric(batch, "steps", float(steps[scored_row].float().mean()))
        tokens = mask.sum().clamp(min=1)
        self.log_metric(batch, "credit_abs", float((cfg.coef * token_credit).abs().sum() / tokens))
        self.log_metric(batch, "outcome_abs", float((outcome * mask).abs().sum() / tokens))
        return (outcome + cfg.coef * token_credit).to(advantages.device)
