"""turn_baseline: hand-computed vectors, the exact expected policy gradient on a stop-or-continue MDP (the
estimator is unbiased, survivor-normalised per-turn advantages are not), a loop reference on random batches,
edge cases, the contract and a real multi-turn training run."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from trl_credit import ConfigError, PluginRuntimeError, hookimpl
from trl_credit.testing import (ScriptedTurns, check_plugin, make_batch, plugin_set, run_plugin, scripted_turns_reward,
                                train_tiny)
from trl_credit_turn_baseline import TurnBaseline, turn_advantages, turn_returns

TURN, REPLY = 2, 1  # tokens of a model turn and of an environment reply in the batches built here


def turn_batch(counts, outcomes, num_generations, columns=None, turn_tokens=TURN, reply_tokens=REPLY, **kw):
    """A multi-turn batch: row i has counts[i] model turns of ``turn_tokens`` tokens, replies in between."""
    layouts = []
    for c in counts:
        row = []
        for k in range(c):
            row += [1] * turn_tokens + ([0] * reply_tokens if k + 1 < c else [])
        layouts.append(row)
    width = max(max(len(r) for r in layouts), 1)
    mask = [[1] * len(r) + [0] * (width - len(r)) for r in layouts]
    tool = [r + [1] * (width - len(r)) for r in layouts]
    return make_batch(list(outcomes), num_generations, completion_mask=mask, tool_mask=tool, columns=columns, **kw)


def per_turn(batch, advantages):
    """``(N, K)`` the advantage at the first token of each turn (NaN past a row's turns); asserts it is constant
    over the turn's tokens and 0 on the environment's tokens and padding."""
    turns = batch.turns()
    k = turns.max_turns
    out = torch.full((batch.num_completions, k), math.nan)
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


def nan_equal(a, b, atol=1e-6):
    assert a.shape == b.shape
    both = torch.isnan(a) & torch.isnan(b)
    torch.testing.assert_close(torch.where(both, 0.0, a), torch.where(both, 0.0, b), atol=atol, rtol=0)


# ----------------------------------------------------------------------------------------- hand vectors
COUNTS, OUTCOMES = [1, 2, 3], [1.0, 0.0, 1.0]
U = [[0.2], [0.1, -0.3], [0.0, 0.4, 0.2]]  # per-turn rewards
NAN = math.nan


def test_outcome_only_vector():
    # G_ik = R_i. row 0: others at turn 0 mean(0, 1) -> 0.5; row 1: turn 0 mean(1, 1) -> -1, turn 1 only row 2
    # reached it -> 0 - 1 = -1; row 2: turn 0 mean(1, 0) -> 0.5, turn 1 only row 1 -> 1 - 0 = 1, turn 2 nobody
    # else reached it: the fallback, rows 0 and 1 at their final returns 1 and 0 -> 1 - 0.5 = 0.5
    result = run_plugin(TurnBaseline, turn_batch(COUNTS, OUTCOMES, 3))
    nan_equal(per_turn(result.batch, result.advantages),
              torch.tensor([[0.5, NAN, NAN], [-1.0, -1.0, NAN], [0.5, 1.0, 0.5]]))
    assert result.metrics["turn_baseline/fallback"] == pytest.approx(1 / 6)  # one scored turn of six
    assert result.metrics["turn_baseline/lone"] == 0.0 and result.metrics["turn_baseline/turns"] == 2.0


# gamma = 0.5: G_0 = [0.2 + 1] = [1.2]; G_1 = [0.1 + 0.5 (-0.3), -0.3] = [-0.05, -0.3];
# G_2 = [0 + 0.5 (0.4 + 0.5 (0.2 + 1)), 0.4 + 0.5 * 1.2, 1.2] = [0.5, 1.0, 1.2]; final returns F = [1.2, -0.3, 1.2]
EXPECTED = {
    # turn 0 (everyone reached it): row 0: 1.2 - mean(-0.05, 0.5) = 0.975; row 1: -0.05 - mean(1.2, 0.5) = -0.9;
    # row 2: 0.5 - mean(1.2, -0.05) = -0.075.  reached: row 1 turn 1 vs row 2's 1.0 -> -1.3; row 2 turn 1 vs
    # row 1's -0.3 -> 1.3; row 2 turn 2 vs mean(F_0, F_1) = 0.45 -> 0.75
    "reached": [[0.975, NAN, NAN], [-0.9, -1.3, NAN], [-0.075, 1.3, 0.75]],
    # extended: row 1 turn 1 vs mean(F_0 = 1.2, G_21 = 1.0) -> -1.4; row 2 turn 1 vs mean(1.2, -0.3) -> 0.55
    "extended": [[0.975, NAN, NAN], [-0.9, -1.4, NAN], [-0.075, 0.55, 0.75]],
    # group: every turn against the others' G_j0 (1.2, -0.05, 0.5): row 1 turn 1: -0.3 - 0.85 = -1.15;
    # row 2: 1.0 - 0.575 = 0.425, 1.2 - 0.575 = 0.625
    "group": [[0.975, NAN, NAN], [-0.9, -1.15, NAN], [-0.075, 0.425, 0.625]],
}


@pytest.mark.parametrize("baseline", sorted(EXPECTED))
def test_turn_rewards_and_discount_vector(baseline):
    batch = turn_batch(COUNTS, OUTCOMES, 3, columns={"u": U})
    result = run_plugin(TurnBaseline, batch, {"turn_rewards": "u", "gamma": 0.5, "baseline": baseline})
    nan_equal(per_turn(batch, result.advantages), torch.tensor(EXPECTED[baseline]))


def test_turn_coef_and_reward_column():
    # the cost u enters as -2 u; the outcome column 'solved' is used instead of the weighted total
    batch = turn_batch([1, 2], [[1.0, 5.0], [0.0, 5.0]], 2, columns={"u": [[0.5], [0.25, 0.25]]},
                       reward_names=["solved", "other"])
    a = per_turn(batch, run_plugin(TurnBaseline, batch, {"turn_rewards": "u", "turn_coef": -2.0,
                                                         "reward": "solved"}).advantages)
    # G_0 = [1 - 1] = [0]; G_1 = [-0.5 - 0.5 + 0, -0.5] = [-1, -0.5]; F = [0, -0.5]
    nan_equal(a, torch.tensor([[1.0, NAN], [-1.0, -0.5]]))  # row 1 turn 1: fallback, F_0 = 0


# ------------------------------------------------------------- the bias test: exact expectations on an MDP
# Stop or continue: at turns 0 and 1 the policy continues with probability p_k = sigmoid(theta_k) (turn 2 is the
# last one allowed: it stops). Stopping after c turns pays the outcome R_c; every turn costs 0.2 (a per-turn
# reward). Scores of the action of turn k: d log p / d theta = 1 - p (continue), -p (stop).
# Every joint outcome of a group of G = 3 trajectories (3^3 = 27) is one group of one batch, so one call of the
# estimator gives every advantage; E[g] = sum over groups of P(group) * (1/G) sum_i sum_k A_ik score_ik.
# Pure tensors: the estimator's own functions (the hook runs exactly these; checked below), no model, no kit.
R_C, COST, G = [0.1, 1.0, 0.1], -0.2, 3


def mdp(theta: torch.Tensor):
    """``(probability of c = 1, 2, 3 turns (3,), score (c, k, dim theta), J)`` for logits ``theta`` of shape (2,)
    (one per decision) or (1,) (one shared 'keep going' logit)."""
    logits = theta.expand(2) if theta.numel() == 1 else theta
    p = torch.sigmoid(logits)
    probs = torch.stack([1 - p[0], p[0] * (1 - p[1]), p[0] * p[1]])
    value = torch.tensor([R_C[c - 1] + COST * c for c in (1, 2, 3)], dtype=theta.dtype)
    objective = (probs * value).sum()
    score = torch.zeros(3, 3, theta.numel(), dtype=theta.dtype)
    d = p.detach()
    for c in (1, 2, 3):
        for k in range(min(c, 2)):  # turn 2 is forced: no decision, no score
            s = (1 - d[k]) if k < c - 1 else -d[k]
            score[c - 1, k, 0 if theta.numel() == 1 else k] += s
    return probs.detach(), score, objective


# all joint outcomes of a group: (27, G) turn counts, flattened to 81 rows in 27 groups
MDP_COMBOS = torch.tensor(list(itertools.product([1, 2, 3], repeat=G)))
MDP_COUNTS = MDP_COMBOS.reshape(-1)


def mdp_returns(gamma):
    outcome = torch.tensor([R_C[c - 1] for c in MDP_COUNTS.tolist()], dtype=torch.float64)
    return turn_returns(outcome, torch.full((MDP_COUNTS.numel(), 3), COST, dtype=torch.float64), MDP_COUNTS, gamma)


def expected_gradient(per_turn_advantages, weights, score):
    g = (per_turn_advantages.nan_to_num(0.0).double().unsqueeze(-1) * score[MDP_COUNTS - 1]).sum(1)  # (N, dim)
    return (weights.unsqueeze(1) * g.reshape(-1, G, g.shape[1]).sum(1)).sum(0) / G


def naive(returns, valid, num_generations, std: bool):
    """Survivor-normalised per-turn advantages: the mean (and unbiased std) over the group's rows that reached
    turn k, row i included; a lone survivor gets 0 (as GRPO's constant groups)."""
    x = returns.reshape(-1, num_generations, returns.shape[1])
    m = valid.reshape(x.shape).double()
    n = m.sum(1, keepdim=True)
    mean = (x * m).sum(1, keepdim=True) / n.clamp(min=1)
    a = x - mean
    if std:
        sd = ((((x - mean) ** 2) * m).sum(1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()
        a = torch.where(n >= 2, a / (sd + 1e-4), 0.0)
    return (a * m).reshape(returns.shape)


@pytest.mark.parametrize("shared", [True, False])
def test_expected_gradient_is_the_policy_gradient_and_naive_normalisation_is_biased(shared):
    theta = torch.tensor([-0.6] if shared else [-0.6, 0.3], dtype=torch.float64, requires_grad=True)
    probs, score, objective = mdp(theta)
    true, = torch.autograd.grad(objective, theta)
    weights = probs[MDP_COMBOS - 1].prod(1)
    assert weights.sum().item() == pytest.approx(1.0)
    returns, valid, final = mdp_returns(1.0)
    for baseline in ("reached", "extended", "group"):
        a, _ = turn_advantages(returns, valid, final, G, baseline)
        torch.testing.assert_close(expected_gradient(a, weights, score), true, atol=1e-12, rtol=1e-10)
    biased_mean = expected_gradient(naive(returns, valid, G, std=False), weights, score)
    biased_std = expected_gradient(naive(returns, valid, G, std=True), weights, score)
    if shared:  # one 'keep going' logit: the true gradient says stop earlier, both naive estimators say go on
        assert true.item() == pytest.approx(-0.0182012, abs=1e-6)
        assert biased_mean.item() == pytest.approx(0.0194496, abs=1e-6)
        assert biased_std.item() > 0.04
    else:  # a logit per decision: turn 0's term is shrunk by 1 - 1/G exactly, turn 1's by more (rarer survivors)
        ratio = biased_mean / true
        assert ratio[0].item() == pytest.approx(2 / 3, abs=1e-9) and ratio[1].item() < 0.6
        cosine = torch.nn.functional.cosine_similarity(biased_std, true, dim=0)
        assert cosine.item() < 0.99  # not even parallel to the policy gradient


def test_discounted_returns_keep_the_expected_gradient_of_no_baseline():
    # gamma < 1: the baseline changes nothing in expectation: E[sum_k score A_k] = E[sum_k score G_k]
    probs, score, _ = mdp(torch.tensor([-0.6, 0.3], dtype=torch.float64))
    weights = probs[MDP_COMBOS - 1].prod(1)
    returns, valid, final = mdp_returns(0.8)
    plain = expected_gradient(returns, weights, score)  # returns are 0 past a row's turns
    for baseline in ("reached", "extended", "group"):
        a, _ = turn_advantages(returns, valid, final, G, baseline)
        torch.testing.assert_close(expected_gradient(a, weights, score), plain, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("gamma", [1.0, 0.8])
def test_the_hook_computes_the_mdp_advantages(gamma):
    # the bias test's advantages are the plugin's: the hook on the 81-row batch (cost as a per-turn column)
    batch = turn_batch(MDP_COUNTS.tolist(), [R_C[c - 1] for c in MDP_COUNTS.tolist()], G,
                       columns={"cost": [[COST] * c for c in MDP_COUNTS.tolist()]})
    returns, valid, final = mdp_returns(gamma)
    for baseline in ("reached", "extended", "group"):
        a = per_turn(batch, run_plugin(TurnBaseline, batch, {"turn_rewards": "cost", "gamma": gamma,
                                                             "baseline": baseline}).advantages)
        expected, _ = turn_advantages(returns, valid, final, G, baseline)
        nan_equal(a, torch.where(valid, expected, math.nan).float(), atol=1e-6)


# ------------------------------------------------------------------------- a loop reference, random batches
def reference(counts, outcome, u, g, gamma, baseline):
    """The formula of the module docstring, with Python loops (None: no turn)."""
    n = len(counts)
    ret, final = [], []
    for i in range(n):
        r = [0.0] * counts[i]
        acc = 0.0
        for k in reversed(range(counts[i])):
            acc = u[i][k] + (outcome[i] if k == counts[i] - 1 else gamma * acc)
            r[k] = acc
        ret.append(r)
        final.append(math.nan if math.isnan(outcome[i]) else (r[-1] if r else outcome[i]))
    out = []
    for i in range(n):
        row = []
        others = [j for j in range(n) if j // g == i // g and j != i and not math.isnan(final[j])]
        for k in range(counts[i]):
            if math.isnan(final[i]):
                row.append(0.0)
                continue
            held = [ret[j][k] if k < counts[j] else final[j] for j in others]
            reached = [ret[j][k] for j in others if k < counts[j]]
            if baseline == "group":
                held = [ret[j][0] if counts[j] else final[j] for j in others]
            pool = reached if baseline == "reached" and reached else held
            row.append(ret[i][k] - sum(pool) / len(pool) if pool else 0.0)
        out.append(row)
    return out


@pytest.mark.parametrize("seed", range(3))
def test_matches_a_loop_reference_on_random_batches(seed):
    rng = random.Random(seed)
    g = rng.choice([2, 3, 4])
    n = g * rng.randint(1, 4)
    counts = [rng.randint(1, 4) for _ in range(n)]
    outcome = [math.nan if rng.random() < 0.15 else rng.choice([0.0, 1.0, 0.5]) for _ in range(n)]
    u = [[round(rng.uniform(-1, 1), 2) for _ in range(c)] for c in counts]
    gamma = rng.choice([1.0, 0.9])
    batch = turn_batch(counts, [None if math.isnan(o) else o for o in outcome], g, columns={"u": u})
    for baseline in ("reached", "extended", "group"):
        a = per_turn(batch, run_plugin(TurnBaseline, batch, {"turn_rewards": "u", "gamma": gamma,
                                                             "baseline": baseline}).advantages)
        expected = reference(counts, outcome, u, g, gamma, baseline)
        for i, row in enumerate(expected):
            for k, value in enumerate(row):
                assert a[i, k].item() == pytest.approx(value, abs=1e-5), (baseline, i, k)


# ----------------------------------------------------------------------------------------------- edge cases
def test_single_turn_batch_is_rloo():
    result = run_plugin(TurnBaseline, make_batch([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0], 4, lengths=[3] * 8))
    expected = torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3, 1 / 3, 1 / 3, -1.0, 1 / 3])
    torch.testing.assert_close(result.advantages, expected.unsqueeze(1).expand(8, 3).contiguous())


def test_all_nan_turn_values_are_no_turn_rewards():
    none = [[None] * c for c in COUNTS]
    batch = turn_batch(COUNTS, OUTCOMES, 3, columns={"u": none})
    with_column = run_plugin(TurnBaseline, batch, {"turn_rewards": "u"}).advantages
    assert torch.equal(with_column, run_plugin(TurnBaseline, turn_batch(COUNTS, OUTCOMES, 3)).advantages)


def test_constant_groups_get_zero():
    # same outcome everywhere, gamma 1, no turn rewards: every return equals every baseline, whatever the turns
    for outcome in (0.0, 1.0):
        a = run_plugin(TurnBaseline, turn_batch([1, 3, 2, 3], [outcome] * 4, 4)).advantages
        assert torch.equal(a, torch.zeros_like(a))


def test_one_turn_rows_mixed_with_three_turn_rows():
    # rows 0, 1: one turn; rows 2, 3: three turns. Turn 1 and 2 of row 2 compare with row 3 only (reached)
    batch = turn_batch([1, 1, 3, 3], [1.0, 0.0, 1.0, 0.0], 4)
    a = per_turn(batch, run_plugin(TurnBaseline, batch).advantages)
    nan_equal(a, torch.tensor([[2 / 3, NAN, NAN], [-2 / 3, NAN, NAN], [2 / 3, 1.0, 1.0], [-2 / 3, -1.0, -1.0]]))


def test_nan_outcomes_one_completion_groups_and_empty_completions():
    # row 1's outcome is NaN: it gets 0 and is in no baseline; row 0 compares with row 2 only
    batch = turn_batch([2, 2, 1], [1.0, None, 0.0], 3)
    a = per_turn(batch, run_plugin(TurnBaseline, batch).advantages)
    nan_equal(a, torch.tensor([[1.0, 1.0], [0.0, 0.0], [-1.0, NAN]]))
    lone = run_plugin(TurnBaseline, turn_batch([2, 1], [1.0, 0.0], 1))  # G = 1: nothing to compare with
    assert torch.equal(lone.advantages, torch.zeros_like(lone.advantages)) and lone.metrics["turn_baseline/lone"] == 1
    empty = run_plugin(TurnBaseline, make_batch([1.0, 0.0], 2, lengths=[0, 0])).advantages
    assert empty.shape == (2, 1) and torch.equal(empty, torch.zeros(2, 1))


def test_scale_batch_divides_by_one_std():
    batch = turn_batch(COUNTS, OUTCOMES, 3, columns={"u": U})
    plain = run_plugin(TurnBaseline, batch, {"turn_rewards": "u", "gamma": 0.5}).advantages
    scaled = run_plugin(TurnBaseline, batch, {"turn_rewards": "u", "gamma": 0.5, "scale": "batch"}).advantages
    values = torch.tensor([0.975, -0.9, -1.3, -0.075, 1.3, 0.75])
    torch.testing.assert_close(scaled, plain / (values.std() + 1e-4))


def test_pure_functions_on_a_turnless_batch():
    returns, valid, final = turn_returns(torch.tensor([1.0, 0.0]), torch.zeros(2, 0), torch.tensor([0, 0]), 1.0)
    a, source = turn_advantages(returns, valid, final, 2)
    assert a.shape == (2, 0) and final.tolist() == [1.0, 0.0]


def test_options_are_validated_with_the_plugin_and_key():
    for bad, key in (({"baseline": "survivors"}, "baseline"), ({"gamma": 1.5}, "gamma"), ({"epsilon": 0}, "epsilon"),
                     ({"scale": "group"}, "scale"), ({"turn_rewards": ""}, "turn_rewards"), ({"gama": 1}, "gama")):
        with pytest.raises(ConfigError, match=key) as info:
            plugin_set(TurnBaseline, bad)
        assert "turn_baseline" in str(info.value)


def test_the_per_turn_column_is_declared_and_a_batch_without_it_is_refused():
    assert plugin_set(TurnBaseline, {}).plugins[0].members.required_turn_values == ()
    assert plugin_set(TurnBaseline, {"turn_rewards": "u"}).plugins[0].members.required_turn_values == ("u",)
    with pytest.raises(PluginRuntimeError, match=r"plugin 'turn_baseline' needs per-turn values \['u'\] "
                                                 r"\(required_turn_values\).*step 0"):
        run_plugin(TurnBaseline, turn_batch(COUNTS, OUTCOMES, 3), {"turn_rewards": "u"})


def test_contract():
    check_plugin(TurnBaseline, batches=[lambda: turn_batch(COUNTS, OUTCOMES, 3),
                                        lambda: turn_batch([1, 3, 2, 2, 1, 1], [1.0, 0.0, None, 1.0, 1.0, 1.0], 3)])
    check_plugin(TurnBaseline)  # the kit's single-turn edge cases
    check_plugin(TurnBaseline, {"turn_rewards": "u", "gamma": 0.9, "baseline": "extended", "scale": "batch"},
                 batches=[lambda: turn_batch(COUNTS, OUTCOMES, 3, columns={"u": U})])


# ---------------------------------------------------------------------------------------------- a real run
class SpyTurnBaseline(TurnBaseline):
    """TurnBaseline recording each batch it scored and the advantages it returned."""

    name = "turn_baseline"
    seen: list = []

    @hookimpl
    def compute_advantages(self, batch):
        advantages = super().compute_advantages(batch)
        SpyTurnBaseline.seen.append((batch.turns().count.tolist(), batch.column("turn_checks"),
                                     batch.total_reward().tolist(), batch.num_generations,
                                     per_turn(batch, advantages)))
        return advantages


def test_trains_on_scripted_multi_turn_rollouts(tmp_path):
    SpyTurnBaseline.seen.clear()
    trainer = train_tiny([{"name": SpyTurnBaseline, "turn_rewards": "turn_checks", "turn_coef": 0.1, "gamma": 0.9}],
                         output_dir=tmp_path, rollout_func=ScriptedTurns(), reward_funcs=[scripted_turns_reward],
                         max_completion_length=32)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs and all(math.isfinite(h["loss"]) for h in logs)
    assert all(math.isfinite(h["trl_credit/turn_baseline/turns"]) for h in logs)
    assert SpyTurnBaseline.seen
    for counts, checks, outcome, g, a in SpyTurnBaseline.seen:  # what it trained on is the formula
        assert len(set(counts)) > 1  # the scripted rollouts stop after 1..3 turns
        u = [[0.1 * v for v in row] for row in checks]
        expected = reference(counts, outcome, u, g, 0.9, "reached")
        for i, row in enumerate(expected):
            for k, value in enumerate(row):
                assert a[i, k].item() == pytest.approx(value, abs=1e-5)
        assert a.nan_to_num(0.0).abs().sum() > 0
