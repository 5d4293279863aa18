"""The TRL seam: `CreditGRPOTrainer`, a drop-in `trl.GRPOTrainer` with a ``plugins=`` argument.

Wrap, never copy. The only GRPOTrainer methods overridden here are small seams, each calling the
original: ``_calculate_rewards`` (to keep the round's inputs), the *tail* of
``_generate_and_score_completions`` (its output is post-processed: rewards shaped, rollouts
filtered, advantages recomputed), ``compute_loss`` (non-dilution factor for per-sequence losses;
loss plugins: token weights passed as TRL's ``tool_mask``, clip bounds as its ``epsilon_low`` /
``epsilon_high``, TRL's own ``_get_per_token_logps_and_entropies`` output kept for extra terms),
``_get_per_token_logps_and_entropies`` (through the `ValidPositionScoring` mixin: on CPU only valid positions
are scored, the same log-probs, several times faster), ``_get_train_sampler`` (curricula), ``create_optimizer`` (skip all-dropped updates) and
``_save_checkpoint`` / ``_load_optimizer_and_scheduler`` (plugin state, auxiliary adapters). Auxiliary
adapters (`trl_credit.adapters`) are added to TRL's PEFT model at the end of ``__init__``, before TRL
builds its optimiser. With no plugins enabled every seam returns TRL's result untouched (on CPU the
gradients differ from TRL's by float summation order only).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
import time
from typing import Any

import torch
from accelerate.utils import gather_object
from transformers import TrainerCallback
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import use_adapter

from trl_credit.adapters import KIND_PREFIX, AuxAdapters, peft_name
from trl_credit.augment import AUGMENTED, SOURCE_PROMPT
from trl_credit.batch import PROMPT_INDEX, PromptStats, RolloutBatch
from trl_credit.checkpoint import STATE_FILE, CheckpointError, read_state, write_state
from trl_credit.config import PluginSet, build_plugins, check_reward_columns, check_run, reward_names
from trl_credit.distributed import gather_padded
from trl_credit.loss import LossInputs
from trl_credit.pipeline import Pipeline, kept_advantages
from trl_credit.refill import RefillStream, assemble, refill_choice
from trl_credit.sampler import CurriculumSampler

PER_SEQUENCE_LOSSES = ("grpo", "sapo", "dr_grpo", "luspo")  # loss averages over rows, so dropped rows dilute


class ValidPositionScoring:
    """A `trl.GRPOTrainer` mixin: its ``_get_per_token_logps_and_entropies`` under `_score_valid_positions_only`
    (on CPU, only the completion tokens are scored). `CreditGRPOTrainer` has it; benchmarks/overhead.py gives
    it to plain TRL so that its host/vanilla ratio measures the seams."""

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        with _score_valid_positions_only(self.args):
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)


class CreditGRPOTrainer(ValidPositionScoring, GRPOTrainer):
    """`trl.GRPOTrainer` plus ``plugins``: a list of names or ``{"name": ..., **options}`` (or a `PluginSet`).

    Plugins act in the order given within each hook family. Everything else is GRPOTrainer's.
    """

    def __init__(self, *args: Any, plugins: Any = None, **kwargs: Any):
        self.credit_plugins = plugins if isinstance(plugins, PluginSet) else build_plugins(plugins)
        self.pipeline = Pipeline(self.credit_plugins)
        kwargs = dict(inspect.signature(GRPOTrainer.__init__).bind_partial(None, *args, **kwargs).arguments)
        kwargs.pop("self")
        dataset = kwargs.get("train_dataset")
        funcs = kwargs.get("reward_funcs")
        if self.pipeline.active:  # every check that needs no model, before the model loads
            args = kwargs.get("args")
            names = reward_names(funcs if isinstance(funcs, list) else [funcs]) if funcs is not None else None
            columns = list(dataset.column_names) if hasattr(dataset, "column_names") else None
            peft = kwargs.get("peft_config") is not None or hasattr(kwargs.get("model"), "peft_config")
            fields = getattr(kwargs.get("rollout_func"), "fields", None)  # a rollout that declares its fields
            self.credit_run = check_run(self.credit_plugins, args if args is not None else _default_args(kwargs),
                                        names, columns, peft, list(fields) if fields is not None else None)
            if columns is not None and PROMPT_INDEX not in columns and hasattr(dataset, "add_column"):
                kwargs["train_dataset"] = dataset.add_column(PROMPT_INDEX, list(range(len(dataset))))
        self.prompt_stats = PromptStats.empty(len(dataset) if hasattr(dataset, "__len__") else 0)
        self._credit_round: dict[str, Any] = {}
        self._credit_batch: RolloutBatch | None = None
        self._credit_skip_update = False
        self._credit_costs: dict[str, float] = {}  # extra passes of this step, summed (`_cost`)
        self._credit_probe_calls = (0, 0)  # (step, probe calls in it): each call its own random stream
        self.refill_stream = RefillStream(self)
        super().__init__(**kwargs)
        self.aux_adapters = AuxAdapters(self.credit_plugins.adapters())
        if self.pipeline.active:
            check_reward_columns(self.credit_plugins, list(self.reward_func_names))  # environments add rewards
            self.add_callback(_ObserverCallback(self))
        if self.aux_adapters:
            if self.is_fsdp_enabled or (self.is_deepspeed_enabled and
                                        self.accelerator.state.deepspeed_plugin.zero_stage == 3):
                raise NotImplementedError("auxiliary adapters need whole (unsharded) LoRA weights on every process: "
                                          "use DDP or DeepSpeed ZeRO-1/2, not FSDP or ZeRO-3")
            self.aux_adapters.attach(self.model, self.args.learning_rate)  # frozen: TRL's optimiser (built in train()) never holds them

    # ------------------------------------------------------------------ seams
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        infinite = torch.isinf(rewards)
        if bool(infinite.any()):  # NaN means "no reward" (None); inf would turn every advantage into NaN
            names = [name for name, bad in zip(self.reward_func_names, infinite.any(dim=0).tolist()) if bad]
            raise ValueError(f"reward function(s) {', '.join(names)} returned inf at step {self.state.global_step} "
                             f"({int(infinite.sum())} value(s)); return finite numbers, or None for no reward")
        if self.pipeline.active and self.model.training:  # evaluation runs TRL's own generation
            self._credit_round = {"inputs": inputs, "prompts": prompts, "completions": completions, "rewards": rewards,
                                  "env_columns": _environment_turn_values(self, completions)}
        return rewards

    def _generate_and_score_completions(self, inputs):
        if not self.pipeline.active or not self.model.training:
            return super()._generate_and_score_completions(inputs)
        quota = None
        rounds = []
        kept_groups = extra_tokens = 0
        budget = self.pipeline.max_refill_tokens
        budget_hit = False
        for round_index in range(self.pipeline.max_refill_rounds + 1):
            if round_index:
                if budget is not None and extra_tokens >= budget:
                    budget_hit = True
                    break
                inputs = self.refill_stream.next()
            start = time.perf_counter()
            output = super()._generate_and_score_completions(inputs)
            self._cost("generation_seconds", time.perf_counter() - start)
            batch = self._rollout_batch(output)
            self.pipeline.check_batch(batch)
            if self.pipeline.has("augment_rollouts"):
                output, batch = self._augment(output, batch)
            self.pipeline.shape_rewards(batch)
            self.pipeline.filter_rollouts(batch)
            self.prompt_stats.update(_plain_rows(batch), batch.total_reward(), batch.step)  # every plain rollout
            rounds.append((output, batch))
            if round_index:  # refill's extra tokens (augmented ones are metered apart)
                plain = ~_augmented(batch).to(batch.completion_mask.device)
                extra_tokens += int(batch.completion_mask[plain].sum())
            quota = quota or batch.num_groups
            kept_groups += int(batch.grouped(batch.kept).all(dim=1).sum())
            if kept_groups >= quota or not self.pipeline.max_refill_rounds:
                break
        if len(rounds) > 1:
            if any(out.get("old_per_token_logps") is not None for out, _ in rounds):  # a round trained on source
                for out, _ in rounds:
                    _store_old_logps(self, out)
            output, batch = assemble(self, rounds, refill_choice([b for _, b in rounds], quota))
        return self._finish(output, batch, rounds, extra_tokens, budget_hit)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if "trl_credit_row" in inputs:  # a loss plugin is enabled and this is a training batch
            return self._plugin_loss(model, inputs, return_outputs, num_items_in_batch)
        return self._trl_loss(model, inputs, return_outputs, num_items_in_batch)

    def _trl_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss, with this batch's ``beta`` (kl_coefficient) and the non-dilution factor (filters)."""
        beta = inputs.get("trl_credit_beta")
        if beta is None:
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        else:  # a kl_coefficient plugin chose this batch's beta
            config_beta, self.beta = self.beta, float(beta)
            try:
                loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            finally:
                self.beta = config_beta
        kept = inputs.get("trl_credit_kept")
        if kept is not None and self.loss_type in PER_SEQUENCE_LOSSES:
            # dropped rows add 0 to the row-mean; rescale so the mean runs over kept rows only
            loss = loss * (kept.numel() / kept.sum().clamp(min=1))
        return loss

    def _plugin_loss(self, model, inputs, return_outputs, num_items_in_batch):
        """``loss_weights`` -> TRL's loss (weights as its ``tool_mask``, clip bounds as its epsilons) -> ``loss_terms``."""
        view = self._loss_inputs(inputs)
        logged = {name: len(values) for name, values in view.batch.metrics.items()}
        weights = self.pipeline.loss_weights(view) if self.pipeline.has("loss_weights") else None
        run_inputs = {k: v for k, v in inputs.items() if k != "trl_credit_row"}
        epsilons = (self.epsilon_low, self.epsilon_high)
        if weights is not None and weights.token is not None:
            token = weights.token.to(view.mask.device)
            run_inputs["tool_mask"] = token if "tool_mask" not in inputs else inputs["tool_mask"] * token
        if weights is not None and weights.epsilon_low is not None:
            self.epsilon_low = weights.epsilon_low.to(view.mask.device).unsqueeze(1)
        if weights is not None and weights.epsilon_high is not None:
            self.epsilon_high = weights.epsilon_high.to(view.mask.device).unsqueeze(1)
        captured: list = []
        if self.pipeline.has("loss_terms"):  # keep TRL's own log-probs (with grad): no second forward pass
            forward = self._get_per_token_logps_and_entropies

            def keep_logps(*args, **kwargs):
                out = forward(*args, **kwargs)
                captured.append(out)
                return out

            self._get_per_token_logps_and_entropies = keep_logps
        try:
            loss = self._trl_loss(model, run_inputs, return_outputs, num_items_in_batch)
        finally:
            self.epsilon_low, self.epsilon_high = epsilons
            self.__dict__.pop("_get_per_token_logps_and_entropies", None)
        mode = "train" if self.model.training else "eval"
        if captured:
            view.logps, view.entropies = captured[0][0], captured[0][1]
            scale = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            for (key, name), value in self.pipeline.loss_terms(view).items():
                loss = loss + value / scale
                self._metrics[mode][f"trl_credit/{key}/{name}"].append(float(value.detach()))
        for name, values in view.batch.metrics.items():  # what the loss hooks logged (the batch was logged before)
            new = values[logged.get(name, 0):]
            if new:
                self._metrics[mode][f"trl_credit/{name}"].append(sum(new) / len(new))
                del values[logged.get(name, 0):]
        return loss

    def _loss_inputs(self, inputs) -> LossInputs:
        mask = inputs["completion_mask"] if "tool_mask" not in inputs else inputs["completion_mask"] * inputs["tool_mask"]
        num_items = None
        if self.loss_type in ("dapo", "cispo", "vespo"):  # TRL's normaliser, per micro-batch before accumulation
            num_items = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if self.model.training:
                num_items = num_items / self.args.steps_per_generation
        beta = inputs.get("trl_credit_beta")
        return LossInputs(
            batch=self._credit_batch, rows=inputs["trl_credit_row"], prompt_ids=inputs["prompt_ids"],
            prompt_mask=inputs["prompt_mask"], completion_ids=inputs["completion_ids"], mask=mask.float(),
            advantages=inputs["advantages"], old_logps=inputs.get("old_per_token_logps"),
            ref_logps=inputs.get("ref_per_token_logps"), loss_type=self.loss_type,
            epsilon_low=float(self.epsilon_low), epsilon_high=float(self.epsilon_high),
            beta=float(self.beta if beta is None else beta), max_completion_length=self.max_completion_length,
            num_items=num_items, step=self.state.global_step)  # fmt: skip

    def _get_train_sampler(self, dataset=None):
        if self.pipeline.has("prompt_weights"):
            dataset = self.train_dataset if dataset is None else dataset
            self.prompt_stats.prompts_per_batch = self.args.generation_batch_size // self.num_generations
            return CurriculumSampler(
                num_prompts=len(dataset),
                prompts_per_batch=self.prompt_stats.prompts_per_batch,
                mini_repeat_count=self.num_generations,
                repeat_count=self.num_iterations * self.args.steps_per_generation,
                seed=self.args.seed,
                weights_fn=lambda: self.pipeline.prompt_weights(self.prompt_stats, self.state.global_step),
            )
        return super()._get_train_sampler(dataset)

    def create_optimizer(self, *args, **kwargs):
        optimizer = super().create_optimizer(*args, **kwargs)
        if self.pipeline.active and not getattr(optimizer, "_trl_credit_guard", False):
            step = optimizer.step

            def guarded_step(*a, **k):
                if self._credit_skip_update:
                    return None
                return step(*a, **k)

            optimizer.step = guarded_step
            optimizer._trl_credit_guard = True
        return optimizer

    def _save_checkpoint(self, model, trial):
        if self.pipeline.active and self.args.should_save:  # before transformers' files: never a checkpoint without it
            folder = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
            write_state(folder, self.pipeline.state_dict(), self.prompt_stats.state_dict(),
                        self.refill_stream.batches_drawn, self.aux_adapters.state_dict() or None)
        super()._save_checkpoint(model, trial)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None or not self.pipeline.active:
            return
        state = read_state(checkpoint, [p.key for p in self.pipeline.stateful()], adapters=bool(self.aux_adapters))
        if state is None:
            self.accelerator.print(f"[trl-credit] resumed from {checkpoint}: it has no {STATE_FILE}; "
                                   "no plugin keeps state, prompt statistics start empty")
            return
        source = os.path.join(checkpoint, STATE_FILE)
        restored = self.pipeline.load_state_dict(state["plugins"], source)
        try:
            self.prompt_stats.load_state_dict(state["prompt_stats"])
        except (KeyError, RuntimeError, TypeError) as exc:
            raise CheckpointError(f"{source}: the prompt statistics do not fit this training set of "
                                  f"{self.prompt_stats.num_prompts} prompts ({type(exc).__name__}: {exc}); was the "
                                  "dataset changed since the checkpoint?") from None
        self.refill_stream.fast_forward(int(state.get("refill_batches_drawn", 0)))
        adapters = ""
        if self.aux_adapters:
            try:
                kinds = self.aux_adapters.load_state_dict(state.get("adapters") or {}, source)
            except ValueError as exc:
                raise CheckpointError(str(exc)) from None
            adapters = f", the auxiliary adapter(s) {', '.join(peft_name(k) for k in kinds)}"
        self.accelerator.print(
            f"[trl-credit] resumed from {checkpoint}: restored the state of "
            f"{', '.join(restored) if restored else 'no plugin'}, the prompt statistics{adapters} and the refill "
            f"stream ({self.refill_stream.batches_drawn} batches drawn)")

    def _cost(self, name: str, value: float) -> None:
        """Add to this step's ``trl_credit/cost/<name>`` (logged once per step as the step's total)."""
        self._credit_costs[name] = self._credit_costs.get(name, 0.0) + float(value)

    # ------------------------------------------------------------------ batch
    def _rollout_batch(self, output: dict[str, Any]) -> RolloutBatch:
        """The gathered `RolloutBatch` of one round (identical on every rank)."""
        stash = self._credit_round
        local_inputs = stash["inputs"]
        pad_id = self._tokenizer.pad_token_id
        completion_ids = gather_padded(self.accelerator, output["completion_ids"], pad_id)
        completion_mask = gather_padded(self.accelerator, output["completion_mask"], 0)
        skip = {"prompt", "completion", "completion_ids", "image", "images"}
        local_columns = [{k: v for k, v in row.items() if k not in skip} for row in local_inputs]
        for row, recorded in zip(local_columns, stash.get("env_columns") or []):
            clash = sorted(set(recorded) & set(row))
            if clash:
                raise ValueError(f"an environment's turn_values names {clash}, which the dataset already has as "
                                 "column(s); rename the recorded values")
            row.update(recorded)
        rows = gather_object(local_columns)
        keys = list(dict.fromkeys(k for r in rows for k in r))  # environments may record on some rows only
        columns = {k: [r.get(k) for r in rows] for k in keys}
        index = columns.pop(PROMPT_INDEX, None)
        prompt_index = torch.tensor(index if index is not None else [-1] * len(rows), dtype=torch.long)
        batch = RolloutBatch(
            prompts=gather_object(list(stash["prompts"])),
            completions=gather_object(list(stash["completions"])),
            completion_ids=completion_ids,
            completion_mask=completion_mask,
            rewards=stash["rewards"].clone(),
            reward_names=list(self.reward_func_names),
            reward_weights=self.reward_weights.clone().to(torch.float32),
            num_generations=self.num_generations,
            columns=columns,
            prompt_index=prompt_index.to(completion_ids.device),
            step=self.state.global_step,
            args=self.args,
            tokenizer=self._tokenizer,
            tool_mask=gather_padded(self.accelerator, output["tool_mask"], 1) if output.get("tool_mask") is not None
            else None,
            scorer=TrainerScorer(self, output),
        )
        return batch

    def _augment(self, output: dict[str, Any], batch: RolloutBatch) -> tuple[dict[str, Any], RolloutBatch]:
        """The round plus the groups ``augment_rollouts`` plugins asked for, generated and scored by TRL."""
        requests = self.pipeline.augment_rollouts(batch)
        n, g = batch.num_completions, self.num_generations
        for column in (AUGMENTED, SOURCE_PROMPT):
            batch.columns.setdefault(column, [None] * n)
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        usable = min(len(requests), batch.num_groups)
        usable -= usable % world  # every process generates an equal share
        metrics = self._metrics["train"]
        if len(requests) > usable:
            metrics["trl_credit/augment_requests_dropped"].append(float(len(requests) - usable))
        requests = requests[:usable]
        if not requests:
            return output, batch
        share = usable // world
        if any(key in ("image", "images") for key in batch.columns):
            raise NotImplementedError("augment_rollouts does not support image inputs yet")
        rows = []
        for _, request in requests[rank * share:(rank + 1) * share]:
            first = request.group * g
            row = {key: values[first] for key, values in batch.columns.items()}
            row.update({PROMPT_INDEX: int(batch.prompt_index[first]), AUGMENTED: request.context,
                        SOURCE_PROMPT: batch.prompts[first]})
            rows += [{**copy.deepcopy(row), "prompt": copy.deepcopy(request.prompt_of(j))} for j in range(g)]
        if len({isinstance(r["prompt"], str) for r in rows}) > 1:
            raise ValueError("augment_rollouts: this process's requests mix string and chat prompts; TRL renders "
                             "one format per generation call")
        clock = time.perf_counter()
        extra = super()._generate_and_score_completions(rows)  # TRL's generation and reward functions
        self._cost("augment_seconds", time.perf_counter() - clock)
        augmented = self._rollout_batch(extra)
        if any(request.train_on_source for _, request in requests):
            mine = [request for _, request in requests[rank * share:(rank + 1) * share]]
            self._train_on_source(output, extra, [batch.prompts[r.group * g] if r.train_on_source else None
                                                  for r in mine for _ in range(g)])
        replaced = {request.group for _, request in requests if request.replace}
        chosen = [(0, gi) for gi in range(batch.num_groups) if gi not in replaced]
        chosen += [(1, j) for j in range(len(requests))]
        tokens = float(augmented.completion_mask.sum())
        metrics["trl_credit/augmented_groups"].append(float(len(requests)))
        metrics["trl_credit/augmented_tokens"].append(tokens)
        metrics["trl_credit/augmented_ratio"].append(tokens / max(float(batch.completion_mask.sum()), 1.0))
        for key in dict.fromkeys(k for k, _ in requests):
            metrics[f"trl_credit/{key}/augmented_groups"].append(float(sum(k == key for k, _ in requests)))
        output, combined = assemble(self, [(output, batch), (extra, augmented)], chosen)
        for name, values in batch.metrics.items():  # what the augment_rollouts plugins logged on the round
            combined.metrics[name].extend(values)
        return output, combined

    def _train_on_source(self, output: dict[str, Any], extra: dict[str, Any], sources: list) -> None:
        """Augmented rows with a source prompt: old log-probs = what sampled them, prompt ids = the source prompt.

        The extra passes are logged as ``trl_credit/cost/source_logps_seconds`` and ``_sequences``."""
        clock, sequences = time.perf_counter(), 0
        for out in (output, extra):  # the behaviour log-probs, for every row (TRL skips them on-policy)
            _store_old_logps(self, out)
            sequences += out["completion_ids"].shape[0]
        device = extra["prompt_ids"].device
        own = [ids[mask.bool()].tolist() for ids, mask in zip(extra["prompt_ids"], extra["prompt_mask"])]
        swapped = [i for i, source in enumerate(sources) if source is not None]
        for i, ids in zip(swapped, self._tokenize_prompts([sources[i] for i in swapped])[0]):
            own[i] = list(ids)
        width = max(len(ids) for ids in own)
        prompt_ids = torch.full((len(own), width), self._tokenizer.pad_token_id, dtype=torch.long, device=device)
        prompt_mask = torch.zeros((len(own), width), dtype=torch.long, device=device)
        for i, ids in enumerate(own):  # left padding, as TRL pads prompts
            prompt_ids[i, width - len(ids):] = torch.as_tensor(ids, dtype=torch.long, device=device)
            prompt_mask[i, width - len(ids):] = 1
        extra["prompt_ids"], extra["prompt_mask"] = prompt_ids, prompt_mask
        if extra.get("ref_per_token_logps") is not None:  # the KL term, after the source prompt too
            extra["ref_per_token_logps"] = TrainerScorer(self, extra)._forward(use_reference=True)[0].detach()
            sequences += extra["completion_ids"].shape[0]
        self._cost("source_logps_seconds", time.perf_counter() - clock)
        self._cost("source_logps_sequences", float(sequences))

    def _finish(self, output: dict[str, Any], batch: RolloutBatch, rounds: list, extra_tokens: int,
                budget_hit: bool) -> dict[str, Any]:
        advantages = kept_advantages(self.pipeline, batch)
        beta = self.pipeline.kl_coefficient(batch)
        self.pipeline.notify("on_batch_end", batch.step, batch=batch, advantages=advantages)

        kept = batch.kept
        local_n = output["completion_ids"].shape[0]
        rank = self.accelerator.process_index
        local = slice(rank * local_n, (rank + 1) * local_n)
        local_adv = advantages[local]
        if local_adv.dim() == 2:
            local_adv = local_adv[:, : output["completion_ids"].shape[1]]
        output["advantages"] = local_adv.to(output["completion_ids"].device)
        local_kept = kept[local].to(output["completion_ids"].device)
        all_kept = bool(kept.all())
        if not all_kept:
            output["completion_mask"] = output["completion_mask"] * local_kept.unsqueeze(1).to(output["completion_mask"].dtype)
            output["trl_credit_kept"] = local_kept
        # TRL counted the tokens of round 0 as generated; filters, refill and augmentation change them: recount
        # (TRL's own expression, so the count is unchanged when nothing did)
        mask = output["completion_mask"] if "tool_mask" not in output else output["completion_mask"] * output["tool_mask"]
        output["num_items_in_batch"] = self.accelerator.gather(mask.sum()).sum()
        self._credit_skip_update = not bool(kept.any())
        if self.pipeline.has("loss_weights") or self.pipeline.has("loss_terms"):
            self._credit_batch = batch  # the loss hooks read it through `rows`
            output["trl_credit_row"] = torch.arange(local.start, local.stop, device=output["completion_ids"].device)
        if beta is not None:
            if beta > 0 and output.get("ref_per_token_logps") is None:  # TRL skipped it (config beta = 0)
                ref = batch.ref_logps()[local][:, : output["completion_ids"].shape[1]]
                output["ref_per_token_logps"] = ref.to(output["completion_ids"].device)
            output["trl_credit_beta"] = torch.tensor(beta, dtype=torch.float64)  # 0-dim: kept by TRL's split/shuffle
            self._metrics["train"]["trl_credit/beta"].append(beta)
        self._log_round_metrics(batch, rounds, extra_tokens, budget_hit)
        return output

    def _log_round_metrics(self, batch: RolloutBatch, rounds: list, extra_tokens: int, budget_hit: bool) -> None:
        metrics = self._metrics["train"]
        metrics["trl_credit/kept_fraction"].append(batch.kept.float().mean().item())
        if self.pipeline.has("shape_rewards"):  # TRL's `reward` is logged before shaping
            shaped = batch.total_reward()
            metrics["trl_credit/shaped_reward"].append(shaped[batch.kept].nanmean().nan_to_num(0.0).item()
                                                       if batch.kept.any() else 0.0)
        if self.pipeline.has("filter_rollouts"):
            metrics["trl_credit/generation_rounds"].append(float(len(rounds)))
            metrics["trl_credit/extra_tokens"].append(float(extra_tokens))  # completion tokens of rounds 2..
            if self.pipeline.max_refill_tokens is not None:
                metrics["trl_credit/refill_budget_hit"].append(float(budget_hit))
            metrics["trl_credit/skipped_update"].append(float(self._credit_skip_update))
            if self._credit_skip_update:
                self.accelerator.print(
                    f"[trl-credit] step {batch.step}: every completion was filtered out "
                    f"({len(rounds)} generation round(s)); the optimiser step is skipped"
                )
        batches = [b for _, b in rounds] + ([batch] if all(batch is not b for _, b in rounds) else [])
        for b in batches:
            for name, values in b.metrics.items():
                metrics[f"trl_credit/{name}"].append(sum(values) / len(values))
        for name, seconds in self.pipeline.pop_timings().items():
            metrics[name].append(seconds)
        for name, total in self._credit_costs.items():  # the step's extra passes, each summed over its calls
            metrics[f"trl_credit/cost/{name}"].append(total)
        self._credit_costs = {}


class TrainerScorer:
    """No-grad scoring with the trainer's model: local rows computed on each rank, then gathered."""

    def __init__(self, trainer: CreditGRPOTrainer, output: dict[str, Any]):
        self.trainer = trainer
        self.output = output
        self._local: dict[str, torch.Tensor] = {}  # policy log-probs and entropies come from one pass

    def _forward(self, use_reference: bool = False, adapter: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """No-grad log-probs (and entropies) of ``output``'s rows: the policy, the reference, or an adapter kind."""
        t, out = self.trainer, self.output
        input_ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        attention = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        keep = out["completion_ids"].shape[1]
        batch_size = t.args.per_device_train_batch_size
        with torch.no_grad(), disable_gradient_checkpointing(t.model, t.args.gradient_checkpointing_kwargs):
            # a pass TRL did not make (its own old / reference log-probs are reused in `token_scores`): its cost
            kind = adapter[len(KIND_PREFIX):] if adapter is not None else "reference" if use_reference else "policy"
            start = time.perf_counter()
            if adapter is not None:
                with use_adapter(t.accelerator.unwrap_model(t.model), adapter_name=peft_name(adapter)):
                    result = t._get_per_token_logps_and_entropies(t.model, input_ids, attention, keep, batch_size)[:2]
            elif not use_reference:
                result = t._get_per_token_logps_and_entropies(t.model, input_ids, attention, keep, batch_size,
                                                              compute_entropy=True)[:2]
            elif t.ref_model is not None:
                result = t._get_per_token_logps_and_entropies(t.ref_model, input_ids, attention, keep, batch_size)[:2]
            else:
                model = t.accelerator.unwrap_model(t.model)
                if not hasattr(model, "peft_config"):
                    raise RuntimeError(
                        "reference log-probs were asked for, but this run has no reference model: set beta > 0 "
                        "(TRL then loads one) or train a PEFT adapter (the reference is the base with adapters "
                        "disabled)"
                    )
                with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
                    result = t._get_per_token_logps_and_entropies(t.model, input_ids, attention, keep, batch_size)[:2]
            t._cost(f"{kind}_score_seconds", time.perf_counter() - start)
            return result

    def token_scores(self, kind: str) -> torch.Tensor:
        out, acc = self.output, self.trainer.accelerator
        if kind == "policy_logps" and out.get("old_per_token_logps") is not None:
            local = out["old_per_token_logps"]  # TRL computed it with the same weights: reuse
        elif kind == "ref_logps" and out.get("ref_per_token_logps") is not None:
            local = out["ref_per_token_logps"]
        elif kind in self._local:
            local = self._local.pop(kind)
        elif kind.startswith(KIND_PREFIX):
            local = self._forward(adapter=kind)[0]
        else:
            logps, entropies = self._forward(use_reference=(kind == "ref_logps"))
            local = logps
            if kind != "ref_logps":
                self._local = {"policy_logps": logps, "policy_entropies": entropies}
                local = self._local.pop(kind)
        return gather_padded(acc, local.float(), 0.0)

    def continuation_logps(self, prefixes, continuations, model):
        t = self.trainer
        acc = t.accelerator
        tok = t._tokenizer
        world, rank = acc.num_processes, acc.process_index
        mine = list(range(rank, len(prefixes), world))
        results: list[tuple[int, list[float]]] = []
        device = acc.device
        chunk = max(1, t.args.per_device_train_batch_size)
        clock = time.perf_counter()
        for start in range(0, len(mine), chunk):
            idx = mine[start:start + chunk]
            pre = [tok(prefixes[i], add_special_tokens=False)["input_ids"] for i in idx]
            cont = [tok(continuations[i], add_special_tokens=False)["input_ids"] for i in idx]
            seqs = [p + c for p, c in zip(pre, cont)]
            width = max(len(s) for s in seqs)
            keep = max(max(len(c) for c in cont), 1)
            ids = torch.full((len(seqs), width), tok.pad_token_id, dtype=torch.long)
            att = torch.zeros((len(seqs), width), dtype=torch.long)
            for j, s in enumerate(seqs):  # left padding: every continuation ends at the last column
                ids[j, width - len(s):] = torch.tensor(s, dtype=torch.long)
                att[j, width - len(s):] = 1
            scorer = TrainerScorer(t, {"prompt_ids": ids[:, : width - keep].to(device),
                                        "prompt_mask": att[:, : width - keep].to(device),
                                        "completion_ids": ids[:, width - keep:].to(device),
                                        "completion_mask": att[:, width - keep:].to(device)})
            logps, _ = scorer._forward(use_reference=(model == "reference"), adapter=_adapter_kind(model))
            for j, i in enumerate(idx):
                n = len(cont[j])
                results.append((i, logps[j, keep - n:].float().cpu().tolist() if n else []))
        merged = dict(gather_object(results))
        t._cost("continuation_seconds", time.perf_counter() - clock)
        t._cost("continuation_sequences", float(len(prefixes)))
        return [torch.tensor(merged[i], dtype=torch.float32) for i in range(len(prefixes))]


    def completion_logps(self, rows, prompts, model, width):
        """This round's own completion ids under other prompts: each rank scores its local rows, then a sum-reduce."""
        t, out, acc = self.trainer, self.output, self.trainer.accelerator
        local_n = out["completion_ids"].shape[0]
        start = acc.process_index * local_n
        result = torch.zeros(len(rows), width, device=acc.device)
        mine = [j for j, row in enumerate(rows) if start <= row < start + local_n]
        chunk = max(1, t.args.per_device_train_batch_size)
        pad_id = t._tokenizer.pad_token_id
        for begin in range(0, len(mine), chunk):
            idx = mine[begin:begin + chunk]
            ids = t._tokenize_prompts([prompts[j] for j in idx])[0]  # TRL's own prompt rendering
            longest = max(len(x) for x in ids)
            prompt_ids = torch.full((len(idx), longest), pad_id, dtype=torch.long)
            prompt_mask = torch.zeros((len(idx), longest), dtype=torch.long)
            for i, x in enumerate(ids):  # left padding, as TRL pads prompts
                prompt_ids[i, longest - len(x):] = torch.as_tensor(x, dtype=torch.long)
                prompt_mask[i, longest - len(x):] = 1
            local = torch.tensor([rows[j] - start for j in idx], device=out["completion_ids"].device)
            scorer = TrainerScorer(t, {"prompt_ids": prompt_ids.to(acc.device), "prompt_mask": prompt_mask.to(acc.device),
                                       "completion_ids": out["completion_ids"][local],
                                       "completion_mask": out["completion_mask"][local]})
            logps, _ = scorer._forward(use_reference=(model == "reference"), adapter=_adapter_kind(model))
            logps = logps.float() * out["completion_mask"][local].to(logps.device)
            result[torch.tensor(idx, device=result.device), : logps.shape[1]] = logps.to(result.device)
        if acc.num_processes > 1:  # every row is scored by exactly one rank
            result = acc.reduce(result, reduction="sum")
        return list(result.cpu().unbind(0))


    def prefix_logps(self, rows, ends, continuations, model, contexts):
        """Continuations after prompt + completion prefixes: each rank scores the entries of its own rows."""
        t, out, acc = self.trainer, self.output, self.trainer.accelerator
        tok = t._tokenizer
        local_n = out["completion_ids"].shape[0]
        start_row = acc.process_index * local_n
        cont = [tok(text, add_special_tokens=False)["input_ids"] for text in continuations]
        ctx = [tok(text, add_special_tokens=False)["input_ids"] if text else [] for text in contexts]
        longest = max((len(c) for c in cont), default=0)
        result = torch.zeros(len(rows), max(longest, 1), device=acc.device)
        mine = [j for j, row in enumerate(rows) if start_row <= row < start_row + local_n]
        chunk = max(1, t.args.per_device_train_batch_size)
        clock = time.perf_counter()
        for begin in range(0, len(mine), chunk):
            idx = mine[begin:begin + chunk]
            seqs = []
            for j in idx:  # prompt (unpadded) + the first ends[j] sampled completion ids + the continuation
                local = rows[j] - start_row
                prompt = out["prompt_ids"][local][out["prompt_mask"][local].bool()].tolist()
                seqs.append(prompt + out["completion_ids"][local, : ends[j]].tolist() + ctx[j] + cont[j])
            width = max(len(x) for x in seqs)
            keep = max(max(len(cont[j]) for j in idx), 1)
            ids = torch.full((len(seqs), width), tok.pad_token_id, dtype=torch.long)
            att = torch.zeros((len(seqs), width), dtype=torch.long)
            for i, x in enumerate(seqs):  # left padding: every continuation ends at the last column
                ids[i, width - len(x):] = torch.tensor(x, dtype=torch.long)
                att[i, width - len(x):] = 1
            scorer = TrainerScorer(t, {"prompt_ids": ids[:, : width - keep].to(acc.device),
                                       "prompt_mask": att[:, : width - keep].to(acc.device),
                                       "completion_ids": ids[:, width - keep:].to(acc.device),
                                       "completion_mask": att[:, width - keep:].to(acc.device)})
            logps, _ = scorer._forward(use_reference=(model == "reference"), adapter=_adapter_kind(model))
            for i, j in enumerate(idx):
                n = len(cont[j])
                if n:
                    result[j, :n] = logps[i, keep - n:].float().to(result.device)
        if acc.num_processes > 1:  # every entry is scored by exactly one rank
            result = acc.reduce(result, reduction="sum")
        t._cost("prefix_seconds", time.perf_counter() - clock)
        t._cost("prefix_sequences", float(len(rows)))
        return [result[j, : len(cont[j])].cpu() for j in range(len(rows))]

    def soft_values(self, model, temperature):
        """Own forward pass: logits of the completion positions (and the one after), never materialised by TRL."""
        t, out, acc = self.trainer, self.output, self.trainer.accelerator
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        att = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        width = out["completion_ids"].shape[1]
        vocab = int(getattr(t.accelerator.unwrap_model(t.model).config, "vocab_size", 0) or 1)
        chunk = max(1, min(t.args.per_device_train_batch_size, (1 << 27) // max((width + 1) * vocab, 1)))
        unwrapped = acc.unwrap_model(t.model)
        net, context = t.model, _model_for(t, unwrapped, model) if model != "reference" else None
        if model == "reference" and t.ref_model is not None:
            net, context = t.ref_model, contextlib.nullcontext()
        elif model == "reference":
            if not hasattr(unwrapped, "peft_config"):
                raise RuntimeError("soft values of the reference were asked for, but this run has no reference "
                                   "model: set beta > 0 or train a PEFT adapter")
            context = _model_for(t, unwrapped, "reference")
        q_parts, v_parts = [], []
        clock = time.perf_counter()
        with torch.no_grad(), disable_gradient_checkpointing(t.model, t.args.gradient_checkpointing_kwargs), context:
            for begin in range(0, ids.shape[0], chunk):
                rows = slice(begin, begin + chunk)
                logits = net(input_ids=ids[rows], attention_mask=att[rows], logits_to_keep=width + 1).logits
                logits = logits[:, -(width + 1):].float()  # position P-1+t predicts completion token t
                v_parts.append(temperature * torch.logsumexp(logits / temperature, dim=-1))
                q_parts.append(logits[:, :width].gather(-1, out["completion_ids"][rows].unsqueeze(-1)).squeeze(-1))
        t._cost("soft_values_seconds", time.perf_counter() - clock)
        q, v = torch.cat(q_parts), torch.cat(v_parts)
        return gather_padded(acc, q, 0.0).cpu(), gather_padded(acc, v, 0.0).cpu()

    def score_texts(self, rows, inputs, prompts, texts):
        """TRL's ``_calculate_rewards`` (GRPOTrainer's own, not the host's stash) on an equal share per rank."""
        t, acc = self.trainer, self.trainer.accelerator
        if t.environments is not None:  # TRL would pass the rollouts' environments to rewards of other texts
            raise ValueError("score_texts cannot score new texts in an `environment_factory` run: TRL passes the "
                             "rollouts' environments to every reward function, and their state belongs to those "
                             "rollouts; score with a reward function of the text alone, outside the environment")
        world, rank = acc.num_processes, acc.process_index
        m = len(texts)
        padded = list(range(m)) + [m - 1] * (-m % world)  # every rank scores the same count (TRL gathers)
        share = len(padded) // world
        mine = padded[rank * share:(rank + 1) * share]
        conversational = isinstance(prompts[0], list)
        completions = [[{"role": "assistant", "content": texts[j]}] if conversational else texts[j] for j in mine]
        ids = [t._tokenizer(texts[j], add_special_tokens=False)["input_ids"] for j in mine]
        clock = time.perf_counter()
        rewards = GRPOTrainer._calculate_rewards(t, [copy.deepcopy(inputs[j]) for j in mine],
                                                 [prompts[j] for j in mine], completions, ids)
        t._cost("score_texts_seconds", time.perf_counter() - clock)
        return rewards[:m].float().cpu()

    def probe(self, rows, ends, cues, num_samples, max_new_tokens, temperature, top_k, model):
        """Hugging Face sampling after prompt + prefix + cue: each rank its own rows, under a forked random stream."""
        from transformers import GenerationConfig
        from trl.models.utils import unwrap_model_for_generation

        t, out, acc = self.trainer, self.output, self.trainer.accelerator
        tok = t._tokenizer
        local_n = out["completion_ids"].shape[0]
        start_row = acc.process_index * local_n
        s, length, k = num_samples, max_new_tokens, top_k
        m = len(rows)
        tokens = torch.zeros((m, s, length), dtype=torch.long, device=acc.device)  # zeros: summed over ranks
        mask = torch.zeros((m, s, length), dtype=torch.long, device=acc.device)
        logps = torch.zeros((m, s, length), device=acc.device)
        top_ids = torch.zeros((m, s, length, k), dtype=torch.long, device=acc.device)
        top_logps = torch.zeros((m, s, length, k), device=acc.device)
        mine = [j for j, row in enumerate(rows) if start_row <= row < start_row + local_n]
        chunk = max(1, t.args.per_device_train_batch_size // s)
        config = GenerationConfig(do_sample=True, temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=length,
                                  num_return_sequences=s, return_dict_in_generate=True, output_logits=True,
                                  pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        clock = time.perf_counter()
        with torch.random.fork_rng(), unwrap_model_for_generation(
                t.model_wrapped, acc, gradient_checkpointing_kwargs=t.args.gradient_checkpointing_kwargs) as gen, \
                torch.no_grad():
            step, calls = t._credit_probe_calls
            calls = calls + 1 if step == t.state.global_step else 1  # every call of a step: its own stream
            t._credit_probe_calls = (t.state.global_step, calls)
            torch.manual_seed(int(t.args.seed) * 1_000_003 + t.state.global_step * 101 + calls * 7919
                              + acc.process_index)
            for begin in range(0, len(mine), chunk):
                idx = mine[begin:begin + chunk]
                seqs = []
                for j in idx:  # prompt (unpadded) + the first ends[j] sampled ids + the cue
                    local = rows[j] - start_row
                    prompt = out["prompt_ids"][local][out["prompt_mask"][local].bool()].tolist()
                    seqs.append(prompt + out["completion_ids"][local, : ends[j]].tolist()
                                + tok(cues[j], add_special_tokens=False)["input_ids"])
                width = max(len(x) for x in seqs)
                ids = torch.full((len(seqs), width), tok.pad_token_id, dtype=torch.long)
                att = torch.zeros((len(seqs), width), dtype=torch.long)
                for i, x in enumerate(seqs):  # left padding, as TRL generates
                    ids[i, width - len(x):] = torch.tensor(x, dtype=torch.long)
                    att[i, width - len(x):] = 1
                with _model_for(t, gen, model):
                    result = gen.generate(input_ids=ids.to(acc.device), attention_mask=att.to(acc.device),
                                          generation_config=config)
                new = result.sequences[:, width:]  # (B * S, L')
                steps = new.shape[1]
                logp = torch.log_softmax(torch.stack(result.logits, dim=1).float(), dim=-1)  # (B * S, L', V)
                chosen = logp.gather(-1, new.unsqueeze(-1)).squeeze(-1)
                best = logp.topk(min(k, logp.shape[-1]), dim=-1)
                is_eos = new == tok.eos_token_id
                ended = (is_eos.cumsum(1) - is_eos.long()) > 0  # past the first EOS
                valid = ~ended
                target = torch.tensor(idx, device=acc.device)
                shape = (len(idx), s, steps)
                tokens[target, :, :steps] = (new * valid).view(shape)
                mask[target, :, :steps] = valid.long().view(shape)
                logps[target, :, :steps] = (chosen * valid).view(shape)
                top_ids[target, :, :steps, : best.indices.shape[-1]] = best.indices.view(*shape, -1)
                top_logps[target, :, :steps, : best.values.shape[-1]] = best.values.view(*shape, -1)
        if acc.num_processes > 1:  # every entry is sampled by exactly one rank, the others hold zeros
            tokens, mask, logps, top_ids, top_logps = (acc.reduce(x, reduction="sum")
                                                       for x in (tokens, mask, logps, top_ids, top_logps))
        tokens = torch.where(mask.bool(), tokens, tok.pad_token_id)
        t._cost("probe_seconds", time.perf_counter() - clock)
        t._cost("probe_tokens", float(mask.sum()))
        top_logps = torch.where(mask.bool().unsqueeze(-1), top_logps, -float("inf"))
        top_ids = torch.where(mask.bool().unsqueeze(-1), top_ids, -1)
        texts = [[tok.decode(tokens[j, i][mask[j, i].bool()], skip_special_tokens=True) for i in range(s)]
                 for j in range(m)]
        return [{"tokens": tokens[j].cpu(), "mask": mask[j].cpu(), "logps": logps[j].cpu(),
                 "topk_ids": top_ids[j].cpu(), "topk_logps": top_logps[j].cpu(), "texts": texts[j]} for j in range(m)]

    def update_adapter(self, kind, rows, loss_fn, width):
        """One optimiser step of an auxiliary adapter on ``rows`` of the batch: this rank's own rows, with grad."""
        t, out, acc = self.trainer, self.output, self.trainer.accelerator
        local_n = out["completion_ids"].shape[0]
        start_row = acc.process_index * local_n
        mine = [int(r) for r in rows.tolist() if start_row <= int(r) < start_row + local_n]
        chunk = max(1, t.args.per_device_train_batch_size)
        model = acc.unwrap_model(t.model)  # not the DDP wrapper: its reducer knows only the policy's weights

        position = {int(r): j for j, r in enumerate(rows.tolist())}  # root row -> row of the (view) batch
        scores = torch.zeros(len(rows), width, device=acc.device)  # the pre-step log-probs, for the plugin

        def chunks():
            for begin in range(0, len(mine), chunk):
                part = mine[begin:begin + chunk]
                idx = torch.tensor([r - start_row for r in part], device=out["completion_ids"].device)
                ids = torch.cat([out["prompt_ids"][idx], out["completion_ids"][idx]], dim=1)
                att = torch.cat([out["prompt_mask"][idx], out["completion_mask"][idx]], dim=1)
                keep = out["completion_ids"].shape[1]
                with use_adapter(model, adapter_name=peft_name(kind)), torch.enable_grad(), acc.autocast():
                    logps = t._get_per_token_logps_and_entropies(model, ids, att, keep, len(idx))[0]
                    logps = logps.float() * out["completion_mask"][idx].to(logps.dtype)
                    logps = torch.nn.functional.pad(logps, (0, width - logps.shape[1]))
                    scores[torch.tensor([position[r] for r in part], device=scores.device)] = logps.detach().to(scores.device)
                    yield loss_fn(logps, torch.tensor([position[r] for r in part]))  # rows of the batch passed

        def reduce(x):
            return acc.reduce(x, reduction="sum") if acc.num_processes > 1 else x

        result = t.aux_adapters.step(kind, chunks, reduce, len(rows))
        result["logps"] = reduce(scores).cpu()  # every row is computed by exactly one rank
        t._cost(f"{kind[len(KIND_PREFIX):]}_update_seconds", result.pop("seconds"))
        return result


@contextlib.contextmanager
def _score_valid_positions_only(args: Any):
    """On CPU, score only the positions whose label is valid (TRL 1.16 scores them all there).

    TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``) scores only the valid positions on a
    Triton device, and every position elsewhere, so that a compiler (Neuron) sees one tile shape per batch
    size. Eager CPU recompiles nothing, and there the prompt and padding positions were most of the
    training step: each scores against the whole vocabulary, forward and backward. The log-probs are the
    same bit for bit; the gradients are the same up to float summation order (pinned in test_trl_seam.py).
    Left as TRL has it under ``torch_compile``, where the changing shapes would recompile.
    """
    import trl.trainer.utils as trl_utils

    original = trl_utils._use_triton
    if not getattr(args, "torch_compile", False):
        trl_utils._use_triton = lambda device: device.type == "cpu" or original(device)
    try:
        yield
    finally:
        trl_utils._use_triton = original


def _model_for(trainer: CreditGRPOTrainer, model: Any, kind: str):
    """The context that makes ``model`` (a PEFT model or not) run as ``kind``: the policy, the reference, an adapter."""
    if kind == "policy":
        return contextlib.nullcontext()
    if kind == "reference":
        if not hasattr(model, "peft_config"):
            raise RuntimeError("reference probes need a PEFT policy (the reference is the base with adapters off)")
        return use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None)
    return use_adapter(model, adapter_name=peft_name(kind))


def _adapter_kind(model: Any) -> str | None:
    """The adapter kind a scorer's ``model=`` names (``adapter:<plugin>/<name>``), or None."""
    return model if isinstance(model, str) and model.startswith(KIND_PREFIX) else None


class _ObserverCallback(TrainerCallback):
    """Broadcasts the observer hooks and the all-dropped skip notice."""

    def __init__(self, trainer: CreditGRPOTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer.pipeline.notify("on_train_begin", state.global_step, trainer=self.trainer)

    def on_step_end(self, args, state, control, **kwargs):
        if self.trainer.aux_adapters:  # EMA adapters follow the policy after its optimiser step
            self.trainer.aux_adapters.track(state.global_step)
        window = self.trainer._metrics["train"]  # this logging window's values, before TRL averages them
        logs = {k: sum(v) / len(v) for k, v in window.items() if v}
        self.trainer.pipeline.notify("on_step_end", state.global_step, trainer=self.trainer,
                                        step=state.global_step, logs=logs)


def _environment_turn_values(trainer: CreditGRPOTrainer, completions: list) -> list[dict[str, list]] | None:
    """Per local rollout, what its ``environment_factory`` environment recorded in ``turn_values`` (``{name:
    [one value per successful tool call]}``), mapped to the model's turns (`trl_credit.turns.values_per_turn`).
    Read right after the rollout: TRL reuses the instances in later batches."""
    from trl_credit.turns import values_per_turn

    environments = trainer.environments  # TRL: this batch's instances, one per rollout
    if not environments:
        return None
    out = []
    for env, messages, name in zip(environments, completions, trainer._batch_environments):
        recorded = getattr(env, "turn_values", None) or {}
        owner = type(env).__name__
        if not isinstance(recorded, dict) or not all(isinstance(k, str) and isinstance(v, (list, tuple))
                                                     for k, v in recorded.items()):
            raise ValueError(f"{owner}.turn_values must be a dict of name -> list (one value per successful tool "
                             f"call), got {recorded!r:.120}")
        # the environment's methods; one named like a standalone tool replaces it in TRL's tool dict (unless one is
        # async and the other not: TRL keeps them in two dicts and runs the sync one; not mapped here)
        tool_names = {tool.__name__ for tool in trainer._env_tools[name]
                      if not any(tool is own for own in trainer._standalone_tools)}
        out.append(values_per_turn(messages, recorded, tool_names, owner))
    return out


def _store_old_logps(trainer: CreditGRPOTrainer, output: dict[str, Any]) -> None:
    """Give ``output`` the behaviour (old) per-token log-probs where TRL skipped them: one no-grad pass."""
    if output.get("old_per_token_logps") is None:
        output["old_per_token_logps"] = TrainerScorer(trainer, output)._forward(use_reference=False)[0].detach()


def _augmented(batch: RolloutBatch) -> torch.Tensor:
    """``(N,)`` bool: the rows an ``augment_rollouts`` plugin added."""
    marks = batch.columns.get(AUGMENTED) or [None] * batch.num_completions
    return torch.tensor([m is not None for m in marks], dtype=torch.bool, device=batch.prompt_index.device)


def _plain_rows(batch: RolloutBatch) -> torch.Tensor:
    """``batch.prompt_index`` with augmented rows set to -1 (prompt statistics count plain rollouts only)."""
    return torch.where(_augmented(batch), torch.full_like(batch.prompt_index, -1), batch.prompt_index)


def _default_args(kwargs: dict[str, Any]) -> Any:
    """The GRPOConfig TRL builds when none is given (checks need its defaults)."""
    from trl import GRPOConfig

    model = kwargs.get("model")
    name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "model")
    return GRPOConfig(f"{str(name).split('/')[-1]}-GRPO")
