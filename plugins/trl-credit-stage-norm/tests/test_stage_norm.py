"""stage_norm: hand-computed vectors (turn-index stages, a stage column, credit and scale options), GRPO parity on
single-turn batches, a loop reference on random batches, edge cases, the contract and a real multi-turn run."""

from __future__ import annotations

import math
import random

import pytest
import torch

from trl_credit import ConfigError, PluginRuntimeError, grpo_advantages, hookimpl
from trl_credit.testing import (ScriptedTurns, check_plugin, make_batch, plugin_set, run_plugin, scripted_turns_reward,
                                train_tiny)
from trl_credit_stage_norm import StageNorm

NAN = math.nan


def turn_batch(counts, outcomes, num_generations, columns=None, **kw):
    """Row i: counts[i] model turns of 2 tokens, a 1-token environment reply between turns."""
    layouts = []
    for c in counts:
        row = []
        for k in range(c):
            row += [1, 1] + ([0] if k + 1 < c else [])
        layouts.append(row)
    width = max(max(len(r) for r in layouts), 1)
    mask = [[1] * len(r) + [0] * (width - len(r)) for r in layouts]
    tool = [r + [1] * (width - len(r)) for r in layouts]
    return make_batch(list(outcomes), num_generations, completion_mask=mask, tool_mask=tool, columns=columns, **kw)


def per_turn(batch, advantages):
    """``(N, K)`` each turn's advantage (NaN past a row's turns), asserting it is constant over the turn's tokens and
    0 on the environment's tokens and padding."""
    turns = batch.turns()
    out = torch.full((batch.num_completions, turns.max_turns), NAN)
    for i in range(batch.num_completions):
        for t in range(batch.width):
            j = int(turns.index[i, t])
            if j < 0:
                assert advantages[i, t] == 0, (i, t)
            elif math.isnan(out[i, j]):
                out[i, j] = advantages[i, t]
            else:
                assert advantages[i, t] == out[i, j], (i, t)
    return out


def nan_equal(a, b, atol=1e-5):
    both = torch.isnan(a) & torch.isnan(b)
    assert a.shape == b.shape and torch.equal(torch.isnan(a), torch.isnan(b))
    torch.testing.assert_close(torch.where(both, 0.0, a), torch.where(both, 0.0, b), atol=atol, rtol=0)


# ----------------------------------------------------------------------------------------- hand vectors
def test_turn_index_stages_with_the_outcome_vector():
    # c = (1, 2, 3), R = (1, 0, 1). Turn 0: r = (1, 0, 1), mean 2/3, unbiased std sqrt(1/3) = 0.577350:
    # (1/3) / 0.577450 = 0.577250, (-2/3) / 0.577450 = -1.154501. Turn 1: rows 1, 2, r = (0, 1), std sqrt(1/2):
    # -/+ 0.5 / 0.707207 = 0.707007. Turn 2: row 2 alone in its stage -> 0.
    result = run_plugin(StageNorm, turn_batch([1, 2, 3], [1.0, 0.0, 1.0], 3))
    nan_equal(per_turn(result.batch, result.advantages),
              torch.tensor([[0.577250, NAN, NAN], [-1.154501, -0.707007, NAN], [0.577250, 0.707007, 0.0]]))
    assert result.metrics["stage_norm/singletons"] == pytest.approx(1 / 6)
    assert result.metrics["stage_norm/stages"] == 3.0 and result.metrics["stage_norm/unstaged"] == 0.0


# Two rows of one group: row 0 has 3 turns in stages [0, 1, 1], row 1 has 2 turns in stages [0, 1];
# per-turn rewards u = [1, 2, 4], [3, 0]; outcomes R = (1, 0).
STAGES, U, R = [[0, 1, 1], [0, 1]], [[1.0, 2.0, 4.0], [3.0, 0.0]], [1.0, 0.0]
VECTORS = [
    # process rewards alone, no scale: stage 0 holds (1, 3), mean 2 -> -1, 1; stage 1 (2, 4, 0), mean 2 -> 0, 2, -2
    ({"outcome_coef": 0.0, "scale": "none"}, [[-1.0, 0.0, 2.0], [1.0, -2.0, NAN]]),
    # scale: stage: std_0 = sqrt(2) -> -/+ 1 / 1.414314 = 0.707057; std_1 = 2 -> 2 / 2.0001 = 0.999950
    ({"outcome_coef": 0.0}, [[-0.707057, 0.0, 0.999950], [0.707057, -0.999950, NAN]]),
    # credit: return, gamma 0.5: row 0: [-1 + 0.5 (0 + 0.5 * 2), 0 + 0.5 * 2, 2]; row 1: [1 + 0.5 (-2), -2]
    ({"outcome_coef": 0.0, "scale": "none", "credit": "return", "gamma": 0.5}, [[-0.5, 1.0, 2.0], [0.0, -2.0, NAN]]),
    # the outcome added to every turn: r = [2, 3, 5], [3, 0]: stage 0 (2, 3) -> -0.5, 0.5; stage 1 (3, 5, 0), mean 8/3
    ({"scale": "none"}, [[-0.5, 1 / 3, 7 / 3], [0.5, -8 / 3, NAN]]),
    # turn_coef -1 (a cost), no outcome: stage 0 (-1, -3) -> 1, -1; stage 1 (-2, -4, 0) -> 0, -2, 2
    ({"outcome_coef": 0.0, "turn_coef": -1.0, "scale": "none"}, [[1.0, 0.0, -2.0], [-1.0, 2.0, NAN]]),
]


@pytest.mark.parametrize("options, expected", VECTORS)
def test_stage_column_vectors(options, expected):
    batch = turn_batch([3, 2], R, 2, columns={"stage": STAGES, "u": U})
    a = run_plugin(StageNorm, batch, {"stage": "stage", "turn_rewards": "u", **options}).advantages
    nan_equal(per_turn(batch, a), torch.tensor(expected))


def test_batch_scale_divides_by_the_std_of_every_scored_turn_reward():
    batch = turn_batch([3, 2], R, 2, columns={"stage": STAGES, "u": U})
    options = {"stage": "stage", "turn_rewards": "u", "outcome_coef": 0.0}
    plain = run_plugin(StageNorm, batch, {**options, "scale": "none"}).advantages
    scaled = run_plugin(StageNorm, batch, {**options, "scale": "batch"}).advantages
    torch.testing.assert_close(scaled, plain / (torch.tensor([1.0, 2.0, 4.0, 3.0, 0.0]).std() + 1e-4))


def test_stages_are_pooled_per_group_not_across_groups():
    # two groups with the same stage labels: each group's stage 0 is normalised on its own
    batch = turn_batch([1, 1, 1, 1], [0.0, 0.0, 1.0, 1.0], 2, columns={"stage": [[0], [0], [0], [0]],
                                                                       "u": [[1.0], [3.0], [10.0], [30.0]]})
    options = {"stage": "stage", "turn_rewards": "u", "scale": "none"}
    a = per_turn(batch, run_plugin(StageNorm, batch, options).advantages)
    nan_equal(a, torch.tensor([[-1.0], [1.0], [-10.0], [10.0]]))


# ------------------------------------------------------------------------------------------ GRPO parity
def test_single_turn_batches_are_trl_grpo():
    rewards = [1.0, 0.0, 0.0, 0.5, 1.0, 1.0, None, 0.0, 0.3, 0.3, 0.3, 0.3]
    batch = make_batch(rewards, 4, lengths=[3, 2, 4, 1, 4, 4, 2, 3, 1, 1, 4, 2])
    a = run_plugin(StageNorm, batch).advantages
    grpo = grpo_advantages(batch.rewards, batch.reward_weights, 4, "group", "sum_then_normalize")
    torch.testing.assert_close(a, grpo.unsqueeze(1) * batch.completion_mask, atol=1e-6, rtol=0)


# --------------------------------------------------------------------- a loop reference, random batches
def reference(counts, outcome, u, stages, g, options):
    """The module docstring's formula with Python loops; ``None`` marks a turn with no stage."""
    scale, coef, ocoef = options.get("scale", "stage"), options.get("turn_coef", 1.0), options.get("outcome_coef", 1.0)
    n = len(counts)
    r = {}
    for i in range(n):
        for k in range(counts[i]):
            if stages[i][k] is None or (ocoef != 0 and math.isnan(outcome[i])):
                continue
            process = 0.0 if u[i][k] is None else u[i][k]
            r[(i, k)] = coef * process + ocoef * (0.0 if math.isnan(outcome[i]) else outcome[i])
    batch_std = torch.tensor(list(r.values()), dtype=torch.float64).std().item() if len(r) > 1 else 0.0
    z = {}
    for (i, k), value in r.items():
        pool = [v for (j, l), v in r.items() if j // g == i // g and stages[j][l] == stages[i][k]]
        mean = sum(pool) / len(pool)
        std = math.sqrt(sum((v - mean) ** 2 for v in pool) / max(len(pool) - 1, 1))
        z[(i, k)] = (value - mean) / {"stage": std + 1e-4, "batch": batch_std + 1e-4, "none": 1.0}[scale]
    return [[z.get((i, k), 0.0) for k in range(counts[i])] for i in range(n)]


@pytest.mark.parametrize("seed", range(3))
def test_matches_a_loop_reference_on_random_batches(seed):
    rng = random.Random(seed)
    g = rng.choice([2, 3, 4])
    n = g * rng.randint(1, 3)
    counts = [rng.randint(1, 4) for _ in range(n)]
    outcome = [NAN if rng.random() < 0.15 else rng.choice([0.0, 1.0, 0.5]) for _ in range(n)]
    u = [[None if rng.random() < 0.1 else round(rng.uniform(-1, 1), 2) for _ in range(c)] for c in counts]
    stages = [[None if rng.random() < 0.1 else rng.randint(0, 2) for _ in range(c)] for c in counts]
    batch = turn_batch(counts, [None if math.isnan(o) else o for o in outcome], g, columns={"u": u, "s": stages})
    for options in ({}, {"scale": "none", "outcome_coef": 0.0}, {"scale": "batch", "turn_coef": -0.5}):
        a = per_turn(batch, run_plugin(StageNorm, batch, {"stage": "s", "turn_rewards": "u", **options}).advantages)
        for i, row in enumerate(reference(counts, outcome, u, stages, g, options)):
            for k, value in enumerate(row):
                assert a[i, k].item() == pytest.approx(value, abs=1e-4), (options, i, k)


# ----------------------------------------------------------------------------------------------- edge cases
def test_all_nan_turn_values_count_as_zero_and_unstaged_turns_get_nothing():
    counts, outcomes = [1, 2, 3], [1.0, 0.0, 1.0]
    none = [[None] * c for c in counts]
    plain = run_plugin(StageNorm, turn_batch(counts, outcomes, 3)).advantages
    with_column = run_plugin(StageNorm, turn_batch(counts, outcomes, 3, columns={"u": none}), {"turn_rewards": "u"})
    assert torch.equal(with_column.advantages, plain)
    unstaged = run_plugin(StageNorm, turn_batch(counts, outcomes, 3, columns={"s": none}), {"stage": "s"})
    assert torch.equal(unstaged.advantages, torch.zeros_like(plain)) and unstaged.metrics["stage_norm/unstaged"] == 1.0


def test_constant_groups_and_single_member_stages_get_zero():
    for outcome in (0.0, 1.0):
        a = run_plugin(StageNorm, turn_batch([1, 3, 2, 3], [outcome] * 4, 4)).advantages
        assert torch.equal(a, torch.zeros_like(a))
    # every stage of the group has one member (distinct stage labels): 0 whatever the scale
    batch = turn_batch([2, 1], [1.0, 0.0], 2, columns={"s": [[0, 1], [2]]})
    for scale in ("stage", "batch", "none"):
        a = run_plugin(StageNorm, batch, {"stage": "s", "scale": scale})
        assert torch.equal(a.advantages, torch.zeros_like(a.advantages)) and a.metrics["stage_norm/singletons"] == 1.0


def test_one_turn_rows_mixed_with_three_turn_rows():
    # rows 0, 1: one turn; rows 2, 3: three. Turn 0 pools all four (R = 1, 0, 1, 0); turns 1, 2 pool rows 2, 3
    batch = turn_batch([1, 1, 3, 3], [1.0, 0.0, 1.0, 0.0], 4)
    a = per_turn(batch, run_plugin(StageNorm, batch, {"scale": "none"}).advantages)
    nan_equal(a, torch.tensor([[0.5, NAN, NAN], [-0.5, NAN, NAN], [0.5, 0.5, 0.5], [-0.5, -0.5, -0.5]]))


def test_nan_outcome_rows_and_one_completion_groups():
    batch = turn_batch([2, 2, 1], [1.0, None, 0.0], 3)
    a = per_turn(batch, run_plugin(StageNorm, batch, {"scale": "none"}).advantages)
    nan_equal(a, torch.tensor([[0.5, 0.0], [0.0, 0.0], [-0.5, NAN]]))  # row 1 out; row 0 alone at turn 1
    # without the outcome in the reward, a NaN outcome no longer removes the row's turns
    b = turn_batch([1, 1], [None, 0.0], 2, columns={"u": [[1.0], [3.0]]})
    a = per_turn(b, run_plugin(StageNorm, b, {"turn_rewards": "u", "outcome_coef": 0.0, "scale": "none"}).advantages)
    nan_equal(a, torch.tensor([[-1.0], [1.0]]))
    lone = run_plugin(StageNorm, turn_batch([2, 3], [1.0, 0.0], 1)).advantages
    assert torch.equal(lone, torch.zeros_like(lone))
    empty = run_plugin(StageNorm, make_batch([1.0, 0.0], 2, lengths=[0, 0])).advantages
    assert torch.equal(empty, torch.zeros(2, 1))


def test_non_integer_stages_are_refused_with_the_row_and_turn():
    batch = turn_batch([2, 1], [1.0, 0.0], 2, columns={"s": [[0, 1.5], [0]]})
    with pytest.raises(Exception, match=r"stage column 's' holds 1.5 at row 0, turn 1; stages must be integers"):
        run_plugin(StageNorm, batch, {"stage": "s"})


def test_options_are_validated_with_the_plugin_and_key():
    for bad, key in (({"scale": "group"}, "scale"), ({"credit": "sum"}, "credit"), ({"gamma": -0.1}, "gamma"),
                     ({"epsilon": 0.0}, "epsilon"), ({"stage": ""}, "stage"), ({"stages": "s"}, "stages"),
                     ({"outcome_coef": 0.0}, "every turn's reward 0"),
                     ({"outcome_coef": 0.0, "turn_rewards": "u", "turn_coef": 0.0}, "outcome_coef")):
        with pytest.raises(ConfigError, match=key) as info:
            plugin_set(StageNorm, bad)
        assert "stage_norm" in str(info.value)


def test_the_per_turn_columns_are_declared_and_a_batch_without_them_is_refused():
    declared = lambda options: plugin_set(StageNorm, options).plugins[0].members.required_turn_values  # noqa: E731
    assert declared({}) == ()
    assert declared({"stage": "s", "turn_rewards": "u"}) == ("s", "u") and declared({"turn_rewards": "u"}) == ("u",)
    batch = turn_batch([2, 1], [1.0, 0.0], 2, columns={"s": [[0, 1], [0]]})
    with pytest.raises(PluginRuntimeError, match=r"plugin 'stage_norm' needs per-turn values \['u'\] "
                                                 r"\(required_turn_values\).*step 0"):
        run_plugin(StageNorm, batch, {"stage": "s", "turn_rewards": "u"})


def test_contract():
    check_plugin(StageNorm, batches=[lambda: turn_batch([1, 2, 3], [1.0, 0.0, 1.0], 3),
                                     lambda: turn_batch([1, 3, 2, 2, 1, 1], [1.0, 0.0, None, 1.0, 1.0, 1.0], 3)])
    check_plugin(StageNorm)  # the kit's single-turn edge cases
    check_plugin(StageNorm, {"stage": "stage", "turn_rewards": "u", "credit": "return", "gamma": 0.9},
                 batches=[lambda: turn_batch([3, 2], R, 2, columns={"stage": STAGES, "u": U})])


# ---------------------------------------------------------------------------------------------- a real run
class SpyStageNorm(StageNorm):
    """StageNorm recording each batch it scored and the advantages it returned."""

    name = "stage_norm"
    seen: list = []

    @hookimpl
    def compute_advantages(self, batch):
        advantages = super().compute_advantages(batch)
        SpyStageNorm.seen.append((batch.turns().count.tolist(), batch.total_reward().tolist(),
                                  batch.column("turn_progress"), batch.column("turn_checks"), batch.num_generations,
                                  per_turn(batch, advantages)))
        return advantages


def test_trains_on_scripted_multi_turn_rollouts(tmp_path):
    SpyStageNorm.seen.clear()
    options = {"stage": "turn_checks", "turn_rewards": "turn_progress", "outcome_coef": 0.5}
    trainer = train_tiny([{"name": SpyStageNorm, **options}], output_dir=tmp_path, rollout_func=ScriptedTurns(),
                         reward_funcs=[scripted_turns_reward], max_completion_length=32)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs and all(math.isfinite(h["loss"]) for h in logs)
    assert all(math.isfinite(h["trl_credit/stage_norm/stages"]) for h in logs)
    assert SpyStageNorm.seen
    for counts, outcome, progress, checks, g, a in SpyStageNorm.seen:  # what it trained on is the formula
        assert len(set(counts)) > 1
        for i, row in enumerate(reference(counts, outcome, progress, checks, g, options)):
            for k, value in enumerate(row):
                assert a[i, k].item() == pytest.approx(value, abs=1e-4)
        assert a.nan_to_num(0.0).abs().sum() > 0
