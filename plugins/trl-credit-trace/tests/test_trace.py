"""TRACE: methods.md 2.27's vector (values, TD rewards), the per-token credit on each step's tokens, the
normalisations and the reward-to-go, the scored prefixes (EOS, max_steps, skipped rows), gold-only scoring
after the cue, the check, the contract and a real training run with a LoRA reference."""

from __future__ import annotations

import math

import pytest
import torch
from peft import LoraConfig

from trl_credit import ConfigError, Plugin, hookimpl, step_ends
from trl_credit.testing import check_args, check_plugin, make_batch, run_plugin, tiny_tokenizer, train_tiny
from trl_credit_trace import TRACE, action_rewards, normalise, reward_to_go, state_values

THREE = "1 + 1 = 2\n2 + 2 = 4\n4 + 1 = 5"  # steps end at tokens 8, 16, 23 (the SmolLM2 tokenizer)
VECTOR = [-6.0, -4.0, -4.5, -1.0]  # log pi_ref(y* | s_k), k = 0..3


def test_vector_values_and_td_rewards():
    logp = torch.tensor([VECTOR])
    torch.testing.assert_close(state_values(logp), torch.tensor([[0.0, 2.0, 1.5, 5.0]]))
    r = action_rewards(logp)
    torch.testing.assert_close(r, torch.tensor([[2.0, -0.5, 3.5]]))
    assert r.sum().item() == pytest.approx(5.0)  # telescopes to V(s_K)


def test_normalisations_and_reward_to_go():
    r, valid = torch.tensor([[2.0, -0.5, 3.5]]), torch.ones(1, 3, dtype=torch.bool)
    # scale: RMS = sqrt((4 + 0.25 + 12.25) / 3 + 1e-8) = 2.345208 -> r / (2.345208 + 1e-6)
    torch.testing.assert_close(normalise(r, valid, 1, "scale"), torch.tensor([[0.852803, -0.213201, 1.492404]]),
                               atol=1e-6, rtol=0)
    # group: mu = 5/3, sigma = sqrt(((1/3)^2 + (13/6)^2 + (11/6)^2) / 3 + 1e-8) = 1.649916
    torch.testing.assert_close(normalise(r, valid, 1, "group"), torch.tensor([[0.20203, -1.313198, 1.111167]]),
                               atol=1e-6, rtol=0)
    torch.testing.assert_close(reward_to_go(r), torch.tensor([[5.0, 3.0, 3.5]]))  # V_K - V_k-1
    # a group of two rows, the second with one valid step: the pool is {2, -0.5, 3.5, 1}, RMS sqrt(17.5/4)
    r2 = torch.tensor([[2.0, -0.5, 3.5], [1.0, 0.0, 0.0]])
    valid2 = torch.tensor([[True, True, True], [True, False, False]])
    z = normalise(r2, valid2, 2, "scale")
    assert z[1, 0].item() == pytest.approx(1.0 / (math.sqrt(17.5 / 4 + 1e-8) + 1e-6), abs=1e-6)
    assert z[1, 1:].abs().sum() == 0


def make(texts, rewards, values, *, eos=(), answers=None, cue="\nThe answer is", template=" {answer}", calls=None,
         **kw):
    """A batch of real token ids; the reference scores y* after state k of row i with ``values[i][k]`` (summed
    over y*'s tokens; the host passes the scored text alone: the cue is unscored context)."""
    tok = tiny_tokenizer()
    ids = [tok(t, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if i in eos else [])
           for i, t in enumerate(texts)]
    ends = {}

    def fn(row, end, text, model):
        if calls is not None:
            calls.append((row, end, model))
        k = 0 if end == 0 else sum(e < end for e in ends[row]) + 1  # state index (the EOS-adjusted last end too)
        assert not cue or not text.startswith(cue)  # the cue is context, never scored
        n_gold = len(tok(text, add_special_tokens=False)["input_ids"])
        return [values[row][k] / n_gold] * n_gold

    n = len(texts)
    batch = make_batch(rewards, kw.pop("num_generations", n), completion_ids=ids, completions=texts, tokenizer=tok,
                       columns={"answer": list(answers or ["5"] * n)}, prefix_logps_fn=fn, reward_names=["accuracy"],
                       **kw)
    ends.update({i: [e for e in row if e >= 0] for i, row in enumerate(step_ends(batch).tolist())})
    return batch, ids


def credit(config, *args, others=(), **kw):
    """``(advantages, advantages - outcome advantages, batch)``: the step credit is what coef adds."""
    batch, ids = make(*args, **kw)
    result = run_plugin(TRACE, batch, config, others=others) if others else run_plugin(TRACE, batch, config)
    base_batch, _ = make(*args, **{k: v for k, v in kw.items() if k != "calls"})
    base = run_plugin(TRACE, base_batch, {**config, "coef": 0.0}, others=others) if others else \
        run_plugin(TRACE, base_batch, {**config, "coef": 0.0})
    return result, result.advantages - base.advantages, ids


def test_step_rewards_on_each_steps_tokens_and_the_scored_prefixes():
    calls = []
    result, extra, _ = credit({"normalise": "none", "coef": 1.0}, [THREE], [1.0], [VECTOR], eos=(0,), calls=calls)
    # states: the prompt (0), after "1 + 1 = 2\n" (8), after "2 + 2 = 4\n" (16), the text without its EOS (23)
    assert sorted(calls) == [(0, 0, "reference"), (0, 8, "reference"), (0, 16, "reference"), (0, 23, "reference")]
    expected = torch.tensor([2.0] * 8 + [-0.5] * 8 + [3.5] * 8)  # the EOS (token 23) belongs to the last step
    torch.testing.assert_close(extra[0], expected)
    assert result.metrics["trace/step_reward"] == pytest.approx(5.0 / 3)
    assert result.metrics["trace/final_value"] == pytest.approx(5.0) and result.metrics["trace/steps"] == 3.0
    half = credit({"normalise": "none"}, [THREE], [1.0], [VECTOR], eos=(0,))[1]
    torch.testing.assert_close(half[0], 0.5 * expected)  # the default coef 0.5


def test_default_scale_and_return_credit_and_mean_reduce():
    _, extra, _ = credit({}, [THREE], [1.0], [VECTOR])  # scale, coef 0.5, no EOS: the last state ends at 23
    z = [0.852803, -0.213201, 1.492404]
    torch.testing.assert_close(extra[0], 0.5 * torch.tensor([z[0]] * 8 + [z[1]] * 8 + [z[2]] * 7), atol=1e-6, rtol=0)
    _, ret, _ = credit({"credit": "return", "normalise": "none", "coef": 1.0}, [THREE], [1.0], [VECTOR])
    torch.testing.assert_close(ret[0], torch.tensor([5.0] * 8 + [3.0] * 8 + [3.5] * 7))  # V(s_3) - V(s_k-1)
    # mean: y* = " 5" is two tokens (" ", "5"), so L_k = value / 2 and r = [1, -0.25, 1.75]
    _, mean, _ = credit({"reduce": "mean", "normalise": "none", "coef": 1.0}, [THREE], [1.0], [VECTOR])
    torch.testing.assert_close(mean[0], torch.tensor([1.0] * 8 + [-0.25] * 8 + [1.75] * 7))


def test_outcome_advantage_is_kept_and_the_group_pools_its_steps():
    texts = [THREE, "2 + 3 = 5\n5"]  # three steps, two steps
    values = [VECTOR, [-3.0, -2.0, -1.0]]
    result, extra, ids = credit({}, texts, [1.0, 0.0], values, num_generations=2)
    # pool {2, -0.5, 3.5, 1, 1}: RMS = sqrt((4 + 0.25 + 12.25 + 1 + 1) / 5 + 1e-8) = sqrt(3.7)
    rms = math.sqrt(18.5 / 5 + 1e-8) + 1e-6
    row1 = len(ids[1])
    e1 = step_ends(result.batch)[1, 0].item()
    torch.testing.assert_close(extra[1, :row1], 0.5 * torch.tensor([1.0] * e1 + [1.0] * (row1 - e1)) / rms,
                               atol=1e-6, rtol=0)
    assert extra[1, row1:].abs().sum() == 0  # padding
    outcome = result.advantages - extra
    assert outcome[0, 0] > 0 > outcome[1, 0]  # GRPO's outcome advantage underneath, constant along a row
    assert torch.allclose(outcome[0], outcome[0, :1].expand(outcome.shape[1]))


def test_max_steps_merges_the_first_steps():
    calls = []
    four = "1\n2\n3\n4"  # ends at tokens 2, 4, 6, 7
    values = [[-3.0, None, None, -1.0, 0.0]]  # by state of the uncapped steps: the prompt, after "3\n", the end
    _, extra, _ = credit({"max_steps": 2, "normalise": "none", "coef": 1.0}, [four], [1.0], values, calls=calls)
    assert sorted(calls) == [(0, 0, "reference"), (0, 6, "reference"), (0, 7, "reference")]  # 3 = max_steps + 1
    torch.testing.assert_close(extra[0], torch.tensor([2.0] * 6 + [1.0]))  # steps 1-3 merged: 6 tokens


class DropSecond(Plugin):
    """Keeps every completion but the second."""

    @hookimpl
    def filter_rollouts(self, batch):
        keep = torch.ones(batch.num_completions, dtype=torch.bool)
        keep[1] = False
        return keep


def test_rows_without_steps_gold_or_kept_are_not_scored_and_get_no_credit():
    calls = []
    texts = [THREE, THREE, "", THREE]
    values = [VECTOR, VECTOR, [0.0], VECTOR]
    result, extra, _ = credit({"normalise": "none", "coef": 1.0}, texts, [1.0, 0.0, 1.0, 0.0], values,
                              answers=["5", "5", "5", None], calls=calls, others=[DropSecond])
    assert {row for row, _, _ in calls} == {0}  # 1 dropped, 2 empty, 3 no gold answer
    assert extra[1:].abs().sum() == 0 and torch.isfinite(result.advantages).all()
    assert (result.advantages[1] == 0).all()  # the host zeroes the dropped row
    torch.testing.assert_close(extra[0, :23], torch.tensor([2.0] * 8 + [-0.5] * 8 + [3.5] * 7))


def test_no_cue_scores_the_whole_continuation_without_a_tokenizer():
    calls = []

    def fn(row, end, text, model):
        calls.append(text)
        return [{0: -6.0, 3: -4.0, 4: -1.0}[end]]

    batch = make_batch([1.0], 1, completion_mask=[[1, 1, 1, 1]], completions=["a\nb"], columns={"answer": [" 7 "]},
                       prefix_logps_fn=fn)  # the stand-in tokenizer spreads the 3 characters over 4 tokens
    result = run_plugin(TRACE, batch, {"cue": "", "template": "{answer}", "normalise": "none", "coef": 1.0})
    assert set(calls) == {"7"}  # the answer stripped, no cue
    assert result.metrics["trace/step_reward"] == pytest.approx(2.5)  # r = [2, 3]


def test_check_args():
    check_args(TRACE, peft=True)
    check_args(TRACE, peft=False, beta=0.04)
    with pytest.raises(ConfigError, match=r"plugins\[0\] \(trace\) reads the reference model with these options, but this run has none \(no PEFT adapter, beta 0\): train a PEFT adapter"):
        check_args(TRACE, peft=False)
    with pytest.raises(ConfigError, match="gold"):
        check_args(TRACE, {"column": "gold"})
    with pytest.raises(ConfigError, match="no {answer} placeholder"):
        check_args(TRACE, {"template": "the answer"})


def edge_batches():
    def batch(rewards, g, texts, answers=None):
        n = len(rewards)
        return make(texts, rewards, [[-1.0 - 0.5 * k - 0.1 * i for k in range(12)] for i in range(n)],
                    answers=answers or ["5"] * n, eos={0, 3}, num_generations=g)[0]

    lines = ["1\n2\n3", "1 + 1 = 2", "a\n\nb\nc\n", "", "x\ny", "1\n2\n3\n4\n5\n6\n7\n8\n9\n10", "z", " \n "]
    return [
        lambda: batch([1, 0, 1, 0, 1, 1, 0, 0], 4, lines),                                        # mixed
        lambda: batch([1, 1, 1, 1, 0, 0, 0, 0], 4, [THREE] * 8),                                  # constant
        lambda: batch([1, None, 0, 1, None, None, None, None], 4, lines),                         # NaN rewards
        lambda: batch([1, 0, 1], 1, [THREE, "", "9"], answers=["5", None, "9"]),                  # G = 1, no gold
        lambda: batch([0.5, 0.25, 0.75, 0.0], 2, ["", "", " \n", ""]),                            # no steps at all
    ]


def test_contract():
    check_plugin(TRACE, batches=edge_batches())
    check_plugin(TRACE, {"credit": "return", "normalise": "group", "reduce": "mean", "max_steps": 2},
                 batches=edge_batches())


def test_trains_with_a_lora_reference(tmp_path):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    trainer = train_tiny([{"name": "trace", "pattern": " ", "max_steps": 2}], output_dir=tmp_path, max_steps=2, peft_config=lora)
    logs = trainer.state.log_history[0]
    assert logs["trl_credit/trace/steps"] >= 1 and math.isfinite(logs["trl_credit/trace/step_reward"])
    assert math.isfinite(logs["trl_credit/trace/credit_abs"]) and logs["trl_credit/cost/prefix_sequences"] > 0


def test_turn_mode_states_are_turn_boundaries_with_the_replies():
    # model turns at 0-1, 4-5, 7 (replies at 2-3 and 6): states after the prompt (0), before turn 2 (4),
    # before turn 3 (7) and after the completion (8); log pi_ref(y*|s_k) = [-6, -4, -4.5, -1] -> r = [2, -0.5, 3.5]
    values = {0: -6.0, 4: -4.0, 7: -4.5, 8: -1.0}
    seen = []

    def fn(row, end, text, model):
        seen.append(end)
        return [values[end]]

    batch = make_batch([1.0], 1, completion_mask=[[1] * 8], tool_mask=[[1, 1, 0, 0, 1, 1, 0, 1]],
                       columns={"answer": ["5"]}, prefix_logps_fn=fn)
    result = run_plugin(TRACE, batch, {"segments": "turns", "normalise": "none", "coef": 1.0, "cue": ""})
    assert sorted(seen) == [0, 4, 7, 8]
    assert result.metrics["trace/step_reward"] == pytest.approx(5.0 / 3)
    # each turn's reward on its own tokens (the reply after it shares its step; TRL's loss ignores reply tokens)
    # (the outcome advantage of a group of one is 0, so the advantages are the credit)
    torch.testing.assert_close(result.advantages[0, [0, 1, 4, 5, 7]], torch.tensor([2.0, 2.0, -0.5, -0.5, 3.5]))
    assert (result.advantages[0, [2, 3, 6]] == 0).all()  # the replies get no credit


def test_an_unscored_completion_is_not_scored_and_gets_nothing():
    values = {0: -6.0, 4: -4.0, 7: -4.5, 8: -1.0}
    rows = []

    def fn(row, end, text, model):
        rows.append(row)
        return [values[end]]

    tool = [[1, 1, 0, 0, 1, 1, 0, 1]] * 2
    batch = make_batch([1.0, None], 2, completion_mask=[[1] * 8] * 2, tool_mask=tool, columns={"answer": ["5"] * 2},
                       prefix_logps_fn=fn)
    result = run_plugin(TRACE, batch, {"segments": "turns", "normalise": "none", "coef": 1.0, "cue": ""})
    assert set(rows) == {0}  # no reward function scored row 1: no scoring pass for it
    assert (result.advantages[1] == 0).all()
    torch.testing.assert_close(result.advantages[0, [0, 1, 4, 5, 7]], torch.tensor([2.0, 2.0, -0.5, -0.5, 3.5]))


def test_turn_mode_on_a_real_multi_turn_run_is_what_trains(tmp_path):
    """A real run on the kit's scripted multi-turn rollouts: what TRL's loss trained on (row by row, from its
    micro-batches) is TRACE's output on the recorded batch, whose turn-boundary scores the host cached in the real
    prefix pass. TRL's loss masks the environment's tokens."""
    from trl_credit.testing import train_scripted_turns

    options = {"segments": "turns"}
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    trainer, batch, trained = train_scripted_turns({"name": "trace", **options}, output_dir=tmp_path, peft_config=lora)
    logs = trainer.state.log_history[0]
    assert math.isfinite(logs["loss"]) and logs["trl_credit/cost/prefix_sequences"] > 0
    turns = batch.turns()
    seen = ~trained.isnan()  # the positions the loss received (the kit checked them against run_plugin)
    assert trained.dim() == 2
    assert trained[seen & turns.model].abs().sum() > 0
