"""Datasets: the built-in seeded ``arithmetic`` generator and a loader for train/eval splits.

``arithmetic`` rows look like::

    {"prompt": [{"role": "user", "content": "What is 12 + 7? Answer with just the number."}],
     "question": "12 + 7", "answer": "19", "solution": "19", "difficulty": 2}

``solution`` repeats ``answer`` so TRL's ``accuracy_reward`` (which reads ``solution``) works as is.
The answer follows Python's operator precedence (``*`` before ``+``/``-``), so ``eval(question)``
always equals ``int(answer)``.

``difficulty`` is a per-row integer that grows with every knob: the digit count of the largest
operand, plus one per term beyond two, plus one if the question multiplies.
"""

from __future__ import annotations

import os
import random
from collections.abc import Collection, Sequence
from typing import Any

__all__ = ["ARITHMETIC_OPS", "PROMPTS", "load_train_eval", "make_arithmetic", "parse_arithmetic_spec"]

ARITHMETIC_OPS: tuple[str, ...] = ("+", "-", "*")
PROMPTS: dict[str, str] = {
    "answer": "What is {question}? Answer with just the number.",
    # for process scores: the working is an equation the built-in step checker can score
    "working": "What is {question}? Write the working as one equation, then the answer.",
}
_LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def _format_operand(value: int) -> str:
    return f"({value})" if value < 0 else str(value)


def _difficulty(operands: Sequence[int], ops: Sequence[str]) -> int:
    digits = max(len(str(abs(v))) for v in operands)
    return digits + (len(operands) - 2) + (1 if "*" in ops else 0)


def _evaluate(operands: Sequence[int], ops: Sequence[str]) -> int:
    """Evaluate with standard precedence: fold products first, then add/subtract left to right."""
    terms: list[int] = [operands[0]]
    signs: list[str] = []
    for op, value in zip(ops, operands[1:]):
        if op == "*":
            terms[-1] *= value
        else:
            terms.append(value)
            signs.append(op)
    total = terms[0]
    for sign, value in zip(signs, terms[1:]):
        total = total + value if sign == "+" else total - value
    return total


def make_arithmetic(
    n: int = 1000,
    seed: int = 0,
    min_value: int = 1,
    max_value: int = 20,
    ops: Sequence[str] = ("+",),
    num_terms: int = 2,
    conversational: bool = True,
    *,
    unique: bool = False,
    exclude_questions: Collection[str] = (),
    prompt: str = "answer",
) -> Any:
    """Generate ``n`` arithmetic questions as a ``datasets.Dataset`` (deterministic for ``seed``).

    Args:
        n: number of rows.
        seed: RNG seed; same arguments give the same rows.
        min_value, max_value: inclusive operand range (negative operands are parenthesised).
        ops: operators drawn uniformly per position, from ``+``, ``-``, ``*`` (a string such as
            ``"+-"`` is read as one operator per character).
        num_terms: operands per question (>= 2).
        conversational: ``prompt`` as a one-message chat list (True) or a plain string (False).
        unique: no two rows share a question (raises if the space is too small for ``n``).
        exclude_questions: questions (``"a + b"`` form, the ``question`` column) never to emit.
        prompt: the instruction, a key of ``PROMPTS``: ``answer`` ("Answer with just the number.") or
            ``working`` ("Write the working as one equation, then the answer.": a completion such as
            "12 + 7 = 19" that the ``arithmetic`` step checker and the ``arithmetic_steps`` reward score).

    Returns:
        A Dataset with columns ``prompt``, ``question``, ``answer`` (str), ``solution`` (= answer),
        ``difficulty`` (int).
    """
    from datasets import Dataset

    ops = tuple(ops)
    if not ops or any(op not in ARITHMETIC_OPS for op in ops):
        raise ValueError(f"ops must be a non-empty subset of {ARITHMETIC_OPS}, got {ops!r}")
    if num_terms < 2:
        raise ValueError(f"num_terms must be >= 2, got {num_terms}")
    if min_value > max_value:
        raise ValueError(f"min_value ({min_value}) > max_value ({max_value})")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if prompt not in PROMPTS:
        raise ValueError(f"prompt must be one of {sorted(PROMPTS)}, got {prompt!r}")

    rng = random.Random(seed)
    excluded = set(exclude_questions)
    seen: set[str] = set()
    rows: dict[str, list[Any]] = {k: [] for k in ("prompt", "question", "answer", "solution", "difficulty")}
    attempts, max_attempts = 0, 100 * n + 1000
    while len(rows["answer"]) < n:
        attempts += 1
        if attempts > max_attempts:
            raise ValueError(
                f"could only generate {len(rows['answer'])} of {n} arithmetic questions "
                f"(unique={unique}, {len(excluded)} excluded): widen the operand range or lower n"
            )
        operands = [rng.randint(min_value, max_value) for _ in range(num_terms)]
        row_ops = [rng.choice(ops) for _ in range(num_terms - 1)]
        question = _format_operand(operands[0]) + "".join(
            f" {op} {_format_operand(v)}" for op, v in zip(row_ops, operands[1:])
        )
        if question in excluded or (unique and question in seen):
            continue
        seen.add(question)
        answer = str(_evaluate(operands, row_ops))
        content = PROMPTS[prompt].format(question=question)
        rows["prompt"].append([{"role": "user", "content": content}] if conversational else content)
        rows["question"].append(question)
        rows["answer"].append(answer)
        rows["solution"].append(answer)
        rows["difficulty"].append(_difficulty(operands, row_ops))
    return Dataset.from_dict(rows)


def _parse_value(text: str) -> Any:
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return int(text)
    except ValueError:
        return text.strip()


def parse_arithmetic_spec(spec: str | None) -> dict[str, Any]:
    """Parse ``"key=value,key=value"`` into keyword arguments (ints and booleans converted).

    ``ops`` takes operator characters (``ops=+-*``, or ``ops=+|*``); ``ops`` values are tuples.
    """
    kwargs: dict[str, Any] = {}
    if not spec:
        return kwargs
    for item in spec.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"arithmetic option {item!r} is not key=value (in {spec!r})")
        key = key.strip()
        kwargs[key] = tuple(c for c in value if c in ARITHMETIC_OPS) if key == "ops" else _parse_value(value)
    return kwargs


def _arithmetic_splits(kwargs: dict[str, Any]) -> tuple[Any, Any]:
    import inspect

    kwargs = dict(kwargs)
    eval_n = int(kwargs.pop("eval_n", 100))
    seed = int(kwargs.get("seed", 0))
    eval_seed = int(kwargs.pop("eval_seed", seed + 1))
    allowed = set(inspect.signature(make_arithmetic).parameters) - {"unique", "exclude_questions"}
    unknown = set(kwargs) - allowed
    if unknown:
        raise ValueError(
            f"unknown arithmetic option(s) {sorted(unknown)}; known: {sorted(allowed | {'eval_n', 'eval_seed'})}"
        )
    if eval_seed == seed:
        raise ValueError("eval_seed must differ from seed")
    # Held-out questions are drawn first (unique), then training avoids every one of them.
    eval_kwargs = {**kwargs, "n": eval_n, "seed": eval_seed}
    eval_ds = make_arithmetic(**eval_kwargs, unique=True)
    train_ds = make_arithmetic(**kwargs, exclude_questions=set(eval_ds["question"]))
    return train_ds, eval_ds


def _pick_split(ds: Any, split: str | None) -> Any:
    return ds[split] if split is not None and split in ds else None


def load_train_eval(
    dataset_name: str | None,
    dataset_config: str | None = None,
    train_split: str = "train",
    test_split: str | None = "test",
    **arithmetic_kwargs: Any,
) -> tuple[Any, Any]:
    """Load ``(train, eval)`` datasets; ``eval`` is None when there is no such split.

    * ``None``, ``"arithmetic"`` or ``"arithmetic:key=value,..."``: the built-in generator. Options
      come from ``arithmetic_kwargs``, then ``dataset_config`` and the ``:`` suffix (later ones win),
      e.g. ``arithmetic:n=500,max_value=50,ops=+-,num_terms=3`` (``prompt=working`` asks for the
      working). ``eval_n`` (default 100) and
      ``eval_seed`` (default ``seed + 1``) shape the held-out split, whose questions are unique and
      never occur in train.
    * ``"guess"`` or ``"guess:key=value,..."``: the bundled multi-turn number-guessing task
      (`trl_credit.app.guess.guess_splits`; `trl-credit train` plays it through its ``rollout_func``).
    * A local ``.json``/``.jsonl``/``.parquet``/``.csv`` file: loaded with datasets' builder (one
      ``train`` split, so eval is None unless ``test_split == "train"``); a directory written by
      ``save_to_disk`` is loaded with ``load_from_disk``.
    * Anything else: ``datasets.load_dataset(dataset_name, dataset_config)`` (the hub; fails offline).
    """
    import datasets

    name = (dataset_name or "arithmetic").strip()
    base, _, spec = name.partition(":")
    if base.lower() == "guess" and not os.path.exists(name):
        from trl_credit.app.guess import guess_splits

        return guess_splits({**parse_arithmetic_spec(dataset_config), **parse_arithmetic_spec(spec)})
    if base.lower() == "arithmetic" and not os.path.exists(name):
        options = {**arithmetic_kwargs, **parse_arithmetic_spec(dataset_config), **parse_arithmetic_spec(spec)}
        return _arithmetic_splits(options)

    ext = os.path.splitext(name)[1].lower()
    if os.path.isfile(name) and ext in _LOCAL_FORMATS:
        loaded = datasets.load_dataset(_LOCAL_FORMATS[ext], data_files=name)
    elif os.path.isdir(name) and (
        os.path.isfile(os.path.join(name, "dataset_dict.json")) or os.path.isfile(os.path.join(name, "state.json"))
    ):
        loaded = datasets.load_from_disk(name)
    else:
        try:
            loaded = datasets.load_dataset(name, dataset_config)
        except Exception as exc:
            raise RuntimeError(
                f"could not load dataset {name!r} (config {dataset_config!r}) with datasets.load_dataset. "
                "These machines have no Hugging Face hub access: use `arithmetic`, a local "
                ".json/.jsonl/.parquet/.csv file, or a save_to_disk directory."
            ) from exc
    if not isinstance(loaded, datasets.DatasetDict):  # a single saved Dataset: no held-out part
        return loaded, None
    train = _pick_split(loaded, train_split)
    if train is None:
        raise ValueError(f"dataset {name!r} has no split {train_split!r}; splits: {list(loaded)}")
    return train, _pick_split(loaded, test_split)
