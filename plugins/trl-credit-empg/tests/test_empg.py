"""EMPG: methods.md's vector in turn mode and step mode, the final normalisations, edge cases (a single-turn batch,
equal entropies, constant groups, one-turn rows beside three-turn rows, NaN rewards and an empty completion, dropped
completions, token-level input), option checks, the contract on a multi-turn batch and a real multi-turn run."""

from __future__ import annotations

import math

import pytest
import torch

from trl_credit import ConfigError, Plugin, hookimpl
from trl_credit.testing import (ScriptedTurns, check_plugin, make_batch, run_plugin, scripted_turns_reward,
                                tiny_tokenizer, train_tiny)
from trl_credit_empg import EMPG, modulate, step_entropies

E1, E5 = math.exp(-1.0), math.exp(-0.5)
RAW = {"normalise": "none"}

# methods.md 2.19 (kappa = kappa' = 1, zeta = 0.1), before the final normalisation: traj 1 A = +1 with step entropies
# [0, 1], traj 2 A = -1 with [0.5, 0.5]. Hn = H (min 0, max 1); exp(-Hn) = [1, e^-1, e^-.5, e^-.5], mean
# m = 0.645235; g = [1.549822, 0.570148, 0.940015, 0.940015]; bonus on each first step: 0.1 e^-Hn(next) =
# 0.1 e^-1 (traj 1), 0.1 e^-.5 (traj 2). Exact values 1.586610, 0.570148, -0.879362, -0.940015 (methods.md
# prints 1.586609: its rounding).
VECTOR = [[1.586609, 0.570148], [-0.879362, -0.940015]]


def turn_batch(rewards=(2.0, 0.0), **kw):
    """Two rollouts of one group, model turns at tokens 0-1 and 3-5 (row 0) / 3-4 (row 1), a reply at token 2.

    Turn entropies: row 0 mean 0 and mean 1 (0.5, 1.5, 1.0), row 1 mean 0.5 and 0.5 (0.2, 0.8); the reply token has
    entropy 9 (not the model's: ignored). Rewards [2, 0] with scale_rewards none give A = [+1, -1]."""
    tool = [[1, 1, 0, 1, 1, 1], [1, 1, 0, 1, 1, 0]]
    mask = [[1] * 6, [1, 1, 1, 1, 1, 0]]
    entropies = torch.tensor([[0.0, 0.0, 9.0, 0.5, 1.5, 1.0], [0.5, 0.5, 9.0, 0.2, 0.8, 0.0]])
    return make_batch(list(rewards), 2, completion_mask=mask, tool_mask=tool, entropies=entropies,
                      scale_rewards="none", **kw)


def per_token(step_values, layout):
    """Token advantages from per-step values: ``layout`` gives each token's step (-1: none, 0)."""
    return torch.tensor([[values[k] if k >= 0 else 0.0 for k in row] for values, row in zip(step_values, layout)])


TURN_LAYOUT = [[0, 0, -1, 1, 1, 1], [0, 0, -1, 1, 1, -1]]


def test_methods_vector_in_turn_mode():
    result = run_plugin(EMPG, turn_batch(), RAW)
    torch.testing.assert_close(result.advantages, per_token(VECTOR, TURN_LAYOUT), atol=1e-5, rtol=0)
    assert result.metrics["empg/step_entropy"] == pytest.approx(0.5)
    assert result.metrics["empg/scale_max"] == pytest.approx(1.549822, abs=1e-6)
    assert result.metrics["empg/scale_min"] == pytest.approx(0.570148, abs=1e-6)
    assert result.metrics["empg/steps"] == 2.0


def test_final_normalisation_over_steps_and_over_tokens():
    # steps: the four step values weigh 1 each: mu = 0.084345, population sigma = 1.057219
    # -> [1.420959, 0.459510], [-0.911549, -0.968919]
    steps = run_plugin(EMPG, turn_batch(), {}).advantages
    expected = [[1.420959, 0.459510], [-0.911549, -0.968919]]
    torch.testing.assert_close(steps, per_token(expected, TURN_LAYOUT), atol=2e-5, rtol=0)
    # tokens: the steps weigh 2, 3, 2, 2 tokens: mu = 0.138323, sigma = 1.008380
    tokens = run_plugin(EMPG, turn_batch(), {"normalise": "tokens"}).advantages
    expected = [[1.436251, 0.428236], [-1.009227, -1.069376]]
    torch.testing.assert_close(tokens, per_token(expected, TURN_LAYOUT), atol=2e-5, rtol=0)
    loss_tokens = torch.tensor(TURN_LAYOUT) >= 0
    assert abs(float(tokens[loss_tokens].mean())) < 1e-6
    assert float(tokens[loss_tokens].std(unbiased=False)) == pytest.approx(1.0, abs=1e-5)


def test_methods_vector_in_step_mode():
    tok = tiny_tokenizer()
    texts = ["First step\nSecond step", "One\nTwo"]
    ids = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    # steps (the newline closes the first, the EOS belongs to the last): row 0 tokens 0-2 | 3-5, row 1 0-1 | 2-3
    entropies = torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.5, 1.5], [0.5, 0.5, 0.2, 0.8, 0.0, 0.0]])
    batch = make_batch([2.0, 0.0], 2, completion_ids=ids, completions=texts, tokenizer=tok, entropies=entropies,
                       scale_rewards="none")
    result = run_plugin(EMPG, batch, {"segments": "steps", **RAW})
    layout = [[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, -1, -1]]
    torch.testing.assert_close(result.advantages, per_token(VECTOR, layout), atol=1e-5, rtol=0)


def test_a_single_turn_batch_has_no_future_bonus():
    # no tool mask: each completion is one step, mean entropies 0 and 1 -> Hn [0, 1], g = 2 / (1 + e^-1) = 1.462117
    # and 2 e^-1 / (1 + e^-1) = 0.537883, no next step: A = [1.462117, -0.537883]
    entropies = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.5, 1.5]])
    batch = make_batch([2.0, 0.0], 2, lengths=[3, 3], entropies=entropies, scale_rewards="none")
    result = run_plugin(EMPG, batch, RAW)
    torch.testing.assert_close(result.advantages, torch.tensor([[1.462117] * 3, [-0.537883] * 3]), atol=1e-5,
                               rtol=0)
    assert result.metrics["empg/bonus"] == 0.0
    # steps mode on a completion without a delimiter: the same single step (the stand-in tokenizer spreads the text)
    steps = run_plugin(EMPG, make_batch([2.0, 0.0], 2, lengths=[3, 3], entropies=entropies, scale_rewards="none",
                                        completions=["abc", "def"]), {"segments": "steps", **RAW})
    torch.testing.assert_close(steps.advantages, result.advantages)


def test_equal_entropies_leave_grpo_plus_a_constant_bonus():
    batch = make_batch([2.0, 0.0], 2, completion_mask=[[1] * 6] * 2, tool_mask=[[1, 1, 0, 1, 1, 1]] * 2,
                       entropies=torch.full((2, 6), 0.7), scale_rewards="none")
    a = run_plugin(EMPG, batch, RAW).advantages
    # Hn = 0 everywhere: g = 1, bonus = zeta * e^0 = 0.1 on each first turn
    torch.testing.assert_close(a, per_token([[1.1, 1.0], [-0.9, -1.0]], [[0, 0, -1, 1, 1, 1]] * 2))


def test_constant_groups_keep_only_the_bonus_and_stay_finite():
    result = run_plugin(EMPG, turn_batch(rewards=(1.0, 1.0)), RAW)
    # A = 0: the first turns carry the bonus 0.1 e^-1 (row 0) and 0.1 e^-0.5 (row 1), the last turns 0
    torch.testing.assert_close(result.advantages, per_token([[0.1 * E1, 0.0], [0.1 * E5, 0.0]], TURN_LAYOUT))
    normalised = run_plugin(EMPG, turn_batch(rewards=(1.0, 1.0)), {}).advantages
    assert torch.isfinite(normalised).all() and normalised[0, 0] > 0 > normalised[0, 3]


def test_one_turn_rows_beside_three_turn_rows():
    # row 0: turns at 0, 2, 4 (replies at 1, 3) with entropies 0, 0.5, 1 and A = +1; row 1: one turn, entropy 0.5,
    # A = -1. exp(-Hn) = [1, e^-.5, e^-1 | e^-.5], m = 0.645235, g = [1.549822, 0.940015, 0.570148 | 0.940015];
    # bonuses 0.1 e^-.5 and 0.1 e^-1 on row 0's first two turns -> [1.610476, 0.976803, 0.570148 | -0.940015]
    tool = [[1, 0, 1, 0, 1], [1, 1, 1, 1, 1]]
    entropies = torch.tensor([[0.0, 5.0, 0.5, 5.0, 1.0], [0.5, 0.5, 0.5, 0.5, 0.5]])
    batch = make_batch([2.0, 0.0], 2, completion_mask=[[1] * 5] * 2, tool_mask=tool, entropies=entropies,
                       scale_rewards="none")
    a = run_plugin(EMPG, batch, RAW).advantages
    expected = torch.tensor([[1.610476, 0.0, 0.976803, 0.0, 0.570148], [-0.940015] * 5])
    torch.testing.assert_close(a, expected, atol=1e-5, rtol=0)


def test_nan_rewards_and_an_empty_completion_stay_finite():
    entropies = torch.rand(4, 5, generator=torch.Generator().manual_seed(0))
    batch = make_batch([1.0, None, 0.0, None], 2, lengths=[5, 0, 3, 2], entropies=entropies)
    a = run_plugin(EMPG, batch, {}).advantages
    assert torch.isfinite(a).all() and (a[1] == 0).all()  # the empty completion has no token


class DropLast(Plugin):
    """Drops the last completion of the batch."""

    @hookimpl
    def filter_rollouts(self, batch):
        keep = torch.ones(batch.num_completions, dtype=torch.bool)
        keep[-1] = False
        return keep


def test_dropped_completions_do_not_enter_the_statistics():
    # a group of three: rewards [2, 0, 1] (scale none: A = [+1, -1, 0], the dropped row counts in the baseline); the
    # third row's entropy 10 would stretch the min-max range: dropped, it leaves the vector unchanged
    tool = [[1, 1, 0, 1, 1, 1], [1, 1, 0, 1, 1, 0], [1] * 6]
    mask = [[1] * 6, [1, 1, 1, 1, 1, 0], [1] * 6]
    entropies = torch.tensor([[0.0, 0.0, 9.0, 0.5, 1.5, 1.0], [0.5, 0.5, 9.0, 0.2, 0.8, 0.0], [10.0] * 6])

    def batch():
        return make_batch([2.0, 0.0, 1.0], 3, completion_mask=mask, tool_mask=tool, entropies=entropies,
                          scale_rewards="none")

    a = run_plugin(DropLast, batch(), others=[{"name": EMPG, **RAW}]).advantages
    torch.testing.assert_close(a[:2], per_token(VECTOR, TURN_LAYOUT), atol=1e-5, rtol=0)
    assert (a[2] == 0).all()
    kept = run_plugin(EMPG, batch(), RAW).advantages
    assert not torch.allclose(kept[:2], a[:2], atol=1e-3)


def test_unscored_completions_do_not_enter_the_statistics():
    # as above, with the third row unscored instead of dropped (every reward None): GRPO leaves it out of the
    # baseline (A = [+1, -1, 0]), EMPG out of its entropy statistics, and it gets 0
    tool = [[1, 1, 0, 1, 1, 1], [1, 1, 0, 1, 1, 0], [1] * 6]
    mask = [[1] * 6, [1, 1, 1, 1, 1, 0], [1] * 6]
    entropies = torch.tensor([[0.0, 0.0, 9.0, 0.5, 1.5, 1.0], [0.5, 0.5, 9.0, 0.2, 0.8, 0.0], [10.0] * 6])
    batch = make_batch([2.0, 0.0, None], 3, completion_mask=mask, tool_mask=tool, entropies=entropies,
                       scale_rewards="none")
    a = run_plugin(EMPG, batch, RAW).advantages
    torch.testing.assert_close(a[:2], per_token(VECTOR, TURN_LAYOUT), atol=1e-5, rtol=0)
    assert (a[2] == 0).all()


def test_step_mode_leaves_out_environment_tokens():
    tok = tiny_tokenizer()
    texts = ["First step\nSecond step", "One\nTwo"]
    ids = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    tool = [[1, 1, 1, 1, 0, 1], [1, 1, 1, 1, 1, 1]]  # row 0's fifth token is the environment's

    def advantages(env_entropy):
        entropies = torch.tensor([[0.0, 0.0, 0.0, 1.0, env_entropy, 1.5], [0.5, 0.5, 0.2, 0.8, 0.0, 0.0]])
        batch = make_batch([2.0, 0.0], 2, completion_ids=ids, completions=texts, tokenizer=tok, entropies=entropies,
                           tool_mask=tool, scale_rewards="none")
        return run_plugin(EMPG, batch, {"segments": "steps", **RAW}).advantages

    low, high = advantages(0.0), advantages(50.0)
    torch.testing.assert_close(low, high)  # the environment token's entropy enters no step mean
    assert low[0, 4] == 0 and low[0, 3] != 0


class TokenAdvantages(Plugin):
    """Turns (N,) advantages into (N, T): twice the advantage on each row's first token."""

    @hookimpl
    def transform_advantages(self, batch, advantages):
        out = advantages.unsqueeze(1).expand(-1, batch.width).clone()
        out[:, 0] *= 2
        return out


def test_token_level_input_is_modulated_token_by_token():
    a = run_plugin(TokenAdvantages, turn_batch(), others=[{"name": EMPG, **RAW}]).advantages
    g0, g2 = 1.549822, 0.940015
    assert a[0, 0] == pytest.approx(2 * g0 + 0.1 * E1, abs=1e-5) and a[0, 1] == pytest.approx(g0 + 0.1 * E1, abs=1e-5)
    assert a[1, 0] == pytest.approx(-2 * g2 + 0.1 * E5, abs=1e-5)


def test_pieces():
    h, n = step_entropies(torch.tensor([[1.0, 3.0, 7.0, 2.0]]), torch.tensor([[0, 0, -1, 1]]))
    assert h.tolist() == [[2.0, 2.0]] and n.tolist() == [[2.0, 1.0]]
    g, bonus = modulate(torch.tensor([[0.0, 1.0]]), torch.tensor([[True, False]]), 1.0, 1.0, 0.1)
    assert g.tolist() == [[1.0, 0.0]] and bonus.tolist() == [[0.0, 0.0]]  # no next step with tokens: no bonus


@pytest.mark.parametrize("key, value", [("kappa", -1.0), ("zeta", -0.1), ("segments", "lines"),
                                        ("pattern", "("), ("normalise", "batch"), ("kapa", 1.0)])
def test_bad_options_are_config_errors(key, value):
    with pytest.raises(ConfigError, match=key if key != "kapa" else "kapa"):
        run_plugin(EMPG, turn_batch(), {key: value})


def multi_turn_batch():
    """Two groups of rollouts with 1 to 3 model turns, replies between them, ragged lengths and random entropies."""
    tool = [[1, 1, 0, 1, 1, 0, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1], [1, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 1, 1, 1],
            [1, 1, 1, 1, 1, 1, 1, 1], [1, 0, 1, 0, 1, 1, 1, 1], [1, 1, 0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]]
    lengths = [8, 5, 6, 8, 3, 7, 8, 2]
    g = torch.Generator().manual_seed(3)
    return make_batch([1.0, 0.0, 0.0, 1.0, 0.5, None, 1.0, 0.0], 4, lengths=lengths, tool_mask=tool,
                      entropies=torch.rand(8, 8, generator=g) * 3)


def test_contract():
    check_plugin(EMPG)
    check_plugin(EMPG, {"segments": "steps"})
    check_plugin(EMPG, batches=[multi_turn_batch])
    check_plugin(EMPG, {"normalise": "tokens", "kappa": 2.0}, batches=[multi_turn_batch])


class Seen(Plugin):
    """Records the final advantages and turns of every trained batch."""

    records: list = []

    @hookimpl
    def on_batch_end(self, batch, advantages):
        Seen.records.append((advantages.clone(), batch.turns(), batch.kept.clone()))


def test_trains_on_scripted_multi_turn_rollouts(tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    Seen.records.clear()
    trainer = train_tiny(["empg", Seen], output_dir=tmp_path, rollout_func=ScriptedTurns(),
                         reward_funcs=[scripted_turns_reward], max_completion_length=32)
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2 and all(math.isfinite(h["loss"]) for h in logged)
    assert all(math.isfinite(h["trl_credit/empg/step_entropy"]) and h["trl_credit/empg/scale_max"] >= 1.0
               for h in logged)
    assert len(Seen.records) == 2
    for advantages, turns, kept in Seen.records:
        assert advantages.dim() == 2 and torch.isfinite(advantages).all()
        assert turns.count.max() > 1  # multi-turn rollouts
        assert (advantages[turns.env] == 0).all()  # the environment's tokens get no credit
        # the trained advantages are constant over each turn, and the step-weighted batch z-score holds
        index = turns.index
        for k in range(turns.max_turns):
            on = index == k
            first = torch.where(on, advantages, float("nan")).nanmean(dim=1, keepdim=True)
            assert torch.allclose(advantages[on], first.expand_as(advantages)[on], atol=1e-6)
        weight = torch.where(index >= 0, 1.0 / turns.lengths.gather(1, index.clamp(min=0)).clamp(min=1), 0.0)
        mu = float((weight * advantages).sum() / weight.sum())
        var = float((weight * (advantages - mu) ** 2).sum() / weight.sum())
        assert abs(mu) < 1e-5 and var == pytest.approx(1.0, abs=1e-4)
