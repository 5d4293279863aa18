"""What does a dense-credit plugin's extra scoring cost?  Added time per step as a multiple of the same step's
generation time, and extra peak memory, per plugin, on the embedded model and on the tiny model.

Each configuration trains a few steps in its own process (the learning benchmark's settings: arithmetic, LoRA,
4 prompts x 8 completions, 24 tokens on the embedded model; 2 x 4 and 8 tokens on the tiny one) and reads, per
step, from the training logs:

- ``trl_credit/cost/generation_seconds``: TRL's generation and scoring of the round (the yardstick);
- ``trl_credit/<plugin>/seconds``: the wall time of the plugin's hooks, scoring passes they trigger included
  (the reference pass, an adapter's scoring and training step): the time the plugin adds;
- ``trl_credit/cost/<plugin>/<adapter>_{score,update}_seconds``: the parts of it spent in auxiliary adapters.

Reported per plugin: the median over steps (the first, warm-up, step left out) of plugin seconds / generation
seconds, and the process's peak resident memory (CPU: ``ru_maxrss``; CUDA: ``max_memory_allocated``) minus that
of the same run with no plugin. Targets (issue #13): one extra no-grad pass <= 1.0x generation time; PRIME's
scoring plus its update <= 2.0x.

    python benchmarks/dense_cost.py --model embedded --plugins prime --steps 4
    python benchmarks/dense_cost.py --model tiny --plugins prime,logprob_reward --json out.json
    python benchmarks/dense_cost.py --report     # the table in docs/results.md from benchmarks/results/dense_cost

On a shared machine both times stretch together; the ratio is taken within one step, so it is the figure to
read, not the seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TARGETS = {"prime": 2.0}  # scoring + update; one extra no-grad pass: 1.0; several passes or probes: reported only
MULTI = ("igpo", "trace", "pppo", "spae", "mrt")  # several passes or generation per completion: no single-pass target
DEFAULT_TARGET = 1.0
# plugin -> (options, reward columns, dataset prompt style)
SETUPS: dict[str, tuple[dict[str, Any], list[str], str]] = {
    "prime": ({}, ["arithmetic_accuracy"], "answer"),
    "logprob_reward": ({}, ["arithmetic_accuracy"], "answer"),
    "grpo_care": ({"ema_every": 1}, ["arithmetic_accuracy"], "answer"),
    "igpo": ({"max_steps": 4}, ["arithmetic_accuracy"], "working"),
    "trace": ({"max_steps": 4}, ["arithmetic_accuracy"], "working"),
    "endogenous_reward": ({}, ["arithmetic_accuracy"], "answer"),
    "pppo": ({"continuations": 2}, ["arithmetic_accuracy"], "answer"),
    "spae": ({"max_steps": 4, "num_samples": 2}, ["arithmetic_accuracy"], "working"),
    "mrt": ({}, ["arithmetic_accuracy"], "answer"),
}
#: what each plugin's extra work is, for the report (the target it is held to)
PASSES = {"prime": "PRM step (forward + backward) + reference pass", "logprob_reward": "1 teacher-forced pass",
          "grpo_care": "1 pass under the EMA adapter", "igpo": "<= 4 prefixes x 1 teacher-forced pass",
          "trace": "<= 5 prefixes x 1 teacher-forced pass (reference)", "endogenous_reward": "1 logits pass",
          "pppo": "2 sampled continuations + rewards", "spae": "<= 4 steps x 2 probes", "mrt": "forced-answer probe"}


def settings_for(model: str, steps: int):
    sys.path.insert(0, str(HERE))
    from learning import Settings, quick_settings

    if model == "tiny":
        return quick_settings().__class__(**{**quick_settings().__dict__, "steps": steps, "heldout_every": 0})
    return Settings(steps=steps, heldout_every=0)


def one(model: str, plugin: str | None, steps: int, out: str) -> dict[str, Any]:
    """Train ``steps`` steps in this process; per-step figures and the peak memory."""
    import torch
    import yaml

    sys.path.insert(0, str(HERE))
    from learning import Variant, run_config

    from trl_credit.app.train_command import train

    options, rewards, prompt = SETUPS.get(plugin, ({}, ["arithmetic_accuracy"], "answer")) if plugin else \
        ({}, ["arithmetic_accuracy"], "answer")
    variant = Variant(plugin or "grpo", [{"name": plugin, **options}] if plugin else [], rewards, prompt=prompt)
    settings = settings_for(model, steps)
    config = run_config(settings, variant, 0, out)
    config.pop("heldout_every", None)
    config["heldout_samples"] = 0
    path = Path(out) / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    metrics = train(str(path))
    rows = [h for h in metrics["log_history"] if "loss" in h and "step" in h]
    keys = sorted({k for h in rows for k in h if k.startswith("trl_credit/") or k == "step_time"})
    peak = (torch.cuda.max_memory_allocated() if torch.cuda.is_available()
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"plugin": plugin, "model": model, "steps": [{k: h.get(k) for k in keys} for h in rows],
            "peak_bytes": peak, "device": "cuda" if torch.cuda.is_available() else "cpu"}


def summarise(base: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    plugin = run["plugin"]
    steps = run["steps"][1:] or run["steps"]
    ratio = [s[f"trl_credit/{plugin}/seconds"] / s["trl_credit/cost/generation_seconds"] for s in steps
             if s.get(f"trl_credit/{plugin}/seconds") is not None and s.get("trl_credit/cost/generation_seconds")]
    parts = sorted({k for s in steps for k in s if k.startswith(f"trl_credit/cost/{plugin}/")})
    part_ratio = {k.removeprefix(f"trl_credit/cost/{plugin}/"): statistics.median(
        [s[k] / s["trl_credit/cost/generation_seconds"] for s in steps if s.get(k) is not None]) for k in parts}
    target = None if plugin in MULTI else TARGETS.get(plugin, DEFAULT_TARGET)
    added = statistics.median(ratio) if ratio else None
    return {"plugin": plugin, "model": run["model"], "device": run["device"],
            "added_x_generation": round(added, 3) if added is not None else None, "parts_x_generation":
            {k: round(v, 3) for k, v in part_ratio.items()}, "target_x": target,
            "meets_target": None if target is None else (added is not None and added <= target),
            "passes": PASSES.get(plugin, ""),
            "generation_seconds": round(statistics.median(s["trl_credit/cost/generation_seconds"] for s in steps), 3),
            "extra_peak_mib": round((run["peak_bytes"] - base["peak_bytes"]) / 2 ** 20, 1),
            "steps_measured": len(steps)}


BEGIN, END = "<!-- dense-cost:begin -->", "<!-- dense-cost:end -->"


def report(folder: Path, docs: Path) -> str:
    """The docs block of every summary in ``folder`` (one table row per plugin and model)."""
    rows = []
    for path in sorted(folder.glob("*.json")):
        summary = json.loads(path.read_text())
        for p in summary["plugins"]:
            target = "-" if p["target_x"] is None else f"<= {p['target_x']:g}x: " + ("met" if p["meets_target"] else
                                                                                    "**not met**")
            parts = ", ".join(f"{k.removesuffix('_seconds')} {v:.2f}x" for k, v in p["parts_x_generation"].items())
            added = "-" if p["added_x_generation"] is None else f"{p['added_x_generation']:.2f}x"
            rows.append(f"| `{p['plugin']}` | {summary['model']} ({p['device']}, {summary['threads']} threads) | "
                        f"{p.get('passes') or PASSES.get(p['plugin'], '')} | {added} | {parts or '-'} | {target} | {p['extra_peak_mib']:+.0f} MiB "
                        f"| {p['generation_seconds']:.2f} s | `{path.name}` |")
    block = "\n".join([
        BEGIN,
        "<!-- generated by `python benchmarks/dense_cost.py --report`; do not edit by hand -->",
        "",
        "| plugin | model | extra work per round | added time / generation time | of which | target | extra peak "
        "memory | generation s (median) | result file |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        END,
    ])
    text = docs.read_text(encoding="utf-8")
    if BEGIN in text:
        text = text[: text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    docs.write_text(text, encoding="utf-8")
    return block


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["tiny", "embedded"], default="embedded")
    parser.add_argument("--plugins", default="prime")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None, help="write the summary here (and print it)")
    parser.add_argument("--report", action="store_true", help="regenerate the table in docs/results.md from "
                        "benchmarks/results/dense_cost/*.json and stop")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: one run in this process
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.report:
        print(report(HERE / "results" / "dense_cost", HERE.parent / "docs" / "results.md"))
        return 0
    if args.one is not None:
        import torch

        torch.set_num_threads(args.threads)
        result = one(args.model, args.one or None, args.steps, args.out)
        Path(args.out, "result.json").write_text(json.dumps(result))
        return 0
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for plugin in ["", *[p for p in args.plugins.split(",") if p]]:
            out = os.path.join(tmp, plugin or "none")
            cmd = [sys.executable, __file__, "--model", args.model, "--steps", str(args.steps), "--threads",
                   str(args.threads), "--one", plugin, "--out", out]
            done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
            if done.returncode:
                sys.stderr.write(done.stdout[-2000:] + done.stderr[-4000:])
                return done.returncode
            runs[plugin] = json.loads(Path(out, "result.json").read_text())
    base = runs.pop("")
    summary = {"model": args.model, "steps": args.steps, "threads": args.threads,
               "baseline_peak_mib": round(base["peak_bytes"] / 2 ** 20, 1),
               "plugins": [summarise(base, run) for run in runs.values()]}
    text = json.dumps(summary, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
