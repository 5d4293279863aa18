"""Half-pass selection: the ranking vector, top-k and soft weights, exploration, the host sampler,
the contract, and real runs (the curriculum's direction, checkpoint/resume of the statistics)."""

from __future__ import annotations

import math

import pytest
import torch
from trl_credit_half_pass_selection import FILL_MASS, HalfPassSelection, rank_prompts

from trl_credit import ConfigError, PromptStats
from trl_credit.testing import check_args, check_plugin, plugin_set, run_curriculum, tiny_dataset, train_tiny


def stats_for(seen, passed, prompts_per_batch=0, last_step=None, latest=None):
    """Statistics with these counts; ``latest``: (seen, passed) of each prompt's last step (default: the same)."""
    s = PromptStats.empty(len(seen))
    s.seen.copy_(torch.tensor(seen, dtype=torch.float64))
    s.passed.copy_(torch.tensor(passed, dtype=torch.float64))
    latest_seen, latest_passed = latest or (seen, passed)
    s.latest_seen.copy_(torch.tensor(latest_seen, dtype=torch.float64))
    s.latest_passed.copy_(torch.tensor(latest_passed, dtype=torch.float64))
    s.last_step.copy_(torch.tensor(last_step if last_step is not None else [0 if n else -1 for n in seen]))
    s.prompts_per_batch = prompts_per_batch
    return s


def weights(stats, config=None):
    return HalfPassSelection(HalfPassSelection.Config(**(config or {}))).prompt_weights(stats, 0)


# Beta(1, 1) posterior means 1/10, 9/20, 11/20, 9/10 (the population prior is Beta(1, 1) here: 26 of 52 passed)
VECTOR_SEEN, VECTOR_PASSED = [8, 18, 18, 8], [0, 8, 10, 8]
#: the rule before 0.2.3: a fixed Beta(1, 1) prior, prompts with mixed outcomes first
OLD_RULE = {"prior": "fixed", "exploit": "mixed"}


# ------------------------------------------------------------------------- ranking
def test_methods_vector_ranking():
    p = torch.tensor([0.1, 0.45, 0.55, 0.9], dtype=torch.float64)
    assert p[rank_prompts(p)].tolist() == [0.45, 0.55, 0.1, 0.9]
    # without the preference, equal distances fall back to the row order
    q = torch.tensor([0.9, 0.55, 0.45, 0.1], dtype=torch.float64)
    assert q[rank_prompts(q, prefer_below=False)].tolist() == [0.55, 0.45, 0.9, 0.1]
    assert q[rank_prompts(q)].tolist() == [0.45, 0.55, 0.1, 0.9]
    # float32 inputs tie too (distances equal within 1e-6)
    assert rank_prompts(p.float()).tolist() == [1, 2, 0, 3]


def test_ranking_tie_breaks_and_target():
    p = torch.tensor([0.5, 0.3, 0.3, 0.7, 0.5], dtype=torch.float64)
    last = torch.tensor([4, 9, 2, 1, 3])
    # 0.5s first (older one first: step 3 before 4), then 0.3s (step 2 before 9), then 0.7
    assert rank_prompts(p, last).tolist() == [4, 0, 2, 1, 3]
    assert rank_prompts(p, last, target=0.7).tolist() == [3, 4, 0, 2, 1]


def test_predicted_pass_rate_is_the_beta_posterior_mean():
    s = stats_for([8, 18, 0], [0, 8, 0])
    # population prior: m = 8 / 26 pooled, weight 2: (passed + 2m) / (seen + 2); the unseen prompt at m
    m = 8 / 26
    plugin = HalfPassSelection()
    assert plugin.population_pass_rate(s) == pytest.approx(m)
    torch.testing.assert_close(plugin.predicted_pass_rate(s),
                               torch.tensor([2 * m / 10, (8 + 2 * m) / 20, m], dtype=torch.float64))
    plugin = HalfPassSelection(HalfPassSelection.Config(prior_strength=6.0))
    torch.testing.assert_close(plugin.predicted_pass_rate(s),
                               torch.tensor([6 * m / 14, (8 + 6 * m) / 24, m], dtype=torch.float64))
    assert HalfPassSelection().population_pass_rate(stats_for([0, 0], [0, 0])) == 0.5   # nothing seen yet
    # fixed prior Beta(alpha, beta)
    torch.testing.assert_close(HalfPassSelection(HalfPassSelection.Config(prior="fixed")).predicted_pass_rate(s),
                               torch.tensor([0.1, 0.45, 0.5], dtype=torch.float64))
    plugin = HalfPassSelection(HalfPassSelection.Config(prior="fixed", prior_alpha=2.0, prior_beta=6.0))
    torch.testing.assert_close(plugin.predicted_pass_rate(s),
                               torch.tensor([2 / 16, 10 / 26, 0.25], dtype=torch.float64))


def test_history_latest_drops_a_prompt_the_policy_has_learned():
    # row 0: 3/8 at first, 8/8 when last scored (11 of 16 in all); row 1: mixed now (4/8); 2, 3 unseen
    s = stats_for([16, 8, 0, 0], [11, 4, 0, 0], prompts_per_batch=2, latest=([8, 8, 0, 0], [8, 4, 0, 0]))
    old = HalfPassSelection(HalfPassSelection.Config(**OLD_RULE))
    torch.testing.assert_close(old.predicted_pass_rate(s), torch.tensor([0.9, 0.5, 0.5, 0.5], dtype=torch.float64))
    # latest: row 0 is all-pass (tier 2), so row 1 and a new prompt fill the batch
    assert weights(s, OLD_RULE).tolist() == [0, 1, FILL_MASS / 2, FILL_MASS / 2]
    # all: 11/16 is still mixed (p_hat 12/18), so row 0 is drawn again beside row 1
    assert weights(s, {**OLD_RULE, "history": "all"}).tolist() == [1, 1, 0, 0]
    # the defaults: latest counts pooled m = 12/16; row 0 at (8 + 1.5) / 10 is further from 1/2 than a new prompt
    torch.testing.assert_close(HalfPassSelection().predicted_pass_rate(s),
                               torch.tensor([0.95, 0.55, 0.75, 0.75], dtype=torch.float64))
    assert weights(s).tolist() == [0, 1, FILL_MASS / 2, FILL_MASS / 2]


# ------------------------------------------------------------------------- top-k weights
@pytest.mark.parametrize("k, chosen", [(1, [1]), (2, [1, 2]), (3, [0, 1, 2]), (4, [0, 1, 2, 3])])
def test_top_k_selects_the_best_ranked(k, chosen):
    s = stats_for(VECTOR_SEEN, VECTOR_PASSED, prompts_per_batch=k)
    w = run_curriculum(HalfPassSelection, s)                     # normalised as the host does
    expected = torch.zeros(4, dtype=torch.float64)
    expected[chosen] = 1.0 / k
    assert torch.equal(w, expected)


def test_population_prior_draws_new_prompts_before_those_predicted_further_from_half():
    # rows: 0 mixed (8/18), 1 always passed (8/8), 2 always failed (0/8), 3 mixed (2/8), 4-6 unseen.
    # m = 18/42 = 3/7: p_hat = (passed + 6/7) / (seen + 2) = 0.443, 0.886, 0.086, 0.286; unseen 0.429.
    # Row 0 is nearer 1/2 than a new prompt (0.057 < 0.071), row 3 is not (0.214): new prompts go first
    s = stats_for([18, 8, 8, 8, 0, 0, 0], [8, 8, 0, 2, 0, 0, 0], prompts_per_batch=2)
    assert weights(s).tolist() == [1, 0, 0, 0] + [FILL_MASS / 3] * 3
    s.prompts_per_batch = 4
    assert weights(s).tolist() == [1, 0, 0, 0, 1, 1, 1]
    s.prompts_per_batch = 5
    assert weights(s).tolist() == [1, 0, 0, 1, 1, 1, 1]
    # a prompt passed 7 times of 8: under the old rule's tier it outranks every new prompt; here
    # (m = 11/16) it is predicted at 0.84, further from 1/2 than a new prompt (0.69)
    s = stats_for([8, 8, 0, 0], [7, 4, 0, 0], prompts_per_batch=2)
    assert weights(s, OLD_RULE).tolist() == [1, 1, 0, 0]
    assert weights(s).tolist() == [0, 1, FILL_MASS / 2, FILL_MASS / 2]


def test_mixed_prompts_first_then_unseen_then_the_rest():
    # the old rule (exploit: mixed, fixed Beta(1, 1) prior)
    # rows: 0 mixed (p 0.45), 1 always passed (0.9), 2 always failed (0.1), 3 mixed (0.3), 4-6 unseen
    s = stats_for([18, 8, 8, 8, 0, 0, 0], [8, 8, 0, 2, 0, 0, 0], prompts_per_batch=4)
    w = weights(s, OLD_RULE)
    assert w[[0, 3]].tolist() == [1.0, 1.0]
    assert w[[1, 2]].tolist() == [0.0, 0.0]
    assert w[4:].tolist() == [FILL_MASS / 3] * 3                  # two open slots, drawn among the 3 unseen
    s.prompts_per_batch = 6                                        # every unseen prompt fits, then row 2 (0.1
    assert weights(s, OLD_RULE).tolist() == [1, 0, 1, 1, 1, 1, 1]  # ties 0.9 on distance, below 1/2 first)
    # exploit: all ranks by p_hat alone: with a fixed Beta(1, 1) prior unseen prompts sit at 1/2 and come first
    s.prompts_per_batch = 2
    assert weights(s, {"prior": "fixed"}).tolist() == [0, 0, 0, 0, 1, 1, 1]
    s.prompts_per_batch = 4
    assert weights(s, {"prior": "fixed"}).tolist() == [1, 0, 0, 0, 1, 1, 1]
    # a prior Beta(1, 3) predicts an unseen prompt at 1/4 (posteriors 9/22, 9/12, 1/12, 3/12, unseen 1/4):
    # behind row 0, tied with row 3 on distance and side but never scored, so ahead of it
    s.prompts_per_batch = 2
    w = weights(s, {"prior": "fixed", "prior_beta": 3.0})
    assert w[0] == 1.0 and w[1:4].tolist() == [0, 0, 0] and w[4:].tolist() == [FILL_MASS / 3] * 3


def test_explore_share_reserves_slots_for_unseen_prompts():
    s = stats_for([18, 18, 18, 18, 0, 0, 0], [8, 9, 10, 7, 0, 0, 0], prompts_per_batch=4)
    assert weights(s, OLD_RULE).tolist() == [1, 1, 1, 1, 0, 0, 0]
    w = weights(s, {**OLD_RULE, "explore_share": 0.5})           # floor(0.5 * 4) = 2 slots for unseen
    assert w[:4].tolist() == [1, 1, 0, 0] and w[4:].tolist() == [FILL_MASS / 3] * 3
    w = weights(s, {**OLD_RULE, "explore_share": 0.3})           # floor(1.2) = 1
    assert w[:4].tolist() == [1, 1, 1, 0]
    s.prompts_per_batch = 10                                       # more slots than unseen: all unseen in
    assert weights(s, {**OLD_RULE, "explore_share": 1.0}).tolist() == [1.0] * 7


def test_nothing_seen_is_uniform_and_unknown_batch_size():
    s = stats_for([0] * 5, [0] * 5, prompts_per_batch=2)
    assert weights(s).tolist() == [1.0] * 5
    s = stats_for(VECTOR_SEEN, VECTOR_PASSED, prompts_per_batch=0)  # unknown: one prompt ranked
    assert weights(s).tolist() == [0, 1, 0, 0]


def test_weights_are_a_pure_function_of_the_stats():
    s = stats_for([18, 8, 8, 8, 0, 0, 0], [8, 8, 0, 2, 0, 0, 0], prompts_per_batch=4)
    before = {k: v.clone() for k, v in s.state_dict().items() if isinstance(v, torch.Tensor)}
    first, second = weights(s), HalfPassSelection().prompt_weights(s, 123)
    assert torch.equal(first, second)
    assert all(torch.equal(before[k], getattr(s, k)) for k in before)


def test_host_sampler_draws_exactly_the_chosen_and_fills_from_unseen():
    s = stats_for([18, 8, 8, 8] + [0] * 12, [8, 8, 0, 2] + [0] * 12, prompts_per_batch=4)
    pipeline_weights = run_curriculum(HalfPassSelection, s, OLD_RULE)
    fills = set()
    for seed in range(40):
        # the host's draw (hookspec prompt_weights): k prompts without replacement, probability ~ weight
        drawn = torch.multinomial(pipeline_weights, 4, replacement=False,
                                  generator=torch.Generator().manual_seed(seed)).tolist()
        assert {0, 3} <= set(drawn) and not {1, 2} & set(drawn)
        fills |= set(drawn) - {0, 3}
    assert fills <= set(range(4, 16)) and len(fills) >= 8          # the open slots spread over the unseen


# ------------------------------------------------------------------------- soft weights
def test_soft_weights():
    s = stats_for(VECTOR_SEEN, VECTOR_PASSED, prompts_per_batch=2)
    w = weights(s, {"mode": "soft"})
    e = math.exp(-3.5)                                             # (0.4 - 0.05) / 0.1
    torch.testing.assert_close(w, torch.tensor([e, 1.0, 0.5, 0.5 * e], dtype=torch.float64))
    w = weights(s, {"mode": "soft", "prefer_below": False, "temperature": 0.35})
    torch.testing.assert_close(w, torch.tensor([math.exp(-1), 1, 1, math.exp(-1)], dtype=torch.float64))


def test_soft_exploration_share():
    s = stats_for([18, 18, 0, 0], [8, 10, 0, 0], prompts_per_batch=2)
    w = weights(s, {"mode": "soft", "explore_share": 0.2})
    # p_hat 0.45, 0.55 and, unseen, the prior mean 1/2 (d_min = 0); 0.55 is above 1/2: times 0.5
    base = torch.tensor([math.exp(-0.5), 0.5 * math.exp(-0.5), 1.0, 1.0], dtype=torch.float64)
    expected = 0.8 * base / base.sum() + torch.tensor([0, 0, 0.1, 0.1], dtype=torch.float64)
    torch.testing.assert_close(w, expected)
    assert float(w[2:].sum()) >= 0.2


# ------------------------------------------------------------------------- config and contract
@pytest.mark.parametrize("options, key", [({"prior_alpha": 0}, "prior_alpha"), ({"mode": "greedy"}, "mode"),
                                          ({"prior": "beta"}, "prior"), ({"prior_strength": 0}, "prior_strength"),
                                          ({"explore_share": 1.5}, "explore_share"),
                                          ({"temperature": 0}, "temperature"), ({"above_weight": 0}, "above_weight"),
                                          ({"exploit": "some"}, "exploit"), ({"history": "recent"}, "history"),
                                          ({"k": 3}, "k")])
def test_bad_options(options, key):
    with pytest.raises(ConfigError, match=key):
        plugin_set(HalfPassSelection, options)


def test_no_setting_is_refused():
    # a curriculum without checks of its own: any GRPOConfig it can be drawn for passes check_args
    for loss_type in ("dapo", "grpo", "dr_grpo"):
        check_args(HalfPassSelection, {"mode": "soft"}, loss_type=loss_type, per_device_train_batch_size=8,
                   num_generations=4)


def test_contract():
    check_plugin(HalfPassSelection)
    check_plugin(HalfPassSelection, {"mode": "soft", "explore_share": 0.25})
    check_plugin("half_pass_selection", OLD_RULE)                   # the installed entry point


# ------------------------------------------------------------------------- real runs
G = 2
#: pass fraction of each arithmetic difficulty in the training runs (stand-in reward)
PASS_RATE = {1: 0.5, 2: 1.0, 3: 0.0}


def stand_in_reward(log):
    """Deterministic reward whatever the tiny random model writes: a completion of a difficulty-d row
    passes (1.0) iff its position in its group of G is below PASS_RATE[d] * G, so difficulty-1 rows
    pass exactly half of the time, difficulty-2 rows always and difficulty-3 rows never. Each call
    appends the dataset rows of its groups to ``log`` (one list per generation batch)."""
    from trl_credit.testing import difficulty_reward

    return difficulty_reward(PASS_RATE, G, log, index_column="row")


#: the stand-in reward's class of each of the 32 rows: 8 rows of difficulty 1 (pass half of the time), 20
#: of 2 (always pass), 4 of 3 (never pass); the rows' order as in the arithmetic set these runs first used
DIFFICULTY = [1, 2, 2, 2, 2, 2, 2, 1, 3, 2, 1, 2, 1, 1, 2, 3, 3, 2, 2, 2, 2, 1, 2, 3, 2, 2, 2, 1, 2, 1, 2, 2]


def arithmetic():
    """`tiny_dataset` (32 rows) with the ``difficulty`` column set to DIFFICULTY, plus a ``row`` column."""
    data = tiny_dataset(32, seed=0).remove_columns("difficulty")
    return data.add_column("difficulty", DIFFICULTY).add_column("row", list(range(len(data))))


def make_trainer(tmp_path, plugins, log, max_steps=6, callbacks=None, **overrides):
    return train_tiny(plugins, output_dir=tmp_path, reward_funcs=[stand_in_reward(log)], dataset=arithmetic(),
                      max_steps=max_steps, callbacks=callbacks, train=False, per_device_train_batch_size=16,
                      num_generations=G, max_completion_length=4, **overrides)


#: groups of G = 2 make 1 of 2 and 0 of 2 weak evidence: at the default prior weight (2 rollouts) a half-pass
#: row is predicted at (1 + 2m) / 4, about 0.7, and an always-failing one at m / 2, about 0.4, nearer 1/2; a
#: weight of 0.5 (a quarter of a group) lets the two rollouts speak
RUN_OPTIONS = {"prior_strength": 0.5}


@pytest.fixture(scope="module")
def curriculum_run(tmp_path_factory):
    log = []
    trainer = make_trainer(tmp_path_factory.mktemp("half_pass"), [{"name": "half_pass_selection", **RUN_OPTIONS}], log)
    trainer.train()
    return trainer, log


def test_training_draws_the_half_pass_rows(curriculum_run, tmp_path):
    """8 prompts per batch from 32 rows; difficulty-1 rows pass half of the time. The loader fetches one
    batch ahead, so the draw of batch b sees the rollouts of batches 1..b-2: batches 1-2 are uniform,
    from batch 3 on every difficulty-1 row already scored (1 of 2 passed: p_hat (1 + 0.5 m) / 2.5, about
    0.55) is drawn again, and no always-passing row ((2 + 0.5 m) / 2.5, about 0.97) is, while unseen rows
    remain. Most rows always pass, so m is high (0.87 at batch 4 on this seed) and a new row is predicted
    further from 1/2 than an always-failing one (0.2 m): those rows may come back, as the rule says."""
    trainer, log = curriculum_run
    assert trainer.state.global_step == 6 and len(log) == 6
    difficulty = arithmetic()["difficulty"]
    for b in range(2, 6):
        known = {r for batch in log[: b - 1] for r in batch}
        half = {r for r in known if difficulty[r] == 1}
        assert half <= set(log[b]), f"batch {b + 1} misses half-pass rows {half - set(log[b])}"
        solved = {r for r in known if difficulty[r] == 2}
        assert not solved & set(log[b]), f"batch {b + 1} re-draws a solved row"
    # compared with TRL's uniform sampler on the same seed (a run without the plugin draws these)
    uniform = make_trainer(tmp_path, [], [])
    baseline = []
    while len(baseline) < 6:
        baseline += [[row["row"] for row in batch][::G] for batch in uniform.get_train_dataloader()]
    share = lambda batches: sum(difficulty[r] == 1 for b in batches for r in b) / sum(map(len, batches))
    assert share(baseline[2:6]) <= 0.35                            # 8 of 32 rows: about a quarter
    assert share(log[2:6]) >= 0.45 and share(log[4:6]) >= 0.65    # this seed: 18/32 and 12/16
    assert share(log[2:6]) >= 1.5 * share(baseline[2:6])


def test_prompt_stats_survive_checkpoint_and_resume(tmp_path):
    from transformers import TrainerCallback

    first = make_trainer(tmp_path, [{"name": "half_pass_selection"}], [], max_steps=2,
                         save_strategy="steps", save_steps=2)
    first.train()
    saved = {k: v.clone() for k, v in first.prompt_stats.state_dict().items() if isinstance(v, torch.Tensor)}
    assert saved["seen"].sum() == 2 * 16                          # two batches of 16 completions
    checkpoint = tmp_path / "checkpoint-2"
    assert (checkpoint / "trl_credit_state.pt").exists()

    restored = {}

    class Capture(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            restored.update({k: v.clone() for k, v in resumed.prompt_stats.state_dict().items()
                             if isinstance(v, torch.Tensor)})

    log = []
    resumed = make_trainer(tmp_path, [{"name": "half_pass_selection"}], log, max_steps=3, callbacks=[Capture()])
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 3
    for key in ("seen", "passed", "reward_sum", "last_step"):
        assert torch.equal(restored[key], saved[key]), key
    assert resumed.prompt_stats.seen.sum() == 3 * 16              # the resumed step added one batch
    assert len(log) == 1
