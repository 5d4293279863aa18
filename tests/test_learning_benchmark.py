"""benchmarks/learning.py --quick (tiny model, 2 steps, 1 seed, 2 plugins) and benchmarks/gpu_qlora.py on CPU.

Only that the scripts run end to end and write every promised output; no learning is asserted (a
tiny random model gets no reward in two steps).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"trl_credit_bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("learning")
    doc = out / "results.md.in"
    doc.write_text("# Results\n\nbefore\n<!-- learning-results:begin -->\nold table\n"
                   "<!-- learning-results:end -->\nafter\n")
    report = _load("learning").main(["--quick", "--out", str(out / "run"), "--docs", str(doc)])
    return out, report, doc


def test_quick_writes_results_json(quick):
    out, report, _ = quick
    on_disk = json.loads((out / "run" / "results.json").read_text())
    assert on_disk["seeds"] == [0] and on_disk["settings"]["steps"] == 2
    variants = on_disk["variants"]
    plugins = [v for v in variants.values() if v["plugin"] is not None]
    assert len(plugins) == 2 and "grpo" in variants and variants["grpo"]["plugin"] is None
    for row in variants.values():
        assert row["seeds"] == [0]
        assert 0.0 <= row["heldout_before"] <= 1.0 and row["heldout_before"] == on_disk["base"]["heldout"]
        assert 0.0 <= row["heldout_after"]["mean"] <= 1.0 and row["heldout_after"]["std"] == 0.0
        assert row["generated_tokens"]["mean"] > 0 and row["seconds_per_step"]["mean"] > 0
    for row in plugins:
        assert row["baseline"] == "grpo" and row["delta_vs_baseline"]["n"] == 1
        assert row["delta_vs_baseline"]["mean"] == pytest.approx(row["heldout_after"]["mean"]
                                                                 - variants["grpo"]["heldout_after"]["mean"])
    # equal budget: the same steps and the same completions per step everywhere
    runs = [run for label_runs in on_disk["runs"].values() for run in label_runs]
    assert {run["steps"] for run in runs} == {2} and len({run["token_budget"] for run in runs}) == 1
    assert report["variants"].keys() == variants.keys()


def test_quick_writes_png_table_and_run_dirs(quick):
    out, report, doc = quick
    assert (out / "run" / "reward_curves.png").read_bytes()[:8] == PNG_MAGIC
    table = (out / "run" / "results.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| run ")]
    assert len(rows) == len(report["variants"]) == 3
    assert {row.split("|")[1].strip() for row in rows} == set(report["variants"])
    assert all(" ± " in row for row in rows)
    for label in report["variants"]:
        folder = out / "run" / "runs" / label / "seed0"
        assert (folder / "adapter_model.safetensors").exists() and (folder / "trl_credit_config.yaml").exists()
        assert json.loads((folder / "eval_test.json").read_text())["evaluated"] == "adapter"
    # the docs section between the markers was replaced, the rest kept; the figure copied beside it
    text = doc.read_text()
    assert "old table" not in text and text.startswith("# Results\n\nbefore\n") and text.endswith("after\n")
    assert "| grpo | baseline |" in text and (doc.parent / "img" / "learning_reward_curves.png").exists()


def test_quick_is_resumable(quick, capsys):
    out, report, _ = quick
    again = _load("learning").main(["--quick", "--out", str(out / "run"), "--docs", ""])
    printed = capsys.readouterr().out
    assert printed.count("done already") == 3 and "training" not in printed
    assert again["variants"] == json.loads(json.dumps(report["variants"]))


def test_presets_and_seeds():
    learning = _load("learning")
    assert learning.parse_seeds("3") == [0, 1, 2] and learning.parse_seeds("0,4") == [0, 4]
    assert learning.Variant("gdpo", "gdpo", {}, [learning.ACC, learning.PROCESS]).baseline == "grpo+steps"
    from trl_credit.app.rewards import known_reward_names

    assert learning.PROCESS in known_reward_names()  # the process-score stand-in is a built-in reward
    # trainer keys a plugin needs go into its config and its baseline's (a separate, paired baseline)
    drpo = learning.Variant("drpo", "drpo", {}, [learning.ACC], "", {"loss_type": "grpo"})
    assert drpo.baseline == "grpo@loss_type=grpo"
    settings = learning.Settings()
    assert learning.run_config(settings, drpo, 0, "out")["loss_type"] == "grpo"
    plain = learning.Variant("grpo", None, {}, [learning.ACC])
    assert "loss_type" not in learning.run_config(settings, plain, 0, "out")
    assert learning.fingerprint(settings, plain, 0) != learning.fingerprint(settings, drpo, 0)


def test_list_reports_what_does_not_apply(tmp_path):
    learning = _load("learning")
    plan = learning.main(["--quick", "--list", "--out", str(tmp_path), "--plugins", "gdpo,no_such_plugin"])
    labels = [v["label"] for v in plan["variants"]]
    if "gdpo" in labels:  # installed: it runs against the baseline with the same two reward columns
        assert labels == ["grpo", "grpo+steps", "gdpo"]
    assert "not installed" in plan["not_run"]["no_such_plugin"]


def test_gpu_qlora_cpu_smoke(tmp_path):
    gpu = _load("gpu_qlora")
    report = gpu.main(["--cpu-smoke", "--json", str(tmp_path / "gpu.json")])
    on_disk = json.loads((tmp_path / "gpu.json").read_text())
    assert on_disk["device"] == "cpu" and on_disk["model"]["num_hidden_layers"] == 1
    names = [r["name"] for r in on_disk["runs"]]
    assert names[0] == "vanilla" and len(names) >= 2
    for run in on_disk["runs"]:
        assert run["steps_timed"] >= 1 and run["tokens_per_second"] > 0 and run["completion_tokens_per_step"] > 0
        # EOS disabled: every completion has exactly max_completion_length tokens
        assert run["mean_completion_length"] == on_disk["settings"]["max_completion_length"]
    assert report["runs"][0]["peak_gpu_memory_gib"] is None  # no GPU here


def test_docs_results_has_the_markers():
    learning = _load("learning")
    text = (BENCHMARKS.parent / "docs" / "results.md").read_text()
    assert text.count(learning.BEGIN) == 1 and text.count(learning.END) == 1
    assert text.index(learning.BEGIN) < text.index(learning.END)


def test_jobs_run_side_by_side_and_report_only_reads_them_back(tmp_path):
    """--jobs 2 (worker processes; a subprocess, as spawn needs the script as __main__) gives the same
    table shape as one job; --report-only then trains nothing and reports the finished runs, naming
    the missing ones."""
    import os
    import subprocess

    out = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(BENCHMARKS / "learning.py"), "--quick", "--jobs", "2", "--plugins",
                           "dynamic_sampling", "--out", str(out)], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "results.json").read_text())
    labels = list(report["variants"])
    if "dynamic_sampling" not in labels:
        pytest.skip("dynamic_sampling is not installed")
    assert labels == ["grpo", "dynamic_sampling"]
    for label in labels:
        assert (out / "runs" / label / "seed0" / "adapter_model.safetensors").exists()
        assert report["variants"][label]["seeds"] == [0]
    assert done.stdout.count("training 2 steps") == 2

    learning = _load("learning")
    again = learning.main(["--quick", "--report-only", "--seeds", "0,1", "--plugins", "dynamic_sampling",
                           "--out", str(out), "--docs", ""])  # fmt: skip
    assert not (out / "runs" / "grpo" / "seed1").exists()  # nothing trained
    for label in labels:
        assert again["variants"][label]["seeds"] == [0]
        assert again["variants"][label]["heldout_after"] == report["variants"][label]["heldout_after"]
    assert again["seeds"] == [0, 1] and again["missing"] == [f"{label}/seed1" for label in labels]
    assert "**Partial:** 2 planned runs" in (out / "results.md").read_text()


def test_a_failing_run_is_reported_not_fatal(tmp_path, monkeypatch):
    learning = _load("learning")
    real = learning.run_one

    def flaky(settings, variant, seed, out, log):
        if variant.label == "dynamic_sampling":
            raise ValueError("boom\nsecond line")
        return real(settings, variant, seed, out, log)

    monkeypatch.setattr(learning, "run_one", flaky)
    report = learning.main(["--quick", "--plugins", "dynamic_sampling", "--out", str(tmp_path), "--docs", ""])
    if "dynamic_sampling" not in report["variants"]:
        pytest.skip("dynamic_sampling is not installed")
    assert report["missing"] == ["dynamic_sampling/seed0 (failed: ValueError: boom)"]
    assert report["variants"]["dynamic_sampling"]["seeds"] == [] and report["variants"]["grpo"]["seeds"] == [0]
    table = (tmp_path / "results.md").read_text()
    assert "**Partial:** 1 planned runs are missing" in table and "ValueError: boom" in table
