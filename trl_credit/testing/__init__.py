"""Test kit for plugin authors: build a `RolloutBatch` from plain values and run one plugin on it.

    from trl_credit.testing import make_batch, run_plugin, check_plugin

    batch = make_batch(rewards=[1, 0, 0, 0], num_generations=4)
    result = run_plugin(MyPlugin, batch, {"alpha": 0.5})
    assert torch.allclose(result.advantages, torch.tensor([...]))
    check_plugin(MyPlugin)          # the contract, on edge-case batches

No model is needed: log-probs and entropies are given as tensors. `run_plugin` runs the plugin the
way the host does (shape -> filter -> estimator on the kept groups -> transforms), with the built-in
``grpo`` estimator when the plugin brings none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Sequence

import torch

from trl_credit.batch import PromptStats, RolloutBatch
from trl_credit.config import ConfigError, EnabledPlugin, PluginSet, active_hooks, instantiate, plugin_name
from trl_credit.hookspecs import HOOKS
from trl_credit.pipeline import Pipeline, kept_advantages
from trl_credit.plugins import available, implemented_hooks, new_manager


def default_args(**overrides: Any) -> SimpleNamespace:
    """The `GRPOConfig` fields the host and plugins read, with TRL's defaults."""
    values = dict(scale_rewards="group", multi_objective_aggregation="sum_then_normalize",
                  max_completion_length=None, loss_type="dapo", beta=0.0, num_generations=None, seed=0)
    values.update(overrides)
    return SimpleNamespace(**values)


class _Tokenizer(SimpleNamespace):
    """Stands in for a tokenizer where only ``pad_token_id`` is read."""


class _StaticScorer:
    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def token_scores(self, kind: str) -> torch.Tensor:
        if kind not in self.tensors:
            name = {"policy_logps": "logps", "policy_entropies": "entropies", "ref_logps": "ref_logps"}[kind]
            raise RuntimeError(f"the plugin asked for {kind}; pass `{name}=` to make_batch")
        return self.tensors[kind]

    def continuation_logps(self, prefixes, continuations, model):
        fn = self.tensors.get("continuation_fn")
        if fn is None:
            raise RuntimeError("the plugin asked for continuation log-probs; pass `continuation_fn=` to make_batch")
        return [torch.as_tensor(fn(p, c, model), dtype=torch.float32) for p, c in zip(prefixes, continuations)]


def make_batch(
    rewards: Sequence | torch.Tensor,
    num_generations: int,
    *,
    reward_names: Sequence[str] | None = None,
    reward_weights: Sequence[float] | None = None,
    completion_ids: Sequence[Sequence[int]] | torch.Tensor | None = None,
    completion_mask: torch.Tensor | None = None,
    lengths: Sequence[int] | None = None,
    completions: Sequence[Any] | None = None,
    prompts: Sequence[Any] | None = None,
    columns: dict[str, Sequence[Any]] | None = None,
    logps: torch.Tensor | None = None,
    entropies: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    continuation_fn: Any = None,
    prompt_index: Sequence[int] | None = None,
    step: int = 0,
    pad_token_id: int = 0,
    args: Any = None,
    **arg_overrides: Any,
) -> RolloutBatch:
    """Build a batch. ``rewards`` is ``(N,)`` or ``(N, K)`` (``None`` entries become NaN).

    Token ids: give ``completion_ids`` (ragged lists are right-padded with ``pad_token_id``), or
    ``lengths`` (ids 1..L are made up), or neither (every completion gets 4 tokens).
    ``arg_overrides`` set `GRPOConfig` fields, e.g. ``scale_rewards="batch"``.
    """
    r = torch.tensor([[math.nan if v is None else v for v in (row if isinstance(row, (list, tuple)) else [row])]
                      for row in (rewards.tolist() if isinstance(rewards, torch.Tensor) else rewards)],
                     dtype=torch.float32)
    n, k = r.shape
    if n % num_generations:
        raise ValueError(f"{n} completions do not split into groups of {num_generations}")
    if completion_ids is None:
        lens = list(lengths) if lengths is not None else [4] * n
        width = max(max(lens), 1)
        ids = torch.full((n, width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, length in enumerate(lens):
            ids[i, :length] = torch.arange(1, length + 1) + (pad_token_id == 1)
            mask[i, :length] = 1
    elif isinstance(completion_ids, torch.Tensor):
        ids = completion_ids.long()
        mask = (ids != pad_token_id).long() if completion_mask is None else completion_mask.long()
    else:
        width = max(max((len(c) for c in completion_ids), default=1), 1)
        ids = torch.full((n, width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, c in enumerate(completion_ids):
            ids[i, : len(c)] = torch.tensor(list(c), dtype=torch.long)
            mask[i, : len(c)] = 1
    if completion_mask is not None:
        mask = completion_mask.long()
    if args is None:
        args = default_args(**{"max_completion_length": ids.shape[1], "num_generations": num_generations,
                               **arg_overrides})
    tensors = {}
    for kind, value in (("policy_logps", logps), ("policy_entropies", entropies), ("ref_logps", ref_logps)):
        if value is not None:
            tensors[kind] = torch.as_tensor(value, dtype=torch.float32)
    if continuation_fn is not None:
        tensors["continuation_fn"] = continuation_fn
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
        tokenizer=_Tokenizer(pad_token_id=pad_token_id),
        scorer=_StaticScorer(tensors),
    )


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


def load_plugin(plugin: type | str) -> type:
    """A plugin class, or the class an installed entry point (or built-in) names."""
    if isinstance(plugin, str):
        found = available()
        if plugin not in found:
            raise ConfigError([f"no plugin named {plugin!r} is installed ({sorted(found)})"])
        return found[plugin].load()
    return plugin


def plugin_set(plugin: type | str, config: dict[str, Any] | None = None, name: str | None = None) -> PluginSet:
    """Validate ``config`` and register one plugin exactly as the host would."""
    cls = load_plugin(plugin)
    name = name or (plugin if isinstance(plugin, str) else plugin_name(cls))
    instance, problems = instantiate(cls, dict(config or {}), 0, name)
    if problems:
        raise ConfigError(problems)
    hooks, problems = active_hooks(instance, implemented_hooks(cls), 0, name)
    if problems:
        raise ConfigError(problems)
    manager = new_manager()
    manager.register(instance, name=name)
    manager.check_pending()
    return PluginSet([EnabledPlugin(0, name, name, instance, hooks)], manager)


def run_plugin(plugin: type | str, batch: RolloutBatch, config: dict[str, Any] | None = None,
               *, plugins: PluginSet | None = None) -> PluginResult:
    """Run the host pipeline on ``batch`` with just this plugin (and the built-in estimator)."""
    plugins = plugins or plugin_set(plugin, config)
    pipeline = Pipeline(plugins)
    pipeline.shape_rewards(batch)
    keep = pipeline.filter_rollouts(batch)
    advantages = kept_advantages(pipeline, batch)
    beta = pipeline.kl_coefficient(batch)
    pipeline.broadcast("on_batch_end", batch.step, batch=batch, advantages=advantages)
    metrics = {k: sum(v) / len(v) for k, v in batch.metrics.items()}
    return PluginResult(batch, batch.rewards, list(batch.reward_names), keep, advantages,
                        plugins.plugins[0].instance, metrics, beta)


def run_curriculum(plugin: type | str, stats: PromptStats, config: dict[str, Any] | None = None,
                   step: int = 0) -> torch.Tensor | None:
    """Normalised sampling weights the host would draw prompts with."""
    return Pipeline(plugin_set(plugin, config)).prompt_weights(stats, step)


def check_plugin(plugin: type | str, config: dict[str, Any] | None = None, *,
                 batches: Sequence[RolloutBatch] | None = None) -> None:
    """Assert the plugin contract; raises AssertionError listing every problem.

    Checks: a docstring; a pydantic ``Config`` forbidding extra keys whose fields all have
    defaults and descriptions; at least one hook, all in the spec; and, on edge-case batches
    (constant groups, NaN rewards, a single completion per group, an all-dropped group, ragged
    lengths), outputs of the right shape, finite, and deterministic for the same input. Pass
    ``batches`` to check on your own batches (e.g. with the columns or scores the plugin needs).
    """
    cls = load_plugin(plugin)
    problems = []
    if not (cls.__doc__ or "").strip():
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
    if problems:
        raise AssertionError("\n".join(problems))
    if batches is None:
        batches = edge_case_batches()
    for i, make in enumerate(batches):
        for attempt in range(2):
            batch = make() if callable(make) else _copy(make)
            try:
                result = run_plugin(cls, batch, config)
            except Exception as exc:
                raise AssertionError(f"edge-case batch {i}: {type(exc).__name__}: {exc}") from exc
            n = batch.num_completions
            assert result.keep.shape == (n,), f"edge-case batch {i}: keep mask shape {tuple(result.keep.shape)}"
            assert torch.isfinite(result.advantages).all(), f"edge-case batch {i}: non-finite advantages"
            assert (result.advantages[~result.keep] == 0).all(), f"edge-case batch {i}: dropped rows got credit"
            if attempt == 0:
                first = result.advantages.clone()
            else:
                assert torch.equal(first, result.advantages), f"edge-case batch {i}: not deterministic"
    if "prompt_weights" in hooks:
        stats = PromptStats.empty(5)
        stats.update(torch.tensor([0, 0, 1, 1, 2]), torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0]), 0)
        weights = run_curriculum(cls, stats, config)
        assert weights is None or (weights.shape == (5,) and torch.isfinite(weights).all()), "bad prompt weights"


def _copy(batch: RolloutBatch) -> RolloutBatch:
    import copy

    return copy.deepcopy(batch)


def edge_case_batches() -> list:
    """Factories of the edge cases every plugin must survive (see `check_plugin`)."""
    def scored(rewards, num_generations, lengths):
        n, t = len(rewards), max(max(lengths), 1)
        g = torch.Generator().manual_seed(n * 1000 + t)  # the same scores every time a factory is called
        return make_batch(rewards, num_generations, lengths=lengths,
                          logps=-torch.rand(n, t, generator=g), entropies=torch.rand(n, t, generator=g),
                          ref_logps=-torch.rand(n, t, generator=g),
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
    ``difficulty`` dataset column (``trl_credit.app.data.make_arithmetic`` has one). When ``log`` is
    given, each call appends the dataset rows of its groups (from ``index_column``: the host's
    prompt index by default) to it, one list per generation round. The reward column is named
    ``difficulty_reward``.
    """
    def difficulty_reward(completions, difficulty, **kwargs):
        if log is not None:
            log.append(list(kwargs[index_column][::group_size]))
        return [1.0 if i % group_size < round(pass_rate[d] * group_size) else 0.0 for i, d in enumerate(difficulty)]

    return difficulty_reward
