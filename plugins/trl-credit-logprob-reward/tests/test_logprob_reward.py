"""logprob_reward: methods.md 2.25's vector (sum and mean), the CoT/answer split and the scored texts, replace and
weight, missing answers, empty completions, long answers, the checks, the contract and a real training run."""

from __future__ import annotations

import math

import pytest
import torch

from trl_credit import ConfigError
from trl_credit.testing import check_args, check_plugin, make_batch, run_plugin, tiny_tokenizer, train_tiny
from trl_credit_logprob_reward import LogprobReward, fill_missing, split_reasoning

LOG_HALF, LOG_QUARTER = math.log(0.5), math.log(0.25)


def scorer(values=(LOG_HALF, LOG_QUARTER), calls=None):
    """A continuation_fn giving every continuation the token log-probs ``values`` and recording each call."""
    def fn(prefix, continuation, model):
        if calls is not None:
            calls.append((prefix, continuation, model))
        return list(values)
    return fn


def run(config=None, rewards=(1.0, 0.0, 0.0, 1.0), completions=None, answers=None, fn=None, **kw):
    n = len(rewards)
    completions = completions or [f"{i} + 1 = {i + 1}\nThe answer is {i + 1}." for i in range(n)]
    batch = make_batch(list(rewards), kw.pop("num_generations", 4), completions=completions,
                       columns={"answer": list(answers or ["7"] * n)}, continuation_fn=fn or scorer(),
                       reward_names=["accuracy"], **kw)
    return run_plugin(LogprobReward, batch, config)


def test_vector_sum_and_mean():
    # y* token probs [0.5, 0.25]: sum = ln 0.5 + ln 0.25 = ln 0.125 = -2.079442; mean = -2.079442 / 2 = -1.039721
    result = run()
    assert result.reward_names == ["accuracy", "logprob_reward"]
    torch.testing.assert_close(result.rewards[:, 1], torch.full((4,), -2.079442), atol=1e-6, rtol=0)
    assert result.batch.reward_weights.tolist() == [1.0, 1.0]
    mean = run({"reduce": "mean"})
    torch.testing.assert_close(mean.rewards[:, 1], torch.full((4,), -1.039721), atol=1e-6, rtol=0)
    assert result.metrics["logprob_reward/mean"] == pytest.approx(-2.079442, abs=1e-6)
    assert result.metrics["logprob_reward/marker_found"] == 1.0 and result.metrics["logprob_reward/missing"] == 0.0


def test_split_at_the_last_marker_keeps_the_marker():
    assert split_reasoning("1 + 2 = 3\n3 + 4 = 7\nThe answer is 7.", r"(?i)answer is:?|=") == \
        ("1 + 2 = 3\n3 + 4 = 7\nThe answer is", True)
    assert split_reasoning("so x = 5  ", r"(?i)answer is:?|=") == ("so x =", True)
    assert split_reasoning("THE ANSWER IS: 12", r"(?i)answer is:?|=") == ("THE ANSWER IS:", True)
    assert split_reasoning("thinking, cut off by the length limit\n", r"=") == ("thinking, cut off by the length limit",
                                                                             False)
    assert split_reasoning("7", r"=", fallback="empty") == ("", False)
    assert split_reasoning("so \\boxed{7}", r"\\boxed\{") == ("so \\boxed{", True)


def test_the_scored_texts_string_prompts_and_model():
    calls = []
    completions = ["3 + 4 = 7\nThe answer is 7.", "I think 8", "", "x = 9 so"]
    result = run({"model": "reference"}, completions=completions, prompts=["Q: 3 + 4?\n"] * 4, fn=scorer(calls=calls))
    assert sorted(calls) == sorted([("Q: 3 + 4?\n3 + 4 = 7\nThe answer is", " 7", "reference"),
                                    ("Q: 3 + 4?\nI think 8", " 7", "reference"),     # no marker: the whole completion
                                    ("Q: 3 + 4?\n", " 7", "reference"),              # empty completion: the prompt
                                    ("Q: 3 + 4?\nx =", " 7", "reference")])
    assert result.metrics["logprob_reward/marker_found"] == 0.5
    assert torch.isfinite(result.rewards).all()


def test_chat_prompts_are_rendered_with_the_generation_prompt():


    tok = tiny_tokenizer()
    calls = []
    prompt = [{"role": "user", "content": "What is 3 + 4?"}]
    completions = ["The answer is 7", [{"role": "assistant", "content": "= 8"}]]  # a string and a message list
    batch = make_batch([1.0, 0.0], 2, prompts=[prompt, prompt], completions=completions,
                       columns={"answer": ["7", "7"]}, tokenizer=tok, continuation_fn=scorer(calls=calls))
    run_plugin(LogprobReward, batch, {"template": "{answer}", "marker": "answer is |="})
    rendered = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    assert rendered.endswith("<|im_start|>assistant\n")
    assert sorted(calls) == sorted([(rendered + "The answer is", "7", "policy"), (rendered + "=", "7", "policy")])


def test_replace_and_weight():
    result = run({"replace": "accuracy"})
    assert result.reward_names == ["accuracy"]
    torch.testing.assert_close(result.rewards[:, 0], torch.full((4,), -2.079442), atol=1e-6, rtol=0)
    weighted = make_batch([1.0, 0.0], 2, completions=["= 1", "= 2"], columns={"answer": ["1", "1"]},
                          continuation_fn=scorer(), reward_names=["accuracy"], reward_weights=[2.0])
    kept = run_plugin(LogprobReward, weighted, {"replace": "accuracy"})
    assert kept.batch.reward_weights.tolist() == [2.0]  # replace keeps the column's weight
    mixed = run({"weight": 0.1})
    assert mixed.batch.reward_weights.tolist() == pytest.approx([1.0, 0.1])
    # the total reward: accuracy + 0.1 * (-2.079442)
    torch.testing.assert_close(mixed.batch.total_reward(), torch.tensor([1.0, 0.0, 0.0, 1.0]) - 0.2079442,
                               atol=1e-6, rtol=0)


def test_missing_answers_get_the_group_mean_and_are_not_scored():
    values = iter([[-1.0], [-3.0]])  # the two rows with an answer, in row order
    calls = []

    def fn(prefix, continuation, model):
        calls.append(continuation)
        return next(values)

    completions = [f"{i} = {i}" for i in range(8)]  # distinct prefixes (the cut keeps "i ="): one call each
    result = run(rewards=[1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0], completions=completions,
                 answers=["7", None, "7", float("nan"), "", None, "  ", None], fn=fn)
    # group 1: rows 0 and 2 scored (-1, -3), rows 1 (None) and 3 (NaN) get their mean (-1 - 3) / 2 = -2;
    # group 2: "", None, blank, None: no row has an answer -> 0 for all (a constant column: no signal)
    assert calls == [" 7", " 7"]
    torch.testing.assert_close(result.rewards[:, 1], torch.tensor([-1.0, -2.0, -3.0, -2.0, 0.0, 0.0, 0.0, 0.0]))
    assert result.metrics["logprob_reward/missing"] == pytest.approx(6 / 8)
    present = torch.tensor([True, False, False, True])
    torch.testing.assert_close(fill_missing(torch.tensor([-1.0, 5.0, float("nan"), -3.0]), present, 2),
                               torch.tensor([-1.0, -1.0, -3.0, -3.0]))


def test_long_answers_mean_is_length_invariant_sum_is_not():
    # every token at log-prob -0.5; the answer "1 2 ... 200" takes 200 tokens in this stand-in scorer, "7" one
    def fn(prefix, continuation, model):
        return [-0.5] * len(continuation.split())

    long = " ".join(str(i) for i in range(1, 201))
    total = run(rewards=[1.0, 0.0, 1.0, 0.0], answers=["7", "7", long, long], fn=fn, num_generations=2)
    torch.testing.assert_close(total.rewards[:, 1], torch.tensor([-0.5, -0.5, -100.0, -100.0]))  # 200 * -0.5
    mean = run({"reduce": "mean"}, rewards=[1.0, 0.0, 1.0, 0.0], answers=["7", "7", long, long], fn=fn,
               num_generations=2)
    torch.testing.assert_close(mean.rewards[:, 1], torch.full((4,), -0.5))


def test_checks():
    check_args(LogprobReward, {"model": "reference"}, peft=True)
    check_args(LogprobReward, {"model": "reference"}, peft=False, beta=0.04)
    check_args(LogprobReward, {}, peft=False)  # the policy needs no reference
    with pytest.raises(ConfigError, match=r"\(logprob_reward\) reads the reference model with these options, but this run has none \(no PEFT adapter, beta 0\): train a PEFT adapter"):
        check_args(LogprobReward, {"model": "reference"}, peft=False)
    with pytest.raises(ConfigError, match=r"reward_name: 'accuracy' is already a reward column.*replace: accuracy"):
        check_args(LogprobReward, {"reward_name": "accuracy"})
    check_args(LogprobReward, {"replace": "accuracy"})
    with pytest.raises(ConfigError, match="judge"):
        check_args(LogprobReward, {"replace": "judge"})
    with pytest.raises(ConfigError, match="gold"):
        check_args(LogprobReward, {"column": "gold"}, columns=("prompt", "answer"))
    with pytest.raises(ConfigError, match="no {answer} placeholder"):
        check_args(LogprobReward, {"template": " the answer"})
    with pytest.raises(ConfigError, match="not a valid regex"):
        check_args(LogprobReward, {"marker": "answer is ("})


def edge_batches():
    def make(rewards, g, lengths, answers):
        return make_batch(rewards, g, lengths=lengths, completions=["= 1" if n else "" for n in lengths],
                          columns={"answer": answers}, reward_names=["accuracy"],
                          continuation_fn=lambda p, c, m: [-0.1 * len(p), -0.2])

    return [
        lambda: make([1, 0, 1, 0, 1, 1, 0, 0], 4, [6, 3, 5, 1, 2, 6, 4, 3], ["1"] * 8),       # mixed
        lambda: make([1, 1, 1, 1, 0, 0, 0, 0], 4, [6] * 8, ["1"] * 4 + [None] * 4),            # constant, missing
        lambda: make([1, None, 0, 1, None, None, None, None], 4, [3] * 8, ["1"] * 8),          # NaN rewards
        lambda: make([1, 0, 1], 1, [2, 6, 4], ["1", None, "2"]),                               # G = 1
        lambda: make([0.5, 0.25, 0.75, 0.0], 2, [6, 0, 6, 1], ["1"] * 4),                      # empty completion
    ]


def test_contract():
    check_plugin(LogprobReward, batches=edge_batches())
    check_plugin(LogprobReward, {"reduce": "mean", "replace": "accuracy", "fallback": "empty"}, batches=edge_batches())


def test_trains_on_the_tiny_model(tmp_path):
    trainer = train_tiny([{"name": "logprob_reward", "reduce": "mean"}], output_dir=tmp_path, max_steps=2)
    logs = trainer.state.log_history[0]
    assert math.isfinite(logs["trl_credit/logprob_reward/mean"]) and logs["trl_credit/logprob_reward/mean"] < 0
    assert logs["trl_credit/logprob_reward/missing"] == 0.0
