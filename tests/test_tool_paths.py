"""TRL's ``tools`` and ``environment_factory`` multi-turn paths through CreditGRPOTrainer (one process; the
two-process runs are in test_distributed.py): turns, tool calls and failures per turn, per-turn values an
environment recorded, refill, and TRL's own tool metrics as the cross-check."""

from __future__ import annotations

import math

import pytest
import torch

import plugins_for_tests as fx
import scripted_tools as st
from trl_credit import Plugin, hookimpl
from trl_credit.turns import values_per_turn


class SeeTurns(Plugin):
    """Records each finished batch's turns, prompts, tool mask and (when asked) a turn-value column."""

    seen: list = []
    value: str | None = None

    @hookimpl
    def on_batch_end(self, batch, advantages):
        turns = batch.turns()
        values = batch.turn_values(SeeTurns.value) if SeeTurns.value else None
        SeeTurns.seen.append({"turns": turns, "prompts": batch.prompts, "values": values, "ids": batch.completion_ids,
                              "advantages": advantages, "tokenizer": batch.tokenizer})


class MaskCheck(Plugin):
    """Every micro-batch: TRL's loss mask is 0 exactly on the tool replies (so their token advantages do not train)."""

    checks: list = []

    @hookimpl
    def loss_terms(self, loss):
        env = loss.batch.turns().env[loss.rows][:, :loss.mask.shape[1]]
        model = loss.batch.turns().model[loss.rows][:, :loss.mask.shape[1]]
        MaskCheck.checks.append(bool((loss.mask[env] == 0).all() and (loss.mask[model] == 1).all()
                                     and env.any() == (loss.batch.turns().count[loss.rows] > 1).any()))
        return {}


def _trainer(tmp_path, monkeypatch, plugins, **kwargs):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl import GRPOConfig

    from trl_credit.app.data import make_arithmetic
    from trl_credit.testing.tiny import tiny_model_path

    SeeTurns.seen.clear()
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=128, max_steps=2, logging_steps=1, report_to="none", save_strategy="no",
                      use_cpu=True, bf16=False, seed=0, learning_rate=1e-3, disable_tqdm=True)
    return st.ScriptedToolTrainer(model=tiny_model_path(), args=args, train_dataset=make_arithmetic(64, seed=1),
                                  processing_class=st.chatml_tool_tokenizer(), plugins=plugins, **kwargs)


def _check_turns(record):
    turns, tok = record["turns"], record["tokenizer"]
    for i, prompt in enumerate(record["prompts"]):
        calls, failures = st.expected_turns(st.conversation_text(prompt))
        k = len(calls)
        assert int(turns.count[i]) == k and int(turns.replies[i]) == k - 1
        assert turns.calls[i, :k].tolist() == calls and turns.failures[i, :k].tolist() == failures
        assert int(turns.calls[i, k:].sum()) == 0
        replies = tok.decode(record["ids"][i][turns.env[i]])
        assert replies.count("<tool_response>") == k - 1  # the environment's tokens are TRL's tool replies
        if k == 3:
            assert "Tool subtract not found" in replies and "\n5\n" in replies  # the failure, then add's result


@pytest.mark.parametrize("with_refill", [False, True])
def test_tools_path_exposes_turns_calls_and_failures(tmp_path, monkeypatch, with_refill):
    MaskCheck.checks.clear()
    plugins = [SeeTurns, fx.TokenCredit, MaskCheck] + ([{"name": fx.DropConstant, "max_refill_rounds": 2}] if with_refill else [])
    SeeTurns.value = None
    trainer = _trainer(tmp_path, monkeypatch, plugins, reward_funcs=[st.digit_reward], tools=[st.add])
    trainer.train()
    assert len(SeeTurns.seen) == 2
    for record in SeeTurns.seen:
        _check_turns(record)
        turns = record["turns"]
        assert set(turns.count.tolist()) <= {1, 2, 3} and turns.count.max() > 1
        assert record["advantages"][turns.env].any()  # TokenCredit spreads credit over every token...
    assert MaskCheck.checks and all(MaskCheck.checks)  # ...and the loss never sees it on the tool replies
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2 and all(math.isfinite(h["loss"]) for h in logged)
    if with_refill:
        assert all(h["trl_credit/kept_fraction"] > 0 for h in logged)
    else:  # TRL's own tool metrics agree with the per-turn counts (one round per step)
        for record, h in zip(SeeTurns.seen, logged):
            calls, failures = record["turns"].calls.sum(), record["turns"].failures.sum()
            assert h["tools/call_frequency"] == pytest.approx(float(calls) / record["turns"].count.numel())
            assert h["tools/failure_frequency"] == pytest.approx(float(failures) / float(calls))


def test_environment_factory_path_maps_recorded_values_to_turns(tmp_path, monkeypatch):
    SeeTurns.value = "total"
    trainer = _trainer(tmp_path, monkeypatch, [SeeTurns], reward_funcs=[st.env_reward],
                       environment_factory=st.AddEnvironment)
    trainer.train()
    for name in ("environments", "_batch_environments", "_env_tools", "_standalone_tools"):  # TRL names the host reads
        assert hasattr(trainer, name), f"TRL's GRPOTrainer no longer has {name} (read by trl_credit/trainer.py)"
    SeeTurns.value = None
    for record in SeeTurns.seen:
        _check_turns(record)
        for i, prompt in enumerate(record["prompts"]):
            plan = st.plan_of(st.conversation_text(prompt))
            expected = {0: [math.nan], 1: [5.0, math.nan], 2: [math.nan, 5.0, math.nan]}[plan]
            row = record["values"][i, :len(expected)].tolist()
            assert all((math.isnan(e) and math.isnan(v)) or e == v for e, v in zip(expected, row)), (plan, row)
            assert torch.isnan(record["values"][i, len(expected):]).all()


class RescoresTexts(Plugin):
    """Asks for the run's rewards of a new text (as a probe-answer plugin does)."""

    @hookimpl
    def on_batch_end(self, batch, advantages):
        batch.score_texts([0], ["5"])


def test_score_texts_in_an_environment_run_is_refused_by_name(tmp_path, monkeypatch):
    """TRL passes the rollouts' environments to every reward function; scoring other texts with them would read
    the rollouts' state (or fail on the count), so the host refuses and says why, naming plugin and hook."""
    from trl_credit.pipeline import PluginRuntimeError

    trainer = _trainer(tmp_path, monkeypatch, [RescoresTexts], reward_funcs=[st.env_reward],
                       environment_factory=st.AddEnvironment)
    with pytest.raises(PluginRuntimeError, match=r"(?s)rescores_texts.*on_batch_end.*cannot score new texts in an "
                                                 r"`environment_factory` run"):
        trainer.train()


def test_an_environment_method_named_like_a_standalone_tool_is_the_environments():
    """TRL's tool dict takes the environment's method over a standalone tool of the same name (it runs), so its
    calls' values are the environment's."""
    from types import SimpleNamespace

    from trl_credit.trainer import _environment_turn_values

    env = st.AddEnvironment()
    env.reset()
    env.add(2, 3)
    trainer = SimpleNamespace(environments=[env], _batch_environments=[None], _standalone_tools=[st.add],
                              _env_tools={None: [st.add, env.add]})
    messages = [{"role": "assistant", "tool_calls": [{}]}, {"role": "tool", "name": "add", "content": "5"},
                {"role": "assistant", "content": "5"}]
    assert _environment_turn_values(trainer, [messages]) == [{"total": [5, None]}]


def test_values_per_turn_follows_successful_calls_and_names_the_rule():
    messages = [{"role": "assistant", "tool_calls": [{}, {}]},
                {"role": "tool", "name": "move", "content": "ok"}, {"role": "tool", "name": "look", "content": "x"},
                {"role": "assistant", "tool_calls": [{}]},
                {"role": "tool", "name": "move", "content": "{'error': 'wall'}"},
                {"role": "assistant", "tool_calls": [{}]}, {"role": "tool", "name": "move", "content": "ok"},
                {"role": "assistant", "content": "done"}]
    # look is a standalone tool, not the environment's: only move's successes count, the turn keeps its last
    assert values_per_turn(messages, {"pos": [3, 4]}, {"move"}) == {"pos": [3, None, 4, None]}
    with pytest.raises(ValueError, match=r"Maze.turn_values\['pos'\] holds 3 value\(s\) for 2 successful"):
        values_per_turn(messages, {"pos": [3, 4, 5]}, {"move"}, "Maze")


def test_values_of_calls_trl_rolled_back_are_left_out():
    """TRL runs a turn's calls, then drops their replies when they would overrun ``max_completion_length``: the
    last turn's calls have no ``tool`` message, and what they recorded (at most one value per call) is left out."""
    messages = [{"role": "assistant", "tool_calls": [{}]}, {"role": "tool", "name": "move", "content": "ok"},
                {"role": "assistant", "tool_calls": [{}, {}]}]
    assert values_per_turn(messages, {"pos": [3, 4]}, {"move"}) == {"pos": [3, None]}
    assert values_per_turn(messages, {"pos": [3, 4, 5]}, {"move"}) == {"pos": [3, None]}
    with pytest.raises(ValueError, match=r"holds 4 value\(s\) for 1 successful"):
        values_per_turn(messages, {"pos": [3, 4, 5, 6]}, {"move"})
    answered = messages[:2] + [{"role": "assistant", "content": "done"}]  # no unanswered call: exact count
    with pytest.raises(ValueError, match=r"holds 2 value\(s\) for 1 successful"):
        values_per_turn(answered, {"pos": [3, 4]}, {"move"})


def test_turn_values_of_a_masked_truncated_row_stay_nan():
    """``mask_truncated_completions`` zeroes a truncated row's masks (no model turn left); its recorded values
    are not an error, and the row reads NaN."""
    from trl_credit.testing import make_batch

    batch = make_batch([1, 0], 2, completion_ids=[[5] * 6] * 2, completion_mask=[[0] * 6, [1] * 6],
                       tool_mask=[[0] * 6, [1] * 6], columns={"progress": [[1.0, 2.0], [3.0]]})
    values = batch.turn_values("progress")
    assert torch.isnan(values[0]).all() and values[1, 0] == 3.0


def test_turn_values_reads_a_rollout_column_and_refuses_too_many():
    from trl_credit.testing import make_batch

    mask, tool = [[1] * 6, [1] * 6], [[1, 1, 0, 1, 0, 1], [1] * 6]
    batch = make_batch([1, 0], 2, completion_ids=[[5] * 6] * 2, completion_mask=mask, tool_mask=tool,
                       columns={"progress": [[0.5, None, 1.0], [2.0]]})
    values = batch.turn_values("progress")
    assert values.shape == (2, 3) and values[0, 0] == 0.5 and math.isnan(values[0, 1]) and values[0, 2] == 1.0
    assert values[1, 0] == 2.0 and torch.isnan(values[1, 1:]).all()
    bad = make_batch([1, 0], 2, completion_ids=[[5] * 6] * 2, completion_mask=mask, tool_mask=tool,
                     columns={"progress": [[0.5], [1.0, 2.0]]})
    with pytest.raises(ValueError, match=r"row 1 has 2 values for 1 model turn"):
        bad.turn_values("progress")
