"""Run by tests/test_distributed.py under `accelerate launch --multi_gpu --num_processes N` (CPU, gloo):
``distributed_worker.py OUT_DIR MODE[,MODE...]`` trains in each mode in turn, in the same processes, each with
its own output folder ``OUT_DIR/MODE``, and saves every rank's records as ``OUT_DIR/MODE-rank{r}.pt``.

Mode ``pipeline`` (default): trains 2 steps on the tiny model with whole-group plugins (a
constant-group filter with refill and a token-credit transform) and saves, per rank, the gathered
batch each hook saw, the advantages the host computed for it and the local slice the rank trained on.
Mode ``curriculum``: trains 4 steps with a curriculum whose weights depend on the host's per-prompt
statistics, and saves what every rank drew and its final statistics.
Modes ``resume-full`` / ``resume-part`` / ``resume``: 4 steps with refill and a checkpoint every 2;
``resume-part`` stops after the step-2 checkpoint, ``resume`` continues from it.
Mode ``adapter``: 2 steps with a PEFT policy and a plugin that trains an auxiliary "prm" adapter and keeps an
"ema" one; saves every rank's auxiliary weights.
Mode ``dense``: 2 steps with a plugin that calls every extra scorer (prefix_logps with a context, probe,
score_texts, soft_values) and keeps what it got, with the policy's log-probs to check them against.
Mode ``augment``: 2 steps where an ``augment_rollouts`` plugin adds two hinted groups and a loss plugin
checks, in every micro-batch, that its ``rows`` point at its own completions in the gathered batch.
Mode ``rollout``: 2 steps of a scripted ``rollout_func`` returning ``env_mask`` and per-turn fields (the kit's
`ScriptedTurns`), with a constant-group filter and refill; saves each batch's turns and its per-turn progress.
Modes ``tools`` / ``environment``: 2 steps of TRL's own tool loop with scripted sampling (tests/scripted_tools.py),
with refill in ``tools``; saves each batch's turns, tool calls and failures and the environment's per-turn values.
"""

import sys
import zlib

import torch
from trl import GRPOConfig

import plugins_for_tests as fx
from trl_credit import Augmentation, hookimpl
from trl_credit.app.data import make_arithmetic
from trl_credit.testing.tiny import tiny_model_path
from trl_credit.trainer import CreditGRPOTrainer

torch.set_num_threads(1)
mode = "pipeline"  # the mode running now (run() sets it; ToolTurns reads it)
records = []
loss_checks = []


def reward(completions, trl_credit_prompt_index, **kwargs):
    text = [c[-1]["content"] for c in completions]
    return [float(zlib.crc32(t.encode()) % 2) if i % 3 else 1.0 for t, i in zip(text, trl_credit_prompt_index)]


class Record:
    """Keeps every finished batch."""

    @hookimpl
    def on_batch_end(self, batch, advantages):
        records.append({"completion_ids": batch.completion_ids.cpu(), "completion_mask": batch.completion_mask.cpu(),
                        "rewards": batch.rewards.cpu(), "kept": batch.kept.cpu(), "advantages": advantages.cpu(),
                        "prompts": batch.prompts, "prompt_index": batch.prompt_index.cpu(),
                        "augmented": list(batch.columns.get("trl_credit_augmented") or [])})


class HintTwoGroups:
    """Two more groups per round: groups 0 and 1 again, with a hint in the prompt."""

    @hookimpl
    def augment_rollouts(self, batch):
        return [Augmentation(g, [{"role": "system", "content": "Hint: add."}, *batch.prompts[g * 4]], context="hint")
                for g in (0, 1)]


class RowsCheck:
    """Every micro-batch: the rows it was given are its own completions in the gathered batch."""

    @hookimpl
    def loss_terms(self, loss):
        width = loss.completion_ids.shape[1]
        loss_checks.append(bool(torch.equal(loss.batch.completion_ids[loss.rows][:, :width], loss.completion_ids)))
        return {"zero": loss.logps.sum() * 0.0}


class DenseScores:
    """Every extra scorer on the gathered batch (collective: each rank scores its own rows)."""

    @hookimpl
    def on_batch_end(self, batch, advantages):
        from trl_credit import step_ends

        n = batch.num_completions
        ends = torch.cat([torch.zeros(n, 1, dtype=torch.long), step_ends(batch, max_steps=2)], dim=1)
        texts = [f"The answer is {a}" for a in batch.column("answer")]
        q, v = batch.soft_values("policy")
        records.append({"prefix": batch.prefix_logps(ends, [" 7"] * n, reduce="none", context=" ="),
                        "ends": ends, "probe": batch.probe(ends[:, :1], " =", num_samples=2, max_new_tokens=3,
                                                           top_k=3),
                        "scores": batch.score_texts(list(range(n)), texts),
                        "expected_scores": reward([[{"role": "assistant", "content": t}] for t in texts],
                                                  trl_credit_prompt_index=batch.prompt_index.tolist()),
                        "q": q, "v": v, "policy": batch.policy_logps(), "mask": batch.completion_mask.cpu()})


class ToolTurns:
    """Keeps every finished batch's turns and (environment mode) the recorded per-turn totals."""

    @hookimpl
    def on_batch_end(self, batch, advantages):
        turns = batch.turns()
        records.append({"prompts": batch.prompts, "count": turns.count.cpu(), "calls": turns.calls.cpu(),
                        "failures": turns.failures.cpu(), "env": turns.env.cpu(), "completion_ids": batch.completion_ids.cpu(),
                        "values": batch.turn_values("total").cpu() if mode == "environment" else None})


class RolloutTurns:
    """Keeps every finished batch's turns, ids, kept groups and the rollout's per-turn progress."""

    @hookimpl
    def on_batch_end(self, batch, advantages):
        turns = batch.turns()
        records.append({"prompts": batch.prompts, "count": turns.count.cpu(), "env": turns.env.cpu(),
                        "model": turns.model.cpu(), "completion_ids": batch.completion_ids.cpu(),
                        "progress": batch.turn_values("turn_progress").cpu(), "kept": batch.kept.cpu(),
                        "advantages": advantages.cpu()})


class CreditRecorder(CreditGRPOTrainer):
    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if not records:
            return output
        records[-1]["local_advantages"] = output["advantages"].cpu()
        records[-1]["local_completion_ids"] = output["completion_ids"].cpu()
        return output


class MidPassRate:
    """Curriculum from the statistics: weight p(1 - p) + 0.01, unseen prompts 1."""

    @hookimpl
    def prompt_weights(self, stats, step):
        p = stats.pass_rate()
        return torch.where(torch.isnan(p), torch.ones_like(p), p * (1 - p) + 0.01)


def run(out_dir: str, name: str) -> None:
    """Train in mode ``name`` with its own output folder ``out_dir/name`` (``resume`` continues ``resume-part``'s)
    and save this rank's records as ``out_dir/name-rank{r}.pt``."""
    global mode
    mode = name
    records.clear()
    loss_checks.clear()
    run_dir = f"{out_dir}/resume-part" if mode == "resume" else f"{out_dir}/{mode}"
    if mode in ("tools", "environment"):
        import os

        import scripted_tools as st

        os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
        args = GRPOConfig(output_dir=run_dir, per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=128, max_steps=2, logging_steps=1, report_to="none",
                          save_strategy="no", use_cpu=True, bf16=False, seed=0, learning_rate=1e-3)
        extra = ({"tools": [st.add], "reward_funcs": [st.digit_reward],
                  "plugins": [{"name": fx.DropConstant, "max_refill_rounds": 2}, ToolTurns]} if mode == "tools" else
                 {"environment_factory": st.AddEnvironment, "reward_funcs": [st.env_reward], "plugins": [ToolTurns]})
        trainer = st.ScriptedToolTrainer(model=tiny_model_path(), args=args, train_dataset=make_arithmetic(64, seed=1),
                                         processing_class=st.chatml_tool_tokenizer(), **extra)
        trainer.train()
        save(trainer, out_dir)
        return

    if mode == "rollout":
        from trl_credit.testing import ScriptedTurns, scripted_turns_reward

        args = GRPOConfig(output_dir=run_dir, per_device_train_batch_size=6, num_generations=4,
                          max_completion_length=16, max_steps=2, logging_steps=1, report_to="none",
                          save_strategy="no", use_cpu=True, bf16=False, seed=0, learning_rate=1e-3)
        trainer = CreditGRPOTrainer(model=tiny_model_path(), reward_funcs=[scripted_turns_reward], args=args,
                                    train_dataset=make_arithmetic(64, seed=0), rollout_func=ScriptedTurns(),
                                    plugins=[{"name": fx.DropConstant, "max_refill_rounds": 4}, RolloutTurns])
        trainer.train()
        save(trainer, out_dir)
        return

    resuming = mode.startswith("resume")
    steps = 4 if mode == "curriculum" or resuming else 2
    args = GRPOConfig(output_dir=run_dir, per_device_train_batch_size=6, num_generations=4, max_completion_length=8,
                      max_steps=steps, logging_steps=1, report_to="none", save_strategy="steps" if resuming else "no",
                      save_steps=2, use_cpu=True, bf16=False, seed=0, learning_rate=1e-3)
    plugins = ([MidPassRate, Record] if mode == "curriculum" else [HintTwoGroups, RowsCheck, Record] if mode == "augment"
               else [{"name": fx.AuxPRM, "ema": 0.5}, Record] if mode == "adapter"
               else [DenseScores] if mode == "dense"
               else [{"name": fx.DropConstant, "max_refill_rounds": 4}, fx.TokenCredit, Record])
    peft_config = None
    if mode == "adapter":
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    trainer = CreditRecorder(model=tiny_model_path(), reward_funcs=[reward], args=args, peft_config=peft_config,
                             train_dataset=make_arithmetic(16 if mode == "curriculum" else 64, seed=0), plugins=plugins)
    if mode == "resume-part":
        from transformers import TrainerCallback

        class StopAt2(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                control.should_training_stop = state.global_step == 2

        trainer.add_callback(StopAt2())
    trainer.train(resume_from_checkpoint=f"{run_dir}/checkpoint-2" if mode == "resume" else None)
    adapters = {}
    if mode == "adapter":
        model = trainer.accelerator.unwrap_model(trainer.model)
        adapters = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
        records.append({"updates": [r for _, r, _ in trainer.credit_plugins.plugins[0].instance.seen]})
    save(trainer, out_dir, adapters=adapters, prompt_stats=trainer.prompt_stats.state_dict(), loss_checks=loss_checks)


def save(trainer, out_dir: str, **more) -> None:
    """This rank's records of the mode that just trained, as ``out_dir/MODE-rank{r}.pt``."""
    torch.save({"world": trainer.accelerator.num_processes, "records": records, "mode": mode,
                "log_history": trainer.state.log_history, **more},
               f"{out_dir}/{mode}-rank{trainer.accelerator.process_index}.pt")


if __name__ == "__main__":
    # several modes in one launch (one after the other, in the same two processes): starting two processes
    # costs more than most modes' training
    for name in (sys.argv[2] if len(sys.argv) > 2 else "pipeline").split(","):
        run(sys.argv[1], name)
    # leave the process group before exit: gloo's threads still running at interpreter teardown aborted a rank
    # now and then ("terminate called without an active exception", exit -6) after every record was saved
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
