"""Auxiliary adapters: LoRA adapters a plugin owns beside the policy's, on the same (possibly 4-bit) base.

A plugin declares them with ``Plugin.adapters()`` (a list of `Adapter`) and reaches them with
``self.adapter(name)`` (an `AdapterHandle`):

- ``handle.logps(batch)``: ``(N, T)`` no-grad per-token log-probs of the batch's completions under the
  adapter (one forward pass, cached for the batch). ``batch.continuation_logps(..., model=handle)`` and
  ``batch.completion_logps(..., model=handle)`` score other text under it.
- ``handle.update(batch, loss_fn)``: one optimiser step of the adapter. ``loss_fn(logps, rows)`` gets
  the log-probs *with grad* of some rows of the batch (``rows``: a long tensor into the batch; ``logps``:
  ``(len(rows), T)``, 0 on padding) and returns one loss per row; the step minimises the mean over the
  batch's rows. It returns the loss, the gradient norm and the rows' log-probs at the weights before the
  step (from the same forward pass: no extra cost). Each process computes its own rows and the gradients are summed over processes, so every
  process ends with the same adapter.
- An ``ema_decay`` adapter is never trained: every ``ema_every`` optimiser steps the host sets
  ``w_ema <- d * w_ema + (1 - d) * w_policy`` for each LoRA weight (a slow reference).
- A ``path`` adapter is loaded from a saved PEFT adapter folder (``adapter_config.json`` and
  ``adapter_model.safetensors``; pickled ``.bin`` weights are refused: loading them could run code) and stays
  frozen: a trained implicit PRM from a checkpoint (``checkpoint-N/tc_prime_prm``).

The host (`AuxAdapters`) adds each adapter to the policy's PEFT model after TRL built it and before
TRL's optimiser exists, frozen, so the policy's optimiser never holds its weights; its own AdamW has the
adapter's learning rate, weight decay and gradient clip. Its weights, optimiser state and counters are
saved in the host's checkpoint file (plain tensors) and restored on resume. The PEFT name of an adapter
is ``tc_<plugin key>_<name>`` (``#`` in a key becomes ``_``).
"""

from __future__ import annotations

import copy
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from trl_credit.batch import RolloutBatch

__all__ = ["Adapter", "AdapterHandle", "AuxAdapters", "adapter_kind", "peft_name"]

_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
KIND_PREFIX = "adapter:"


@dataclass(frozen=True)
class Adapter:
    """An auxiliary LoRA adapter (same LoRA config as the policy's).

    - ``init``: ``"policy"`` (a copy of the policy adapter when the trainer is built) or ``"fresh"``
      (PEFT's initialisation: LoRA B = 0, so it starts equal to the base model, the reference).
    - ``lr`` (None: the run's ``learning_rate``), ``weight_decay``, ``max_grad_norm`` (None: no clip): its
      AdamW step.
    - ``ema_decay`` (0 < d < 1) and ``ema_every``: an EMA of the policy adapter instead of a trained one.
    - ``path``: a saved PEFT adapter folder to load, frozen (``init`` is then ignored).
    """

    name: str
    init: str = "policy"
    lr: float | None = None
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    ema_decay: float | None = None
    ema_every: int = 1
    path: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(f"adapter name {self.name!r}: use 1-32 lowercase letters, digits and '_', "
                             "starting with a letter")
        if self.init not in ("policy", "fresh"):
            raise ValueError(f"adapter '{self.name}': init must be 'policy' or 'fresh', got {self.init!r}")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"adapter '{self.name}': lr must be > 0, got {self.lr}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"adapter '{self.name}': max_grad_norm must be > 0 or None, got {self.max_grad_norm}")
        if self.ema_decay is not None and not 0.0 < self.ema_decay < 1.0:
            raise ValueError(f"adapter '{self.name}': ema_decay must be in (0, 1), got {self.ema_decay}")
        if self.ema_every < 1:
            raise ValueError(f"adapter '{self.name}': ema_every must be >= 1, got {self.ema_every}")
        if self.path is not None and self.ema_decay is not None:
            raise ValueError(f"adapter '{self.name}': give path (a frozen saved adapter) or ema_decay, not both")

    @property
    def trained(self) -> bool:
        """True when it has its own optimiser (not an EMA, not loaded frozen from a path)."""
        return self.ema_decay is None and self.path is None

    def check_path(self) -> str | None:
        """What is wrong with ``path`` (None when it is usable or not set): checked before the model loads."""
        import os

        if self.path is None:
            return None
        if not os.path.isdir(self.path):
            return f"adapter '{self.name}': path {self.path!r} is not a directory"
        missing = [f for f in ("adapter_config.json", "adapter_model.safetensors")
                   if not os.path.isfile(os.path.join(self.path, f))]
        if missing:
            pickled = os.path.isfile(os.path.join(self.path, "adapter_model.bin"))
            return (f"adapter '{self.name}': {self.path!r} has no {' or '.join(missing)}"
                    + ("; it has pickled adapter_model.bin weights, which are not loaded (unpickling can run "
                       "code): re-save the adapter with safetensors" if pickled else ""))
        return None


def adapter_kind(owner: str, name: str) -> str:
    """The score kind of an adapter in a batch cache and a scorer: ``adapter:<plugin key>/<name>``."""
    return f"{KIND_PREFIX}{owner}/{name}"


def peft_name(kind: str) -> str:
    """The PEFT adapter name of a score kind: ``tc_<plugin key>_<name>``."""
    owner, name = kind[len(KIND_PREFIX):].split("/", 1)
    return "tc_" + re.sub(r"[^A-Za-z0-9_]", "_", owner) + "_" + name


@dataclass(frozen=True)
class AdapterHandle:
    """A plugin's view of one of its adapters (``Plugin.adapter(name)``); pass it as ``model=`` to scorers."""

    owner: str
    name: str

    @property
    def kind(self) -> str:
        return adapter_kind(self.owner, self.name)

    def logps(self, batch: RolloutBatch) -> torch.Tensor:
        """``(N, T)`` no-grad per-token log-probs of ``batch``'s completions under this adapter (cached)."""
        return batch._token_scores(self.kind)

    def update(self, batch: RolloutBatch, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
               ) -> dict[str, float]:
        """One optimiser step minimising the mean over ``batch``'s rows of ``loss_fn(logps, rows)``.

        Returns ``{"loss": mean loss, "grad_norm": norm before clipping, "logps": (N, T) no-grad log-probs
        at the weights before the step}`` (``logps`` come from the step's own forward pass: scoring with
        the pre-step adapter costs nothing more, as PRIME does). ``loss`` and ``grad_norm`` are logged as
        ``trl_credit/<plugin>/<name>_loss`` and ``_grad_norm``. The cached scores of this adapter are
        dropped (the weights changed).
        """
        import torch

        root = batch.root
        if root.scorer is None or not hasattr(root.scorer, "update_adapter"):
            raise RuntimeError(f"adapter '{self.name}' update: this batch has no model; in tests pass "
                               f"`adapters={{'{self.name}': logps}}` to trl_credit.testing.make_batch")
        rows = torch.arange(batch.num_completions) if batch._rows is None else batch._rows.cpu()
        result = root.scorer.update_adapter(self.kind, rows, loss_fn, root.width)
        result["logps"] = result["logps"][:, : batch.width].to(batch.device)
        _drop_cached(root, self.kind)
        for key in ("loss", "grad_norm"):
            root.metrics[f"{self.owner}/{self.name}_{key}"].append(float(result[key]))
        return result


def _drop_cached(root: RolloutBatch, kind: str) -> None:
    root.token_cache.pop(kind, None)
    for cache_name in ("continuations", "completion_logps"):
        cache = root.token_cache.get(cache_name)
        if isinstance(cache, dict):
            for key in [k for k in cache if k[0] == kind]:
                del cache[key]


class AuxAdapters:
    """The host side: creates, trains, tracks (EMA) and checkpoints every declared adapter."""

    def __init__(self, declared: dict[str, Adapter]):
        self.specs = declared  # kind -> Adapter
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.params: dict[str, list[tuple[str, torch.nn.Parameter]]] = {}
        self.updates: dict[str, int] = dict.fromkeys(declared, 0)
        self.policy = "default"
        self.model: Any = None

    def __bool__(self) -> bool:
        return bool(self.specs)

    def attach(self, model: Any, learning_rate: float) -> None:
        """Add every adapter to ``model`` (a `peft.PeftModel`), frozen; build the optimisers (``learning_rate``:
        the run's, for adapters that set none)."""
        import torch

        if not hasattr(model, "peft_config"):
            raise RuntimeError("auxiliary adapters need a PEFT policy (they are LoRA adapters on its base model); "
                               "train with a LoRA adapter: use_peft: true, or peft_config=LoraConfig(...)")
        self.model = model
        self.policy = model.active_adapter
        policy_config = model.peft_config[self.policy]
        if getattr(policy_config, "modules_to_save", None):
            raise RuntimeError("auxiliary adapters need a LoRA policy adapter without modules_to_save "
                               f"(this one saves {policy_config.modules_to_save}); remove modules_to_save")
        policy_params = dict(self._named(self.policy))
        for kind, spec in self.specs.items():
            name = peft_name(kind)
            if spec.path is not None:
                problem = spec.check_path()
                if problem:
                    raise RuntimeError(problem)
                model.load_adapter(spec.path, adapter_name=name, is_trainable=False)
                if getattr(model.peft_config[name], "modules_to_save", None):
                    raise RuntimeError(f"adapter {spec.path!r} has modules_to_save; only plain LoRA adapters load")
            else:
                with torch.random.fork_rng():  # the policy run's random streams are left as they were
                    torch.manual_seed(0)
                    model.add_adapter(name, copy.deepcopy(policy_config))
            model.set_adapter(self.policy)  # the policy stays active and trainable; the new adapter is frozen
            params = self._named(name)
            if not params:
                raise RuntimeError(f"adapter {name}: PEFT created no weights for it")
            if spec.path is None and (spec.init == "policy" or not spec.trained):
                with torch.no_grad():
                    for param_name, param in params:
                        param.copy_(policy_params[self._policy_name(param_name, name)])
            for _, param in params:
                param.requires_grad_(False)
            self.params[kind] = params
            if spec.trained:
                lr = spec.lr if spec.lr is not None else learning_rate
                self.optimizers[kind] = torch.optim.AdamW([p for _, p in params], lr=lr,
                                                          weight_decay=spec.weight_decay)

    def _named(self, adapter: str) -> list[tuple[str, torch.nn.Parameter]]:
        marker = f".{adapter}."
        return [(n, p) for n, p in self.model.named_parameters() if marker in n]

    def _policy_name(self, param_name: str, adapter: str) -> str:
        return param_name.replace(f".{adapter}.", f".{self.policy}.")

    def step(self, kind: str, chunks: Callable[[], Any], reduce: Callable[[torch.Tensor], torch.Tensor],
             total: int) -> dict[str, float]:
        """One AdamW step: ``chunks()`` yields per-row losses (with grad) of this process's rows."""
        import torch

        spec = self.specs.get(kind)
        if spec is None:
            raise KeyError(f"no auxiliary adapter {kind}; declared: {sorted(self.specs)}")
        if not spec.trained:
            raise RuntimeError(f"{kind} is an EMA adapter; it follows the policy and cannot be trained")
        start = time.perf_counter()
        params = [p for _, p in self.params[kind]]
        loss_sum = torch.zeros((), dtype=torch.float32, device=params[0].device)
        for losses in chunks():  # each chunk: backward at once (memory: one micro-batch of activations)
            if losses.dim() != 1:
                raise ValueError(f"{kind}: loss_fn must return one loss per row, got shape {tuple(losses.shape)}")
            (losses.sum() / max(total, 1)).backward()
            loss_sum = loss_sum + losses.detach().float().sum()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = reduce(torch.cat([p.grad.reshape(-1) for p in params]))  # summed over processes
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        norm = torch.nn.utils.clip_grad_norm_(params, spec.max_grad_norm if spec.max_grad_norm is not None
                                              else float("inf"))
        self.optimizers[kind].step()
        self.optimizers[kind].zero_grad(set_to_none=True)
        self.updates[kind] += 1
        loss = float(reduce(loss_sum.reshape(1))[0]) / max(total, 1)
        return {"loss": loss, "grad_norm": float(norm), "seconds": time.perf_counter() - start}

    def track(self, global_step: int) -> list[str]:
        """EMA adapters due at ``global_step``: ``w <- d * w + (1 - d) * w_policy``; returns the kinds updated."""
        import torch

        done = []
        policy = dict(self._named(self.policy))
        for kind, spec in self.specs.items():
            if spec.ema_decay is None or global_step % spec.ema_every:
                continue
            with torch.no_grad():
                for param_name, param in self.params[kind]:
                    source = policy[self._policy_name(param_name, peft_name(kind))]
                    param.mul_(spec.ema_decay).add_(source.detach().to(param.dtype), alpha=1.0 - spec.ema_decay)
            self.updates[kind] += 1
            done.append(kind)
        return done

    def state_dict(self) -> dict[str, Any]:
        """Plain data: per adapter its weights (CPU tensors by parameter name), optimiser state, update count."""
        state = {}
        for kind, params in self.params.items():
            entry: dict[str, Any] = {"weights": {n: p.detach().cpu().clone() for n, p in params},
                                     "updates": self.updates[kind]}
            if kind in self.optimizers:
                entry["optimizer"] = self.optimizers[kind].state_dict()
            state[kind] = entry
        return state

    def load_state_dict(self, state: dict[str, Any], source: str) -> list[str]:
        """Restore what `state_dict` returned; raises ValueError naming ``source`` on a mismatch."""
        import torch

        missing = [kind for kind in self.params if kind not in state]
        if missing:
            raise ValueError(f"{source} holds no weights for the auxiliary adapter(s) {', '.join(missing)} "
                             f"(it has: {', '.join(state) or 'none'}); resume with the same plugins")
        for kind, params in self.params.items():
            weights = state[kind]["weights"]
            names = [n for n, _ in params]
            if sorted(weights) != sorted(names):
                raise ValueError(f"{source}: the saved weights of {kind} do not match this model's adapter "
                                 f"({len(weights)} saved tensors, {len(names)} expected); was the LoRA config changed?")
            with torch.no_grad():
                for n, p in params:
                    if weights[n].shape != p.shape:
                        raise ValueError(f"{source}: {kind} weight {n} has shape {tuple(weights[n].shape)}, "
                                         f"this model's has {tuple(p.shape)}; was the LoRA rank changed?")
                    p.copy_(weights[n].to(p.device, p.dtype))
            if kind in self.optimizers and "optimizer" in state[kind]:
                self.optimizers[kind].load_state_dict(state[kind]["optimizer"])
            self.updates[kind] = int(state[kind].get("updates", 0))
        return list(self.params)
