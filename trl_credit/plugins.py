"""Plugin discovery and registration; nothing else lives here.

1. the manager and the hookspecs, 2. entry points of group ``trl_credit`` (name = YAML handle,
value = plugin class; skipped when ``TRL_CREDIT_NO_ENTRY_POINTS=1``), 3. the built-ins.
Installed is not enabled: an entry point is imported only when a config names it (or a listing asks).
"""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass
from typing import Any

import pluggy

from trl_credit import hookspecs

ENTRY_POINT_GROUP = "trl_credit"
BUILTIN_PATHS = {"grpo": "trl_credit.builtin:GRPOAdvantage"}


@dataclass(frozen=True)
class Available:
    """An installed plugin, before import."""

    name: str
    value: str  # "module:Class"
    distribution: str | None
    version: str | None
    builtin: bool = False

    def load(self) -> type:
        module_name, _, attr = self.value.partition(":")
        module = importlib.import_module(module_name)
        obj: Any = module
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj


def _entry_points() -> list[Available]:
    if os.environ.get("TRL_CREDIT_NO_ENTRY_POINTS") == "1":
        return []
    out = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        out.append(Available(ep.name, ep.value, dist.name if dist else None, dist.version if dist else None))
    return out


def available(include_builtins: bool = True) -> dict[str, Available]:
    """Installed plugins by YAML name (a built-in name cannot be shadowed; see `entry_point_problems`)."""
    found: dict[str, Available] = {}
    for info in _entry_points():
        found.setdefault(info.name, info)
    if include_builtins:
        version = _host_version()
        for name, value in BUILTIN_PATHS.items():
            found[name] = Available(name, value, "trl-credit", version, builtin=True)
    return found


def entry_point_problems() -> dict[str, str]:
    """``{name: problem}`` for plugin names that two installed distributions claim, or that shadow a built-in."""
    by_name: dict[str, list[Available]] = {}
    for info in _entry_points():
        by_name.setdefault(info.name, []).append(info)
    problems = {}
    for name, infos in by_name.items():
        claims = sorted({f"{i.distribution or '?'} ({i.value})" for i in infos})
        if name in BUILTIN_PATHS:
            problems[name] = (f"the entry point '{name}' of {', '.join(claims)} has the name of a built-in plugin; the "
                              f"built-in is used and the entry point is ignored: rename it in that package")
        elif len(claims) > 1:
            problems[name] = (f"two installed distributions name a plugin '{name}': {' and '.join(claims)}; "
                              "uninstall one of them (pip uninstall ...)")
    return problems


def _host_version() -> str | None:
    try:
        return importlib.metadata.version("trl-credit")
    except importlib.metadata.PackageNotFoundError:
        return None


def new_manager() -> pluggy.PluginManager:
    manager = pluggy.PluginManager(hookspecs.PROJECT)
    manager.add_hookspecs(hookspecs)
    return manager


def implemented_hooks(plugin_class: type) -> list[str]:
    """Names of the methods of ``plugin_class`` marked with ``@hookimpl``, in pipeline order first."""
    marker = f"{hookspecs.PROJECT}_impl"
    names = [n for n in dir(plugin_class) if hasattr(getattr(plugin_class, n, None), marker)]
    known = [h for h in hookspecs.HOOKS if h in names]
    return known + sorted(set(names) - set(known))
