"""InfoPO: a hand-computed vector on a multi-turn batch with a controlled prefix scorer, the gate, the masked
counterfactual's context, single-turn batches (= GRPO), edge cases, the contract and a real multi-turn run."""

from __future__ import annotations

import math

import pytest
import torch

from trl_credit import ConfigError, grpo_advantages, hookimpl
from trl_credit.testing import (ScriptedTurns, check_plugin, make_batch, plugin_set, run_plugin, scripted_turns_reward,
                                tiny_tokenizer, train_tiny)
from trl_credit_infopo import MASK_TEXT, InfoPO, gate, outcome_spread, reply_wrap

# Row layouts: ("m", text) a model turn, ("e", text) an environment reply (tool_mask 0).
ROWS = [
    [("m", "Which colour?"), ("e", " Blue."), ("m", " Size?"), ("e", " Large."), ("m", " Order 7.")],  # 3 turns
    [("m", "Colour?"), ("e", " Red."), ("m", " Done.")],                                              # 2 turns
    [("m", "Guess 5.")],                                                                               # 1 turn
    [("m", "Ask."), ("e", " Yes."), ("m", " Again."), ("e", " No."), ("m", " Stop.")],                 # 3 turns
    [("m", "Guess 4.")],                                                                               # 1 turn
    [("m", "Hint?"), ("e", " Warm."), ("m", " Guess 9.")],                                             # 2 turns
]
OUTCOMES = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]  # group 0 split, group 1 tied
# (F, M) summed log-probs of turn k + 1's action after turn k's reply seen / masked, per row and feedback turn k
SCORES = {0: [(-1.0, -2.0), (-3.0, -2.5)], 1: [(-0.5, -1.0)], 3: [(-1.0, -3.0), (-2.0, -2.0)], 5: [(-2.0, -1.0)]}
# IG = F - M: row 0 [1.0, -0.5], row 1 [0.5], row 3 [2.0, 0.0], row 5 [-1.0]; last turns and row 2, 4: none.
#
# Worked by hand (G = 3):
#   group 0 outcomes [1, 0, 0]: mean 1/3, unbiased std sqrt(1/3) = 0.577350 -> A = [1.154500, -0.577250, -0.577250]
#     (TRL: (r - mean) / (std + 1e-4)); population std sqrt(2/9) = 0.471405 -> w = exp(-0.471405 / 0.25) = 0.151735
#     IG pool [1.0, -0.5, 0.5]: mu 1/3, population sigma sqrt(7/18) = 0.623610
#     -> Z = [1.069043, -1.336304], [0.267261]
#     row 0: [1.154500 + 0.151735 * 1.069043, 1.154500 - 0.151735 * 1.336304, 1.154500] = [1.316712, 0.951736, 1.154500]
#     row 1: [-0.577250 + 0.151735 * 0.267261, -0.577250] = [-0.536697, -0.577250];  row 2 (one turn): [-0.577250]
#   group 1 outcomes tied: A = 0, population std 0 -> w = 1
#     IG pool [2.0, 0.0, -1.0]: mu 1/3, sigma sqrt(14/9) = 1.247219 -> Z = [1.336305, -0.267261], [-1.069044]
#     row 3: [1.336305, -0.267261, 0];  row 4 (one turn): [0];  row 5: [-1.069044, 0]
EXPECTED = [[1.316712, 0.951736, 1.154500], [-0.536697, -0.577250], [-0.577250],
            [1.336305, -0.267261, 0.0], [0.0], [-1.069044, 0.0]]


def layout_batch(rows=ROWS, outcomes=OUTCOMES, num_generations=3, scores=SCORES, seen=None, per_token=False, **kw):
    """A multi-turn batch of real token ids (the tiny tokenizer) with a controlled prefix scorer: the summed
    log-prob of the next action is ``scores[row][k]`` (F after the reply, M at the end of turn k)."""
    tok = tiny_tokenizer()
    ids, tool = [], []
    for segments in rows:
        row_ids, row_tool = [], []
        for kind, text in segments:
            piece = tok(text, add_special_tokens=False)["input_ids"]
            row_ids += piece
            row_tool += [int(kind == "m")] * len(piece)
        ids.append(row_ids)
        tool.append(row_tool)
    width = max(len(r) for r in ids)
    tool = [r + [1] * (width - len(r)) for r in tool]
    table = {}

    def prefix_logps_fn(row, end, text, model):
        if seen is not None:
            seen.append((row, end, text))
        value = table[(row, end)]
        if per_token:  # the same log-prob on every token of the action: its mean is the value
            return [value] * len(tok(text, add_special_tokens=False)["input_ids"])
        return [value]

    batch = make_batch(list(outcomes), num_generations, completion_ids=ids, tool_mask=tool, tokenizer=tok,
                       prefix_logps_fn=prefix_logps_fn, **kw)
    turns = batch.turns()
    starts, lengths = turns.starts(), turns.lengths
    for row, pairs in scores.items():
        for k, (factual, masked) in enumerate(pairs):
            table[(row, int(starts[row, k + 1]))] = factual
            table[(row, int(starts[row, k] + lengths[row, k]))] = masked
    return batch


def per_turn(batch, advantages):
    """The advantage of each turn (asserted constant over its tokens, 0 on the environment's tokens and padding)."""
    turns = batch.turns()
    out = []
    for i in range(batch.num_completions):
        model = turns.model[i]
        assert (advantages[i][~model] == 0).all(), f"row {i}: credit on environment tokens or padding"
        values = []
        for k in range(int(turns.count[i])):
            tokens = advantages[i][turns.index[i] == k]
            assert torch.allclose(tokens, tokens[0].expand_as(tokens)), f"row {i} turn {k} not constant"
            values.append(tokens[0].item())
        out.append(values)
    return out


# ------------------------------------------------------------------------------------------------ pieces
def test_gate_values():
    torch.testing.assert_close(gate(torch.tensor([0.0, 0.5]), 0.25), torch.tensor([1.0, math.exp(-2.0)]))
    assert math.exp(-2.0) == pytest.approx(0.135335, abs=1e-6)  # a binary group split in half
    torch.testing.assert_close(gate(torch.tensor([0.0, 0.5]), 0.25, "none"), torch.ones(2))
    spread = outcome_spread(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, math.nan, 0.0]), 3)
    torch.testing.assert_close(spread, torch.tensor([math.sqrt(2 / 9), 0.0, 0.5]))  # population std, NaN left out


def test_reply_wrap_keeps_what_every_reply_shares_and_masks_only_the_feedback():
    tok = tiny_tokenizer()
    wrap = "\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"  # the guess game's reply (ChatML)
    replies = [tok(wrap.format(text), add_special_tokens=False)["input_ids"]
               for text in ("Higher.", "Lower.", "Reply with just a number.")]
    head, tail = reply_wrap(replies)
    assert tok.decode(head) == "\n<|im_start|>user\n" and tok.decode(tail) == ".<|im_end|>\n<|im_start|>assistant\n"
    assert reply_wrap([replies[0], replies[0]]) == ([], [])  # one distinct reply: no wrap can be told apart
    assert reply_wrap([[1, 2], [1, 2, 2]]) == ([1, 2], [])  # a reply that is all wrap: head and tail never overlap
    assert reply_wrap([[5, 1], [6, 1]]) == ([], [1])


# ------------------------------------------------------------------------------------------------ the vector
def test_hand_computed_vector_on_a_multi_turn_batch():
    seen = []
    batch = layout_batch(seen=seen)
    result = run_plugin(InfoPO, batch)
    got = per_turn(batch, result.advantages)
    for i, (row, expected) in enumerate(zip(got, EXPECTED)):
        assert row == pytest.approx(expected, abs=1e-5), i
    # the scorer read turn k + 1's decoded text after its prefix, seen (start of k + 1) and masked (end of k)
    turns = batch.turns()
    starts, ends = turns.starts(), turns.starts() + turns.lengths
    expected_calls = set()
    for row, pairs in SCORES.items():
        actions = [text for kind, text in ROWS[row] if kind == "m"]
        for k in range(len(pairs)):
            expected_calls |= {(row, int(starts[row, k + 1]), actions[k + 1]), (row, int(ends[row, k]), actions[k + 1])}
    assert set(seen) == expected_calls  # no call for a last turn, nor for the one-turn rows 2 and 4
    assert result.metrics["infopo/information_gain"] == pytest.approx((1.0 - 0.5 + 0.5 + 2.0 + 0.0 - 1.0) / 6)
    assert result.metrics["infopo/positive_fraction"] == pytest.approx(3 / 6)
    assert result.metrics["infopo/gate"] == pytest.approx((math.exp(-math.sqrt(2 / 9) / 0.25) + 1.0) / 2, abs=1e-6)


def test_the_masked_prefix_carries_the_mask_text_as_context():
    contexts = []

    def spy(batch):
        scorer = batch.prefix_logps

        def recording(ends, continuations, model="policy", reduce="mean", context=None):
            contexts.append((context, reduce))
            return scorer(ends, continuations, model=model, reduce=reduce, context=context)

        batch.prefix_logps = recording
        return batch

    run_plugin(InfoPO, spy(layout_batch()))
    # the replies " Yes." " No." " Warm." all end with ".": the wrap they share stays around the placeholder
    assert set(contexts) == {(None, "sum"), (MASK_TEXT + ".", "sum")} and len(contexts) == 4  # 2 feedback turns x 2
    contexts.clear()
    a = run_plugin(InfoPO, spy(layout_batch()), {"mask_text": "", "keep_wrap": False}).advantages  # reply dropped
    assert set(contexts) == {(None, "sum"), ("", "sum")}
    contexts.clear()
    run_plugin(InfoPO, spy(layout_batch()), {"keep_wrap": False})
    assert set(contexts) == {(None, "sum"), (MASK_TEXT, "sum")}
    assert per_turn(layout_batch(), a)[0] == pytest.approx(EXPECTED[0], abs=1e-5)  # same scores, same vector


def test_gate_none_and_info_coef():
    batch = layout_batch()
    got = per_turn(batch, run_plugin(InfoPO, batch, {"gate": "none", "info_coef": 0.5}).advantages)
    assert got[0] == pytest.approx([1.154500 + 0.5 * 1.069043, 1.154500 - 0.5 * 1.336304, 1.154500], abs=1e-5)
    assert got[3] == pytest.approx([0.5 * 1.336305, -0.5 * 0.267261, 0.0], abs=1e-5)
    got = per_turn(batch, run_plugin(InfoPO, layout_batch(), {"gate_tau": 1.0}).advantages)
    w = math.exp(-math.sqrt(2 / 9))  # 0.624  (tau 1)
    assert got[0][0] == pytest.approx(1.154500 + w * 1.069043, abs=1e-5)


def test_reduce_mean_divides_each_log_prob_by_the_action_tokens():
    tok = tiny_tokenizer()
    sums = InfoPO(InfoPO.Config()).information_gains(layout_batch(per_token=True))
    means = InfoPO(InfoPO.Config(reduce="mean")).information_gains(layout_batch(per_token=True))
    n_size = len(tok(" Size?", add_special_tokens=False)["input_ids"])  # row 0's action after its first reply
    assert means[0, 0].item() == pytest.approx(1.0)  # every token at F resp. M: the mean is F - M
    assert sums[0, 0].item() == pytest.approx(1.0 * n_size)
    assert math.isnan(means[0, 2]) and math.isnan(means[2, 0])  # a last turn, a one-turn row


# ------------------------------------------------------------------------------------------------ edge cases
def test_single_turn_batches_are_grpo_exactly():
    rewards = [1.0, 0.0, 0.5, None, 1.0, 1.0, 1.0, 1.0]
    for kw in ({}, {"scale_rewards": "batch"}, {"scale_rewards": "none"}):
        batch = make_batch(rewards, 4, lengths=[3, 5, 2, 4, 1, 6, 3, 3], **kw)
        got = run_plugin(InfoPO, batch).advantages
        expected = grpo_advantages(batch.rewards, batch.reward_weights, 4, kw.get("scale_rewards", "group"),
                                   "sum_then_normalize")
        assert torch.equal(got, expected)
    tool = make_batch(rewards, 4, lengths=[3] * 8, tool_mask=[[1, 1, 1]] * 8)  # a tool mask, one turn each
    assert torch.equal(run_plugin(InfoPO, tool).advantages,
                       grpo_advantages(tool.rewards, tool.reward_weights, 4, "group", "sum_then_normalize"))


def test_all_nan_scores_leave_the_outcome_advantage():
    scores = {row: [(math.nan, math.nan)] * len(pairs) for row, pairs in SCORES.items()}
    batch = layout_batch(scores=scores)
    result = run_plugin(InfoPO, batch)
    got = per_turn(batch, result.advantages)
    assert got[0] == pytest.approx([1.154500] * 3, abs=1e-5) and got[3] == [0.0, 0.0, 0.0]
    assert "infopo/information_gain" not in result.metrics


def test_constant_gains_and_tied_groups_give_no_information_credit():
    scores = {row: [(-1.0, -2.0)] * len(pairs) for row, pairs in SCORES.items()}  # IG 1 everywhere
    batch = layout_batch(outcomes=[1.0] * 6, scores=scores)
    assert torch.equal(run_plugin(InfoPO, batch).advantages, torch.zeros(6, batch.width))


def test_a_row_without_an_outcome_gets_nothing_and_is_not_scored():
    seen = []
    batch = layout_batch(outcomes=[1.0, 0.0, 0.0, None, 1.0, 1.0], seen=seen)
    got = per_turn(batch, run_plugin(InfoPO, batch).advantages)
    assert got[3] == [0.0, 0.0, 0.0] and all(row != 3 for row, _, _ in seen)
    # group 1: outcomes [1, 1] scorable (tied), pool row 5's one IG alone -> Z = 0
    assert got[5] == [0.0, 0.0] and got[0] == pytest.approx(EXPECTED[0], abs=1e-5)


@pytest.mark.parametrize("options, key", [({"gate_tau": 0.0}, "gate_tau"), ({"info_coef": -1.0}, "info_coef"),
                                          ({"gate": "linear"}, "gate"), ({"reduce": "max"}, "reduce"),
                                          ({"mask": "x"}, "mask")])
def test_bad_options(options, key):
    with pytest.raises(ConfigError, match=rf"\(infopo\).*{key}"):
        plugin_set(InfoPO, options)


def test_contract():
    check_plugin(InfoPO, batches=[layout_batch,
                                  lambda: layout_batch(outcomes=[1.0, None, 0.0, 1.0, 1.0, 0.0])])
    check_plugin(InfoPO)  # the kit's single-turn edge cases
    check_plugin(InfoPO, {"mask_text": "", "reduce": "mean", "gate": "none"}, batches=[layout_batch])


# ------------------------------------------------------------------------------------------------ a real run
class SpyInfoPO(InfoPO):
    """InfoPO recording each batch's turn counts, GRPO's outcome advantages and its own per-turn advantages."""

    name = "infopo"
    seen: list = []

    @hookimpl
    def compute_advantages(self, batch):
        advantages = super().compute_advantages(batch)
        outcome = grpo_advantages(batch.rewards, batch.reward_weights, batch.num_generations, "group",
                                  "sum_then_normalize")
        SpyInfoPO.seen.append((batch.turns().count.tolist(), outcome.tolist(), per_turn(batch, advantages)))
        return advantages


def test_trains_on_scripted_multi_turn_rollouts(tmp_path):
    SpyInfoPO.seen.clear()
    trainer = train_tiny([{"name": SpyInfoPO}], output_dir=tmp_path, rollout_func=ScriptedTurns(),
                         reward_funcs=[scripted_turns_reward], max_completion_length=32)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs and all(math.isfinite(h["loss"]) for h in logs)
    assert all(math.isfinite(h["trl_credit/infopo/gate"]) for h in logs)
    assert any(math.isfinite(h.get("trl_credit/infopo/information_gain", math.nan)) for h in logs)
    assert any(h.get("trl_credit/cost/prefix_sequences", 0) > 0 for h in logs)  # the host meters the scorer
    assert SpyInfoPO.seen
    differ = False
    for counts, outcome, advantages in SpyInfoPO.seen:
        assert max(counts) > 1  # the scripted rollouts take 1..3 turns
        for c, a_i, row in zip(counts, outcome, advantages):
            assert row[-1] == pytest.approx(a_i, abs=1e-5) if row else True  # the last turn: the outcome only
            differ |= c > 1 and max(row) - min(row) > 1e-6
    assert differ  # the information term moves credit between the turns of a row
