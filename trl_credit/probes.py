"""Probes: short sampled continuations after a completion prefix plus a cue, and what the sampler saw.

`RolloutBatch.probe` samples ``num_samples`` continuations of at most ``max_new_tokens`` tokens after
``prompt + completion[:end] + cue`` for every prefix end of every completion (SPAE's answer probes after each
step, MRT's forced termination), with the model's log-probs of each sampled token and its ``top_k``
alternatives. Probes are measurements, never training rows: they are generated with Hugging Face
``generate`` on the unwrapped training model (TRL's ``unwrap_model_for_generation``, so DeepSpeed ZeRO-3
parameters are gathered), no-grad, under a random stream of their own (seeded from the run's seed, the
step, the call's number within the step and the rank), so TRL's own sampling is not shifted by them and two
probe calls of a step do not replay the same stream.

Log-probs are the model's at temperature 1 (its raw distribution, as vLLM reports by default);
``temperature`` only shapes the sampling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["Probes"]


@dataclass
class Probes:
    """Probe samples of a batch, indexed like ``ends``: ``(N, K)`` prefixes, ``S`` samples, ``L`` tokens, top ``k``.

    - ``valid`` ``(N, K)`` bool: the prefix was probed (``ends >= 0``).
    - ``tokens`` ``(N, K, S, L)`` long: the sampled ids (pad after the end); ``mask`` ``(N, K, S, L)``: 1 up to
      and including the first EOS.
    - ``logps`` ``(N, K, S, L)``: log-prob of each sampled token; ``topk_ids`` / ``topk_logps``
      ``(N, K, S, L, k)``: the ``k`` most likely tokens at each position and their log-probs.
    - ``texts``: ``[N][K][S]`` decoded samples (None where not probed).
    """

    valid: torch.Tensor
    tokens: torch.Tensor
    mask: torch.Tensor
    logps: torch.Tensor
    topk_ids: torch.Tensor
    topk_logps: torch.Tensor
    texts: list

    def topk_entropy(self, renormalise: bool = True) -> torch.Tensor:
        """``(N, K, S, L)`` entropy (nats) of the top-``k`` distribution, 0 off the mask: renormalised over the
        ``k`` tokens, or (``renormalise=False``) ``-sum_k p_k log p_k`` of the raw probabilities (SPAE's code)."""
        import torch

        logp = self.topk_logps
        if renormalise:
            logp = logp - torch.logsumexp(logp, dim=-1, keepdim=True)
        terms = torch.where(torch.isfinite(logp), logp.exp() * logp, 0.0)  # absent entries (-inf) add nothing
        return -terms.sum(-1) * self.mask

    def token_logp(self, ids: torch.Tensor, floor: float = -10.0) -> torch.Tensor:
        """``(N, K, S, L)`` log-prob of ``ids`` ``(N, L)`` (a target per row, -1 = none) at each position, read from
        the top-``k`` lists; ``floor`` where the target is not among them (SPAE's rule) or there is none."""
        import torch

        target = ids[:, None, None, :, None].to(self.topk_ids.device)  # (N, 1, 1, L, 1)
        width = min(target.shape[3], self.topk_ids.shape[3])
        hit = self.topk_ids[..., :width, :] == target[..., :width, :]
        found = torch.where(hit, self.topk_logps[..., :width, :], torch.finfo(self.topk_logps.dtype).min).amax(-1)
        found = torch.where(hit.any(-1) & (target[..., :width, 0] >= 0), found, floor)
        out = torch.full(self.logps.shape, float(floor), dtype=self.logps.dtype, device=self.logps.device)
        out[..., :width] = found
        return out
