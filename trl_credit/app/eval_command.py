"""``trl-credit eval``: greedy accuracy and pass@k of a trained run or of a config's base model.

    trl-credit eval runs/quickstart                  # the adapter `trl-credit train` saved there
    trl-credit eval runs/quickstart --base           # the same config's base model, for comparison
    trl-credit eval examples/quickstart.yaml --k 1,4 --n 8 --samples 50 --json base.json

An output directory is read through the resolved config `trl-credit train` saves in it
(``trl_credit_config.yaml``; for runs made before that file existed, the config path recorded in
``metrics.json``). Model, quantization (QLoRA), dataset, seed, reward functions and sampling options
(``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, ``generation_kwargs``) all
come from that config, so the evaluation uses the training's verifier and the training's held-out split.
The first reward function is the verifier. Results: a JSON file (default
``<output_dir>/eval_<split>[_base].json``) and a printed table.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

from trl_credit.config import ConfigError
from trl_credit.app.train_command import CONFIG_FILE

__all__ = ["format_table", "load_model", "resolve_source", "run_eval"]

def resolve_source(target: str):
    """``(Loaded config, output_dir or None)`` for a config file or a ``trl-credit train`` output dir."""
    from trl_credit.app.train_command import load_config

    if not os.path.isdir(target):
        return load_config(target), None
    config = os.path.join(target, CONFIG_FILE)
    if not os.path.isfile(config):
        recorded = None
        metrics = os.path.join(target, "metrics.json")
        if os.path.isfile(metrics):
            with open(metrics) as handle:
                recorded = json.load(handle).get("config")
        if not recorded or not os.path.isfile(recorded):
            raise ConfigError([f"{target}: no {CONFIG_FILE} (written by `trl-credit train`) and no readable "
                               "config recorded in metrics.json; pass the training config file instead"])  # fmt: skip
        config = recorded
    return load_config(config), target


def _device(cfg, requested: str | None) -> str:
    import torch

    if requested and requested != "auto":
        return requested
    if cfg.training_args.use_cpu or not torch.cuda.is_available():
        return "cpu"
    return "cuda"


def load_model(cfg, output_dir: str | None, base: bool, device: str = "cpu") -> tuple[Any, Any, dict[str, Any]]:
    """Load what to evaluate, as ``trl-credit train`` loaded it: ``(model, tokenizer, description)``.

    The base model is loaded with the config's dtype, attention and quantization (4-bit NF4 for
    QLoRA configs); a PEFT adapter found in ``output_dir`` is put on top, a full checkpoint there is
    loaded instead of the base. ``base=True`` (or no ``output_dir``) evaluates the base model.
    """
    from transformers import AutoTokenizer
    from trl import get_quantization_config
    from trl.trainer.utils import create_model_from_path

    from trl_credit.app.models import resolve_model

    margs, targs = cfg.model_args, cfg.training_args
    base_path = resolve_model(margs.model_name_or_path)
    init = dict(revision=margs.model_revision, trust_remote_code=targs.trust_remote_code,
                attn_implementation=margs.attn_implementation, dtype=margs.dtype)  # fmt: skip
    init.update(targs.model_init_kwargs or {})
    init = {k: v for k, v in init.items() if v is not None}
    quantization = get_quantization_config(margs)
    if quantization is not None:
        init["quantization_config"] = quantization
        init["device_map"] = {"": device}
    else:
        init["device_map"] = None
    weights, adapter, kind = base_path, None, "base"
    if output_dir is not None and not base:
        if os.path.isfile(os.path.join(output_dir, "adapter_config.json")):
            adapter, kind = output_dir, "adapter"
        elif os.path.isfile(os.path.join(output_dir, "config.json")):
            weights, kind = output_dir, "full"
        else:
            raise ConfigError([f"{output_dir}: no trained model (adapter_config.json or config.json); "
                               "was training finished? Use --base for the base model"])  # fmt: skip
    model = create_model_from_path(weights, **init)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    if quantization is None:
        model = model.to(device)
    model.eval()
    trained = output_dir is not None and not base
    has_tokenizer = trained and os.path.isfile(os.path.join(output_dir, "tokenizer_config.json"))
    tokenizer = AutoTokenizer.from_pretrained(output_dir if has_tokenizer else base_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer, {"evaluated": kind, "model": margs.model_name_or_path, "weights": weights,
                              "adapter": adapter, "load_in_4bit": quantization is not None, "device": device}


def _split(cfg, split: str):
    from trl_credit.app.train_command import load_datasets

    args = cfg.script_args
    if split == args.dataset_train_split:
        return load_datasets(cfg)[0]
    args.dataset_test_split = split
    dataset = load_datasets(cfg)[1]
    if dataset is None:
        raise ConfigError([f"{cfg.path}: dataset {args.dataset_name!r} has no split {split!r}"])
    return dataset


def sampling_options(cfg) -> dict[str, Any]:
    """The config's sampling options, as TRL's GRPOTrainer passes them to ``generate``."""
    t = cfg.training_args
    options = {"temperature": t.temperature, "top_p": t.top_p, "top_k": t.top_k, "min_p": t.min_p,
               "repetition_penalty": t.repetition_penalty}  # fmt: skip
    fixed = {"max_new_tokens", "do_sample", "num_return_sequences", "pad_token_id", "eos_token_id", "bos_token_id"}
    options.update({k: v for k, v in (t.generation_kwargs or {}).items() if k not in fixed})
    return options


def default_json_path(cfg, output_dir: str | None, split: str, base: bool) -> str:
    folder = output_dir or cfg.training_args.output_dir
    return os.path.join(folder, f"eval_{split}{'_base' if base or output_dir is None else ''}.json")


def run_eval(
    target: str,
    *,
    split: str = "test",
    samples: int | None = None,
    ks: list[int] | None = None,
    n: int | None = None,
    json_path: str | None = None,
    base: bool = False,
    max_new_tokens: int | None = None,
    seed: int | None = None,
    batch_size: int = 32,
    threshold: float = 1.0,
    device: str | None = None,
) -> dict[str, Any]:
    """Evaluate ``target`` (config file or output dir); write the JSON and return the result dict.

    Defaults from the config: ``n`` = ``num_generations`` (at least ``max(ks)``), ``max_new_tokens``
    = ``heldout_max_new_tokens`` (the length ``trl-credit train``'s held-out accuracy uses), ``seed``
    = ``seed``. ``samples`` keeps the first rows of the split (default: all). ``n=0``: greedy only.
    """
    import importlib.metadata

    from trl_credit.app.heldout import evaluate_model, write_metrics
    from trl_credit.app.rewards import known_reward_names
    from trl_credit.app.train_command import reward_functions

    started = time.time()
    cfg, output_dir = resolve_source(target)
    ks = sorted(set(ks or [1]))
    if n is None:
        n = max(cfg.training_args.num_generations or 1, max(ks))
    dataset = _split(cfg, split)
    if samples is not None:
        dataset = dataset.select(range(min(samples, len(dataset))))
    funcs = [f for f in reward_functions(cfg) if callable(f)]  # a reward *model* path is not evaluated here
    if not funcs:
        raise ConfigError([f"{cfg.path}: no reward function to verify with (reward models are not supported by eval); "
                           f"known: {known_reward_names()}"])  # fmt: skip
    model, tokenizer, described = load_model(cfg, output_dir, base, _device(cfg, device))
    seed = cfg.training_args.seed if seed is None else seed
    result = evaluate_model(
        model, tokenizer, dataset, funcs, n=n, ks=ks, sampling=sampling_options(cfg),
        max_new_tokens=max_new_tokens or cfg.credit_args.heldout_max_new_tokens, batch_size=batch_size,
        seed=seed, threshold=threshold,
    )  # fmt: skip
    try:
        version = importlib.metadata.version("trl-credit")
    except importlib.metadata.PackageNotFoundError:
        version = None
    header = {"source": os.path.abspath(target), "config": os.path.abspath(cfg.path),
              "output_dir": os.path.abspath(output_dir) if output_dir else None, "split": split,
              "dataset": cfg.script_args.dataset_name or "arithmetic", "trl_credit_version": version,
              **described}  # fmt: skip
    result = {**header, **result}
    result["seconds"]["total"] = round(time.time() - started, 2)
    path = json_path or default_json_path(cfg, output_dir, split, base)
    write_metrics(path, result)
    result["json"] = os.path.abspath(path)
    return result


def _fmt(value: Any) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.3f}"


def format_table(result: dict[str, Any]) -> str:
    """A markdown table of the headline figures of a `run_eval` result."""
    what = {"adapter": f"adapter {result['adapter']} on {result['model']}", "full": f"model {result['weights']}",
            "base": f"base model {result['model']}"}[result["evaluated"]]  # fmt: skip
    lines = [f"trl-credit eval: {what}; split {result['split']}, {result['num_prompts']} prompts, "
             f"verifier {result['verifier']}", "", "| metric | value |", "|---|---|"]  # fmt: skip
    if "greedy_accuracy" in result:
        lines.append(f"| greedy accuracy | {_fmt(result['greedy_accuracy'])} |")
        for name, value in result["greedy_rewards"].items():
            if name != result["verifier"]:
                lines.append(f"| greedy mean {name} | {_fmt(value)} |")
    if result.get("n"):
        temperature = result["sampling"].get("temperature")
        for k, value in result["pass_at_k"].items():
            lines.append(f"| pass@{k} (n={result['n']}, temperature {temperature}) | {_fmt(value)} |")
        lines.append(f"| sampled accuracy (reward >= {result['threshold']}) | {_fmt(result['sampled_accuracy'])} |")
        for name, value in result["sampled_rewards"].items():
            lines.append(f"| sampled mean {name} | {_fmt(value)} |")
    lines.append(f"\njson: {result['json']}  ({result['seconds']['total']} s)")
    return "\n".join(lines)


def parse_ks(text: str) -> list[int]:
    """``"1,4"`` -> ``[1, 4]``."""
    try:
        ks = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--k takes integers separated by commas, got {text!r}") from None
    if not ks or min(ks) < 1:
        raise ValueError(f"--k values must be >= 1, got {text!r}")
    return ks
