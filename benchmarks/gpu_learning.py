"""The learning benchmark, short, with QLoRA on a lent GPU: what it learns there and what the full grid costs.

One prepared command for a GPU session (the sibling of ``gpu_qlora.py``, which measures memory and
throughput at 8B size). It runs ``benchmarks/learning.py`` in its own results folder with QLoRA
(bitsandbytes 4-bit NF4 base, bf16 compute, double quantisation, LoRA r16 on all linear layers) on
the embedded SmolLM2-135M-Instruct, same setting as the CPU grid otherwise (arithmetic 1..20, 4
prompts x 8 completions, 24 tokens, held-out curve every 5 steps): GRPO and ``--plugins`` (default
``dynamic_sampling,gdpo``), one seed, ``--steps`` 30. It then reports the wall time of each run and
what the full grid (every planned variant x 3 seeds, and 5 seeds for the three best) would cost there
run one after the other.

    python benchmarks/gpu_learning.py --json gpu_learning.json     # on the GPU: about 4-6 minutes
    python benchmarks/gpu_learning.py --cpu-smoke                  # the tiny model, 2 steps (tests)

Prints one JSON object; ``--json PATH`` also writes it. Results are not mixed with the CPU grid's:
the QLoRA keys are part of every run's fingerprint and the folder is separate.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
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
    parser.add_argument("--out", default=None, help="results folder (default: a temporary one)")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model, 2 steps, no 4-bit compute dtype")
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args(argv)
    import torch

    learning = _learning()
    out = Path(args.out or tempfile.mkdtemp(prefix="gpu_learning_"))
    extra = dict(QLORA)
    if args.cpu_smoke or not torch.cuda.is_available():
        extra.update(dtype="float32", bf16=False)  # CPUs without bf16 units crawl; 4-bit NF4 still
    command = ["--out", str(out), "--docs", "", "--plugins", args.plugins, "--seeds", args.seeds,
               "--extra", json.dumps(extra)]  # fmt: skip
    command += ["--quick"] if args.cpu_smoke else ["--steps", str(args.steps)]
    clock = time.time()
    report = learning.main(command)
    seconds = round(time.time() - clock, 1)
    runs = [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*/seed*.json"))]
    wall = [r["wall_seconds"] for r in runs]
    plan = learning.main(["--list", "--out", str(out / "plan"), "--docs", "", *(["--quick"] if args.cpu_smoke
                                                                               else [])])  # fmt: skip
    grid_runs = len(plan["variants"]) * 3 + 3 * 2 * 2  # every variant x 3 seeds; 2 more seeds for 3 best + baselines
    per_run = statistics.fmean(wall) if wall else None
    result = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "qlora": extra, "steps": report["settings"]["steps"], "seconds": seconds,
        "runs": [{"label": r["label"], "seed": r["seed"], "curve": r["curve"], "wall_seconds": r["wall_seconds"],
                  "seconds_per_step": r["seconds_per_step"], "eval_seconds": r["eval_seconds"],
                  "generated_tokens": r["generated_tokens"]} for r in runs],
        "peak_gpu_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available()
        else None,
        "full_grid": {"runs": grid_runs, "seconds_per_run": per_run,
                      "hours_one_at_a_time": round(grid_runs * per_run / 3600, 2) if per_run else None},
        "table": (out / "results.md").read_text(),
    }  # fmt: skip
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
