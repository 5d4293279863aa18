"""Evaluation helpers: greedy held-out accuracy, sampled pass@k, reward curves, metrics files."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

from transformers import TrainerCallback

from trl_credit.app.rewards import arithmetic_accuracy

logger = logging.getLogger(__name__)

__all__ = ["HeldoutCurve", "evaluate_model", "generate_answers", "heldout_accuracy", "pass_at_k", "plot_reward_curve",
           "score_completions", "write_metrics"]

_REWARD_KEY = re.compile(r"^rewards/(.+)/mean$")


def _is_conversational(prompt: Any) -> bool:
    return isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) for m in prompt)


def _generate(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Any],
    max_new_tokens: int,
    batch_size: int,
    sampling: dict[str, Any] | None = None,
    num_return_sequences: int = 1,
) -> tuple[list[str], list[list[int]]]:
    """Completions as (texts, token ids without padding or the trailing pad run).

    Greedy when ``sampling`` is None, else sampled with those `GenerationConfig` options
    (``temperature``, ``top_p``, ...); ``num_return_sequences`` completions per prompt, prompt-major.
    """
    import torch
    from transformers import GenerationConfig

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if num_return_sequences < 1:
        raise ValueError(f"num_return_sequences must be >= 1, got {num_return_sequences}")
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
    options: dict[str, Any] = {"do_sample": False}
    if sampling is not None:
        options = {"do_sample": True, **sampling}  # None values too: top_k=None means no top-k, as in TRL
    if num_return_sequences > 1:
        options["num_return_sequences"] = num_return_sequences
    generation_config = GenerationConfig(
        max_new_tokens=max_new_tokens, pad_token_id=pad_id, eos_token_id=eos_id, **options
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


class HeldoutCurve(TrainerCallback):
    """A ``transformers.TrainerCallback`` that measures ``evaluate()`` every ``every`` optimiser steps.

    ``points`` holds ``[step, value]`` pairs and ``seconds`` the time spent evaluating. Built from a
    zero-argument ``evaluate`` (``trl-credit train`` passes greedy held-out accuracy), so the training
    loop is untouched: greedy decoding draws no random numbers, and the run trains exactly as it would
    without the curve. Points cover the steps run in this process (a resumed run starts a new curve).
    """

    def __init__(self, evaluate: Callable[[], float], every: int, log: Callable[[str], Any] = print) -> None:
        if every < 1:
            raise ValueError(f"HeldoutCurve: every must be >= 1, got {every}")
        self.evaluate, self.every, self.log = evaluate, every, log
        self.points: list[list[float]] = []
        self.seconds = 0.0

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step % self.every == 0:
            clock = time.time()
            value = float(self.evaluate())
            self.seconds += time.time() - clock
            self.points.append([state.global_step, value])
            self.log(f"held-out accuracy at step {state.global_step}: {value:.3f}")
        return control


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct: ``1 - C(n-c, k) / C(n, k)``.

    The estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code"): the
    probability that at least one of ``k`` samples drawn without replacement from the ``n`` is
    correct. Computed with exact integers (no overflow, no rounding before the final float).

    Raises:
        ValueError: unless ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:
        return 1.0
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


def _reward_name(func: Any) -> str:
    return getattr(func, "__name__", type(func).__name__)


def score_completions(
    reward_funcs: Sequence[Callable[..., list[Any]]],
    prompts: Sequence[Any],
    texts: Sequence[str],
    completion_ids: Sequence[Sequence[int]],
    columns: dict[str, Sequence[Any]],
) -> list[list[float | None]]:
    """Score completions with each reward function, called as TRL's GRPOTrainer calls it.

    ``prompts``, ``texts``, ``completion_ids`` and every list in ``columns`` are aligned (one entry
    per completion). Conversational prompts get ``[{"role": "assistant", "content": text}]``
    completions. TRL's extra keywords are passed too (``trainer_state=None``, no-op ``log_extra`` and
    ``log_metric``). Returns one list per reward function; ``None`` stays ``None`` (not scored).
    """
    completions: list[Any] = [
        [{"role": "assistant", "content": t}] if _is_conversational(p) else t for p, t in zip(prompts, texts)
    ]
    extra = {"trainer_state": None, "log_extra": lambda *a, **k: None, "log_metric": lambda *a, **k: None}
    scores = []
    for func in reward_funcs:
        out = func(prompts=list(prompts), completions=completions, completion_ids=[list(i) for i in completion_ids],
                   **{k: list(v) for k, v in columns.items()}, **extra)  # fmt: skip
        values = [None if r is None or (isinstance(r, float) and math.isnan(r)) else float(r) for r in out]
        if len(values) != len(texts):
            raise ValueError(f"reward function {_reward_name(func)} returned {len(values)} rewards for "
                             f"{len(texts)} completions")  # fmt: skip
        scores.append(values)
    return scores


def _mean(values: Sequence[float | None]) -> float:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else math.nan


def _prompt_text(prompt: Any) -> str:
    if _is_conversational(prompt):
        return str(prompt[-1].get("content", "")) if prompt else ""
    return str(prompt)


def evaluate_model(
    model: Any,
    tokenizer: Any,
    dataset: Any,
    reward_funcs: Sequence[Callable[..., list[Any]]],
    *,
    n: int = 8,
    ks: Sequence[int] = (1,),
    sampling: dict[str, Any] | None = None,
    max_new_tokens: int = 24,
    batch_size: int = 32,
    seed: int = 0,
    threshold: float = 1.0,
    greedy: bool = True,
) -> dict[str, Any]:
    """Greedy accuracy and sampled pass@k of ``model`` on ``dataset`` (a ``prompt`` column + any others).

    The first reward function is the verifier (as in ``trl-credit train``'s held-out accuracy); the
    others are reported as means. Greedy: one completion per prompt, ``greedy_accuracy`` = the mean
    verifier reward (``None`` rewards left out) = :func:`heldout_accuracy`. Sampled: ``n``
    completions per prompt with ``sampling`` (`GenerationConfig` options: ``temperature``, ``top_p``,
    ``top_k``, ``min_p``, ``repetition_penalty``; prompt ``i`` is sampled alone with seed ``seed + i``,
    so its samples do not depend on ``batch_size`` or on the other prompts; the global RNG is restored);
    a sample is correct when its verifier reward is ``>= threshold``; ``pass_at_k[k]`` is the mean
    over prompts of :func:`pass_at_k` (prompts with fewer than ``k`` scored samples are left out).
    ``n=0`` skips sampling.

    Returns a JSON-ready dict: ``num_prompts``, ``n``, ``k``, ``threshold``, ``verifier``,
    ``reward_names``, ``greedy_accuracy``, ``greedy_rewards``, ``sampled_rewards``,
    ``sampled_accuracy`` (fraction of correct samples), ``pass_at_k`` (``{"1": ...}``),
    ``seconds`` and ``per_prompt`` (prompt, columns, completions, rewards, correct count).
    """
    import torch

    if not reward_funcs:
        raise ValueError("evaluate_model: no reward function")
    if len(dataset) == 0:
        raise ValueError("evaluate_model: empty dataset")
    ks = sorted({int(k) for k in ks})
    if n < 0 or (n and any(k < 1 or k > n for k in ks)):
        raise ValueError(f"evaluate_model: every k must be in 1..n (n={n}), got {ks}")
    names = [_reward_name(f) for f in reward_funcs]
    prompts = list(dataset["prompt"])
    columns = {k: list(dataset[k]) for k in dataset.column_names if k != "prompt"}
    per_prompt: list[dict[str, Any]] = [
        {"index": i, "prompt": _prompt_text(p), **{k: v[i] for k, v in columns.items() if _plain(v[i])}}
        for i, p in enumerate(prompts)
    ]
    result: dict[str, Any] = {"num_prompts": len(prompts), "n": n, "k": ks, "threshold": threshold,
                              "verifier": names[0], "reward_names": names, "max_new_tokens": max_new_tokens,
                              "seed": seed, "sampling": dict(sampling or {}), "seconds": {}}  # fmt: skip
    if greedy:
        clock = time.time()
        texts, ids = _generate(model, tokenizer, prompts, max_new_tokens, batch_size)
        scores = score_completions(reward_funcs, prompts, texts, ids, columns)
        result["seconds"]["greedy"] = round(time.time() - clock, 2)
        result["greedy_accuracy"] = _mean(scores[0])
        result["greedy_rewards"] = {name: _mean(s) for name, s in zip(names, scores)}
        for i, row in enumerate(per_prompt):
            row["greedy"] = {"completion": texts[i], "rewards": {name: s[i] for name, s in zip(names, scores)}}
    if n:
        clock = time.time()
        device = next(model.parameters()).device
        texts, ids = [], []
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for i, prompt in enumerate(prompts):  # one prompt at a time, seeded: samples do not depend on batching
                torch.manual_seed(seed + i)
                more = _generate(model, tokenizer, [prompt], max_new_tokens, 1, sampling=sampling or {},
                                 num_return_sequences=n)  # fmt: skip
                texts += more[0]
                ids += more[1]
        repeated = {k: [x for x in v for _ in range(n)] for k, v in columns.items()}
        scores = score_completions(reward_funcs, [p for p in prompts for _ in range(n)], texts, ids, repeated)
        result["seconds"]["sampled"] = round(time.time() - clock, 2)
        result["sampled_rewards"] = {name: _mean(s) for name, s in zip(names, scores)}
        verdicts = [None if r is None else r >= threshold for r in scores[0]]
        judged = [v for v in verdicts if v is not None]
        result["sampled_accuracy"] = sum(judged) / len(judged) if judged else math.nan
        pass_values: dict[int, list[float]] = {k: [] for k in ks}
        for i, row in enumerate(per_prompt):
            mine = verdicts[i * n : (i + 1) * n]
            scored = [v for v in mine if v is not None]
            row["samples"] = texts[i * n : (i + 1) * n]
            row["sample_rewards"] = {name: s[i * n : (i + 1) * n] for name, s in zip(names, scores)}
            row["scored"], row["correct"] = len(scored), sum(scored)
            for k in ks:
                if len(scored) >= k:
                    pass_values[k].append(pass_at_k(len(scored), sum(scored), k))
        result["pass_at_k"] = {str(k): _mean(v) for k, v in pass_values.items()}
        result["pass_at_k_prompts"] = {str(k): len(v) for k, v in pass_values.items()}
    result["per_prompt"] = per_prompt
    return result


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


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
