"""How much does trl-credit cost?  Two measurements, one report.

1. **Trainer overhead**: vanilla ``trl.GRPOTrainer`` vs ``trl_credit.CreditGRPOTrainer`` (no plugins unless
   ``--plugins``; on CPU the vanilla arm scores only the completion tokens, as the host does), same seed, model
   and data, run in ABBA order (A B B A A B ...) so that slow drift of a shared machine hits both equally.
   Per-step wall time is the time between consecutive ``on_step_end`` callbacks (data loading, generation,
   scoring, the host's seams, backward, optimiser and logging); the first step of every run is a warm-up and is
   skipped. Reported: per-repeat ratio host/vanilla of the median step times (min / median / max) and the pooled
   ratio, for wall time and for process CPU time (less sensitive to other processes on the machine). Target with
   no plugins: <= 1.02. On a busy machine both ratios are dominated by noise, so one more host run is profiled
   (``--profile-host``): the self time of the host's own functions per step is a machine-noise-free bound on the
   overhead.

2. **Hook cost**: one call of each hook family, through the host's `Pipeline` (so the host's own checks
   are included), on a synthetic `RolloutBatch` of N completions x T tokens (G completions per prompt),
   with tiny vectorised in-file plugins; plus the host's per-batch work that does not depend on plugins
   (`RolloutBatch.select` of the kept rows, `PromptStats.update`, the advantage scatter of the trainer's
   tail). Median of ``--calls`` calls, over ``--sizes``; a log-log slope shows linearity.
   Target: < 50 ms per hook at 8192 x 1024.

    python benchmarks/overhead.py                       # full run (minutes)
    python benchmarks/overhead.py --quick --json out.json
    python benchmarks/overhead.py --only hooks --sizes 1024x256,8192x1024 --threads 2
    python benchmarks/overhead.py --only trainer --model smollm2-135m-instruct --steps 3 --repeats 2

Threads: ``--threads`` (default 1) is applied with ``torch.set_num_threads`` to both parts. One thread
makes figures reproducible on a shared machine and is the worst case for the hooks (they are vectorised
tensor code that only gets faster with more threads); ``--threads 0`` keeps torch's default.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import torch

TRAINER_TARGET = 1.02
PLUGIN_TARGET = 1.05  # host + one pure-math plugin vs vanilla
HOOK_TARGET_MS = 50.0
DEFAULT_SIZES = "1024x256,8192x256,8192x1024"
TARGET_SIZE = "8192x1024"
SCALING_SIZES = "1024x256,1024x1024,8192x256,8192x1024,65536x256,65536x1024"  # --sizes scaling
QUICK_SIZES = "64x32,256x64"


# ====================================================================== environment
def environment() -> dict[str, Any]:
    versions = {}
    for dist in ("torch", "transformers", "trl", "accelerate", "pluggy", "trl-credit"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        load = list(os.getloadavg())
    except OSError:
        load = None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "loadavg_at_start": load,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": versions,
    }


def _loadavg() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except OSError:
        return None


# ====================================================================== 1. trainer overhead
def _step_timer(profiler=None):
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Wall and process-CPU time between consecutive on_step_end events (the first starts at on_train_begin).

        CPU time (all threads of this process) is far less sensitive than wall time to other processes
        competing for the cores, so both are reported.
        """

        def __init__(self, profiler=None) -> None:
            self.marks: list[tuple[float, float]] = []
            self.profiler = profiler

        def on_train_begin(self, args, state, control, **kwargs):
            self.marks = [(time.perf_counter(), time.process_time())]

        def on_step_end(self, args, state, control, **kwargs):
            self.marks.append((time.perf_counter(), time.process_time()))
            if self.profiler is not None and len(self.marks) == 2:  # after the warm-up step
                self.profiler.enable()

        def on_train_end(self, args, state, control, **kwargs):
            if self.profiler is not None:
                self.profiler.disable()

        @property
        def step_seconds(self) -> list[float]:
            return [b[0] - a[0] for a, b in zip(self.marks, self.marks[1:])]

        @property
        def step_cpu_seconds(self) -> list[float]:
            return [b[1] - a[1] for a, b in zip(self.marks, self.marks[1:])]

    return StepTimer(profiler)


def _vanilla_class():
    """TRL's `GRPOTrainer`, scoring as the host does on CPU (only the completion tokens, the same log-probs), so
    the host/vanilla ratio measures the seams and not that scoring change (`trl_credit/trainer.py`)."""
    from trl import GRPOTrainer

    from trl_credit.trainer import ValidPositionScoring

    class VanillaGRPOTrainer(ValidPositionScoring, GRPOTrainer):
        pass

    return VanillaGRPOTrainer


def _train_once(kind: str, model: str, dataset: Any, steps: int, args: argparse.Namespace, out_dir: str,
                profile: bool = False) -> dict:
    """One run of ``steps`` optimiser steps (the first is the warm-up); returns per-step seconds and logs.

    ``profile``: run the steps after the warm-up under cProfile and return the self time (``tottime``)
    of every function defined in the ``trl_credit`` package, i.e. the host's own Python work.
    """
    from trl import GRPOConfig

    from trl_credit.app.rewards import arithmetic_accuracy
    from trl_credit.trainer import CreditGRPOTrainer

    config = GRPOConfig(
        output_dir=out_dir,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,  # TRL defaults to bf16 autocast, which crawls on CPUs without bf16 units
        logging_steps=1,
        max_steps=steps,
        max_completion_length=args.max_completion_length,
        per_device_train_batch_size=8,
        num_generations=4,
        learning_rate=1e-5,
        seed=args.seed,
        disable_tqdm=True,
        **getattr(args, "grpo_overrides", {}),  # vanilla and host alike
    )
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
    timer = _step_timer(profiler)
    rewards = [arithmetic_accuracy, *getattr(args, "extra_rewards", [])]
    common = dict(model=model, reward_funcs=rewards, args=config, train_dataset=dataset, callbacks=[timer])
    if kind == "vanilla":
        trainer = _vanilla_class()(**common)
    else:
        trainer = CreditGRPOTrainer(**common, plugins=list(args.plugins or []))
    trainer.train()
    logs = [{k: v for k, v in row.items() if k in ("loss", "reward", "step_time", "completions/mean_length")}
            for row in trainer.state.log_history if "loss" in row]
    # the host's own timing of every plugin's hook calls (and the scoring they trigger), per step
    hook_seconds = [sum(v for k, v in row.items() if k.startswith("trl_credit/") and k.endswith("/seconds"))
                    for row in trainer.state.log_history if "loss" in row]
    del trainer
    out = {"step_seconds": timer.step_seconds, "step_cpu_seconds": timer.step_cpu_seconds, "logs": logs,
           "hook_seconds": hook_seconds[1:]}  # warm-up step skipped
    if profiler is not None:
        out["host_self_seconds"], out["host_functions"] = _host_self_time(profiler)
    return out


#: trl_credit modules that both trainers use alike (the reward function, data, models): not host overhead
NOT_HOST = {"rewards.py", "data.py", "models.py", "evaluate.py"}


def _host_self_time(profiler) -> tuple[float, dict[str, float]]:
    """Total cProfile self time of the host's functions (trl_credit, minus `NOT_HOST`), and the top ones (ms)."""
    import pstats

    import trl_credit

    root = os.path.dirname(os.path.abspath(trl_credit.__file__))
    per_function = {}
    for (filename, line, name), (_, _, tottime, _, _) in pstats.Stats(profiler).stats.items():
        path = os.path.abspath(filename)
        if path.startswith(root + os.sep) and os.path.basename(path) not in NOT_HOST:
            per_function[f"{os.path.relpath(filename, root)}:{line}({name})"] = tottime
    top = dict(sorted(((k, 1000.0 * v) for k, v in per_function.items()), key=lambda kv: -kv[1])[:8])
    return sum(per_function.values()), top


def trainer_overhead(args: argparse.Namespace) -> dict[str, Any]:
    from trl_credit.app.data import make_arithmetic
    from trl_credit.app.models import resolve_model
    from trl_credit.testing.tiny import tiny_model_path

    model = tiny_model_path() if args.model in (None, "tiny") else resolve_model(args.model)
    dataset = make_arithmetic(n=256, seed=args.seed)
    for column, fn in getattr(args, "extra_columns", {}).items():
        dataset = dataset.add_column(column, [fn(row) for row in dataset])
    steps = args.steps + 1  # + the warm-up step
    times: dict[str, list[list[float]]] = {"vanilla": [], "host": []}
    cpu: dict[str, list[list[float]]] = {"vanilla": [], "host": []}
    logs: dict[str, list] = {"vanilla": [], "host": []}
    hook_ms: list[float] = []
    order = []
    with tempfile.TemporaryDirectory(prefix="trl-credit-bench-") as tmp:
        if not args.quick:  # untimed run first: imports, allocator and caches warm up before A or B is timed
            _train_once("vanilla", model, dataset, 2, args, os.path.join(tmp, "warm"))
        for r in range(args.repeats):
            pair = ("vanilla", "host") if r % 2 == 0 else ("host", "vanilla")  # ABBA: cancels linear drift
            for kind in pair:
                order.append(kind)
                run = _train_once(kind, model, dataset, steps, args, os.path.join(tmp, f"{kind}{r}"))
                times[kind].append([1000.0 * s for s in run["step_seconds"][1:]])  # skip the warm-up step
                cpu[kind].append([1000.0 * s for s in run["step_cpu_seconds"][1:]])
                logs[kind].append(run["logs"])
                if kind == "host":
                    hook_ms += [1000.0 * x for x in run["hook_seconds"]]
                print(f"  repeat {r + 1}/{args.repeats} {kind:7s}: step ms wall "
                      + " ".join(f"{t:.0f}" for t in times[kind][-1]) + "  cpu "
                      + " ".join(f"{t:.0f}" for t in cpu[kind][-1]), flush=True)
        profiled = None
        if args.profile_host:  # a deterministic bound that does not depend on the machine's noise
            run = _train_once("host", model, dataset, steps, args, os.path.join(tmp, "profiled"), profile=True)
            profiled = {"host_self_ms_per_step": 1000.0 * run["host_self_seconds"] / args.steps,
                        "top_functions_ms_total": run["host_functions"]}
    ratios = [statistics.median(h) / statistics.median(v) for h, v in zip(times["host"], times["vanilla"])]
    pooled_v = statistics.median([t for run in times["vanilla"] for t in run])
    pooled_h = statistics.median([t for run in times["host"] for t in run])
    cpu_ratios = [statistics.median(h) / statistics.median(v) for h, v in zip(cpu["host"], cpu["vanilla"])]
    cpu_v = statistics.median([t for run in cpu["vanilla"] for t in run])
    cpu_h = statistics.median([t for run in cpu["host"] for t in run])
    identical = all(_same_logs(a, b) for a, b in zip(logs["vanilla"], logs["host"])) if not args.plugins else None
    return {
        "model": model,
        "plugins": list(args.plugins or []),
        "steps": args.steps,
        "repeats": args.repeats,
        "warmup_steps_skipped": 1,
        "max_completion_length": args.max_completion_length,
        "order": order,
        "vanilla_step_ms": times["vanilla"],
        "host_step_ms": times["host"],
        "vanilla_median_ms": pooled_v,
        "host_median_ms": pooled_h,
        "ratios": ratios,
        "ratio_min": min(ratios),
        "ratio_median": statistics.median(ratios),
        "ratio_max": max(ratios),
        "ratio_pooled": pooled_h / pooled_v,
        "vanilla_step_cpu_ms": cpu["vanilla"],
        "host_step_cpu_ms": cpu["host"],
        "vanilla_median_cpu_ms": cpu_v,
        "host_median_cpu_ms": cpu_h,
        "cpu_ratios": cpu_ratios,
        "cpu_ratio_min": min(cpu_ratios),
        "cpu_ratio_median": statistics.median(cpu_ratios),
        "cpu_ratio_max": max(cpu_ratios),
        "cpu_ratio_pooled": cpu_h / cpu_v,
        "identical_losses_and_rewards": identical,
        # noise-free view: plugin hooks (+ scoring they trigger) timed by the host, per step, vs a vanilla step
        "plugin_hook_ms_per_step": statistics.median(hook_ms) if hook_ms else 0.0,
        "hook_bound_ratio": 1.0 + (statistics.median(hook_ms) if hook_ms else 0.0) / cpu_v,
        "host_profile": profiled,
        "host_self_fraction": (profiled["host_self_ms_per_step"] / cpu_v) if profiled else None,
        "target_ratio": TRAINER_TARGET,
        "loadavg_at_end": _loadavg(),
    }


def _same_logs(a: list[dict], b: list[dict]) -> bool:
    keys = ("loss", "reward", "completions/mean_length")
    return len(a) == len(b) and all(x.get(k) == y.get(k) for x, y in zip(a, b) for k in keys)


# ====================================================================== 2. hook cost: in-file plugins
def _plugins():
    """Tiny, realistic, vectorised plugins, one per hook family (defined lazily: imports trl_credit)."""
    from trl_credit.hookspecs import hookimpl

    class LengthShaper:
        """Shaper: appends a length-penalty column, -L/T_max, weight 0.1."""

        @hookimpl
        def shape_rewards(self, batch):
            lengths = batch.completion_lengths.to(torch.float32)
            return {"length_penalty": (-lengths / batch.max_completion_length, 0.1)}

    class ConstantGroupFilter:
        """Group filter (DAPO dynamic sampling): drops groups whose total rewards are all equal."""

        @hookimpl
        def filter_rollouts(self, batch):
            r = batch.grouped(batch.total_reward())
            return r.amax(dim=1) != r.amin(dim=1)

    class EntropyTokenCredit:
        """Token transform (N,) -> (N, T): A_i * H_it / mean_t(H_i) on valid tokens, 0 on padding (GTPO/EMPG-like).

        Written as a careful author would on CPU: one (N, T) allocation, the rest in place.
        """

        @hookimpl
        def transform_advantages(self, batch, advantages):
            mask = batch.completion_mask
            out = mask.to(torch.float32).mul_(batch.policy_entropies())  # H * mask
            mean_h = out.sum(1) / mask.sum(1).clamp(min=1)
            return out.mul_((advantages / mean_h.clamp(min=1e-6)).unsqueeze(1))

    class AccuracyKL:
        """KL coefficient: beta = 0.01 + 0.04 * accuracy of the kept completions (FG-ExPO-like)."""

        @hookimpl
        def kl_coefficient(self, batch):
            acc = (batch.total_reward()[batch.kept] >= 0.5).float().mean()
            return 0.01 + 0.04 * float(acc)

    class VarianceCurriculum:
        """Curriculum: weight p(1-p) of the pass rate (+ floor), unseen prompts weight 1."""

        @hookimpl
        def prompt_weights(self, stats, step):
            p = stats.pass_rate()
            return torch.where(torch.isnan(p), torch.ones_like(p), 4.0 * p * (1.0 - p) + 0.05)

    class StatsObserver:
        """Observers: advantage statistics at batch end, a linear schedule at step end."""

        def __init__(self) -> None:
            self.temperature = 1.0

        @hookimpl
        def on_batch_end(self, batch, advantages):
            lo, hi = torch.aminmax(advantages)  # no (N, T) temporaries
            per_seq = advantages.sum(1) / batch.completion_lengths.clamp(min=1) if advantages.dim() == 2 else advantages
            batch.log_metric("max_abs_advantage", max(-lo.item(), hi.item()), plugin=self)
            batch.log_metric("mean_abs_seq_advantage", per_seq.abs().mean().item(), plugin=self)
            batch.log_metric("kept", batch.kept.float().mean().item(), plugin=self)

        @hookimpl
        def on_step_end(self, trainer, step, logs):
            self.temperature = max(0.1, 1.0 - 0.001 * step)

    return {
        "shaper": LengthShaper,
        "filter": ConstantGroupFilter,
        "transform": EntropyTokenCredit,
        "kl": AccuracyKL,
        "curriculum": VarianceCurriculum,
        "observer": StatsObserver,
    }


def _plugin_set(classes: dict[str, type]):
    """All given plugins registered on one manager, in order, exactly as `build_plugins` would."""
    from trl_credit.config import EnabledPlugin, PluginSet
    from trl_credit.plugins import implemented_hooks, new_manager

    manager = new_manager()
    enabled = []
    for i, (name, cls) in enumerate(classes.items()):
        instance = cls()
        manager.register(instance, name=name)
        enabled.append(EnabledPlugin(i, name, name, instance, implemented_hooks(cls)))
    manager.check_pending()
    return PluginSet(enabled, manager)


def parse_sizes(text: str) -> list[tuple[int, int]]:
    if text == "scaling":
        text = SCALING_SIZES
    sizes = []
    for item in text.split(","):
        n, _, t = item.strip().lower().partition("x")
        sizes.append((int(n), int(t)))
    return sizes


def build_batch(n: int, t: int, g: int, num_prompts: int, seed: int = 0):
    """Synthetic `RolloutBatch`: random ids, ragged lengths, binary rewards in 2 columns, random scores."""
    from trl_credit.testing import make_batch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 49152, (n, t), generator=gen)
    lengths = torch.randint(1, t + 1, (n,), generator=gen)
    mask = (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).long()
    ids = ids * mask
    rewards = torch.randint(0, 2, (n, 2), generator=gen).float()
    prompt_of_group = torch.randint(0, num_prompts, (n // g,), generator=gen)
    return make_batch(
        rewards, g,
        reward_names=["accuracy", "format"],
        completion_ids=ids,
        completion_mask=mask,
        logps=-torch.rand(n, t, generator=gen),
        entropies=torch.rand(n, t, generator=gen) * 3,
        prompt_index=prompt_of_group.repeat_interleave(g).tolist(),
        columns={"answer": ["1"] * n, "entities": [["Paris", "Berlin"]] * n},
    )


def _time(fn: Callable[[], Any], setup: Callable[[], Any] | None, calls: int) -> list[float]:
    """Milliseconds of ``calls`` timed calls of ``fn`` after one untimed one; ``setup`` runs untimed before each."""
    out = []
    for i in range(calls + 1):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        elapsed = 1000.0 * (time.perf_counter() - start)
        if i:
            out.append(elapsed)
    return out


#: family -> (description, what it scales with)
FAMILIES = {
    "shape_rewards": ("shaper: adds a length column", "N"),
    "filter_rollouts": ("filter: drop constant groups", "N"),
    "compute_advantages": ("built-in grpo, on the kept view", "N"),
    "transform_advantages": ("token credit (N,)->(N,T), view", "N*T"),
    "kl_coefficient": ("beta from the batch accuracy", "N"),
    "prompt_weights": ("curriculum over P prompts", "P"),
    "on_batch_end": ("observer: advantage stats", "N*T"),
    "on_step_end": ("observer: schedule", "1"),
    "host:select": ("RolloutBatch.select(kept)", "N*T"),
    "host:view_scores": ("view.policy_entropies() gather", "N*T"),
    "host:prompt_stats": ("total_reward+PromptStats.update", "N"),
    "host:scatter": ("advantage scatter of _finish", "N*T"),
    "all": ("one round, all plugins + host", "N*T"),
}


def hook_costs_at(n: int, t: int, g: int, num_prompts: int, calls: int, seed: int = 0) -> dict[str, Any]:
    """Median ms per call of every family at one size (with the plugin-body share where there is one)."""
    from trl_credit.batch import PromptStats
    from trl_credit.config import PluginSet
    from trl_credit.pipeline import Pipeline

    classes = _plugins()
    batch = build_batch(n, t, g, num_prompts, seed)
    base = (batch.rewards.clone(), list(batch.reward_names), batch.reward_weights.clone())

    def reset() -> None:
        batch.rewards, batch.reward_names, batch.reward_weights = base[0].clone(), list(base[1]), base[2].clone()
        batch.kept = torch.ones(n, dtype=torch.bool)
        batch.metrics.clear()

    stats = PromptStats.empty(num_prompts)
    gen = torch.Generator().manual_seed(seed + 1)
    for step in range(4):  # some history: seen, unseen, passed
        rows = torch.randint(0, num_prompts, (num_prompts // 2,), generator=gen)
        stats.update(rows, torch.randint(0, 2, rows.shape, generator=gen).double(), step)

    single = {k: Pipeline(_plugin_set({k: cls})) for k, cls in classes.items()}
    default = Pipeline(PluginSet())
    everything = Pipeline(_plugin_set(classes))
    reset()
    keep = single["filter"].filter_rollouts(batch)  # random binary rewards: (almost) every group is kept
    kept_rows = keep.nonzero().squeeze(1)
    view = batch.select(kept_rows)  # the host runs the estimator and the transforms on this view
    seq_adv = default.compute_advantages(view)
    view_adv = single["transform"].transform_advantages(view, seq_adv)  # (kept, T)
    tok_adv = torch.zeros(n, t)
    tok_adv[kept_rows] = view_adv

    def one_round() -> None:  # the host's per-round sequence (trainer._generate_and_score_completions tail)
        p = everything
        p.shape_rewards(batch)
        kept = p.filter_rollouts(batch)
        rows = kept.nonzero().squeeze(1)
        view = batch.select(rows)
        adv = p.transform_advantages(view, p.compute_advantages(view))
        full = torch.zeros(n, t) if adv.dim() == 2 else torch.zeros(n)
        full[rows] = adv
        p.kl_coefficient(batch)
        p.notify("on_batch_end", batch.step, batch=batch, advantages=full)
        stats.update(batch.prompt_index, batch.total_reward(), batch.step)

    def scatter() -> None:  # trainer._finish: advantages of the kept rows into the full (N, T) tensor
        full = torch.zeros(n, t)
        full[kept_rows] = view_adv

    def view_scores() -> None:  # what a plugin pays per batch.policy_entropies() call on the host's view (not cached)
        view.policy_entropies()

    cases: dict[str, tuple[Pipeline | None, Callable[[], Any]]] = {
        "shape_rewards": (single["shaper"], lambda: single["shaper"].shape_rewards(batch)),
        "filter_rollouts": (single["filter"], lambda: single["filter"].filter_rollouts(batch)),
        "compute_advantages": (default, lambda: default.compute_advantages(view)),
        "transform_advantages": (single["transform"], lambda: single["transform"].transform_advantages(view, seq_adv)),
        "kl_coefficient": (single["kl"], lambda: single["kl"].kl_coefficient(batch)),
        "prompt_weights": (single["curriculum"], lambda: single["curriculum"].prompt_weights(stats, 5)),
        "on_batch_end": (single["observer"], lambda: single["observer"].notify(
            "on_batch_end", 0, batch=batch, advantages=tok_adv)),
        "on_step_end": (single["observer"], lambda: single["observer"].notify(
            "on_step_end", 5, trainer=None, step=5, logs={"loss": 0.1})),
        "host:select": (None, lambda: batch.select(kept_rows)),
        "host:view_scores": (None, view_scores),
        "host:prompt_stats": (None, lambda: stats.update(batch.prompt_index, batch.total_reward(), 5)),
        "host:scatter": (None, scatter),
        "all": (everything, one_round),
    }
    out = {}
    for family, (pipeline, fn) in cases.items():
        plugin_ms: list[float] = []

        def setup(pipeline=pipeline) -> None:
            reset()
            if pipeline is not None:
                pipeline.seconds.clear()

        def call(pipeline=pipeline, fn=fn) -> None:
            fn()
            if pipeline is not None:
                plugin_ms.append(1000.0 * sum(pipeline.seconds.values()))

        ms = _time(call, setup, calls)
        row = {"ms": statistics.median(ms), "ms_min": min(ms), "ms_max": max(ms)}
        if pipeline is not None:
            row["plugin_ms"] = statistics.median(plugin_ms[1:])  # body of the plugin(s), without host checks
        out[family] = row
    out["kept_fraction"] = kept_rows.numel() / n
    return out


def hook_costs(args: argparse.Namespace) -> dict[str, Any]:
    sizes = parse_sizes(args.sizes)
    results = {}
    for n, t in sizes:
        print(f"  hooks at {n}x{t} ...", flush=True)
        results[f"{n}x{t}"] = hook_costs_at(n, t, args.group_size, args.prompts, args.calls, args.seed)
    families = {}
    for family, (what, scales) in FAMILIES.items():
        row = {"description": what, "scales_with": scales, "by_size": {}}
        for (n, t), key in zip(sizes, results):
            r = results[key][family]
            row["by_size"][key] = {**r, "ms_per_mtok": r["ms"] / (n * t / 1e6)}
        if len(sizes) > 1:  # log-log slope vs tokens between the smallest and the largest size
            (n0, t0), (n1, t1) = sizes[0], sizes[-1]
            a, b = results[f"{n0}x{t0}"][family]["ms"], results[f"{n1}x{t1}"][family]["ms"]
            row["slope_vs_tokens"] = math.log(b / a) / math.log((n1 * t1) / (n0 * t0)) if a > 0 and b > 0 and n1 * t1 != n0 * t0 else None
        families[family] = row
    keys = [f"{n}x{t}" for n, t in sizes]
    largest = TARGET_SIZE if TARGET_SIZE in keys else keys[-1]  # the target is stated at 8192 x 1024
    worst = max((f for f in families if f != "all" and not f.startswith("host:")),
                key=lambda f: families[f]["by_size"][largest]["ms"])
    return {
        "sizes": [f"{n}x{t}" for n, t in sizes],
        "group_size": args.group_size,
        "num_prompts": args.prompts,
        "calls": args.calls,
        "kept_fraction": {key: r["kept_fraction"] for key, r in results.items()},
        "families": families,
        "largest_size": largest,
        "slowest_hook": worst,
        "slowest_hook_ms": families[worst]["by_size"][largest]["ms"],
        "target_ms": HOOK_TARGET_MS,
        "loadavg_at_end": _loadavg(),
    }


# ====================================================================== 1b. trainer overhead per plugin
#: Plugins that score the model (an extra no-grad forward pass per batch) or generate more: not pure maths.
SCORING = {"drpo": "policy log-probs", "gtpo": "policy entropies"}  # fg_expo's AKL would score the reference:
# its preset below turns AKL off (the tiny run has no reference model), so it is measured as a curriculum


def process_score(completions, **kwargs):
    """Stand-in process/thinking score in [0, 1] (a hash of the text), given to vanilla and host alike in the
    per-plugin runs: the tiny model's accuracy is always 0, this makes groups vary so filters keep some."""
    import zlib

    from trl_credit.app.rewards import completion_text

    return [(zlib.crc32(completion_text(c).encode()) % 11) / 10 for c in completions]


#: name -> what a plugin needs in the benchmark's tiny run: options, extra reward functions, dataset columns.
#: Filters run in mask-only mode: refill would generate more and measure generation, not the host.
ACC, PROC = "arithmetic_accuracy", "process_score"
TRAINER_PRESETS: dict[str, dict[str, Any]] = {
    "dynamic_sampling": {"options": {"mode": "filter"}},
    "accuracy_band": {"options": {"refill": False}},
    "riskpo": {"options": {"bundle_size": 2}},
    "drpo": {"options": {"reward": ACC}, "args": {"loss_type": "grpo"}},  # its gradient identity needs grpo
    "p_grpo": {"options": {"outcome_reward": ACC, "process_reward": PROC}},
    "trust_grpo": {"options": {"answer_reward": ACC, "thinking_reward": PROC}},
    "e_grpo": {"options": {"correct_reward": ACC}, "columns": {"entities": lambda row: [row["answer"]]}},
    "fg_expo": {"options": {"akl": False}},  # AKL needs a reference pass (PEFT or beta > 0): not pure maths
}


def each_plugin_overhead(args: argparse.Namespace) -> dict[str, Any]:
    """`trainer_overhead` once per installed plugin (host with that plugin alone vs vanilla TRL)."""
    from trl_credit.plugins import available

    names = args.each_plugin or sorted(n for n, a in available().items() if not a.builtin)
    results = {}
    for name in names:
        preset = TRAINER_PRESETS.get(name, {})
        options = preset.get("options", {})
        sub = argparse.Namespace(**vars(args))
        sub.plugins = [{"name": name, **options}]
        sub.extra_rewards = [process_score]
        sub.extra_columns = preset.get("columns", {})
        sub.grpo_overrides = preset.get("args", {})
        sub.profile_host = False
        print(f"\n  plugin {name} {options or ''}", flush=True)
        try:
            res = trainer_overhead(sub)
        except Exception as exc:  # report and go on: one plugin's preset must not hide the others
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"  {name}: failed: {exc}")
            continue
        res["pure_math"] = name not in SCORING
        res["scores"] = SCORING.get(name)
        res["target_ratio"] = PLUGIN_TARGET if name not in SCORING else None
        results[name] = res
    return results


def print_each_plugin(results: dict[str, Any]) -> None:
    print(f"\nPer-plugin trainer overhead (host with one plugin / vanilla TRL; wall and CPU ratio min / median / max; "
          f"target <= {PLUGIN_TARGET} for pure-math plugins). hooks = the plugin's hook time per step as the host "
          "times it (with any scoring it triggers); bound = 1 + hooks / vanilla CPU step: the ratio without machine noise")
    for name, r in results.items():
        if "error" in r:
            print(f"  {name:24s} error: {r['error']}")
            continue
        kind = "pure maths" if r["pure_math"] else f"scores {r['scores']}"
        print(f"  {name:24s} wall {r['ratio_min']:.3f} / {r['ratio_median']:.3f} / {r['ratio_max']:.3f}   "
              f"cpu {r['cpu_ratio_min']:.3f} / {r['cpu_ratio_median']:.3f} / {r['cpu_ratio_max']:.3f}   "
              f"hooks {r['plugin_hook_ms_per_step']:7.2f} ms/step (bound {r['hook_bound_ratio']:.4f})   {kind}")


# Options some installed plugins need on the synthetic batch (2 binary reward columns, 1,024 groups of 8).
BENCH_OPTIONS = {"riskpo": {"bundle_size": 8}, "drpo": {"reward": "accuracy"},
                 "p_grpo": {"outcome_reward": "accuracy", "process_reward": "format"},
                 "trust_grpo": {"answer_reward": "accuracy", "thinking_reward": "format"},
                 "e_grpo": {"correct_reward": "accuracy"}, "g_ra": {"outcome": "accuracy"}}


def installed_plugin_costs(args: argparse.Namespace) -> dict[str, Any]:
    """Median ms of one host round per installed plugin: shape -> filter -> estimator -> transforms -> KL
    coefficient -> on_batch_end, plus one curriculum draw over ``--prompts`` prompts."""
    from trl_credit.batch import PromptStats
    from trl_credit.pipeline import Pipeline, kept_advantages
    from trl_credit.plugins import available
    from trl_credit.testing import plugin_set

    names = args.installed or sorted(n for n, a in available().items() if not a.builtin)
    keys = [f"{a}x{b}" for a, b in parse_sizes(args.sizes)]
    n, t = parse_sizes(TARGET_SIZE if TARGET_SIZE in keys else keys[-1])[0]
    stats = PromptStats.empty(args.prompts)
    gen = torch.Generator().manual_seed(args.seed + 1)
    rows = torch.randint(0, args.prompts, (args.prompts // 2,), generator=gen)
    stats.update(rows, torch.randint(0, 2, rows.shape, generator=gen).double(), 0)
    stats.prompts_per_batch = n // args.group_size
    out = {}
    print(f"\ninstalled plugins, one host round at {n}x{t} (median ms, target {HOOK_TARGET_MS:.0f})")
    for name in names:
        batch = build_batch(n, t, args.group_size, args.prompts, args.seed)
        base = (batch.rewards.clone(), list(batch.reward_names), batch.reward_weights.clone())
        pipeline = Pipeline(plugin_set(name, BENCH_OPTIONS.get(name)))

        def setup() -> None:
            batch.rewards, batch.reward_names, batch.reward_weights = base[0].clone(), list(base[1]), base[2].clone()
            batch.kept = torch.ones(n, dtype=torch.bool)
            pipeline.seconds.clear()

        def round_() -> None:
            pipeline.shape_rewards(batch)
            pipeline.filter_rollouts(batch)
            advantages = kept_advantages(pipeline, batch)
            pipeline.kl_coefficient(batch)
            pipeline.notify("on_batch_end", batch.step, batch=batch, advantages=advantages)
            pipeline.prompt_weights(stats, batch.step)

        plugin_ms: list[float] = []

        def call() -> None:
            round_()
            plugin_ms.append(1000.0 * pipeline.seconds[name])

        ms = _time(call, setup, args.calls)
        out[name] = {"ms": statistics.median(ms), "plugin_ms": statistics.median(plugin_ms[1:]),
                     "options": BENCH_OPTIONS.get(name, {})}
        print(f"  {name:<24} round {out[name]['ms']:8.1f}   plugin hooks {out[name]['plugin_ms']:8.1f}")
    return out


# ====================================================================== report
def print_trainer(res: dict[str, Any]) -> None:
    print(f"\nTrainer overhead: {res['model']}  plugins={res['plugins'] or 'none'}  "
          f"{res['steps']} timed steps x {res['repeats']} repeats (1 warm-up step skipped), "
          f"order {' '.join('A' if k == 'vanilla' else 'B' for k in res['order'])} (A=vanilla, B=host)")
    print(f"  median wall time per step: vanilla {res['vanilla_median_ms']:.1f} ms, host {res['host_median_ms']:.1f} ms")
    print("  wall ratio host/vanilla per repeat: " + ", ".join(f"{r:.3f}" for r in res["ratios"]))
    print(f"  wall ratio min / median / max: {res['ratio_min']:.3f} / {res['ratio_median']:.3f} / {res['ratio_max']:.3f}"
          f"   pooled: {res['ratio_pooled']:.3f}   (target <= {res['target_ratio']})")
    print(f"  process CPU time per step (robust to competing processes): vanilla {res['vanilla_median_cpu_ms']:.1f} ms, "
          f"host {res['host_median_cpu_ms']:.1f} ms")
    print("  CPU ratio per repeat: " + ", ".join(f"{r:.3f}" for r in res["cpu_ratios"]))
    print(f"  CPU ratio min / median / max: {res['cpu_ratio_min']:.3f} / {res['cpu_ratio_median']:.3f} / "
          f"{res['cpu_ratio_max']:.3f}   pooled: {res['cpu_ratio_pooled']:.3f}")
    if res["host_profile"] is not None:
        prof = res["host_profile"]
        print(f"  host's own Python time per step (cProfile self time in trl_credit's host modules): "
              f"{prof['host_self_ms_per_step']:.3f} ms = {100 * res['host_self_fraction']:.4f}% of a vanilla step")
    if res["identical_losses_and_rewards"] is not None:
        print(f"  identical losses/rewards/lengths vanilla vs host: {res['identical_losses_and_rewards']}")


def print_hooks(res: dict[str, Any]) -> None:
    sizes = res["sizes"]
    print(f"\nHook cost: median of {res['calls']} calls, ms (ms per million tokens), G={res['group_size']}, "
          f"P={res['num_prompts']} prompts; through the host Pipeline (its checks included)")
    head = f"  {'family':22s} {'what':34s} {'scales':>6s}"
    for s in sizes:
        head += f" {s:>22s}"
    head += f" {'slope':>6s} {'host ms':>8s}"
    print(head)
    for family, row in res["families"].items():
        line = f"  {family:22s} {row['description']:34s} {row['scales_with']:>6s}"
        for s in sizes:
            r = row["by_size"][s]
            line += f" {r['ms']:10.2f} ({r['ms_per_mtok']:8.2f})"
        slope = row.get("slope_vs_tokens")
        line += f" {slope:6.2f}" if slope is not None else f" {'':6s}"
        last = row["by_size"][sizes[-1]]
        line += f" {last['ms'] - last['plugin_ms']:8.2f}" if "plugin_ms" in last else ""
        print(line)
    print(f"  slope = d log(ms) / d log(N*T) from {sizes[0]} to {sizes[-1]} (1 = linear in tokens, 0 = flat)"
          f"\n  host ms = the host Pipeline's own share at {sizes[-1]} (checks, merging), the rest is the plugin body")
    print(f"  slowest hook at {res['largest_size']} (the target size): {res['slowest_hook']} {res['slowest_hook_ms']:.1f} ms "
          f"(target < {res['target_ms']:.0f} ms)")


# ====================================================================== main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=("trainer", "hooks"), help="run one part only")
    p.add_argument("--quick", action="store_true", help=f"defaults for a smoke run: sizes {QUICK_SIZES}, 2 steps x 1 repeat, "
                   "no untimed warm-up run, completions of 8 tokens, 3 calls, 1000 prompts (explicit options win)")
    p.add_argument("--json", metavar="PATH", help="write every figure to PATH")
    p.add_argument("--threads", type=int, default=1, help="torch threads for both parts (0 = torch default); default 1")
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("trainer overhead")
    g.add_argument("--model", default="tiny", help="'tiny' (trl_credit.testing.tiny.tiny_model_path), a path or an alias "
                   "such as smollm2-135m-instruct (resolved with trl_credit.app.models.resolve_model)")
    g.add_argument("--steps", type=int, default=None, help="timed optimiser steps per run, plus 1 warm-up step "
                   "(default 4; 2 with --quick)")
    g.add_argument("--repeats", type=int, default=None, help="vanilla/host pairs, ABBA order (default 3; 1 with --quick)")
    g.add_argument("--max-completion-length", type=int, default=None, help="default 16 (8 with --quick)")
    g.add_argument("--profile-host", action=argparse.BooleanOptionalAction, default=None,
                   help="one more host run under cProfile to measure the host's own Python time per step "
                   "(default on; off with --quick)")
    g.add_argument("--plugins", nargs="*", default=[], metavar="NAME", help="installed plugins to enable in the host")
    g.add_argument("--each-plugin", nargs="*", default=None, metavar="NAME",
                   help="also measure the trainer overhead of every installed plugin alone (or the NAMEs), with "
                   "the presets in TRAINER_PRESETS; target <= 1.05 for pure-math plugins")
    h = p.add_argument_group("hook cost")
    h.add_argument("--installed", nargs="*", default=None, metavar="NAME",
                   help="also time installed plugins (no names: every installed one) at the largest size")
    h.add_argument("--sizes", default=DEFAULT_SIZES, help=f"NxT list (default {DEFAULT_SIZES}); "
                   f"'scaling' = {SCALING_SIZES}")
    h.add_argument("--group-size", type=int, default=8, help="G, completions per prompt")
    h.add_argument("--prompts", type=int, default=100_000, help="P, prompts the curriculum weighs")
    h.add_argument("--calls", type=int, default=None, help="timed calls per family after 1 untimed (default 5; 3 with --quick)")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.steps = args.steps or 2
        args.repeats = args.repeats or 1
        args.calls = args.calls or 3
        args.max_completion_length = args.max_completion_length or 8
        if args.sizes == DEFAULT_SIZES:
            args.sizes = QUICK_SIZES
        if args.prompts == 100_000:
            args.prompts = 1000
    args.profile_host = (not args.quick) if args.profile_host is None else args.profile_host
    args.steps, args.repeats, args.calls = args.steps or 4, args.repeats or 3, args.calls or 5
    args.max_completion_length = args.max_completion_length or 16
    previous_threads = torch.get_num_threads()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        return _run(args, argv)
    finally:  # importable: leave the caller's thread setting as it was
        torch.set_num_threads(previous_threads)


def _run(args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any]:
    env = environment()
    print(f"trl-credit overhead benchmark  ({'quick' if args.quick else 'full'})")
    print(f"  machine: {env['cpu']}, {env['cores']} cores ({env['usable_cores']} usable), "
          f"load avg {env['loadavg_at_start']}, torch threads {env['torch_threads']}"
          f" ({'--threads; 1 by default: reproducible on a shared machine, worst case for the hooks' if args.threads > 0 else 'torch default'})")
    print("  " + "  ".join(f"{k} {v}" for k, v in env["versions"].items()) + f"  python {env['python']}", flush=True)
    report: dict[str, Any] = {"environment": env, "argv": list(argv) if argv is not None else sys.argv[1:],
                              "quick": args.quick, "threads": args.threads}
    if args.only in (None, "trainer"):
        print("\n[1] trainer overhead", flush=True)
        report["trainer"] = trainer_overhead(args)
        print_trainer(report["trainer"])
    if args.only in (None, "hooks"):
        print("\n[2] hook cost", flush=True)
        report["hooks"] = hook_costs(args)
        print_hooks(report["hooks"])
    if args.each_plugin is not None:
        print("\n[1b] trainer overhead per plugin", flush=True)
        report["each_plugin"] = each_plugin_overhead(args)
        print_each_plugin(report["each_plugin"])
    if args.installed is not None:
        report["installed_plugins"] = installed_plugin_costs(args)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"\nwrote {args.json}")
    return report


if __name__ == "__main__":
    main()
