"""Smoke test of benchmarks/overhead.py: it runs end to end and reports every figure.

Timing targets are *not* asserted (CI machines are noisy); only that the script works and that
every figure it promises is there and positive.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "overhead.py"


def _load():
    spec = importlib.util.spec_from_file_location("trl_credit_bench_overhead", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "overhead.json"
    # --steps 1: one warm-up + one timed step per run keeps this well under a minute on 2 busy cores
    returned = _load().main(["--quick", "--steps", "1", "--json", str(path), "--each-plugin", "dynamic_sampling"])
    return returned, json.loads(path.read_text())


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_trainer_ratio_fields(quick_report):
    _, report = quick_report
    trainer = report["trainer"]
    for key in ("ratio_min", "ratio_median", "ratio_max", "ratio_pooled", "vanilla_median_ms", "host_median_ms",
                "cpu_ratio_min", "cpu_ratio_median", "cpu_ratio_max", "cpu_ratio_pooled"):
        assert _positive(trainer[key]), (key, trainer[key])
    assert trainer["ratio_min"] <= trainer["ratio_median"] <= trainer["ratio_max"]
    assert len(trainer["ratios"]) == trainer["repeats"] == 1
    assert all(len(run) == trainer["steps"] for run in trainer["vanilla_step_ms"] + trainer["host_step_ms"])
    # with no plugins the host is TRL: same seed, same losses and rewards
    assert trainer["identical_losses_and_rewards"] is True


def test_every_hook_family_timed(quick_report):
    module = _load()
    _, report = quick_report
    hooks = report["hooks"]
    assert set(hooks["families"]) == set(module.FAMILIES)
    for family in ("shape_rewards", "filter_rollouts", "compute_advantages", "transform_advantages",
                   "kl_coefficient", "prompt_weights", "on_batch_end", "on_step_end"):
        assert family in hooks["families"]
    for family, row in hooks["families"].items():
        assert list(row["by_size"]) == hooks["sizes"]
        for size, figures in row["by_size"].items():
            assert _positive(figures["ms"]), (family, size, figures)
            assert _positive(figures["ms_per_mtok"]), (family, size, figures)


def test_report_environment_and_return_value(quick_report):
    returned, report = quick_report
    assert returned["hooks"]["sizes"] == report["hooks"]["sizes"]
    env = report["environment"]
    assert env["cores"] >= 1 and env["torch_threads"] == 1
    assert env["versions"]["trl"] and env["versions"]["torch"]


def test_parse_sizes():
    assert _load().parse_sizes("1024x256, 8192X1024") == [(1024, 256), (8192, 1024)]


def test_installed_plugin_costs(tmp_path):
    from trl_credit.plugins import available

    installed = sorted(n for n, a in available().items() if not a.builtin)
    if not installed:
        pytest.skip("no plugin installed")
    report = _load().main(["--quick", "--only", "hooks", "--installed", installed[0],
                           "--json", str(tmp_path / "b.json")])
    row = report["installed_plugins"][installed[0]]
    assert _positive(row["ms"]) and _positive(row["plugin_ms"])


def test_each_plugin_overhead_reports_a_ratio_and_its_target(quick_report):
    _, report = quick_report
    row = report["each_plugin"]["dynamic_sampling"]
    assert "error" not in row, row
    assert row["pure_math"] is True and row["target_ratio"] == 1.05
    assert row["plugins"] == [{"name": "dynamic_sampling", "mode": "filter"}]
    assert _positive(row["ratio_median"]) and _positive(row["cpu_ratio_median"])
    # the host timed the filter and the built-in estimator on every step: a small, positive cost
    assert _positive(row["plugin_hook_ms_per_step"]) and 1.0 < row["hook_bound_ratio"] < 1.5


def test_scaling_sizes_cover_the_issue_grid():
    module = _load()
    sizes = module.parse_sizes("scaling")
    assert {n for n, _ in sizes} == {1024, 8192, 65536} and {t for _, t in sizes} == {256, 1024}
