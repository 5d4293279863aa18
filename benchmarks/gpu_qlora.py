"""QLoRA GRPO at Llama-3-8B size: peak GPU memory and tokens/s, vanilla TRL vs CreditGRPOTrainer + plugins.

One prepared script for a lent GPU (an H200, no network): a **random-init** model with Llama-3-8B's
shape (hidden 4096, 32 layers, 32 heads, 8 KV heads, intermediate 14336, vocab 128256; ~8.0B
parameters) is written once as bf16 safetensors to a scratch folder, then loaded for each run the
way a QLoRA user loads a checkpoint: bitsandbytes 4-bit NF4 (bf16 compute, double quantisation) +
PEFT LoRA on all linear layers. Prompts are random token ids written as words of a word-level
tokenizer whose vocabulary is exactly the model's (so every sampled id decodes and every prompt has
exactly ``--prompt-length`` tokens). End-of-sequence is disabled (``min_new_tokens`` =
``max_completion_length``, pad and bos suppressed), so every step generates the same number of tokens
whatever the random weights sample. Two deterministic rewards of the completion ids (never constant
within a group) feed the multi-reward and filtering plugins.

Runs (``--runs``, default ``vanilla,plugins``): ``vanilla`` = ``trl.GRPOTrainer``; ``host`` =
``CreditGRPOTrainer`` with no plugin; ``plugins`` = ``CreditGRPOTrainer`` with ``--plugins`` (default
``gdpo,dynamic_sampling,gtpo``, those installed; ``dynamic_sampling`` without refill, so the budget is
equal). Each run: ``--steps`` GRPO steps, the first one a warm-up; reported per run: median step time,
completion tokens per step and per second, all tokens (prompt + completion) per second, peak GPU
memory (``torch.cuda.max_memory_allocated`` over the training steps) and the memory after loading.

    python benchmarks/gpu_qlora.py --json gpu_qlora.json            # on the GPU, ~4-6 minutes
    python benchmarks/gpu_qlora.py --cpu-smoke                      # tiny sizes on CPU (tests)
    python benchmarks/gpu_qlora.py --layers 2 --steps 2             # a quicker GPU check

``--cpu-smoke`` = ``--layers 1 --hidden 64 --heads 2 --kv-heads 1 --intermediate 128 --vocab 1024
--prompt-length 8 --completion-length 8 --prompts-per-step 2 --generations 4 --steps 2`` on the CPU
(4-bit too: bitsandbytes has CPU kernels). Prints one JSON object; ``--json PATH`` also writes it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any

LLAMA3_8B = {"hidden": 4096, "layers": 32, "heads": 32, "kv_heads": 8, "intermediate": 14336, "vocab": 128256}
CPU_SMOKE = {"layers": 1, "hidden": 64, "heads": 2, "kv_heads": 1, "intermediate": 128, "vocab": 1024,
             "prompt_length": 8, "completion_length": 8, "prompts_per_step": 2, "generations": 4,
             "steps": 2}  # fmt: skip
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0..3; words t4 .. t{vocab-1} follow


# ====================================================================== model, tokenizer, data
def build_tokenizer(vocab: int):
    """A word-level tokenizer whose vocabulary is exactly ``vocab`` ids: the specials, then ``t4`` ... ``tN``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {tok: i for i, tok in enumerate(SPECIALS)}
    words.update({f"t{i}": i for i in range(len(SPECIALS), vocab)})
    backend = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>",
                                        eos_token="</s>", unk_token="<unk>")  # fmt: skip
    tokenizer.padding_side = "left"
    return tokenizer


def model_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(8192, args.prompt_length + args.completion_length + 8), rope_theta=500000.0,
        rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip


def parameter_count(config) -> int:
    h, i, v, n = config.hidden_size, config.intermediate_size, config.vocab_size, config.num_hidden_layers
    kv = h // config.num_attention_heads * config.num_key_value_heads
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    return n * per_layer + 2 * v * h + h


def write_random_model(args, folder: str, device: str) -> dict[str, float]:
    """Random-init weights (bf16 on GPU, fp32 on CPU) and the tokenizer, saved to ``folder``."""
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    clock = time.time()
    config = model_config(args)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    init_seconds = time.time() - clock
    clock = time.time()
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="5GB")
    build_tokenizer(args.vocab).save_pretrained(folder)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"init_seconds": round(init_seconds, 1), "save_seconds": round(time.time() - clock, 1)}


def make_dataset(args):
    from datasets import Dataset

    rng = random.Random(args.seed)
    count = args.prompts_per_step * (args.steps + 2) * 4  # refills and the sampler never run dry
    prompts = [" ".join(f"t{rng.randrange(len(SPECIALS), args.vocab)}" for _ in range(args.prompt_length))
               for _ in range(count)]  # fmt: skip
    return Dataset.from_dict({"prompt": prompts})


def even_ids(completion_ids, **kwargs) -> list[float]:
    """Fraction of even token ids: a deterministic reward that varies within every group."""
    return [sum(1 for t in ids if t % 2 == 0) / max(1, len(ids)) for ids in completion_ids]


def third_ids(completion_ids, **kwargs) -> list[float]:
    """Fraction of token ids divisible by 3 (a second, different reward column)."""
    return [sum(1 for t in ids if t % 3 == 0) / max(1, len(ids)) for ids in completion_ids]


# ====================================================================== one run
def grpo_args(args, output_dir: str, device: str):
    from trl import GRPOConfig

    gpu = device == "cuda"
    return GRPOConfig(
        output_dir=output_dir, max_steps=args.steps, learning_rate=1e-5, beta=0.0, seed=args.seed,
        loss_type="grpo",  # gtpo (a default plugin) needs the per-completion token mean; every run uses it
        per_device_train_batch_size=args.prompts_per_step * args.generations, num_generations=args.generations,
        max_completion_length=args.completion_length, temperature=1.0, logging_steps=1, save_strategy="no",
        report_to="none", use_cpu=not gpu, bf16=gpu, gradient_checkpointing=gpu and not args.no_checkpointing,
        generation_kwargs={"min_new_tokens": args.completion_length, "suppress_tokens": [0, 1]},
        model_init_kwargs={"dtype": "bfloat16" if gpu else "float32"}, disable_tqdm=True,
    )  # fmt: skip


def one_run(name: str, plugins: list, args, folder: str, device: str, dataset) -> dict[str, Any]:
    import torch
    from peft import LoraConfig
    from transformers import AutoTokenizer, BitsAndBytesConfig, TrainerCallback

    from trl_credit import CreditGRPOTrainer

    class Clock(TrainerCallback):
        def __init__(self):
            self.starts: list[float] = []
            self.seconds: list[float] = []

        def _now(self) -> float:
            if device == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter()

        def on_step_begin(self, *a, **k):
            self.starts.append(self._now())

        def on_step_end(self, *a, **k):
            self.seconds.append(self._now() - self.starts[-1])

    gpu = device == "cuda"
    quantization = None if args.no_4bit else BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16 if gpu else torch.float32)  # fmt: skip
    lora = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules="all-linear", task_type="CAUSAL_LM")
    clock = Clock()
    if gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    started = time.time()
    kwargs = dict(model=folder, reward_funcs=[even_ids, third_ids],
                  args=grpo_args(args, os.path.join(folder, name), device), train_dataset=dataset,
                  processing_class=AutoTokenizer.from_pretrained(folder, padding_side="left"),
                  callbacks=[clock], quantization_config=quantization, peft_config=lora)  # fmt: skip
    if name == "vanilla":
        from trl import GRPOTrainer

        trainer = GRPOTrainer(**kwargs)
    else:
        trainer = CreditGRPOTrainer(**kwargs, plugins=plugins)
    load_seconds = time.time() - started
    model = trainer.accelerator.unwrap_model(trainer.model)
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    in_4bit = bool(getattr(model, "is_loaded_in_4bit", False))
    loaded = torch.cuda.memory_allocated() / 2**30 if gpu else None
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    peak = torch.cuda.max_memory_allocated() / 2**30 if gpu else None
    timed = clock.seconds[1:] if len(clock.seconds) > 1 else clock.seconds
    history = [h for h in trainer.state.log_history if "loss" in h]
    lengths = [h["completions/mean_length"] for h in history if "completions/mean_length" in h]
    completions = args.prompts_per_step * args.generations
    tokens = completions * args.completion_length
    median = statistics.median(timed)
    result = {
        "name": name, "trainer": type(trainer).__name__,
        "plugins": [p if isinstance(p, str) else p.get("name") for p in plugins],
        "loaded_in_4bit": in_4bit, "load_seconds": round(load_seconds, 1), "memory_after_load_gib": _round(loaded),
        "peak_gpu_memory_gib": _round(peak), "peak_rss_gib_so_far": _round(_rss_gib()),
        "step_seconds": [round(s, 3) for s in clock.seconds],
        "steps_timed": len(timed), "median_step_seconds": round(median, 3),
        "completion_tokens_per_step": tokens, "tokens_per_second": round(tokens / median, 1),
        "total_tokens_per_second": round(completions * (args.prompt_length + args.completion_length) / median, 1),
        "mean_completion_length": statistics.fmean(lengths) if lengths else None,
        "kept_fraction": [h.get("trl_credit/kept_fraction") for h in history],
        "plugin_seconds": {k.split("/")[1]: statistics.fmean(h[k] for h in history if k in h)
                           for k in sorted({k for h in history for k in h})
                           if k.startswith("trl_credit/") and k.endswith("/seconds") and k.count("/") == 2},
    }  # fmt: skip
    del trainer
    if gpu:
        torch.cuda.empty_cache()
    return result


def _rss_gib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def available_plugins(names: list[str]) -> tuple[list, list[str]]:
    from trl_credit.plugins import available

    installed = available()
    chosen, missing = [], []
    for name in names:
        if name not in installed:
            missing.append(name)
        elif name == "dynamic_sampling":
            chosen.append({"name": name, "refill": False})  # equal generated tokens
        else:
            chosen.append(name)
    return chosen, missing


def environment(device: str) -> dict[str, Any]:
    import torch

    versions = {}
    for dist in ("torch", "transformers", "trl", "peft", "bitsandbytes", "trl-credit"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    env = {"python": platform.python_version(), "cores": os.cpu_count(), "versions": versions}
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return env


# ====================================================================== main
def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=LLAMA3_8B["layers"])
    p.add_argument("--hidden", type=int, default=LLAMA3_8B["hidden"])
    p.add_argument("--heads", type=int, default=LLAMA3_8B["heads"])
    p.add_argument("--kv-heads", type=int, default=LLAMA3_8B["kv_heads"])
    p.add_argument("--intermediate", type=int, default=LLAMA3_8B["intermediate"])
    p.add_argument("--vocab", type=int, default=LLAMA3_8B["vocab"])
    p.add_argument("--prompt-length", type=int, default=128)
    p.add_argument("--completion-length", type=int, default=256)
    p.add_argument("--prompts-per-step", type=int, default=2)
    p.add_argument("--generations", type=int, default=8, help="completions per prompt")
    p.add_argument("--steps", type=int, default=3, help="GRPO steps per run; the first is a warm-up")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--runs", default="vanilla,plugins", help="comma list of vanilla, host, plugins")
    p.add_argument("--plugins", default="gdpo,dynamic_sampling,gtpo", help="plugins of the `plugins` run")
    p.add_argument("--no-4bit", action="store_true", help="LoRA on the bf16/fp32 model instead of QLoRA")
    p.add_argument("--no-checkpointing", action="store_true", help="GPU: gradient checkpointing off")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU: " + json.dumps(CPU_SMOKE))
    p.add_argument("--scratch", default=None, help="folder for the random checkpoint (default: a temp dir, removed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="also write the JSON here")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        for key, value in CPU_SMOKE.items():
            setattr(args, key, value)
        args.device = "cpu"
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    args = parse_args(argv)
    import torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    plugins, missing = available_plugins([p for p in args.plugins.split(",") if p.strip()])
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    config = model_config(args)
    report: dict[str, Any] = {
        "device": device, "environment": environment(device),
        "model": {"random_init": True, "num_hidden_layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
                  "num_attention_heads": config.num_attention_heads,
                  "num_key_value_heads": config.num_key_value_heads, "intermediate_size": config.intermediate_size,
                  "vocab_size": config.vocab_size, "parameters": parameter_count(config),
                  "quantization": None if args.no_4bit else "bitsandbytes 4-bit NF4, double quant",
                  "lora": {"r": args.lora_r, "alpha": 2 * args.lora_r, "target_modules": "all-linear"}},
        "settings": {"prompt_length": args.prompt_length, "max_completion_length": args.completion_length,
                     "prompts_per_step": args.prompts_per_step, "num_generations": args.generations,
                     "steps": args.steps, "eos": "disabled (min_new_tokens = max_completion_length)",
                     "gradient_checkpointing": device == "cuda" and not args.no_checkpointing},
        "plugins": plugins, "plugins_not_installed": missing, "runs": [], "errors": {},
    }  # fmt: skip
    scratch = args.scratch or tempfile.mkdtemp(prefix="gpu_qlora_")
    started = time.time()
    try:
        os.makedirs(scratch, exist_ok=True)
        report["phases"] = write_random_model(args, scratch, device)
        dataset = make_dataset(args)
        for name in runs:
            try:
                enabled = plugins if name == "plugins" else []
                report["runs"].append(one_run(name, enabled, args, scratch, device, dataset))
            except Exception:  # report the others; the traceback goes into the JSON
                report["errors"][name] = traceback.format_exc(limit=8)
                print(report["errors"][name], file=sys.stderr, flush=True)
    finally:
        if args.scratch is None:
            shutil.rmtree(scratch, ignore_errors=True)
    by_name = {r["name"]: r for r in report["runs"]}
    if "vanilla" in by_name:
        base = by_name["vanilla"]
        report["relative_to_vanilla"] = {
            name: {"step_time": round(r["median_step_seconds"] / base["median_step_seconds"], 3),
                   "peak_memory": None if base["peak_gpu_memory_gib"] is None else
                   round(r["peak_gpu_memory_gib"] / base["peak_gpu_memory_gib"], 3)}
            for name, r in by_name.items() if name != "vanilla"
        }  # fmt: skip
    report["seconds"] = round(time.time() - started, 1)
    text = json.dumps(report, indent=2, default=str)
    print(text, flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            handle.write(text + "\n")
    return report


if __name__ == "__main__":
    main()
