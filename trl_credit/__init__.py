"""trl-credit: credit-assignment plugins for TRL's GRPOTrainer.

``from trl_credit import hookimpl`` to write a plugin; ``CreditGRPOTrainer`` is the drop-in trainer.
Heavy names are imported lazily so that ``trl-credit plugins`` stays fast.
"""

from trl_credit.hookspecs import hookimpl, hookspec

__version__ = "0.1.0"
__all__ = ["hookimpl", "hookspec", "CreditGRPOTrainer", "RolloutBatch", "PromptStats", "ConfigError",
           "PluginRuntimeError", "__version__"]

_LAZY = {
    "CreditGRPOTrainer": "trl_credit.trainer",
    "RolloutBatch": "trl_credit.batch",
    "PromptStats": "trl_credit.batch",
    "ConfigError": "trl_credit.config",
    "PluginRuntimeError": "trl_credit.pipeline",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trl_credit' has no attribute {name!r}")
