"""Progress-potential shaping: hand-computed vectors (carried potentials, Ng's terminal 0 and the last state, the
shaping rewards, their discounted returns, the add and index advantages), the telescoping identity on random
trajectories, a guess_distance batch (lower is better), edge cases (single-turn batch, all-NaN progress, constant
groups, NaN outcomes, a missing column refused by the host), the contract on multi-turn batches and a real training run on
ScriptedTurns rollouts."""

from __future__ import annotations

import math

import pytest
import torch

from trl_credit import ConfigError, Plugin, PluginRuntimeError, hookimpl
from trl_credit.testing import check_plugin, make_batch, plugin_set, run_plugin, train_tiny
from trl_credit_progress_potential import ProgressPotential, index_normalise, potentials, shaping_rewards

# One group of four. Model turns (m) and environment replies (e), in tokens:
#   row 0: m m e m m e m      3 turns: tokens {0, 1}, {3, 4}, {6}
#   row 1: m e e m e m m      3 turns: {0}, {3}, {5, 6}
#   row 2: m m m              1 turn:  {0, 1, 2}
#   row 3: m m e m            2 turns: {0, 1}, {3}
TOOL = [[1, 1, 0, 1, 1, 0, 1], [1, 0, 0, 1, 0, 1, 1], [1, 1, 1, 1, 1, 1, 1], [1, 1, 0, 1, 1, 1, 1]]
LENGTHS = [7, 7, 3, 4]
TURN = [[0, 0, -1, 1, 1, -1, 2], [0, -1, -1, 1, -1, 2, 2], [0, 0, 0, -1, -1, -1, -1], [0, 0, -1, 1, -1, -1, -1]]
PROGRESS = [[0.2, 0.5, 0.9], [0.4, None, 0.6], [0.3], [None, 0.8]]
REWARDS = [1.0, 0.0, 1.0, 0.0]
A = 0.5 / (math.sqrt(1 / 3) + 1e-4)  # GRPO's outcome advantage: (r - 0.5) / (unbiased std sqrt(1/3) + 1e-4)
OUTCOME = [A, -A, A, -A]
NAN = math.nan
VALUES = torch.tensor([[0.2, 0.5, 0.9], [0.4, NAN, 0.6], [0.3, NAN, NAN], [NAN, 0.8, NAN]])
COUNT = torch.tensor([3, 3, 1, 2])


def make(progress=PROGRESS, rewards=REWARDS, column="progress", **kw):
    return make_batch(list(rewards), 4, lengths=LENGTHS, tool_mask=TOOL, columns={column: list(progress)},
                      reward_names=["accuracy"], **kw)


def per_token(per_turn, base=OUTCOME):
    """(N, T): ``base[i]`` plus row i's turn values on the tokens of its turns."""
    out = torch.zeros(4, 7)
    for i, row in enumerate(TURN):
        for t, k in enumerate(row):
            out[i, t] = base[i] + (per_turn[i][k] if k >= 0 else 0.0)
    return out


def model_tokens(x):
    return x[torch.tensor(TURN) >= 0]


def test_potentials_and_shaping_rewards_ng_terminal_zero():
    phi, shaped = potentials(VALUES, COUNT)
    # Phi before turn k (Phi_0 = 0), the terminal Phi_K = 0 (Ng), 0 past a row's end; row 1's None carries 0.4,
    # row 3's leading None carries Phi_0, and its last record (0.8, the terminal state) is replaced by 0
    torch.testing.assert_close(phi, torch.tensor([[0.0, 0.2, 0.5, 0.0], [0.0, 0.4, 0.4, 0.0], [0.0, 0.0, 0.0, 0.0],
                                                  [0.0, 0.0, 0.0, 0.0]]))
    assert shaped.all()
    f = shaping_rewards(phi, COUNT, 1.0)
    # F_k = Phi_k+1 - Phi_k: row 0 [.2, .3, -.5], row 1 [.4, 0, -.4], row 2 [0], row 3 [0, 0]
    torch.testing.assert_close(f, torch.tensor([[0.2, 0.3, -0.5], [0.4, 0.0, -0.4], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    assert f.sum(1).abs().max() < 1e-7  # telescopes to gamma^K * 0 - Phi_0 = 0


def test_the_hand_computed_vector_add_mode_defaults():
    result = run_plugin(ProgressPotential, make(), {"column": "progress"})
    # return-to-go G_k = -Phi_k (terminal 0, gamma 1): row 0 [0, -.2, -.5], row 1 [0, -.4, -.4], rows 2, 3: 0
    g = [[0.0, -0.2, -0.5], [0.0, -0.4, -0.4], [0.0], [0.0, 0.0]]
    torch.testing.assert_close(model_tokens(result.advantages), model_tokens(per_token(g)), atol=1e-5, rtol=0)
    m = result.metrics
    assert m["progress_potential/valued_rows"] == 1.0
    assert m["progress_potential/potential_gain"] == pytest.approx(0.0, abs=1e-7)  # -Phi_0 for every row
    assert m["progress_potential/shaping_reward"] == pytest.approx((0.2 + 0.3 - 0.5 + 0.4 - 0.4) / 9, abs=1e-7)
    assert m["progress_potential/credited_turns"] == pytest.approx(4 / 9)
    assert m["progress_potential/credit_abs"] == pytest.approx(1.5 / 9, abs=1e-7)


def test_terminal_last_and_a_discount():
    phi, _ = potentials(VALUES, COUNT, terminal="last")
    torch.testing.assert_close(phi, torch.tensor([[0.0, 0.2, 0.5, 0.9], [0.0, 0.4, 0.4, 0.6], [0.0, 0.3, 0.0, 0.0],
                                                  [0.0, 0.0, 0.8, 0.0]]))
    result = run_plugin(ProgressPotential, make(), {"column": "progress", "terminal": "last"})
    # F: row 0 [.2, .3, .4], row 1 [.4, 0, .2], row 2 [.3], row 3 [0, .8]; G = Phi_end - Phi_k (progress to come)
    g = [[0.9, 0.7, 0.4], [0.6, 0.2, 0.2], [0.3], [0.8, 0.8]]
    torch.testing.assert_close(model_tokens(result.advantages), model_tokens(per_token(g)), atol=1e-5, rtol=0)
    assert result.metrics["progress_potential/potential_gain"] == pytest.approx((0.9 + 0.6 + 0.3 + 0.8) / 4)
    # gamma 0.9, row 0: F = [.9 * .2 - 0, .9 * .5 - .2, .9 * .9 - .5] = [.18, .25, .31]; G_2 = .31,
    # G_1 = .25 + .9 * .31 = .529 (= .9^2 * .9 - .2), G_0 = .18 + .9 * .529 = .6561 (= .9^3 * .9 - 0)
    disc = run_plugin(ProgressPotential, make(), {"column": "progress", "terminal": "last", "gamma": 0.9})
    torch.testing.assert_close(disc.advantages[0, [0, 3, 6]] - A, torch.tensor([0.6561, 0.529, 0.31]), atol=1e-5,
                               rtol=0)
    # credit: reward gives the turn its own F: row 0 [.18, .25, .31]
    own = run_plugin(ProgressPotential, make(), {"column": "progress", "terminal": "last", "gamma": 0.9,
                                                 "credit": "reward"})
    torch.testing.assert_close(own.advantages[0, [0, 3, 6]] - A, torch.tensor([0.18, 0.25, 0.31]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("terminal", ["zero", "last"])
@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.5])
def test_the_shaping_telescopes_on_random_trajectories(terminal, gamma):
    g = torch.Generator().manual_seed(7)
    values = torch.rand(64, 6, generator=g)
    values[torch.rand(64, 6, generator=g) < 0.3] = NAN  # turns that recorded nothing carry the last state
    count = torch.randint(1, 7, (64,), generator=g)
    phi, _ = potentials(values, count, initial=0.25, terminal=terminal)
    f = shaping_rewards(phi, count, gamma)
    discount = gamma ** torch.arange(6, dtype=torch.float32)
    end = phi.gather(1, count.unsqueeze(1)).squeeze(1)
    # sum_k gamma^k F_k = gamma^K Phi_end - Phi_0, with Phi_end = 0 under Ng's rule
    torch.testing.assert_close((f * discount).sum(1), gamma ** count.float() * end - 0.25, atol=1e-6, rtol=0)
    if terminal == "zero":
        assert end.abs().max() == 0
    from trl_credit import discounted_returns

    returns = discounted_returns(f, gamma)
    ks = torch.arange(6).unsqueeze(0)
    expected = torch.where(ks < count.unsqueeze(1), gamma ** (count.unsqueeze(1) - ks).float() * end.unsqueeze(1)
                           - phi[:, :6], 0.0)
    torch.testing.assert_close(returns, expected, atol=1e-6, rtol=0)  # G_k = gamma^(K-k) Phi_end - Phi_k


def test_guess_distance_lower_is_better():
    # guess_distance per turn: [5, 2, 0] (solved on turn 3), [6, None, 3], [4], [None, 7]; Phi = -distance
    dist = [[5.0, 2.0, 0.0], [6.0, None, 3.0], [4.0], [None, 7.0]]
    base = {"column": "guess_distance", "direction": "lower", "credit": "reward"}
    zero = run_plugin(ProgressPotential, make(dist, column="guess_distance"), base)
    # terminal zero: Phi row 0 [0, -5, -2, 0] -> F [-5, 3, 2]; row 1 [0, -6, -6, 0] -> [-6, 0, 6]; row 2 [0, 0] -> [0];
    # row 3 [0, 0, 0] -> [0, 0]
    f = [[-5.0, 3.0, 2.0], [-6.0, 0.0, 6.0], [0.0], [0.0, 0.0]]
    torch.testing.assert_close(model_tokens(zero.advantages), model_tokens(per_token(f)), atol=1e-5, rtol=0)
    # terminal last: the last guess is credited with its own distance change: row 1 [-6, 0, 3], row 2 [-4], row 3
    # [0, -7]; row 0 is solved (distance 0): the same as Ng's 0
    last = run_plugin(ProgressPotential, make(dist, column="guess_distance"), {**base, "terminal": "last"})
    f = [[-5.0, 3.0, 2.0], [-6.0, 0.0, 3.0], [-4.0], [0.0, -7.0]]
    torch.testing.assert_close(model_tokens(last.advantages), model_tokens(per_token(f)), atol=1e-5, rtol=0)
    # initial: 10 (the worst distance before any guess): Phi_0 = -10; a turn without a number keeps it
    # (F = 0), the first guess gains 10 - distance: row 0 [5, 3, 2], row 1 [4, 0, 3], row 2 [6], row 3 [0, 3]
    worst = run_plugin(ProgressPotential, make(dist, column="guess_distance"),
                       {**base, "terminal": "last", "initial": 10})
    f = [[5.0, 3.0, 2.0], [4.0, 0.0, 3.0], [6.0], [0.0, 3.0]]
    torch.testing.assert_close(model_tokens(worst.advantages), model_tokens(per_token(f)), atol=1e-5, rtol=0)
    # initial: first: Phi_0 = the first record's potential; row 0 F_0 = -5 - (-5) = 0
    first = run_plugin(ProgressPotential, make(dist, column="guess_distance"), {**base, "initial": "first"})
    assert first.advantages[0, 0] - A == pytest.approx(0.0, abs=1e-6)
    assert first.advantages[3, 0] + A == pytest.approx(0.0, abs=1e-6)  # row 3's first record is turn 1: Phi_0 = -7


def test_initial_first_leaves_the_turns_up_to_the_first_record_unshaped():
    # terminal zero, return credit: Phi row 0 [.2, .2, .5, 0] -> G [-.2, -.2, -.5]; row 1 [.4, .4, .4, 0] -> G -.4;
    # row 2 [.3, 0] -> G -.3; row 3 (first record after turn 1) [.8, .8, 0] -> G -.8. A turn at or before the first
    # record would be credited with -Phi(its own result), so it gets 0: the later turns keep -Phi(state before)
    result = run_plugin(ProgressPotential, make(), {"column": "progress", "initial": "first"})
    g = [[0.0, -0.2, -0.5], [0.0, -0.4, -0.4], [0.0], [0.0, 0.0]]
    torch.testing.assert_close(model_tokens(result.advantages), model_tokens(per_token(g)), atol=1e-5, rtol=0)


def test_index_mode_normalises_the_shaped_returns_per_turn_index():
    res = run_plugin(ProgressPotential, make(), {"column": "progress", "terminal": "last", "advantage": "index"})
    # R_k = G_k + r (gamma 1): row 0 [1.9, 1.7, 1.4], row 1 [.6, .2, .2], row 2 [1.3], row 3 [.8, .8]
    # k = 0: mean 1.15, centred [.75, -.55, .15, -.35], unbiased std sqrt(1.01 / 3)
    # k = 1 (rows 0, 1, 3): mean .9, centred [.8, -.7, -.1], std sqrt(.57); k = 2 (rows 0, 1): [.6, -.6], std sqrt(.72)
    s0, s1, s2 = math.sqrt(1.01 / 3) + 1e-4, math.sqrt(0.57) + 1e-4, math.sqrt(0.72) + 1e-4
    z = [[0.75 / s0, 0.8 / s1, 0.6 / s2], [-0.55 / s0, -0.7 / s1, -0.6 / s2], [0.15 / s0], [-0.35 / s0, -0.1 / s1]]
    torch.testing.assert_close(model_tokens(res.advantages), model_tokens(per_token(z, [0.0] * 4)), atol=1e-5, rtol=0)
    unscaled = index_normalise(torch.tensor([[1.9, 1.7, 1.4], [0.6, 0.2, 0.2], [1.3, 0, 0], [0.8, 0.8, 0]]),
                               torch.arange(3).unsqueeze(0) < COUNT.unsqueeze(1), 4, "none")
    torch.testing.assert_close(unscaled[:, 0], torch.tensor([0.75, -0.55, 0.15, -0.35]))
    # without shaping (coef 0) every turn index carries the outcome alone: GRPO on the rows that reach the index
    plain = run_plugin(ProgressPotential, make(), {"column": "progress", "advantage": "index", "coef": 0.0})
    assert plain.advantages[0, 0] == pytest.approx(A, abs=1e-4) and plain.advantages[1, 0] == pytest.approx(-A, abs=1e-4)
    # k = 2 holds rows 0 (r = 1) and 1 (r = 0): +-0.5 / (sqrt(0.5) + 1e-4)
    assert plain.advantages[0, 6] == pytest.approx(0.5 / (math.sqrt(0.5) + 1e-4), abs=1e-5)


def test_the_mode_switches_the_hook():
    add = plugin_set(ProgressPotential, {}).plugins[0]
    index = plugin_set(ProgressPotential, {"advantage": "index", "reward": "accuracy"}).plugins[0]
    assert "transform_advantages" in add.hooks and "compute_advantages" not in add.hooks
    assert "compute_advantages" in index.hooks and "transform_advantages" not in index.hooks
    assert index.members.required_rewards == ("accuracy",) and add.members.required_rewards == ()


def test_single_turn_batch():
    # no tool mask: one turn each; with Ng's terminal 0 a single turn's return is -Phi_0 = 0: no shaping at all;
    # with terminal: last it is its progress: the outcome advantage plus the recorded value
    batch = lambda: make_batch([1, 0, 1, 1], 2, lengths=[3, 2, 4, 1], reward_names=["accuracy"],  # noqa: E731
                               columns={"progress": [[0.5], [0.25], [None], [1.0]]})
    plain = run_plugin(ProgressPotential, batch(), {"column": "progress"})
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    assert plain.advantages[0, 0] == pytest.approx(a, abs=1e-5) and plain.advantages[2, 0] == 0.0
    last = run_plugin(ProgressPotential, batch(), {"column": "progress", "terminal": "last"})
    expected = torch.tensor([a + 0.5, -a + 0.25, 0.0, 1.0])  # row 2 recorded nothing: unshaped
    torch.testing.assert_close(last.advantages[:, 0], expected, atol=1e-5, rtol=0)


def test_all_nan_progress_constant_groups_and_nan_outcomes():
    none = run_plugin(ProgressPotential, make([[None] * 3, None, [None], [None, None]]),
                      {"column": "progress", "terminal": "last", "initial": 1.0})
    torch.testing.assert_close(model_tokens(none.advantages), model_tokens(per_token([[0] * 3] * 4)))
    assert none.metrics["progress_potential/valued_rows"] == 0.0
    # the same progress everywhere and the same reward: index mode gives 0, add mode only the (0) outcome
    same = [[0.5, 0.5, 0.5], [0.5, 0.5, 0.5], [0.5], [0.5, 0.5]]
    flat = run_plugin(ProgressPotential, make(same, rewards=[1.0] * 4), {"column": "progress", "advantage": "index"})
    assert flat.advantages.abs().max() == 0
    # a NaN outcome: no credit in either mode
    for mode in ("add", "index"):
        res = run_plugin(ProgressPotential, make(rewards=[1.0, None, 1.0, 0.0]),
                         {"column": "progress", "terminal": "last", "advantage": mode})
        assert res.advantages[1].abs().sum() == 0 and torch.isfinite(res.advantages).all()


def test_sequence_or_token_advantages_in():
    class Tokens(Plugin):
        """An estimator giving (N, T) advantages: 1 on every token."""

        @hookimpl
        def compute_advantages(self, batch):
            return torch.ones(batch.completion_ids.shape)

    res = run_plugin(ProgressPotential, make(), {"column": "progress", "terminal": "last"}, others=[Tokens])
    assert res.advantages[0, 0] == pytest.approx(1.9, abs=1e-6) and res.advantages[0, 2] == 1.0


@pytest.mark.parametrize("mode", ["add", "index"])
def test_a_batch_without_the_column_is_refused_by_the_host(mode):
    options = {"column": "progress", "advantage": mode}
    assert plugin_set(ProgressPotential, options).plugins[0].members.required_turn_values == ("progress",)
    with pytest.raises(PluginRuntimeError, match=r"plugin 'progress_potential' needs per-turn values \['progress'\] "
                                                 r"\(required_turn_values\).*step 0"):
        run_plugin(ProgressPotential, make(column="other"), options)


def test_bad_options_are_refused():
    for bad, key in (({"initial": "last"}, "initial"), ({"initial": NAN}, "initial"), ({"coef": -1}, "coef"),
                     ({"terminal": "one"}, "terminal"), ({"column": ""}, "column"), ({"gamma": 1.5}, "gamma"),
                     ({"advantage": "both"}, "advantage")):
        with pytest.raises(ConfigError, match=key):
            plugin_set(ProgressPotential, bad)


@pytest.mark.parametrize("config", [{}, {"terminal": "last", "gamma": 0.9, "initial": "first"},
                                    {"advantage": "index", "terminal": "last", "credit": "reward", "scale": "none"}])
def test_check_plugin_on_multi_turn_batches(config):
    check_plugin(ProgressPotential, config)  # the kit's edge cases, with the declared turn_progress filled in
    check_plugin(ProgressPotential, {"column": "progress", **config},
                 batches=[make, lambda: make(rewards=[1.0] * 4), lambda: make([[None] * 3, None, [None], [None] * 2])])


class Seen(Plugin):
    """Records each finished batch and its final advantages."""

    seen: list = []

    @hookimpl
    def on_batch_end(self, batch, advantages):
        Seen.seen.append((batch, advantages.detach().clone()))


def test_a_real_run_on_scripted_multi_turn_rollouts(tmp_path, monkeypatch):
    from trl_credit.testing import ScriptedTurns, scripted_turns_reward

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    Seen.seen.clear()
    config = {"name": "progress_potential", "column": "turn_progress", "terminal": "last", "coef": 0.5}
    trainer = train_tiny([config, Seen], output_dir=tmp_path, rollout_func=ScriptedTurns(),
                         reward_funcs=[scripted_turns_reward], max_completion_length=32)
    logs = trainer.state.log_history
    assert all(math.isfinite(entry["loss"]) for entry in logs if "loss" in entry)
    assert any("trl_credit/progress_potential/potential_gain" in entry for entry in logs)
    batch, advantages = Seen.seen[-1]
    turns = batch.turns()
    assert int(turns.count.max()) > 1  # really multi-turn
    # turn_progress is (k + 1) / 3 after turn k: with terminal last and gamma 1 the return is the progress still to
    # come, Phi_end - Phi_k = (K - k) / 3, added with coef 0.5 to GRPO's outcome advantage
    k = torch.arange(turns.max_turns).unsqueeze(0)
    to_come = ((turns.count.unsqueeze(1) - k) / 3).clamp(min=0)
    r = batch.total_reward().reshape(-1, batch.num_generations)
    outcome = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).reshape(-1, 1)
    model = turns.model
    torch.testing.assert_close(advantages[model], (outcome + turns.broadcast(0.5 * to_come))[model], atol=1e-5,
                               rtol=0)
