"""GRPO-CARE: methods.md 2.24's vector, the answer span (stand-in and real tokenizer), the options, edge cases,
the checks, the contract, and a real training run whose EMA adapter follows the policy."""

from __future__ import annotations

import math
import zlib

import pytest
import torch
from peft import LoraConfig

from trl_credit import ConfigError
from trl_credit.testing import check_args, check_plugin, make_batch, run_plugin, tiny_tokenizer, train_tiny
from trl_credit_grpo_care import GRPOCARE, accurate_set, answer_spans, answer_token_mask, care_bonus

ANSWERED = ["<think>a</think><answer>4</answer>", "<think>b</think><answer>4</answer>",
            "<think>c</think><answer>5</answer>", "<think>d</think><answer>6</answer>"]


def batch_of(acc, p, texts=ANSWERED, extra=None, num_generations=None):
    """One character per token (the stand-in tokenizer spreads a text evenly over as many tokens as characters);
    the EMA log-prob of every token of row i is log p_i, so the answer-span mean is log p_i whatever the span."""
    width = max(len(t) for t in texts)
    ema = torch.tensor([[math.log(v)] * width for v in p])
    rewards = [[a, *(extra or [])] for a in acc] if extra is not None else acc
    names = ["accuracy", *(["format"] * bool(extra))]
    return make_batch(rewards, num_generations or len(acc), completions=texts, lengths=[len(t) for t in texts],
                      adapters={"ema": ema}, reward_names=names)


def test_methods_vector():
    # p clamped to [0.95, 0.80, 0.60, 0.90]; accurate = acc > 0.1 and >= mean 0.75: c0, c1, c2;
    # mu = (0.95 + 0.80 + 0.60) / 3 = 0.783333, threshold 0.773333: c0 and c1 -> bonus 0.5 * 1
    result = run_plugin(GRPOCARE, batch_of([1, 1, 1, 0], [0.99, 0.80, 0.60, 0.90], extra=[0.5]))
    assert result.reward_names == ["accuracy", "format", "care_bonus"]
    torch.testing.assert_close(result.rewards[:, 2], torch.tensor([0.5, 0.5, 0.0, 0.0]))
    assert result.batch.reward_weights[2].item() == 1.0
    # R = acc + format + bonus = [2.0, 2.0, 1.5, 0.5]: GRPO's group-normalised advantages
    total = torch.tensor([2.0, 2.0, 1.5, 0.5])
    torch.testing.assert_close(result.advantages, (total - total.mean()) / (total.std() + 1e-4))
    assert result.metrics["grpo_care/bonus_rate"] == 0.5
    assert result.metrics["grpo_care/confidence"] == pytest.approx((0.95 + 0.8 + 0.6 + 0.9) / 4)


def test_care_bonus_function_margin_and_no_clamp():
    acc, has = torch.tensor([1.0, 1, 1, 0]), torch.ones(4, dtype=torch.bool)
    p = torch.tensor([0.99, 0.80, 0.60, 0.90])
    # no clamp: mu = (0.99 + 0.8 + 0.6) / 3 = 0.796667; margin 0.01 -> 0.786667: c0, c1
    torch.testing.assert_close(care_bonus(acc, p, has, 4), torch.tensor([0.5, 0.5, 0.0, 0.0]))
    # margin 0 with the clamp: p 0.8 >= mu 0.783333 still; coefficient 1
    clamped = p.clamp(max=0.95)
    torch.testing.assert_close(care_bonus(acc, clamped, has, 4, 1.0, 0.0), torch.tensor([1.0, 1.0, 0.0, 0.0]))
    # margin 0.2: threshold 0.583333: c2 (0.60) joins
    torch.testing.assert_close(care_bonus(acc, clamped, has, 4, 0.5, 0.2), torch.tensor([0.5, 0.5, 0.5, 0.0]))
    # through the plugin: confidence_upper_bound null, margin 0 -> mu 0.796667, c1 (0.80) >= it
    result = run_plugin(GRPOCARE, batch_of([1, 1, 1, 0], [0.99, 0.80, 0.60, 0.90]),
                        {"confidence_upper_bound": None, "margin": 0.0, "bonus_coefficient": 2.0})
    torch.testing.assert_close(result.rewards[:, 1], torch.tensor([2.0, 2.0, 0.0, 0.0]))


def test_accurate_set_is_relative_and_graded_accuracy_scales_the_bonus():
    # acc [0.6, 0.9, 0.05, 0.9]: mean 0.6125 -> accurate c1, c3 (c0 is below the mean, c2 below 0.1)
    acc = torch.tensor([0.6, 0.9, 0.05, 0.9])
    assert accurate_set(acc, 4).tolist() == [False, True, False, True]
    # p c1 0.5, c3 0.7: mu 0.6, threshold 0.59: only c3 -> 0.5 * 0.9
    result = run_plugin(GRPOCARE, batch_of(acc.tolist(), [0.9, 0.5, 0.9, 0.7]))
    torch.testing.assert_close(result.rewards[:, 1], torch.tensor([0.0, 0.0, 0.0, 0.45]))
    # all accuracies 0.1: none is > 0.1 -> no bonus at all, and the EMA is never scored (no adapter scores given)
    quiet = run_plugin(GRPOCARE, make_batch([0.1] * 4, 4, completions=ANSWERED, reward_names=["accuracy"]))
    assert torch.equal(quiet.rewards[:, 1], torch.zeros(4)) and "grpo_care/confidence" not in quiet.metrics


def test_groups_are_separate_and_nan_accuracy_is_never_accurate():
    # group 1 = the methods vector; group 2: acc [NaN, 1, 0, 0]: mean over the finite 1/3, accurate c5 only,
    # mu = its own p (0.3): confident -> bonus 0.5; the NaN row gets 0 (no NaN introduced)
    texts = ANSWERED * 2
    result = run_plugin(GRPOCARE, batch_of([1, 1, 1, 0, None, 1, 0, 0], [0.99, 0.8, 0.6, 0.9, 0.9, 0.3, 0.9, 0.9],
                                           texts=texts, num_generations=4))
    torch.testing.assert_close(result.rewards[:, 1], torch.tensor([0.5, 0.5, 0, 0, 0, 0.5, 0, 0]))


def test_empty_span_is_not_confident_and_left_out_of_the_mean():
    # c0 has no answer span (no <answer>, no number, fallback none): never confident, not in mu;
    # mu over c1, c2 = (0.8 + 0.6) / 2 = 0.7, threshold 0.69: c1 -> 0.5
    texts = ["<think>a</think> no answer", *ANSWERED[1:]]
    result = run_plugin(GRPOCARE, batch_of([1, 1, 1, 0], [0.99, 0.80, 0.60, 0.90], texts=texts), {"fallback": "none"})
    torch.testing.assert_close(result.rewards[:, 1], torch.tensor([0.0, 0.5, 0.0, 0.0]))
    assert result.metrics["grpo_care/span_rate"] == 0.75
    # an empty <answer></answer> is an empty span too (the fallback applies only when the pattern does not match)
    texts = ["<answer></answer> 7", *ANSWERED[1:]]
    result = run_plugin(GRPOCARE, batch_of([1, 1, 1, 0], [0.99, 0.80, 0.60, 0.90], texts=texts))
    torch.testing.assert_close(result.rewards[:, 1], torch.tensor([0.0, 0.5, 0.0, 0.0]))
    # the only accurate completions have no span: no mu, no bonus
    texts = ["none", "none", *ANSWERED[2:]]
    result = run_plugin(GRPOCARE, batch_of([1, 1, 0, 0], [0.9, 0.9, 0.9, 0.9], texts=texts), {"fallback": "none"})
    assert torch.equal(result.rewards[:, 1], torch.zeros(4))


def test_answer_spans_and_fallbacks():
    texts = ["<answer>1</answer> then <answer> 42 </answer> tail", "<answer>open ended", "x = -3.5, so 1,200 left.",
             "line one\nlast line\n\n", "nothing"]
    spans = answer_spans(texts)
    assert [t[a:b] for t, (a, b) in zip(texts[:3], spans[:3])] == [" 42 ", "open ended", "1,200"]
    assert spans[3] is None and spans[4] is None  # last_number: no number
    lines = answer_spans(texts, fallback="last_line")
    assert texts[3][slice(*lines[3])] == "last line" and texts[4][slice(*lines[4])] == "nothing"
    assert answer_spans(texts, fallback="none")[2] is None
    # a custom pattern: the \boxed{...} content (group 1)
    assert answer_spans(["so \\boxed{7} and \\boxed{9}."], r"\\boxed\{([^}]*)\}") == [(24, 25)]


def test_answer_token_mask_with_one_character_tokens():
    texts = ["ab<answer> 12 </answer>", "x -4 y"]
    batch = make_batch([1, 0], 2, completions=texts, lengths=[len(t) for t in texts])
    mask = answer_token_mask(batch, answer_spans(texts))
    # row 0: characters 11, 12 ("12"; the spaces are whitespace-only tokens); row 1: "-4"
    assert torch.nonzero(mask[0]).flatten().tolist() == [11, 12]
    assert torch.nonzero(mask[1]).flatten().tolist() == [2, 3]
    # the span mean reads only those tokens: row 0's EMA log-probs -1 on "12", -9 elsewhere
    ema = torch.full((2, len(texts[0])), -9.0)
    ema[0, 11:13] = -1.0
    ema[1, 2:4] = -2.0
    batch = make_batch([[1, 0], [1, 0]], 2, completions=texts, lengths=[len(t) for t in texts], adapters={"ema": ema},
                       reward_names=["accuracy", "other"])
    result = run_plugin(GRPOCARE, batch)
    assert result.metrics["grpo_care/confidence"] == pytest.approx((math.exp(-1) + math.exp(-2)) / 2)


def test_answer_token_mask_with_a_real_tokenizer():


    tok = tiny_tokenizer()  # the tiny model's (SmolLM2) tokenizer
    texts = ["<think>7+5</think>\n<answer> 12 </answer>", "The sum is 1,234.5.\n",
             "<answer>-4</answer>\n<answer>x=19</answer>", "hello"]
    ids = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    batch = make_batch([1, 1, 1, 0], 4, completions=texts, completion_ids=ids, tokenizer=tok)
    mask = answer_token_mask(batch, answer_spans(texts))
    decoded = [tok.decode(batch.completion_ids[i][mask[i]].tolist()) for i in range(4)]
    assert decoded == ["12", "1,234.5", "x=19", ""]  # EOS and the tags' tokens are never in the span


def test_checks():
    check_args(GRPOCARE)  # defaults on a PEFT run with an accuracy reward
    with pytest.raises(ConfigError, match=r"use_peft|PEFT|peft"):
        check_args(GRPOCARE, peft=False)  # the host: an adapter needs a LoRA policy
    with pytest.raises(ConfigError, match=r"multi_objective_aggregation: 'normalize_then_sum' normalises the "
                                          r"care_bonus column.*fix: use `multi_objective_aggregation"):
        check_args(GRPOCARE, multi_objective_aggregation="normalize_then_sum")
    with pytest.raises(ConfigError, match=r"reward: no reward column to read the accuracy from"):
        check_args(GRPOCARE, reward_names=())
    with pytest.raises(ConfigError, match="correctness"):
        check_args(GRPOCARE, {"reward": "correctness"})  # the host: a missing reward column
    with pytest.raises(ConfigError, match="answer_pattern"):
        check_args(GRPOCARE, {"answer_pattern": "(<answer>"})
    with pytest.raises(ConfigError, match="ema_decay"):
        check_args(GRPOCARE, {"ema_decay": 1.0})


def test_declares_the_ema_adapter():
    plugin = GRPOCARE(GRPOCARE.Config(ema_decay=0.99, ema_every=3))
    adapter, = plugin.adapters()
    assert (adapter.name, adapter.ema_decay, adapter.ema_every, adapter.trained) == ("ema", 0.99, 3, False)
    assert GRPOCARE().adapters()[0].ema_decay == 0.995 and GRPOCARE().adapters()[0].ema_every == 10


def test_contract():
    check_plugin(GRPOCARE)
    check_plugin(GRPOCARE, {"fallback": "last_line", "margin": 0.0, "confidence_upper_bound": None})


def parity_reward(completions, **kwargs):
    return [float(zlib.crc32(c[-1]["content"].encode()) % 2) for c in completions]


def test_trains_with_an_ema_reference_that_follows_the_policy(tmp_path):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    trainer = train_tiny([{"name": "grpo_care", "fallback": "last_line", "ema_every": 1}], output_dir=tmp_path,
                         reward_funcs=[parity_reward], peft_config=lora, learning_rate=1e-2)
    model = trainer.accelerator.unwrap_model(trainer.model)
    ema = [p for n, p in model.named_parameters() if "lora_B.tc_grpo_care_ema." in n]
    policy = [p for n, p in model.named_parameters() if "lora_B.default." in n]
    assert ema and any(p.abs().sum() > 0 for p in ema)  # moved from B = 0 towards the policy
    assert not any(torch.equal(a, b) for a, b in zip(ema, policy))  # an average, not a copy
    logs = [entry for entry in trainer.state.log_history if "trl_credit/grpo_care/bonus_rate" in entry]
    assert logs and all(math.isfinite(entry["trl_credit/grpo_care/bonus_rate"]) for entry in logs)
    assert any("trl_credit/cost/grpo_care/ema_score_seconds" in entry for entry in logs)
    assert any(math.isfinite(entry.get("trl_credit/grpo_care/confidence", math.nan)) for entry in logs)
