"""GTPO: the methods.md vector, conflict edge cases, entropy filter/shaping, the contract and a real run."""

from __future__ import annotations

import math

import pytest
import torch

from trl_credit_gtpo import GTPO, LOSS_TYPE_PROBLEMS, conflict_delta, conflict_runs

from trl_credit import ConfigError, grpo_advantages, hookimpl
from trl_credit.testing import (check_args, check_plugin, edge_case_batches, make_batch, plugin_set, run_plugin,
                                train_tiny)

# methods.md 2.18: G = 4, c0 and c2 positive, c1 and c3 negative
IDS = [[5, 7, 9, 2], [5, 7, 3, 2], [5, 8, 9, 2], [6, 7, 9, 2]]
DELTA = torch.tensor([[4., 4., 4., 4.], [0., 0., 1., 0.], [2., 1., 2., 2.], [1., 0., 0., 0.]])
POS = torch.tensor([True, False, True, False])


def delta_of(ids, positive, negative, group=None, mode="aligned", mask=None):
    """``conflict_delta``; without ``mask`` the ids are right-padded with 0 and the mask is ``ids != 0``."""
    ids = torch.tensor(ids)
    mask = (ids != 0).long() if mask is None else torch.as_tensor(mask).long()
    return conflict_delta(ids, mask, torch.tensor(positive), torch.tensor(negative),
                          group or ids.shape[0], 2.0, mode)


def registered(options=None):
    """A GTPO instance registered as the host registers it (it then owns the metrics it logs)."""
    plugin = GTPO(GTPO.Config(**(options or {})))
    plugin_set(plugin)
    return plugin


def tight(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------- the vector
@pytest.mark.parametrize("mode, n_conflict", [("aligned", [4, 3, 3, 3]), ("code", [4, 2, 2, 3])])
def test_methods_vector(mode, n_conflict):
    delta, n = delta_of(IDS, POS.tolist(), (~POS).tolist(), mode=mode)
    assert torch.equal(delta, DELTA)
    assert n.tolist() == n_conflict


@pytest.mark.parametrize("mode, n_conflict", [("aligned", [4, 3, 3, 3]), ("code", [4, 2, 2, 3])])
def test_methods_vector_through_the_host(mode, n_conflict):
    # rewards 1/0 -> TRL group advantages +-a; entropy part off
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    batch = make_batch([1, 0, 1, 0], 4, completion_ids=IDS, loss_type="grpo")
    result = run_plugin(GTPO, batch, {"entropy": False, "count_mode": mode})
    signed = torch.tensor([a, -a, a, -a])
    expected = signed[:, None] * DELTA / torch.tensor(n_conflict, dtype=torch.float32)[:, None]
    tight(result.advantages, expected)
    assert result.metrics["gtpo/conflict_tokens"] == pytest.approx(sum(n_conflict) / 4)


def test_runs_in_both_orders():
    start, end, end_reversed = conflict_runs(torch.tensor(IDS), torch.ones(4, 4), POS, ~POS, 4)
    assert start.int().tolist() == [[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]]
    assert end.int().tolist() == [[1, 1, 1, 1], [0, 0, 0, 1], [0, 0, 1, 1], [0, 1, 1, 1]]
    assert end_reversed.int().tolist() == [[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]]


# ------------------------------------------------------------------------- edge cases
def test_no_negatives_or_no_positives_means_no_conflict():
    for positive in ([True] * 4, [False] * 4):
        delta, n = delta_of([[5, 7, 9, 2]] * 4, positive, [not p for p in positive])
        assert torch.equal(delta, torch.ones(4, 4)) and n.tolist() == [0] * 4


def test_zero_advantage_completions_neither_vote_nor_move():
    # c1 and c3 inactive (A = 0): only c0 (+) and c2 (+) vote, no negative -> delta 1
    delta, n = delta_of(IDS, [True, False, True, False], [False] * 4)
    assert torch.equal(delta, torch.ones(4, 4)) and n.tolist() == [0] * 4
    # c3 inactive, c1 negative: c3's tokens never conflict, and c3 does not vote
    delta, n = delta_of(IDS, [True, False, True, False], [False, True, False, False])
    assert torch.equal(delta[3], torch.ones(4))
    assert delta[0].tolist() == [2.0, 2.0, 1.0, 2.0]   # runs [0, 1] and [3]: 9 is in no negative now


def test_identical_completions():
    delta, n = delta_of([[5, 7, 9, 2]] * 4, POS.tolist(), (~POS).tolist())
    assert torch.equal(delta, torch.tensor([[4.0] * 4, [0.0] * 4] * 2))
    assert n.tolist() == [4] * 4
    _, n = delta_of([[5, 7, 9, 2]] * 4, POS.tolist(), (~POS).tolist(), mode="code")
    assert n.tolist() == [4] * 4


def test_ragged_lengths_align_the_end_run_right():
    # the ends match ([.., 9, 2]) only when right-aligned; padding (0) never conflicts
    ids = [[5, 9, 2, 0, 0], [4, 8, 3, 9, 2], [6, 3, 9, 2, 0]]
    delta, n = delta_of(ids, [True, False, False], [False, True, True])
    assert delta.tolist() == [[1, 2, 2, 0, 0], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]
    assert n.tolist() == [2, 2, 2]
    # left-aligned, pads at the same positions would have matched: they must not
    ids = [[5, 0, 0], [6, 0, 0]]
    delta, n = delta_of(ids, [True, False], [False, True])
    assert delta.tolist() == [[1, 0, 0], [1, 0, 0]] and n.tolist() == [0, 0]


def test_the_mask_alone_decides_what_is_padding():
    # id 0 inside the mask (the EOS of a pad == EOS tokenizer) is an ordinary token: weighted and counted
    ids = [[5, 7, 0], [5, 7, 0]]
    delta, n = delta_of(ids, [True, False], [False, True], mask=[[1, 1, 1], [1, 1, 1]])
    assert delta.tolist() == [[4, 4, 4], [0, 0, 0]] and n.tolist() == [3, 3]
    _, n = delta_of(ids, [True, False], [False, True], mode="code", mask=[[1, 1, 1], [1, 1, 1]])
    assert n.tolist() == [3, 3]
    # and any id outside the mask is padding: it neither votes nor is weighted nor counted
    delta, n = delta_of([[5, 7, 9], [5, 7, 9]], [True, False], [False, True], mask=[[1, 1, 0], [1, 1, 0]])
    assert delta.tolist() == [[4, 4, 0], [0, 0, 0]] and n.tolist() == [2, 2]


# methods.md 2.18 with an EOS appended to every completion, EOS = pad = 0 (make_batch's default, as SmolLM2)
IDS_EOS = [row + [0] for row in IDS]
DELTA_EOS = torch.tensor([[4., 4., 4., 4., 4.], [0., 0., 1., 0., 0.], [2., 1., 2., 2., 2.], [1., 0., 0., 0., 0.]])
N_EOS = {"aligned": [5, 4, 4, 4], "code": [5, 2, 3, 4]}


@pytest.mark.parametrize("mode", ["aligned", "code"])
def test_eos_equal_to_the_pad_id_is_weighted_and_counted(mode):
    """TRL's mask includes the EOS; with pad == EOS gtpo used to treat it as padding (delta 1, not counted)."""
    batch = make_batch([1, 0, 1, 0], 4, completion_ids=IDS_EOS, loss_type="grpo")
    assert batch.pad_token_id == 0 and batch.completion_mask.tolist() == [[1] * 5] * 4   # EOS inside the mask
    # by hand: the EOS (0) sits at the same place in every completion, so it conflicts in both runs:
    # W^2 = 4 on a positive whose runs reach it, 0 on a negative; the start runs are those of the vector
    # (c0 all, c1 [5, 7], c2 [5], c3 none), the end runs now begin with the EOS
    # (c0 all, c1 [2, EOS], c2 [9, 2, EOS], c3 [7, 9, 2, EOS])
    delta, n = conflict_delta(batch.completion_ids, batch.completion_mask, POS, ~POS, 4, 2.0, mode)
    assert torch.equal(delta, DELTA_EOS)
    assert n.tolist() == N_EOS[mode]
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    result = run_plugin(GTPO, batch, {"entropy": False, "count_mode": mode})
    expected = torch.tensor([a, -a, a, -a])[:, None] * DELTA_EOS / torch.tensor(N_EOS[mode])[:, None].float()
    tight(result.advantages, expected)
    assert result.metrics["gtpo/conflict_tokens"] == pytest.approx(sum(N_EOS[mode]) / 4)
    assert result.metrics["gtpo/conflict_fraction"] == pytest.approx(sum(N_EOS[mode]) / 5 / 4)


def test_eos_weighted_and_padding_after_it_ignored_in_ragged_completions():
    # c0 (+) = 5 9 7 EOS, c1 (-) = 5 8 EOS + one pad (id 0 as well): TRL's mask [1 1 1 1], [1 1 1 0]
    batch = make_batch([1, 0], 2, completion_ids=[[5, 9, 7, 0], [5, 8, 0]], loss_type="grpo")
    assert batch.completion_ids.tolist() == [[5, 9, 7, 0], [5, 8, 0, 0]]
    assert batch.completion_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    # start runs: position 0 (5) in both; end runs (right-aligned): the EOS in both, then 7 vs 8 differ
    # delta c0 = [W, 1, 1, W], c1 = [0, 1, 0, 0 (padding)], n = 2 each ("code": max(1, 1) = 1)
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    result = run_plugin(GTPO, batch, {"entropy": False})
    tight(result.advantages, torch.tensor([[a, a / 2, a / 2, a], [0.0, -a / 2, 0.0, 0.0]]))
    code = run_plugin(GTPO, batch, {"entropy": False, "count_mode": "code"})
    tight(code.advantages, torch.tensor([[2 * a, a, a, 2 * a], [0.0, -a, 0.0, 0.0]]))


def test_groups_are_separate():
    # the same tokens in another group never make a conflict
    ids = [[5, 7], [6, 8], [6, 8], [5, 7]]
    delta, n = delta_of(ids, [True, False, True, False], [False, True, False, True], group=2)
    assert torch.equal(delta, torch.ones(4, 2)) and n.tolist() == [0] * 4


def test_dropped_completions_do_not_vote():
    batch = make_batch([1, 0, 1, 0], 4, completion_ids=[[5, 7], [5, 7], [6, 8], [6, 8]])
    batch.kept = torch.tensor([True, False, True, True])
    plugin = registered({"entropy": False})
    out = plugin.transform_advantages(batch, torch.tensor([1.0, -1.0, 1.0, -1.0]))
    # c0 (5, 7) only conflicted with c1, which is dropped; c2/c3 conflict fully (W^2 / 2)
    tight(out, torch.tensor([[1.0, 1.0], [-1.0, -1.0], [2.0, 2.0], [0.0, 0.0]]))


# ------------------------------------------------------------------------- entropy
def entropy_batch(entropies, lengths=(4, 4, 4, 4)):
    ent = torch.tensor(entropies, dtype=torch.float32)[:, None].expand(4, 4).clone()
    ent[1, lengths[1]:] = 100.0   # outside completion 1's mask: must not count
    return make_batch([1, 0, 1, 0], 4, lengths=list(lengths), entropies=ent)


def test_entropy_filter_and_shaping():
    # lengths 1..L ids: every completion equal -> all tokens conflict; switch conflicts off here
    result = run_plugin(GTPO, entropy_batch([0.2, 0.5, 0.9, 0.6], (4, 2, 4, 4)), {"protect_conflicts": False})
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    expected = torch.tensor([a - 0.02, -a - 0.05, 0.0, -a - 0.06])  # 0.9 > 0.7 dropped
    mask = result.batch.completion_mask.float()
    tight(result.advantages, expected[:, None] * mask)
    assert result.metrics["gtpo/entropy_filtered"] == 0.25
    assert result.metrics["gtpo/entropy_mean"] == pytest.approx((0.2 + 0.5 + 0.9 + 0.6) / 4)


def test_entropy_shapes_zero_advantage_completions_like_the_code():
    batch = make_batch([1, 1, 1, 1], 4, entropies=torch.full((4, 4), 0.5))
    result = run_plugin(GTPO, batch)
    tight(result.advantages, torch.full((4, 4), -0.05))          # A = 0 -> 0 - 0.1 * 0.5


def test_an_unscorable_completion_gets_no_entropy_shaping():
    # every reward None for row 1: GRPO gives it 0, and so does GTPO (no -0.1 H); the metrics leave it out
    batch = make_batch([1, None, 1, 1], 4, entropies=torch.tensor([[0.5] * 4, [0.3] * 4, [0.5] * 4, [0.5] * 4]))
    result = run_plugin(GTPO, batch)
    tight(result.advantages[1], torch.zeros(4))
    tight(result.advantages[[0, 2, 3]], torch.full((3, 4), -0.05))
    assert result.metrics["gtpo/entropy_mean"] == pytest.approx(0.5)


def test_sets_are_taken_before_shaping():
    # A = +0.01 with H = 0.5 becomes -0.04 but still counts as positive (weight W, not 0)
    batch = make_batch([0, 0], 2, completion_ids=[[5], [5]], entropies=torch.full((2, 1), 0.5))
    out = registered().transform_advantages(batch, torch.tensor([0.01, -0.01]))
    tight(out, torch.tensor([[(0.01 - 0.05) * 4.0], [0.0]]))


def test_entropy_switch_and_threshold():
    batch = entropy_batch([0.9, 0.9, 0.9, 0.9])
    off = run_plugin(GTPO, batch, {"entropy": False, "protect_conflicts": False})
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    tight(off.advantages[:, 0], torch.tensor([a, -a, a, -a]))
    assert "gtpo/entropy_mean" not in off.metrics
    high = run_plugin(GTPO, entropy_batch([0.9] * 4), {"ent_threshold": 1.0, "ent_scale": 0.0,
                                                         "protect_conflicts": False})
    tight(high.advantages[:, 0], torch.tensor([a, -a, a, -a]))


def test_token_level_input():
    batch = make_batch([1, 0], 2, completion_ids=[[5, 6], [5, 7]], entropies=torch.zeros(2, 2))
    adv = torch.tensor([[1.0, 3.0], [-2.0, -2.0]])
    out = registered().transform_advantages(batch, adv)
    # sign from the masked mean; position 0 conflicts (start run), position 1 does not; n = 1
    tight(out, torch.tensor([[2.0, 3.0], [0.0, -2.0]]))


# ------------------------------------------------------------------------- contract
def test_bad_options():
    for options in ({"count_mode": "merged"}, {"conflict_weight": -1.0}, {"w_raw": 2.0}):
        with pytest.raises(ConfigError):
            plugin_set(GTPO, options)


def test_contract():
    check_plugin(GTPO)
    check_plugin(GTPO, {"count_mode": "code", "conflict_weight": 3.0})
    check_plugin(GTPO, {"entropy": False, "protect_conflicts": False})
    check_plugin(GTPO, batches=edge_case_batches()[:1]
                 + [lambda: make_batch([1, 0] * 4, 4, completion_ids=[[3, 3, 0, 0]] * 8, pad_token_id=0,
                                       entropies=torch.rand(8, 4, generator=torch.Generator().manual_seed(1)))])


# ------------------------------------------------------------------------- settings (check_args)
def test_loss_type_grpo_is_accepted():
    check_args(GTPO, {}, loss_type="grpo", per_device_train_batch_size=8, num_generations=4)
    check_args(GTPO, {"entropy": False, "count_mode": "code"}, loss_type="grpo", beta=0.0,
               per_device_train_batch_size=8, num_generations=4)


@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPE_PROBLEMS))
def test_other_loss_types_are_refused_before_the_model_loads(loss_type):
    extra = {"importance_sampling_level": "sequence"} if loss_type == "luspo" else {}
    with pytest.raises(ConfigError) as error:
        check_args(GTPO, {}, loss_type=loss_type, per_device_train_batch_size=8, num_generations=4, **extra)
    message = str(error.value)
    assert "(gtpo)" in message and "loss_type" in message and repr(loss_type) in message
    assert LOSS_TYPE_PROBLEMS[loss_type] in message
    assert "fix: set `loss_type: grpo`" in message


def test_trl_default_loss_type_is_refused(tmp_path):
    # TRL's default is dapo: a run that does not set loss_type fails before its model loads
    with pytest.raises(ConfigError, match=r"\(gtpo\): loss_type: .*got 'dapo'.*fix: set `loss_type: grpo`"):
        train_tiny(["gtpo"], output_dir=tmp_path, train=False)


# ------------------------------------------------------------------------- a real run
def test_training_run(tmp_path):
    def parity(completions, **kwargs):   # mixed groups whatever the model writes
        return [float(i % 2) for i in range(len(completions))]

    trainer = train_tiny([{"name": "gtpo", "ent_threshold": 100.0}], output_dir=tmp_path, reward_funcs=[parity],
                         loss_type="grpo", beta=0.0)
    logs = [e for e in trainer.state.log_history if "trl_credit/gtpo/seconds" in e]
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert trainer.state.global_step == 2 and len(logs) == 2 and len(losses) == 2
    assert all(math.isfinite(v) for v in losses)
    for entry in logs:
        assert "trl_credit/gtpo/conflict_tokens" in entry and "trl_credit/gtpo/entropy_mean" in entry


def naive_delta(ids, lengths, positive, negative, group, weight=2.0):
    """Reference with plain loops: start run, right-aligned end run, aligned count."""
    n, t = len(ids), len(ids[0])
    delta, count = torch.zeros(n, t), []
    for i in range(n):
        g0 = i - i % group
        members = range(g0, g0 + group)
        active = positive[i] or negative[i]

        def conflicts(tokens_of):
            out = []
            for s in range(lengths[i]):
                tok = tokens_of(i, s)
                in_p = any(positive[j] and s < lengths[j] and tokens_of(j, s) == tok for j in members)
                in_n = any(negative[j] and s < lengths[j] and tokens_of(j, s) == tok for j in members)
                out.append(active and in_p and in_n)
            run = []
            for c in out:
                run.append(c and (not run or run[-1]))
            return run

        start = conflicts(lambda j, s: ids[j][s])
        end_rev = conflicts(lambda j, s: ids[j][lengths[j] - 1 - s])
        w = weight if positive[i] else 0.0
        for s in range(lengths[i]):
            e = end_rev[lengths[i] - 1 - s]
            delta[i, s] = (w if start[s] else 1.0) * (w if e else 1.0)
        count.append(sum(start[s] or end_rev[lengths[i] - 1 - s] for s in range(lengths[i])))
    return delta, count


def test_matches_a_naive_reference_on_random_ragged_groups():
    g = torch.Generator().manual_seed(0)
    n, t, group = 24, 7, 4
    lengths = torch.randint(1, t + 1, (n,), generator=g).tolist()
    ids = [[int(v) for v in torch.randint(1, 3, (lengths[i],), generator=g)] + [0] * (t - lengths[i])
           for i in range(n)]
    sign = torch.randint(-1, 2, (n,), generator=g)
    positive, negative = (sign > 0).tolist(), (sign < 0).tolist()
    delta, count = delta_of(ids, positive, negative, group=group)
    ref_delta, ref_count = naive_delta(ids, lengths, positive, negative, group)
    assert torch.equal(delta, ref_delta)
    assert count.tolist() == ref_count


@pytest.mark.parametrize("mode", ["aligned", "code"])
@pytest.mark.parametrize("token_level", [False, True])
def test_windowed_hook_equals_the_full_width_formula(mode, token_level):
    """The hook only compares the conflict windows; it must equal delta from every position."""
    g = torch.Generator().manual_seed(1)
    n, t, group = 32, 40, 4                       # long runs over a 2-token vocabulary: windows must grow
    lengths = torch.randint(0, t + 1, (n,), generator=g)
    ids = torch.randint(1, 3, (n, t), generator=g)
    ids[:8, :30] = 1                              # two groups share 30 leading tokens
    # the pad id inside the mask (as an EOS would be): an ordinary token, the mask decides what is padding
    ids[ids == 2] = torch.where(torch.rand(int((ids == 2).sum()), generator=g) < 0.1, 0, 2)
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    rewards = torch.randint(0, 2, (n,), generator=g).float()
    batch = make_batch(rewards.tolist(), group, completion_ids=ids * mask, completion_mask=mask, pad_token_id=0)
    seq = grpo_advantages(batch.rewards, torch.ones(1), group, "group", "sum_then_normalize")
    plugin = TokenLevelGTPO if token_level else GTPO
    result = run_plugin(plugin, batch, {"entropy": False, "count_mode": mode})
    delta, n_conflict = conflict_delta(ids * mask, mask, seq > 0, seq < 0, group, 2.0, mode)
    expected = seq[:, None] * delta / n_conflict.clamp(min=1)[:, None]
    torch.testing.assert_close(result.advantages, expected)
    assert n_conflict.max() > 16                  # the windows really grew past their first size


class TokenLevelGTPO(GTPO):
    """GTPO fed an ``(N, T)`` input: the estimator's ``(N,)`` advantages broadcast over the mask first."""

    name = "gtpo"

    @hookimpl
    def transform_advantages(self, batch, advantages):
        return super().transform_advantages(batch, advantages[:, None] * batch.completion_mask)
