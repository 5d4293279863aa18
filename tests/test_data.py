"""Tests for trl_credit.app.data: the arithmetic generator and load_train_eval."""

from __future__ import annotations

import json
import re

import pytest

from trl_credit.app.data import load_train_eval, make_arithmetic, parse_arithmetic_spec

_OPERAND = re.compile(r"\(?(-?\d+)\)?")


def _operands(question: str) -> list[int]:
    return [int(x) for x in _OPERAND.findall(question)]


def test_arithmetic_columns_and_prompt_format():
    ds = make_arithmetic(n=5, seed=0)
    assert len(ds) == 5
    assert {"prompt", "answer", "difficulty", "question"} <= set(ds.column_names)
    row = ds[0]
    assert row["prompt"] == [
        {"role": "user", "content": f"What is {row['question']}? Answer with just the number."}
    ]
    assert isinstance(row["answer"], str) and isinstance(row["difficulty"], int)
    plain = make_arithmetic(n=5, seed=0, conversational=False)
    assert plain["prompt"][0] == f"What is {plain['question'][0]}? Answer with just the number."
    assert plain["question"] == ds["question"]


def test_arithmetic_is_deterministic_per_seed():
    a = make_arithmetic(n=50, seed=7, ops=("+", "-", "*"), num_terms=3)
    b = make_arithmetic(n=50, seed=7, ops=("+", "-", "*"), num_terms=3)
    c = make_arithmetic(n=50, seed=8, ops=("+", "-", "*"), num_terms=3)
    assert a.to_list() == b.to_list()
    assert a["question"] != c["question"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"ops": ("+", "-", "*"), "num_terms": 4},
        {"ops": "-*", "min_value": -30, "max_value": 30, "num_terms": 3},
    ],
)
def test_answers_match_python_eval(kwargs):
    ds = make_arithmetic(n=300, seed=1, **kwargs)
    for question, answer, solution in zip(ds["question"], ds["answer"], ds["solution"]):
        assert int(answer) == eval(question), question  # noqa: S307 (trusted, generated text)
        assert solution == answer


def test_difficulty_knobs_change_ranges_and_levels():
    easy = make_arithmetic(n=200, seed=0, min_value=1, max_value=9)
    hard = make_arithmetic(n=200, seed=0, min_value=100, max_value=999, ops=("*",), num_terms=3)
    easy_ops = [v for q in easy["question"] for v in _operands(q)]
    hard_ops = [v for q in hard["question"] for v in _operands(q)]
    assert min(easy_ops) >= 1 and max(easy_ops) <= 9
    assert min(hard_ops) >= 100 and max(hard_ops) <= 999
    assert all(len(_operands(q)) == 2 for q in easy["question"])
    assert all(len(_operands(q)) == 3 and q.count("*") == 2 for q in hard["question"])
    assert set(easy["difficulty"]) == {1}
    assert set(hard["difficulty"]) == {3 + 1 + 1}  # 3 digits, one extra term, multiplication
    assert "-" not in "".join(easy["question"])

    mixed = make_arithmetic(n=300, seed=0, ops=("+", "-"))
    assert {"+", "-"} <= {tok for q in mixed["question"] for tok in q.split()}
    neg = make_arithmetic(n=100, seed=0, min_value=-5, max_value=-1)
    assert all(v < 0 for q in neg["question"] for v in _operands(q))


def test_invalid_knobs_raise():
    with pytest.raises(ValueError, match="ops"):
        make_arithmetic(n=1, ops=("/",))
    with pytest.raises(ValueError, match="num_terms"):
        make_arithmetic(n=1, num_terms=1)
    with pytest.raises(ValueError, match="min_value"):
        make_arithmetic(n=1, min_value=5, max_value=1)
    with pytest.raises(ValueError, match="could only generate"):
        make_arithmetic(n=10, min_value=1, max_value=2, unique=True)  # only 4 distinct questions


def test_load_train_eval_arithmetic_is_disjoint():
    train, held = load_train_eval("arithmetic", None)
    assert len(train) == 1000 and len(held) == 100
    assert len(set(held["question"])) == 100, "held-out questions must be unique"
    assert not set(train["question"]) & set(held["question"])
    # 1..20 with "+" has only 400 questions: train still fills up, from the 300 left over
    assert len(set(train["question"])) <= 300
    again, held_again = load_train_eval("arithmetic", None)
    assert again.to_list() == train.to_list() and held_again.to_list() == held.to_list()


def test_load_train_eval_spec_string_and_kwargs():
    train, held = load_train_eval(
        "arithmetic:n=40,max_value=50,ops=+*,num_terms=3,eval_n=10", None, seed=5, min_value=10
    )
    assert len(train) == 40 and len(held) == 10
    values = [v for q in list(train["question"]) + list(held["question"]) for v in _operands(q)]
    assert min(values) >= 10 and max(values) <= 50
    assert all(len(_operands(q)) == 3 for q in train["question"])
    assert set("".join(train["question"])) <= set("0123456789 +*")
    # dataset_config carries the same options; the name's suffix wins over it
    t2, _ = load_train_eval("arithmetic:n=7", "n=3,max_value=5,eval_n=5")
    assert len(t2) == 7 and max(v for q in t2["question"] for v in _operands(q)) <= 5
    with pytest.raises(ValueError, match="unknown arithmetic option"):
        load_train_eval("arithmetic:nn=3", None)


def test_parse_arithmetic_spec():
    assert parse_arithmetic_spec("n=5, ops=+-*,conversational=false") == {
        "n": 5,
        "ops": ("+", "-", "*"),
        "conversational": False,
    }
    assert parse_arithmetic_spec(None) == {}
    with pytest.raises(ValueError, match="key=value"):
        parse_arithmetic_spec("n5")


@pytest.mark.parametrize("ext", [".jsonl", ".json", ".csv", ".parquet"])
def test_load_train_eval_local_files(tmp_path, ext):
    ds = make_arithmetic(n=6, seed=0, conversational=False)
    path = tmp_path / f"data{ext}"
    if ext == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in ds.to_list()))
    elif ext == ".json":
        ds.to_json(str(path), lines=False)
    elif ext == ".csv":
        ds.to_csv(str(path), index=False)
    else:
        ds.to_parquet(str(path))
    train, held = load_train_eval(str(path), None)
    assert held is None
    assert len(train) == 6
    assert [str(a) for a in train["answer"]] == ds["answer"]


def test_load_train_eval_save_to_disk_dir(tmp_path):
    from datasets import DatasetDict

    train_ds, test_ds = make_arithmetic(n=4, seed=0), make_arithmetic(n=3, seed=1)
    DatasetDict({"train": train_ds, "test": test_ds}).save_to_disk(str(tmp_path / "dd"))
    train, held = load_train_eval(str(tmp_path / "dd"), None)
    assert train["question"] == train_ds["question"] and held["question"] == test_ds["question"]
    with pytest.raises(ValueError, match="no split 'validation'"):
        load_train_eval(str(tmp_path / "dd"), None, train_split="validation")


def test_load_train_eval_unknown_hub_dataset_fails_clearly(monkeypatch):
    import datasets.config
    import huggingface_hub.constants

    # no network here: offline mode makes the failure immediate instead of a connection timeout
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True, raising=False)
    with pytest.raises(RuntimeError, match="could not load dataset 'no-such-owner/no-such-dataset-xyz'"):
        load_train_eval("no-such-owner/no-such-dataset-xyz", None)
