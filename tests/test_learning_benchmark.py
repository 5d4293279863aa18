"""benchmarks/learning.py --quick (tiny model, 2 steps, 1 seed, 2 plugins) and benchmarks/gpu_qlora.py on CPU.

The scripts run end to end and write every promised output; no learning is asserted (a tiny random
model gets no reward in two steps). The statistics (t-interval, AUC, steps and tokens to a target,
accuracy at a token budget) are checked on known values.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
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
    report = _load("learning").main(["--quick", "--out", str(out / "run"), "--docs", str(doc),
                                     "--plugins", "dynamic_sampling,balanced_aggregation",
                                     "--plugins", "dynamic_sampling,balanced_aggregation",
                                    "--combo", "dynamic_sampling,balanced_aggregation"])
    return out, report, doc


def test_quick_writes_results_json(quick):
    out, report, _ = quick
    on_disk = json.loads((out / "run" / "results.json").read_text())
    assert on_disk["seeds"] == [0] and on_disk["settings"]["steps"] == 2
    variants = on_disk["variants"]
    plugins = [v for v in variants.values() if v["baseline"] is not None]
    assert [v["label"] for v in plugins] == ["dynamic_sampling", "balanced_aggregation",
                                             "combo:dynamic_sampling+balanced_aggregation"]
    assert variants["grpo"]["plugins"] == [] and plugins[-1]["plugins"] == [{"name": "dynamic_sampling"},
                                                                              {"name": "balanced_aggregation"}]
    for row in variants.values():
        assert row["seeds"] == [0] and row["before"] == on_disk["bases"]["answer"]["heldout"]
        assert 0.0 <= row["final"]["mean"] <= 1.0 and row["final"]["std"] == 0.0 and row["final"]["ci95"] is None
        assert row["generated_tokens"]["mean"] > 0 and row["seconds_per_step"]["mean"] > 0
    for row in plugins:
        assert row["baseline"] == "grpo" and row["delta_final"]["n"] == 1 and row["paired_seeds"] == [0]
        assert row["delta_final"]["mean"] == pytest.approx(row["final"]["mean"] - variants["grpo"]["final"]["mean"])
        assert len(row["steps_to_target"]) == 1 and row["time_ratio"]["mean"] > 0
    for path in (out / "run" / "runs").glob("*/seed0.json"):  # one small JSON per run, the curve in it
        run = json.loads(path.read_text())
        assert [step for step, _ in run["curve"]] == [0, 1, 2] and len(run["tokens_per_step"]) == run["steps"] == 2
        assert run["generated_tokens"] == pytest.approx(sum(run["tokens_per_step"]), abs=0.2)
        # every plugin metric and the policy's entropy per step, for diagnosing a run afterwards
        assert [step for step, _ in run["series"]["entropy"]] == [1, 2]
        assert all(value >= 0 for _, value in run["series"]["entropy"])
        if path.parent.name == "dynamic_sampling":
            assert {"trl_credit/kept_fraction", "trl_credit/cost/generation_seconds"} <= run["series"].keys()
    assert report["variants"].keys() == variants.keys() and len(report["goals"]) == 1
    assert report["goals"][0]["baseline"] == "grpo" and report["goals"][0]["steps_total"] == 2
    # the combination's seed is followed by its control (the baseline rerun), and the goal's time reads it
    pair = "dynamic_sampling+balanced_aggregation"
    control = json.loads((out / "run" / "runs" / f"control_{pair}" / "seed0.json").read_text())
    combo = json.loads((out / "run" / "runs" / f"combo_{pair}" / "seed0.json").read_text())
    assert control["plugins"] == [] and control["label"] == f"control:{pair}"
    assert report["goals"][0]["time_against"] == f"control:{pair}" and report["goals"][0]["time_seeds"] == [0]
    assert report["goals"][0]["time_ratio"] == pytest.approx(_load("learning").time_ratio(combo, control))
    assert f"control:{pair}" not in report["variants"]  # not a row of the tables
    assert "**The combination goal**" in (out / "run" / "results.md").read_text()


def test_quick_writes_figures_tables_and_docs(quick):
    out, report, doc = quick
    for name in ("curves_by_step.png", "curves_by_tokens.png"):
        assert (out / "run" / name).read_bytes()[:8] == PNG_MAGIC
        assert (doc.parent / "img" / f"learning_{name}").read_bytes()[:8] == PNG_MAGIC
    table = (out / "run" / "results.md").read_text()
    main, _, goals = table.partition("**The combination goal**")
    rows = [line for line in main.splitlines() if line.startswith("| ") and not line.startswith(("| baseline ",
                                                                                                 "| plugin "))]
    assert {row.split("|")[1].strip() for row in rows} == set(report["variants"])
    assert "| combo:dynamic_sampling+balanced_aggregation | grpo | 1 |" in goals
    assert (out / "run" / "work" / "runs" / "grpo" / "seed0" / "adapter_model.safetensors").exists()
    text = doc.read_text()
    assert "old table" not in text and text.startswith("# Results\n\nbefore\n") and text.endswith("after\n")
    assert "| grpo | answer |" in text and "learning_curves_by_tokens.png" in text


def test_quick_is_resumable(quick, capsys):
    out, report, _ = quick
    again = _load("learning").main(["--quick", "--out", str(out / "run"), "--docs", "",
                                    "--plugins", "dynamic_sampling,balanced_aggregation",
                                    "--combo", "dynamic_sampling,balanced_aggregation"])
    printed = capsys.readouterr().out
    assert "5 of 5 runs done already; 0 to run" in printed and "training" not in printed
    # --combo alone plans the combination and its baseline only; the report still holds every run on disk
    combo_only = _load("learning").main(["--quick", "--out", str(out / "run"), "--docs", "",
                                         "--combo", "dynamic_sampling,balanced_aggregation"])
    printed = capsys.readouterr().out
    assert "3 of 3 runs done already; 0 to run" in printed and "training" not in printed
    assert combo_only["variants"].keys() == report["variants"].keys()
    assert json.loads(json.dumps(again["variants"], default=str)) == json.loads(json.dumps(report["variants"],
                                                                                           default=str))


def test_statistics_on_known_values():
    learning = _load("learning")
    s = learning.stats([0.1, 0.2, 0.3])
    assert s["mean"] == pytest.approx(0.2) and s["std"] == pytest.approx(0.1)
    assert s["ci95"] == pytest.approx(4.303 * 0.1 / 3**0.5)  # t(0.975, df 2)
    assert learning.t975(4) == 2.776 and learning.t975(11) == 2.228  # nearest tabulated df below
    # trapezoid area / span: (0.4 + 0.6) / 2 * 5 + (0.6 + 0.8) / 2 * 5 over 10 steps
    assert learning.auc([[0, 0.4], [5, 0.6], [10, 0.8]]) == pytest.approx(0.6)
    run = {"curve": [[0, 0.4], [2, 0.5], [4, 0.7]], "tokens_per_step": [100.0, 100.0, 300.0, 300.0]}
    assert learning.cumulative_tokens(run) == {0: 0.0, 1: 100.0, 2: 200.0, 3: 500.0, 4: 800.0}
    assert learning.first_reach(run, 0.5) == (2, 200.0) and learning.first_reach(run, 0.9) == (None, None)
    assert learning.first_reach(run, 0.3) == (2, 200.0)  # the base model (step 0) meeting a target is no reach
    assert learning.at_tokens(run, 500.0) == 0.5 and learning.at_tokens(run, 50.0) == 0.4
    tied = learning.stats([0.02, 0.02])  # equal paired differences: no interval, not a zero-width one
    assert tied["mean"] == pytest.approx(0.02) and tied["ci95"] is None and learning._ci(tied) == "+0.020 (no spread over 2)"
    # time per step: TRL's medians when both runs have them, else both means, never one of each
    assert learning.time_ratio({"step_seconds_median": 30.0, "seconds_per_step": 40.0},
                               {"step_seconds_median": 20.0, "seconds_per_step": 10.0}) == pytest.approx(1.5)
    assert learning.time_ratio({"step_seconds_median": 30.0, "seconds_per_step": 40.0},
                               {"step_seconds_median": None, "seconds_per_step": 10.0}) == pytest.approx(4.0)


def _run(seed, curve, tokens_per_step, seconds=20.0):
    return {"seed": seed, "curve": curve, "tokens_per_step": tokens_per_step, "generated_tokens": sum(tokens_per_step),
            "seconds_per_step": seconds, "step_seconds_median": seconds, "mechanisms": {}}


def test_paired_targets_budgets_and_the_goal_on_known_runs():
    """Per seed: the baseline's own final accuracy is the target and its own tokens the budget; only seeds both
    sides have are paired; the goal reads the median over seeds with a never-reaching seed as never."""
    learning = _load("learning")
    grid = [0, 10, 20, 30]
    base = {"grpo": [_run(0, [[s, a] for s, a in zip(grid, (0.4, 0.5, 0.6, 0.6))], [100.0] * 30),
                     _run(1, [[s, a] for s, a in zip(grid, (0.4, 0.6, 0.8, 0.7))], [150.0] * 30),
                     _run(2, [[s, a] for s, a in zip(grid, (0.4, 0.4, 0.5, 0.5))], [100.0] * 30)]}
    combo = [_run(0, [[s, a] for s, a in zip(grid, (0.4, 0.6, 0.6, 0.7))], [200.0] * 30, seconds=21.0),
             _run(1, [[s, a] for s, a in zip(grid, (0.4, 0.5, 0.6, 0.6))], [200.0] * 30, seconds=21.0),
             _run(3, [[s, a] for s, a in zip(grid, (0.4, 0.9, 0.9, 0.9))], [200.0] * 30, seconds=21.0)]  # seed 3: unpaired
    variants = [learning.Variant("grpo", [], [learning.ACC]),
                learning.Variant("combo:a+b", [{"name": "a"}, {"name": "b"}], [learning.ACC])]
    summary = learning.summarise(variants, {**base, "combo:a+b": combo})
    row = summary["combo:a+b"]
    assert row["paired_seeds"] == [0, 1] and row["targets"] == [0.6, 0.7]
    assert row["steps_to_target"] == [10, None]  # seed 1 never reaches its baseline's 0.7
    assert row["baseline_steps_to_target"] == [20, 20]  # GRPO reaches its own final before its last step
    assert row["delta_final"]["mean"] == pytest.approx((0.1 - 0.1) / 2)
    # budget: the baseline's own tokens on that seed (3000, 4500); the combination spends 200 a step, so its last
    # evaluation within them is step 10 (0.6) and step 20 (0.6), minus the baseline's final (0.6, 0.7). One budget
    # for every seed (the mean, 3500) would read seed 1 at step 10 (0.5): -0.1 on average, not -0.05
    assert row["delta_at_baseline_tokens"]["mean"] == pytest.approx((0.0 - 0.1) / 2)
    assert row["time_ratio"]["mean"] == pytest.approx(1.05)
    assert row["token_ratio"]["mean"] == pytest.approx((6000 / 3000 + 6000 / 4500) / 2)  # paired, not a ratio of means
    row["steps_total"] = 30
    g = learning.goal(summary, "combo:a+b", {"combo:a+b": combo})
    assert g["median_steps_to_target"] is None and not g["steps_met"] and g["time_met"]  # median of (10, never)
    assert g["steps_limit"] == pytest.approx(18.0) and g["effective_limit"] == 10
    table = "\n".join(learning.goals_table([g]))
    assert ("| combo:a+b | grpo | 2 | 10, never | never | ≤ 18 of 30 (in effect the evaluation at step 10) | 20, 20 | "
            "1.05 vs the stored baseline runs (other sessions: rough) | no (steps) |") in table
    row["steps_to_target"] = [10, 10]
    g = learning.goal(summary, "combo:a+b", {"combo:a+b": combo})
    assert g["median_steps_to_target"] == 10 and g["steps_met"] and "| **yes** |" in "\n".join(learning.goals_table([g]))
    # controls: the baseline rerun next to the combination. The time ratio reads them on the seeds they cover (here
    # seed 0 at 15 s a step: 21 / 15 = 1.4, though the stored baseline's 20 s would pass), and the table says how
    # far the rerun's final accuracy is from the stored baseline's on the same seed
    controls = {0: _run(0, [[s, a] for s, a in zip(grid, (0.4, 0.5, 0.6, 0.65))], [100.0] * 30, seconds=15.0),
                7: _run(7, [[0, 0.4], [30, 0.5]], [100.0] * 30, seconds=1.0)}  # seed 7: no combination run, ignored
    g = learning.goal(summary, "combo:a+b", {"combo:a+b": combo}, controls)
    assert g["time_ratio"] == pytest.approx(1.4) and not g["time_met"] and g["time_seeds"] == [0]
    assert g["time_against"] == "control:a+b" and g["control_repeat_final"] == [pytest.approx(0.05)]
    table = "\n".join(learning.goals_table([g]))
    assert "`control:a+b` reruns grpo's config and seeds next to combo:a+b" in table
    assert "| 1.40 vs its control reruns (1 seeds) | no (time) |" in table
    assert "differs from the stored grpo runs' by +0.050 (same seeds)" in table


def test_a_combination_seed_is_followed_by_its_control():
    learning = _load("learning")
    grpo = learning.Variant("grpo", [], [learning.ACC])
    combo = learning.combo_variant(["dynamic_sampling", "gdpo"])
    tasks = [(v.label, seed) for v, seed in learning.tasks_of([grpo, combo], [0, 1])]
    control = "control:dynamic_sampling+gdpo"  # one per combination: each is timed against its own session's reruns
    assert tasks == [("grpo", 0), ("grpo", 1), (combo.label, 0), (control, 0), (combo.label, 1), (control, 1)]
    control = learning.control_variant(combo)
    assert control.label != learning.control_variant(learning.combo_variant(["gdpo", "dynamic_sampling"])).label
    assert control.is_baseline and control.baseline == combo.baseline == "grpo+steps@working"
    assert learning.run_config(learning.Settings(), control, 3, "x") == learning.run_config(
        learning.Settings(), combo.baseline_variant(), 3, "x")  # the same training run as the baseline's
    assert learning.fingerprint(learning.Settings(), control, 3) != learning.fingerprint(
        learning.Settings(), combo.baseline_variant(), 3)  # but its own result file


def test_report_labels_on_disk_and_generation_cycles(tmp_path):
    learning = _load("learning")
    for name in ("grpo", "grpo+steps@working", "grpo@loss_type=grpo", "grpo_lambda", "grpo_care", "combo_a+b",
                 "dynamic_sampling", "control_a+b"):
        (tmp_path / "runs" / name).mkdir(parents=True)
    # baselines are what Variant.baseline names (grpo, grpo+..., grpo@...), not every name that starts with grpo
    assert learning.labels_on_disk(tmp_path) == (["dynamic_sampling", "grpo_care", "grpo_lambda"], [["a", "b"]])
    # num_iterations 2: TRL generates every other step; a cycle's mean holds one generation (first cycle left out)
    assert learning.generation_cycles([9.0, 1.0, 8.0, 2.0, 7.0, 3.0, 6.0, 4.0], 2) == [5.0, 5.0, 5.0]
    assert learning.generation_cycles([9.0, 1.0, 8.0, None, 7.0], 1) == [1.0, 8.0, 7.0]


def test_presets_and_seeds():
    learning = _load("learning")
    assert learning.parse_seeds("3") == [0, 1, 2] and learning.parse_seeds("0,4") == [0, 4]
    assert learning.parse_seeds("2,") == [2]
    with pytest.raises(SystemExit, match="--seeds 0 names no seed"):
        learning.parse_seeds("0")  # not an empty grid that "finishes" at once
    gdpo = learning.preset_variant("gdpo")
    assert gdpo.rewards == [learning.ACC, learning.PROCESS] and gdpo.baseline == "grpo+steps@working"
    settings = learning.Settings()
    config = learning.run_config(settings, gdpo, 0, "out")
    assert config["dataset_name"].endswith(",prompt=working") and config["plugins"] == [{"name": "gdpo"}]
    assert config["heldout_every"] == 5 and config["heldout_samples"] == 100 and not config["heldout_before"]
    from trl_credit.app.rewards import known_reward_names

    assert learning.PROCESS in known_reward_names()  # the process-score stand-in is a built-in reward
    # trainer keys a plugin needs go into its config and its baseline's (a separate, paired baseline)
    drpo = learning.preset_variant("drpo")
    assert drpo.baseline == "grpo@loss_type=grpo" and drpo.baseline_variant().trainer == {"loss_type": "grpo"}
    assert learning.run_config(settings, drpo, 0, "out")["loss_type"] == "grpo"
    plain = learning.Variant("grpo", [], [learning.ACC])
    assert "loss_type" not in learning.run_config(settings, plain, 0, "out") and plain.baseline == "grpo"
    assert learning.fingerprint(settings, plain, 0) != learning.fingerprint(settings, drpo, 0)
    combo = learning.combo_variant(["dynamic_sampling", "drpo", "gdpo"])
    assert combo.baseline == "grpo+steps@working@loss_type=grpo" and combo.prompt == "working"
    assert [e["name"] for e in combo.plugins] == ["dynamic_sampling", "drpo", "gdpo"]


def test_list_reports_what_does_not_apply(tmp_path):
    learning = _load("learning")
    plan = learning.main(["--quick", "--list", "--out", str(tmp_path), "--plugins", "gdpo,no_such_plugin"])
    labels = [v["label"] for v in plan["variants"]]
    if "gdpo" in labels:  # installed: it runs against the baseline with the same prompt and reward columns
        assert labels == ["grpo", "grpo+steps@working", "gdpo"]
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
        assert (out / "work" / "runs" / label / "seed0" / "adapter_model.safetensors").exists()
        assert report["variants"][label]["seeds"] == [0]
    assert done.stdout.count("training 2 steps") == 2

    learning = _load("learning")
    again = learning.main(["--quick", "--report-only", "--seeds", "0,1", "--plugins", "dynamic_sampling",
                           "--out", str(out), "--docs", ""])  # fmt: skip
    assert not (out / "runs" / "grpo" / "seed1.json").exists()  # nothing trained
    for label in labels:
        assert again["variants"][label]["seeds"] == [0]
        assert again["variants"][label]["final"] == report["variants"][label]["final"]
    assert again["seeds"] == [0, 1] and again["missing"] == [f"{label}/seed1" for label in labels]
    assert "**Partial:** 2 planned runs" in (out / "results.md").read_text()
    walls = [json.loads((out / "runs" / label / "seed0.json").read_text())["wall_seconds"] for label in labels]
    assert again["hours_left"] == pytest.approx(2 * sum(walls) / len(walls) / 3600)  # 2 missing runs at the mean
    # a command about another plugin still reports every finished run on disk (the published tables keep them)
    other = learning.main(["--quick", "--report-only", "--plugins", "balanced_aggregation", "--out", str(out),
                           "--docs", ""])  # fmt: skip
    assert other["variants"]["dynamic_sampling"]["final"] == report["variants"]["dynamic_sampling"]["final"]
    assert other["variants"]["dynamic_sampling"]["seeds"] == [0] and other["missing"] == ["balanced_aggregation/seed0"]


def test_a_failing_run_is_reported_not_fatal(tmp_path, monkeypatch):
    learning = _load("learning")
    real = learning.run_one

    def flaky(settings, variant, seed, out, work, base, log):
        if variant.label == "dynamic_sampling":
            raise ValueError("boom\nsecond line")
        return real(settings, variant, seed, out, work, base, log)

    monkeypatch.setattr(learning, "run_one", flaky)
    report = learning.main(["--quick", "--plugins", "dynamic_sampling", "--out", str(tmp_path), "--docs", ""])
    if "dynamic_sampling" not in report["variants"]:
        pytest.skip("dynamic_sampling is not installed")
    assert report["missing"] == ["dynamic_sampling/seed0 (failed: ValueError: boom)"]
    assert report["variants"]["dynamic_sampling"]["seeds"] == [] and report["variants"]["grpo"]["seeds"] == [0]
    table = (tmp_path / "results.md").read_text()
    assert "**Partial:** 1 planned runs are missing" in table and "ValueError: boom" in table


def test_gpu_learning_cpu_smoke(tmp_path):
    """The GPU session's short learning run, on the CPU with the tiny model: QLoRA keys reach every run."""
    report = _load("gpu_learning").main(["--cpu-smoke", "--plugins", "dynamic_sampling", "--out", str(tmp_path / "o"),
                                         "--json", str(tmp_path / "gpu.json")])  # fmt: skip
    on_disk = json.loads((tmp_path / "gpu.json").read_text())
    assert on_disk["device"] == "cpu" and on_disk["qlora"]["load_in_4bit"] and on_disk["steps"] == 2
    labels = [r["label"] for r in on_disk["runs"]]
    if "dynamic_sampling" not in labels:
        pytest.skip("dynamic_sampling is not installed")
    assert sorted(labels) == ["dynamic_sampling", "grpo"]
    assert all(len(r["curve"]) == 3 and r["wall_seconds"] > 0 for r in on_disk["runs"])
    saved = (tmp_path / "o" / "work" / "runs" / "grpo" / "seed0.yaml").read_text()
    assert "load_in_4bit: true" in saved and "use_bnb_nested_quant: true" in saved
    assert report["jobs"] == 1 and report["finished_runs"] == report["planned_runs"] == 2
    assert report["exit_code"] == 0 and not report["stopped_at_budget"]
    grid = report["full_grid"]
    assert grid["runs"] > len(labels) and grid["hours"] == pytest.approx(
        round(grid["runs"] * grid["seconds_per_run"] / 3600, 2))
    # the budget stops the runs (the child and its workers) and what finished is still reported
    stopped = _load("gpu_learning").main(["--cpu-smoke", "--plugins", "dynamic_sampling", "--budget", "0.5",
                                          "--out", str(tmp_path / "stopped")])  # fmt: skip
    assert stopped["stopped_at_budget"] and stopped["finished_runs"] == 0 and stopped["seconds"] < 30
    assert stopped["full_grid"]["hours"] is None
    # stopped with one run finished (GRPO's, kept from the first call): the table of what finished is still made
    (tmp_path / "partial" / "runs").mkdir(parents=True)
    shutil.copytree(tmp_path / "o" / "runs" / "grpo", tmp_path / "partial" / "runs" / "grpo")
    partial = _load("gpu_learning").main(["--cpu-smoke", "--plugins", "dynamic_sampling", "--budget", "3",
                                          "--out", str(tmp_path / "partial")])  # fmt: skip
    assert partial["stopped_at_budget"] and partial["finished_runs"] == 1 and partial["runs"][0]["label"] == "grpo"
    assert "| grpo |" in partial["table"] and "dynamic_sampling/seed0" in partial["table"]


def test_the_which_plugin_evidence_table_reads_the_intervals():
    learning = _load("learning")
    summary = {
        "gdpo": {"paired_seeds": [0, 1, 2], "baseline": "grpo+steps@working", "delta_final": learning.stats([0.1, 0.12, 0.14]),
                 "delta_auc": learning.stats([0.0, 0.1, 0.2]), "steps_to_target": [10, 15, None],
                 "time_ratio": learning.stats([1.0, 1.1, 1.2])},
        "gtpo": {"paired_seeds": [0, 1, 2], "baseline": "grpo@loss_type=grpo", "delta_final": learning.stats([-0.1, 0.1, 0.0]),
                 "delta_auc": learning.stats([0.0]), "steps_to_target": [None] * 3, "time_ratio": learning.stats([1.0])},
        # a filter with refill: better at equal steps, but not at the baseline's token budget
        "accuracy_band": {"paired_seeds": [0, 1, 2], "baseline": "grpo", "delta_final": learning.stats([0.06, 0.07, 0.09]),
                          "delta_auc": learning.stats([0.04, 0.05, 0.07]), "token_ratio": learning.stats([2.7, 2.8, 2.9]),
                          "delta_at_baseline_tokens": learning.stats([-0.2, 0.0, 0.1]), "steps_to_target": [10] * 3},
        # final accuracy not distinguishable, the curve lower: worse on what the intervals separate
        "prime": {"paired_seeds": [0, 1, 2], "baseline": "grpo", "delta_final": learning.stats([-0.03, -0.11, 0.06]),
                  "delta_auc": learning.stats([-0.07, -0.11, -0.05]), "token_ratio": learning.stats([1.0, 1.1, 1.1])},
        "mrt": {"paired_seeds": [0, 1, 2], "baseline": "grpo", "delta_final": learning.stats([0.1, 0.12, 0.14]),
                "delta_auc": learning.stats([-0.1, -0.12, -0.14])},
    }  # fmt: skip
    installed = ["accuracy_band", "e_grpo", "gdpo", "gtpo", "mrt", "prime", "rpr"]
    table = learning.evidence(summary, {"e_grpo": "needs an entities column"}, installed)
    rows = {line.split("|")[1].strip().split()[0]: line for line in table.splitlines()[2:]}
    assert "**better** at equal steps: higher final accuracy |" in rows["`gdpo`"]
    assert "+0.120 ± 0.050" in rows["`gdpo`"] and "12 (2/3)" in rows["`gdpo`"]
    assert "no difference shown at equal steps" in rows["`gtpo`"] and "not reached (0/3)" in rows["`gtpo`"]
    assert ("**better** at equal steps: higher final accuracy and higher curve (AUC); at the baseline's generated "
            "tokens (2.8x its tokens per step): no difference shown") in rows["`accuracy_band`"]
    assert "**worse** at equal steps: lower curve (AUC) |" in rows["`prime`"]  # 1.07x tokens: no token clause
    assert "mixed at equal steps: higher final accuracy and lower curve (AUC)" in rows["`mrt`"]
    assert "needs an entities column" in rows["`e_grpo`"] and "not run yet" in rows["`rpr`"]


def test_the_best_are_ranked_by_paired_auc_and_only_from_the_complete_grid(tmp_path, monkeypatch):
    """`rank`: paired Δ AUC over every grid seed (ties by Δ final); fixtures, combinations and partly paired plugins
    are not ranked. `ranked` refuses a partial grid; `best_combo` falls back to fewer plugins that validate."""
    learning = _load("learning")
    curve = lambda a: [[0, 0.4], [15, a], [30, a]]  # noqa: E731 - AUC = (0.4 + a) / 4 + a / 2
    grpo = [_run(s, curve(0.6), [100.0] * 30) for s in range(3)]
    runs = {"grpo": grpo, "a": [_run(s, curve(0.7), [100.0] * 30) for s in range(3)],
            "b": [_run(s, curve(0.8), [100.0] * 30) for s in range(3)],
            "c": [_run(s, curve(0.9), [100.0] * 30) for s in range(2)],  # seed 2 missing: not ranked
            "reward_noise": [_run(s, curve(0.95), [100.0] * 30) for s in range(3)]}
    variants = [learning.Variant("grpo", [], [learning.ACC]),
                *(learning.Variant(n, [{"name": n}], [learning.ACC]) for n in ("a", "b", "c", "reward_noise"))]
    summary = learning.summarise(variants, runs)
    assert summary["b"]["delta_auc"]["mean"] == pytest.approx(0.75 * 0.2)
    assert learning.rank(summary) == ["b", "a"]
    # cheap:N ranks only the plugins whose own runs put them within the goal's time per step: b's extra passes
    # take half its step (2x its baseline's time at equal tokens), though the measured ratio from another session
    # says 0.9x; a generates 1.05x the tokens and has no extra pass
    b_runs = [{**r, "series": {"trl_credit/cost/probe_seconds": [[1, 9.0], [2, 6.0]],
                               "trl_credit/cost/generation_seconds": [[1, 40.0], [2, 40.0]]},
               "steps": 2, "seconds_per_step": 15.0} for r in runs["b"]]
    assert learning.extra_pass_share(b_runs[0]) == pytest.approx(0.5)  # (9 + 6) / 2 steps / 15 s; generation is TRL's
    a_runs = [{**r, "generated_tokens": 1.05 * r["generated_tokens"]} for r in runs["a"]]
    timed = learning.summarise(variants, {**runs, "a": a_runs, "b": b_runs})
    assert timed["b"]["own_time_ratio"]["mean"] == pytest.approx(2.0)
    assert timed["a"]["own_time_ratio"]["mean"] == pytest.approx(1.05)
    assert learning.rank(timed, learning.GOAL_TIME) == ["a"] and learning.rank(timed) == ["b", "a"]
    assert learning.rank(timed, 1.01) == []

    monkeypatch.setattr(learning, "plan", lambda *a: (variants[:3], {}))
    settings = learning.Settings()
    with pytest.raises(SystemExit, match="9 runs are missing"):
        learning.ranked(settings, tmp_path, tmp_path / "work")
    for variant in variants[:3]:
        for run in runs[variant.label]:
            path = learning.result_path(tmp_path, variant.label, run["seed"])
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({**run, "fingerprint": learning.fingerprint(settings, variant, run["seed"])}))
    assert learning.ranked(settings, tmp_path, tmp_path / "work") == ["b", "a"]

    monkeypatch.setattr(learning, "_validate", lambda s, v, f: "conflict" if len(v.plugins) == 3 else None)
    assert learning.best_combo(settings, ["b", "a", "d"], 3, tmp_path) == ["b", "a"]
    monkeypatch.setattr(learning, "_validate", lambda s, v, f: "conflict")
    with pytest.raises(SystemExit, match="validate together"):
        learning.best_combo(settings, ["b", "a", "d"], 3, tmp_path)


def test_gpu_session_carries_the_wheels_in_parts_and_installs_only_a_complete_bundle(tmp_path):
    """benchmarks/gpu_session.sh: `prepare` splits the wheels into parts (one per device call), `stash` keeps each
    call's part, and `install` refuses an incomplete bundle, then installs a complete one (checksums checked)."""
    import subprocess

    script = BENCHMARKS / "gpu_session.sh"
    plugin = next((BENCHMARKS.parent / "plugins").glob("trl-credit-gdpo"), None)
    if plugin is None:
        pytest.skip("the gdpo plugin's source is not here")
    env = {**os.environ, "PYTHON": sys.executable, "PY3": sys.executable, "DOWNLOAD": "0",
           "SOURCES": str(plugin), "PART": "4K", "CARRY": str(tmp_path / "carry"), "TRLC_TMP": str(tmp_path / "m")}

    def call(verb: str, carry: Path | None = None) -> subprocess.CompletedProcess:
        extra = {"CARRY": str(carry)} if carry else {}
        return subprocess.run(["bash", str(script), verb], env={**env, **extra}, capture_output=True, text=True,
                              timeout=300)  # fmt: skip

    done = call("prepare")
    assert done.returncode == 0, done.stderr
    parts = sorted((tmp_path / "carry").glob("part*"), key=lambda p: int(p.name[4:]))
    assert len(parts) >= 2 and f"1 wheels in {len(parts)} parts of at most 4K" in done.stdout
    assert done.stdout.count("gpu_session.sh stash") == len(parts) - 1 and "gpu_session.sh run" in done.stdout
    assert all(f.stat().st_size <= 4096 for p in parts for f in p.glob("bundle.tar.part*"))
    # each device call carries one part: call k's working tree holds part k only
    calls = []
    for part in parts:
        tree = tmp_path / f"call-{part.name}"
        shutil.copytree(part, tree / part.name)
        calls.append(tree)
    refused = call("install", calls[-1])  # the last part alone
    assert refused.returncode == 3 and "bundle incomplete" in refused.stderr
    for tree in calls[:-1]:
        assert call("stash", tree).returncode == 0
    installed = call("install", calls[-1])
    assert installed.returncode == 0, installed.stderr
    site = tmp_path / "m" / "site"
    assert list(site.glob("trl_credit_gdpo-*.dist-info")) and (site / "trl_credit_gdpo").is_dir()
