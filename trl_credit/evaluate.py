"""Evaluation helpers: greedy held-out accuracy, reward curves, metrics files."""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

from trl_credit.rewards import arithmetic_accuracy

logger = logging.getLogger(__name__)

__all__ = ["generate_answers", "heldout_accuracy", "plot_reward_curve", "write_metrics"]

_REWARD_KEY = re.compile(r"^rewards/(.+)/mean$")


def _is_conversational(prompt: Any) -> bool:
    return isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) for m in prompt)


def _generate(
    model: Any, tokenizer: Any, prompts: Sequence[Any], max_new_tokens: int, batch_size: int
) -> tuple[list[str], list[list[int]]]:
    """Greedy completions as (texts, token ids without padding or the trailing pad run)."""
    import torch
    from transformers import GenerationConfig

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    texts = [
        tokenizer.apply_chat_template(list(p), tokenize=False, add_generation_prompt=True)
        if _is_conversational(p)
        else str(p)
        for p in prompts
    ]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model_gen = getattr(model, "generation_config", None)
    eos_id = getattr(model_gen, "eos_token_id", None)
    if eos_id is None:
        eos_id = tokenizer.eos_token_id
    generation_config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id, eos_token_id=eos_id
    )
    eos_ids = set(eos_id if isinstance(eos_id, list) else [eos_id]) - {None}
    device = next(model.parameters()).device

    old_side, old_pad = tokenizer.padding_side, tokenizer.pad_token
    was_training = model.training
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    out_texts: list[str] = []
    out_ids: list[list[int]] = []
    try:
        model.eval()
        with torch.inference_mode():
            for start in range(0, len(texts), batch_size):
                # Chat templates already contain the special tokens, as in TRL's GRPOTrainer.
                enc = tokenizer(
                    texts[start : start + batch_size], return_tensors="pt", padding=True, add_special_tokens=False
                ).to(device)
                generated = model.generate(**enc, generation_config=generation_config)
                for row in generated[:, enc["input_ids"].shape[1] :].tolist():
                    # cut after the first end-of-sequence token (keep it, like TRL's completion ids)
                    cut = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
                    out_ids.append(row[:cut])
                    out_texts.append(tokenizer.decode(row[:cut], skip_special_tokens=True))
    finally:
        tokenizer.padding_side, tokenizer.pad_token = old_side, old_pad
        model.train(was_training)
    return out_texts, out_ids


def generate_answers(
    model: Any, tokenizer: Any, prompts: Sequence[Any], max_new_tokens: int = 24, batch_size: int = 32
) -> list[str]:
    """Greedy-decode one completion per prompt, in batches with left padding.

    Conversational prompts (lists of message dicts) go through the tokenizer's chat template with
    ``add_generation_prompt=True``; plain strings are used as they are. Returns the decoded
    completions (special tokens skipped), one per prompt, in order. The model's train/eval mode and
    the tokenizer's padding side are restored afterwards.
    """
    return _generate(model, tokenizer, prompts, max_new_tokens, batch_size)[0]


def heldout_accuracy(
    model: Any,
    tokenizer: Any,
    dataset: Any,
    reward_fn: Callable[..., list[Any]] = arithmetic_accuracy,
    max_new_tokens: int = 24,
    batch_size: int = 32,
    limit: int | None = None,
) -> float:
    """Mean of ``reward_fn`` over greedy completions of ``dataset["prompt"]``.

    ``reward_fn`` is called the way TRL's GRPOTrainer calls reward functions: ``completions``
    (message lists ``[{"role": "assistant", "content": ...}]`` for conversational prompts, else
    strings), ``prompts``, ``completion_ids`` and every other dataset column as keyword arguments.
    ``None`` rewards are left out of the mean (NaN if all are None). ``limit`` keeps the first rows.
    """
    if limit is not None:
        dataset = dataset.select(range(min(limit, len(dataset))))
    if len(dataset) == 0:
        raise ValueError("heldout_accuracy: empty dataset")
    prompts = list(dataset["prompt"])
    texts, ids = _generate(model, tokenizer, prompts, max_new_tokens, batch_size)
    completions: list[Any] = [
        [{"role": "assistant", "content": t}] if _is_conversational(p) else t for p, t in zip(prompts, texts)
    ]
    columns = {k: list(dataset[k]) for k in dataset.column_names if k != "prompt"}
    rewards = reward_fn(completions=completions, prompts=prompts, completion_ids=ids, **columns)
    values = [float(r) for r in rewards if r is not None]
    return sum(values) / len(values) if values else math.nan


def plot_reward_curve(log_history: Sequence[dict[str, Any]], path: str | os.PathLike[str]) -> None:
    """Plot ``reward`` and every ``rewards/<name>/mean`` against ``step`` and save a PNG at ``path``.

    ``log_history`` is a transformers ``Trainer.state.log_history``; entries without ``step`` or
    without reward keys (e.g. the final train summary) are skipped. With no reward logged at all, the
    figure says so instead of failing.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, tuple[list[float], list[float]]] = {}
    for entry in log_history:
        if "step" not in entry:
            continue
        for key, value in entry.items():
            if key == "reward" or _REWARD_KEY.match(key):
                if isinstance(value, (int, float)) and not math.isnan(float(value)):
                    xs, ys = series.setdefault(key, ([], []))
                    xs.append(float(entry["step"]))
                    ys.append(float(value))

    fig, ax = plt.subplots(figsize=(7, 4))
    try:
        for key in sorted(series, key=lambda k: (k != "reward", k)):
            xs, ys = series[key]
            ax.plot(xs, ys, marker="o" if len(xs) < 50 else None, markersize=3,
                    linewidth=2.0 if key == "reward" else 1.2, label=key)  # fmt: skip
        if series:
            ax.legend(loc="best", fontsize=8)
        else:
            logger.warning("plot_reward_curve: no reward entries in log_history")
            ax.text(0.5, 0.5, "no reward logged", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel("step")
        ax.set_ylabel("reward")
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        parent = os.path.dirname(os.fspath(path))
        if parent:
            os.makedirs(parent, exist_ok=True)
        fig.savefig(path, format="png", dpi=100)
    finally:
        plt.close(fig)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):  # numpy / torch scalars and arrays
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def write_metrics(path: str | os.PathLike[str], metrics: dict[str, Any]) -> None:
    """Write ``metrics`` as pretty, key-sorted JSON (parent directories created)."""
    parent = os.path.dirname(os.fspath(path))
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(metrics, fh, indent=2, sort_keys=True, default=_jsonable)
        fh.write("\n")
