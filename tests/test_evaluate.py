"""Tests for trl_credit.app.heldout."""

from __future__ import annotations

import json

import pytest

from trl_credit.app.data import make_arithmetic
from trl_credit.app.heldout import generate_answers, heldout_accuracy, plot_reward_curve, write_metrics
from trl_credit.app.rewards import arithmetic_accuracy

try:
    from conftest_helpers_models import tiny_model_and_tokenizer, tiny_model_dir  # noqa: F401 (fixtures)
except ImportError:  # tests/ became a package
    from tests.conftest_helpers_models import tiny_model_and_tokenizer, tiny_model_dir  # noqa: F401

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_generate_answers_on_tiny_model(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    ds = make_arithmetic(n=5, seed=0)
    model.train()
    side = tokenizer.padding_side
    out = generate_answers(model, tokenizer, ds["prompt"], max_new_tokens=4, batch_size=2)
    assert len(out) == 5 and all(isinstance(t, str) for t in out)
    assert model.training and tokenizer.padding_side == side  # state restored
    again = generate_answers(model, tokenizer, list(ds["prompt"])[:3], max_new_tokens=4, batch_size=3)
    assert len(again) == 3
    plain = generate_answers(model, tokenizer, ["1 + 1 =", "2 + 2 ="], max_new_tokens=3)
    assert len(plain) == 2


def test_heldout_accuracy_on_tiny_model(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    ds = make_arithmetic(n=12, seed=0)
    acc = heldout_accuracy(model, tokenizer, ds, max_new_tokens=4, batch_size=8, limit=6)
    assert isinstance(acc, float) and 0.0 <= acc <= 1.0


def test_heldout_accuracy_calls_reward_like_trl(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    ds = make_arithmetic(n=8, seed=0)
    seen: dict = {}

    def reward(completions, prompts, completion_ids, answer, difficulty, question, **kwargs):
        seen.update(completions=completions, prompts=prompts, ids=completion_ids, answer=answer, kwargs=kwargs)
        return [1.0, None, 0.0, 1.0]  # None: skipped, as TRL does

    acc = heldout_accuracy(model, tokenizer, ds, reward_fn=reward, max_new_tokens=3, limit=4)
    assert acc == pytest.approx(2 / 3)
    assert len(seen["completions"]) == 4 and seen["completions"][0][0]["role"] == "assistant"
    assert seen["answer"] == list(ds["answer"])[:4] and "solution" in seen["kwargs"]
    assert all(1 <= len(ids) <= 3 for ids in seen["ids"])


class _EchoModel:
    """Stands in for a causal LM: records its inputs and answers '42' then end-of-sequence."""

    def __init__(self, tokenizer):
        import torch

        self.tokenizer, self.training, self.calls = tokenizer, False, []
        self._param = torch.nn.Parameter(torch.zeros(1))
        self.generation_config = None

    def parameters(self):
        return iter([self._param])

    def eval(self):
        self.training = False

    def train(self, mode=True):
        self.training = mode

    def generate(self, input_ids, attention_mask, generation_config):
        import torch

        self.calls.append((input_ids.clone(), attention_mask.clone(), generation_config))
        answer = self.tokenizer("42", add_special_tokens=False)["input_ids"]
        tail = answer + [self.tokenizer.eos_token_id] + [generation_config.pad_token_id] * 2
        tail = torch.tensor([tail] * input_ids.shape[0])
        return torch.cat([input_ids, tail], dim=1)


def test_generate_answers_chat_template_left_padding_and_greedy(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = _EchoModel(tokenizer)
    prompts = [[{"role": "user", "content": "What is 1 + 1?"}],
               [{"role": "user", "content": "What is 12 + 7? Answer with just the number, please."}],
               [{"role": "user", "content": "Hi"}]]  # fmt: skip
    out = generate_answers(model, tokenizer, prompts, max_new_tokens=5, batch_size=2)
    assert out == ["42", "42", "42"]
    assert len(model.calls) == 2  # batches of 2 and 1
    ids, mask, gen = model.calls[0]
    assert gen.do_sample is False and gen.max_new_tokens == 5
    assert mask[0, 0] == 0 and mask[0, -1] == 1 and mask[1].all()  # shorter prompt padded on the left
    text = tokenizer.decode(ids[1][mask[1].bool()])
    assert text.endswith("<|im_start|>assistant\n") and "What is 12 + 7?" in text
    # accuracy path: answers 42 everywhere
    ds = make_arithmetic(n=3, seed=0)
    assert heldout_accuracy(model, tokenizer, ds) == sum(a == "42" for a in ds["answer"]) / 3
    assert arithmetic_accuracy(["42"], ["42"]) == [1.0]


def _log_history():
    history = []
    for step in range(1, 11):
        history.append({"step": step, "reward": step / 10, "rewards/arithmetic_accuracy/mean": step / 12, "loss": 0.1})
    history.append({"step": 10, "train_runtime": 12.0})  # final summary: no reward
    return history


def test_plot_reward_curve_writes_png(tmp_path):
    from matplotlib.image import imread

    path = tmp_path / "plots" / "reward.png"
    plot_reward_curve(_log_history(), path)
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000
    image = imread(str(path))
    assert image.shape[0] > 100 and image.shape[1] > 100


def test_plot_reward_curve_plots_the_series(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    captured = {}
    real_close = plt.close

    def close(fig):
        captured.update({line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
                         for line in fig.axes[0].get_lines()})  # fmt: skip
        real_close(fig)

    monkeypatch.setattr(plt, "close", close)
    plot_reward_curve(_log_history(), tmp_path / "r.png")
    assert set(captured) == {"reward", "rewards/arithmetic_accuracy/mean"}
    assert captured["reward"][0] == [float(s) for s in range(1, 11)]
    assert captured["reward"][1] == pytest.approx([s / 10 for s in range(1, 11)])


def test_plot_reward_curve_without_rewards_still_writes(tmp_path):
    path = tmp_path / "empty.png"
    plot_reward_curve([{"step": 1, "loss": 0.3}], path)
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_write_metrics_roundtrip(tmp_path):
    import numpy as np

    path = tmp_path / "out" / "metrics.json"
    write_metrics(path, {"accuracy": 0.83, "steps": 30, "np": np.float32(0.5), "arr": np.arange(2)})
    text = path.read_text()
    assert json.loads(text) == {"accuracy": 0.83, "steps": 30, "np": 0.5, "arr": [0, 1]}
    assert "\n  " in text  # pretty-printed
