"""What the host adds to a checkpoint: ``trl_credit_state.pt``, plain data that loads without running code.

The file holds ``{"format": 1, "plugins": {key: state}, "prompt_stats": {...}, "refill_batches_drawn": n}``
and, when plugins own auxiliary adapters, ``"adapters": {kind: {"weights", "optimizer", "updates"}}``.
It is written with ``torch.save`` and read with ``torch.load(weights_only=True)``: only tensors, numbers,
strings, booleans, None, lists, tuples and dicts can be in it, so a crafted file cannot run code. A plugin
whose ``state_dict()`` holds anything else is refused when the checkpoint is saved, naming the plugin
and the path to the offending value. The file is written (atomically: a temporary file renamed into
place) before transformers writes the checkpoint's own files, so a checkpoint that has a model and a
trainer state always has the host's state too.
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["FORMAT", "STATE_FILE", "CheckpointError", "check_plain", "read_state", "write_state"]

STATE_FILE = "trl_credit_state.pt"
FORMAT = 1
_SCALARS = (bool, int, float, str, type(None))


class CheckpointError(RuntimeError):
    """The host's checkpoint state cannot be written or read; the message names the plugin and the file."""


def check_plain(value: Any, where: str) -> None:
    """Raise `TypeError` naming ``where`` (a path such as ``state['table'][3]``) unless ``value`` is plain data."""
    if isinstance(value, _SCALARS) or isinstance(value, torch.Tensor):
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_plain(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, _SCALARS):
                raise TypeError(f"{where} has a key of type {type(key).__name__}; keys must be strings or numbers")
            check_plain(item, f"{where}[{key!r}]")
        return
    raise TypeError(f"{where} is a {type(value).__module__}.{type(value).__qualname__}; checkpoint state may hold "
                    "only tensors, numbers, strings, booleans, None, lists and dicts")


def write_state(folder: str, plugins: dict[str, Any], prompt_stats: dict[str, Any], refill_batches_drawn: int,
                adapters: dict[str, Any] | None = None) -> str:
    """Write ``folder/trl_credit_state.pt`` atomically; raises `CheckpointError` for a plugin state that is not plain."""
    for key, state in plugins.items():
        try:
            check_plain(state, "state_dict()")
        except TypeError as exc:
            raise CheckpointError(f"plugin '{key}' cannot be checkpointed: its {exc}. Return plain data from "
                                  "state_dict() (convert sets, numpy arrays and objects to lists and dicts)") from None
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, STATE_FILE)
    tmp = f"{path}.tmp-{os.getpid()}"
    state = {"format": FORMAT, "plugins": plugins, "prompt_stats": prompt_stats,
             "refill_batches_drawn": int(refill_batches_drawn)}
    if adapters:
        check_plain(adapters, "adapters")
        state["adapters"] = adapters
    torch.save(state, tmp)
    os.replace(tmp, path)
    return path


def read_state(checkpoint: str, stateful: list[str], adapters: bool = False) -> dict[str, Any] | None:
    """The host state of ``checkpoint`` (None when the run had no plugins then and none is stateful now).

    Raises `CheckpointError` naming the file when it is missing while ``stateful`` plugins are enabled,
    cannot be read (truncated, not a torch file), holds anything but plain data, or lacks the state of
    one of the ``stateful`` plugin keys. ``adapters``: the run has auxiliary adapters (the file must exist).
    """
    path = os.path.join(checkpoint, STATE_FILE)
    if not os.path.exists(path):
        if adapters:
            raise CheckpointError(f"{path} is missing, but this run's plugins train auxiliary adapters whose "
                                  "weights it holds: resume from a checkpoint written by trl-credit with these plugins")
        if stateful:
            raise CheckpointError(f"{path} is missing, but plugin(s) {', '.join(stateful)} keep state across "
                                  "checkpoints: resume from a checkpoint written by trl-credit with these plugins, or "
                                  "start a new run")
        return None
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # truncated, not a torch file, or a pickle that would run code
        raise CheckpointError(f"cannot read {path} ({type(exc).__name__}: {str(exc).splitlines()[0][:300]}); it is "
                              "loaded as plain data only (weights_only=True) and nothing in it is run") from None
    if not isinstance(state, dict) or "plugins" not in state or "prompt_stats" not in state:
        raise CheckpointError(f"{path} is not a trl-credit state file (keys: "
                              f"{sorted(state) if isinstance(state, dict) else type(state).__name__})")
    missing = [key for key in stateful if key not in state["plugins"]]
    if missing:
        raise CheckpointError(f"{path} holds no state for plugin(s) {', '.join(missing)} (it has: "
                              f"{', '.join(state['plugins']) or 'none'}): the checkpoint was written with other "
                              "plugins; resume with the same plugins: list or start a new run")
    return state
