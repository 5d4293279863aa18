"""SALT: a constructed group whose trajectories share turns and part (both merge rules, the three aggregates),
per-token inputs, single-turn batches (GRPO as is), NaN and dropped rows, the contract, and a real training run on
scripted multi-turn rollouts whose trajectories share their first turn."""

from __future__ import annotations

import math

import pytest
import torch

from trl_credit import Plugin, hookimpl
from trl_credit.testing import (ScriptedTurns, check_plugin, make_batch, plugin_set, run_plugin,
                                scripted_turns_reward, train_tiny)
from trl_credit_salt import SALT, prefix_nodes, step_nodes, turn_means

# A group of four (rewards 1, 0.5, 0, 0). Tokens (model turns | environment replies, here the token 7):
#   row 0: [5 6] 7 [8] 7 [9 10]     three turns
#   row 1: [5 6] 7 [8] 7 [11]       three turns: the same first two turns as row 0 (same history), a different third
#   row 2: [5 6] 7 [12] 7 [8]       three turns: row 0's first turn, then its own; its third = row 0's second step
#   row 3: [5 6 14]                 one turn, longer than the others' first: its own node
# GRPO: mean 0.375, unbiased std sqrt(0.6875 / 3) = 0.478714, D = std + 1e-4 = 0.478814:
#   A = [0.625, 0.125, -0.375, -0.375] / D = [1.305309, 0.261062, -0.783185, -0.783185]
# prefix: turn 0 of rows 0-2 -> mean(A0, A1, A2) = 0.125 / D = 0.261062; turn 1 of rows 0-1 -> 0.375 / D = 0.783185;
#         every other turn keeps its own A.
# step:   as prefix, and (reply 7, step [8]) is one node for row 0 turn 1, row 1 turn 1 and row 2 turn 2 ->
#         mean(A0, A1, A2) = 0.261062 for all three.
IDS = [[5, 6, 7, 8, 7, 9, 10], [5, 6, 7, 8, 7, 11], [5, 6, 7, 12, 7, 8], [5, 6, 14]]
TOOL = [[1, 1, 0, 1, 0, 1, 1], [1, 1, 0, 1, 0, 1, 0], [1, 1, 0, 1, 0, 1, 0], [1, 1, 1, 0, 0, 0, 0]]
MASK = [[1] * 7, [1] * 6 + [0], [1] * 6 + [0], [1] * 3 + [0] * 4]
D = math.sqrt(0.6875 / 3) + 1e-4
A = [0.625 / D, 0.125 / D, -0.375 / D, -0.375 / D]
S0, S1 = 0.125 / D, 0.375 / D


def group_batch(rewards=(1.0, 0.5, 0.0, 0.0), **kw):
    return make_batch(list(rewards), 4, completion_ids=IDS, completion_mask=MASK, tool_mask=TOOL, **kw)


def test_shared_turns_get_the_mean_and_diverging_turns_keep_their_own():
    assert D == pytest.approx(0.478814, abs=1e-6) and S0 == pytest.approx(0.261062, abs=1e-6)
    result = run_plugin(SALT, group_batch())
    a0, a1, a2, a3 = A
    expected = torch.tensor([[S0, S0, 0, S1, 0, a0, a0],
                             [S0, S0, 0, S1, 0, a1, 0],
                             [S0, S0, 0, a2, 0, a2, 0],
                             [a3, a3, a3, 0, 0, 0, 0]])
    torch.testing.assert_close(result.advantages, expected, atol=1e-5, rtol=0)
    # 4 + 3 + ... member turns: 10 in all; in shared nodes: rows 0-2 turn 0 (3) and rows 0-1 turn 1 (2)
    assert result.metrics["salt/shared_turns"] == pytest.approx(5 / 10)
    assert result.metrics["salt/nodes_per_group"] == 7  # {0,1,2}t0, {0,1}t1, 0t2, 1t2, 2t1, 2t2, 3t0


def test_step_merge_joins_equal_steps_reached_by_different_histories():
    a0, a1, a2, a3 = A
    expected = torch.tensor([[S0, S0, 0, S0, 0, a0, a0],
                             [S0, S0, 0, S0, 0, a1, 0],
                             [S0, S0, 0, a2, 0, S0, 0],
                             [a3, a3, a3, 0, 0, 0, 0]])
    torch.testing.assert_close(run_plugin(SALT, group_batch(), {"merge": "step"}).advantages, expected, atol=1e-5,
                               rtol=0)
    batch = group_batch()
    prefix, step = prefix_nodes(batch), step_nodes(batch)
    assert prefix[0, 0] == prefix[1, 0] == prefix[2, 0] != prefix[3, 0] and prefix[0, 1] == prefix[1, 1] != prefix[2, 1]
    assert step[0, 1] == step[1, 1] == step[2, 2] and (prefix[3, 1:] == -1).all() and (step[3, 1:] == -1).all()


def test_max_and_min_aggregates():
    a0, a1, a2, _ = A
    high = run_plugin(SALT, group_batch(), {"aggregate": "max"}).advantages
    low = run_plugin(SALT, group_batch(), {"aggregate": "min"}).advantages
    assert high[1, 0].item() == pytest.approx(a0, abs=1e-5) and high[1, 3].item() == pytest.approx(a0, abs=1e-5)
    assert low[0, 0].item() == pytest.approx(a2, abs=1e-5) and low[0, 3].item() == pytest.approx(a1, abs=1e-5)
    assert high[1, 5].item() == pytest.approx(a1, abs=1e-5)  # a diverging turn keeps its own


def enabled():
    return plugin_set(SALT).plugins[0].instance


def test_per_token_inputs_keep_their_within_turn_structure():
    batch = group_batch()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randn(4, 7, generator=g)
    means = turn_means(batch, tokens)
    out = enabled().transform_advantages(batch=batch, advantages=tokens)
    node0 = (means[0, 0] + means[1, 0] + means[2, 0]) / 3
    torch.testing.assert_close(out[0, :2], tokens[0, :2] - means[0, 0] + node0)  # shifted by the node's correction
    torch.testing.assert_close(out[2, 5], tokens[2, 5])  # a turn of its own: unchanged
    torch.testing.assert_close(out[:, 2], tokens[:, 2])  # environment tokens: as they came
    assert torch.allclose(turn_means(batch, out)[0, 0], node0)


def test_single_turn_batches_are_grpo_as_is():
    ids = [[3, 4, 5], [3, 4], [3, 9, 5, 6], [8]]  # distinct completions (a prefix of another is not the same turn)
    batch = make_batch([1.0, 0.0, 0.5, 0.0], 4, completion_ids=ids, completion_mask=[[1] * 3 + [0], [1] * 2 + [0] * 2,
                                                                                      [1] * 4, [1] + [0] * 3])
    result = run_plugin(SALT, batch)
    grpo = run_plugin(SALT, batch, {"aggregate": "max"}).advantages
    r = torch.tensor([1.0, 0.0, 0.5, 0.0])
    a = (r - r.mean()) / (r.std() + 1e-4)
    torch.testing.assert_close(result.advantages, a.unsqueeze(1) * batch.completion_mask, atol=1e-6, rtol=0)
    torch.testing.assert_close(grpo, result.advantages)
    assert result.metrics["salt/shared_turns"] == 0
    same = make_batch([1.0, 0.0, 0.0, 0.0], 4, completion_ids=[[3, 4]] * 2 + [[5], [6]])  # two identical answers
    b = run_plugin(SALT, same).advantages  # merge: mean of A = [0.75, -0.25] / (0.5 + 1e-4)
    assert b[0, 0].item() == pytest.approx(0.25 / 0.5001, abs=1e-6) and b[1, 1].item() == b[0, 1].item()


def test_nan_and_dropped_rows_are_not_members():
    nan = run_plugin(SALT, group_batch((1.0, None, 0.0, 0.0))).advantages
    # members 0, 2, 3 (row 1's rewards are NaN: GRPO gives it 0 and SALT leaves it so)
    r = torch.tensor([1.0, 0.0, 0.0])
    grpo = (r - r.mean()) / (r.std() + 1e-4)
    assert (nan[1] == 0).all()
    assert nan[0, 0].item() == pytest.approx((grpo[0] + grpo[1]).item() / 2, abs=1e-5)  # rows 0 and 2 share turn 0
    assert nan[0, 3].item() == pytest.approx(grpo[0].item(), abs=1e-5)  # row 1 shared turn 1 but is no member

    class DropRowOne(Plugin):
        """Drops row 1."""

        @hookimpl
        def filter_rollouts(self, batch):
            return torch.tensor([True, False, True, True])

    dropped = run_plugin(SALT, group_batch(), others=[DropRowOne]).advantages
    a0, _, a2, _ = A
    assert (dropped[1] == 0).all()
    assert dropped[0, 0].item() == pytest.approx((a0 + a2) / 2, abs=1e-5) and dropped[0, 3].item() == pytest.approx(a0, abs=1e-5)


def test_constant_groups_and_empty_completions():
    assert (run_plugin(SALT, group_batch((1.0,) * 4)).advantages == 0).all()
    empty = make_batch([1.0, 0.0], 2, lengths=[0, 0])  # no token to credit: the incoming advantages as they are
    assert run_plugin(SALT, empty).advantages.shape == (2,)


def test_contract():
    check_plugin(SALT)
    check_plugin(SALT, batches=[group_batch, lambda: group_batch((1.0, None, 0.0, None))])
    check_plugin(SALT, {"merge": "step", "aggregate": "min"}, batches=[group_batch])


# --------------------------------------------------------------------------------------- training run
class SharedStart(ScriptedTurns):
    """ScriptedTurns whose rollouts of one prompt all begin with the same first turn (then draw their own)."""

    def __call__(self, prompts, trainer):
        out = super().__call__(prompts, trainer)
        first: dict[str, list[int]] = {}
        for i, prompt in enumerate(prompts):
            head = first.setdefault(str(prompt), out["completion_ids"][i][: self.turn_tokens])
            out["completion_ids"][i][: self.turn_tokens] = head
        return out


class Seen(Plugin):
    """Records each finished batch and its advantages."""

    name = "seen"
    batches: list = []

    @hookimpl
    def on_batch_end(self, batch, advantages):
        Seen.batches.append((batch, advantages.clone()))


def expected(batch):
    """The formula written out with loops: GRPO per group, then each turn the mean over its identical histories."""
    g = batch.num_generations
    r = batch.total_reward()
    grpo = []
    for start in range(0, len(r), g):
        x = r[start: start + g]
        grpo += ((x - x.mean()) / (x.std() + 1e-4)).tolist()
    turns = batch.turns()
    ids, tool = batch.completion_ids.tolist(), batch.tool_mask.tolist()
    ends = (turns.starts() + turns.lengths).tolist()
    key = {}
    for i in range(len(r)):
        for k in range(int(turns.count[i])):
            key[i, k] = (i // g, tuple(ids[i][: ends[i][k]]), tuple(tool[i][: ends[i][k]]))
    out = torch.zeros(turns.lengths.shape)
    for (i, k), node in key.items():
        through = [grpo[j] for (j, _), other in key.items() if other == node]
        out[i, k] = sum(through) / len(through)
    return turns.broadcast(out), sum(len([1 for o in key.values() if o == n]) > 1 for n in key.values()) / len(key)


def test_trains_on_scripted_turns_sharing_their_first_turn(tmp_path):
    Seen.batches.clear()
    trainer = train_tiny(["salt", Seen], output_dir=tmp_path, rollout_func=SharedStart(),
                         reward_funcs=[scripted_turns_reward], max_completion_length=32)
    logs = trainer.state.log_history
    assert math.isfinite(logs[-1]["train_loss"])
    assert len(Seen.batches) == 2
    shared = []
    for step, (batch, advantages) in enumerate(Seen.batches):
        assert int(batch.turns().count.max()) > 1
        want, fraction = expected(batch)
        torch.testing.assert_close(advantages, want, atol=1e-5, rtol=0)
        assert logs[step]["trl_credit/salt/shared_turns"] == pytest.approx(fraction)
        shared.append(fraction)
    assert max(shared) > 0  # the first turns really were merged
