"""Turns of multi-turn rollouts: TRL's tool/env mask read into turn spans, counts, lengths and a broadcast."""

from __future__ import annotations

import pytest
import torch

import plugins_for_tests as fx
from trl_credit import Plugin, hookimpl
from trl_credit.testing import make_batch

# two completions of width 10: model 3, env 2, model 2, env 1, model 1, pad 1 / one turn of 4, pad 6
MASK = [[1] * 9 + [0], [1] * 4 + [0] * 6]
TOOL = [[1, 1, 1, 0, 0, 1, 1, 0, 1, 1], [1] * 10]


def test_turns_from_the_tool_mask():
    turns = make_batch([1, 0], 2, completion_mask=MASK, completion_ids=[[5] * 10] * 2, tool_mask=TOOL).turns()
    assert turns.index.tolist() == [[0, 0, 0, -1, -1, 1, 1, -1, 2, -1], [0, 0, 0, 0] + [-1] * 6]
    assert turns.count.tolist() == [3, 1] and turns.replies.tolist() == [2, 0]
    assert turns.lengths.tolist() == [[3, 2, 1], [4, 0, 0]]
    assert turns.env[0].tolist() == [False] * 3 + [True] * 2 + [False] * 2 + [True] + [False] * 2
    values = torch.tensor([[1.0, 2.0, 3.0], [7.0, 8.0, 9.0]])
    assert turns.broadcast(values).tolist() == [[1, 1, 1, 0, 0, 2, 2, 0, 3, 0], [7, 7, 7, 7] + [0] * 6]
    assert turns.last_turn()[0].nonzero().squeeze(1).tolist() == [8]
    with pytest.raises(ValueError, match="expected \\(2, K\\) with K >= 3"):
        turns.broadcast(torch.ones(2, 2))


def test_a_single_turn_batch_is_one_turn_per_completion():
    turns = make_batch([1, 0, 1, 0], 2, lengths=[3, 1, 4, 2]).turns()
    assert turns.count.tolist() == [1, 1, 1, 1] and turns.replies.tolist() == [0, 0, 0, 0]
    assert turns.lengths.squeeze(1).tolist() == [3, 1, 4, 2]


class TurnCredit(Plugin):
    """Per-turn advantages: the sequence advantage times 0.5 ** (turns after this one)."""

    seen: list = []

    @hookimpl
    def transform_advantages(self, batch, advantages):
        turns = batch.turns()
        k = torch.arange(turns.max_turns, device=advantages.device)
        decay = 0.5 ** (turns.count.unsqueeze(1) - 1 - k).clamp(min=0).float()
        TurnCredit.seen.append(turns)
        return turns.broadcast(advantages.unsqueeze(1) * decay)


def _rollout(prompts, trainer):
    """A scripted multi-turn rollout: model 3 tokens, environment reply 2, model 3 (env_mask marks the reply)."""
    tok = trainer.processing_class
    prompt_ids = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
                  for p in prompts]
    completion_ids, env_mask = [], []
    for i, _ in enumerate(prompts):
        first, reply, second = [100 + i % 7, 101, 102], [200, 201], [103, 104 + i % 3, tok.eos_token_id]
        completion_ids.append(first + reply + second)
        env_mask.append([1, 1, 1, 0, 0, 1, 1, 1])
    return {"prompt_ids": [list(p) for p in prompt_ids], "completion_ids": completion_ids,
            "logprobs": [[float("nan")] * len(c) for c in completion_ids], "env_mask": env_mask}


def _second_token(completions, completion_ids, question, **kwargs):
    """Varies within a group (the scripted second turn) when the question's first number is even, else 0."""
    return [float(ids[6] - 104) if int(q.split()[0]) % 2 == 0 else 0.0 for ids, q in zip(completion_ids, question)]


@pytest.mark.parametrize("with_refill", [False, True])
def test_a_rollout_func_with_env_mask_trains_with_turn_credit(monkeypatch, with_refill, tmp_path):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl import GRPOConfig

    from trl_credit.app.data import make_arithmetic
    from trl_credit.testing.tiny import tiny_model_path
    from trl_credit.trainer import CreditGRPOTrainer

    TurnCredit.seen.clear()
    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=8, max_steps=2, logging_steps=1, report_to="none", save_strategy="no",
                      use_cpu=True, bf16=False, seed=0, learning_rate=1e-3, disable_tqdm=True)
    trainer = CreditGRPOTrainer(model=tiny_model_path(), reward_funcs=[_second_token], args=args,
                                train_dataset=make_arithmetic(32, seed=0), rollout_func=_rollout,
                                plugins=[{"name": fx.DropConstant, "max_refill_rounds": 2}, TurnCredit] if with_refill
                                else [TurnCredit])  # fmt: skip
    trainer.train()
    for turns in TurnCredit.seen:  # refill's assembled batches keep the turn structure
        assert turns.count.tolist() == [2] * turns.count.numel() and turns.replies.tolist() == [1] * turns.count.numel()
        assert turns.lengths.tolist() == [[3, 3]] * turns.count.numel()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logged)
    if with_refill:  # constant groups were dropped and refilled, and the kept groups trained
        assert max(h["trl_credit/generation_rounds"] for h in logged) > 1
        assert all(h["trl_credit/kept_fraction"] > 0 for h in logged)


def test_turn_starts_are_where_each_model_turn_begins():
    from trl_credit.turns import turns_of

    mask = torch.ones(2, 8, dtype=torch.long)
    tool = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 1], [0, 1, 1, 0, 1, 1, 1, 1]])
    mask[1, 6:] = 0  # row 1: padding after 6 tokens
    turns = turns_of(mask, tool)
    assert turns.starts().tolist() == [[0, 4, 7], [1, 4, -1]]
    assert turns_of(mask, None).starts().tolist() == [[0], [0]]  # single-turn: one turn from token 0


def test_turn_ends_hold_the_reply_and_cap_the_turns():
    from trl_credit import turn_ends
    from trl_credit.testing import make_batch

    batch = make_batch([1, 0], 2, completion_mask=[[1] * 8, [1, 1, 1, 1, 0, 0, 0, 0]],
                       tool_mask=[[1, 1, 0, 0, 1, 1, 0, 1], [0, 1, 1, 0, 1, 1, 1, 1]])
    assert turn_ends(batch).tolist() == [[4, 7, 8], [4, -1, -1]]  # where the next turn begins; the end last
    assert turn_ends(batch, max_turns=2).tolist() == [[7, 8], [4, -1]]  # row 1 has one turn (1-2)


class NeedsProgress(Plugin):
    """Reads per-turn values the rollout records (a declared per-turn column)."""

    def required_turn_values(self):
        return ["progress"]

    @hookimpl
    def transform_advantages(self, batch, advantages):
        values = batch.turn_values("progress").nan_to_num(0.0) * batch.scorable.unsqueeze(1)  # none to unscored rows
        return batch.turns().broadcast(values) + advantages.unsqueeze(1) * batch.turns().model


def test_a_missing_per_turn_column_is_named_with_plugin_and_step():
    from trl_credit.pipeline import PluginRuntimeError
    from trl_credit.testing import run_plugin

    batch = make_batch([1, 0], 2, completion_mask=MASK, completion_ids=[[5] * 10] * 2, tool_mask=TOOL)
    with pytest.raises(PluginRuntimeError, match=r"plugin 'needs_progress' needs per-turn values \['progress'\] "
                                                 r"\(required_turn_values\), which the rollouts of step 0"):
        run_plugin(NeedsProgress, batch)
    batch.columns["progress"] = [[1.0, 2.0, 3.0], [4.0]]
    out = run_plugin(NeedsProgress, batch).advantages
    grpo = 0.5 / (0.5 ** 0.5 + 1e-4)  # GRPO on rewards [1, 0]: +-0.7070 (TRL's epsilon 1e-4)
    assert out[0, [0, 5, 8]].tolist() == pytest.approx([1 + grpo, 2 + grpo, 3 + grpo])  # plus the turn's value
    assert out[1, 0].item() == pytest.approx(4 - grpo)


def test_declared_rollout_fields_are_checked_before_the_model_loads(tmp_path):
    from trl import GRPOConfig

    from trl_credit.app.guess import GuessRollout, make_guess
    from trl_credit.config import ConfigError
    from trl_credit.testing.tiny import tiny_model_path
    from trl_credit.trainer import CreditGRPOTrainer

    class NeedsDistance(NeedsProgress):
        """Reads the guess game's per-turn distance."""

        def required_turn_values(self):
            return ["guess_distance"]

    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=8,
                      num_generations=4, report_to="none")
    with pytest.raises(ConfigError, match=r"needs per-turn values 'progress', which the rollouts do not record "
                                          r"\(they record: guess_solved, guess_distance, guess_turns\)"):
        CreditGRPOTrainer(model="/nonexistent/model", reward_funcs=[lambda completions, **k: [0.0]], args=args,
                          train_dataset=make_guess(8), rollout_func=GuessRollout(), plugins=[NeedsProgress])
    trainer = CreditGRPOTrainer(model=tiny_model_path(), reward_funcs=[lambda completions, **k: [0.0] * len(completions)],
                                args=args, train_dataset=make_guess(8), rollout_func=GuessRollout(),
                                plugins=[NeedsDistance])
    assert trainer.credit_plugins.plugins[0].members.required_turn_values == ("guess_distance",)


def test_check_plugin_fills_declared_per_turn_columns():
    from trl_credit.testing import check_plugin

    check_plugin(NeedsProgress)  # the kit's edge-case batches get a "progress" list per completion


def test_carry_forward_fills_unrecorded_turns_with_the_last_value():
    from trl_credit import carry_forward

    nan = float("nan")
    values = torch.tensor([[nan, 1.0, nan, 3.0], [2.0, nan, nan, nan], [nan] * 4])
    assert carry_forward(values, 0.0).tolist() == [[0.0, 1.0, 1.0, 3.0], [2.0, 2.0, 2.0, 2.0], [0.0] * 4]
    filled = carry_forward(values)  # NaN until a value is known
    assert torch.isnan(filled[0, 0]) and filled[0, 1:].tolist() == [1.0, 1.0, 3.0] and torch.isnan(filled[2]).all()
    assert carry_forward(torch.zeros(2, 0)).shape == (2, 0)


def test_group_normalise_reads_only_its_pool_and_pools_each_group_apart():
    from trl_credit import group_normalise

    nan = float("nan")
    # per-turn (N=4, K=2), groups of 2: group 0 pools [1, 3, 5] (row 1's second turn is outside, NaN)
    x = torch.tensor([[1.0, 3.0], [5.0, nan], [2.0, 2.0], [nan, 2.0]])
    pool = torch.tensor([[True, True], [True, False], [True, True], [False, True]])
    z = group_normalise(x, pool, 2, "group")
    # mean 3, population sigma sqrt(8/3) = 1.632993 -> (x - 3) / (1.632993 + 1e-6); group 1 is constant: 0
    s = 1.632993 + 1e-6
    torch.testing.assert_close(z, torch.tensor([[-2 / s, 0.0], [2 / s, 0.0], [0.0, 0.0], [0.0, 0.0]]), atol=1e-5, rtol=0)
    assert not torch.isnan(z).any()
    torch.testing.assert_close(group_normalise(x, pool, 2, "mean"),
                               torch.tensor([[-2.0, 0.0], [2.0, 0.0], [0.0, 0.0], [0.0, 0.0]]))
    torch.testing.assert_close(group_normalise(x, pool, 2, "none"),
                               torch.tensor([[1.0, 3.0], [5.0, 0.0], [2.0, 2.0], [0.0, 2.0]]))
    # per completion (N,), an empty pool: all 0
    flat = group_normalise(torch.tensor([nan, 4.0, 1.0, 3.0]), torch.tensor([False, False, True, True]), 2)
    torch.testing.assert_close(flat, torch.tensor([0.0, 0.0, -1.0, 1.0]), atol=1e-5, rtol=0)


def test_scripted_turns_rollout_is_self_consistent():
    """The kit's `ScriptedTurns`: one progress value per model turn of the env mask, ``solved`` when all turns were
    used, and NaN log-probs (TRL's "not scored": the tokens are drawn, not sampled from the model)."""
    from types import SimpleNamespace

    from trl_credit.testing import ScriptedTurns, tiny_tokenizer

    tok = tiny_tokenizer()
    torch.manual_seed(0)
    out = ScriptedTurns(max_turns=3, turn_tokens=3, reply_tokens=2)([[{"role": "user", "content": "hi"}]] * 12,
                                                                    SimpleNamespace(processing_class=tok))
    counts = set()
    for ids, mask, logps, progress, checks, solved in zip(out["completion_ids"], out["env_mask"], out["logprobs"],
                                                          out["turn_progress"], out["turn_checks"], out["solved"]):
        turns = len(progress)
        counts.add(turns)
        assert len(ids) == len(mask) == len(logps) == 3 * turns + 2 * (turns - 1) + 1
        assert mask == ([1] * 3 + [0] * 2) * (turns - 1) + [1] * 3 + [1]
        assert progress == [(k + 1) / 3 for k in range(turns)] and len(checks) == turns
        assert solved == float(turns == 3) and all(x != x for x in logps)
    assert counts == {1, 2, 3}


def test_refill_keeps_the_env_mask_when_only_some_rounds_return_one(tmp_path):
    """A ``rollout_func`` may return ``env_mask`` in one round and not the next. The refilled batch still has
    TRL's ``tool_mask`` for the loss: the round's own where it had one, all ones (every token the model's) where
    not. Before, refill kept only the keys round 0 returned."""
    from trl_credit import Refill
    from trl_credit.testing import ScriptedTurns, scripted_turns_reward, train_tiny

    class SecondCallUnmasked(ScriptedTurns):
        calls = 0

        def __call__(self, prompts, trainer):
            out = super().__call__(prompts, trainer)
            SecondCallUnmasked.calls += 1
            if SecondCallUnmasked.calls == 1:
                del out["env_mask"]
            return out

    class KeepFirstGroup(Plugin):
        """Keeps only group 0 of the step's first generation round and every group after (refill tops up)."""

        rounds = 0

        def refill(self):
            return Refill(max_rounds=1)

        @hookimpl
        def filter_rollouts(self, batch):
            KeepFirstGroup.rounds += 1
            keep = torch.ones(batch.num_groups, dtype=torch.bool)
            keep[1:] = KeepFirstGroup.rounds > 1
            return keep

    trainer = train_tiny([KeepFirstGroup], output_dir=tmp_path, train=False, rollout_func=SecondCallUnmasked(),
                         reward_funcs=[scripted_turns_reward], max_completion_length=32)
    trainer.model.train()
    rows = trainer.train_dataset
    out = trainer._generate_and_score_completions([dict(rows[i // 4]) for i in range(8)])
    assert SecondCallUnmasked.calls == 2 and trainer._metrics["train"]["trl_credit/generation_rounds"] == [2.0]
    # rows 0-3: round 0's kept group (no env mask), rows 4-7: round 1's first group (its own env mask)
    mask, valid = out["tool_mask"], out["completion_mask"].bool()
    assert mask.shape == valid.shape
    assert (mask[:4][valid[:4]] == 1).all()  # every token of the unmasked round is the model's
    assert (mask[4:][valid[4:]] == 0).any()  # round 1's environment replies stay masked
