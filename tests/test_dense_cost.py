"""benchmarks/dense_cost.py: the ratio it reports, its targets, the docs table, and one real (tiny) run."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "dense_cost.py"


def _load():
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("trl_credit_bench_dense_cost", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def step(gen, plugin_seconds, update):
    return {"trl_credit/cost/generation_seconds": gen, "trl_credit/prime/seconds": plugin_seconds,
            "trl_credit/cost/prime/prm_update_seconds": update}


def test_summary_is_the_median_ratio_after_the_warm_up_step():
    dense = _load()
    base = {"peak_bytes": 100 * 2 ** 20}
    run = {"plugin": "prime", "model": "tiny", "device": "cpu", "peak_bytes": 130 * 2 ** 20,
           "steps": [step(1.0, 9.0, 5.0), step(2.0, 2.0, 1.0), step(4.0, 2.0, 1.0), step(1.0, 1.5, 1.0)]}
    summary = dense.summarise(base, run)
    assert summary["added_x_generation"] == pytest.approx(1.0)  # median of 1.0, 0.5, 1.5 (step 1 left out)
    assert summary["parts_x_generation"] == {"prm_update_seconds": pytest.approx(0.5)}
    assert summary["target_x"] == 2.0 and summary["meets_target"] is True and summary["extra_peak_mib"] == 30.0


def test_a_pass_skipped_on_some_steps_counts_0_there_and_the_report_says_so(tmp_path):
    """GRPO-CARE scores under its EMA adapter only when a group has an accurate answer: its part is 0 on the other
    steps, so the part's median (over the same steps as the total) never exceeds the total's."""
    dense = _load()
    base = {"peak_bytes": 0}

    def care(gen, seconds, score):
        row = {"trl_credit/cost/generation_seconds": gen, "trl_credit/grpo_care/seconds": seconds}
        return row if score is None else {**row, "trl_credit/cost/grpo_care/ema_score_seconds": score}

    run = {"plugin": "grpo_care", "model": "embedded", "device": "cpu", "peak_bytes": 0,
           "steps": [care(1.0, 5.0, 4.0), care(10.0, 7.0, 6.6), care(10.0, 0.1, None), care(10.0, 0.1, None)]}
    summary = dense.summarise(base, run)
    # measured steps 2..4: totals 0.7, 0.01, 0.01 -> median 0.01; the part 0.66, 0, 0 -> 0 (before: 0.66 from step 2 alone)
    assert summary["added_x_generation"] == pytest.approx(0.01)
    assert summary["parts_x_generation"] == {"ema_score_seconds": pytest.approx(0.0)}
    assert summary["parts_steps"] == {"ema_score_seconds": 1} and summary["steps_measured"] == 3
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "e.json").write_text(json.dumps({"model": "embedded", "steps": 4, "threads": 2, "plugins": [summary]}))
    docs = tmp_path / "results.md"
    docs.write_text("# R\n")
    dense.report(folder, docs)
    assert "ema_score 0.00x (ran on 1 of 3 steps)" in docs.read_text()


def test_report_writes_the_generated_block(tmp_path):
    dense = _load()
    folder = tmp_path / "results"
    folder.mkdir()
    summary = {"model": "tiny", "steps": 3, "threads": 2, "plugins": [
        {"plugin": "prime", "model": "tiny", "device": "cpu", "added_x_generation": 0.65, "parts_x_generation":
         {"prm_update_seconds": 0.51}, "target_x": 2.0, "meets_target": True, "generation_seconds": 3.07,
         "extra_peak_mib": 35.1, "steps_measured": 2, "passes": "PRM step"}]}
    (folder / "tiny.json").write_text(json.dumps(summary))
    docs = tmp_path / "results.md"
    docs.write_text(f"# R\n\n{dense.BEGIN}\nold\n{dense.END}\n\ntail\n")
    dense.report(folder, docs)
    text = docs.read_text()
    assert "old" not in text and text.endswith("tail\n")
    assert "| `prime` | tiny (cpu, 2 threads) | PRM step | 0.65x | prm_update 0.51x | <= 2x: met | +35 MiB |" in text


def test_one_tiny_run_reports_generation_and_plugin_time(tmp_path):
    dense = _load()
    out = tmp_path / "json"
    assert dense.main(["--model", "tiny", "--plugins", "prime", "--steps", "2", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    row, = summary["plugins"]
    assert row["added_x_generation"] > 0 and row["generation_seconds"] > 0 and "prm_update_seconds" in row["parts_x_generation"]
