"""``trl-credit train``: a ``trl grpo`` config plus ``plugins:``, run with `CreditGRPOTrainer`.

The YAML is read with TRL's own parser classes (GRPOScriptArguments, GRPOConfig, ModelConfig,
DatasetMixtureConfig); ``plugins:`` is taken out first and validated before anything heavy loads.
`CreditArguments` adds optional keys for the held-out greedy evaluation the quickstart prints (and its curve).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import yaml

from trl_credit.config import ConfigError, PluginSet, build_plugins, check_run, reward_names


@dataclass
class CreditArguments:
    """trl-credit's own keys (all optional)."""

    heldout_samples: int = field(default=0, metadata={"help": "Greedy held-out accuracy on this many eval "
                                                               "prompts before and after training (0: off)."})
    heldout_max_new_tokens: int = field(default=24, metadata={"help": "Max new tokens for the held-out evaluation."})
    heldout_every: int = field(default=0, metadata={"help": "Also evaluate the held-out accuracy every this many "
                                                           "optimiser steps: a curve in metrics.json (0: off)."})
    heldout_before: bool = field(default=True, metadata={"help": "Evaluate the held-out accuracy before training "
                                                                 "(false: skip it, e.g. when it is known)."})


@dataclass
class Loaded:
    """Everything parsed and validated from a config, nothing heavy loaded yet."""

    path: str
    raw: dict[str, Any]
    plugins: PluginSet
    script_args: Any
    training_args: Any
    model_args: Any
    dataset_args: Any
    credit_args: CreditArguments


def read_yaml(path: str) -> dict[str, Any]:
    try:
        with open(path) as handle:
            data = yaml.safe_load(handle)
    except FileNotFoundError:
        raise ConfigError([f"{path}: no such file"]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([f"{path}: malformed YAML: {exc}"]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: the config must be a YAML mapping of keys, got {type(data).__name__}"])
    return data


def _parser():
    from trl import DatasetMixtureConfig, GRPOConfig, ModelConfig, TrlParser
    from trl.scripts.grpo import GRPOScriptArguments

    return TrlParser((GRPOScriptArguments, GRPOConfig, ModelConfig, DatasetMixtureConfig, CreditArguments))


def load_config(path: str, overrides: list[str] | None = None) -> Loaded:
    """Parse and validate ``path`` (+ command-line ``--key value`` overrides); raises `ConfigError`."""
    raw = read_yaml(path)
    problems: list[str] = []
    plugins = PluginSet()
    try:
        plugins = build_plugins(raw.get("plugins"))
    except ConfigError as exc:
        problems += exc.problems
    rest = {k: v for k, v in raw.items() if k != "plugins"}
    parser = _parser()
    known = {f.name for dc in parser.dataclass_types for f in dataclasses.fields(dc)} | {"env"}
    for key in rest:
        if key not in known:
            close = difflib.get_close_matches(key, list(known), n=1)
            problems.append(f"{path}: unknown key '{key}'" + (f"; did you mean '{close[0]}'?" if close else
                            "; it is neither a `trl grpo` option nor `plugins`"))
    if problems:
        raise ConfigError(problems)
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as handle:
        yaml.safe_dump(rest, handle)
        stripped = handle.name
    import contextlib
    import io

    usage = io.StringIO()
    try:
        with contextlib.redirect_stderr(usage):
            parsed = parser.parse_args_and_config(["--config", stripped, *(overrides or [])])
    except SystemExit:  # argparse reports ill-typed values by printing its usage and exiting
        lines = [line for line in usage.getvalue().splitlines() if "error:" in line]
        reason = lines[-1].split("error:", 1)[1].strip() if lines else usage.getvalue().strip()[-500:]
        raise ConfigError([f"{path}: invalid value for a TRL option: {reason}"]) from None
    except (ValueError, TypeError) as exc:
        raise ConfigError([f"{path}: {exc}"]) from None
    except ZeroDivisionError:  # GRPOConfig divides by num_generations before checking it
        raise ConfigError([f"{path}: num_generations must be at least 2 (GRPO compares the completions of a "
                           "prompt with each other); got 0"]) from None
    finally:
        os.unlink(stripped)
    script_args, training_args, model_args, dataset_args, credit_args = parsed
    problems = credit_problems(path, credit_args)
    if problems:
        raise ConfigError(problems)
    return Loaded(path, raw, plugins, script_args, training_args, model_args, dataset_args, credit_args)


def credit_problems(path: str, args: CreditArguments) -> list[str]:
    """What is wrong with trl-credit's own keys (negative counts, a curve without held-out prompts)."""
    problems = [f"{path}: {key} must be >= {low}, got {getattr(args, key)}"
                for key, low in (("heldout_samples", 0), ("heldout_every", 0), ("heldout_max_new_tokens", 1))
                if getattr(args, key) < low]  # fmt: skip
    if args.heldout_every > 0 and args.heldout_samples == 0:
        problems.append(f"{path}: heldout_every: {args.heldout_every} needs held-out prompts: set heldout_samples "
                        "(for example 100), or heldout_every: 0")  # fmt: skip
    return problems


def load_datasets(cfg: Loaded):
    from trl_credit.app.data import load_train_eval

    args = cfg.script_args
    if cfg.dataset_args.datasets:
        from trl import get_dataset

        loaded = get_dataset(cfg.dataset_args)
        return loaded[args.dataset_train_split], loaded.get(args.dataset_test_split)
    try:
        return load_train_eval(args.dataset_name, args.dataset_config, args.dataset_train_split,
                               args.dataset_test_split, seed=cfg.training_args.seed)
    except (ValueError, TypeError) as exc:
        raise ConfigError([f"{cfg.path}: dataset {args.dataset_name!r}: {exc}"]) from None


def guess_task(cfg: Loaded) -> dict[str, Any] | None:
    """The rollout options when the run plays the bundled ``guess`` task (``dataset_name: guess[:...]``), else None."""
    from trl_credit.app.data import parse_arithmetic_spec
    from trl_credit.app.guess import rollout_options

    name = (cfg.script_args.dataset_name or "").strip()
    base, _, spec = name.partition(":")
    if base.lower() != "guess" or os.path.exists(name):
        return None
    try:
        return rollout_options({**parse_arithmetic_spec(cfg.script_args.dataset_config), **parse_arithmetic_spec(spec)})
    except ValueError as exc:
        raise ConfigError([f"{cfg.path}: dataset {name!r}: {exc}"]) from None


def reward_functions(cfg: Loaded) -> list:
    from trl_credit.app.rewards import resolve_reward_funcs

    default = "guess_solved" if guess_task(cfg) is not None else "arithmetic_accuracy"
    names = list(cfg.script_args.reward_funcs or [default])
    try:
        funcs = resolve_reward_funcs(names, max_completion_len=cfg.training_args.max_completion_length or 1280)
    except (ValueError, ImportError) as exc:
        raise ConfigError([f"{cfg.path}: reward_funcs: {exc}"]) from None
    if cfg.script_args.reward_model_name_or_path:
        funcs.insert(0, cfg.script_args.reward_model_name_or_path)
    return funcs


def validate(path: str, overrides: list[str] | None = None) -> Loaded:
    """All configuration checks that need no model: YAML, TRL keys and settings, the model name, the
    dataset (built-in and local: not empty, a prompt column, the columns rewards and plugins read),
    plugins and their ``check_args``, reward columns, the KL reference."""
    cfg = load_config(path, overrides)
    preflight(cfg, offline_only=True)
    return cfg


def preflight(cfg: Loaded, offline_only: bool) -> tuple[Any, Any, list]:
    """Every check before the model is resolved or loaded; (train set, eval set, reward functions).

    One `ConfigError` lists every problem: the model name, a missing data file, the dataset, the
    reward functions, then `check_loaded`. ``offline_only`` (`validate`) loads only built-in and local
    datasets (a hub dataset is not checked); `train` loads any. Warns about bf16 on a CPU without it.
    """
    problems = model_problems(cfg) + dataset_file_problems(cfg)
    name = cfg.script_args.dataset_name or "arithmetic"
    local = name.startswith(("arithmetic", "guess")) or os.path.exists(name.split(":")[0])
    train_set = eval_set = None
    if not problems and (local or not offline_only):
        train_set, eval_set = load_datasets(cfg)
    funcs = reward_functions(cfg)
    check_loaded(cfg, funcs, train_set, problems)
    warning = bf16_warning(cfg)
    if warning:
        print(f"trl-credit: warning: {warning}", file=sys.stderr)
    return train_set, eval_set, funcs


_LOCAL_DATA = (".json", ".jsonl", ".parquet", ".csv", ".arrow")
#: arguments TRL passes to every reward function itself (not dataset columns)
_TRL_REWARD_ARGS = {"prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra",
                    "environments", "tool_calls"}


def cpu_has_bf16() -> bool | None:
    """Whether this CPU has bf16 instructions (AVX512-BF16 or AMX-BF16); None when it cannot be told."""
    try:
        with open("/proc/cpuinfo") as handle:
            flags = handle.read()
    except OSError:
        return None
    return "avx512_bf16" in flags or "amx_bf16" in flags


def bf16_warning(cfg: Loaded) -> str | None:
    """A warning when bf16 autocast will run on a CPU without bf16 units (a very slow fallback)."""
    targs = cfg.training_args
    if not getattr(targs, "bf16", False):
        return None
    import torch

    on_cpu = targs.use_cpu or not torch.cuda.is_available()
    if on_cpu and cpu_has_bf16() is False:
        return (f"{cfg.path}: bf16 is on, but this CPU has no bf16 instructions: autocast falls back to a slow "
                "path (a QLoRA step took minutes instead of 31 s here); set `bf16: false` on this machine")
    return None


def model_problems(cfg: Loaded) -> list[str]:
    """An embedded-model alias with a typo, or a local-looking model path that does not exist."""
    from trl_credit.app.models import EMBEDDED_MODELS

    name = cfg.model_args.model_name_or_path
    if not name or os.path.exists(name) or name.strip().lower() in EMBEDDED_MODELS:
        return []
    close = difflib.get_close_matches(name.strip().lower(), list(EMBEDDED_MODELS), n=1, cutoff=0.8)
    if close:
        return [f"{cfg.path}: model_name_or_path: {name!r} is neither a local path nor an embedded model; did you "
                f"mean '{close[0]}'? (embedded: {', '.join(EMBEDDED_MODELS)})"]
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        return [f"{cfg.path}: model_name_or_path: {name!r} looks like a local path but does not exist"]
    return []  # a hub id: not checkable offline


def dataset_file_problems(cfg: Loaded) -> list[str]:
    name = (cfg.script_args.dataset_name or "").split(":")[0]
    if name.lower().endswith(_LOCAL_DATA) and not os.path.exists(name):
        return [f"{cfg.path}: dataset_name: {name!r} does not exist (a local data file; hub ids have no extension)"]
    return []


def reward_columns(funcs: list) -> dict[str, list[str]]:
    """``{reward function: dataset columns it takes}``: its parameters without defaults that TRL does not pass."""
    import inspect

    out = {}
    for func in funcs:
        if not callable(func):
            continue
        try:
            params = inspect.signature(func).parameters.values()
        except (TypeError, ValueError):
            continue
        needed = [p.name for p in params if p.default is inspect.Parameter.empty
                  and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in _TRL_REWARD_ARGS]
        if needed:
            out[getattr(func, "__name__", type(func).__name__)] = needed
    return out


def check_loaded(cfg: Loaded, funcs: list, train: Any, problems: list[str] | None = None) -> None:
    """What `validate` and `train` check before loading: the dataset (when loaded), the reward functions'
    columns, then `trl_credit.config.check_run` (TRL settings, plugins); one `ConfigError` lists them all."""
    from trl_credit.app.guess import ROLLOUT_FIELDS

    problems = list(problems or [])
    columns = None
    if train is not None:
        columns = list(train.column_names) + (list(ROLLOUT_FIELDS) if guess_task(cfg) is not None else [])
        if len(train) == 0:
            problems.append(f"{cfg.path}: the training dataset is empty")
        if "prompt" not in columns:
            problems.append(f"{cfg.path}: the training dataset has no 'prompt' column (columns: {', '.join(columns)}); "
                            "TRL's GRPO reads the prompts from it")
        for func, needed in reward_columns(funcs).items():
            missing = [c for c in needed if c not in columns]
            if missing:
                problems.append(f"{cfg.path}: reward function {func} reads dataset column(s) {', '.join(missing)}, "
                                f"which the training dataset lacks (columns: {', '.join(columns)})")
    try:
        fields = list(ROLLOUT_FIELDS) if guess_task(cfg) is not None else None  # the bundled task's rollout fields
        check_run(cfg.plugins, cfg.training_args, reward_names(funcs), columns, bool(cfg.model_args.use_peft), fields)
    except ConfigError as exc:
        problems += exc.problems
    if problems:
        raise ConfigError(problems)


def train(path: str, overrides: list[str] | None = None) -> dict[str, Any]:
    """Run a training config end to end; returns the metrics written to ``<output_dir>/metrics.json``."""
    started = time.time()
    cfg = load_config(path, overrides)
    train_set, eval_set, funcs = preflight(cfg, offline_only=False)  # before the model is resolved or loaded

    from trl import get_peft_config, get_quantization_config

    from trl_credit.app.heldout import HeldoutCurve, heldout_accuracy, plot_reward_curve, write_metrics
    from trl_credit.app.models import resolve_model
    from trl_credit.trainer import CreditGRPOTrainer

    targs, margs = cfg.training_args, cfg.model_args
    model_path = resolve_model(margs.model_name_or_path)
    init_kwargs = dict(revision=margs.model_revision, trust_remote_code=targs.trust_remote_code,
                       attn_implementation=margs.attn_implementation, dtype=margs.dtype)
    init_kwargs.update(targs.model_init_kwargs or {})
    targs.model_init_kwargs = {k: v for k, v in init_kwargs.items() if v is not None}
    trainer = CreditGRPOTrainer(
        model=model_path,
        reward_funcs=funcs,
        args=targs,
        train_dataset=train_set,
        eval_dataset=eval_set if targs.eval_strategy != "no" else None,
        quantization_config=get_quantization_config(margs),
        peft_config=get_peft_config(margs),
        plugins=cfg.plugins,
        rollout_func=_rollout_func(cfg),
    )
    metrics: dict[str, Any] = {"config": os.path.abspath(path), "model": margs.model_name_or_path,
                               "plugins": cfg.plugins.names, "load_in_4bit": bool(margs.load_in_4bit),
                               "use_peft": bool(margs.use_peft)}
    if trainer.accelerator.is_main_process:
        metrics["resolved_config"] = save_resolved_config(cfg, overrides, targs.output_dir)
    n_eval = cfg.credit_args.heldout_samples
    heldout = curve = None
    if n_eval and eval_set is not None:
        heldout = eval_set.select(range(min(n_eval, len(eval_set))))
        if cfg.credit_args.heldout_every:
            curve = HeldoutCurve(lambda: _heldout(trainer, heldout, funcs[0], cfg, heldout_accuracy),
                                 cfg.credit_args.heldout_every, trainer.accelerator.print)
            trainer.add_callback(curve)
    if heldout is not None and cfg.credit_args.heldout_before:
        clock = time.time()
        metrics["heldout_accuracy_before"] = _heldout(trainer, heldout, funcs[0], cfg, heldout_accuracy)
        metrics["heldout_seconds"] = round(time.time() - clock, 1)
        trainer.accelerator.print(f"held-out accuracy before training: {metrics['heldout_accuracy_before']:.3f} "
                                  f"({len(heldout)} prompts, greedy, {metrics['heldout_seconds']} s)")
    clock = time.time()
    start_step = trainer.state.global_step
    trainer.train(resume_from_checkpoint=targs.resume_from_checkpoint)
    if trainer.state.global_step == 0 or (targs.resume_from_checkpoint is None and trainer.state.global_step == start_step):
        raise NothingTrained(
            f"{path}: the run made 0 optimiser steps (training set: {len(train_set)} rows; max_steps="
            f"{targs.max_steps}, num_train_epochs={targs.num_train_epochs}, num_iterations={targs.num_iterations}): "
            + ("num_iterations must be at least 1" if targs.num_iterations < 1 else
               "a generation batch needs generation_batch_size / num_generations distinct prompts: use a larger "
               "dataset or smaller batches"))
    metrics["train_seconds"] = round(time.time() - clock, 1)
    metrics["seconds_per_step"] = round(metrics["train_seconds"] / max(trainer.state.global_step, 1), 2)
    trainer.save_model(targs.output_dir)
    if curve is not None:
        metrics["heldout_curve"], metrics["heldout_curve_seconds"] = curve.points, round(curve.seconds, 1)
    if heldout is not None:
        if curve is not None and curve.points and curve.points[-1][0] == trainer.state.global_step:
            metrics["heldout_accuracy_after"] = curve.points[-1][1]  # just evaluated at this step
        else:
            metrics["heldout_accuracy_after"] = _heldout(trainer, heldout, funcs[0], cfg, heldout_accuracy)
        trainer.accelerator.print(f"held-out accuracy after training:  {metrics['heldout_accuracy_after']:.3f}")
    if getattr(trainer, "trl_credit_heldout_turns", None):
        metrics["heldout_turns"] = trainer.trl_credit_heldout_turns  # the guess task: per evaluation, in order
        metrics["heldout_feedback"] = trainer.trl_credit_heldout_feedback  # `feedback_use`, per evaluation
    metrics["total_seconds"] = round(time.time() - started, 1)
    history = trainer.state.log_history
    metrics["log_history"] = history
    if trainer.accelerator.is_main_process:
        os.makedirs(targs.output_dir, exist_ok=True)
        write_metrics(os.path.join(targs.output_dir, "metrics.json"), metrics)
        plot_reward_curve(history, os.path.join(targs.output_dir, "reward_curve.png"))
        trainer.accelerator.print(f"metrics: {os.path.join(targs.output_dir, 'metrics.json')}, "
                                  f"reward curve: {os.path.join(targs.output_dir, 'reward_curve.png')}")
    metrics["is_main_process"] = trainer.accelerator.is_main_process
    return metrics


CONFIG_FILE = "trl_credit_config.yaml"


class NothingTrained(RuntimeError):
    """A run that finished without a single optimiser step (`trl-credit train` exits 1)."""


def resolved_config(cfg: Loaded, overrides: list[str] | None = None) -> dict[str, Any]:
    """The config as run: the YAML's keys (``plugins:`` included) with command-line overrides applied.

    Override values are read back from TRL's parsed dataclasses, so types are those TRL saw.
    """
    from enum import Enum

    resolved = dict(cfg.raw)
    parsed = (cfg.script_args, cfg.training_args, cfg.model_args, cfg.dataset_args, cfg.credit_args)
    for item in overrides or []:
        if not item.startswith("--"):
            continue
        key = item[2:].split("=", 1)[0].replace("-", "_")
        for obj in parsed:
            if key in {f.name for f in dataclasses.fields(obj)}:
                value = getattr(obj, key)
                value = value.value if isinstance(value, Enum) else value
                resolved[key] = list(value) if isinstance(value, tuple) else value
                break
    return resolved


def save_resolved_config(cfg: Loaded, overrides: list[str] | None, output_dir: str) -> str:
    """Write `resolved_config` to ``<output_dir>/trl_credit_config.yaml`` (read by ``trl-credit eval``)."""
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, CONFIG_FILE)
    with open(path, "w") as handle:
        handle.write(f"# resolved from {os.path.abspath(cfg.path)} by `trl-credit train`\n")
        yaml.safe_dump(resolved_config(cfg, overrides), handle, sort_keys=False)
    return path


def _rollout_func(cfg: Loaded):
    """TRL's ``rollout_func`` of the run: the guess game's for the bundled task, else None (TRL samples)."""
    task = guess_task(cfg)
    if task is None:
        return None
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL 1.16
    from trl_credit.app.guess import GuessRollout

    return GuessRollout(max_new_tokens=task["turn_tokens"], strict=task["strict"])


def _heldout(trainer, dataset, reward_fn, cfg: Loaded, heldout_accuracy) -> float:
    """Greedy held-out accuracy (single-turn) or success rate (the guess task; its mean turns played and its
    `feedback_use` are printed and kept in ``trainer.trl_credit_heldout_turns`` and ``..._heldout_feedback``)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    was_training = model.training
    model.eval()
    try:
        task = guess_task(cfg)
        if task is not None:
            from trl_credit.app.guess import feedback_use, guess_success

            result = guess_success(model, trainer.processing_class, dataset, **task)
            feedback = feedback_use(model, trainer.processing_class, dataset, **task)
            trainer.trl_credit_heldout_turns = getattr(trainer, "trl_credit_heldout_turns", []) + [result["turns"]]
            trainer.trl_credit_heldout_feedback = getattr(trainer, "trl_credit_heldout_feedback", []) + [feedback]
            trainer.accelerator.print(f"held-out guess: success {result['success']:.3f}, "
                                      f"{result['turns']:.2f} turns per game; the second guess follows the feedback "
                                      f"in {feedback['follows']:.3f} of games (changes with it in {feedback['changes']:.3f})")
            return result["success"]
        return heldout_accuracy(model, trainer.processing_class, dataset, reward_fn=reward_fn,
                                max_new_tokens=cfg.credit_args.heldout_max_new_tokens)
    finally:
        model.train(was_training)


def dump(metrics: dict[str, Any]) -> str:
    hidden = ("log_history", "is_main_process")
    return json.dumps({k: v for k, v in metrics.items() if k not in hidden}, indent=2, default=str)
