"""Shared fixtures: a tiny random model with the local tokenizer, arithmetic data, a trainer factory."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub on these machines: fail fast instead of timing out
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
import torch

torch.set_num_threads(1)  # the CI machine has 2 cores; tests are tiny, one thread is faster and stable


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from trl_credit.testing.tiny import tiny_model_path

    return tiny_model_path()


@pytest.fixture(scope="session")
def arithmetic():
    from trl_credit.app.data import make_arithmetic

    return make_arithmetic(64, seed=0)


@pytest.fixture
def make_trainer(tiny_model, arithmetic, tmp_path):
    """Build a CreditGRPOTrainer on the tiny model; keyword args go to GRPOConfig."""
    from trl import GRPOConfig

    from trl_credit.app.rewards import arithmetic_accuracy
    from trl_credit.trainer import CreditGRPOTrainer

    def build(plugins=None, reward_funcs=None, dataset=None, trainer_cls=CreditGRPOTrainer, peft_config=None,
              **overrides):
        values = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=8, max_steps=2, logging_steps=1, report_to="none",
                      learning_rate=1e-3, save_strategy="no", use_cpu=True, bf16=False, seed=0)
        values.update(overrides)
        kwargs = dict(model=tiny_model, reward_funcs=reward_funcs or [arithmetic_accuracy],
                      args=GRPOConfig(**values), train_dataset=dataset if dataset is not None else arithmetic)
        if peft_config is not None:
            kwargs["peft_config"] = peft_config
        if trainer_cls is CreditGRPOTrainer:
            kwargs["plugins"] = plugins
        return trainer_cls(**kwargs)

    return build
