"""Runs the hook families in config order, times each plugin and checks what it returns.

A plugin that raises, returns a wrong shape, or returns NaN/inf stops the run with a
`PluginRuntimeError` naming the plugin, the hook and the step. No plugin is ever skipped.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from typing import Any

import torch

from trl_credit.augment import Augmentation
from trl_credit.batch import PromptStats, RolloutBatch
from trl_credit.builtin import GRPOAdvantage
from trl_credit.config import EnabledPlugin, PluginSet
from trl_credit.hookspecs import HOOKS
from trl_credit.loss import CLIPPED_LOSSES, LossInputs, LossWeights


class PluginRuntimeError(RuntimeError):
    """A plugin failed or broke the contract while training."""


class Pipeline:
    """The enabled plugins, ready to be called by the trainer seam (or by `trl_credit.testing`)."""

    def __init__(self, plugins: PluginSet):
        self.plugins = plugins
        self._impls: dict[tuple[str, str], tuple[Any, tuple[str, ...]]] = {}
        if plugins.manager is not None:
            for hook in HOOKS:
                for impl in getattr(plugins.manager.hook, hook).get_hookimpls():
                    self._impls[(impl.plugin_name, hook)] = (impl.function, tuple(impl.argnames))
        estimators = plugins.with_hook("compute_advantages")
        if estimators:
            self.estimator = estimators[0]
        else:
            default = GRPOAdvantage()
            self.estimator = EnabledPlugin(-1, "grpo", "grpo", default, ["compute_advantages"])
            self._impls[("grpo", "compute_advantages")] = (default.compute_advantages, ("batch",))
        self.seconds: dict[str, float] = defaultdict(float)  # per plugin, since the last log
        # refill: as many extra rounds as the most generous filter asks for, within the tightest token budget
        refills = [p.members.refill for p in plugins.with_hook("filter_rollouts") if p.members.refill is not None]
        self.max_refill_rounds = max((r.max_rounds for r in refills), default=0)
        budgets = [r.max_tokens for r in refills if r.max_tokens is not None]
        self.max_refill_tokens: int | None = min(budgets) if budgets else None

    # ---------------------------------------------------------------- queries
    @property
    def active(self) -> bool:
        """False when no plugin is enabled: the trainer then runs TRL's code path untouched (on CPU it scores
        only the completion tokens: `trl_credit.trainer`)."""
        return bool(self.plugins.plugins)

    def has(self, hook: str) -> bool:
        return bool(self.plugins.with_hook(hook))

    # ---------------------------------------------------------------- calling
    def _call(self, plugin: EnabledPlugin, hook: str, at_step: int, **kwargs: Any) -> Any:
        function, argnames = self._impls[(plugin.key, hook)]
        batch = kwargs.get("batch") if "loss" not in kwargs else kwargs["loss"].batch
        before = _tensor_versions(batch) if batch is not None else None
        start = time.perf_counter()
        try:
            out = function(**{k: kwargs[k] for k in argnames})
        except PluginRuntimeError:
            raise
        except (Exception, SystemExit) as exc:  # a plugin may not end the run: SystemExit is an error too
            raise PluginRuntimeError(
                f"plugin '{plugin.key}' raised in {hook} at step {at_step}: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            self.seconds[plugin.key] += time.perf_counter() - start
        if before is not None:
            changed = [name for name, (tensor, version) in before.items() if tensor._version != version]
            if changed:
                raise PluginRuntimeError(
                    f"plugin '{plugin.key}' modified {', '.join(changed)} in place in {hook} at step {at_step}: "
                    "the batch is read-only (other plugins and the loss read it); return new values instead "
                    "(e.g. `x = batch.completion_mask.clone()`)")
        return out

    def _fail(self, plugin: EnabledPlugin, hook: str, step: int, what: str) -> None:
        raise PluginRuntimeError(f"plugin '{plugin.key}' returned {what} from {hook} at step {step}")

    def _check_finite(self, plugin, hook, step, x: torch.Tensor) -> None:
        if x.numel() == 0:
            return
        low, high = torch.aminmax(x)  # NaN propagates into both; ~25x cheaper than isfinite(x).all()
        if not (math.isfinite(float(low)) and math.isfinite(float(high))):
            bad = int((~torch.isfinite(x)).sum())
            self._fail(plugin, hook, step, f"{bad} NaN/inf value(s)")

    # ---------------------------------------------------------------- families
    def augment_rollouts(self, batch: RolloutBatch) -> list[tuple[str, Augmentation]]:
        """``[(plugin key, request)]`` of every ``augment_rollouts`` plugin, checked, in config order."""
        requests: list[tuple[str, Augmentation]] = []
        for plugin in self.plugins.with_hook("augment_rollouts"):
            out = self._call(plugin, "augment_rollouts", batch.step, batch=batch)
            if out is None:
                continue
            if not isinstance(out, (list, tuple)) or not all(isinstance(r, Augmentation) for r in out):
                self._fail(plugin, "augment_rollouts", batch.step, f"a {type(out).__name__} (expected a list of "
                           "trl_credit.Augmentation or None)")
            for request in out:
                if not 0 <= int(request.group) < batch.num_groups:
                    self._fail(plugin, "augment_rollouts", batch.step, f"group {request.group}; the round has groups "
                               f"0..{batch.num_groups - 1}")
                prompts = [request.prompt] if request.prompts is None else list(request.prompts)
                if request.prompts is not None and len(prompts) != batch.num_generations:
                    self._fail(plugin, "augment_rollouts", batch.step, f"{len(prompts)} prompts for group "
                               f"{request.group} (expected one per completion: {batch.num_generations})")
                for prompt in prompts:
                    if not isinstance(prompt, (str, list)) or not prompt:
                        self._fail(plugin, "augment_rollouts", batch.step, f"a prompt of type {type(prompt).__name__}"
                                   " (expected a non-empty string or list of chat messages)")
                if not isinstance(request.context, str) or not request.context:
                    self._fail(plugin, "augment_rollouts", batch.step, "an empty context (say what was changed)")
                requests.append((plugin.key, request))
        replaced = [r.group for _, r in requests if r.replace]
        if len(replaced) != len(set(replaced)):
            names = ", ".join(p.key for p in self.plugins.with_hook("augment_rollouts"))
            raise PluginRuntimeError(f"augment_rollouts ({names}) asked to replace the same group twice at step "
                                     f"{batch.step}")
        return requests

    def check_batch(self, batch: RolloutBatch) -> None:
        """Every per-turn column a plugin reads (``required_turn_values``) is in the batch, before any hook runs."""
        for plugin in self.plugins.plugins:
            missing = [name for name in plugin.members.required_turn_values if name not in batch.columns]
            if missing:
                raise PluginRuntimeError(
                    f"plugin '{plugin.key}' needs per-turn values {missing} (required_turn_values), which the "
                    f"rollouts of step {batch.step} did not record (columns: {sorted(batch.columns)}); return them "
                    "from the rollout_func or record them in the environment's turn_values, or set the plugin's "
                    "column option")

    def shape_rewards(self, batch: RolloutBatch) -> None:
        """Apply the shapers in order, updating ``batch.rewards/reward_names/reward_weights``."""
        for plugin in self.plugins.with_hook("shape_rewards"):
            before = batch.rewards
            out = self._call(plugin, "shape_rewards", batch.step, batch=batch)
            if out is None:
                continue
            n, k = before.shape
            if isinstance(out, torch.Tensor):
                if tuple(out.shape) != (n, k):
                    self._fail(plugin, "shape_rewards", batch.step, f"shape {tuple(out.shape)}, expected ({n}, {k})")
                new = out.to(before)
            elif isinstance(out, dict):
                new, names = before.clone(), list(batch.reward_names)
                weights = batch.reward_weights.clone().to(torch.float32)
                for name, value in out.items():
                    weight = None
                    if isinstance(value, tuple):
                        value, weight = value
                    value = torch.as_tensor(value, dtype=before.dtype, device=before.device)
                    if tuple(value.shape) != (n,):
                        self._fail(plugin, "shape_rewards", batch.step,
                                   f"column '{name}' of shape {tuple(value.shape)}, expected ({n},)")
                    if name in names:
                        j = names.index(name)
                        new[:, j] = value
                        if weight is not None:
                            weights[j] = float(weight)
                    else:
                        names.append(name)
                        new = torch.cat([new, value.unsqueeze(1)], dim=1)
                        extra = torch.tensor([1.0 if weight is None else float(weight)], device=weights.device)
                        weights = torch.cat([weights, extra])
                batch.reward_names, batch.reward_weights = names, weights
            else:
                self._fail(plugin, "shape_rewards", batch.step, f"a {type(out).__name__} (expected tensor, dict or None)")
            old_nan = torch.isnan(before)
            new_nan = torch.isnan(new[:, :k]) & ~old_nan
            unscored = old_nan.all(dim=1, keepdim=True) & (k > 0)  # a new column may leave these rows unscored
            if new_nan.any() or (torch.isnan(new[:, k:]) & ~unscored).any() or torch.isinf(new).any():
                self._fail(plugin, "shape_rewards", batch.step, "NaN/inf rewards where its input had finite values")
            batch.rewards = new

    def filter_rollouts(self, batch: RolloutBatch) -> torch.Tensor:
        """AND of every filter's keep mask, ``(N,)`` bool; also stored in ``batch.kept``."""
        keep = torch.ones(batch.num_completions, dtype=torch.bool, device=batch.device)
        for plugin in self.plugins.with_hook("filter_rollouts"):
            out = self._call(plugin, "filter_rollouts", batch.step, batch=batch)
            if out is None:
                continue
            out = torch.as_tensor(out, device=batch.device)
            if out.dtype != torch.bool:
                self._fail(plugin, "filter_rollouts", batch.step, f"a {out.dtype} mask (expected torch.bool)")
            if tuple(out.shape) == (batch.num_groups,):
                out = out.repeat_interleave(batch.num_generations)
            elif tuple(out.shape) != (batch.num_completions,):
                self._fail(plugin, "filter_rollouts", batch.step, f"mask of shape {tuple(out.shape)}, expected "
                           f"({batch.num_completions},) or ({batch.num_groups},)")
            batch.log_metric("kept_fraction", out.float().mean().item(), plugin=plugin.key)
            keep &= out
        batch.kept = keep
        return keep

    def compute_advantages(self, batch: RolloutBatch) -> torch.Tensor:
        plugin = self.estimator
        out = self._call(plugin, "compute_advantages", batch.step, batch=batch)
        return self._check_advantages(plugin, "compute_advantages", batch, out)

    def transform_advantages(self, batch: RolloutBatch, advantages: torch.Tensor) -> torch.Tensor:
        for plugin in self.plugins.with_hook("transform_advantages"):
            out = self._call(plugin, "transform_advantages", batch.step, batch=batch, advantages=advantages)
            if out is not None:
                advantages = self._check_advantages(plugin, "transform_advantages", batch, out)
        return advantages

    def _check_advantages(self, plugin, hook, batch: RolloutBatch, out: Any) -> torch.Tensor:
        if not isinstance(out, torch.Tensor):
            self._fail(plugin, hook, batch.step, f"a {type(out).__name__} (expected a tensor)")
        n, t = batch.num_completions, batch.width
        if tuple(out.shape) not in ((n,), (n, t)):
            self._fail(plugin, hook, batch.step, f"advantages of shape {tuple(out.shape)}, expected ({n},) or ({n}, {t})")
        self._check_finite(plugin, hook, batch.step, out)
        return out.to(torch.float32)

    def kl_coefficient(self, batch: RolloutBatch) -> float | None:
        """The enabled plugin's ``beta`` for this batch, or None (keep ``GRPOConfig.beta``)."""
        for plugin in self.plugins.with_hook("kl_coefficient"):  # at most one (config check)
            out = self._call(plugin, "kl_coefficient", batch.step, batch=batch)
            if out is None:
                return None
            try:
                beta = float(out)
            except (TypeError, ValueError):
                self._fail(plugin, "kl_coefficient", batch.step, f"a {type(out).__name__} (expected a number or None)")
            if not math.isfinite(beta) or beta < 0:
                self._fail(plugin, "kl_coefficient", batch.step, f"beta = {beta}; it must be finite and >= 0")
            return beta
        return None

    def loss_weights(self, loss: LossInputs) -> LossWeights | None:
        """The product of the plugins' token weights and the one plugin's clip bounds (None: no plugin gave any)."""
        token = low = high = None
        source = None
        b, t = loss.completion_ids.shape
        for plugin in self.plugins.with_hook("loss_weights"):
            out = self._call(plugin, "loss_weights", loss.step, loss=loss)
            if out is None:
                continue
            if not isinstance(out, LossWeights):
                self._fail(plugin, "loss_weights", loss.step, f"a {type(out).__name__} (expected trl_credit.LossWeights "
                           "or None)")
            if out.token is not None:
                w = self._loss_tensor(plugin, "token weights", loss.step, out.token, (b, t))
                token = w if token is None else token * w
            for name, value in (("epsilon_low", out.epsilon_low), ("epsilon_high", out.epsilon_high)):
                if value is None:
                    continue
                if loss.loss_type not in CLIPPED_LOSSES:
                    self._fail(plugin, "loss_weights", loss.step, f"{name} under loss_type {loss.loss_type}, which has "
                               f"no clip bounds (only {', '.join(CLIPPED_LOSSES)} do)")
                if source is not None and source != plugin.key:
                    self._fail(plugin, "loss_weights", loss.step, f"{name}, but plugin '{source}' already set the clip "
                               "bounds of this micro-batch (at most one plugin may)")
                source = plugin.key
                bound = self._loss_tensor(plugin, name, loss.step, value, (b,))
                low, high = (bound, high) if name == "epsilon_low" else (low, bound)
        if token is None and low is None and high is None:
            return None
        return LossWeights(token, low, high)

    def _loss_tensor(self, plugin, what: str, step: int, value: Any, shape: tuple[int, ...]) -> torch.Tensor:
        if not isinstance(value, torch.Tensor):
            self._fail(plugin, "loss_weights", step, f"{what} as a {type(value).__name__} (expected a tensor)")
        if tuple(value.shape) != shape:
            self._fail(plugin, "loss_weights", step, f"{what} of shape {tuple(value.shape)}, expected {shape}")
        self._check_finite(plugin, "loss_weights", step, value.detach())
        if bool((value < 0).any()):
            self._fail(plugin, "loss_weights", step, f"negative {what}")
        return value.detach().to(torch.float32)

    def loss_terms(self, loss: LossInputs) -> dict[tuple[str, str], torch.Tensor]:
        """``{(plugin key, term name): scalar}`` from every ``loss_terms`` plugin, checked finite and 0-dim."""
        terms: dict[tuple[str, str], torch.Tensor] = {}
        for plugin in self.plugins.with_hook("loss_terms"):
            out = self._call(plugin, "loss_terms", loss.step, loss=loss)
            if out is None:
                continue
            if not isinstance(out, dict):
                self._fail(plugin, "loss_terms", loss.step, f"a {type(out).__name__} (expected a dict of scalars or None)")
            for name, value in out.items():
                if not isinstance(value, torch.Tensor) or value.dim() != 0:
                    what = f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
                    self._fail(plugin, "loss_terms", loss.step, f"term '{name}' as {what} (expected a 0-dim tensor)")
                self._check_finite(plugin, "loss_terms", loss.step, value.detach())
                terms[(plugin.key, str(name))] = value
        return terms

    def prompt_weights(self, stats: PromptStats, step: int) -> torch.Tensor | None:
        """Product of the curricula's weights, normalised; None when no curriculum is enabled."""
        weights = None
        for plugin in self.plugins.with_hook("prompt_weights"):
            out = self._call(plugin, "prompt_weights", step, stats=stats, step=step)
            if out is None:
                continue
            out = torch.as_tensor(out, dtype=torch.float64)
            if tuple(out.shape) != (stats.num_prompts,):
                self._fail(plugin, "prompt_weights", step, f"weights of shape {tuple(out.shape)}, expected ({stats.num_prompts},)")
            self._check_finite(plugin, "prompt_weights", step, out)
            if (out < 0).any():
                self._fail(plugin, "prompt_weights", step, "negative weights")
            weights = out if weights is None else weights * out
        if weights is None:
            return None
        total = weights.sum()
        if not math.isfinite(float(total)) or total <= 0:
            names = ", ".join(p.key for p in self.plugins.with_hook("prompt_weights"))
            raise PluginRuntimeError(f"prompt curricula ({names}) gave every prompt weight 0 at step {step}")
        return weights / total

    def notify(self, hook: str, at_step: int, **kwargs: Any) -> None:
        """Call the observers of ``hook`` (``on_train_begin``, ``on_batch_end``, ``on_step_end``) in config order."""
        for plugin in self.plugins.with_hook(hook):
            self._call(plugin, hook, at_step, **kwargs)

    # ---------------------------------------------------------------- metrics
    def pop_timings(self) -> dict[str, float]:
        out = {f"trl_credit/{k}/seconds": v for k, v in self.seconds.items()}
        self.seconds.clear()
        return out

    def stateful(self) -> list[EnabledPlugin]:
        return [p for p in self.plugins.plugins if p.members.stateful]

    def state_dict(self) -> dict[str, Any]:
        """``{plugin key: state}`` of every stateful plugin (``state_dict()`` may return None: nothing to restore)."""
        return {p.key: p.instance.state_dict() for p in self.stateful()}

    def load_state_dict(self, state: dict[str, Any], source: str = "the checkpoint") -> list[str]:
        """Restore every stateful plugin from ``state`` (a None state: nothing to restore); returns the keys restored.

        A ``load_state_dict`` that raises stops the run with a `PluginRuntimeError` naming the plugin and ``source``.
        """
        restored = []
        for p in self.stateful():
            if state.get(p.key) is None:
                continue
            try:
                p.instance.load_state_dict(state[p.key])
            except Exception as exc:
                raise PluginRuntimeError(f"plugin '{p.key}' raised in load_state_dict while resuming from {source}: "
                                         f"{type(exc).__name__}: {exc}") from exc
            restored.append(p.key)
        return restored


_READ_ONLY = ("completion_ids", "completion_mask", "rewards", "reward_weights", "kept", "prompt_index", "tool_mask")


def _tensor_versions(batch: RolloutBatch) -> dict[str, tuple[torch.Tensor, int]]:
    """The batch tensors a hook may read but not write, with their in-place version counters.

    A view's lazy ids and mask count once materialised, and the scores cached on the root batch
    (shared by every plugin) are included. ``Tensor._version`` counts in-place writes (pinned by a test).
    """
    found = {}
    for name in _READ_ONLY:
        value = batch.__dict__.get(name)
        if isinstance(value, torch.Tensor):
            found[f"batch.{name}"] = (value, value._version)
    for kind, value in batch.root.token_cache.items():
        if isinstance(value, torch.Tensor):
            found[f"the cached {kind} scores"] = (value, value._version)
    return found


def kept_advantages(pipeline: Pipeline, batch: RolloutBatch) -> torch.Tensor:
    """Estimator + transforms on every group with a kept completion; 0 for dropped completions.

    The estimator always sees whole groups: a group is left out only when all of its completions
    are dropped. Completions dropped inside a kept group still count in its baseline (as TRL does
    for truncated completions) and get advantage 0 afterwards.
    """
    kept = batch.kept
    if bool(kept.all()):  # common case: no copy, no scatter
        return pipeline.transform_advantages(batch, pipeline.compute_advantages(batch))
    n, width = batch.num_completions, batch.width
    groups = batch.grouped(kept).any(dim=1).repeat_interleave(batch.num_generations)
    rows = groups.nonzero().squeeze(1)
    advantages = torch.zeros(n, device=batch.device)
    if rows.numel():
        view = batch.select(rows)
        adv = pipeline.transform_advantages(view, pipeline.compute_advantages(view))
        if adv.dim() == 2:
            advantages = torch.zeros(n, width, device=batch.device)
        advantages[rows] = adv.to(advantages.device)
        advantages[~kept] = 0.0
    return advantages
