"""Does a plugin change what GRPO learns?  Baseline GRPO vs each installed plugin, same budget, several seeds.

Every run is a real ``trl-credit train`` run (a generated YAML config, `trl_credit.app.train_command.train`): LoRA on
the embedded SmolLM2-135M-Instruct, the built-in ``arithmetic`` dataset at a difficulty where the
base model is right 10-40% of the time (two-number addition with operands 1..50: 0.26 greedy on the
100 held-out prompts used here; 1..20 gave 0.34 and 1..100 0.10 on 50 prompts), the same
steps, the same prompts and completions per step, the same completion length and the same seeds
for every run. Held-out accuracy is greedy, on the same 100 held-out prompts for every run, computed
with `trl_credit.app.eval_command.run_eval` (what ``trl-credit eval`` runs): once for the base model
("before", one number: greedy decoding of the same model) and once per trained adapter ("after").

    python benchmarks/learning.py --out runs/learning --jobs 2          # everything (hours: see docs/results.md)
    python benchmarks/learning.py --out runs/learning --report-only     # the table from the runs finished so far
    python benchmarks/learning.py --out runs/learning --plugins gdpo,gtpo --seeds 0,1,2 --steps 30
    python benchmarks/learning.py --out runs/learning --list            # the plan and what does not apply
    python benchmarks/learning.py --quick --out /tmp/learning-quick     # tiny model, 2 steps, 1 seed (CI)

Resumable: a run whose ``result.json`` exists with the same settings is skipped; a run without one is
redone from scratch. Outputs under ``--out``: ``runs/<label>/seed<k>/`` (the train output dir:
adapter, metrics.json, trl_credit_config.yaml, reward_curve.png, eval_test.json, result.json),
``base_eval.json``, ``results.json`` (every figure), ``results.md`` (the table) and
``reward_curves.png``. Without ``--quick`` the table and the figure also go into ``docs/results.md``
between the ``learning-results`` markers (``--docs ''`` to skip).

Presets (``PRESETS``): options that keep the budget equal (no refill for filters: a refill generates
extra completions) and the reward columns a plugin needs. Multi-reward estimators and
process-score shapers get a second, deterministic reward column, the built-in ``arithmetic_steps``
(**a stand-in** for a process reward model: the mean score of the completion's lines under a
rule-based checker of integer equations, so "17 + 8 = 25" scores 1, "17 + 8 = 24" and a bare "25"
score 0); they are compared with a baseline that has the same two reward columns (``grpo+steps``),
not with the accuracy-only one. Plugins without a preset run with their defaults; a plugin whose
preset or defaults fail ``trl-credit validate`` (a dataset column arithmetic lacks, an option it
requires) is listed with the reason instead of being run.

Honest reporting: the table shows mean ± sample standard deviation over seeds, min-max, and the
difference to the baseline paired by seed; with 3 seeds and 10 steps differences of a few points may
be noise. No claims are made by this script.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import io
import json
import math
import os
import platform
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ACC = "arithmetic_accuracy"
PROCESS = "arithmetic_steps"  # the process-score stand-in (trl_credit.app.rewards.arithmetic_steps)
BEGIN, END = "<!-- learning-results:begin -->", "<!-- learning-results:end -->"
QUICK_PREFERENCE = ("dynamic_sampling", "balanced_aggregation", "gtpo", "gdpo", "riskpo", "drpo", "corrgrpo")

# name -> {"options": plugin options, "rewards": reward columns, "trainer": `trl grpo` keys it needs (its
# baseline gets them too), "note": shown in the table, "skip": reason}
PRESETS: dict[str, dict[str, Any]] = {
    "dynamic_sampling": {"options": {"mode": "filter"}, "note": "no refill (equal generated tokens)"},
    "accuracy_band": {"options": {"refill": False}, "note": "refill off (equal generated tokens)"},
    "gdpo": {"rewards": [ACC, PROCESS], "note": "two reward columns (with one, GDPO is GRPO)"},
    "corrgrpo": {"rewards": [ACC, PROCESS], "note": "two reward columns (with one, it is Dr.GRPO)"},
    "p_grpo": {"options": {"outcome_reward": ACC, "process_reward": PROCESS}, "rewards": [ACC, PROCESS],
               "note": "process score = stand-in column"},
    "trust_grpo": {"options": {"answer_reward": ACC, "thinking_reward": PROCESS}, "rewards": [ACC, PROCESS],
                   "note": "thinking score = stand-in column"},
    "drpo": {"trainer": {"loss_type": "grpo"}, "note": "its advantages equal the DRPO gradient only with "
             "loss_type grpo (it refuses TRL's default dapo); compared with GRPO under the same loss"},
    "riskpo": {"options": {"bundle_size": 2}, "note": "K = 2 prompt groups per bundle (paper 5): a step has 2"},
    "gtpo": {"trainer": {"loss_type": "grpo"}, "note": "the GTPO objective is a per-completion token mean "
             "(loss_type grpo; it refuses TRL's default dapo); compared with GRPO under the same loss"},
    "e_grpo": {"skip": "needs a gold entity-list dataset column ('entities'); arithmetic has one number per answer"},
    "reward_noise": {"note": "flips rewards on purpose (a robustness fixture): expected to hurt"},
}  # fmt: skip


# ====================================================================== settings
@dataclass
class Settings:
    """Everything that must be equal across runs (part of every run's fingerprint)."""

    model: str = "smollm2-135m-instruct"
    dataset: str = "arithmetic:max_value=50,seed=0,eval_n=100"  # seed fixed: same prompts for every run seed
    steps: int = 10
    per_device_train_batch_size: int = 16  # 2 prompts x 8 completions per step (the quickstart's batch)
    num_generations: int = 8
    max_completion_length: int = 16
    heldout_max_new_tokens: int = 16
    learning_rate: float = 2.0e-4
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0  # PEFT's 0.05 costs ~13% of a CPU step here (profiled) and is noise at 10 steps
    temperature: float = 1.0
    samples_per_prompt: int = 0  # > 0: also sampled pass@k after training
    extra: dict[str, Any] = field(default_factory=dict)  # more `trl grpo` keys


def quick_settings() -> Settings:
    from trl_credit.testing.tiny import tiny_model_path

    return Settings(model=tiny_model_path(), dataset="arithmetic:n=64,seed=0,eval_n=8", steps=2,
                    per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                    heldout_max_new_tokens=8, learning_rate=1e-3, lora_r=4, lora_alpha=8)  # fmt: skip


@dataclass
class Variant:
    """One line of the table: a label, its plugin entry (None for a baseline) and reward columns."""

    label: str
    plugin: str | None
    options: dict[str, Any]
    rewards: list[str]
    note: str = ""
    trainer: dict[str, Any] = field(default_factory=dict)  # `trl grpo` keys (shared with its baseline)

    @property
    def baseline(self) -> str:
        label = "grpo" if self.rewards == [ACC] else "grpo+" + "+".join(r.removeprefix("arithmetic_") for r in
                                                                         self.rewards[1:])  # fmt: skip
        return label + "".join(f"@{key}={value}" for key, value in sorted(self.trainer.items()))


def run_config(settings: Settings, variant: Variant, seed: int, output_dir: str) -> dict[str, Any]:
    """The ``trl-credit train`` YAML of one run."""
    import torch

    config: dict[str, Any] = {
        "model_name_or_path": settings.model, "dtype": "float32", "bf16": False,
        "use_peft": True, "lora_r": settings.lora_r, "lora_alpha": settings.lora_alpha,
        "lora_dropout": settings.lora_dropout,
        "lora_target_modules": "all-linear",
        "dataset_name": settings.dataset, "reward_funcs": list(variant.rewards),
        "output_dir": output_dir, "max_steps": settings.steps, "learning_rate": settings.learning_rate, "beta": 0.0,
        "per_device_train_batch_size": settings.per_device_train_batch_size,
        "num_generations": settings.num_generations, "max_completion_length": settings.max_completion_length,
        "temperature": settings.temperature, "logging_steps": 1, "save_strategy": "no", "report_to": "none",
        "use_cpu": not torch.cuda.is_available(), "gradient_checkpointing": False, "seed": seed,
        "heldout_samples": 0, "heldout_max_new_tokens": settings.heldout_max_new_tokens, **settings.extra,
        **variant.trainer,
    }  # fmt: skip
    if variant.plugin is not None:
        config["plugins"] = [{"name": variant.plugin, **variant.options}]
    return config


def fingerprint(settings: Settings, variant: Variant, seed: int) -> str:
    described = asdict(variant)
    if not described["trainer"]:  # runs made before the field existed keep their fingerprint
        del described["trainer"]
    text = json.dumps({"settings": asdict(settings), "variant": described, "seed": seed}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ====================================================================== the plan
def plan(
    settings: Settings, selected: list[str] | None, out: Path, quick: bool
) -> tuple[list[Variant], dict[str, str]]:
    """Variants to run (baselines first) and ``{plugin: reason}`` for the ones that do not apply."""
    from trl_credit.plugins import available

    installed = sorted(name for name, info in available().items() if not info.builtin)
    skipped: dict[str, str] = {}
    if selected is not None:
        for name in selected:
            if name not in installed:
                skipped[name] = "not installed (pip install trl-credit-" + name.replace("_", "-") + ")"
        candidates = [n for n in selected if n in installed]
    else:
        candidates = installed
        if quick:  # the two best-known plugins that apply
            order = {n: i for i, n in enumerate(QUICK_PREFERENCE)}
            candidates = sorted(installed, key=lambda n: (order.get(n, len(order)), n))
    variants: list[Variant] = []
    check_dir = out / "validate"
    check_dir.mkdir(parents=True, exist_ok=True)
    for name in candidates:
        preset = PRESETS.get(name, {})
        if "skip" in preset:
            skipped[name] = preset["skip"]
            continue
        variant = Variant(name, name, dict(preset.get("options", {})), list(preset.get("rewards", [ACC])),
                          preset.get("note", ""), dict(preset.get("trainer", {})))  # fmt: skip
        reason = _validate(settings, variant, check_dir)
        if reason:
            skipped[name] = reason
            continue
        variants.append(variant)
        if quick and selected is None and len(variants) == 2:
            break
    baselines = {"grpo": Variant("grpo", None, {}, [ACC], "baseline")}
    for variant in variants:
        baselines.setdefault(variant.baseline, Variant(variant.baseline, None, {}, variant.rewards, "baseline",
                                                       dict(variant.trainer)))  # fmt: skip
    lines = [baselines[label] for label in sorted(baselines)]
    return lines + variants, skipped


def _validate(settings: Settings, variant: Variant, folder: Path) -> str | None:
    """None when ``trl-credit validate`` accepts the variant's config, else the first problem."""
    import yaml

    from trl_credit.config import ConfigError
    from trl_credit.app.train_command import validate

    path = folder / f"{variant.label}.yaml"
    path.write_text(yaml.safe_dump(run_config(settings, variant, 0, str(folder / "unused")), sort_keys=False))
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            validate(str(path))
    except ConfigError as exc:
        first = exc.problems[0].split("\n")[0]
        origin = "preset" if variant.label in PRESETS else "defaults"
        return f"rejected by `trl-credit validate` with its {origin}: {first.split(': ', 1)[-1]}"
    return None


# ====================================================================== one run
def run_one(settings: Settings, variant: Variant, seed: int, out: Path, log) -> dict[str, Any]:
    """Train and evaluate one (variant, seed) from scratch (`run_all` skips the finished ones first)."""
    import yaml

    from trl_credit.app.eval_command import run_eval
    from trl_credit.app.train_command import train

    folder = out / "runs" / variant.label / f"seed{seed}"
    result_path = folder / "result.json"
    stamp = fingerprint(settings, variant, seed)
    if result_path.exists():  # not `finished`: made with other settings
        log(f"  {variant.label} seed {seed}: settings changed, redoing")
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    config_path = folder.parent / f"seed{seed}.yaml"
    config_path.write_text(yaml.safe_dump(run_config(settings, variant, seed, str(folder)), sort_keys=False))
    log(f"  {variant.label} seed {seed}: training {settings.steps} steps")
    clock = time.time()
    metrics = train(str(config_path))
    history = metrics["log_history"]
    evaluation = run_eval(str(folder), n=settings.samples_per_prompt, ks=_ks(settings.samples_per_prompt),
                          json_path=str(folder / "eval_test.json"))  # fmt: skip
    steps = [h for h in history if "loss" in h and "step" in h]
    completions = settings.per_device_train_batch_size
    generated = sum(h.get("completions/mean_length", 0.0) * completions + h.get("trl_credit/extra_tokens", 0.0)
                    for h in steps)  # fmt: skip
    result = {
        "label": variant.label, "plugin": variant.plugin, "options": variant.options, "rewards": variant.rewards,
        "baseline": variant.baseline, "seed": seed, "fingerprint": stamp,
        "heldout_after": evaluation["greedy_accuracy"],
        "pass_at_k_after": evaluation.get("pass_at_k"),
        "steps": len(steps), "completions_per_step": completions,
        "generated_tokens": round(generated, 1),
        "token_budget": settings.steps * completions * settings.max_completion_length,
        "train_seconds": metrics["train_seconds"], "seconds_per_step": metrics["seconds_per_step"],
        "wall_seconds": round(time.time() - clock, 1),
        "verifier_curve": [[h["step"], h.get(f"rewards/{ACC}/mean")] for h in steps],
        "reward_curve": [[h["step"], h.get("reward")] for h in steps],
        "kept_fraction": [h.get("trl_credit/kept_fraction") for h in steps],
    }  # fmt: skip
    result_path.write_text(json.dumps(result, indent=2) + "\n")
    log(f"  {variant.label} seed {seed}: held-out after {result['heldout_after']:.3f} "
        f"({result['wall_seconds']} s)")  # fmt: skip
    return result


def finished(settings: Settings, variant: Variant, seed: int, out: Path) -> dict[str, Any] | None:
    """The stored result of (variant, seed) when it was made with these settings, else None."""
    path = out / "runs" / variant.label / f"seed{seed}" / "result.json"
    if not path.exists():
        return None
    done = json.loads(path.read_text())
    return done if done.get("fingerprint") == fingerprint(settings, variant, seed) else None


def _log(message: str) -> None:
    print(f"[learning {time.strftime('%H:%M:%S')}] {message}", flush=True)


def _run_in_worker(settings: Settings, variant: Variant, seed: int, out: Path, threads: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    return run_one(settings, variant, seed, out, _log)


def run_all(settings: Settings, tasks: list[tuple[Variant, int]], out: Path, jobs: int, threads: int,
            log) -> tuple[list[dict[str, Any] | None], dict[str, str]]:
    """Every (variant, seed) in ``tasks``, in order; ``jobs`` > 1: that many worker processes, each with
    ``threads`` torch threads and a fresh process per run (on 2 cores two 1-thread runs side by side do
    ~1.9x the work of one 2-thread run: the small matmuls of a 135M model do not use a second thread).

    A run that raises is logged and reported, not fatal: ``(results with None for it, {"label/seedK": error})``.
    """
    results: list[dict[str, Any] | None] = [finished(settings, variant, seed, out) for variant, seed in tasks]
    for (variant, seed), done in zip(tasks, results):
        if done is not None:
            log(f"  {variant.label} seed {seed}: done already ({out / 'runs' / variant.label / f'seed{seed}'})")
    todo = [i for i, done in enumerate(results) if done is None]
    failures: dict[str, str] = {}

    def record(i: int, exc: BaseException) -> None:
        variant, seed = tasks[i]
        error = f"{type(exc).__name__}: {exc}".split("\n")[0]
        failures[f"{variant.label}/seed{seed}"] = error
        log(f"  {variant.label} seed {seed}: FAILED: {error}")

    if jobs <= 1:
        for i in todo:
            try:
                results[i] = run_one(settings, *tasks[i], out, log)
            except Exception as exc:  # noqa: BLE001 - reported in the table
                record(i, exc)
        return results, failures
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context, max_tasks_per_child=1) as pool:
        futures = {i: pool.submit(_run_in_worker, settings, *tasks[i], out, threads) for i in todo}
        for i, future in futures.items():
            try:
                results[i] = future.result()
            except Exception as exc:  # noqa: BLE001 - reported in the table
                record(i, exc)
    return results, failures


def _ks(n: int) -> list[int]:
    return sorted({1, n}) if n else [1]


def base_accuracy(settings: Settings, out: Path, log) -> dict[str, Any]:
    """Greedy held-out accuracy of the base model (one number: every run starts from it)."""
    import yaml

    from trl_credit.app.eval_command import run_eval

    path = out / "base_eval.json"
    variant = Variant("grpo", None, {}, [ACC])
    stamp = hashlib.sha256(json.dumps([settings.model, settings.dataset, settings.heldout_max_new_tokens,
                                       settings.samples_per_prompt]).encode()).hexdigest()[:16]  # fmt: skip
    if path.exists():
        done = json.loads(path.read_text())
        if done.get("fingerprint") == stamp:
            return done
    config = out / "base.yaml"
    config.write_text(yaml.safe_dump(run_config(settings, variant, 0, str(out / "base")), sort_keys=False))
    log("base model: held-out accuracy")
    evaluation = run_eval(str(config), n=settings.samples_per_prompt, ks=_ks(settings.samples_per_prompt),
                          json_path=str(out / "base_eval_full.json"))  # fmt: skip
    done = {"fingerprint": stamp, "heldout": evaluation["greedy_accuracy"], "pass_at_k": evaluation.get("pass_at_k"),
            "num_prompts": evaluation["num_prompts"], "seconds": evaluation["seconds"]["total"]}  # fmt: skip
    path.write_text(json.dumps(done, indent=2) + "\n")
    log(f"base model: held-out accuracy {done['heldout']:.3f} on {done['num_prompts']} prompts")
    return done


# ====================================================================== summary
def _stats(values: list[float]) -> dict[str, Any]:
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0}
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values)}  # fmt: skip


def summarise(variants: list[Variant], results: dict[str, list[dict]], base: dict[str, Any]) -> dict[str, Any]:
    rows = {}
    for variant in variants:
        runs = results.get(variant.label, [])
        after = _stats([r["heldout_after"] for r in runs])
        row = {"label": variant.label, "plugin": variant.plugin, "options": variant.options, "trainer": variant.trainer,
               "rewards": variant.rewards, "baseline": None if variant.plugin is None else variant.baseline,
               "note": variant.note, "seeds": [r["seed"] for r in runs], "heldout_before": base["heldout"],
               "heldout_after": after,
               "train_verifier_last5": _stats([_tail_mean(r["verifier_curve"]) for r in runs]),
               "generated_tokens": _stats([r["generated_tokens"] for r in runs]),
               "seconds_per_step": _stats([r["seconds_per_step"] for r in runs])}  # fmt: skip
        if variant.plugin is not None:
            reference = {r["seed"]: r["heldout_after"] for r in results.get(variant.baseline, [])}
            paired = [r["heldout_after"] - reference[r["seed"]] for r in runs if r["seed"] in reference]
            row["delta_vs_baseline"] = _stats(paired)
        rows[variant.label] = row
    return rows


def _tail_mean(curve: list[list[Any]], last: int = 5) -> float | None:
    values = [v for _, v in curve[-last:] if v is not None]
    return statistics.fmean(values) if values else None


def _f(x: float | None, digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def markdown(summary: dict[str, Any], skipped: dict[str, str], settings: Settings, base: dict[str, Any],
             figure: str | None, missing: list[str] | None = None) -> str:
    """The results table (and what did not run), as markdown."""
    lines = [
        f"Model `{settings.model}`, dataset `{settings.dataset}`, LoRA r={settings.lora_r}, lr "
        f"{settings.learning_rate}, beta 0, {settings.steps} steps of {settings.per_device_train_batch_size} "
        f"completions ({settings.num_generations} per prompt, at most {settings.max_completion_length} tokens, "
        f"temperature {settings.temperature}); held-out: greedy, {base['num_prompts']} prompts, "
        f"verifier `{ACC}`. Base model (before any training, every run): **{_f(base['heldout'])}**.",
        "",
        "| run | options / note | reward columns | seeds | held-out before | held-out after (mean ± std) | "
        "after min-max | Δ vs baseline (paired by seed, mean ± std) | train accuracy reward, last 5 steps | "
        "generated tokens per run | s/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in summary.values():
        after, delta = row["heldout_after"], row.get("delta_vs_baseline")
        options = ", ".join(f"{k}={v}" for k, v in [*row["options"].items(), *row.get("trainer", {}).items()])
        note = "; ".join(x for x in (options, row["note"]) if x)
        delta_text = "—" if delta is None else (
            f"{delta['mean']:+.3f} ± {delta['std']:.3f} (vs {row['baseline']})" if delta["n"] else "n/a")
        lines.append(
            f"| {row['label']} | {note or '—'} | {', '.join(row['rewards'])} | {len(row['seeds'])} | "
            f"{_f(row['heldout_before'])} | {_f(after['mean'])} ± {_f(after['std'])} | "
            f"{_f(after['min'])}-{_f(after['max'])} | {delta_text} | {_f(row['train_verifier_last5']['mean'])} | "
            f"{_f(row['generated_tokens']['mean'], 0)} | {_f(row['seconds_per_step']['mean'], 1)} |"
        )  # fmt: skip
    if missing:
        lines += ["", f"**Partial:** {len(missing)} planned runs are missing from this table (failed, or not "
                  f"finished when a `--report-only` table was made): {'; '.join(missing)}."]  # fmt: skip
    if skipped:
        lines += ["", "Not run:", ""]
        lines += [f"- `{name}`: {reason}" for name, reason in sorted(skipped.items())]
    lines += ["", "std is the sample standard deviation over seeds (0 with one seed). The difference to the baseline "
              "is paired by seed (same LoRA initialisation and prompt order). `arithmetic_steps` is a "
              "deterministic stand-in for a process reward model (a rule-based equation checker), "
              "not a PRM."]  # fmt: skip
    if figure:
        lines += ["", f"![reward curves and held-out accuracy]({figure})"]
    return "\n".join(lines)


def plot(summary: dict[str, Any], results: dict[str, list[dict]], base: dict[str, Any], path: Path) -> None:
    """Left: training accuracy reward per step (mean over seeds, min-max band). Right: held-out after."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(summary)
    colours = plt.get_cmap("tab20")
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    try:
        for i, label in enumerate(labels):
            curves = [dict((s, v) for s, v in r["verifier_curve"] if v is not None) for r in results.get(label, [])]
            steps = sorted(set().union(*curves)) if curves else []
            if not steps:
                continue
            mean = [statistics.fmean([c[s] for c in curves if s in c]) for s in steps]
            low = [min(c[s] for c in curves if s in c) for s in steps]
            high = [max(c[s] for c in curves if s in c) for s in steps]
            style = "--" if summary[label]["plugin"] is None else "-"
            left.plot(steps, mean, style, color=colours(i % 20), label=label, linewidth=1.6)
            left.fill_between(steps, low, high, color=colours(i % 20), alpha=0.12)
        left.set_xlabel("step")
        left.set_ylabel(f"training reward {ACC} (mean over seeds)")
        left.set_ylim(-0.02, 1.02)
        left.grid(True, alpha=0.3)
        left.legend(fontsize=7, ncol=2, loc="best")
        means = [summary[label]["heldout_after"]["mean"] or 0.0 for label in labels]
        errors = [summary[label]["heldout_after"]["std"] or 0.0 for label in labels]
        right.barh(range(len(labels)), means, xerr=errors, color=[colours(i % 20) for i in range(len(labels))])
        for i, label in enumerate(labels):
            seeds = [r["heldout_after"] for r in results.get(label, [])]
            right.plot(seeds, [i] * len(seeds), "k.", markersize=4)
        right.axvline(base["heldout"], color="k", linestyle=":", label="base model (before)")
        right.set_yticks(range(len(labels)), labels, fontsize=8)
        right.invert_yaxis()
        right.set_xlim(0.0, 1.0)
        right.set_xlabel("held-out greedy accuracy after training\n(mean ± std; dots: seeds)")
        right.legend(fontsize=7, loc="lower right")
        right.grid(True, axis="x", alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, format="png", dpi=100)
    finally:
        plt.close(fig)


def update_docs(doc: Path, text: str) -> None:
    """Replace what is between the markers in ``doc`` with ``text``."""
    content = doc.read_text()
    if BEGIN not in content or END not in content:
        raise SystemExit(f"{doc}: markers {BEGIN} / {END} not found")
    head, rest = content.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")


def environment() -> dict[str, Any]:
    versions = {}
    for dist in ("torch", "transformers", "trl", "peft", "trl-credit"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    import torch

    return {"python": platform.python_version(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.is_available(), "versions": versions}  # fmt: skip


# ====================================================================== main
def parse_seeds(text: str) -> list[int]:
    """``"3"`` -> ``[0, 1, 2]``; ``"0,4"`` -> ``[0, 4]``."""
    if "," not in text:
        return list(range(int(text)))
    return [int(part) for part in text.split(",") if part.strip()]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/learning", help="output folder (runs, JSON, table, figure)")
    parser.add_argument("--plugins", default=None, help="comma-separated plugin names (default: every installed one)")
    parser.add_argument("--seeds", default=None, help="N (seeds 0..N-1) or a comma list (default: 3; quick: 1)")
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default: 10; quick: 2)")
    parser.add_argument("--model", default=None, help="model name or path (default: smollm2-135m-instruct)")
    parser.add_argument("--dataset", default=None,
                        help="dataset spec (default: arithmetic:max_value=50,seed=0,eval_n=100)")
    parser.add_argument("--samples-per-prompt", type=int, default=None,
                        help="also sampled pass@1 and pass@N with N samples per held-out prompt (default: 0, off)")
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 steps, 1 seed, 2 plugins (CI smoke run)")
    parser.add_argument("--docs", default=None,
                        help="markdown file whose learning-results section is replaced (default: docs/results.md; "
                             "quick: none; '' for none)")
    parser.add_argument("--list", action="store_true", help="print the plan (and what does not apply), train nothing")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per run (0: torch's default; with --jobs: cores // jobs)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs side by side in worker processes (default 1; 2 on a quiet 2-core machine)")
    parser.add_argument("--report-only", action="store_true",
                        help="train nothing: table, figure and docs from the runs already finished (partial)")
    args = parser.parse_args(argv)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    settings = quick_settings() if args.quick else Settings()
    settings.steps = args.steps or settings.steps
    settings.model = args.model or settings.model
    settings.dataset = args.dataset or settings.dataset
    if args.samples_per_prompt is not None:
        settings.samples_per_prompt = args.samples_per_prompt
    seeds = parse_seeds(args.seeds or ("1" if args.quick else "3"))
    selected = [p.strip() for p in args.plugins.split(",") if p.strip()] if args.plugins else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    log = _log
    started = time.time()
    variants, skipped = plan(settings, selected, out, args.quick)
    log(f"plan: {', '.join(v.label for v in variants)} x seeds {seeds}; not run: {', '.join(skipped) or 'none'}")
    for name, reason in skipped.items():
        log(f"  {name}: {reason}")
    if args.list:
        return {"variants": [asdict(v) for v in variants], "not_run": skipped}

    base = base_accuracy(settings, out, log)
    tasks = [(variant, seed) for seed in seeds for variant in variants]  # seed-major: an interrupted job
    missing: list[str] = []
    if args.report_only:  # has every variant at the first seeds
        done = [(task, finished(settings, *task, out)) for task in tasks]
        missing = [f"{variant.label}/seed{seed}" for (variant, seed), result in done if result is None]
        log(f"report only: {len(tasks) - len(missing)} of {len(tasks)} runs finished; missing: "
            f"{', '.join(missing) or 'none'}")  # fmt: skip
        pairs = [(task, result) for task, result in done if result is not None]
    else:
        threads = args.threads or max(1, (os.cpu_count() or 1) // max(1, args.jobs))
        ran, failures = run_all(settings, tasks, out, args.jobs, threads, log)
        pairs = [(task, result) for task, result in zip(tasks, ran) if result is not None]
        missing = [f"{name} (failed: {error})" for name, error in failures.items()]
    results: dict[str, list[dict]] = {}
    for (variant, _), result in pairs:
        results.setdefault(variant.label, []).append(result)
    summary = summarise(variants, results, base)
    figure = out / "reward_curves.png"
    plot(summary, results, base, figure)
    docs = args.docs if args.docs is not None else ("" if args.quick else str(ROOT / "docs" / "results.md"))
    report = {"settings": asdict(settings), "seeds": seeds, "environment": environment(), "base": base,
              "variants": summary, "not_run": skipped, "runs": results,
              "missing": missing, "seconds": round(time.time() - started, 1)}  # fmt: skip
    (out / "results.md").write_text(markdown(summary, skipped, settings, base, figure.name, missing) + "\n")
    if docs:
        doc = Path(docs)
        image = doc.parent / "img" / "learning_reward_curves.png"
        image.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(figure, image)
        text = markdown(summary, skipped, settings, base, os.path.relpath(image, doc.parent), missing)
        command = " ".join(["python benchmarks/learning.py", *(argv if argv is not None else sys.argv[1:])])
        text += f"\n\nGenerated by `{command}` on {time.strftime('%Y-%m-%d')}."
        update_docs(doc, text)
        report["docs"] = str(doc)
    (out / "results.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    log(f"done in {report['seconds']} s: {out / 'results.json'}, {out / 'results.md'}, {figure}")
    return report


if __name__ == "__main__":
    main()
