"""Pins the TRL seam: every private GRPOTrainer / Trainer name the host overrides or calls, and the keys
of ``_generate_and_score_completions``' output it reads. A TRL upgrade that moves one fails here with
one message naming what moved (the supported range is in README.md and pyproject.toml)."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

from trl_credit.refill import RIGHT_PADDED
from trl_credit.testing import answer_reward, tiny_dataset, train_tiny

#: method -> the leading parameters (after self) the host passes or overrides with
METHODS = {
    "_calculate_rewards": ["inputs", "prompts", "completions", "completion_ids_list"],
    "_generate_and_score_completions": ["inputs"],
    "_get_train_sampler": ["dataset"],
    "_tokenize_prompts": ["prompts"],
    "_get_per_token_logps_and_entropies": ["model", "input_ids", "attention_mask", "logits_to_keep", "batch_size",
                                           "compute_entropy"],
    "compute_loss": ["model", "inputs", "return_outputs", "num_items_in_batch"],
    "create_optimizer": ["model"],
    "_save_checkpoint": ["model", "trial"],
    "_load_optimizer_and_scheduler": ["checkpoint"],
    "_get_output_dir": ["trial"],
    "_get_dataloader": ["dataset", "description", "batch_size", "sampler_fn", "is_training", "dataloader_key"],
}
#: attributes of a built GRPOTrainer the host reads
ATTRIBUTES = ["_tokenizer", "_metrics", "_train_batch_size", "reward_func_names", "reward_weights", "num_generations",
              "num_iterations", "loss_type", "beta", "ref_model", "accelerator", "epsilon_low", "epsilon_high",
              "max_completion_length", "temperature"]
#: module-level TRL names the host imports
IMPORTS = {"trl.trainer.utils": ["RepeatSampler", "use_adapter", "nanstd"],
           "trl.models.utils": ["disable_gradient_checkpointing", "unwrap_model_for_generation"],
           "trl": ["GRPOTrainer", "GRPOConfig"]}
#: output keys of _generate_and_score_completions the host reads or writes
OUTPUT_KEYS = {"prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages", "num_items_in_batch"}


def test_the_loss_seam_reads_what_the_loss_hooks_pass():
    """The loss hooks rely on three facts of TRL's ``_compute_loss``: it calls
    ``self._get_per_token_logps_and_entropies`` once (the host keeps its output for ``loss_terms``),
    its loss mask is ``completion_mask * inputs["tool_mask"]`` (token weights), and its clip bounds are
    ``self.epsilon_low`` / ``self.epsilon_high`` (per-sample bounds). The parity tests in
    test_loss_hooks.py check the values; this names what moved."""
    from trl import GRPOTrainer

    source = inspect.getsource(GRPOTrainer._compute_loss)
    assert source.count("self._get_per_token_logps_and_entropies(") == 1, "TRL changed how _compute_loss scores"
    assert 'completion_mask * inputs["tool_mask"]' in source, "TRL changed the loss mask (tool_mask)"
    assert "1 - self.epsilon_low, 1 + self.epsilon_high" in source, "TRL changed its clip bounds"


def test_supported_trl_version():
    import trl

    major, minor = (int(x) for x in trl.__version__.split(".")[:2])
    assert (major, minor) == (1, 16), f"trl-credit supports TRL 1.16.x; installed {trl.__version__}"


@pytest.mark.parametrize("name", sorted(METHODS))
def test_private_method_signatures(name):
    from trl import GRPOTrainer

    method = getattr(GRPOTrainer, name, None)
    assert method is not None, f"TRL moved GRPOTrainer.{name}: the host's seam in trl_credit/trainer.py needs it"
    params = list(inspect.signature(method).parameters)[1:]
    expected = METHODS[name]
    assert params[: len(expected)] == expected, (
        f"TRL changed GRPOTrainer.{name}: parameters {params}, the host expects {expected} first")


@pytest.mark.parametrize("module", sorted(IMPORTS))
def test_imported_names(module):
    mod = importlib.import_module(module)
    missing = [n for n in IMPORTS[module] if not hasattr(mod, n)]
    assert not missing, f"TRL moved {module}.{', '.join(missing)} (used by trl_credit)"


def _one_step_trainer(tmp_path):
    """A tiny trainer with one plugin that records nothing, so the host's seam is active."""
    from trl_credit import Plugin, hookimpl

    class Look(Plugin):
        """Records nothing."""

        @hookimpl
        def on_batch_end(self, batch, advantages):
            pass

    return train_tiny([Look], output_dir=tmp_path, train=False, reward_funcs=[answer_reward],
                      dataset=tiny_dataset(16))


def test_attributes_and_output_keys(tmp_path):
    """One real step: the trainer attributes exist and the output has the keys the host reads; every per-row
    tensor of the output is one refill knows how to pad and combine."""
    trainer = _one_step_trainer(tmp_path)
    from trl import GRPOTrainer

    missing_attrs = [a for a in ATTRIBUTES if not hasattr(trainer, a)]
    assert not missing_attrs, f"TRL's GRPOTrainer no longer has {missing_attrs} (read by trl_credit/trainer.py)"
    inputs = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    output = GRPOTrainer._generate_and_score_completions(trainer, inputs)
    missing = OUTPUT_KEYS - set(output)
    assert not missing, f"_generate_and_score_completions no longer returns {sorted(missing)}"
    per_row = {k for k, v in output.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    unknown = per_row - {"prompt_ids", "prompt_mask", "completion_ids", "advantages", *RIGHT_PADDED}
    assert not unknown, f"_generate_and_score_completions returns per-row tensors refill does not combine: {unknown}"


def test_cpu_scoring_scores_only_the_completion_tokens(tmp_path, monkeypatch):
    """TRL 1.16's fused LM head scores every position off Triton devices (``compact = _use_triton(...)`` in
    ``add_fused_lm_head``); the host's ``_get_per_token_logps_and_entropies`` switches it to the valid positions
    on CPU. Pinned here: the switch TRL reads, the rows scored (the completion tokens, not prompt or padding),
    the log-probs and entropies equal to TRL's bit for bit, and the gradients equal to float rounding."""
    import trl.trainer.utils as trl_utils
    from trl import GRPOTrainer

    assert "compact = _use_triton(hidden_states.device)" in inspect.getsource(trl_utils.add_fused_lm_head), (
        "TRL changed how its fused LM head decides which positions to score (trl_credit/trainer.py relies on it)")

    trainer = _one_step_trainer(tmp_path)
    scored: list[int] = []
    original = trl_utils._ChunkedLogProbFunction

    class Spy:
        @staticmethod
        def apply(hidden, *rest):
            scored.append(hidden.shape[0])
            return original.apply(hidden, *rest)

    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", Spy)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (3, 12), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding in the prompt
    mask[1, -2:] = 0  # right padding in the completion
    keep = 5  # the last 5 positions are the completion
    model = trainer.model
    params = [p for p in model.parameters() if p.requires_grad]
    results = {}
    for name, scorer in (("ours", trainer._get_per_token_logps_and_entropies),
                         ("theirs", lambda *a, **k: GRPOTrainer._get_per_token_logps_and_entropies(trainer, *a, **k))):
        model.zero_grad()
        logps, entropies, _ = scorer(model, ids, mask, keep, compute_entropy=True)
        (logps * torch.linspace(0.5, 1.5, keep)).sum().backward()
        results[name] = logps.detach(), entropies.detach(), [p.grad.clone() for p in params]
    valid = int(mask[:, -keep:].sum())
    assert scored == [valid, 3 * 11], "ours scores the completion tokens only; TRL's CPU path scores every position"
    (ours_logps, ours_entropy, ours_grads), (logps, entropy, grads) = results["ours"], results["theirs"]
    assert torch.equal(ours_logps, logps) and torch.equal(ours_entropy, entropy)
    assert torch.count_nonzero(logps) == valid
    for mine, theirs in zip(ours_grads, grads):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-6)
    assert trl_utils._use_triton(torch.device("cpu")) is False, "the switch is restored after scoring"
