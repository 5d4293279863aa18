"""``heldout_every``: a held-out accuracy curve during ``trl-credit train`` that leaves training untouched."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from trl_credit.app import cli
from trl_credit.app.train_command import load_config
from trl_credit.config import ConfigError

REWARDS = '''
from trl_credit.app.rewards import completion_text


def odd_length(completions, **kwargs):
    """1.0 for an odd number of characters: a random tiny model gets it about half the time."""
    return [float(len(completion_text(c)) % 2 == 1) for c in completions]
'''


def _config(root, model, out, **extra) -> str:
    keys = "".join(f"{k}: {v}\n" for k, v in extra.items())
    path = root / f"{out.name}.yaml"
    path.write_text(textwrap.dedent(f"""\
        model_name_or_path: {model}
        dtype: float32
        bf16: false
        use_peft: true
        lora_r: 4
        lora_alpha: 8
        lora_target_modules: all-linear
        dataset_name: "arithmetic:n=32,eval_n=8"
        reward_funcs: [curverewards.odd_length]
        output_dir: {out}
        max_steps: 4
        learning_rate: 5.0e-2
        beta: 0.0
        per_device_train_batch_size: 8
        num_generations: 4
        max_completion_length: 8
        logging_steps: 1
        save_strategy: "no"
        report_to: none
        use_cpu: true
        seed: 0
        heldout_samples: 8
        heldout_max_new_tokens: 8
    """) + keys)
    return str(path)


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("curve")
    (root / "curverewards.py").write_text(REWARDS)
    sys.path.insert(0, str(root))
    try:
        plain = _config(root, tiny_model, root / "plain")
        curved = _config(root, tiny_model, root / "curved", heldout_every=2, heldout_before="false")
        assert cli.main(["train", plain]) == 0 and cli.main(["train", curved]) == 0
    finally:
        sys.path.remove(str(root))
    return [json.loads((root / name / "metrics.json").read_text()) for name in ("plain", "curved")]


def test_the_curve_is_measured_every_n_steps_and_ends_with_the_final_accuracy(runs):
    plain, curved = runs
    steps = [step for step, _ in curved["heldout_curve"]]
    assert steps == [2, 4]
    assert all(0.0 <= value <= 1.0 for _, value in curved["heldout_curve"])
    assert curved["heldout_accuracy_after"] == curved["heldout_curve"][-1][1]
    assert curved["heldout_accuracy_after"] == pytest.approx(plain["heldout_accuracy_after"])  # the same model
    assert "heldout_accuracy_before" not in curved and "heldout_accuracy_before" in plain
    assert curved["heldout_curve_seconds"] >= 0.0


def test_the_curve_does_not_change_training(runs):
    """Greedy decoding draws no random numbers: every logged loss and reward is the same with and without."""
    plain, curved = runs

    def logged(metrics):
        return [(h["step"], h["loss"], h["reward"]) for h in metrics["log_history"] if "loss" in h]

    assert len(logged(plain)) == 4 and logged(curved) == logged(plain)


@pytest.mark.parametrize(("keys", "message"), [
    ({"heldout_every": 5}, "heldout_every: 5 needs held-out prompts: set heldout_samples"),
    ({"heldout_every": -1, "heldout_samples": 10}, "heldout_every must be >= 0, got -1"),
    ({"heldout_samples": -3}, "heldout_samples must be >= 0, got -3"),
])  # fmt: skip
def test_bad_heldout_keys_are_refused_before_anything_loads(tmp_path, keys, message):
    path = tmp_path / "bad.yaml"
    path.write_text("use_cpu: true\nbf16: false\n" + "".join(f"{k}: {v}\n" for k, v in keys.items()))
    with pytest.raises(ConfigError, match=message):
        load_config(str(path))
