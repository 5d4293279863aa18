"""Test kit for plugin authors: build a `RolloutBatch` from plain values and run one plugin on it.

    from trl_credit.testing import make_batch, run_plugin, check_plugin, train_tiny

    batch = make_batch(rewards=[1, 0, 0, 0], num_generations=4)
    result = run_plugin(MyPlugin, batch, {"alpha": 0.5})
    assert torch.allclose(result.advantages, torch.tensor([...]))
    check_plugin(MyPlugin)          # the contract, on edge-case batches, state round-trip included
    trainer = train_tiny(["my_plugin"], output_dir=tmp_path)   # 2 real steps on the tiny model

No model is needed for the first three: log-probs and entropies are given as tensors. `run_plugin`
runs the plugin the way the host does (shape -> filter -> estimator on the groups with a kept
completion -> transforms), with the built-in ``grpo`` estimator when the plugin brings none.
`make_batch` builds only batches real training can produce: ids, masks and ``T`` agree, the mask
ends at the first EOS as TRL's does, ``mask_truncated_completions`` is applied, and unknown keywords
are errors.
"""

from __future__ import annotations

import copy
import difflib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Sequence

import torch

from trl_credit.batch import PromptStats, RolloutBatch
from trl_credit.config import ConfigError, PluginSet, enable, plugin_name
from trl_credit.hookspecs import HOOKS
from trl_credit.pipeline import Pipeline, kept_advantages
from trl_credit.plugin import Plugin, RunInfo, near_misses
from trl_credit.plugins import available, implemented_hooks, new_manager
from trl_credit.checkpoint import STATE_FILE, CheckpointError, read_state, write_state
from trl_credit.testing.tiny import (ScriptedTurns, answer_reward, scripted_turns_reward, tiny_dataset, tiny_model,
                                     tiny_model_path, tiny_tokenizer, train_scripted_turns, train_tiny)

__all__ = ["AdapterUpdate", "PluginResult", "answer_reward", "check_args", "check_plugin", "default_args", "difficulty_reward",
           "edge_case_batches", "load_plugin", "LossResult", "loss_inputs", "STATE_FILE", "make_batch", "plugin_set",
           "run_curriculum", "run_loss", "run_plugin", "ScriptedTurns", "scripted_turns_reward", "tools",
           "tiny_dataset", "tiny_model", "tiny_model_path", "tiny_tokenizer", "train_scripted_turns", "train_tiny"]


def __getattr__(name: str) -> Any:
    """``trl_credit.testing.tools`` (scripted tool-calling rollouts through TRL's own tool loop) on first use: it
    imports the trainer, which the rest of the kit does not need."""
    if name == "tools":
        import importlib

        return importlib.import_module("trl_credit.testing.tools")
    raise AttributeError(f"module 'trl_credit.testing' has no attribute {name!r}")


def _grpo_fields() -> dict[str, Any]:
    import dataclasses

    from trl import GRPOConfig

    return {f.name: f for f in dataclasses.fields(GRPOConfig)}


def default_args(**overrides: Any) -> SimpleNamespace:
    """The `GRPOConfig` fields the host and plugins read, with TRL's defaults; ``overrides`` must be
    `GRPOConfig` fields (a misspelled one is an error with a did-you-mean)."""
    fields = _grpo_fields()
    unknown = [k for k in overrides if k not in fields]
    if unknown:
        hints = [f"{k!r}" + (f" (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(k, fields, n=1))
                             else "") for k in unknown]
        raise TypeError(f"not GRPOConfig fields: {', '.join(hints)}")
    values = dict(scale_rewards="group", multi_objective_aggregation="sum_then_normalize",
                  max_completion_length=None, loss_type="dapo", beta=0.0, num_generations=None, seed=0,
                  mask_truncated_completions=False, generation_batch_size=None, per_device_train_batch_size=8,
                  temperature=1.0, epsilon=0.2, epsilon_high=0.2, importance_sampling_level="token")
    values.update(overrides)
    return SimpleNamespace(**values)


class _Tokenizer(SimpleNamespace):
    """Stands in for a tokenizer: ``pad_token_id`` and ``eos_token_id``, no vocabulary.

    It cannot decode (``stand_in`` is True; step maps then spread each text evenly over its tokens):
    pass a real tokenizer to `make_batch` (``tokenizer=``) to test what depends on token text.
    """

    stand_in = True

    def decode(self, *args: Any, **kwargs: Any) -> str:
        raise RuntimeError("the make_batch stand-in tokenizer cannot decode; pass tokenizer= a real tokenizer")

    batch_decode = decode


@dataclass
class AdapterUpdate:
    """One ``handle.update`` a plugin made on a `make_batch` batch: what the host would have minimised.

    ``loss``: the mean of the per-row losses (what the optimiser step minimises); ``losses``: per row;
    ``grad``: d loss / d logps ``(N, T)`` (the gradient the adapter's log-probs would receive).
    """

    adapter: str
    rows: torch.Tensor
    losses: torch.Tensor
    loss: float
    grad: torch.Tensor


class _StaticScorer:
    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors
        self.adapter_updates: list[AdapterUpdate] = []

    def _adapter(self, kind: str) -> torch.Tensor:
        name = kind.rsplit("/", 1)[-1]
        given = self.tensors.get("adapters", {})
        name = name if name in given or "*" not in given else "*"
        if name not in given:
            raise RuntimeError(f"the plugin asked for its adapter {name!r}; pass `adapters={{'{name}': logps}}` "
                               "to make_batch")
        return given[name]

    def update_adapter(self, kind, rows, loss_fn, width):
        logps = self._adapter(kind).clone().requires_grad_(True)
        losses = loss_fn(logps[rows], torch.arange(len(rows)))  # rows of the batch passed (a view's own)
        if losses.dim() != 1:
            raise ValueError(f"{kind}: loss_fn must return one loss per row, got shape {tuple(losses.shape)}")
        loss = losses.sum() / max(len(rows), 1)
        grad, = torch.autograd.grad(loss, logps, allow_unused=True)
        update = AdapterUpdate(kind.rsplit("/", 1)[-1], rows, losses.detach(), float(loss.detach()),
                               torch.zeros_like(logps) if grad is None else grad)
        self.adapter_updates.append(update)
        return {"loss": update.loss, "grad_norm": float(update.grad.norm()), "logps": logps.detach()[rows].clone()}

    def token_scores(self, kind: str) -> torch.Tensor:
        if kind.startswith("adapter:"):
            return self._adapter(kind)
        if kind not in self.tensors:
            name = {"policy_logps": "logps", "policy_entropies": "entropies", "ref_logps": "ref_logps"}[kind]
            raise RuntimeError(f"the plugin asked for {kind}; pass `{name}=` to make_batch")
        return self.tensors[kind]

    def continuation_logps(self, prefixes, continuations, model):
        model = model.rsplit("/", 1)[-1] if model.startswith("adapter:") else model  # an adapter by its name
        fn = self.tensors.get("continuation_fn")
        if fn is None:
            raise RuntimeError("the plugin asked for continuation log-probs; pass `continuation_fn=` to make_batch")
        return [torch.as_tensor(fn(p, c, model), dtype=torch.float32) for p, c in zip(prefixes, continuations)]

    def prefix_logps(self, rows, ends, continuations, model, contexts):  # the context is not passed to the fn
        model = model.rsplit("/", 1)[-1] if model.startswith("adapter:") else model
        fn = self.tensors.get("prefix_logps_fn")
        if fn is None:
            raise RuntimeError("the plugin asked for continuation log-probs after completion prefixes; pass "
                               "`prefix_logps_fn=` to make_batch")
        return [torch.as_tensor(fn(row, end, text, model), dtype=torch.float32).reshape(-1)
                for row, end, text in zip(rows, ends, continuations)]

    def soft_values(self, model, temperature):
        if "soft_values" not in self.tensors:
            raise RuntimeError("the plugin asked for soft values (logits); pass `soft_values=(Q, V)` to make_batch")
        return self.tensors["soft_values"]

    def score_texts(self, rows, inputs, prompts, texts):
        fn = self.tensors.get("score_fn")
        if fn is None:
            raise RuntimeError("the plugin scores new texts with the run's rewards; pass `score_fn=` to make_batch")
        values = [fn(row, text) for row, text in zip(rows, texts)]
        return torch.tensor([[math.nan if v is None else float(v) for v in (x if isinstance(x, (list, tuple)) else [x])]
                             for x in values], dtype=torch.float32)

    def probe(self, rows, ends, cues, num_samples, max_new_tokens, temperature, top_k, model):
        model = model.rsplit("/", 1)[-1] if model.startswith("adapter:") else model
        fn = self.tensors.get("probe_fn")
        if fn is None:
            raise RuntimeError("the plugin asked for probe samples; pass `probe_fn=` to make_batch")
        out = []
        shape = (num_samples, max_new_tokens)
        for row, end, cue in zip(rows, ends, cues):
            given = fn(row, end, cue, model)  # {"tokens": S x L' ids, "topk_ids"/"topk_logps": S x L' x k', ...}
            tokens = torch.as_tensor(given["tokens"], dtype=torch.long)[:num_samples, :max_new_tokens]
            s, steps = tokens.shape
            cut = (slice(0, s), slice(0, steps))  # the fn may give more samples or tokens than asked: cut
            mask = torch.as_tensor(given.get("mask", torch.ones(s, steps)), dtype=torch.long)[cut]
            sample = {"tokens": torch.zeros(shape, dtype=torch.long), "mask": torch.zeros(shape, dtype=torch.long),
                      "logps": torch.zeros(shape), "topk_ids": torch.full((*shape, top_k), -1, dtype=torch.long),
                      "topk_logps": torch.full((*shape, top_k), -math.inf)}
            sample["tokens"][:s, :steps], sample["mask"][:s, :steps] = tokens, mask
            sample["logps"][:s, :steps] = torch.as_tensor(given.get("logps", torch.zeros(s, steps)),
                                                          dtype=torch.float32)[cut]
            if "topk_ids" in given:
                ids = torch.as_tensor(given["topk_ids"], dtype=torch.long)[cut][..., :top_k]
                sample["topk_ids"][:s, :steps, : ids.shape[-1]] = ids
                sample["topk_logps"][:s, :steps, : ids.shape[-1]] = torch.as_tensor(
                    given["topk_logps"], dtype=torch.float32)[cut][..., :top_k]
            sample["texts"] = list(given.get("texts", [""] * s))[:s]
            out.append(sample)
        return out

    def completion_logps(self, rows, prompts, model, width):
        model = model.rsplit("/", 1)[-1] if model.startswith("adapter:") else model
        fn = self.tensors.get("completion_logps_fn")
        if fn is None:
            raise RuntimeError("the plugin asked for completion log-probs under other prompts; pass "
                               "`completion_logps_fn=` to make_batch")
        return [torch.as_tensor(fn(row, prompt, model), dtype=torch.float32).reshape(width)
                for row, prompt in zip(rows, prompts)]


def make_batch(
    rewards: Sequence | torch.Tensor,
    num_generations: int,
    *,
    reward_names: Sequence[str] | None = None,
    reward_weights: Sequence[float] | None = None,
    completion_ids: Sequence[Sequence[int]] | torch.Tensor | None = None,
    completion_mask: torch.Tensor | Sequence[Sequence[int]] | None = None,
    lengths: Sequence[int] | None = None,
    completions: Sequence[Any] | None = None,
    prompts: Sequence[Any] | None = None,
    columns: dict[str, Sequence[Any]] | None = None,
    logps: torch.Tensor | None = None,
    entropies: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    continuation_fn: Callable[[str, str, str], Sequence[float]] | None = None,
    completion_logps_fn: Callable[[int, Any, str], Sequence[float]] | None = None,
    prefix_logps_fn: Callable[[int, int, str, str], Sequence[float]] | None = None,
    probe_fn: Callable[[int, int, str, str], dict[str, Any]] | None = None,
    score_fn: Callable[[int, str], Any] | None = None,
    soft_values: tuple[torch.Tensor, torch.Tensor] | None = None,
    tool_mask: torch.Tensor | Sequence[Sequence[int]] | None = None,
    adapters: dict[str, torch.Tensor] | None = None,
    prompt_index: Sequence[int] | None = None,
    step: int = 0,
    pad_token_id: int | None = None,
    eos_token_id: int | None = None,
    tokenizer: Any = None,
    args: Any = None,
    **grpo_args: Any,
) -> RolloutBatch:
    """Build a batch as training would. ``rewards`` is ``(N,)`` or ``(N, K)`` (``None`` entries become NaN).

    Token ids, one of:

    - ``completion_ids``: a tensor ``(N, T)`` or ragged lists (right-padded with the pad id);
    - ``lengths``: made-up ids ``1..L`` (never the pad or EOS id) of those lengths;
    - ``completion_mask`` alone: ids of the mask's width where the mask is 1;
    - nothing: every completion gets 4 tokens.

    The mask is TRL's: 1 up to and including the first EOS of a row, 0 after it; a row of the full
    width ``T`` without EOS is truncated and, with ``mask_truncated_completions=True``, masked out
    entirely (a row shorter than ``T`` counts as finished). An explicit ``completion_mask`` must have
    the ids' shape and is used as given (truncation masking still applies).

    Scores (no model): ``logps``, ``entropies``, ``ref_logps`` ``(N, T)``; ``adapters``: ``{name: (N, T)}``
    log-probs under a plugin's auxiliary adapters (``"*"``: any name), whose ``update`` calls are recorded
    (`PluginResult.adapter_updates`); ``continuation_fn(prefix, continuation, model)`` and
    ``completion_logps_fn(row, prompt, model)`` and ``prefix_logps_fn(row, end, continuation, model)`` (per-token
    log-probs of ``continuation`` after row ``row``'s first ``end`` completion tokens; an adapter's ``model`` is
    its name); ``probe_fn(row, end, cue, model)`` returns one prefix's probe samples as a dict: ``tokens``
    ``(S, L')`` and optionally ``mask``, ``logps`` ``(S, L')``, ``topk_ids`` / ``topk_logps`` ``(S, L', k')``,
    ``texts`` (`RolloutBatch.probe` pads them to its ``max_new_tokens`` and ``top_k``); ``score_fn(row, text)``
    returns the reward (or one per reward column) of a new text for row ``row`` (`RolloutBatch.score_texts`);
    ``soft_values=(Q, V)``: ``(N, T)`` and ``(N, T + 1)`` (`RolloutBatch.soft_values`, for any model).

    ``tokenizer``: a real tokenizer (its pad and EOS ids are used), or None for a stand-in with
    ``pad_token_id`` (default 0) and ``eos_token_id`` (default: the pad id, as SmolLM2 and many others).
    ``args``: a ready args object; else `default_args` with ``grpo_args`` (``GRPOConfig`` fields only,
    e.g. ``scale_rewards="batch"``; anything else raises ``TypeError``).
    """
    r = torch.tensor([[math.nan if v is None else v for v in (row if isinstance(row, (list, tuple)) else [row])]
                      for row in (rewards.tolist() if isinstance(rewards, torch.Tensor) else rewards)],
                     dtype=torch.float32)
    n, k = r.shape
    if n % num_generations:
        raise ValueError(f"{n} completions do not split into groups of {num_generations}")
    if tokenizer is not None:
        if pad_token_id is not None or eos_token_id is not None:
            raise TypeError("give either tokenizer= or pad_token_id=/eos_token_id=, not both")
        pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    else:
        pad = 0 if pad_token_id is None else pad_token_id
        eos = pad if eos_token_id is None else eos_token_id
        tokenizer = _Tokenizer(pad_token_id=pad, eos_token_id=eos)
    given = [name for name, v in (("completion_ids", completion_ids), ("lengths", lengths)) if v is not None]
    if len(given) > 1:
        raise TypeError("give completion_ids= or lengths=, not both")
    if completion_mask is not None:
        completion_mask = torch.as_tensor(completion_mask).long()
    finished = None  # rows shorter than T count as finished (as if their last token were EOS)
    if completion_ids is None:
        if completion_mask is not None:
            lens = None
            ids_shape = tuple(completion_mask.shape)
        else:
            lens = list(lengths) if lengths is not None else [4] * n
            if len(lens) != n:
                raise ValueError(f"lengths has {len(lens)} entries for {n} completions")
            ids_shape = (n, max(max(lens), 1))
        made = torch.arange(1, ids_shape[1] + 1).expand(ids_shape).clone()
        taken = {t for t in (pad, eos) if t is not None}
        while taken & set(made.unique().tolist()):  # keep made-up ids clear of pad and EOS
            made = made + 1 + max(t for t in taken if t is not None)
        positions = torch.arange(ids_shape[1]).expand(ids_shape)
        if lens is not None:
            real = positions < torch.tensor(lens).unsqueeze(1)
        else:
            real = completion_mask.bool()
        ids = torch.where(real, made, torch.full_like(made, pad))
        mask = real.long()
        finished = real.sum(dim=1) < ids_shape[1]
    else:
        if isinstance(completion_ids, torch.Tensor):
            ids = completion_ids.long()
            lens = None
        else:
            rows = [list(c) for c in completion_ids]
            width = max(max((len(c) for c in rows), default=1), 1)
            ids = torch.full((len(rows), width), pad, dtype=torch.long)
            for i, c in enumerate(rows):
                ids[i, : len(c)] = torch.tensor(c, dtype=torch.long)
            lens = [len(c) for c in rows]
        if ids.shape[0] != n:
            raise ValueError(f"completion_ids has {ids.shape[0]} rows for {n} completions")
        width = ids.shape[1]
        positions = torch.arange(width).expand(ids.shape)
        is_eos = ids == eos if eos is not None else torch.zeros_like(ids, dtype=torch.bool)
        first_eos = torch.where(is_eos.any(dim=1), is_eos.float().argmax(dim=1), torch.full((n,), width))
        ends = first_eos + 1  # TRL's mask: up to and including the first EOS
        if lens is not None:
            ends = torch.minimum(ends, torch.tensor(lens))
        mask = (positions < ends.unsqueeze(1)).long()
        finished = is_eos.any(dim=1) | (mask.sum(dim=1) < width)
    if completion_mask is not None:
        if tuple(completion_mask.shape) != tuple(ids.shape):
            raise ValueError(f"completion_mask has shape {tuple(completion_mask.shape)} but the ids are "
                             f"{tuple(ids.shape)}")
        mask = completion_mask
    if args is None:
        args = default_args(**{"max_completion_length": ids.shape[1], "num_generations": num_generations,
                               "generation_batch_size": n, **grpo_args})
    elif grpo_args:
        raise TypeError(f"give args= or GRPOConfig keywords ({', '.join(grpo_args)}), not both")
    if getattr(args, "mask_truncated_completions", False):
        mask = mask * finished.long().unsqueeze(1)
    tensors: dict[str, Any] = {}
    for kind, value in (("policy_logps", logps), ("policy_entropies", entropies), ("ref_logps", ref_logps)):
        if value is not None:
            value = torch.as_tensor(value, dtype=torch.float32)
            if tuple(value.shape) != tuple(ids.shape):
                raise ValueError(f"{kind} has shape {tuple(value.shape)} but the ids are {tuple(ids.shape)}")
            tensors[kind] = value
    if adapters:
        tensors["adapters"] = {}
        for name, value in adapters.items():
            value = torch.as_tensor(value, dtype=torch.float32)
            if tuple(value.shape) != tuple(ids.shape):
                raise ValueError(f"adapters[{name!r}] has shape {tuple(value.shape)} but the ids are {tuple(ids.shape)}")
            tensors["adapters"][name] = value
    if continuation_fn is not None:
        tensors["continuation_fn"] = continuation_fn
    if completion_logps_fn is not None:
        tensors["completion_logps_fn"] = completion_logps_fn
    if prefix_logps_fn is not None:
        tensors["prefix_logps_fn"] = prefix_logps_fn
    if probe_fn is not None:
        tensors["probe_fn"] = probe_fn
    if score_fn is not None:
        tensors["score_fn"] = score_fn
    if soft_values is not None:
        q, v = (torch.as_tensor(x, dtype=torch.float32) for x in soft_values)
        if tuple(q.shape) != tuple(ids.shape) or tuple(v.shape) != (ids.shape[0], ids.shape[1] + 1):
            raise ValueError(f"soft_values: Q must be {tuple(ids.shape)} and V {(ids.shape[0], ids.shape[1] + 1)}, got "
                             f"{tuple(q.shape)} and {tuple(v.shape)}")
        tensors["soft_values"] = (q, v)
    for name, values in (("prompts", prompts), ("completions", completions), ("prompt_index", prompt_index),
                         *((f"columns[{key!r}]", v) for key, v in (columns or {}).items())):
        if values is not None and len(values) != n:
            raise ValueError(f"{name} has {len(values)} entries for {n} completions")
    return RolloutBatch(
        prompts=list(prompts) if prompts is not None else [f"prompt {i // num_generations}" for i in range(n)],
        completions=list(completions) if completions is not None else [f"completion {i}" for i in range(n)],
        completion_ids=ids,
        completion_mask=mask,
        rewards=r,
        reward_names=list(reward_names) if reward_names is not None else [f"reward_{j}" for j in range(k)],
        reward_weights=torch.tensor(list(reward_weights) if reward_weights is not None else [1.0] * k),
        num_generations=num_generations,
        columns={key: list(v) for key, v in (columns or {}).items()},
        prompt_index=torch.tensor(list(prompt_index)) if prompt_index is not None
        else torch.arange(n) // num_generations,
        step=step,
        args=args,
        tokenizer=tokenizer,
        tool_mask=_tool_mask(tool_mask, ids.shape),
        scorer=_StaticScorer(tensors),
    )


def _tool_mask(tool_mask: Any, shape: tuple[int, ...]) -> torch.Tensor | None:
    if tool_mask is None:
        return None
    mask = torch.as_tensor(tool_mask, dtype=torch.long)
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"tool_mask has shape {tuple(mask.shape)} but the ids are {tuple(shape)}")
    return mask


@dataclass
class PluginResult:
    """What the host would have made of one batch with the plugin enabled."""

    batch: RolloutBatch
    rewards: torch.Tensor
    reward_names: list[str]
    keep: torch.Tensor
    advantages: torch.Tensor  # (N,) or (N, T); 0 for dropped completions
    plugin: Any
    metrics: dict[str, float] = field(default_factory=dict)
    beta: float | None = None  # the plugin's kl_coefficient for this batch (None: GRPOConfig.beta)

    @property
    def adapter_updates(self) -> list[AdapterUpdate]:
        """The auxiliary-adapter updates the plugin made on this batch (`AdapterUpdate`), in order."""
        return list(getattr(self.batch.root.scorer, "adapter_updates", []))


def load_plugin(plugin: type | str | Any) -> type:
    """A plugin class: the class itself, an instance's class, or the class an installed entry point names."""
    if isinstance(plugin, str):
        found = available()
        if plugin not in found:
            raise ConfigError([f"no plugin named {plugin!r} is installed ({sorted(found)})"])
        return found[plugin].load()
    return plugin if isinstance(plugin, type) else type(plugin)


def plugin_set(plugin: type | str | Any, config: dict[str, Any] | None = None, name: str | None = None) -> PluginSet:
    """Validate ``config`` and register one plugin exactly as the host would.

    ``plugin``: a class, an installed name, or a ready instance (then ``config`` must be None).
    """
    cls = load_plugin(plugin)
    name = name or (plugin if isinstance(plugin, str) else plugin_name(cls))
    instance = None
    if not isinstance(plugin, (str, type)):
        if config:
            raise TypeError("pass options with a plugin class, not with an instance")
        instance = plugin
    manager = new_manager()
    enabled, problems = enable(cls, dict(config or {}), 0, name, name, manager, instance=instance)
    if problems:
        raise ConfigError(problems)
    return PluginSet([enabled], manager)


def run_plugin(plugin: type | str | Any, batch: RolloutBatch | Sequence[RolloutBatch],
               config: dict[str, Any] | None = None, *, others: Sequence[Any] = (),
               plugins: PluginSet | None = None) -> PluginResult | list[PluginResult]:
    """Run the host pipeline on ``batch`` with this plugin (and the built-in estimator when none is enabled).

    ``plugin``: a class, an installed name or an instance. ``batch``: one batch, or a sequence of
    batches run in order through the same plugin instances (for stateful plugins and schedules; the
    result is then a list). ``others``: more plugins after it, as in ``plugins:`` (names, classes or
    ``{"name": ..., **options}``), e.g. a filter in front of an estimator; ``result.plugin`` stays this one.
    """
    if plugins is None and others:
        from trl_credit.config import build_plugins

        if not isinstance(plugin, (str, type)):
            raise TypeError("with others=, pass this plugin as a class or a name")
        plugins = build_plugins([{"name": load_plugin(plugin) if isinstance(plugin, str) else plugin,
                                  **(config or {})}, *others])
    plugins = plugins or plugin_set(plugin, config)
    if not isinstance(batch, RolloutBatch):
        return [run_plugin(plugin, b, plugins=plugins) for b in batch]
    pipeline = Pipeline(plugins)
    pipeline.check_batch(batch)
    pipeline.shape_rewards(batch)
    keep = pipeline.filter_rollouts(batch)
    advantages = kept_advantages(pipeline, batch)
    beta = pipeline.kl_coefficient(batch)
    pipeline.notify("on_batch_end", batch.step, batch=batch, advantages=advantages)
    metrics = {k: sum(v) / len(v) for k, v in batch.metrics.items()}
    return PluginResult(batch, batch.rewards, list(batch.reward_names), keep, advantages,
                        plugins.plugins[0].instance, metrics, beta)


def loss_inputs(batch: RolloutBatch, advantages: torch.Tensor, *, logps: torch.Tensor | None = None,
                old_logps: torch.Tensor | None = None, ref_logps: torch.Tensor | None = None,
                loss_type: str = "dapo", epsilon: float = 0.2, epsilon_high: float | None = None,
                beta: float = 0.0, max_completion_length: int | None = None) -> Any:
    """A `trl_credit.LossInputs` for the whole ``batch`` as one micro-batch (rows in batch order).

    ``logps`` default: a leaf ``(N, T)`` tensor of -1.0 with ``requires_grad`` (so a term's gradient
    can be checked with ``torch.autograd.grad``); ``num_items`` is the batch's mask sum, as TRL's
    ``dapo`` normaliser is on one process with one micro-batch per step. ``mask`` is TRL's loss mask:
    ``completion_mask``, times the batch's ``tool_mask`` on multi-turn rollouts.
    """
    from trl_credit.loss import LossInputs

    n, t = batch.completion_ids.shape
    mask = batch.completion_mask.float()
    if batch.tool_mask is not None:
        mask = mask * batch.tool_mask.float()
    if logps is None:
        logps = torch.full((n, t), -1.0, requires_grad=True)
    return LossInputs(
        batch=batch, rows=torch.arange(n), prompt_ids=torch.zeros(n, 1, dtype=torch.long),
        prompt_mask=torch.ones(n, 1, dtype=torch.long), completion_ids=batch.completion_ids, mask=mask,
        advantages=advantages, old_logps=old_logps, ref_logps=ref_logps, loss_type=loss_type, epsilon_low=epsilon,
        epsilon_high=epsilon if epsilon_high is None else epsilon_high, beta=beta,
        max_completion_length=max_completion_length or t, num_items=mask.sum().clamp(min=1.0), step=batch.step,
        logps=logps, entropies=torch.zeros(n, t))  # fmt: skip


@dataclass
class LossResult:
    """What the host made of a loss plugin: combined `LossWeights` (or None) and ``{name: term}``."""

    weights: Any
    terms: dict[str, torch.Tensor]
    inputs: Any


def run_loss(plugin: type | str | Any, loss: Any, config: dict[str, Any] | None = None, *,
             plugins: PluginSet | None = None) -> LossResult:
    """Run ``loss_weights`` and ``loss_terms`` of this plugin through the host's checks on ``loss``
    (a `loss_inputs` result). Terms are keyed by their name (the host logs ``trl_credit/<plugin>/<name>``)."""
    pipeline = Pipeline(plugins or plugin_set(plugin, config))
    weights = pipeline.loss_weights(loss)
    terms = {name: value for (_, name), value in pipeline.loss_terms(loss).items()}
    return LossResult(weights, terms, loss)


def run_curriculum(plugin: type | str | Any, stats: PromptStats, config: dict[str, Any] | None = None,
                   step: int = 0) -> torch.Tensor | None:
    """Normalised sampling weights the host would draw prompts with."""
    return Pipeline(plugin_set(plugin, config)).prompt_weights(stats, step)


def check_args(plugin: type | str | Any, config: dict[str, Any] | None = None, *,
               reward_names: Sequence[str] = ("accuracy",), columns: Sequence[str] | None = ("prompt", "answer"),
               peft: bool = True, others: Sequence[Any] = (), **grpo_args: Any) -> RunInfo:
    """Run the checks a run meets before its model loads (`trl_credit.config.check_run`), with this
    plugin (and ``others``, names or ``{"name": ..., **options}``, after it) on a run whose
    ``GRPOConfig`` has ``grpo_args``. Raises the `ConfigError` that ``trl-credit validate`` prints."""
    from trl import GRPOConfig

    from trl_credit.config import build_plugins, check_run

    cls = load_plugin(plugin)
    first = {"name": cls, **(config or {})}
    plugins = build_plugins([first, *others])
    args = GRPOConfig(output_dir="unused", report_to="none", use_cpu=True, bf16=False, **grpo_args)
    return check_run(plugins, args, list(reward_names), None if columns is None else list(columns), peft)


def check_plugin(plugin: type | str, config: dict[str, Any] | None = None, *,
                 batches: Sequence[RolloutBatch | Callable[[], RolloutBatch]] | None = None,
                 credits_unscorable: bool = False) -> None:
    """Assert the plugin contract; raises AssertionError listing every problem.

    Checks: a docstring; a pydantic ``Config`` forbidding extra keys whose fields all have
    defaults and descriptions; at least one hook, all in the spec; no near-miss member names;
    and, on edge-case batches (constant groups, NaN rewards, a single completion per group, an
    all-dropped group, ragged lengths), outputs of the right shape, finite, deterministic for
    the same input, and 0 for dropped rows and for rows no reward function scored (every reward NaN
    after shaping; ``credits_unscorable=True`` for a method that says otherwise). A stateful plugin's state, after those batches, must be plain data that
    survives ``torch.save``/``torch.load(weights_only=True)`` and ``load_state_dict`` into a fresh
    instance unchanged. Loss hooks (on `loss_inputs` of each batch) and ``augment_rollouts`` run through
    the host's checks too. Pass ``batches`` (batches or factories) to check on your own batches.
    """
    cls = load_plugin(plugin)
    problems = []
    if not (cls.__doc__ or "").strip() or (cls.__doc__ == Plugin.__doc__):
        problems.append(f"{cls.__name__} has no docstring (give the formula and its source)")
    config_cls = getattr(cls, "Config", None)
    if config_cls is not None:
        if config_cls.model_config.get("extra") != "forbid":
            problems.append("Config must forbid extra keys: model_config = ConfigDict(extra='forbid')")
        for fname, finfo in config_cls.model_fields.items():
            if finfo.is_required() and fname not in (config or {}):
                problems.append(f"Config.{fname} has no default (take it from the paper)")
            if not finfo.description:
                problems.append(f"Config.{fname} has no description (Field(..., description=...))")
    hooks = implemented_hooks(cls)
    if not hooks:
        problems.append("no method is marked @hookimpl")
    problems += [f"hook {h!r} is not in the spec ({', '.join(HOOKS)})" for h in hooks if h not in HOOKS]
    problems += near_misses(cls)
    if problems:
        raise AssertionError("\n".join(problems))
    if batches is None:
        batches = edge_case_batches()
    turn_values = plugin_set(cls, config).plugins[0].members.required_turn_values
    batches = [_with_turn_values(make, turn_values) for make in batches]
    for i, make in enumerate(batches):
        for attempt in range(2):
            batch = make()
            try:
                result = run_plugin(cls, batch, config)
            except Exception as exc:
                raise AssertionError(f"edge-case batch {i}: {type(exc).__name__}: {exc}") from exc
            n = batch.num_completions
            assert result.keep.shape == (n,), f"edge-case batch {i}: keep mask shape {tuple(result.keep.shape)}"
            assert torch.isfinite(result.advantages).all(), f"edge-case batch {i}: non-finite advantages"
            assert (result.advantages[~result.keep] == 0).all(), f"edge-case batch {i}: dropped rows got credit"
            unscored = torch.isnan(result.rewards).all(dim=1).to(result.advantages.device)
            assert credits_unscorable or (result.advantages[unscored] == 0).all(), (
                f"edge-case batch {i}: rows no reward function scored got credit (TRL gives them 0): leave them "
                "out of the credit and the statistics (batch.kept & batch.scorable), or pass credits_unscorable=True "
                "if the method says otherwise")
            if attempt == 0:
                first = result.advantages.clone()
            else:
                assert torch.equal(first, result.advantages), f"edge-case batch {i}: not deterministic"
            _check_other_hooks(cls, config, hooks, i, make, result.advantages)
    _check_state_round_trip(cls, config, batches)
    if "prompt_weights" in hooks:
        stats = PromptStats.empty(5)
        stats.update(torch.tensor([0, 0, 1, 1, 2]), torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0]), 0)
        weights = run_curriculum(cls, stats, config)
        assert weights is None or (weights.shape == (5,) and torch.isfinite(weights).all()), "bad prompt weights"


def _with_turn_values(make: Any, names: Sequence[str]) -> Callable[[], RolloutBatch]:
    """A factory of ``make``'s batch with the per-turn columns a plugin needs and the batch lacks:
    ``0.5, 1.0, ...`` per model turn of each completion."""
    def factory() -> RolloutBatch:
        batch = make() if callable(make) else _copy(make)
        counts = batch.turns().count.tolist() if names else []
        for name in names:
            if name not in batch.columns:
                batch.columns[name] = [[0.5 * (k + 1) for k in range(c)] for c in counts]
        return batch

    return factory


def _check_other_hooks(cls: type, config: dict[str, Any] | None, hooks: Sequence[str], i: int, make: Any,
                       advantages: torch.Tensor) -> None:
    """The loss hooks and ``augment_rollouts`` on edge-case batch ``i``, through the host's checks.

    A batch that lacks a score the plugin asks for (the kit's "pass `...=` to make_batch" error) is
    skipped for these hooks: give ``check_plugin`` ``batches=`` that carry those scores.
    """
    try:
        if {"loss_weights", "loss_terms"} & set(hooks):
            batch = make() if callable(make) else _copy(make)
            run_loss(cls, loss_inputs(batch, advantages.detach().clone()), config)
        if "augment_rollouts" in hooks:
            batch = make() if callable(make) else _copy(make)
            Pipeline(plugin_set(cls, config)).augment_rollouts(batch)
    except RuntimeError as exc:
        if "make_batch" in str(exc) and "pass" in str(exc):
            return
        raise AssertionError(f"edge-case batch {i}: {type(exc).__name__}: {exc}") from exc
    except Exception as exc:
        raise AssertionError(f"edge-case batch {i}: {type(exc).__name__}: {exc}") from exc


def _check_state_round_trip(cls: type, config: dict[str, Any] | None, batches: Sequence[Any]) -> None:
    """Run every batch through one instance, save its state as a checkpoint would, load it into a fresh one."""
    plugins = plugin_set(cls, config)
    if not plugins.plugins[0].members.stateful:
        return
    instance = plugins.plugins[0].instance
    for make in batches:
        run_plugin(cls, make() if callable(make) else _copy(make), plugins=plugins)
    state = instance.state_dict()
    if state is None:
        return
    try:
        loaded = _through_a_checkpoint(state)
    except CheckpointError as exc:
        raise AssertionError(str(exc)) from None
    fresh = plugin_set(cls, config).plugins[0].instance
    fresh.load_state_dict(loaded)
    reloaded = _through_a_checkpoint(fresh.state_dict())
    assert _same(state, reloaded), "state_dict() after load_state_dict(state_dict()) differs from the saved state"


def _through_a_checkpoint(state: Any) -> Any:
    """``state`` written and read back exactly as the host checkpoints a plugin's state."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        write_state(folder, {"plugin": state}, {}, 0)
        return read_state(folder, ["plugin"])["plugins"]["plugin"]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape \
            and torch.equal(a.to(b.dtype), b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _copy(batch: RolloutBatch) -> RolloutBatch:
    return copy.deepcopy(batch)


def edge_case_batches() -> list:
    """Factories of the edge cases every plugin must survive (see `check_plugin`)."""
    def scored(rewards, num_generations, lengths):
        n, t = len(rewards), max(max(lengths), 1)
        g = torch.Generator().manual_seed(n * 1000 + t)  # the same scores every time a factory is called
        return make_batch(rewards, num_generations, lengths=lengths,
                          logps=-torch.rand(n, t, generator=g), entropies=torch.rand(n, t, generator=g),
                          ref_logps=-torch.rand(n, t, generator=g), adapters={"*": -torch.rand(n, t, generator=g)},
                          columns={"answer": ["1"] * n}, reward_names=["accuracy"])

    return [
        lambda: scored([1, 0, 1, 0, 1, 1, 0, 0], 4, [6, 3, 5, 1, 2, 6, 4, 3]),   # mixed groups
        lambda: scored([1, 1, 1, 1, 0, 0, 0, 0], 4, [6] * 8),                    # constant groups
        lambda: scored([1, None, 0, 1, None, None, None, None], 4, [3] * 8),     # NaN rewards
        lambda: scored([1, 0, 1], 1, [2, 6, 4]),                                 # one completion per group
        lambda: scored([0.5, 0.25, 0.75, 0.0], 2, [6, 0, 6, 1]),                 # non-binary, empty completion
    ]


def difficulty_reward(pass_rate: dict[int, float], group_size: int, log: list | None = None,
                      index_column: str = "trl_credit_prompt_index"):
    """A deterministic stand-in reward for curriculum tests, whatever a (tiny, random) model writes.

    Completion ``i`` of a prompt with ``difficulty`` d passes (1.0) iff its position in its group,
    ``i % group_size``, is below ``round(pass_rate[d] * group_size)``: every group of a difficulty-d
    prompt passes exactly that fraction, so per-prompt pass rates are known in advance. Needs a
    ``difficulty`` dataset column (`tiny_dataset` has one). When ``log`` is
    given, each call appends the dataset rows of its groups (from ``index_column``: the host's
    prompt index by default) to it, one list per generation round. The reward column is named
    ``difficulty_reward``.
    """
    def difficulty_reward(completions, difficulty, **kwargs):
        if log is not None:
            log.append(list(kwargs[index_column][::group_size]))
        return [1.0 if i % group_size < round(pass_rate[d] * group_size) else 0.0 for i, d in enumerate(difficulty)]

    return difficulty_reward
