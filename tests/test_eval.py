"""``trl-credit eval``: the pass@k estimator, sampled evaluation, and train -> eval on a tiny model."""

from __future__ import annotations

import json
import math
import textwrap

import pytest
import yaml

from trl_credit.app import cli
from trl_credit.app.heldout import evaluate_model, heldout_accuracy, pass_at_k, score_completions

REWARDS_MODULE = '''
from trl_credit.app.rewards import completion_text


def odd_length(completions, **kwargs):
    """1.0 when the completion has an odd number of characters: a reward a random tiny model gets half the time."""
    return [float(len(completion_text(c)) % 2 == 1) for c in completions]
'''


# ---------------------------------------------------------------------------------------------- estimator
@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 1, 1, 0.25),  # = c / n
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (4, 0, 1, 0.0),
        (4, 0, 4, 0.0),
        (4, 4, 1, 1.0),
        (4, 4, 4, 1.0),
        (4, 2, 2, 5 / 6),  # 1 - C(2,2)/C(4,2) = 1 - 1/6
        (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (4, 1, 4, 1.0),  # n - c < k: every draw of 4 contains the correct one
        (200, 3, 1, 0.015),
    ],
)
def test_pass_at_k_vectors(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_large_n_is_exact_and_finite():
    # C(1000, 500) overflows a float; the estimator works on exact integers
    assert pass_at_k(1000, 1, 500) == pytest.approx(0.5)
    assert pass_at_k(1000, 0, 500) == 0.0


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_rejects_bad_arguments(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(n, c, k)


def test_score_completions_calls_rewards_like_trl():
    seen = {}

    def reward(prompts, completions, completion_ids, answer, trainer_state, log_metric, **kwargs):
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, answer=answer)
        return [1.0, None, float("nan")]

    prompts = [[{"role": "user", "content": "q"}]] * 3
    scores = score_completions([reward], prompts, ["a", "b", "c"], [[1], [2, 3], []], {"answer": ["1", "2", "3"]})
    assert scores == [[1.0, None, None]]  # NaN counts as not scored, like None
    assert seen["completions"][1] == [{"role": "assistant", "content": "b"}] and seen["ids"] == [[1], [2, 3], []]


# ------------------------------------------------------------------------------------- sampled, tiny model
@pytest.fixture(scope="module")
def tiny(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny_model).eval(), AutoTokenizer.from_pretrained(tiny_model)


def _odd_length(completions, **kwargs):
    from trl_credit.app.rewards import completion_text

    return [float(len(completion_text(c)) % 2 == 1) for c in completions]


def test_evaluate_model_pass_at_k_matches_its_samples(tiny):
    from trl_credit.app.data import make_arithmetic

    model, tokenizer = tiny
    ds = make_arithmetic(5, seed=3)
    out = evaluate_model(model, tokenizer, ds, [_odd_length], n=4, ks=[1, 2, 4], sampling={"temperature": 1.0},
                         max_new_tokens=6, batch_size=8, seed=7)  # fmt: skip
    assert out["num_prompts"] == 5 and out["n"] == 4 and out["k"] == [1, 2, 4] and out["verifier"] == "_odd_length"
    rows = out["per_prompt"]
    # every stored sample re-scores to its stored reward; counts and pass@k follow from them
    for row in rows:
        assert len(row["samples"]) == 4
        rescored = _odd_length(row["samples"])
        assert row["sample_rewards"]["_odd_length"] == rescored
        assert row["correct"] == sum(r >= 1.0 for r in rescored) and row["scored"] == 4
    for k in (1, 2, 4):
        expected = sum(pass_at_k(4, r["correct"], k) for r in rows) / 5
        assert out["pass_at_k"][str(k)] == pytest.approx(expected)
    assert out["pass_at_k"]["1"] == pytest.approx(out["sampled_accuracy"])  # binary reward: pass@1 = mean
    assert out["pass_at_k"]["1"] <= out["pass_at_k"]["2"] <= out["pass_at_k"]["4"]
    # greedy part = heldout_accuracy
    assert out["greedy_accuracy"] == pytest.approx(
        heldout_accuracy(model, tokenizer, ds, reward_fn=_odd_length, max_new_tokens=6)
    )
    # same seed, same samples; the global RNG is left alone
    import torch

    state = torch.random.get_rng_state()
    again = evaluate_model(model, tokenizer, ds, [_odd_length], n=4, ks=[1], sampling={"temperature": 1.0},
                           max_new_tokens=6, batch_size=3, seed=7, greedy=False)  # fmt: skip
    assert [r["samples"] for r in again["per_prompt"]] == [r["samples"] for r in rows]
    assert torch.equal(state, torch.random.get_rng_state()) and "greedy_accuracy" not in again


def test_evaluate_model_rejects_k_above_n(tiny):
    from trl_credit.app.data import make_arithmetic

    with pytest.raises(ValueError, match="k must be in 1..n"):
        evaluate_model(*tiny, make_arithmetic(2), [_odd_length], n=2, ks=[4])


# ------------------------------------------------------------------------------- train -> eval, end to end
@pytest.fixture(scope="module")
def trained_run(tiny_model, tmp_path_factory):
    """A tiny LoRA run trained for one step through `trl-credit train` (the CLI's code path)."""
    root = tmp_path_factory.mktemp("eval_run")
    (root / "evalrewards.py").write_text(REWARDS_MODULE)
    out = root / "run"
    config = root / "tiny.yaml"
    config.write_text(textwrap.dedent(f"""\
        model_name_or_path: {tiny_model}
        dtype: float32
        bf16: false
        use_peft: true
        lora_r: 4
        lora_alpha: 8
        lora_target_modules: all-linear
        dataset_name: "arithmetic:n=32,eval_n=8"
        reward_funcs: [evalrewards.odd_length, arithmetic_accuracy]
        output_dir: {out}
        max_steps: 3
        learning_rate: 1.0e-2
        beta: 0.0
        per_device_train_batch_size: 8
        num_generations: 4
        max_completion_length: 8
        temperature: 1.0
        logging_steps: 1
        save_strategy: "no"
        report_to: none
        use_cpu: true
        seed: 0
        heldout_samples: 6
        heldout_max_new_tokens: 8
    """))
    import sys

    sys.path.insert(0, str(root))  # the reward module, as `trl grpo` imports modules next to the config
    try:
        assert cli.main(["train", str(config), "--max_steps", "1"]) == 0
    finally:
        sys.path.remove(str(root))
    return root, out


def test_train_saves_the_resolved_config(trained_run):
    _, out = trained_run
    saved = yaml.safe_load((out / "trl_credit_config.yaml").read_text())
    assert saved["max_steps"] == 1  # the command-line override, not the YAML's 3
    assert saved["reward_funcs"] == ["evalrewards.odd_length", "arithmetic_accuracy"]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["resolved_config"].endswith("trl_credit_config.yaml")


def test_eval_of_a_trained_run(trained_run, capsys, monkeypatch):
    root, out = trained_run
    monkeypatch.syspath_prepend(str(root))
    path = root / "eval.json"
    code = cli.main(["eval", str(out), "--k", "1,2", "--n", "4", "--samples", "6", "--json", str(path)])
    printed = capsys.readouterr().out
    assert code == 0
    assert "| greedy accuracy |" in printed and "| pass@2 (n=4, temperature 1.0) |" in printed
    result = json.loads(path.read_text())
    for key in ("source", "config", "output_dir", "split", "model", "adapter", "evaluated", "num_prompts", "n", "k",
                "verifier", "reward_names", "greedy_accuracy", "greedy_rewards", "pass_at_k", "sampled_accuracy",
                "sampled_rewards", "per_prompt", "seconds", "max_new_tokens", "sampling", "seed"):  # fmt: skip
        assert key in result, key
    assert result["evaluated"] == "adapter" and result["adapter"] == str(out) and result["split"] == "test"
    assert result["num_prompts"] == 6 and result["n"] == 4 and result["k"] == [1, 2]
    assert result["verifier"] == "odd_length" and result["reward_names"] == ["odd_length", "arithmetic_accuracy"]
    assert result["max_new_tokens"] == 8 and result["sampling"]["temperature"] == 1.0 and result["seed"] == 0

    # direct computation: the adapter on the base model, the held-out split of the same config, the same reward
    from evalrewards import odd_length
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_credit.app.data import load_train_eval
    from trl_credit.app.rewards import arithmetic_accuracy

    _, heldout = load_train_eval("arithmetic:n=32,eval_n=8", seed=0)
    heldout = heldout.select(range(6))
    assert [r["prompt"] for r in result["per_prompt"]] == [p[-1]["content"] for p in heldout["prompt"]]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(json.loads(
        (out / "adapter_config.json").read_text())["base_model_name_or_path"]), str(out)).eval()  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    direct = heldout_accuracy(model, tokenizer, heldout, reward_fn=odd_length, max_new_tokens=8)
    assert result["greedy_accuracy"] == pytest.approx(direct)
    assert result["greedy_rewards"]["arithmetic_accuracy"] == pytest.approx(
        heldout_accuracy(model, tokenizer, heldout, reward_fn=arithmetic_accuracy, max_new_tokens=8))
    # train's own held-out figure (same 6 prompts, same length) is the same number
    metrics = json.loads((out / "metrics.json").read_text())
    assert result["greedy_accuracy"] == pytest.approx(metrics["heldout_accuracy_after"])
    # pass@k from the stored samples
    counts = [sum(r >= 1.0 for r in odd_length(row["samples"])) for row in result["per_prompt"]]
    assert [row["correct"] for row in result["per_prompt"]] == counts
    for k in (1, 2):
        assert result["pass_at_k"][str(k)] == pytest.approx(sum(pass_at_k(4, c, k) for c in counts) / 6)
    assert not math.isnan(result["sampled_rewards"]["arithmetic_accuracy"])


def test_eval_base_model_of_a_run_and_of_a_config(trained_run, capsys, monkeypatch):
    root, out = trained_run
    monkeypatch.syspath_prepend(str(root))
    assert cli.main(["eval", str(out), "--base", "--n", "0", "--samples", "3"]) == 0
    base = json.loads((out / "eval_test_base.json").read_text())
    assert base["evaluated"] == "base" and base["adapter"] is None and base["n"] == 0 and "pass_at_k" not in base
    assert "pass@" not in capsys.readouterr().out
    # a config file evaluates its base model, here on the training split
    path = root / "cfg.json"
    assert cli.main(["eval", str(out / "trl_credit_config.yaml"), "--split", "train", "--n", "2", "--samples", "2",
                     "--json", str(path)]) == 0  # fmt: skip
    from_config = json.loads(path.read_text())
    assert from_config["evaluated"] == "base" and from_config["split"] == "train" and from_config["output_dir"] is None
    assert from_config["num_prompts"] == 2 and set(from_config["pass_at_k"]) == {"1"}


def test_eval_errors(tmp_path, capsys):
    assert cli.main(["eval", str(tmp_path)]) == 2
    assert "no trl_credit_config.yaml" in capsys.readouterr().err
    assert cli.main(["eval", str(tmp_path), "--k", "0"]) == 2
    assert "--k values must be >= 1" in capsys.readouterr().err


def test_eval_of_a_qlora_run_loads_the_4bit_base(tiny_model, tmp_path):
    """QLoRA: eval quantizes the base as training did, so greedy accuracy equals train's held-out figure."""
    out = tmp_path / "qlora"
    config = tmp_path / "qlora.yaml"
    config.write_text(textwrap.dedent(f"""\
        model_name_or_path: {tiny_model}
        dtype: float32
        bf16: false
        load_in_4bit: true
        bnb_4bit_quant_type: nf4
        use_peft: true
        lora_target_modules: all-linear
        dataset_name: "arithmetic:n=16,eval_n=4"
        reward_funcs: [arithmetic_accuracy]
        output_dir: {out}
        max_steps: 1
        per_device_train_batch_size: 4
        num_generations: 2
        max_completion_length: 4
        learning_rate: 1.0e-2
        report_to: none
        save_strategy: "no"
        use_cpu: true
        heldout_samples: 4
        heldout_max_new_tokens: 6
    """))
    assert cli.main(["train", str(config)]) == 0
    assert cli.main(["eval", str(out), "--n", "2", "--k", "2"]) == 0
    result = json.loads((out / "eval_test.json").read_text())
    assert result["load_in_4bit"] is True and result["evaluated"] == "adapter" and result["max_new_tokens"] == 6
    metrics = json.loads((out / "metrics.json").read_text())
    assert result["greedy_accuracy"] == pytest.approx(metrics["heldout_accuracy_after"])
    assert 0.0 <= result["pass_at_k"]["2"] <= 1.0
