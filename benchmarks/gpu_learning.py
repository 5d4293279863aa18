"""The learning benchmark, short, with QLoRA on a lent GPU: what it learns there and what the full grid costs.

One prepared command for a GPU session (the sibling of ``gpu_qlora.py``, which measures memory and
throughput at 8B size; ``gpu_session.sh`` carries the wheels and runs both). It runs
``benchmarks/learning.py`` in its own results folder with QLoRA (bitsandbytes 4-bit NF4 base, bf16
compute, double quantisation, LoRA r16 on all linear layers) on the embedded SmolLM2-135M-Instruct,
same setting as the CPU grid otherwise (arithmetic 1..20, 4 prompts x 8 completions, 24 tokens,
held-out curve every 5 steps): GRPO and ``--plugins`` (default ``dynamic_sampling,gdpo``) with their
baselines, one seed, ``--steps`` 30, ``--jobs`` runs side by side (default: all of them on a GPU; a
135M model leaves an H200 mostly idle). The runs go to a child process that is stopped at
``--budget`` seconds (default 420, so the whole command stays under 8 minutes); what finished by then
is reported. It then says what the full grid (every planned variant x 3 seeds, and 5 seeds for the
three best) would cost there at the same number of runs side by side.

    python benchmarks/gpu_learning.py --json gpu_learning.json     # on the GPU
    python benchmarks/gpu_learning.py --cpu-smoke                  # the tiny model, 2 steps (tests)

Prints one JSON object; ``--json PATH`` also writes it. Results are not mixed with the CPU grid's:
the QLoRA keys are part of every run's fingerprint and the folder is separate.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
QLORA = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "use_bnb_nested_quant": True,
         "dtype": "bfloat16", "bf16": True}  # fmt: skip


def _learning():
    spec = importlib.util.spec_from_file_location("trl_credit_bench_learning", HERE / "learning.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plugins", default="dynamic_sampling,gdpo")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seeds", default="1")
    parser.add_argument("--jobs", type=int, default=0, help="runs side by side (0: all of them on a GPU, 1 on CPU)")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds after which the runs are stopped")
    parser.add_argument("--out", default=None, help="results folder (default: a temporary one)")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model, 2 steps, no 4-bit compute dtype")
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args(argv)
    import torch

    learning = _learning()
    out = Path(args.out or tempfile.mkdtemp(prefix="gpu_learning_"))
    cuda = torch.cuda.is_available()
    extra = dict(QLORA)
    if args.cpu_smoke or not cuda:
        extra.update(dtype="float32", bf16=False)  # CPUs without bf16 units crawl; 4-bit NF4 still
    common = ["--out", str(out), "--work", str(out / "work"), "--docs", "", "--extra", json.dumps(extra),
              *(["--quick"] if args.cpu_smoke else [])]  # fmt: skip
    plan = learning.main(["--list", *common, "--plugins", args.plugins, "--seeds", args.seeds])
    planned = len(plan["variants"]) * len(learning.parse_seeds(args.seeds))
    jobs = args.jobs or (planned if cuda else 1)
    command = [sys.executable, str(HERE / "learning.py"), *common, "--plugins", args.plugins, "--seeds", args.seeds,
               "--jobs", str(jobs), *([] if args.cpu_smoke else ["--steps", str(args.steps)])]  # fmt: skip
    clock = time.time()
    child = subprocess.Popen(command, start_new_session=True)  # its worker processes share its process group
    try:
        child.wait(timeout=args.budget)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    seconds = round(time.time() - clock, 1)
    if child.returncode != 0 and any((out / "runs").glob("*/seed*.json")):  # stopped: the table of what finished
        learning.main(["--report-only", *common, "--plugins", args.plugins, "--seeds", args.seeds])
    runs = [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*/seed*.json"))]
    wall = [r["wall_seconds"] for r in runs]
    grid = learning.main(["--list", *common])  # every installed plugin that applies, as the CPU grid plans it
    grid_runs = len(grid["variants"]) * 3 + 3 * 2 * 2  # every variant x 3 seeds; 2 more seeds for 3 best + baselines
    per_run = statistics.fmean(wall) if wall else None
    result = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "qlora": extra, "steps": args.steps if not args.cpu_smoke else 2, "jobs": jobs, "seconds": seconds,
        "exit_code": child.returncode, "stopped_at_budget": child.returncode == -signal.SIGKILL,
        "planned_runs": planned, "finished_runs": len(runs),
        "runs": [{"label": r["label"], "seed": r["seed"], "curve": r["curve"], "wall_seconds": r["wall_seconds"],
                  "seconds_per_step": r["seconds_per_step"], "step_seconds_median": r.get("step_seconds_median"),
                  "eval_seconds": r["eval_seconds"], "generated_tokens": r["generated_tokens"]} for r in runs],
        "full_grid": {"runs": grid_runs, "seconds_per_run": per_run, "side_by_side": jobs,
                      "hours": round(grid_runs * per_run / jobs / 3600, 2) if per_run else None},
        "table": (out / "results.md").read_text() if (out / "results.md").exists() else None,
    }  # fmt: skip
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
