"""`Plugin`: the declared contract between the host and a plugin, beside the hooks themselves.

A plugin is a class with ``@hookimpl`` methods (the hooks, `trl_credit.hookspecs`) and, optionally,
the members below, which the host knows by name. Subclass `Plugin` to get every member with a
default that does nothing; a plain class with ``@hookimpl`` methods keeps working (the host reads its
members through `members`, the one place that looks them up).

==========================  =================================================================  ===========
member                      meaning                                                            called
==========================  =================================================================  ===========
``Config``                  pydantic model of the plugin's options (``extra="forbid"``)        config load
``config``                  the validated options (set by ``__init__``)
``required_rewards()``      reward columns the run must produce (``batch.reward(name)``)       before load
``required_columns()``      dataset columns the run must have (``batch.column(name)``)         before load
``required_turn_values()``  per-turn columns the rollouts must record (``batch.turn_values``)  each batch
``disabled_hooks()``        hooks this configuration switches off (treated as absent)          config load
``check_args(run)``         raise `ConfigError` for settings it cannot run with (`RunInfo`)    before load
``refill()``                a `Refill` when its filter wants more prompts drawn, else None     config load
``adapters()``              auxiliary LoRA adapters it owns (`Adapter`, `adapter(name)`)       config load
``needs_reference()``       True when this configuration reads the reference model             before load
``state_dict()``            plain data to checkpoint, or None (stateless)                      each save
``load_state_dict(s)``      restore what ``state_dict()`` returned                             on resume
==========================  =================================================================  ===========

"Before load" means in ``trl-credit validate`` and in the trainer's ``__init__`` before any model is
loaded, so a bad setting costs no model load. At registration the host refuses a public method whose
name is close to a hook or to one of these members without being one (``filter_rollout``,
``stat_dict``), and a method named like a hook that is not marked ``@hookimpl``.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from trl_credit.adapters import Adapter, AdapterHandle
from trl_credit.hookspecs import HOOKS, PROJECT

__all__ = ["MEMBERS", "Plugin", "PluginInfo", "Refill", "RunInfo", "adapter_handle", "members", "near_misses"]

#: The optional members the host knows by name.
MEMBERS = ("required_rewards", "required_columns", "required_turn_values", "disabled_hooks", "check_args", "refill", "adapters",
           "needs_reference", "state_dict", "load_state_dict")


@dataclass(frozen=True)
class Refill:
    """A filter's request for DAPO-style refill: draw more prompts until the batch holds its quota of
    kept groups, at most ``max_rounds`` extra generation rounds and, when given, at most ``max_tokens``
    extra generated completion tokens (summed over all processes) per optimiser batch."""

    max_rounds: int = 4
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_rounds < 0:
            raise ValueError(f"Refill.max_rounds must be >= 0, got {self.max_rounds}")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise ValueError(f"Refill.max_tokens must be >= 0 or None, got {self.max_tokens}")


@dataclass(frozen=True)
class PluginInfo:
    """Another enabled plugin, as `RunInfo` shows it (for checks on combinations)."""

    index: int
    key: str
    hooks: tuple[str, ...]
    refill: Refill | None


@dataclass(frozen=True)
class RunInfo:
    """What ``check_args`` sees: the resolved run, before any model is loaded.

    - ``args``: the resolved ``GRPOConfig`` (``loss_type``, ``beta``, ``num_generations``, ...).
    - ``reward_names``: the reward columns the reward functions produce, in order.
    - ``columns``: the training dataset's columns, or None when they are not known before loading.
    - ``peft``: a PEFT adapter is trained (the base with adapters off is then a reference model).
    - ``plugins``: every enabled plugin in config order (`PluginInfo`), this one included.
    """

    args: Any
    reward_names: tuple[str, ...] = ()
    columns: tuple[str, ...] | None = None
    peft: bool = False
    plugins: tuple[PluginInfo, ...] = field(default_factory=tuple)

    @property
    def groups_per_batch(self) -> int:
        """Prompts (groups) in one generation batch: ``generation_batch_size // num_generations``."""
        size = getattr(self.args, "generation_batch_size", None)
        g = getattr(self.args, "num_generations", None)
        return int(size) // int(g) if size and g else 0

    def with_hook(self, hook: str) -> list[PluginInfo]:
        return [p for p in self.plugins if hook in p.hooks]


class Plugin:
    """Base class of trl-credit plugins: a ``Config``, ``self.config`` and the optional members.

    Override what the method needs; every default does nothing. See the module docstring.
    """

    #: The YAML name when the class is passed in Python (entry points name installed plugins).
    name: ClassVar[str | None] = None

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

    def __init__(self, config: BaseModel | None = None):
        self.config = config if config is not None else self.Config()

    def required_rewards(self) -> Sequence[str]:
        """Reward columns (``reward_names``) this configuration reads; checked before the model loads."""
        return ()

    def required_columns(self) -> Sequence[str]:
        """Dataset columns this configuration reads; checked before the model loads."""
        return ()

    def required_turn_values(self) -> Sequence[str]:
        """Per-turn columns (`RolloutBatch.turn_values`) this configuration reads: fields a ``rollout_func``
        returns or an environment records, so not dataset columns. Checked before the model loads when the
        rollout declares its fields (a ``rollout_func`` with a ``fields`` attribute, the ``guess`` task), and
        on every batch (a clear error naming the plugin, the column and the step)."""
        return ()

    def disabled_hooks(self) -> Sequence[str]:
        """Hooks this configuration switches off; the host treats them as not implemented."""
        return ()

    def check_args(self, run: RunInfo) -> None:
        """Raise `trl_credit.ConfigError` (``ConfigError.for_key``) for settings this plugin cannot run with."""

    def refill(self) -> Refill | None:
        """A `Refill` when this plugin's filter wants dropped groups replaced by newly drawn ones."""
        return None

    def adapters(self) -> Sequence[Adapter]:
        """Auxiliary LoRA adapters this configuration owns (`trl_credit.Adapter`); they need a PEFT policy."""
        return ()

    def needs_reference(self) -> bool:
        """True when this configuration reads the reference model (``ref_logps``, ``model="reference"``): the host
        then refuses, before the model loads, a run that has none (no PEFT adapter and ``beta == 0``)."""
        return False

    def adapter(self, name: str) -> AdapterHandle:
        """The handle of the declared adapter ``name``: ``.logps(batch)``, ``.update(batch, loss_fn)``, ``model=``."""
        return adapter_handle(self, name)

    def state_dict(self) -> dict[str, Any] | None:
        """Plain data (tensors, numbers, strings, lists, dicts) to save with each checkpoint; None: none."""
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (called on resume, before the first step)."""
        raise NotImplementedError(f"{type(self).__name__} saves state but does not implement load_state_dict")

    def log_metric(self, batch: Any, name: str, value: float) -> None:
        """Log a scalar under ``trl_credit/<this plugin>/<name>`` (averaged over the logging window)."""
        batch.log_metric(name, value, plugin=self)


@dataclass(frozen=True)
class Members:
    """A plugin's optional members, read once (`members`)."""

    required_rewards: tuple[str, ...]
    required_columns: tuple[str, ...]
    disabled_hooks: tuple[str, ...]
    refill: Refill | None
    stateful: bool
    adapters: tuple[Adapter, ...] = ()
    needs_reference: bool = False
    required_turn_values: tuple[str, ...] = ()


def members(instance: Any) -> Members:
    """The optional members of a plugin instance, with the defaults for a plain class that lacks them."""
    def call(name: str, default: Any) -> Any:
        fn = getattr(instance, name, None)
        return fn() if callable(fn) else default

    refill = call("refill", None)
    if refill is not None and not isinstance(refill, Refill):
        raise TypeError(f"refill() must return trl_credit.Refill or None, got {type(refill).__name__}")
    state = getattr(type(instance), "state_dict", None)
    stateful = callable(state) and state is not Plugin.state_dict
    adapters = tuple(call("adapters", ()) or ())
    bad = [a for a in adapters if not isinstance(a, Adapter)]
    if bad:
        raise TypeError(f"adapters() must return trl_credit.Adapter items, got {type(bad[0]).__name__}")
    names = [a.name for a in adapters]
    if len(set(names)) != len(names):
        raise ValueError(f"adapters() declares the same name twice: {names}")
    return Members(tuple(call("required_rewards", ()) or ()), tuple(call("required_columns", ()) or ()),
                   tuple(call("disabled_hooks", ()) or ()), refill, stateful, adapters, bool(call("needs_reference", False)),
                   tuple(call("required_turn_values", ()) or ()))


def adapter_handle(instance: Any, name: str) -> AdapterHandle:
    """The `AdapterHandle` of ``instance``'s declared adapter ``name`` (works for plain classes too)."""
    key = getattr(instance, "trl_credit_key", None)
    if key is None:
        raise RuntimeError(f"{type(instance).__name__}.adapter({name!r}): the plugin is not enabled (no key yet)")
    fn = getattr(instance, "adapters", None)
    declared = [a.name for a in (fn() if callable(fn) else ())]
    if name not in declared:
        raise KeyError(f"{key} has no adapter {name!r}; adapters() declares {declared or 'none'}")
    return AdapterHandle(key, name)


def near_misses(cls: type) -> list[str]:
    """Public methods of ``cls`` that look like a hook or a member but are not one (with did-you-mean)."""
    marker = f"{PROJECT}_impl"
    known = set(HOOKS) | set(MEMBERS)
    base = set(dir(Plugin))
    problems = []
    for name in sorted(dir(cls)):
        if name.startswith("_") or name in base - set(HOOKS):
            continue
        attr = getattr(cls, name, None)
        if not callable(attr) or isinstance(attr, type):
            continue
        marked = hasattr(attr, marker)
        if name in HOOKS and not marked:
            problems.append(f"method '{name}' is named like a hook but is not marked @trl_credit.hookimpl; "
                            "mark it or rename it")
        elif name not in known and not marked:
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.85)
            if close:
                what = "hook" if close[0] in HOOKS else "plugin member"
                problems.append(f"method '{name}' is not a hook or plugin member; did you mean the {what} "
                                f"'{close[0]}'? (rename it, or make it private with a leading underscore)")
    return problems
