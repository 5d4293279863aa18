"""fixed_prm: step rewards of a frozen implicit PRM on hand-computed vectors, every aggregate, the path checks
(before the model loads; pickled weights refused), and a real run that loads PRIME's checkpointed adapter."""

from __future__ import annotations

import math
import zlib

import pytest
import torch
from peft import LoraConfig

from trl_credit import ConfigError
from trl_credit.testing import check_args, check_plugin, make_batch, run_plugin, train_tiny
from trl_credit_fixed_prm import FixedPRM, aggregate_steps, step_rewards

LORA = dict(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)


def test_step_rewards_and_aggregates():
    q = torch.tensor([[0.2, 0.4, -1.0, 0.6, 0.0], [0.5, 0.5, 0.0, 0.0, 0.0], [0.0] * 5])
    index = torch.tensor([[0, 0, 1, 2, -1], [-1, -1, -1, -1, -1], [-1] * 5])  # row 1: text without steps
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [0] * 5])
    r, valid = step_rewards(q, index, mask, beta=0.5)
    # row 0: steps [0.2 + 0.4, -1.0, 0.6] * 0.5 = [0.3, -0.5, 0.3]; row 1: one step of all tokens 0.5 * 1.0
    torch.testing.assert_close(r[0], torch.tensor([0.3, -0.5, 0.3]))
    assert valid.tolist() == [[True, True, True], [True, False, False], [False, False, False]]
    assert r[1, 0].item() == pytest.approx(0.5)
    assert aggregate_steps(r, valid, "min").tolist() == pytest.approx([-0.5, 0.5, 0.0])
    assert aggregate_steps(r, valid, "sum").tolist() == pytest.approx([0.1, 0.5, 0.0])
    assert aggregate_steps(r, valid, "mean").tolist() == pytest.approx([0.1 / 3, 0.5, 0.0])
    assert aggregate_steps(r, valid, "last").tolist() == pytest.approx([0.3, 0.5, 0.0])


def saved_adapter(tmp_path):
    """A PEFT folder as PRIME writes it (safetensors)."""
    folder = tmp_path / "prm"
    folder.mkdir()
    (folder / "adapter_config.json").write_text("{}")
    (folder / "adapter_model.safetensors").write_bytes(b"")
    return str(folder)


def test_scores_through_the_adapter_and_the_reference(tmp_path):
    ref = -torch.rand(4, 3, generator=torch.Generator().manual_seed(0))
    prm = ref + torch.tensor([[0.4, 0.2, 0.0], [-0.2, 0.0, 0.0], [0.0, 0.0, 0.0], [0.6, -0.6, 0.2]])
    batch = make_batch([1, 0, 1, 0], 2, lengths=[2, 1, 0, 3], ref_logps=ref, adapters={"prm": prm},
                       reward_names=["accuracy"])
    result = run_plugin(FixedPRM, batch, {"path": saved_adapter(tmp_path), "aggregate": "sum", "beta": 0.1})
    # the stand-in tokenizer has no text: each row is one step; sum = 0.1 * [0.6, -0.2, 0, 0.2]
    assert result.reward_names == ["accuracy", "implicit_prm"]
    torch.testing.assert_close(result.rewards[:, 1], torch.tensor([0.06, -0.02, 0.0, 0.02]), atol=1e-6, rtol=0)


def test_path_checks_before_the_model_loads(tmp_path):
    with pytest.raises(ConfigError, match=r"\(fixed_prm\).*path: is empty; fix: set path"):
        check_args(FixedPRM, {})
    pickled = tmp_path / "old"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text("{}")
    (pickled / "adapter_model.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"pickled adapter_model.bin weights, which are not loaded"):
        check_args(FixedPRM, {"path": str(pickled)})
    with pytest.raises(ConfigError, match="is not a directory"):
        check_args(FixedPRM, {"path": str(tmp_path / "missing")})
    with pytest.raises(ConfigError, match=r"\(fixed_prm\).*pattern"):
        check_args(FixedPRM, {"path": str(tmp_path), "pattern": "("})


def test_contract(tmp_path):
    check_plugin(FixedPRM, {"path": saved_adapter(tmp_path)})


def parity_reward(completions, **kwargs):
    return [float(zlib.crc32(c[-1]["content"].encode()) % 2) for c in completions]


def test_loads_primes_checkpointed_prm_and_scores_with_it(tmp_path):
    lora = LoraConfig(**LORA)
    train_tiny([{"name": "prime"}], output_dir=tmp_path / "prime", reward_funcs=[parity_reward], peft_config=lora,
               learning_rate=1e-2, max_steps=1, save_strategy="steps", save_steps=1)
    path = tmp_path / "prime" / "checkpoint-1" / "tc_prime_prm"
    saved = torch.load(tmp_path / "prime" / "checkpoint-1" / "trl_credit_state.pt", weights_only=True)
    trainer = train_tiny([{"name": "fixed_prm", "path": str(path)}], output_dir=tmp_path / "fixed",
                         reward_funcs=[parity_reward], peft_config=LoraConfig(**LORA), max_steps=1)
    model = trainer.accelerator.unwrap_model(trainer.model)
    loaded = {n: p for n, p in model.named_parameters() if ".tc_fixed_prm_prm." in n}
    weights = saved["adapters"]["adapter:prime/prm"]["weights"]
    assert loaded and len(loaded) == len(weights)
    for name, value in weights.items():  # the PRIME step's weights, loaded frozen
        other = loaded[name.replace(".tc_prime_prm.", ".tc_fixed_prm_prm.")]
        assert torch.equal(other.detach().cpu(), value) and not other.requires_grad
    assert trainer.aux_adapters.updates["adapter:fixed_prm/prm"] == 0  # never trained
    logs = trainer.state.log_history[0]
    assert math.isfinite(logs["trl_credit/fixed_prm/reward"]) and logs["trl_credit/fixed_prm/reward"] != 0.0
