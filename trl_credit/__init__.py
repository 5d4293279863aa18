"""trl-credit: credit-assignment plugins for TRL's GRPOTrainer.

This module is the public API: everything a plugin may import is listed in ``__all__`` (plus the
testing kit, `trl_credit.testing`). Plugins in this repository import nothing else from the host, and
a test keeps it so. Heavy names are imported lazily so that ``trl-credit plugins`` stays fast.

- writing a plugin: `hookimpl`, `Plugin`, `Refill`, `RunInfo`, `ConfigError`
- what hooks see: `RolloutBatch`, `PromptStats`, `LossInputs` (loss hooks; they return `LossWeights`);
  what `augment_rollouts` returns: `Augmentation`; prompt and group helpers: `with_context`,
  `joint_advantages` (an augmented group and its source share one GRPO baseline); what `probe` returns:
  `Probes`
- shared pieces: step segmentation and scorers (`StepConfig`, `split_steps`, `token_steps`, `step_ends`, `turn_ends`, `carry_forward`, `token_char_offsets`, `discounted_returns`,
  `step_scores`, `score_steps`, `resolve_step_scorer`, `pad_step_scores`), answer extraction
  (`completion_text`, `last_number`, `answer_prefix`, `has_answer`), the built-in GRPO estimator (`GRPOAdvantage`, `grpo_advantages`), pooled group normalisation (`group_normalise`)
- auxiliary LoRA adapters a plugin owns (`Plugin.adapters()`, `Plugin.adapter(name)`): `Adapter`,
  `AdapterHandle`
- option types for a plugin's `Config`: `Regex`, `AnswerTemplate`
- running: `CreditGRPOTrainer`; errors at run time: `PluginRuntimeError`
"""

from trl_credit.hookspecs import hookimpl

__version__ = "0.2.3"

_LAZY = {
    "Plugin": "trl_credit.plugin",
    "Refill": "trl_credit.plugin",
    "RunInfo": "trl_credit.plugin",
    "PluginInfo": "trl_credit.plugin",
    "ConfigError": "trl_credit.config",
    "RolloutBatch": "trl_credit.batch",
    "PromptStats": "trl_credit.batch",
    "Augmentation": "trl_credit.augment",
    "joint_advantages": "trl_credit.augment",
    "source_keys": "trl_credit.augment",
    "with_context": "trl_credit.augment",
    "Turns": "trl_credit.turns",
    "turn_ends": "trl_credit.turns",
    "carry_forward": "trl_credit.turns",
    "Probes": "trl_credit.probes",
    "Regex": "trl_credit.options",
    "AnswerTemplate": "trl_credit.options",
    "Adapter": "trl_credit.adapters",
    "AdapterHandle": "trl_credit.adapters",
    "LossInputs": "trl_credit.loss",
    "LossWeights": "trl_credit.loss",
    "CLIPPED_LOSSES": "trl_credit.loss",
    "StepConfig": "trl_credit.steps",
    "split_steps": "trl_credit.steps",
    "token_steps": "trl_credit.steps",
    "step_ends": "trl_credit.steps",
    "discounted_returns": "trl_credit.steps",
    "token_char_offsets": "trl_credit.steps",
    "step_scores": "trl_credit.steps",
    "score_steps": "trl_credit.steps",
    "resolve_step_scorer": "trl_credit.steps",
    "pad_step_scores": "trl_credit.steps",
    "completion_text": "trl_credit.answers",
    "last_number": "trl_credit.answers",
    "answer_prefix": "trl_credit.answers",
    "has_answer": "trl_credit.answers",
    "GRPOAdvantage": "trl_credit.builtin",
    "grpo_advantages": "trl_credit.builtin",
    "group_normalise": "trl_credit.builtin",
    "CreditGRPOTrainer": "trl_credit.trainer",
    "PluginRuntimeError": "trl_credit.pipeline",
}

__all__ = ["hookimpl", *_LAZY, "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trl_credit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
