"""The ``plugins:`` list: parsing, typed validation and the errors users read.

Every problem is collected (``trl-credit validate`` prints them all) and raised as one
`ConfigError` before any model is loaded. Messages name the item, the plugin and the key, and say
how to fix it: ``plugins[1] (accuracy_band): option 'low': Input should be a valid number``.
"""

from __future__ import annotations

import difflib
import re
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ConfigError", "EnabledPlugin", "PluginSet", "build_plugins", "check_run", "enable", "instantiate",
           "option_names", "plugin_name"]

import pluggy
from pydantic import BaseModel, ConfigDict, ValidationError

from trl_credit import hookspecs
from trl_credit.plugin import Members, PluginInfo, RunInfo, members, near_misses
from trl_credit.plugins import Available, available, entry_point_problems, implemented_hooks, new_manager


class ConfigError(ValueError):
    """One or more configuration problems, each a line."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(f"- {p}" for p in self.problems))

    @classmethod
    def for_key(cls, key: str, problem: str, fix: str) -> ConfigError:
        """The error a plugin's ``check_args`` raises: the config key at fault, what is wrong, how to fix it.

        The host prefixes the plugin: ``plugins[0] (drpo): loss_type: ... ; fix: set `loss_type: grpo```.
        """
        return cls([f"{key}: {problem}; fix: {fix}"])


class EmptyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")


@dataclass
class EnabledPlugin:
    """A plugin named in the config: its class, validated config and instance."""

    index: int
    name: str
    key: str  # unique: the name, or name#2 for a second copy
    instance: Any
    hooks: list[str]
    info: Available | None = None
    members: Members | None = None  # read from the instance when not given

    def __post_init__(self) -> None:
        if self.members is None:
            self.members = members(self.instance)
        self.instance.trl_credit_key = self.key  # the owner of the metrics it logs (`RolloutBatch.log_metric`)

    @property
    def config(self) -> BaseModel:
        return getattr(self.instance, "config", EmptyConfig())


@dataclass
class PluginSet:
    """The enabled plugins in config order and the pluggy manager they are registered with."""

    plugins: list[EnabledPlugin] = field(default_factory=list)
    manager: pluggy.PluginManager | None = None

    def with_hook(self, hook: str) -> list[EnabledPlugin]:
        return [p for p in self.plugins if hook in p.hooks]

    def infos(self) -> tuple[PluginInfo, ...]:
        return tuple(PluginInfo(p.index, p.key, tuple(p.hooks), p.members.refill) for p in self.plugins)

    @property
    def names(self) -> list[str]:
        return [p.key for p in self.plugins]

    def adapters(self) -> dict[str, Any]:
        """Every declared auxiliary adapter: ``adapter:<plugin key>/<name>`` -> `trl_credit.Adapter`."""
        from trl_credit.adapters import adapter_kind

        return {adapter_kind(p.key, a.name): a for p in self.plugins for a in p.members.adapters}


def normalize_items(raw: Any) -> list[tuple[str, dict[str, Any]]]:
    """``plugins:`` as a list of (name, options); raises `ConfigError` on a malformed list.

    An item is a name, ``{name: ..., <options>}``, ``{<name>: {<options>}}`` or, from Python, a
    plugin class (optionally as ``{"name": cls, <options>}``).
    """
    if raw is None:
        return []
    if isinstance(raw, (str, dict, type)):
        raw = [raw]
    if not isinstance(raw, (list, tuple)):
        raise ConfigError([f"plugins: expected a list of names or {{name: ..., <options>}} items, got {type(raw).__name__}"])
    items, problems = [], []
    for i, item in enumerate(raw):
        if isinstance(item, (str, type)):
            items.append((item, {}))
        elif isinstance(item, dict) and isinstance(item.get("name"), (str, type)):
            options = {k: v for k, v in item.items() if k != "name"}
            items.append((item["name"], options))
        elif isinstance(item, dict) and len(item) == 1 and isinstance(next(iter(item.values())), (dict, type(None))):
            (name, options), = item.items()  # mkdocs style: - accuracy_band: {low: 0.2}
            items.append((str(name), dict(options or {})))
        else:
            problems.append(f"plugins[{i}]: expected a name or a mapping with a 'name' key, got {item!r}")
    if problems:
        raise ConfigError(problems)
    return items


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name.lstrip("_")).lower()


def unknown_plugin_message(index: int, name: str, installed: dict[str, Available]) -> str:
    public = sorted(n for n, a in installed.items() if not a.builtin)
    close = difflib.get_close_matches(name, list(installed), n=1, cutoff=0.6)
    alt = difflib.get_close_matches(name.replace("_", "-"), [n.replace("_", "-") for n in installed], n=1)
    suggestion = close[0] if close else (alt[0].replace("-", "_") if alt else None)
    installed_list = f"Installed: {', '.join(public) if public else 'none'}."
    if suggestion:
        return f"plugins[{index}] ({name}): no plugin named '{name}' is installed. Did you mean '{suggestion}'? {installed_list}"
    return (
        f"plugins[{index}] ({name}): no plugin named '{name}' is installed. {installed_list} "
        f"Install it with `trl-credit install {name}` (or `pip install trl-credit-{name.replace('_', '-')}`)."
    )


def option_names(config_cls: type[BaseModel]) -> dict[str, str]:
    """``{YAML key: field name}``: a field with an alias (``lambda_`` for ``lambda``) goes by its alias."""
    return {(f.alias or n): n for n, f in config_cls.model_fields.items()}


def _option_errors(index: int, name: str, error: ValidationError, config_cls: type[BaseModel]) -> list[str]:
    out = []
    keys = sorted(option_names(config_cls))
    for e in error.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<options>"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            close = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'? " if close else ""
            msg = (f"unknown option; {hint}options: {', '.join(keys) or 'none'} "
                   f"(`trl-credit plugins show {name}` describes them)")
        out.append(f"plugins[{index}] ({name}): option '{key}': {msg}")
    return out


def build_plugins(raw: Any, installed: dict[str, Available] | None = None) -> PluginSet:
    """Validate ``plugins:`` and instantiate every enabled plugin (imports only the enabled ones).

    Raises `ConfigError` listing every problem: malformed items, unknown plugins, import
    failures (with traceback), unknown or ill-typed options, hooks not in the spec, and two
    advantage estimators.
    """
    items = normalize_items(raw)
    clashes = entry_point_problems() if installed is None else {}
    installed = available() if installed is None else installed
    problems: list[str] = []
    enabled: list[EnabledPlugin] = []
    counts: dict[str, int] = {}
    manager = new_manager()
    for index, (name, options) in enumerate(items):
        if isinstance(name, type):  # a class passed in Python: used as is, nothing to discover
            cls, info = name, None
            name = plugin_name(cls)
        else:
            info = installed.get(name)
            if info is None:
                problems.append(unknown_plugin_message(index, name, installed))
                continue
            if name in clashes and not info.builtin:
                problems.append(f"plugins[{index}] ({name}): {clashes[name]}")
                continue
            if name in clashes:
                warnings.warn(f"plugins[{index}] ({name}): {clashes[name]}", stacklevel=2)
            try:
                cls = info.load()
            except Exception:  # an enabled plugin that cannot be imported must say why
                problems.append(
                    f"plugins[{index}] ({name}): importing {info.value} from "
                    f"{info.distribution or 'unknown distribution'} failed:\n{traceback.format_exc()}"
                )
                continue
        counts[name] = counts.get(name, 0) + 1
        key = name if counts[name] == 1 else f"{name}#{counts[name]}"
        plugin, errs = enable(cls, options, index, name, key, manager, info)
        problems += errs
        if plugin is not None:
            enabled.append(plugin)
    estimators = [p for p in enabled if "compute_advantages" in p.hooks]
    if len(estimators) > 1:
        listed = ", ".join(f"plugins[{p.index}] ({p.name})" for p in estimators)
        problems.append(
            f"two advantage estimators are enabled: {listed}. Exactly one plugin may implement "
            "compute_advantages; remove all but one (advantage transforms can be chained instead)."
        )
    kl = [p for p in enabled if "kl_coefficient" in p.hooks]
    if len(kl) > 1:
        listed = ", ".join(f"plugins[{p.index}] ({p.name})" for p in kl)
        problems.append(
            f"two plugins set the KL coefficient: {listed}. At most one plugin may implement "
            "kl_coefficient; remove all but one (or switch that part off in its options)."
        )
    if problems:
        raise ConfigError(problems)
    return PluginSet(enabled, manager)


def enable(cls: type, options: dict[str, Any], index: int, name: str, key: str, manager: pluggy.PluginManager,
           info: Available | None = None, instance: Any = None) -> tuple[EnabledPlugin | None, list[str]]:
    """Check, build (unless ``instance`` is given) and register one plugin under ``key``; (plugin, problems).

    The checks: no near-miss member names, valid options, hooks in the spec, its declared members,
    at least one active hook, refill only with a filter.
    """
    misses = near_misses(cls)
    if misses:
        return None, [f"plugins[{index}] ({name}): {m}" for m in misses]
    if instance is None:
        instance, problems = instantiate(cls, options, index, name)
        if instance is None:
            return None, problems
    try:
        manager.register(instance, name=key)
        manager.check_pending()
    except pluggy.PluginValidationError as exc:
        if manager.is_registered(instance):
            manager.unregister(instance)
        return None, [f"plugins[{index}] ({name}): {exc}. Hooks a plugin may implement: {', '.join(hookspecs.HOOKS)} "
                      "(see `trl-credit plugins show grpo` or docs/hooks.md for their arguments)"]
    try:
        declared = members(instance)
    except Exception as exc:  # a member that raises or returns the wrong type
        return None, [f"plugins[{index}] ({name}): {type(exc).__name__}: {exc}"]
    hooks, problems = active_hooks(instance, implemented_hooks(cls), index, name, declared)
    if problems:
        return None, problems
    if not hooks:
        problems.append(f"plugins[{index}] ({name}): {cls.__name__} implements no hook; mark methods with "
                        "`@trl_credit.hookimpl` (see `trl-credit plugins show`)")
    if declared.refill is not None and "filter_rollouts" not in hooks:
        problems.append(f"plugins[{index}] ({name}): refill() asks for refill, but the plugin has no "
                        "active filter_rollouts hook; refill replaces the groups a filter drops")
    return EnabledPlugin(index, name, key, instance, hooks, info, declared), problems


def active_hooks(instance: Any, hooks: list[str], index: int = 0, name: str = "?",
                 declared: Members | None = None) -> tuple[list[str], list[str]]:
    """``hooks`` minus those the plugin's options switch off (its ``disabled_hooks()``), and problems."""
    off = set((declared or members(instance)).disabled_hooks)
    if not off:
        return hooks, []
    problems = []
    unknown = sorted(off - set(hooks))
    if unknown:
        problems.append(f"plugins[{index}] ({name}): disabled_hooks() names hooks it does not implement: "
                        f"{', '.join(unknown)}")
    kept = [h for h in hooks if h not in off]
    if hooks and not kept:
        problems.append(f"plugins[{index}] ({name}): its options switch every hook off; "
                        "enable a part of it or remove it from plugins:")
    return kept, problems


def check_reference(plugins: PluginSet, beta: float, peft: bool) -> None:
    """A ``kl_coefficient`` plugin, or one whose ``needs_reference()`` is True, needs the reference model:
    ``beta > 0`` (TRL keeps a reference) or PEFT (the base model with adapters off)."""
    if beta != 0.0 or peft:
        return
    problems = [
        f"plugins[{p.index}] ({p.name}) sets the KL coefficient, but this run has no reference model: "
        "set `beta` > 0 in the config (TRL then keeps a reference copy; the plugin replaces the value "
        "per batch) or train a PEFT adapter (`use_peft: true`; the reference is the base model)"
        for p in plugins.with_hook("kl_coefficient")]
    problems += [
        f"plugins[{p.index}] ({p.name}) reads the reference model with these options, but this run has none (no "
        "PEFT adapter, beta 0): train a PEFT adapter (`use_peft: true`; the reference is the base model with "
        "adapters off), set `beta` > 0 (TRL keeps a frozen copy), or choose the plugin's policy option"
        for p in plugins.plugins if p.members.needs_reference and "kl_coefficient" not in p.hooks]
    if problems:
        raise ConfigError(problems)


def _adapter_problems(plugins: PluginSet, peft: bool) -> list[str]:
    """Auxiliary adapters are LoRA adapters on the policy's base model: they need a PEFT policy; saved ones a usable path."""
    paths = [f"plugins[{p.index}] ({p.name}): {problem}; fix: point the plugin's path option at a saved PEFT adapter "
             "folder (adapter_config.json + adapter_model.safetensors)"
             for p in plugins.plugins for a in p.members.adapters if (problem := a.check_path())]
    if peft:
        return paths
    return paths + [f"plugins[{p.index}] ({p.name}) owns the auxiliary adapter(s) "
            f"{', '.join(repr(a.name) for a in p.members.adapters)}, LoRA adapters on the policy's base model, but "
            "the policy is not a PEFT adapter: set `use_peft: true` in the config (`peft_config=LoraConfig(...)` "
            "in Python), optionally with `load_in_4bit: true` for QLoRA"
            for p in plugins.plugins if p.members.adapters]


def instantiate(cls: type, options: dict[str, Any], index: int = 0, name: str = "?") -> tuple[Any, list[str]]:
    """Validate ``options`` against ``cls.Config`` and build the plugin; returns (instance, problems)."""
    config_cls = getattr(cls, "Config", None)
    if config_cls is None:
        if options:
            return None, [f"plugins[{index}] ({name}): option '{next(iter(options))}': this plugin takes no options"]
        return cls(), []
    if not (isinstance(config_cls, type) and issubclass(config_cls, BaseModel)):
        return None, [f"plugins[{index}] ({name}): {cls.__name__}.Config must be a pydantic BaseModel"]
    if config_cls.model_config.get("extra") != "forbid":
        return None, [
            f"plugins[{index}] ({name}): {cls.__name__}.Config must set model_config = ConfigDict(extra='forbid') "
            "so that misspelled options are reported"
        ]
    try:
        config = config_cls(**options)
    except ValidationError as exc:
        return None, _option_errors(index, name, exc, config_cls)
    try:
        return cls(config), []
    except Exception:
        return None, [f"plugins[{index}] ({name}): creating the plugin failed:\n{traceback.format_exc()}"]


def _missing(plugins: PluginSet, member: str, present: list[str], describe) -> list[str]:
    """A problem for every name a plugin's ``member()`` needs that is not in ``present``."""
    return [f"plugins[{p.index}] ({p.name}): {describe(name)}" for p in plugins.plugins
            for name in getattr(p.members, member) if name not in present]


def _raise(problems: list[str]) -> None:
    if problems:
        raise ConfigError(problems)


def check_columns(plugins: PluginSet, columns: list[str]) -> None:
    """Raise `ConfigError` when a plugin needs (``required_columns()``) a dataset column the training set lacks."""
    _raise(_column_problems(plugins, columns))


def _column_problems(plugins: PluginSet, columns: list[str]) -> list[str]:
    return _missing(plugins, "required_columns", columns,
                    lambda col: f"needs dataset column '{col}', which the training dataset lacks (columns: "
                                f"{', '.join(columns)}); add it or set the plugin's column option")


def reward_names(reward_funcs: list) -> list[str]:
    """The column names TRL gives reward functions (``__name__``) and reward models (last path part)."""
    names = []
    for func in reward_funcs:
        if isinstance(func, str):
            names.append(func.rstrip("/").split("/")[-1])
        elif hasattr(func, "config") and hasattr(func.config, "_name_or_path"):
            names.append(func.config._name_or_path.split("/")[-1])
        else:
            names.append(getattr(func, "__name__", type(func).__name__))
    return names


def plugin_name(cls: type) -> str:
    """The handle a class goes by: its ``name`` attribute, the entry point naming it, or snake_case."""
    explicit = getattr(cls, "name", None)
    if isinstance(explicit, str):
        return explicit
    target = f"{cls.__module__}:{cls.__qualname__}"
    for handle, info in available().items():
        if info.value == target:
            return handle
    return _snake(cls.__name__)


def check_reward_columns(plugins: PluginSet, reward_names: list[str]) -> None:
    """Raise `ConfigError` when a plugin needs (``required_rewards()``) a reward column no reward function produces."""
    _raise(_reward_problems(plugins, reward_names))


def _reward_problems(plugins: PluginSet, reward_names: list[str]) -> list[str]:
    return _missing(plugins, "required_rewards", reward_names,
                    lambda col: f"needs reward column '{col}', but the reward functions are {reward_names}; add "
                                "it to reward_funcs or point the plugin's option at one of these")


#: TRL 1.16's loss types and reward scalings (values GRPOConfig accepts but GRPOTrainer rejects or misreads later)
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
SCALE_REWARDS = ("group", "batch", "none")


def trl_problems(args: Any, reward_names: list[str] | None) -> list[str]:
    """TRL settings that GRPOConfig accepts but the trainer rejects, misreads or fails on later."""
    import importlib.util
    import os

    problems = []

    def close(value: str, choices: tuple[str, ...]) -> str:
        match = difflib.get_close_matches(str(value), list(choices), n=1)
        return f"; did you mean '{match[0]}'?" if match else ""

    loss_type = getattr(args, "loss_type", "dapo")
    if loss_type not in LOSS_TYPES:
        problems.append(f"loss_type: {loss_type!r} is not a TRL 1.16 loss type ({', '.join(LOSS_TYPES)})"
                        + close(loss_type, LOSS_TYPES))
    scale = getattr(args, "scale_rewards", "group")
    scale = {True: "group", False: "none"}.get(scale, scale)
    if scale not in SCALE_REWARDS:
        problems.append(f"scale_rewards: {scale!r} must be one of {', '.join(SCALE_REWARDS)}" + close(scale, SCALE_REWARDS))
    temperature = getattr(args, "temperature", 1.0)
    if temperature is not None and not temperature > 0:
        problems.append(f"temperature: {temperature} must be > 0 (sampling divides the logits by it)")
    beta = getattr(args, "beta", 0.0)
    if beta is not None and beta < 0:
        problems.append(f"beta: {beta} must be >= 0 (the KL penalty's coefficient)")
    weights = getattr(args, "reward_weights", None)
    if weights is not None and reward_names is not None and len(weights) != len(reward_names):
        problems.append(f"reward_weights: {len(weights)} weight(s) for {len(reward_names)} reward function(s) "
                        f"({', '.join(reward_names)}); give one weight per reward function")
    if getattr(args, "use_vllm", False) and importlib.util.find_spec("vllm") is None:
        problems.append("use_vllm: true, but vLLM is not installed; `pip install vllm` (a GPU machine) or set "
                        "use_vllm: false")
    resume = getattr(args, "resume_from_checkpoint", None)
    if isinstance(resume, str) and resume.lower() not in ("true", "false") and not os.path.isdir(resume):
        problems.append(f"resume_from_checkpoint: {resume!r} is not a directory; give a checkpoint folder such as "
                        f"{os.path.join(getattr(args, 'output_dir', 'out') or 'out', 'checkpoint-500')}")
    return problems


def check_run(plugins: PluginSet, args: Any, reward_names: list[str] | None, columns: list[str] | None,
              peft: bool, rollout_fields: list[str] | None = None) -> RunInfo:
    """Every check a run needs before its model loads; raises one `ConfigError` listing all problems.

    TRL settings TRL itself rejects only later (`trl_problems`), reward columns (``required_rewards``),
    dataset columns (``required_columns``, when ``columns`` is known), per-turn columns
    (``required_turn_values``, when the rollout declares its ``rollout_fields``), the KL reference a
    ``kl_coefficient`` plugin needs, and each plugin's ``check_args`` on the resolved run. `trl-credit validate` and `CreditGRPOTrainer.__init__` both call it.
    """
    run = RunInfo(args=args, reward_names=tuple(reward_names or ()),
                  columns=tuple(columns) if columns is not None else None, peft=peft, plugins=plugins.infos())
    problems: list[str] = trl_problems(args, None if reward_names is None else list(reward_names))
    if reward_names is not None:
        problems += _reward_problems(plugins, list(reward_names))
    if columns is not None:
        problems += _column_problems(plugins, list(columns))
    if rollout_fields is not None:
        known = list(rollout_fields) + list(columns or [])
        problems += _missing(plugins, "required_turn_values", known,
                             lambda col: f"needs per-turn values '{col}', which the rollouts do not record (they "
                                         f"record: {', '.join(rollout_fields) or 'nothing'}); set the plugin's "
                                         "column option or record it")
    try:
        check_reference(plugins, getattr(args, "beta", 0.0), peft)
    except ConfigError as exc:
        problems += exc.problems
    problems += _adapter_problems(plugins, peft)
    for p in plugins.plugins:
        check = getattr(p.instance, "check_args", None)
        if not callable(check):
            continue
        try:
            check(run)
        except ConfigError as exc:
            problems += [f"plugins[{p.index}] ({p.name}): {problem}" for problem in exc.problems]
        except Exception:
            problems.append(f"plugins[{p.index}] ({p.name}): check_args raised:\n{traceback.format_exc()}")
    _raise(problems)
    return run
