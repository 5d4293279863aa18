"""The TRL seam on a tiny model: parity with GRPOTrainer, filtering, refill, scorers, state, curricula."""

from __future__ import annotations

import copy
import zlib

import pytest
import torch
from trl import GRPOTrainer

import plugins_for_tests as fx
from trl_credit.builtin import grpo_advantages
from trl_credit.pipeline import PluginRuntimeError
from trl_credit.checkpoint import STATE_FILE


def _h(completion) -> int:
    text = completion[-1]["content"] if isinstance(completion, list) else completion
    return zlib.crc32(text.encode())


def parity_reward(completions, **kwargs):
    return [float(_h(c) % 5) / 4 for c in completions]


def sometimes_none(completions, **kwargs):
    return [None if _h(c) % 3 == 0 else float(_h(c) % 2) for c in completions]


def often_none(completions, **kwargs):
    return [None if _h(c) % 3 in (0, 1) else 1.0 for c in completions]


def generation_inputs(dataset, prompts=3, g=4):
    return [copy.deepcopy(dataset[i // g]) for i in range(prompts * g)]


def both_paths(trainer, inputs, seed=0):
    """(ours, TRL's) outputs of _generate_and_score_completions on the same samples."""
    trainer.model.train()
    torch.manual_seed(seed)
    ours = trainer._generate_and_score_completions(copy.deepcopy(inputs))
    torch.manual_seed(seed)
    theirs = GRPOTrainer._generate_and_score_completions(trainer, copy.deepcopy(inputs))
    assert torch.equal(ours["completion_ids"], theirs["completion_ids"])
    return ours, theirs


def loss(trainer, inputs, cls=None):
    trainer.current_gradient_accumulation_steps = 1
    fn = (cls or type(trainer)).compute_loss
    return fn(trainer, trainer.model, inputs)


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_host_pipeline_reproduces_trl_advantages_and_loss(make_trainer, arithmetic, aggregation, scale):
    trainer = make_trainer(plugins=[fx.Passthrough], reward_funcs=[parity_reward, sometimes_none, often_none],
                           per_device_train_batch_size=12, multi_objective_aggregation=aggregation,
                           scale_rewards=scale)
    ours, theirs = both_paths(trainer, generation_inputs(arithmetic))
    assert trainer.credit_plugins.plugins[0].instance.batches == 1  # the pipeline really ran
    rewards = trainer._credit_round["rewards"]
    assert torch.isnan(rewards).any(), "the fixture should produce None rewards"
    assert torch.equal(ours["advantages"], theirs["advantages"])
    assert "trl_credit_kept" not in ours
    assert torch.equal(loss(trainer, ours), loss(trainer, theirs, GRPOTrainer))


def test_no_plugins_is_trl_untouched(make_trainer, arithmetic):
    trainer = make_trainer(plugins=None, reward_funcs=[parity_reward])
    assert not trainer.pipeline.active
    ours, theirs = both_paths(trainer, generation_inputs(arithmetic, prompts=2))
    assert ours.keys() == theirs.keys() and torch.equal(ours["advantages"], theirs["advantages"])
    assert trainer._credit_round == {}


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "bnpo"])
def test_dropped_groups_add_nothing_and_do_not_dilute(make_trainer, arithmetic, loss_type):
    trainer = make_trainer(plugins=[fx.DropFirstGroup], reward_funcs=[parity_reward], loss_type=loss_type)
    ours, theirs = both_paths(trainer, generation_inputs(arithmetic, prompts=2))
    assert ours["trl_credit_kept"].tolist() == [False] * 4 + [True] * 4
    assert torch.all(ours["advantages"][:4] == 0) and torch.all(ours["completion_mask"][:4] == 0)
    assert torch.equal(ours["advantages"][4:], theirs["advantages"][4:])  # group-normalised: unchanged
    kept_only = {k: (v[4:] if isinstance(v, torch.Tensor) and v.dim() else v) for k, v in theirs.items()}
    kept_only["num_items_in_batch"] = theirs["completion_mask"][4:].sum()
    assert ours["num_items_in_batch"] == kept_only["num_items_in_batch"]
    torch.testing.assert_close(loss(trainer, ours), loss(trainer, kept_only, GRPOTrainer), rtol=1e-6, atol=1e-7)
    assert trainer._metrics["train"]["trl_credit/kept_fraction"][-1] == 0.5


class DropAllAfterFirstStep:
    """Keeps everything at step 0, drops everything later."""

    from trl_credit import hookimpl

    @hookimpl
    def filter_rollouts(self, batch):
        return torch.full((batch.num_groups,), batch.step == 0)


def test_all_dropped_batch_skips_the_optimizer_step_and_says_so(make_trainer, capsys):
    from transformers import TrainerCallback

    snapshots = {}

    class Snap(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            snapshots[state.global_step] = [p.detach().clone() for p in model.parameters()]

    trainer = make_trainer(plugins=[DropAllAfterFirstStep], reward_funcs=[parity_reward], max_steps=2)
    initial = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.add_callback(Snap())
    trainer.train()
    assert any(not torch.equal(a, b) for a, b in zip(initial, snapshots[1])), "step 1 trains"
    final = [p.detach() for p in trainer.model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(snapshots[1], final)), \
        "an all-dropped batch must not move the weights (AdamW momentum would)"
    logs = [h for h in trainer.state.log_history if "trl_credit/skipped_update" in h]
    assert [h["trl_credit/skipped_update"] for h in logs] == [0.0, 1.0]
    assert "every completion was filtered out" in capsys.readouterr().out


def prompt_gated_reward(completions, trl_credit_prompt_index, **kwargs):
    """Constant for most prompts; varies with the completion for prompts whose index is divisible by 8."""
    return [float(_h(c) % 2) if i % 8 == 0 else 1.0 for c, i in zip(completions, trl_credit_prompt_index)]


def test_refill_tops_up_kept_groups_and_logs_rounds(make_trainer, arithmetic):
    seen = []

    class Record(fx.Passthrough):
        from trl_credit import hookimpl

        @hookimpl
        def on_batch_end(self, batch, advantages):
            seen.append((batch.rewards.clone(), batch.kept.clone(), advantages.clone(), batch.prompt_index.clone()))
            batch.log_metric("kept_rows", float(batch.kept.sum()), plugin=self)  # logged on the assembled batch after refill

    trainer = make_trainer(plugins=[{"name": fx.DropConstant, "max_refill_rounds": 6}, Record],
                           reward_funcs=[prompt_gated_reward], max_steps=3)
    trainer.train()
    metrics = [h for h in trainer.state.log_history if "trl_credit/generation_rounds" in h]
    rounds = [h["trl_credit/generation_rounds"] for h in metrics]
    assert len(rounds) == 3 and max(rounds) > 1
    for h in metrics:
        if h["trl_credit/generation_rounds"] > 1:
            assert h["trl_credit/extra_tokens"] > 0
        # an observer's metric on the final (assembled) batch is reported, refill or not
        assert h["trl_credit/record/kept_rows"] == pytest.approx(8 * h["trl_credit/kept_fraction"])
        if h["trl_credit/kept_fraction"] < 1:
            assert h["trl_credit/generation_rounds"] == 7  # only when the rounds ran out
    for rewards, kept, advantages, prompt_index in seen:
        assert rewards.shape[0] == 8  # the quota: as many groups as one round had
        rows = kept.nonzero().squeeze(1)
        expected = grpo_advantages(rewards[rows], torch.ones(1), 4, "group", "sum_then_normalize")
        torch.testing.assert_close(advantages[rows], expected)
        assert torch.all(advantages[~kept] == 0)
        assert all(int(i) % 8 == 0 for i in prompt_index[rows])  # only non-constant prompts survive


def test_plugin_failure_stops_the_run_with_name_and_step(make_trainer):
    trainer = make_trainer(plugins=[fx.Raises], reward_funcs=[parity_reward])
    with pytest.raises(PluginRuntimeError, match=r"plugin 'raises' raised in shape_rewards at step 0: ZeroDivisionError"):
        trainer.train()


def test_wrong_shape_stops_the_run(make_trainer):
    trainer = make_trainer(plugins=[fx.Broken], reward_funcs=[parity_reward])
    with pytest.raises(PluginRuntimeError, match=r"'broken' returned advantages of shape \(9,\)"):
        trainer.train()


def test_token_level_advantages_reach_the_loss(make_trainer, arithmetic):
    trainer = make_trainer(plugins=[fx.TokenCredit], reward_funcs=[parity_reward], loss_type="grpo")
    ours, theirs = both_paths(trainer, generation_inputs(arithmetic, prompts=2))
    positions = torch.arange(1, ours["completion_ids"].shape[1] + 1)
    expected = theirs["advantages"].unsqueeze(1) * positions * theirs["completion_mask"]
    torch.testing.assert_close(ours["advantages"], expected)
    assert torch.isfinite(loss(trainer, ours))


def test_plugin_metrics_and_timings_are_logged_under_its_name(make_trainer):
    trainer = make_trainer(plugins=[fx.DropFirstGroup], reward_funcs=[parity_reward], max_steps=1)
    trainer.train()
    logged = trainer.state.log_history[0]
    assert logged["trl_credit/drop_first_group/kept_fraction"] == 0.5
    assert logged["trl_credit/drop_first_group/seconds"] >= 0
    assert logged["trl_credit/grpo/seconds"] >= 0


def _count_scoring_passes(trainer):
    calls = []
    original = trainer._get_per_token_logps_and_entropies

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    trainer._get_per_token_logps_and_entropies = counted
    return calls


def test_nothing_is_scored_unless_a_plugin_asks(make_trainer, arithmetic):
    trainer = make_trainer(plugins=[fx.Passthrough, fx.DropFirstGroup], reward_funcs=[parity_reward])
    calls = _count_scoring_passes(trainer)
    trainer.model.train()
    trainer._generate_and_score_completions(generation_inputs(arithmetic, prompts=2))
    assert calls == []
    logged = trainer._metrics["train"]
    assert not [k for k in logged if k.startswith("trl_credit/cost/") and k != "trl_credit/cost/generation_seconds"]


def test_scorers_are_lazy_cached_and_match_the_model(make_trainer, arithmetic):
    from peft import LoraConfig

    trainer = make_trainer(plugins=[fx.Scores], reward_funcs=[parity_reward])
    # a PEFT run: reference = adapters disabled; perturb LoRA B so policy and reference differ
    from peft import get_peft_model

    peft_model = get_peft_model(trainer.model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    trainer.model = peft_model
    calls = _count_scoring_passes(trainer)
    trainer.model.train()
    out = trainer._generate_and_score_completions(generation_inputs(arithmetic, prompts=2))
    seen = trainer.credit_plugins.plugins[0].instance.seen
    assert len(calls) == 3  # policy log-probs + entropies share one pass; reference; continuation
    logged = trainer._metrics["train"]  # every extra pass reports its cost, one value per step
    for name in ("policy_score_seconds", "reference_score_seconds", "continuation_seconds"):
        assert len(logged[f"trl_credit/cost/{name}"]) == 1 and logged[f"trl_credit/cost/{name}"][0] > 0, name

    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
    mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
    width = out["completion_ids"].shape[1]
    with torch.no_grad():
        logps, entropies, _ = GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, peft_model, ids, mask, width, 8, compute_entropy=True)
        with peft_model.disable_adapter():
            ref, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(trainer, peft_model, ids, mask, width, 8)
    m = out["completion_mask"].bool()
    torch.testing.assert_close(seen["policy_logps"][m], logps[m])
    torch.testing.assert_close(seen["policy_entropies"][m], entropies[m])
    torch.testing.assert_close(seen["ref_logps"][m], ref[m])
    assert not torch.allclose(seen["ref_logps"][m], seen["policy_logps"][m])

    tok = trainer._tokenizer
    pre = tok("What is 2 + 2?", add_special_tokens=False)["input_ids"]
    cont = tok(" 4", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = peft_model(torch.tensor([pre + cont])).logits[0, len(pre) - 1:-1]
    expected = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(cont).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(seen["continuation"][0], expected, atol=1e-4, rtol=1e-4)


def test_plugin_state_and_prompt_stats_survive_checkpoint_and_resume(make_trainer, tmp_path):
    trainer = make_trainer(plugins=[fx.Counter], reward_funcs=[parity_reward], max_steps=2,
                           save_strategy="steps", save_steps=2)
    trainer.train()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    state = torch.load(checkpoint / STATE_FILE, weights_only=True)
    assert state["plugins"] == {"counter": {"count": 2}}
    seen_before = trainer.prompt_stats.seen.clone()
    assert seen_before.sum() == 16

    resumed = make_trainer(plugins=[fx.Counter], reward_funcs=[parity_reward], max_steps=3,
                           save_strategy="no")
    printed = []
    resumed.accelerator.print = lambda *a, **k: printed.append(" ".join(map(str, a)))
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert any(f"resumed from {checkpoint}: restored the state of counter" in line for line in printed), printed
    assert resumed.credit_plugins.plugins[0].instance.count == 3
    assert resumed.prompt_stats.seen.sum() == 24
    assert torch.all(resumed.prompt_stats.seen >= seen_before)


def test_curriculum_draws_only_weighted_prompts_deterministically(make_trainer):
    drawn = []

    class Record(fx.Passthrough):
        from trl_credit import hookimpl

        @hookimpl
        def on_batch_end(self, batch, advantages):
            drawn.append(batch.prompt_index.tolist())

    trainer = make_trainer(plugins=[fx.PreferLowIndex, Record], reward_funcs=[parity_reward], max_steps=3)
    trainer.train()
    assert len(drawn) == 3 and all(0 <= i < 8 for batch in drawn for i in batch)
    assert all(len(set(b[k:k + 4])) == 1 for b in drawn for k in (0, 4))  # whole groups
    trainer2 = make_trainer(plugins=[fx.PreferLowIndex, Record], reward_funcs=[parity_reward], max_steps=3)
    drawn_first, drawn[:] = list(drawn), []
    trainer2.train()
    assert drawn == drawn_first


def test_observers_see_training_begin_and_every_step_with_its_metrics(make_trainer):
    events = []

    class Observer:
        """Records observer calls."""

        from trl_credit import hookimpl

        @hookimpl
        def on_train_begin(self, trainer):
            events.append(("begin", trainer.state.global_step))

        @hookimpl
        def on_step_end(self, trainer, step, logs):
            events.append(("step", step, logs.get("trl_credit/kept_fraction")))

    trainer = make_trainer(plugins=[Observer], reward_funcs=[parity_reward], max_steps=2)
    trainer.train()
    assert events == [("begin", 0), ("step", 1, 1.0), ("step", 2, 1.0)]


def test_refilled_batch_counts_only_its_own_tokens(make_trainer, monkeypatch):
    sentinel = torch.tensor(10**6)
    original = GRPOTrainer._generate_and_score_completions

    def marked(self, inputs):  # TRL's count for one round, marked so a stale one is visible
        out = original(self, inputs)
        out["num_items_in_batch"] = sentinel
        return out

    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", marked)
    trainer = make_trainer(plugins=[{"name": fx.DropConstant, "max_refill_rounds": 6}],
                           reward_funcs=[prompt_gated_reward], loss_type="dapo")
    trainer.model.train()
    refilled = 0
    for start in (0, 8, 16):  # prompts 0, 8, 16 vary; 1-7, 9-15 are constant: refill is needed
        inputs = [copy.deepcopy(trainer.train_dataset[start + i // 4]) for i in range(8)]
        out = trainer._generate_and_score_completions(inputs)
        refilled += trainer._metrics["train"]["trl_credit/generation_rounds"][-1] > 1
        assert out["num_items_in_batch"] == out["completion_mask"].sum()
    assert refilled
    # one round, all kept: the recount is TRL's own expression, so it gives TRL's own count
    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", original)
    plain = make_trainer(plugins=[fx.Passthrough], reward_funcs=[prompt_gated_reward], loss_type="dapo")
    plain.model.train()
    inputs = [copy.deepcopy(plain.train_dataset[i // 4]) for i in range(8)]
    torch.manual_seed(0)
    theirs = original(plain, copy.deepcopy(inputs))
    torch.manual_seed(0)
    ours = plain._generate_and_score_completions(inputs)
    assert torch.equal(ours["completion_ids"], theirs["completion_ids"])
    assert ours["num_items_in_batch"] == theirs["num_items_in_batch"] == ours["completion_mask"].sum()


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")


def _move_adapter_off_the_base(trainer):
    """LoRA starts as the identity (B = 0), where KL = 0: give B values so policy != reference."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))


def test_kl_coefficient_plugin_gives_the_loss_trl_computes_with_that_beta(make_trainer, arithmetic):
    trainer = make_trainer(plugins=[{"name": fx.FixedBeta, "beta": 0.05}], reward_funcs=[parity_reward],
                           peft_config=_lora(), beta=0.0)
    _move_adapter_off_the_base(trainer)
    trainer.model.train()
    inputs = generation_inputs(arithmetic, prompts=2)
    torch.manual_seed(0)
    ours = trainer._generate_and_score_completions(copy.deepcopy(inputs))
    assert trainer.beta == 0.0 and float(ours["trl_credit_beta"]) == 0.05
    assert ours["ref_per_token_logps"] is not None  # TRL skipped it (beta 0): the host scored the base model
    trainer.beta = 0.05  # TRL's own path with that beta, on the same samples
    torch.manual_seed(0)
    theirs = GRPOTrainer._generate_and_score_completions(trainer, copy.deepcopy(inputs))
    trainer.beta = 0.0
    assert torch.equal(ours["completion_ids"], theirs["completion_ids"])
    mask = theirs["completion_mask"].bool()
    torch.testing.assert_close(ours["ref_per_token_logps"][mask], theirs["ref_per_token_logps"][mask])
    assert not torch.allclose(ours["ref_per_token_logps"][mask], ours["old_per_token_logps"][mask]
                              if ours.get("old_per_token_logps") is not None else
                              trainer._get_per_token_logps_and_entropies(
                                  trainer.model, torch.cat([ours["prompt_ids"], ours["completion_ids"]], 1),
                                  torch.cat([ours["prompt_mask"], ours["completion_mask"]], 1),
                                  ours["completion_ids"].shape[1])[0].detach()[mask])
    ours_loss = loss(trainer, ours)
    assert trainer.beta == 0.0  # restored after the loss
    trainer.beta = 0.05
    theirs_loss = loss(trainer, theirs, GRPOTrainer)
    trainer.beta = 0.0
    no_kl = loss(trainer, theirs, GRPOTrainer)
    torch.testing.assert_close(ours_loss, theirs_loss)
    assert not torch.allclose(theirs_loss, no_kl)  # the KL term is really in the loss


def test_kl_coefficient_trains_and_logs_beta_and_kl(make_trainer):
    trainer = make_trainer(plugins=[{"name": fx.FixedBeta, "beta": 0.02}], reward_funcs=[parity_reward],
                           peft_config=_lora(), beta=0.0)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "trl_credit/beta" in h]
    assert trainer.state.global_step == 2 and len(logs) == 2
    assert all(h["trl_credit/beta"] == pytest.approx(0.02) and "kl" in h for h in logs)


def test_kl_coefficient_without_a_reference_is_refused_before_the_model_loads(make_trainer):
    from trl_credit.config import ConfigError

    with pytest.raises(ConfigError, match=r"plugins\[0\] \(.*\) sets the KL coefficient.*use_peft"):
        make_trainer(plugins=[fx.FixedBeta], reward_funcs=[parity_reward], beta=0.0)


def test_shaped_reward_is_logged_next_to_trls_unshaped_one(make_trainer):
    trainer = make_trainer(plugins=[{"name": fx.AddBonus, "bonus": 0.25}], reward_funcs=[parity_reward])
    trainer.train()
    rows = [h for h in trainer.state.log_history if "trl_credit/shaped_reward" in h]
    assert len(rows) == 2
    for row in rows:  # TRL's `reward` is the weighted total before shaping; the bonus column adds 0.25
        assert row["trl_credit/shaped_reward"] == pytest.approx(row["reward"] + 0.25, abs=1e-6)


def test_refill_token_budget_stops_new_rounds_and_is_reported(make_trainer):
    """With max_refill_tokens the host starts no refill round once the extra tokens reach the budget."""
    def constant(completions, **kwargs):
        return [1.0] * len(completions)  # every group constant: refill would run all its rounds

    trainer = make_trainer(plugins=[{"name": fx.DropConstant, "max_refill_rounds": 5, "max_refill_tokens": 1}],
                           reward_funcs=[constant], max_steps=2)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "trl_credit/generation_rounds" in h]
    assert [h["trl_credit/generation_rounds"] for h in logs] == [2.0, 2.0]  # round 0 + one refill round
    assert all(h["trl_credit/refill_budget_hit"] == 1.0 and h["trl_credit/extra_tokens"] >= 1 for h in logs)
    unbounded = make_trainer(plugins=[{"name": fx.DropConstant, "max_refill_rounds": 2}], reward_funcs=[constant],
                             max_steps=1)
    unbounded.train()
    log = [h for h in unbounded.state.log_history if "trl_credit/generation_rounds" in h][0]
    assert log["trl_credit/generation_rounds"] == 3.0 and "trl_credit/refill_budget_hit" not in log


def test_resume_with_refill_is_exact(make_trainer, tmp_path):
    """4 uninterrupted steps equal 2 + resume + 2 under refill: same prompts, rewards and losses."""
    from transformers import TrainerCallback

    class StopAt2(TrainerCallback):  # an interruption after the step-2 checkpoint (same LR schedule)
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                control.should_training_stop = True

    def run(out, resume=None, stop=False):
        seen = []

        class Record(fx.Passthrough):
            from trl_credit import hookimpl

            @hookimpl
            def on_batch_end(self, batch, advantages):
                seen.append((batch.step, batch.prompt_index.tolist(), batch.rewards.flatten().tolist()))

        trainer = make_trainer(plugins=[{"name": fx.DropConstant, "max_refill_rounds": 3}, Record],
                               reward_funcs=[prompt_gated_reward], max_steps=4, output_dir=str(tmp_path / out),
                               save_strategy="steps", save_steps=2)
        if stop:
            trainer.add_callback(StopAt2())
        trainer.train(resume_from_checkpoint=resume)
        losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
        return seen, losses, trainer

    full, full_losses, _ = run("full")
    first, first_losses, trainer = run("part", stop=True)
    assert trainer.refill_stream.batches_drawn > 0  # the fixture makes refill happen
    second, second_losses, _ = run("part", resume=str(tmp_path / "part" / "checkpoint-2"))
    assert [s for s, _, _ in first] == [0, 1] and [s for s, _, _ in second] == [2, 3]
    assert first + second == full  # prompts (refill included) and rewards
    assert {**first_losses, **second_losses} == pytest.approx(full_losses, abs=1e-7)


def test_an_infinite_reward_is_reported_with_its_function_name(make_trainer):
    def blows_up(completions, **kwargs):
        return [float("inf")] + [0.0] * (len(completions) - 1)

    trainer = make_trainer(plugins=[fx.Passthrough], reward_funcs=[blows_up], max_steps=1)
    with pytest.raises(ValueError, match=r"reward function\(s\) blows_up returned inf at step 0 \(1 value\(s\)\)"):
        trainer.train()
