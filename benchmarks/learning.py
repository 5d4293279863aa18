"""Does a plugin help GRPO learn?  Each plugin against its matching baseline, held-out curves, several seeds.

The setting is one where plain GRPO visibly learns: LoRA r16 on the embedded SmolLM2-135M-Instruct,
two-number addition with operands 1..20 (the built-in ``arithmetic`` dataset), lr 2e-4, beta 0, 4
prompts x 8 completions per step, at most 24 tokens, temperature 1, 30 steps. Held-out greedy
accuracy on 100 prompts that never occur in training is measured every 5 steps (``heldout_every``
of ``trl-credit train``), so every run is a curve; step 0 is the base model (LoRA starts as the
identity, so one evaluation serves every run of a prompt style).

Every run is a real ``trl-credit train`` run (a generated YAML config). Comparisons:

* **equal optimiser steps**: final accuracy, area under the accuracy curve (AUC: the curve's mean
  over the steps, trapezoid rule), and per seed the first evaluation after step 0 that reaches the
  baseline's final accuracy on that seed, beside the baseline's own;
* **equal generated tokens** (x axis: tokens generated, refill rounds included): filters run with
  their refill on, as their papers do, so they generate more per step; their accuracy is also read
  at the baseline's total tokens on the same seed (the last evaluation within that budget) and the
  tokens they need to reach the baseline's final accuracy are reported.

A combination (``--combo``) is the project's goal: GRPO's final accuracy in at most 60% of its steps at no
more than 1.1x its time per step. Each of its seeds is followed by a **control**, its baseline rerun on the same
seed (``runs/control_<plugins>/``, one per combination), and the time per step is compared with that rerun: step
times of the same config differed by up to 1.6x between sessions on this kind of machine.

The report holds every finished run of the settings under ``--out``, whichever command made it, so
``--plugins X`` or more ``--seeds`` never drop the rest of the grid from the tables.

Differences are paired by seed (same LoRA initialisation, same prompt order) with a 95% t-interval.
Process-score shapers and estimators get a prompt that asks for the working
(``arithmetic:prompt=working``: "Write the working as one equation, then the answer.") and the
built-in step checker (``arithmetic_steps`` reward column, ``arithmetic`` step scorer): **a stand-in**
for a process reward model that fits the prompt; their baseline is GRPO on the same prompt and
reward columns.

    python benchmarks/learning.py                           # the grid, resumable (hours: see docs/results.md)
    python benchmarks/learning.py --report-only             # tables and figures from the runs finished so far
    python benchmarks/learning.py --plugins gdpo,gtpo --seeds 0,1,2,3,4
    python benchmarks/learning.py --combo dynamic_sampling,gdpo   # plugins enabled together
    python benchmarks/learning.py --best 3 --combo best:3   # after the grid: 5 seeds for the 3 best, and them together
    python benchmarks/learning.py --combo cheap:3           # the 3 best whose own cost is within the goal's time
    python benchmarks/learning.py --list                    # the plan and what does not apply
    python benchmarks/learning.py --quick --out /tmp/q      # tiny model, 2 steps, 1 seed (CI smoke run)

Resumable across machines: a finished run's result (curve, tokens, timings, mechanism metrics) is a
small JSON file under ``--out`` (default ``benchmarks/results/learning``, committed); a run whose
result exists with the same settings is skipped; a run without one is redone from scratch. Adapters
and train logs go under ``--work`` (default ``runs/learning``, not committed).
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
EVIDENCE = ("<!-- which-plugin-evidence:begin -->", "<!-- which-plugin-evidence:end -->")  # docs/which-plugin.md
QUICK_PREFERENCE = ("dynamic_sampling", "balanced_aggregation", "gtpo", "gdpo", "riskpo", "drpo", "corrgrpo")
# the grid's order after the baselines: the sparse-reward filters and multi-reward estimators first, so a partial
# grid (it takes several sessions on 2 cores) answers the commonest questions; then alphabetical; fixtures last
#: the grid's order: filters and the first estimators, then the dense-credit methods (the heart of the seed papers),
#: then the rest alphabetically
PRIORITY = ("dynamic_sampling", "accuracy_band", "prime", "gdpo", "half_pass_selection", "balanced_aggregation", "p_grpo",
            "prm_clip_delta", "gtpo", "drpo", "igpo", "trace", "spae", "siop", "logprob_reward", "g_ra", "trust_grpo",
            "corrgrpo", "empg", "mrt", "endogenous_reward")
INFORMATIVE = "informative_groups"  # 1 - TRL's frac_reward_zero_std: groups whose rewards differ
LAST = ("reward_noise",)  # robustness fixtures: run after the methods
#: turn-credit plugins: on a single-turn task they are GRPO or refuse; benchmarks/multiturn.py runs them
MULTI_TURN = ("ctc_grpo", "fatal_aware", "infopo", "matchtir", "mira", "pica", "procredit", "progress_potential", "salt",
              "stage_norm", "taco", "turn_baseline")

# name -> {"options": plugin options, "rewards": reward columns, "trainer": `trl grpo` keys it needs (its baseline
# gets them too), "prompt": arithmetic prompt style, "mechanism": the logged metric that shows it acting,
# "note": shown in the table, "skip": reason}
PRESETS: dict[str, dict[str, Any]] = {
    "dynamic_sampling": {"mechanism": "trl_credit/kept_fraction",
                         "note": "refill on (mode replace, as in DAPO): more tokens per step"},
    "accuracy_band": {"mechanism": "trl_credit/kept_fraction", "note": "refill on (as in PRIME): more tokens per step"},
    "half_pass_selection": {"options": {"history": "latest", "prior": "population", "exploit": "all"},
                            "mechanism": INFORMATIVE,
                            "note": "a prompt curriculum; its earlier rules re-drew prompts the policy had learned: "
                            "final 0.60 under history=all, 0.647 under exploit=mixed with a fixed prior"},
    "gdpo": {"rewards": [ACC, PROCESS], "prompt": "working", "mechanism": "trl_credit/gdpo/gdpo_applied",
             "note": "two reward columns (with one, GDPO is GRPO)"},
    "corrgrpo": {"rewards": [ACC, PROCESS], "prompt": "working", "mechanism": "trl_credit/corrgrpo/active_fraction",
                 "note": "two reward columns (with one, it is Dr.GRPO)"},
    "p_grpo": {"options": {"outcome_reward": ACC, "process_reward": PROCESS}, "rewards": [ACC, PROCESS],
               "prompt": "working", "mechanism": "trl_credit/p_grpo/gate_rate", "note": "process score = step checker"},
    "trust_grpo": {"options": {"answer_reward": ACC, "thinking_reward": PROCESS}, "rewards": [ACC, PROCESS],
                   "prompt": "working", "mechanism": "trl_credit/trust_grpo/active_groups",
                   "note": "thinking score = step checker"},
    "prm_clip_delta": {"prompt": "working", "mechanism": "trl_credit/prm_clip_delta/process_return",
                       "note": "step scores from the built-in `arithmetic` step checker"},
    "g_ra": {"prompt": "working", "mechanism": "trl_credit/g_ra/gate_open",
             "note": "step scores from the built-in `arithmetic` step checker"},
    "drpo": {"trainer": {"loss_type": "grpo"}, "mechanism": "trl_credit/drpo/valid_groups",
             "note": "needs loss_type grpo (refuses TRL's default dapo); baseline under the same loss"},
    "riskpo": {"options": {"bundle_size": 2}, "note": "K = 2 prompt groups per bundle: a step has 2 bundles"},
    "gtpo": {"trainer": {"loss_type": "grpo"}, "note": "a per-completion token mean (loss_type grpo; refuses "
             "TRL's default dapo); baseline under the same loss"},
    "grpo_lambda": {"mechanism": "trl_credit/grpo_lambda/selected_fraction"},
    "balanced_aggregation": {"mechanism": "trl_credit/balanced_aggregation/active_fraction"},
    "e_grpo": {"skip": "needs a gold entity-list dataset column ('entities'); arithmetic has one number per answer"},
    "etr": {"trainer": {"num_iterations": 2}, "mechanism": "trl_credit/etr/epsilon_high",
            "note": "clip bounds act only off-policy: num_iterations 2, baseline under the same"},
    "disco_constraint": {"trainer": {"num_iterations": 2}, "mechanism": "trl_credit/disco_constraint/kl",
                         "note": "the KL constraint acts only off-policy: num_iterations 2, baseline under the same"},
    "negative_only": {"mechanism": "trl_credit/negative_only/positive_fraction"},
    "reg_grpo": {"mechanism": "trl_credit/reg_grpo/regression"},
    "diffgate": {"mechanism": "trl_credit/diffgate/gated_fraction",
                 "note": "teacher = the frozen reference (the base model under LoRA)"},
    "guide": {"skip": "needs a hint column; arithmetic has none (a generic hint would be a different experiment)"},
    "prime": {"mechanism": "trl_credit/prime/prm_auc",
              "note": "implicit PRM = a second LoRA adapter; AUC scored before the PRM trains on the rollouts"},
    # the dense-credit plugins that segment completions into steps run on the prompt that asks for the working
    "igpo": {"prompt": "working", "mechanism": "trl_credit/igpo/mean_information_gain",
             "note": "gold answer after each step (policy)"},
    "trace": {"prompt": "working", "mechanism": "trl_credit/trace/step_reward",
              "note": "gold answer after each step (reference)"},
    "siop": {"prompt": "working", "mechanism": "trl_credit/siop/potential_gain", "note": "no gold: answer clusters"},
    "spae": {"prompt": "working", "options": {"num_samples": 2, "max_steps": 4},
             "mechanism": "trl_credit/spae/potential", "note": "answer probes after each step (2 per step)"},
    "mrt": {"mechanism": "trl_credit/mrt/termination_reward", "note": "forced-termination baseline"},
    "pppo": {"mechanism": "trl_credit/pppo/retained_fraction", "note": "prefix retention 0.2 -> 0.5"},
    "s_grpo": {"options": {"max_groups": 2}, "mechanism": "trl_credit/s_grpo/first_correct_exit",
               "note": "2 serial groups per step: extra generation"},
    "logprob_reward": {"mechanism": "trl_credit/logprob_reward/mean", "note": "log-prob of the gold answer"},
    "grpo_care": {"mechanism": "trl_credit/grpo_care/bonus_rate", "note": "EMA reference adapter"},
    "endogenous_reward": {"mechanism": "trl_credit/endogenous_reward/reward", "note": "base model's logits as reward"},
    "p2s": {"skip": "needs a gold chain-of-thought column ('gold_cot'); arithmetic has a one-line solution"},
    "fixed_prm": {"skip": "needs a trained PRM adapter (a prime checkpoint): run prime first, then point path at it"},
    "expo": {"mechanism": "trl_credit/expo/explained_groups",
             "note": "answer-conditioned explanations for all-fail groups: extra generation"},
    "search_e1": {"mechanism": "trl_credit/search_e1/distilled_fraction"},
    "scaf_grpo": {"skip": "needs tiered hint columns; arithmetic has none"},
    "seed": {"skip": "needs a skill column (SEED generates skills with the policy; not implemented here)"},
    "reward_noise": {"mechanism": "trl_credit/reward_noise/flipped_fraction",
                     "note": "flips rewards on purpose (a robustness fixture): expected to hurt"},
    # turn credit: the arithmetic task is single-turn; EMPG also segments single completions into steps
    "empg": {"prompt": "working", "options": {"segments": "steps"}, "mechanism": "trl_credit/empg/scale_max",
             "note": "steps of the working (single-turn reading of its per-turn credit)"},
    **{name: {"skip": "multi-turn credit: needs turns (and per-turn values or tool calls); arithmetic is single-turn, "
              "see the guess task"} for name in MULTI_TURN},
    "skillgate": {"skip": "needs skill reads (named spans) and a gold-skill column; arithmetic has neither"},
}  # fmt: skip


# ====================================================================== settings
@dataclass
class Settings:
    """Everything that must be equal across runs (part of every run's fingerprint)."""

    model: str = "smollm2-135m-instruct"
    dataset: str = "arithmetic:max_value=20,seed=0,eval_n=100"  # seed fixed: same prompts for every run seed
    steps: int = 30
    per_device_train_batch_size: int = 32  # 4 prompts x 8 completions per step
    num_generations: int = 8
    max_completion_length: int = 24
    heldout_max_new_tokens: int = 24
    heldout_every: int = 5
    learning_rate: float = 2.0e-4
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0  # PEFT's 0.05 costs ~13% of a CPU step here (profiled)
    temperature: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)  # more `trl grpo` keys
    # bumped when a host change alters a run's speed or numbers, so older runs are retrained, not mixed in:
    # 2 = on CPU the trainer scores only the completion tokens (0.2.3; quickstart median step 13.8 -> 12.0 s)
    host: int = 2


def quick_settings() -> Settings:
    from trl_credit.testing.tiny import tiny_model_path

    return Settings(model=tiny_model_path(), dataset="arithmetic:n=64,seed=0,eval_n=8", steps=2,
                    per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                    heldout_max_new_tokens=8, heldout_every=1, learning_rate=1e-3, lora_r=4, lora_alpha=8)  # fmt: skip


@dataclass
class Variant:
    """One line of the table: a label, its plugin entries (none for a baseline), reward columns, prompt style."""

    label: str
    plugins: list[dict[str, Any]]  # [{"name": ..., **options}]
    rewards: list[str]
    note: str = ""
    trainer: dict[str, Any] = field(default_factory=dict)  # `trl grpo` keys (shared with its baseline)
    prompt: str = "answer"
    mechanism: str | None = None

    @property
    def is_baseline(self) -> bool:
        return not self.plugins

    @property
    def baseline(self) -> str:
        label = "grpo" + "".join("+" + r.removeprefix("arithmetic_") for r in self.rewards[1:])
        label += "" if self.prompt == "answer" else f"@{self.prompt}"
        return label + "".join(f"@{key}={value}" for key, value in sorted(self.trainer.items()))

    def baseline_variant(self) -> Variant:
        return Variant(self.baseline, [], list(self.rewards), "baseline", dict(self.trainer), self.prompt,
                       INFORMATIVE)  # fmt: skip


def dataset_spec(settings: Settings, prompt: str) -> str:
    return settings.dataset if prompt == "answer" else f"{settings.dataset},prompt={prompt}"


def run_config(settings: Settings, variant: Variant, seed: int, output_dir: str) -> dict[str, Any]:
    """The ``trl-credit train`` YAML of one run."""
    import torch

    config: dict[str, Any] = {
        "model_name_or_path": settings.model, "dtype": "float32", "bf16": False,
        "use_peft": True, "lora_r": settings.lora_r, "lora_alpha": settings.lora_alpha,
        "lora_dropout": settings.lora_dropout, "lora_target_modules": "all-linear",
        "dataset_name": dataset_spec(settings, variant.prompt), "reward_funcs": list(variant.rewards),
        "output_dir": output_dir, "max_steps": settings.steps, "learning_rate": settings.learning_rate, "beta": 0.0,
        "per_device_train_batch_size": settings.per_device_train_batch_size,
        "num_generations": settings.num_generations, "max_completion_length": settings.max_completion_length,
        "temperature": settings.temperature, "logging_steps": 1, "save_strategy": "no", "report_to": "none",
        "use_cpu": not torch.cuda.is_available(), "gradient_checkpointing": False, "seed": seed,
        "heldout_samples": _eval_n(settings), "heldout_max_new_tokens": settings.heldout_max_new_tokens,
        "heldout_every": settings.heldout_every, "heldout_before": False, **settings.extra, **variant.trainer,
    }  # fmt: skip
    if variant.plugins:
        config["plugins"] = [dict(entry) for entry in variant.plugins]
    return config


def _eval_n(settings: Settings) -> int:
    from trl_credit.app.data import parse_arithmetic_spec

    return int(parse_arithmetic_spec(settings.dataset.partition(":")[2]).get("eval_n", 100))


def fingerprint(settings: Settings, variant: Variant, seed: int) -> str:
    described = {k: v for k, v in asdict(variant).items() if k not in ("note", "mechanism")}
    text = json.dumps({"settings": asdict(settings), "variant": described, "seed": seed}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ====================================================================== the plan
def preset_variant(name: str) -> Variant:
    preset = PRESETS.get(name, {})
    return Variant(name, [{"name": name, **preset.get("options", {})}], list(preset.get("rewards", [ACC])),
                   preset.get("note", ""), dict(preset.get("trainer", {})), preset.get("prompt", "answer"),
                   preset.get("mechanism"))  # fmt: skip


def combo_variant(names: list[str]) -> Variant:
    """The plugins enabled together, each with its preset; reward columns, trainer keys and prompt merged."""
    parts = [preset_variant(name) for name in names]
    rewards = list(dict.fromkeys(r for part in parts for r in part.rewards))
    trainer: dict[str, Any] = {}
    for part in parts:
        trainer.update(part.trainer)
    prompts = {part.prompt for part in parts}
    prompt = "working" if "working" in prompts else "answer"
    entries = [entry for part in parts for entry in part.plugins]
    return Variant("combo:" + "+".join(names), entries, rewards, "plugins enabled together, each with its preset",
                   trainer, prompt, "trl_credit/kept_fraction")  # fmt: skip


def control_label(combo: str) -> str:
    """``combo:a+b`` -> ``control:a+b``: each combination has its own controls, run in the session it ran in."""
    return "control:" + combo.removeprefix("combo:")


def control_variant(variant: Variant) -> Variant:
    """A combination's baseline rerun beside it (label `control_label`, its own folder and fingerprint): the goal's
    time per step is read against runs made on the same machine at the same time, not against baseline runs of
    other sessions, whose speed differed by up to 1.6x on the same kind of machine."""
    return Variant(control_label(variant.label), [], list(variant.rewards),
                   "the baseline rerun next to a combination, for its time per step", dict(variant.trainer),
                   variant.prompt, INFORMATIVE)  # fmt: skip


def tasks_of(variants: list[Variant], seeds: list[int]) -> list[tuple[Variant, int]]:
    """The runs in order: variant-major (a partial grid is paired), and each combination seed followed by its
    control on the same seed (`control_variant`), so the pair shares the machine's state."""
    tasks: list[tuple[Variant, int]] = []
    for variant in variants:
        for seed in seeds:
            tasks.append((variant, seed))
            if variant.label.startswith("combo:"):
                tasks.append((control_variant(variant), seed))
    return tasks


def controls_on_disk(settings: Settings, variant: Variant, out: Path) -> dict[int, dict[str, Any]]:
    """``{seed: finished control run}`` of a combination (every seed on disk with these settings)."""
    return finished_on_disk(settings, control_variant(variant), out)


def plan(settings: Settings, selected: list[str] | None, combos: list[list[str]], work: Path,
         quick: bool) -> tuple[list[Variant], dict[str, str]]:
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
        order = {n: i for i, n in enumerate(QUICK_PREFERENCE if quick else PRIORITY)}
        candidates = sorted(installed, key=lambda n: (n in LAST, order.get(n, len(order)), n))
    variants: list[Variant] = []
    check_dir = work / "validate"
    check_dir.mkdir(parents=True, exist_ok=True)
    for name in candidates:
        if "skip" in PRESETS.get(name, {}):
            skipped[name] = PRESETS[name]["skip"]
            continue
        variant = preset_variant(name)
        reason = _validate(settings, variant, check_dir)
        if reason:
            skipped[name] = reason
            continue
        variants.append(variant)
        if quick and selected is None and len(variants) == 2:
            break
    for names in combos:
        missing = [n for n in names if n not in installed]
        variant = combo_variant(names)
        reason = f"not installed: {', '.join(missing)}" if missing else _validate(settings, variant, check_dir)
        if reason:
            skipped[variant.label] = reason
        else:
            variants.append(variant)
    lines = [Variant("grpo", [], [ACC], "baseline", mechanism=INFORMATIVE)]
    for variant in variants:  # each baseline just before the first plugin that needs it: a partial grid is paired
        if variant.baseline not in {line.label for line in lines}:
            lines.append(variant.baseline_variant())
        lines.append(variant)
    return lines, skipped


def _validate(settings: Settings, variant: Variant, folder: Path) -> str | None:
    """None when ``trl-credit validate`` accepts the variant's config, else the first problem."""
    import yaml

    from trl_credit.app.train_command import validate
    from trl_credit.config import ConfigError

    path = folder / f"{variant.label.replace(':', '_')}.yaml"
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
def result_path(out: Path, label: str, seed: int) -> Path:
    return out / "runs" / label.replace(":", "_") / f"seed{seed}.json"


def run_one(settings: Settings, variant: Variant, seed: int, out: Path, work: Path, base: dict[str, float],
            log) -> dict[str, Any]:
    """Train one (variant, seed) from scratch and store its result (`run_all` skips the finished ones first)."""
    import yaml

    from trl_credit.app.train_command import train

    folder = work / "runs" / variant.label.replace(":", "_") / f"seed{seed}"
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    config_path = folder.parent / f"seed{seed}.yaml"
    config = run_config(settings, variant, seed, str(folder))
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    log(f"  {variant.label} seed {seed}: training {settings.steps} steps")
    clock = time.time()
    metrics = train(str(config_path))
    steps = [h for h in metrics["log_history"] if "loss" in h and "step" in h]
    completions = settings.per_device_train_batch_size
    tokens = [h.get("completions/mean_length", 0.0) * completions + h.get("trl_credit/extra_tokens", 0.0)
              + h.get("trl_credit/augmented_tokens", 0.0) for h in steps]  # refill and extra generation included
    logged = sorted({k for h in steps for k in h if k.startswith("trl_credit/") or k == "frac_reward_zero_std"})
    mechanisms = {k: statistics.fmean([h[k] for h in steps if h.get(k) is not None]) for k in logged
                  if any(h.get(k) is not None for h in steps)}  # fmt: skip
    if "frac_reward_zero_std" in mechanisms:
        mechanisms[INFORMATIVE] = 1.0 - mechanisms["frac_reward_zero_std"]
    # every plugin metric per step (30 x a few numbers) and the policy's token entropy, so a run can be diagnosed later
    tracked = [*logged, *(["entropy"] if any("entropy" in h for h in steps) else [])]
    series = {k: [[h["step"], round(h[k], 5)] for h in steps if h.get(k) is not None] for k in tracked}
    train_seconds = metrics["train_seconds"] - metrics.get("heldout_curve_seconds", 0.0)
    curve = [[0, base[variant.prompt]], *metrics["heldout_curve"]]
    if curve[-1][0] != len(steps) and metrics.get("heldout_accuracy_after") is not None:
        curve.append([len(steps), metrics["heldout_accuracy_after"]])  # the final model, when no evaluation fell there
    every = int(config.get("num_iterations", 1)) * int(config.get("steps_per_generation") or 1)
    step_times = generation_cycles([h.get("step_time") for h in steps], every)
    result = {
        "label": variant.label, "plugins": variant.plugins, "rewards": variant.rewards, "prompt": variant.prompt,
        "baseline": None if variant.is_baseline else variant.baseline, "seed": seed,
        "fingerprint": fingerprint(settings, variant, seed),
        "curve": curve,
        "tokens_per_step": [round(t, 1) for t in tokens],
        "steps": len(steps), "completions_per_step": completions,
        "generated_tokens": round(sum(tokens), 1),
        "seconds_per_step": round(train_seconds / max(len(steps), 1), 2),
        # TRL's own per-step time, median over the generation cycles after the first (`generation_cycles`): a few
        # steps slowed by other work on the machine barely move it (the mean above is kept for older runs)
        "step_seconds_median": round(statistics.median(step_times), 2) if step_times else None,
        "generation_every": every,
        "environment": {**environment(), "date": time.strftime("%Y-%m-%d")},
        "eval_seconds": metrics.get("heldout_curve_seconds"), "wall_seconds": round(time.time() - clock, 1),
        "train_reward": [[h["step"], h.get(f"rewards/{ACC}/mean")] for h in steps],
        "mechanisms": mechanisms,
        "series": series,  # per step: every plugin metric (the mechanism, the extra passes' costs, ...)
    }  # fmt: skip
    path = result_path(out, variant.label, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    log(f"  {variant.label} seed {seed}: held-out {result['curve'][-1][1]:.3f} at step {result['curve'][-1][0]} "
        f"({result['wall_seconds']} s)")  # fmt: skip
    return result


def generation_cycles(step_times: list[float | None], every: int) -> list[float]:
    """Per-step times averaged over each generation cycle, the first cycle (warm-up) left out.

    TRL generates once every ``steps_per_generation * num_iterations`` steps and reuses the batch in between, so
    with ``num_iterations: 2`` every other step skips generation: a median over single steps would pick a step
    without it. Over whole cycles every value holds one generation. A cycle with a step that logged no time is
    left out.
    """
    every = max(1, every)
    cycles = [step_times[i:i + every] for i in range(every, len(step_times) - every + 1, every)]
    return [sum(c) / every for c in cycles if all(t for t in c)]


def finished(settings: Settings, variant: Variant, seed: int, out: Path) -> dict[str, Any] | None:
    """The stored result of (variant, seed) when it was made with these settings, else None."""
    path = result_path(out, variant.label, seed)
    if not path.exists():
        return None
    done = json.loads(path.read_text())
    return done if done.get("fingerprint") == fingerprint(settings, variant, seed) else None


def finished_on_disk(settings: Settings, variant: Variant, out: Path) -> dict[int, dict[str, Any]]:
    """``{seed: result}`` for every seed of the variant stored under ``out`` with these settings."""
    found: dict[int, dict[str, Any]] = {}
    for path in sorted(result_path(out, variant.label, 0).parent.glob("seed*.json")):
        seed = path.stem.removeprefix("seed")
        if seed.isdigit() and (result := finished(settings, variant, int(seed), out)) is not None:
            found[int(seed)] = result
    return found


def on_disk(settings: Settings, variants: list[Variant], skipped: dict[str, str], pairs: list, out: Path, work: Path,
            quick: bool, log) -> tuple[list[Variant], dict[str, str], dict[str, list[dict]]]:
    """The report's variants, what does not apply, and ``{label: finished runs}``: this command's runs, plus every
    other finished run of the same settings under ``out`` (other plugins and combinations, other seeds)."""
    planned = {v.label for v in variants}
    disk_plugins, disk_combos = labels_on_disk(out)
    combos = [v.label.removeprefix("combo:").split("+") for v in variants if v.label.startswith("combo:")]
    combos += [c for c in disk_combos if "combo:" + "+".join(c) not in planned]
    names = [v.label for v in variants if not v.is_baseline and not v.label.startswith("combo:")]
    names += [name for name in disk_plugins if name not in planned]
    if not quick and len(names) + len(combos) == len([v for v in variants if not v.is_baseline]):
        report, more = variants, {}  # the full plan already (the grid's own command)
    else:
        report, more = plan(settings, names, combos, work, quick)
    skipped = {**more, **skipped}
    results: dict[str, list[dict]] = {}
    for (variant, _), result in pairs:
        results.setdefault(variant.label, []).append(result)
    for variant in report:
        have = {r["seed"] for r in results.get(variant.label, [])}
        for seed, result in finished_on_disk(settings, variant, out).items():
            if seed not in have:
                results.setdefault(variant.label, []).append(result)
        results.get(variant.label, []).sort(key=lambda r: r["seed"])
    # a folder of another setting (another --steps, say) holds no run of these settings: its variant stays out,
    # and so does a baseline that no reported plugin needs
    kept = [v for v in report if v.label in planned or results.get(v.label)]
    needed = {v.baseline for v in kept if not v.is_baseline}
    report = [v for v in kept if not v.is_baseline or v.label in planned or v.label in needed]
    extra = sum(len(v) for v in results.values()) - len(pairs)
    if extra:
        log(f"report: {extra} more finished runs of these settings on disk")
    return report, skipped, results


def labels_on_disk(out: Path) -> tuple[list[str], list[list[str]]]:
    """The plugin labels and the combinations (as plugin lists) with a run folder under ``out/runs``; baselines
    (``grpo``, ``grpo+...``, ``grpo@...``, as `Variant.baseline` names them) are not listed: their plugins
    bring them; nor are a combination's timing controls (``control_...``): its goal reads them."""
    folder = out / "runs"
    labels = sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []
    baseline = [name for name in labels if name == "grpo" or name.startswith(("grpo+", "grpo@"))]
    combos = [name.removeprefix("combo_").split("+") for name in labels if name.startswith("combo_")]
    plugins = [name for name in labels if name not in baseline and not name.startswith(("combo_", "control_"))]
    return plugins, combos


def _log(message: str) -> None:
    print(f"[learning {time.strftime('%H:%M:%S')}] {message}", flush=True)


def _run_in_worker(settings: Settings, variant: Variant, seed: int, out: Path, work: Path, base: dict[str, float],
                   threads: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    return run_one(settings, variant, seed, out, work, base, _log)


def run_all(settings: Settings, tasks: list[tuple[Variant, int]], out: Path, work: Path, base: dict[str, float],
            jobs: int, threads: int, log) -> tuple[list[dict[str, Any] | None], dict[str, str]]:
    """Every (variant, seed) in ``tasks``, in order; ``jobs`` > 1: that many worker processes, each with
    ``threads`` torch threads and a fresh process per run (measured on 2 cores with 32 completions of 24
    tokens: two 1-thread runs side by side make 2 steps per 43 s, one 2-thread run 1 step per 17 s).

    A run that raises is logged and reported, not fatal: ``(results with None for it, {"label/seedK": error})``.
    """
    results: list[dict[str, Any] | None] = [finished(settings, variant, seed, out) for variant, seed in tasks]
    todo = [i for i, done in enumerate(results) if done is None]
    log(f"{len(tasks) - len(todo)} of {len(tasks)} runs done already; {len(todo)} to run")
    failures: dict[str, str] = {}

    def record(i: int, exc: BaseException) -> None:
        variant, seed = tasks[i]
        error = f"{type(exc).__name__}: {exc}".split("\n")[0]
        failures[f"{variant.label}/seed{seed}"] = error
        log(f"  {variant.label} seed {seed}: FAILED: {error}")

    if jobs <= 1:
        for i in todo:
            try:
                results[i] = run_one(settings, *tasks[i], out, work, base, log)
            except Exception as exc:  # noqa: BLE001 - reported in the table
                record(i, exc)
        return results, failures
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context, max_tasks_per_child=1) as pool:
        futures = {i: pool.submit(_run_in_worker, settings, *tasks[i], out, work, base, threads) for i in todo}
        for i, future in futures.items():
            try:
                results[i] = future.result()
            except Exception as exc:  # noqa: BLE001 - reported in the table
                record(i, exc)
    return results, failures


def base_accuracy(settings: Settings, prompt: str, out: Path, work: Path, log) -> dict[str, Any]:
    """Greedy held-out accuracy of the base model (step 0 of every curve with this prompt style)."""
    import yaml

    from trl_credit.app.eval_command import run_eval

    path = out / f"base_{prompt}.json"
    stamp = hashlib.sha256(json.dumps([settings.model, dataset_spec(settings, prompt),
                                       settings.heldout_max_new_tokens]).encode()).hexdigest()[:16]  # fmt: skip
    if path.exists():
        done = json.loads(path.read_text())
        if done.get("fingerprint") == stamp:
            return done
    config = work / f"base_{prompt}.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    variant = Variant("grpo", [], [ACC], prompt=prompt)
    config.write_text(yaml.safe_dump(run_config(settings, variant, 0, str(work / "base")), sort_keys=False))
    log(f"base model, prompt {prompt}: held-out accuracy")
    evaluation = run_eval(str(config), n=0, ks=[1], json_path=str(work / f"base_{prompt}_eval.json"))
    done = {"fingerprint": stamp, "prompt": prompt, "heldout": evaluation["greedy_accuracy"],
            "num_prompts": evaluation["num_prompts"], "seconds": evaluation["seconds"]["total"]}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(done, indent=1) + "\n")
    log(f"base model, prompt {prompt}: held-out accuracy {done['heldout']:.3f} on {done['num_prompts']} prompts")
    return done


# ====================================================================== statistics
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}  # Student t, 0.975 quantile, by degrees of freedom


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (the nearest tabulated df below)."""
    return T975[max(k for k in T975 if k <= df)] if df >= 1 else math.nan


def stats(values: list[float | None]) -> dict[str, Any]:
    """Mean, sample std, min, max, n and the half-width of the 95% t-interval of the mean."""
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0, "ci95": None}
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    # no interval from one value, nor from values that do not vary up to rounding (a zero-width interval would read
    # as certainty: with 32 held-out games, two seeds can easily tie)
    ci = t975(len(values) - 1) * std / math.sqrt(len(values)) if len(values) > 1 and std > 1e-9 else None
    return {"mean": statistics.fmean(values), "std": std, "min": min(values), "max": max(values), "n": len(values),
            "ci95": ci}  # fmt: skip


def auc(curve: list[list[float]]) -> float:
    """Mean accuracy over the run: the trapezoid area under the curve divided by its step span."""
    xs, ys = [c[0] for c in curve], [c[1] for c in curve]
    if len(xs) < 2 or xs[-1] == xs[0]:
        return ys[-1]
    return sum((x1 - x0) * (y0 + y1) / 2 for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:])) / (xs[-1] - xs[0])


def cumulative_tokens(run: dict[str, Any]) -> dict[int, float]:
    """Tokens generated up to and including each step (step 0: none)."""
    total, out = 0.0, {0: 0.0}
    for step, tokens in enumerate(run["tokens_per_step"], start=1):
        total += tokens
        out[step] = total
    return out


def first_reach(run: dict[str, Any], target: float) -> tuple[int | None, float | None]:
    """(step, tokens) of the first evaluation after step 0 at or above ``target``, or (None, None). Step 0 is the
    base model, the same for every run: a target it already meets says nothing of training."""
    tokens = cumulative_tokens(run)
    for step, value in run["curve"]:
        if step > 0 and value >= target - 1e-9:
            return int(step), tokens.get(int(step))
    return None, None


def step_seconds(run: dict[str, Any]) -> float:
    """A run's time per step: TRL's median ``step_time`` where the run recorded it, else its mean wall time per
    step (runs that predate the median)."""
    return run.get("step_seconds_median") or run["seconds_per_step"]


def extra_pass_share(run: dict[str, Any]) -> float:
    """The share of a run's time per step spent in the extra passes the host times (every
    ``trl_credit/cost/*_seconds`` but TRL's own generation), read from the run alone."""
    series = run.get("series", {})
    extra = sum(sum(v for _, v in points) for key, points in series.items()
                if key.startswith("trl_credit/cost/") and key.endswith("_seconds")
                and key != "trl_credit/cost/generation_seconds")  # fmt: skip
    steps = run.get("steps") or len(run.get("tokens_per_step", [])) or 1
    return extra / steps / run["seconds_per_step"] if extra else 0.0


def time_ratio(mine: dict[str, Any], theirs: dict[str, Any]) -> float:
    """Time per step over the baseline's: medians when both runs have them, else both means (never one of each)."""
    if mine.get("step_seconds_median") and theirs.get("step_seconds_median"):
        return mine["step_seconds_median"] / theirs["step_seconds_median"]
    return mine["seconds_per_step"] / theirs["seconds_per_step"]


def at_tokens(run: dict[str, Any], budget: float) -> float:
    """Held-out accuracy at the last evaluation whose cumulative generated tokens are within ``budget``."""
    tokens = cumulative_tokens(run)
    within = [value for step, value in run["curve"] if tokens.get(int(step), math.inf) <= budget + 1e-6]
    return within[-1] if within else run["curve"][0][1]


def _trend(trend: tuple[list[float], list[float]] | None) -> str:
    """`` (first 5 steps -> last 5 steps)`` of the mechanism metric, mean over seeds ('' without a series)."""
    if not trend:
        return ""
    first, last = trend
    return f" ({statistics.fmean(first):.2f} in steps 1-5 → {statistics.fmean(last):.2f} in the last 5)"


def summarise(variants: list[Variant], results: dict[str, list[dict]]) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for variant in variants:
        runs = results.get(variant.label, [])
        row: dict[str, Any] = {
            "label": variant.label, "plugins": variant.plugins, "trainer": variant.trainer,
            "rewards": variant.rewards, "prompt": variant.prompt, "note": variant.note,
            "baseline": None if variant.is_baseline else variant.baseline, "seeds": [r["seed"] for r in runs],
            "before": runs[0]["curve"][0][1] if runs else None,
            "final": stats([r["curve"][-1][1] for r in runs]), "auc": stats([auc(r["curve"]) for r in runs]),
            "gain": stats([r["curve"][-1][1] - r["curve"][0][1] for r in runs]),
            "generated_tokens": stats([r["generated_tokens"] for r in runs]),
            "seconds_per_step": stats([step_seconds(r) for r in runs]),
            "mechanism": variant.mechanism or _first_own_metric(variant, runs),
        }  # fmt: skip
        row["mechanism_value"] = stats([r["mechanisms"].get(row["mechanism"]) for r in runs])
        series = [r.get("series", {}).get(row["mechanism"]) for r in runs]
        series = [x for x in series if x and len(x) >= 10]
        row["mechanism_trend"] = ([statistics.fmean(v for _, v in x[:5]) for x in series],
                                  [statistics.fmean(v for _, v in x[-5:]) for x in series]) if series else None
        row[INFORMATIVE] = stats([r["mechanisms"].get(INFORMATIVE) for r in runs])
        rows[variant.label] = row
    for variant in variants:
        if variant.is_baseline or variant.baseline not in rows:
            continue
        row = rows[variant.label]
        mine = {r["seed"]: r for r in results.get(variant.label, [])}
        theirs = {r["seed"]: r for r in results.get(variant.baseline, [])}
        seeds = sorted(set(mine) & set(theirs))
        row["paired_seeds"] = seeds
        row["delta_final"] = stats([mine[s]["curve"][-1][1] - theirs[s]["curve"][-1][1] for s in seeds])
        row["delta_auc"] = stats([auc(mine[s]["curve"]) - auc(theirs[s]["curve"]) for s in seeds])
        row["time_ratio"] = stats([time_ratio(mine[s], theirs[s]) for s in seeds])
        tokens = {s: mine[s]["generated_tokens"] / theirs[s]["generated_tokens"] for s in seeds
                  if theirs[s]["generated_tokens"]}  # fmt: skip
        row["token_ratio"] = stats(list(tokens.values()))
        # the time per step over the baseline's as the plugin's own runs put it, free of the machine's speed in
        # other sessions: its tokens per step over the baseline's, over the share of the step not in extra passes
        row["own_time_ratio"] = stats([ratio / (1.0 - min(extra_pass_share(mine[s]), 0.99))
                                       for s, ratio in tokens.items()])  # fmt: skip
        if seeds:
            # per seed: the baseline's own final accuracy on that seed is the target, and its own total tokens
            # the budget (paired, like every other difference)
            row["targets"] = [theirs[s]["curve"][-1][1] for s in seeds]
            reached = [first_reach(mine[s], theirs[s]["curve"][-1][1]) for s in seeds]
            row["steps_to_target"] = [step for step, _ in reached]
            row["tokens_to_target"] = [tokens for _, tokens in reached]
            # the baseline reaches its own final accuracy too, often before its last step: the reference
            own = [first_reach(theirs[s], theirs[s]["curve"][-1][1]) for s in seeds]
            row["baseline_steps_to_target"] = [step for step, _ in own]
            row["baseline_tokens_to_target"] = [tokens for _, tokens in own]
            row["delta_at_baseline_tokens"] = stats([at_tokens(mine[s], theirs[s]["generated_tokens"])
                                                     - theirs[s]["curve"][-1][1] for s in seeds])  # fmt: skip
    return rows


def _first_own_metric(variant: Variant, runs: list[dict[str, Any]]) -> str:
    names = sorted({k for r in runs for k in r["mechanisms"]})
    for entry in variant.plugins:
        own = [k for k in names if k.startswith(f"trl_credit/{entry['name']}/") and not k.endswith("/seconds")]
        if own:
            return own[0]
    return INFORMATIVE


# ====================================================================== tables
def _f(x: float | None, digits: int = 3, sign: bool = False) -> str:
    return "n/a" if x is None else (f"{x:+.{digits}f}" if sign else f"{x:.{digits}f}")


def _ci(s: dict[str, Any] | None, digits: int = 3) -> str:
    if not s or not s["n"]:
        return "n/a"
    if s.get("ci95") is None:  # one value, or values that do not vary: no interval
        return f"{s['mean']:+.{digits}f}" + (f" (no spread over {s['n']})" if s["n"] > 1 else "")
    return f"{s['mean']:+.{digits}f} ± {s['ci95']:.{digits}f}"


def _reach(values: list[Any] | None, digits: int = 0) -> str:
    if not values:
        return "n/a"
    hits = [v for v in values if v is not None]
    if not hits:
        return f"not reached (0/{len(values)})"
    return f"{statistics.median(hits):.{digits}f} ({len(hits)}/{len(values)})"


def remaining_hours(results: dict[str, list[dict[str, Any]]], missing: int) -> float | None:
    """``missing`` runs at the mean wall time (training and evaluations) of the finished ones, in hours; None when
    nothing is missing or nothing has finished to measure by."""
    walls = [r["wall_seconds"] for runs in results.values() for r in runs if r.get("wall_seconds")]
    if not missing or not walls:
        return None
    return missing * statistics.fmean(walls) / 3600


def markdown(summary: dict[str, Any], skipped: dict[str, str], settings: Settings, bases: dict[str, Any],
             figures: list[str], missing: list[str], goals: list[dict[str, Any]] | None = None,
             hours_left: float | None = None) -> str:
    """The results tables (and what did not run), as markdown; ``hours_left``: the missing runs' estimated time."""
    base_text = ", ".join(f"`{p}` prompt {_f(b['heldout'])}" for p, b in sorted(bases.items()))
    lines = [
        f"Model `{settings.model}`, dataset `{settings.dataset}`, LoRA r={settings.lora_r}, lr "
        f"{settings.learning_rate}, beta 0, {settings.steps} steps of {settings.per_device_train_batch_size} "
        f"completions ({settings.num_generations} per prompt, at most {settings.max_completion_length} tokens, "
        f"temperature {settings.temperature}). Held-out: greedy, {_eval_n(settings)} prompts never seen in "
        f"training, verifier `{ACC}`, every {settings.heldout_every} steps. Base model (step 0 of every curve; "
        f"greedy decoding of the same weights, so no spread): {base_text}.",
        "",
        "**Baselines** (mean ± 95% t-interval over seeds; std in brackets):",
        "",
        "| baseline | prompt | reward columns | trainer keys | seeds | before | final | gain | AUC | "
        "generated tokens | s/step | informative groups |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in summary.values():
        if row["baseline"] is not None:
            continue
        final, gain = row["final"], row["gain"]
        trainer = ", ".join(f"{k}={v}" for k, v in row["trainer"].items()) or "—"
        lines.append(
            f"| {row['label']} | {row['prompt']} | {', '.join(row['rewards'])} | {trainer} | {len(row['seeds'])} | "
            f"{_f(row['before'])} | {_f(final['mean'])} ({_f(final['std'])}) | {_ci(gain)} ({_f(gain['std'])}) | "
            f"{_f(row['auc']['mean'])} | {_f(row['generated_tokens']['mean'], 0)} | "
            f"{_f(row['seconds_per_step']['mean'], 1)} | {_f(row[INFORMATIVE]['mean'], 2)} |")  # fmt: skip
    lines += [
        "",
        "**Plugins against their baseline** at equal optimiser steps (Δ: paired by seed, mean ± 95% t-interval; "
        "an interval that contains 0 is no evidence either way; \"no spread\": the paired differences were all "
        "equal, so there is no interval). Steps and tokens to the baseline's final accuracy: per seed, the first "
        "evaluation after step 0 at or above the baseline's final accuracy on that seed; median over the seeds "
        "that reached it (how many did), then the same for the baseline itself, which often reaches its final "
        "accuracy before its last step. Δ at equal tokens: held-out accuracy at the baseline's total generated "
        "tokens on that seed (the last evaluation within that budget) minus the baseline's final. s/step: TRL's "
        "median step time (the mean for runs that predate it); runs made in different sessions share the machine "
        "with different side work, so a ratio between them is a rough guide only (`environment` in each run's "
        "JSON says when and with how many threads it ran).",
        "",
        "| plugin | baseline | seeds | final | Δ final | Δ AUC | steps to baseline final (plugin vs baseline) | "
        "tokens to baseline final (plugin vs baseline) | Δ at equal tokens | tokens / baseline's | s/step (× baseline) | "
        "mechanism: mean over steps | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    plugin_rows = [r for r in summary.values() if r["baseline"] is not None]
    plugin_rows.sort(key=lambda r: (0, -r["delta_final"]["mean"]) if r.get("delta_final", {}).get("n") else (1, 0))
    for row in plugin_rows:
        ratio = row.get("token_ratio", {}).get("mean")  # paired by seed, like every column after "seeds"
        options = "; ".join(x for x in (", ".join(f"{k}={v}" for k, v in e.items() if k != "name")
                                        for e in row["plugins"]) if x)  # fmt: skip
        note = "; ".join(x for x in (options, row["note"]) if x)
        mech = row["mechanism"].removeprefix("trl_credit/")
        lines.append(
            f"| {row['label']} | {row['baseline']} | {len(row.get('paired_seeds', []))} | {_f(row['final']['mean'])} | "
            f"{_ci(row.get('delta_final'))} | {_ci(row.get('delta_auc'))} | {_reach(row.get('steps_to_target'))} vs "
            f"{_reach(row.get('baseline_steps_to_target'))} | {_reach(row.get('tokens_to_target'))} vs "
            f"{_reach(row.get('baseline_tokens_to_target'))} | {_ci(row.get('delta_at_baseline_tokens'))} | "
            f"{_f(ratio, 2)} | {_f(row['seconds_per_step']['mean'], 1)} (× {_f(row.get('time_ratio', {}).get('mean'), 2)}) | "
            f"{mech} {_f(row['mechanism_value']['mean'], 2)}{_trend(row.get('mechanism_trend'))} | {note or '—'} |")  # fmt: skip
    lines += goals_table(goals or [])
    if missing:
        shown = "; ".join(missing[:12]) + (f"; and {len(missing) - 12} more" if len(missing) > 12 else "")
        lines += ["", f"**Partial:** {len(missing)} planned runs are missing from these tables (failed, or not "
                  f"finished yet; the grid is resumable): {shown}."]  # fmt: skip
        if hours_left is not None:
            lines[-1] += (f" At the mean wall time of the finished runs they take about {hours_left:.0f} hours more "
                          "on this machine, one run at a time.")
    if skipped:
        lines += ["", "Not run:", ""]
        lines += [f"- `{name}`: {reason}" for name, reason in sorted(skipped.items())]
    lines += ["", "`arithmetic_steps` and the `arithmetic` step scorer are a deterministic stand-in for a process "
              "reward model (a rule-based equation checker), not a PRM; the `working` prompt asks for the "
              "equation they score."]  # fmt: skip
    for caption, path in figures:
        lines += ["", f"![{caption}]({path})"]
    return "\n".join(lines)


def evidence(summary: dict[str, Any], skipped: dict[str, str], installed: list[str]) -> str:
    """The evidence table of docs/which-plugin.md: one row per installed plugin, measured or not (and why)."""
    lines = ["| plugin | seeds | Δ final accuracy (95% CI) | Δ AUC | steps to its baseline's final (plugin vs baseline) "
             "| s/step × (rough: runs of different sessions) | verdict |",
             "|---|---|---|---|---|---|---|"]
    for name in installed:
        row = summary.get(name)
        if row is None or not row.get("paired_seeds"):
            why = skipped.get(name, "not run yet (the grid is resumable)")
            lines.append(f"| `{name}` | 0 | — | — | — | — | {why} |")
            continue
        verdict = _verdict(row)
        lines.append(f"| `{name}` (vs {row['baseline']}) | {len(row['paired_seeds'])} | {_ci(row['delta_final'])} | "
                     f"{_ci(row.get('delta_auc'))} | {_reach(row.get('steps_to_target'))} vs "
                     f"{_reach(row.get('baseline_steps_to_target'))} | "
                     f"{_f(row.get('time_ratio', {}).get('mean'), 2)} | {verdict} |")  # fmt: skip
    return "\n".join(lines)


def _sign(s: dict[str, Any] | None) -> int | None:
    """+1 / -1 when the 95% interval of a paired difference excludes 0, 0 when it contains 0, None without one."""
    if not s or not s.get("n") or s.get("ci95") is None:
        return None
    return 1 if s["mean"] - s["ci95"] > 0 else -1 if s["mean"] + s["ci95"] < 0 else 0


def _verdict(row: dict[str, Any]) -> str:
    """What the intervals say, at equal steps (final accuracy and the curve's AUC) and, for a plugin that generates
    more per step (filters with refill), at the baseline's token budget: a gain bought with tokens is named so."""
    final, auc = _sign(row.get("delta_final")), _sign(row.get("delta_auc"))
    if final is None:
        n = row.get("delta_final", {}).get("n", 0)
        return "one seed: no interval" if n == 1 else f"no spread over {n} seeds: no interval"
    said = [f"{'higher' if sign > 0 else 'lower'} {what}" for sign, what in
            ((final, "final accuracy"), (auc, "curve (AUC)")) if sign]  # fmt: skip
    if not said:
        text = "no difference shown at equal steps (the intervals contain 0)"
    else:
        word = "**better**" if all(x >= 0 for x in (final, auc or 0)) else "**worse**" if all(
            x <= 0 for x in (final, auc or 0)) else "mixed"  # fmt: skip
        text = f"{word} at equal steps: {' and '.join(said)}"
    ratio = row.get("token_ratio", {}).get("mean")
    tokens = _sign(row.get("delta_at_baseline_tokens"))
    if ratio is not None and ratio > 1.1 and tokens is not None:
        at = {1: "higher", -1: "lower", 0: "no difference shown"}[tokens]
        text += f"; at the baseline's generated tokens ({ratio:.1f}x its tokens per step): {at}"
    return text


GRID_SEEDS = (0, 1, 2)
GOAL_STEPS = 0.6  # the goal: the baseline's final accuracy in at most this fraction of its steps,
GOAL_TIME = 1.1  # at no more than this multiple of its time per step


def rank(summary: dict[str, Any], max_time_ratio: float | None = None) -> list[str]:
    """The plugins of a summary best first, by paired Δ AUC over their baseline (the mean; ties: Δ final), among
    those with every grid seed paired; combinations and the robustness fixtures (``LAST``) are not ranked.
    ``max_time_ratio``: only plugins whose time per step over their baseline's, as their own runs put it
    (``own_time_ratio``: tokens per step over the baseline's, over the share of the step outside extra passes), is
    at most this (``cheap:N``). The measured ratio is not used there: its baselines ran in other sessions, and the
    machine's speed moved 1.6x between them (``taco_probe`` measured 1.01x while its probes took a third of its step).

    The rule is fixed before the grid's results are read, and it picks plugins, never options: the three best get
    5 seeds (``--best 3``) and the combination is the best ones together (``--combo best:3``), each preset as in the
    grid, so nothing is tuned on the held-out prompts beyond the choice of plugins itself. ``--combo cheap:3`` was
    added after ``best:3`` missed the goal on time alone: the same rule among the plugins within the goal's time.
    """
    def fast(row: dict[str, Any]) -> bool:
        ratio = row.get("own_time_ratio", {}).get("mean")
        return max_time_ratio is None or (ratio is not None and ratio <= max_time_ratio)

    rows = [(label, row) for label, row in summary.items()
            if row["baseline"] is not None and not label.startswith("combo:") and label not in LAST
            and set(GRID_SEEDS) <= set(row.get("paired_seeds", [])) and fast(row)]  # fmt: skip
    rows.sort(key=lambda item: (-item[1]["delta_auc"]["mean"], -item[1]["delta_final"]["mean"], item[0]))
    return [label for label, _ in rows]


def ranked(settings: Settings, out: Path, work: Path) -> list[str]:
    """`rank` over the finished 3-seed grid on disk; an error naming what is missing while the grid is partial."""
    return rank(grid_summary(settings, out, work))


def grid_summary(settings: Settings, out: Path, work: Path) -> dict[str, Any]:
    """`summarise` of the finished 3-seed grid on disk (what `rank` reads); an error while the grid is partial."""
    variants, _ = plan(settings, None, [], work, False)
    done = {(v.label, seed): finished(settings, v, seed, out) for v in variants for seed in GRID_SEEDS}
    missing = [f"{label}/seed{seed}" for (label, seed), result in done.items() if result is None]
    if missing:
        raise SystemExit(f"the best plugins are named from the complete 3-seed grid: {len(missing)} of {len(done)} "
                         f"runs are missing ({', '.join(missing[:5])}, ...); run `python benchmarks/learning.py` "
                         "until it reports no missing run, then --best / --combo best:N")
    results: dict[str, list[dict]] = {}
    for (label, _), result in done.items():
        results.setdefault(label, []).append(result)
    return summarise(variants, results)


def best_combo(settings: Settings, ranking: list[str], n: int, work: Path) -> list[str]:
    """The ``n`` best plugins that ``trl-credit validate`` accepts together: the best ``n`` when they compose, else
    the best ``n - 1``, down to two (a combination of one plugin is that plugin's own run)."""
    folder = work / "validate"
    folder.mkdir(parents=True, exist_ok=True)
    for size in range(min(n, len(ranking)), 1, -1):
        names = ranking[:size]
        if _validate(settings, combo_variant(names), folder) is None:
            return names
    raise SystemExit(f"no two of the best plugins ({', '.join(ranking[:n])}) validate together")


def goal(summary: dict[str, Any], label: str, results: dict[str, list[dict]] | None = None,
         controls: dict[int, dict[str, Any]] | None = None) -> dict[str, Any] | None:
    """The project's goal for a combination: its baseline's final accuracy (per seed) within 60% of the steps, at
    no more than 1.1x the baseline's time per step.

    The baseline is the combination's matched GRPO (same prompt, reward columns and trainer keys). Steps: the
    median over the paired seeds of the first evaluation that reaches the target, a seed that never does counting
    as never. With evaluations every few steps the limit is in effect the last evaluation at or below it. Time:
    against ``controls`` (``{seed: the baseline rerun next to the combination}``, `control_variant`) on the seeds
    that have one, else against the stored baseline runs, which may come from another session.
    """
    row = summary.get(label)
    if row is None or not row.get("paired_seeds") or "steps_to_target" not in row:
        return None
    total = max(int(row.get("steps_total", 0)), 1)
    limit = GOAL_STEPS * total
    runs = (results or {}).get(label) or []
    evaluations = sorted({int(step) for r in runs for step, _ in r["curve"] if step > 0})
    effective = max((e for e in evaluations if e <= limit), default=None) if evaluations else limit
    steps = sorted(math.inf if s is None else s for s in row["steps_to_target"])
    median = statistics.median(steps)
    mine = {r["seed"]: r for r in runs}
    timed = sorted(seed for seed in (controls or {}) if seed in mine)
    if timed:
        ratio = statistics.fmean(time_ratio(mine[seed], controls[seed]) for seed in timed)
    else:
        ratio = row["time_ratio"]["mean"]
    # the control is the baseline's own config and seed: how closely it repeats the stored run's final accuracy
    stored = dict(zip(row["paired_seeds"], row.get("targets", [])))
    repeat = [controls[seed]["curve"][-1][1] - stored[seed] for seed in timed if seed in stored]
    return {"label": label, "baseline": row["baseline"], "seeds": row["paired_seeds"],
            "steps_to_target": row["steps_to_target"],
            "median_steps_to_target": None if math.isinf(median) else median,
            "baseline_steps_to_target": row.get("baseline_steps_to_target"), "steps_total": total,
            "steps_limit": limit, "effective_limit": effective,
            "steps_met": not math.isinf(median) and median <= limit, "time_ratio": ratio,
            "time_against": control_label(label) if timed else row["baseline"], "time_seeds": timed,
            "control_repeat_final": repeat, "time_met": ratio is not None and ratio <= GOAL_TIME}  # fmt: skip


def goals_table(goals: list[dict[str, Any]]) -> list[str]:
    """The combination goal, one row per combination, as markdown lines."""
    if not goals:
        return []
    lines = ["", "**The combination goal** (reach the matched GRPO baseline's final held-out accuracy, per seed, in "
             "at most 60% of its steps at no more than 1.1x its time per step; steps: median over seeds of the "
             "first evaluation after step 0 that reaches it, a seed that never does counting as never):", "",
             "| combination | baseline | seeds | steps to baseline final (per seed) | median | limit | baseline's own "
             "(per seed) | s/step × baseline | goal met |", "|---|---|---|---|---|---|---|---|---|"]
    for g in goals:
        per_seed = ", ".join("never" if s is None else str(s) for s in g["steps_to_target"])
        own = ", ".join("never" if s is None else str(s) for s in g.get("baseline_steps_to_target") or [])
        limit = f"≤ {g['steps_limit']:g} of {g['steps_total']}"
        if g.get("effective_limit") is None:
            limit += " (no evaluation falls within it: the goal cannot be met on this grid)"
        elif g["effective_limit"] != g["steps_limit"]:
            limit += f" (in effect the evaluation at step {g['effective_limit']})"
        met = "**yes**" if g["steps_met"] and g["time_met"] else "no (" + ", ".join(
            x for x, ok in (("steps", g["steps_met"]), ("time", g["time_met"])) if not ok) + ")"
        median = "never" if g["median_steps_to_target"] is None else f"{g['median_steps_to_target']:g}"  # 12.5 stays
        timed = g.get("time_seeds") or []
        against = (f"vs its control reruns ({len(timed)} seeds)" if timed
                   else "vs the stored baseline runs (other sessions: rough)")
        lines.append(f"| {g['label']} | {g['baseline']} | {len(g['seeds'])} | {per_seed} | {median} | {limit} | "
                     f"{own or 'n/a'} | {_f(g['time_ratio'], 2)} {against} | {met} |")  # fmt: skip
    for g in goals:
        if g.get("control_repeat_final"):
            gaps = g["control_repeat_final"]
            lines.append(f"\n`{g['time_against']}` reruns {g['baseline']}'s config and seeds next to "
                         f"{g['label']}, so the time per step is compared on the same machine at the same time; "
                         f"its final accuracy differs from the stored {g['baseline']} runs' by "
                         f"{', '.join(_f(x, 3, sign=True) for x in gaps)} (same seeds).")  # fmt: skip
    return lines


# ====================================================================== figures
def plot(summary: dict[str, Any], results: dict[str, list[dict]], path: Path, x: str) -> None:
    """One panel per plugin: its mean held-out curve (min-max band over seeds) and its baseline's (dashed).

    ``x`` is ``"step"`` or ``"tokens"`` (cumulative generated tokens, refill included).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [label for label, row in summary.items() if row["baseline"] is not None and results.get(label)]
    if not labels:
        labels = [label for label in summary if results.get(label)]
    cols = min(4, max(1, len(labels)))
    rows = max(1, math.ceil(len(labels) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.8 * rows), squeeze=False, sharey=True)
    try:
        for ax in axes.flat[len(labels):]:
            ax.set_visible(False)
        for ax, label in zip(axes.flat, labels):
            for name, style, colour in ((summary[label]["baseline"], "--", "0.4"), (label, "-", "C0")):
                runs = results.get(name or label, [])
                if not runs:
                    continue
                xs, mean, low, high = _curve_band(runs, x)
                ax.plot(xs, mean, style, color=colour, linewidth=1.6, label=name)
                ax.fill_between(xs, low, high, color=colour, alpha=0.15)
            ax.set_title(label, fontsize=9)
            ax.set_ylim(-0.02, 1.02)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=6, loc="lower right")
            ax.set_xlabel("optimiser step" if x == "step" else "generated tokens", fontsize=8)
        for ax in axes[:, 0]:
            ax.set_ylabel("held-out accuracy", fontsize=8)
        fig.tight_layout()
        fig.savefig(path, format="png", dpi=90)
    finally:
        plt.close(fig)


def _curve_band(runs: list[dict[str, Any]], x: str) -> tuple[list[float], list[float], list[float], list[float]]:
    steps = [int(s) for s, _ in runs[0]["curve"]]
    values = [[dict((int(s), v) for s, v in r["curve"]).get(step) for r in runs] for step in steps]
    keep = [i for i, vs in enumerate(values) if all(v is not None for v in vs)]
    if x == "step":
        xs = [float(steps[i]) for i in keep]
    else:
        xs = [statistics.fmean(cumulative_tokens(r)[steps[i]] for r in runs) for i in keep]
    return (xs, [statistics.fmean(values[i]) for i in keep], [min(values[i]) for i in keep],
            [max(values[i]) for i in keep])  # fmt: skip


def update_docs(doc: Path, text: str, markers: tuple[str, str] = (BEGIN, END)) -> None:
    """Replace what is between the markers in ``doc`` with ``text``."""
    begin, end = markers
    content = doc.read_text()
    if begin not in content or end not in content:
        raise SystemExit(f"{doc}: markers {begin} / {end} not found")
    head, rest = content.split(begin, 1)
    _, tail = rest.split(end, 1)
    doc.write_text(f"{head}{begin}\n{text}\n{end}{tail}")


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
    """``"3"`` -> ``[0, 1, 2]``; ``"0,4"`` -> ``[0, 4]``; ``"2,"`` -> ``[2]``. A count below 1 names no seed: an error,
    not an empty grid."""
    if "," in text:
        return [int(part) for part in text.split(",") if part.strip()]
    if int(text) < 1:
        raise SystemExit(f"--seeds {text} names no seed: a count N runs seeds 0..N-1 (--seeds 1 is seed 0 alone); "
                         "a comma list names the seeds (--seeds 0,4 or --seeds 2,)")
    return list(range(int(text)))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="results folder: one small JSON per run, tables, figures "
                        "(default: benchmarks/results/learning, committed)")
    parser.add_argument("--work", default=None, help="train outputs: adapters, logs (default: runs/learning)")
    parser.add_argument("--plugins", default=None, help="comma-separated plugin names (default: every installed one)")
    parser.add_argument("--best", type=int, default=0, metavar="N",
                        help="the N plugins of the finished 3-seed grid with the highest paired Δ AUC (`rank`), and "
                        "their baselines, at --seeds (default 5 here: the issue's 5 seeds for the three best)")
    parser.add_argument("--combo", action="append", default=[],
                        help="comma-separated plugins to enable together (repeatable); best:N = the N best of the "
                        "finished grid that validate together (`best_combo`); cheap:N = the same among the plugins "
                        "whose own runs put their time per step within the goal's 1.1x (`own_time_ratio`); without --plugins only the "
                        "combinations and their baselines run")
    parser.add_argument("--seeds", default=None, help="N (seeds 0..N-1) or a comma list (default: 3; quick: 1)")
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default: 30; quick: 2)")
    parser.add_argument("--model", default=None, help="model name or path (default: smollm2-135m-instruct)")
    parser.add_argument("--dataset", default=None, help="dataset spec (default: arithmetic:max_value=20,seed=0,"
                        "eval_n=100)")
    parser.add_argument("--extra", default=None, help="more `trl grpo` keys for every run, as a JSON object "
                        "(e.g. the GPU script's QLoRA keys)")
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 steps, 1 seed, 2 plugins (CI smoke run)")
    parser.add_argument("--docs", default=None, help="markdown file whose learning-results section is replaced "
                        "(default: docs/results.md; quick: none; '' for none)")
    parser.add_argument("--list", action="store_true", help="print the plan (and what does not apply), train nothing")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per run (0: torch's default; with --jobs: cores // jobs)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs side by side in worker processes (default 1: on 2 cores one 2-thread run of "
                        "this setting does more steps per second than two 1-thread runs, and needs half the memory)")
    parser.add_argument("--report-only", action="store_true",
                        help="train nothing: tables, figures and docs from the runs already finished (partial)")
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
    if args.extra:
        settings.extra = json.loads(args.extra)
    chosen = bool(args.best) or any(c.startswith(("best:", "cheap:")) for c in args.combo)
    seeds = parse_seeds(args.seeds or ("1" if args.quick else "5" if chosen else "3"))
    if args.quick and args.out is None:
        raise SystemExit("--quick needs --out (its runs are not the benchmark's)")
    out = Path(args.out or HERE / "results" / "learning")
    work = Path(args.work or (out / "work" if args.quick else ROOT / "runs" / "learning"))
    out.mkdir(parents=True, exist_ok=True)
    grid = grid_summary(settings, out, work) if chosen else {}
    ranking, cheap = rank(grid), rank(grid, GOAL_TIME)
    if chosen:
        _log(f"the finished grid's plugins by paired Δ AUC: {', '.join(ranking)}")
    if any(c.startswith("cheap:") for c in args.combo):
        _log(f"of them within {GOAL_TIME}x their baseline's time per step by their own runs: {', '.join(cheap)}")

    def chosen_combo(spec: str) -> list[str]:
        if spec.startswith("best:"):
            return best_combo(settings, ranking, int(spec.removeprefix("best:")), work)
        if spec.startswith("cheap:"):
            return best_combo(settings, cheap, int(spec.removeprefix("cheap:")), work)
        return [p.strip() for p in spec.split(",") if p.strip()]

    combos = [chosen_combo(c) for c in args.combo]
    # --combo alone runs the combinations (and their baselines), not the whole grid beside them
    selected = [p.strip() for p in args.plugins.split(",") if p.strip()] if args.plugins else ([] if combos else None)
    if args.best:
        selected = [*(selected or []), *ranking[:args.best]]

    log = _log
    started = time.time()
    variants, skipped = plan(settings, selected, combos, work, args.quick)
    log(f"plan: {', '.join(v.label for v in variants)} x seeds {seeds}; not run: {', '.join(skipped) or 'none'}")
    for name, reason in skipped.items():
        log(f"  {name}: {reason}")
    if args.list:
        return {"variants": [asdict(v) for v in variants], "not_run": skipped}

    bases = {p: base_accuracy(settings, p, out, work, log) for p in sorted({v.prompt for v in variants})}
    base = {p: b["heldout"] for p, b in bases.items()}
    tasks = tasks_of(variants, seeds)
    if args.report_only:
        done = [(task, finished(settings, *task, out)) for task in tasks]
        missing = [f"{variant.label}/seed{seed}" for (variant, seed), result in done if result is None]
        log(f"report only: {len(tasks) - len(missing)} of {len(tasks)} runs finished")
        pairs = [(task, result) for task, result in done if result is not None]
    else:
        threads = args.threads or max(1, (os.cpu_count() or 1) // max(1, args.jobs))
        ran, failures = run_all(settings, tasks, out, work, base, args.jobs, threads, log)
        pairs = [(task, result) for task, result in zip(tasks, ran) if result is not None]
        missing = [f"{name} (failed: {error})" for name, error in failures.items()]
    # the report holds every finished run of these settings on disk, not only this command's: a command that runs
    # one plugin or more seeds must not drop the rest of the grid from the published tables
    variants, skipped, results = on_disk(settings, variants, skipped, pairs, out, work, args.quick, log)
    for prompt in sorted({v.prompt for v in variants} - bases.keys()):  # a prompt only runs from disk use
        bases[prompt] = base_accuracy(settings, prompt, out, work, log)
    summary = summarise(variants, results)
    hours_left = remaining_hours(results, len(missing))
    for row in summary.values():
        row["steps_total"] = settings.steps
    figures = {"step": out / "curves_by_step.png", "tokens": out / "curves_by_tokens.png"}
    for x, path in figures.items():
        plot(summary, results, path, x)
    goals = [g for g in (goal(summary, v.label, results, controls_on_disk(settings, v, out)) for v in variants
                         if v.label.startswith("combo:")) if g]  # fmt: skip
    captions = [("held-out accuracy per step, each plugin against its baseline", figures["step"].name),
                ("held-out accuracy against generated tokens", figures["tokens"].name)]
    table = markdown(summary, skipped, settings, bases, captions, missing, goals, hours_left)
    (out / "results.md").write_text(table + "\n")
    report = {"settings": asdict(settings), "seeds": seeds,
              "seeds_reported": sorted({r["seed"] for runs in results.values() for r in runs}),
              "environment": environment(), "bases": bases,
              "variants": summary, "goals": goals, "not_run": skipped, "missing": missing, "hours_left": hours_left,
              "seconds": round(time.time() - started, 1)}  # fmt: skip
    docs = args.docs if args.docs is not None else ("" if args.quick else str(ROOT / "docs" / "results.md"))
    if docs:
        doc = Path(docs)
        images = []
        for (caption, _), (x, figure) in zip(captions, figures.items()):
            image = doc.parent / "img" / f"learning_{figure.name}"
            image.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(figure, image)
            images.append((caption, os.path.relpath(image, doc.parent)))
        text = markdown(summary, skipped, settings, bases, images, missing, goals, hours_left)
        command = " ".join(["python benchmarks/learning.py", *(argv if argv is not None else sys.argv[1:])])
        text += f"\n\nGenerated by `{command}` on {time.strftime('%Y-%m-%d')}."
        update_docs(doc, text)
        report["docs"] = str(doc)
        which = doc.parent / "which-plugin.md"
        if which.exists() and EVIDENCE[0] in which.read_text():
            from trl_credit.plugins import available

            installed = sorted(n for n, info in available().items() if not info.builtin)
            table = evidence(summary, skipped, installed)
            update_docs(which, f"{table}\n\nGenerated by `{command}` on {time.strftime('%Y-%m-%d')}; the setting "
                        "and every figure: [results.md](results.md).", EVIDENCE)
    (out / "results.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    log(f"done in {report['seconds']} s: {out / 'results.json'}, {out / 'results.md'}")
    return report


if __name__ == "__main__":
    main()
