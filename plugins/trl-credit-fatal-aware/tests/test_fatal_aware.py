"""Fatal-aware masking: methods.md's vector (advantages and loss weights), where masking starts, the clamp sides,
consecutive failures, dropping an all-masked completion, the normaliser under each loss type, edge cases (no
failure, a single-turn batch, one-turn rows beside three-turn rows, NaN rewards, token-level input), option checks,
the contract on a multi-turn batch and real runs through TRL's tool loop (scripted sampling, a failing call)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from trl_credit import ConfigError, LossWeights, Plugin, hookimpl
from trl_credit.testing import (check_plugin, loss_inputs, make_batch, run_loss, run_plugin, tiny_dataset,
                                tiny_model_path)
from trl_credit_fatal_aware import FatalAware, clamp_prefix, fatal_turn, post_failure_mask


def call(name="add"):
    return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": name,
                                                                                              "arguments": {}}}]}


OK = {"role": "tool", "name": "add", "content": "5"}
ERROR = {"role": "tool", "name": "add", "content": "{'error': 'Tool subtract not found'}"}  # TRL's failed call
ANSWER = {"role": "assistant", "content": "7"}


def vector_batch(rewards=(0.0, 1.6), **kw):
    """methods.md 2.22: T = 6, the failing call's turn starts at t = 3 (row 0: turn 0 = tokens 0-1 with a call that
    succeeds, its reply at 2, turn 1 = tokens 3-5 with a call that fails). Row 1 answers at once (one turn).
    Rewards [0, 1.6] with scale_rewards none give A = [-0.8, +0.8]."""
    completions = [[call(), OK, call(), ERROR], [ANSWER]]
    return make_batch(list(rewards), 2, completion_ids=[[5] * 6] * 2, completion_mask=[[1] * 6] * 2,
                      tool_mask=[[1, 1, 0, 1, 1, 1], [1] * 6], completions=completions, scale_rewards="none", **kw)


def test_methods_vector_advantages_and_loss_weights():
    batch = vector_batch()
    assert batch.turns().failures.tolist() == [[0, 1], [0, 0]]
    result = run_plugin(FatalAware, batch, {})
    # row 0: tokens 0-2 kept with max(-0.8, 0) = 0, tokens 3-5 masked (advantage 0); row 1 (no failure) untouched
    assert result.advantages[0].tolist() == [0.0] * 6
    torch.testing.assert_close(result.advantages[1], torch.full((6,), 0.8))
    assert result.keep.all()
    assert result.metrics["fatal_aware/fatal_fraction"] == 0.5
    assert result.metrics["fatal_aware/masked_token_fraction"] == pytest.approx(3 / 11)  # of 11 model tokens
    assert result.metrics["fatal_aware/clamped_token_fraction"] == pytest.approx(2 / 11)
    # the loss: the masked tokens get weight 0 (they do not train); under grpo the weight is exactly the keep mask
    weights = run_loss(FatalAware, loss_inputs(batch, result.advantages, loss_type="grpo"), {}).weights
    assert weights.token.tolist() == [[1, 1, 1, 0, 0, 0], [1] * 6]
    effective = (batch.completion_mask * batch.tool_mask * weights.token).tolist()
    assert effective == [[1, 1, 0, 0, 0, 0], [1] * 6]  # TRL's tool mask already drops the reply at t = 2


def test_clamp_sides_and_where_masking_starts():
    nonpos = run_plugin(FatalAware, vector_batch(), {"clamp": "nonpos"}).advantages
    torch.testing.assert_close(nonpos[0], torch.tensor([-0.8, -0.8, -0.8, 0, 0, 0]))
    # a failing trajectory with A = +0.8: nonneg keeps it, nonpos zeroes it, none keeps it
    flipped = dict(rewards=(1.6, 0.0))
    assert run_plugin(FatalAware, vector_batch(**flipped), {}).advantages[0].tolist() == pytest.approx(
        [0.8, 0.8, 0.8, 0, 0, 0])
    assert run_plugin(FatalAware, vector_batch(**flipped), {"clamp": "nonpos"}).advantages[0].tolist() == [0.0] * 6
    none = run_plugin(FatalAware, vector_batch(), {"clamp": "none"}).advantages
    torch.testing.assert_close(none[0], torch.tensor([-0.8, -0.8, -0.8, 0, 0, 0]))
    # after_failing_turn: the failing turn is kept; masked from just past it (nothing here: it ends the completion)
    after = run_plugin(FatalAware, vector_batch(), {"mask_from": "after_failing_turn"}).advantages
    assert after[0].tolist() == [0.0] * 6  # all kept, clamped to max(-0.8, 0)
    assert run_loss(FatalAware, loss_inputs(vector_batch(), after), {"mask_from": "after_failing_turn"}).weights is None


def three_turn_batch(rewards=(0.0, 1.6, 0.8, 0.8), **kw):
    """Row 0: turns at 0-1 | 3-4 | 6-7 (replies at 2 and 5), its first call fails, the second succeeds. Row 1: one
    turn. Row 2: three turns whose first two calls fail. Row 3: three turns, no failure. A (scale none, G = 4):
    mean 0.8 -> [-0.8, +0.8, 0, 0]."""
    tool = [[1, 1, 0, 1, 1, 0, 1, 1], [1] * 8, [1, 1, 0, 1, 1, 0, 1, 1], [1, 1, 0, 1, 1, 0, 1, 1]]
    completions = [[call("subtract"), ERROR, call(), OK, ANSWER], [ANSWER], [call(), ERROR, call(), ERROR, ANSWER],
                   [call(), OK, call(), OK, ANSWER]]
    return make_batch(list(rewards), 4, completion_ids=[[5] * 8] * 4, completion_mask=[[1] * 8] * 4, tool_mask=tool,
                      completions=completions, scale_rewards="none", **kw)


def test_one_turn_rows_beside_three_turn_rows_and_the_empty_prefix():
    batch = three_turn_batch()
    assert batch.turns().failures.tolist() == [[1, 0, 0], [0, 0, 0], [1, 1, 0], [0, 0, 0]]
    # failing_turn: rows 0 and 2 fail in their first turn, so no model token is kept: dropped by the host's filter
    result = run_plugin(FatalAware, batch, {})
    assert result.keep.tolist() == [False, True, False, True] and result.metrics["fatal_aware/dropped"] == 0.5
    assert (result.advantages[[0, 2]] == 0).all()
    # no kept row has a fatal failure, so the estimator's (N,) advantages stand; the baseline still counted 0 and 2
    assert result.advantages.dim() == 1 and float(result.advantages[1]) == pytest.approx(0.8)
    # without drop_empty they stay, every token weighted 0
    kept = run_plugin(FatalAware, three_turn_batch(), {"drop_empty": False})
    assert kept.keep.all() and (kept.advantages[[0, 2]] == 0).all()
    weights = run_loss(FatalAware, loss_inputs(three_turn_batch(), kept.advantages), {"drop_empty": False}).weights
    assert (weights.token[[0, 2]] == 0).all() and (weights.token[[1, 3]] > 0).all()
    # after_failing_turn: rows 0 and 2 keep their first turn (tokens 0-1), masked from its reply at t = 2
    after = run_plugin(FatalAware, three_turn_batch(), {"mask_from": "after_failing_turn"})
    assert after.keep.all()
    assert after.advantages[0].tolist() == [0.0] * 8  # max(-0.8, 0) on tokens 0-1, masked after
    loss = loss_inputs(three_turn_batch(), after.advantages, loss_type="grpo")
    token = run_loss(FatalAware, loss, {"mask_from": "after_failing_turn"}).weights.token
    assert token[0].tolist() == [1, 1, 0, 0, 0, 0, 0, 0] and token[2].tolist() == [1, 1, 0, 0, 0, 0, 0, 0]
    assert token[[1, 3]].eq(1).all()


def test_consecutive_failures_before_a_failure_is_fatal():
    failures = torch.tensor([[0, 1, 0, 1, 1, 0], [1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 2, 1]])
    assert fatal_turn(failures, 1).tolist() == [1, 0, -1, 4]
    assert fatal_turn(failures, 2).tolist() == [3, 0, -1, 4]  # the first of the run: where the cascade began
    assert fatal_turn(failures, 3).tolist() == [-1, 0, -1, -1]
    assert fatal_turn(torch.zeros(2, 0, dtype=torch.long)).tolist() == [-1, -1]
    # through the plugin: with min_failures 2 only row 2 (two failing turns in a row) counts, masked from turn 0
    result = run_plugin(FatalAware, three_turn_batch(), {"min_failures": 2, "drop_empty": False})
    torch.testing.assert_close(result.advantages[0], torch.full((8,), -0.8))  # a lone failure: untouched
    assert (result.advantages[2] == 0).all()


def test_the_normaliser_counts_kept_tokens_only():
    batch = vector_batch()
    advantages = run_plugin(FatalAware, batch, {}).advantages
    model = (batch.completion_mask * batch.tool_mask).float()  # TRL's loss mask: 11 tokens, 8 of them kept
    for loss_type, scale in (("dapo", 11 / 8), ("cispo", 11 / 8), ("grpo", 1.0), ("bnpo", 1.0), ("dr_grpo", 1.0)):
        loss = dataclasses.replace(loss_inputs(batch, advantages, loss_type=loss_type), mask=model,
                                   num_items=model.sum())
        result = run_loss(FatalAware, loss, {})
        token = result.weights.token
        assert token[0, 3:].eq(0).all() and token[0, :3].eq(scale).all() and token[1].eq(scale).all()
        assert result.terms == {}
        if loss_type == "dapo":  # TRL's dapo: sum(l * mask * w) / num_items = the mean over the kept tokens
            per_token = torch.arange(12.0).reshape(2, 6)
            kept = model * (token > 0)
            got = loss.aggregate(per_token * token)
            assert float(got) == pytest.approx(float((per_token * kept).sum() / kept.sum()))
    off = run_loss(FatalAware, loss_inputs(batch, advantages, loss_type="dapo"), {"renormalise": False}).weights
    assert off.token.tolist() == [[1, 1, 1, 0, 0, 0], [1] * 6]


def test_no_failure_changes_nothing():
    plain = make_batch([1.0, 0.0], 2, completion_mask=[[1] * 4] * 2, tool_mask=[[1, 0, 1, 1]] * 2,
                       completions=[[call(), OK, ANSWER]] * 2)
    result = run_plugin(FatalAware, plain, {})
    assert result.advantages.dim() == 1  # returned None: the estimator's (N,) advantages stand
    assert run_loss(FatalAware, loss_inputs(plain, result.advantages), {}).weights is None
    single = make_batch([1.0, 0.0, None, 0.5], 2, lengths=[3, 4, 2, 1])  # no tool mask, text completions
    result = run_plugin(FatalAware, single, {})
    assert result.advantages.dim() == 1 and result.metrics["fatal_aware/fatal_fraction"] == 0.0


class TokenAdvantages(Plugin):
    """Turns (N,) advantages into (N, T): -0.5 on each row's first token, the advantage elsewhere."""

    @hookimpl
    def transform_advantages(self, batch, advantages):
        out = advantages.unsqueeze(1).expand(-1, batch.width).clone()
        out[:, 0] = -0.5
        return out


def test_token_level_input_and_nan_rewards():
    a = run_plugin(TokenAdvantages, vector_batch(rewards=(1.6, 0.0)), others=[FatalAware]).advantages
    assert a[0].tolist() == pytest.approx([0.0, 0.8, 0.8, 0, 0, 0])  # max(-0.5, 0) and max(0.8, 0), then masked
    assert a[1].tolist() == pytest.approx([-0.5] + [-0.8] * 5)  # no failure: as the previous transform left it
    nan = run_plugin(FatalAware, vector_batch(rewards=(None, 1.0)), {}).advantages
    assert torch.isfinite(nan).all() and (nan[0] == 0).all()


def test_pieces():
    a = torch.tensor([-1.0, 2.0])
    masked = torch.tensor([[False, True, True], [False, False, False]])
    assert clamp_prefix(a, masked, torch.tensor([True, False])).tolist() == [[0.0, 0.0, 0.0], [2.0, 2.0, 2.0]]
    # a fatal row with nothing masked (its failing turn ends it, after_failing_turn) is clamped all the same
    assert clamp_prefix(a, torch.zeros(2, 3, dtype=torch.bool), torch.tensor([True, True]), "nonpos").tolist() == \
        [[-1.0] * 3, [0.0] * 3]
    batch = three_turn_batch()
    fatal = torch.tensor([1, -1, 2, -1])
    mask = post_failure_mask(batch.turns(), batch.completion_mask, fatal)
    assert mask[0].tolist() == [False] * 3 + [True] * 5 and mask[2].tolist() == [False] * 6 + [True] * 2
    after = post_failure_mask(batch.turns(), batch.completion_mask, fatal, "after_failing_turn")
    assert after[0].tolist() == [False] * 5 + [True] * 3 and not after[2].any()  # turn 2 ends the completion
    assert not mask[[1, 3]].any()


@pytest.mark.parametrize("key, value", [("clamp", "max"), ("mask_from", "failure"), ("min_failures", 0),
                                        ("renormalise", "maybe"), ("min_failure", 2)])
def test_bad_options_are_config_errors(key, value):
    with pytest.raises(ConfigError, match=key):
        run_plugin(FatalAware, vector_batch(), {key: value})


def test_contract():
    check_plugin(FatalAware)
    check_plugin(FatalAware, batches=[vector_batch, three_turn_batch])
    for config in ({"mask_from": "after_failing_turn"}, {"clamp": "nonpos", "drop_empty": False},
                   {"min_failures": 2, "renormalise": False}):
        check_plugin(FatalAware, config, batches=[vector_batch, three_turn_batch])


# ---------------------------------------------------------------------------------- TRL's tool loop, scripted
class Recorded(FatalAware):
    """FatalAware that records each batch's turns and advantages and each micro-batch's loss weights."""

    batches: list = []
    losses: list = []

    @hookimpl
    def loss_weights(self, loss):
        weights = super().loss_weights(loss)
        Recorded.losses.append((loss.batch, loss.rows.clone(), loss.mask.clone(), loss.num_items, loss.loss_type,
                                None if weights is None else weights.token.clone()))
        return weights

    @hookimpl
    def on_batch_end(self, batch, advantages):
        Recorded.batches.append((batch, advantages.clone()))


def scripted_trainer(tmp_path, monkeypatch, options, **grpo):
    """The kit's scripted tool trainer (trl_credit.testing.tools): TRL's own tool loop, where plan 2 calls
    an unknown tool in its first turn (a failure), then `add`, then answers; plan 1 adds, then answers. Each step
    has one group of each."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl_credit.testing import tools as st
    from trl import GRPOConfig

    Recorded.batches.clear()
    Recorded.losses.clear()
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=128, max_steps=2, logging_steps=1, report_to="none", save_strategy="no",
                      use_cpu=True, bf16=False, seed=0, learning_rate=1e-3, disable_tqdm=True, **grpo)
    questions = tiny_dataset(64, seed=1)
    plan = [st.plan_of(st.conversation_text(p)) for p in questions["prompt"]]
    questions = questions.select([plan.index(2), plan.index(1)])  # two prompts: every step draws both
    trainer = st.ScriptedToolTrainer(model=tiny_model_path(), args=args, train_dataset=questions,
                                     processing_class=st.chatml_tool_tokenizer(),
                                     plugins=[{"name": Recorded, **options}], reward_funcs=[st.digit_reward],
                                     tools=[st.add])
    trainer.train()
    return trainer, st


def plans(batch, st):
    return torch.tensor([st.plan_of(st.conversation_text(p)) for p in batch.prompts])


def test_trains_through_trls_tool_loop_masking_after_the_failing_turn(tmp_path, monkeypatch):
    trainer, st = scripted_trainer(tmp_path, monkeypatch, {"mask_from": "after_failing_turn"})
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2 and all(math.isfinite(h["loss"]) for h in logged)
    assert all("trl_credit/fatal_aware/fatal_fraction" in h for h in logged)
    failed_rows = 0
    for batch, advantages in Recorded.batches:
        turns, plan = batch.turns(), plans(batch, st)
        failing = plan == 2
        failed_rows += int(failing.sum())
        assert (turns.failures[:, 0] > 0).eq(failing).all()  # TRL recorded the unknown tool as a failure
        later = turns.index > 0
        assert (advantages[failing.unsqueeze(1) & later] == 0).all()  # masked from the failing turn's reply on
        first = failing.unsqueeze(1) & (turns.index == 0)
        assert (advantages[first] >= 0).all()  # the kept turn is clamped to max(A, 0)
        for i in torch.nonzero(~failing).flatten().tolist():  # the other rows keep GRPO's sequence advantage
            row = advantages[i][turns.model[i]]
            assert torch.allclose(row, row[0].expand_as(row))
    assert failed_rows > 0
    # every micro-batch: the failing rows' later tokens have weight 0, the kept tokens N_loss / N_kept (dapo)
    assert Recorded.losses and all(record[4] == "dapo" for record in Recorded.losses)
    for batch, rows, mask, num_items, _, token in Recorded.losses:
        turns, plan = batch.turns(), plans(batch, st)
        later = (turns.index > 0) & (plan == 2).unsqueeze(1)  # the failing rows' model tokens after turn 0
        width = mask.shape[1]
        assert (token[later[rows][:, :width]] == 0).all()
        loss_mask = (batch.completion_mask * batch.tool_mask).bool()  # TRL's: model tokens of the completions
        n_loss, n_kept = int(loss_mask.sum()), int((loss_mask & ~later).sum())
        assert n_kept < n_loss
        assert float(num_items) * trainer.args.steps_per_generation == pytest.approx(n_loss)  # TRL's normaliser
        kept_tokens = ~later[rows][:, :width] & mask.bool()
        assert token[kept_tokens].unique().tolist() == pytest.approx([n_loss / n_kept])


def test_trains_through_trls_tool_loop_dropping_what_fails_first(tmp_path, monkeypatch):
    trainer, st = scripted_trainer(tmp_path, monkeypatch, {}, loss_type="grpo")
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2 and all(math.isfinite(h["loss"]) for h in logged)
    for (batch, advantages), h in zip(Recorded.batches, logged):
        failing = plans(batch, st) == 2  # fatal in the first turn: nothing kept, so the host drops the row
        assert batch.kept.eq(~failing).all() and (advantages[failing] == 0).all()
        assert h["trl_credit/kept_fraction"] == pytest.approx(1 - float(failing.float().mean()))
    assert any(bool((plans(b, st) == 2).any()) for b, _ in Recorded.batches)
    # no tokens are masked in the kept rows, so the loss hook gives no weights
    assert Recorded.losses and all(record[5] is None for record in Recorded.losses)


def test_loss_weights_type():
    weights = run_loss(FatalAware, loss_inputs(vector_batch(), torch.zeros(2, 6)), {}).weights
    assert isinstance(weights, LossWeights) and weights.epsilon_low is None and weights.epsilon_high is None
