"""Positive-negative pairing: the methods.md vector, pairs, thresholds, open slots, the host sampler,
the contract, and real runs (the curriculum's direction, identical draws for the same seed)."""

from __future__ import annotations

import pytest
import torch
from trl_credit_pos_neg_pairing import FILL_MASS, PosNegPairing, select_pairs

from trl_credit import ConfigError, PromptStats
from trl_credit.testing import (
    check_plugin,
    difficulty_reward,
    plugin_set,
    run_curriculum,
    tiny_dataset,
    train_tiny,
)


def stats_for(rates, prompts_per_batch=2, seen=10, last_step=None):
    """Stats whose empirical pass rates are ``rates`` (None = never seen), ``seen`` rollouts each."""
    s = PromptStats.empty(len(rates))
    for i, p in enumerate(rates):
        if p is not None:
            s.seen[i], s.passed[i], s.last_step[i] = seen, round(p * seen), 0
    if last_step is not None:
        s.last_step.copy_(torch.tensor(last_step))
    s.latest_seen.copy_(s.seen)                                    # the last step's counts: the same
    s.latest_passed.copy_(s.passed)
    s.prompts_per_batch = prompts_per_batch
    return s


def test_history_latest_drops_a_prompt_the_policy_has_solved():
    # row 0: 3 of 30 at first, 10 of 10 when last scored (13/40 = 0.325 in all); rows 1, 2 eligible; 3 unseen
    s = stats_for([0.2, 0.4, 0.9, None])
    s.seen[0], s.passed[0], s.latest_seen[0], s.latest_passed[0] = 40, 13, 10, 10
    assert weights(s).tolist() == [0, 1, 1, 0]                     # q+ = 0.4 (row 0 is solved now), q- = 0.9
    assert weights(s, {"history": "all"}).tolist() == [1, 0, 1, 0]  # all: 0.325 is the hardest solvable one


def weights(stats, config=None):
    return PosNegPairing(PosNegPairing.Config(**(config or {}))).prompt_weights(stats, 0)


# ------------------------------------------------------------------------- selection
def test_methods_vector():
    # p_hat = {A: 0.1, B: 0.9, C: 0.5, D: 1.0, E: 0.0} -> q+ = A, q- = B (D, E: no signal)
    s = stats_for([0.1, 0.9, 0.5, 1.0, 0.0])
    positives, negatives = select_pairs(s.pass_rate(), s.last_step, 1)
    assert positives.tolist() == [0] and negatives.tolist() == [1]
    w = run_curriculum(PosNegPairing, s)                            # normalised as the host does
    assert torch.equal(w, torch.tensor([0.5, 0.5, 0, 0, 0], dtype=torch.float64))


def test_two_pairs_take_the_extremes_of_the_open_interval():
    s = stats_for([0.7, 0.0, 0.2, 0.6, 1.0, 0.1, 0.8, 0.3], prompts_per_batch=4)
    positives, negatives = select_pairs(s.pass_rate(), s.last_step, 2)
    assert positives.tolist() == [5, 2] and negatives.tolist() == [6, 0]   # 0.1, 0.2 and 0.8, 0.7
    assert weights(s).tolist() == [1, 0, 1, 0, 0, 1, 1, 0]


def test_equal_rates_take_the_prompt_scored_longest_ago():
    s = stats_for([0.2, 0.2, 0.8, 0.8], last_step=[5, 3, 1, 4])
    assert weights(s).tolist() == [0, 1, 1, 0]


@pytest.mark.parametrize("options, chosen", [
    ({}, [0, 3]),
    ({"positive_below": 0.3, "negative_above": 0.7}, [0, 3]),
    ({"positive_below": 0.05}, [3]),                              # no q+ candidate: q- alone
    ({"negative_above": 0.95}, [0]),                              # no q- candidate: q+ alone
])
def test_thresholds(options, chosen):
    s = stats_for([0.1, 0.4, 0.6, 0.9, None], prompts_per_batch=2)
    w = weights(s, options)
    assert (w == 1).nonzero().squeeze(1).tolist() == chosen
    if len(chosen) < 2:                                            # the open slot: the unseen prompt
        assert w[4] == FILL_MASS


def test_a_prompt_is_never_both_q_plus_and_q_minus():
    s = stats_for([0.5, 1.0, 0.0])
    positives, negatives = select_pairs(s.pass_rate(), s.last_step, 1, positive_below=0.8, negative_above=0.2)
    assert positives.tolist() == [0] and negatives.tolist() == []
    assert select_pairs(s.pass_rate(), s.last_step, 1)[0].numel() == 0    # 1/2 is neither low nor high


def test_open_slots_fill_from_unseen_then_spare_eligible():
    # k = 3 (odd): one pair, one open slot
    s = stats_for([0.1, 0.9, 0.3, 1.0, None, None], prompts_per_batch=3)
    w = weights(s)
    assert w[:4].tolist() == [1, 1, FILL_MASS * FILL_MASS, 0]      # spare eligible 0.3 only after unseen
    assert w[4:].tolist() == [FILL_MASS / 2] * 2
    s = stats_for([0.1, 0.9, 0.3, 1.0], prompts_per_batch=3)       # nothing unseen: the spare eligible one
    assert weights(s).tolist() == [1, 1, FILL_MASS, 0]


def test_explore_share():
    s = stats_for([0.1, 0.2, 0.8, 0.9, None, None, None], prompts_per_batch=4)
    assert weights(s).tolist() == [1, 1, 1, 1, 0, 0, 0]
    w = weights(s, {"explore_share": 0.5})                        # 2 slots for unseen: one pair
    assert w[[0, 3]].tolist() == [1, 1] and w[4:].tolist() == [FILL_MASS / 3] * 3
    assert w[[1, 2]].tolist() == [FILL_MASS * FILL_MASS / 2] * 2   # spare candidates after the unseen


def test_nothing_known():
    assert weights(stats_for([None] * 4)).tolist() == [0.25] * 4   # all unseen: uniform
    assert weights(stats_for([0.0, 1.0, 1.0])).tolist() == [1.0] * 3  # no signal anywhere: uniform
    s = stats_for([0.0, 1.0, None, None, None])                    # no candidate: unseen only
    assert weights(s).tolist() == [0, 0, 1 / 3, 1 / 3, 1 / 3]
    s = stats_for([0.1, 0.9], prompts_per_batch=0)                 # unknown batch size: one pair
    assert weights(s).tolist() == [1, 1]


def test_weights_are_a_pure_function_of_the_stats():
    s = stats_for([0.1, 0.9, 0.5, None], prompts_per_batch=3)
    before = {k: getattr(s, k).clone() for k in ("seen", "passed", "reward_sum", "last_step")}
    assert torch.equal(weights(s), PosNegPairing().prompt_weights(s, 99))
    assert all(torch.equal(before[k], getattr(s, k)) for k in before)


def test_host_sampler_draws_the_pair_and_fills_from_unseen():
    s = stats_for([0.1, 0.9, 0.0, 1.0, 0.5] + [None] * 10, prompts_per_batch=3)
    pipeline_weights = run_curriculum(PosNegPairing, s)
    fills = set()
    for seed in range(30):
        # the host's draw: k distinct prompts from the weights (the real sampler: the training runs below)
        generator = torch.Generator().manual_seed(seed * 1_000_003)
        drawn = torch.multinomial(pipeline_weights, 3, replacement=False, generator=generator).tolist()
        assert {0, 1} <= set(drawn)
        fills |= set(drawn) - {0, 1}
    assert fills <= set(range(5, 15)) and len(fills) >= 6


# ------------------------------------------------------------------------- config and contract
@pytest.mark.parametrize("options, key", [({"positive_below": 1.5}, "positive_below"),
                                          ({"negative_above": -0.1}, "negative_above"),
                                          ({"explore_share": 2}, "explore_share"),
                                          ({"history": "recent"}, "history"),
                                          ({"weighted_grpo": True}, "weighted_grpo")])
def test_bad_options(options, key):
    with pytest.raises(ConfigError, match=key):
        plugin_set(PosNegPairing, options)


def test_contract():
    check_plugin(PosNegPairing)
    check_plugin("pos_neg_pairing", {"explore_share": 0.5, "positive_below": 0.4})


# ------------------------------------------------------------------------- real runs
G = 4
#: pass fraction of each arithmetic difficulty in the training runs (stand-in reward)
PASS_RATE = {1: 0.75, 2: 0.5, 3: 0.25}


def stand_in_reward(log):
    """Deterministic reward whatever the tiny random model writes: a completion of a difficulty-d row
    passes (1.0) iff its position in its group of G = 4 is below PASS_RATE[d] * 4, so difficulty-1
    rows pass 3 of 4 times (easy but brittle: q-), difficulty-3 rows 1 of 4 (hard but solvable: q+)
    and difficulty-2 rows 2 of 4 (neither). Each call appends its groups' dataset rows to ``log``."""
    return difficulty_reward(PASS_RATE, G, log, index_column="row")


#: difficulty of each of the 32 rows (8 of level 1, 20 of level 2, 4 of level 3): the levels of the
#: arithmetic set these runs were written on, kept so that their draws and expectations stay the same
DIFFICULTY = [1, 2, 2, 2, 2, 2, 2, 1, 3, 2, 1, 2, 1, 1, 2, 3, 3, 2, 2, 2, 2, 1, 2, 3, 2, 2, 2, 1, 2, 1, 2, 2]


def arithmetic():
    """`tiny_dataset` (32 rows) with the ``difficulty`` levels of `DIFFICULTY` and a ``row`` column.

    The stand-in reward reads only ``difficulty`` and the sampler only the statistics, so the prompts'
    text plays no part in which rows are drawn."""
    data = tiny_dataset(32, seed=0).remove_columns("difficulty").add_column("difficulty", DIFFICULTY)
    return data.add_column("row", list(range(len(data))))


def make_trainer(tmp_path, plugins, log):
    return train_tiny(plugins, output_dir=tmp_path, reward_funcs=stand_in_reward(log), dataset=arithmetic(),
                      max_steps=6, train=False, per_device_train_batch_size=16, num_generations=G,
                      max_completion_length=4, seed=0)


@pytest.fixture(scope="module")
def curriculum_run(tmp_path_factory):
    log = []
    trainer = make_trainer(tmp_path_factory.mktemp("pos_neg"), [{"name": "pos_neg_pairing"}], log)
    trainer.train()
    return trainer, log


def test_training_draws_pairs(curriculum_run, tmp_path):
    """4 prompts (2 pairs) per batch from 32 rows. The loader fetches one batch ahead, so the draw of
    batch b sees the rollouts of batches 1..b-2. From batch 3 on, each batch holds as many scored
    difficulty-3 rows (q+, p_hat 1/4) and difficulty-1 rows (q-, 3/4) as there are pairs and such rows,
    never a scored difficulty-2 row (p_hat 1/2: neither low nor high), and fills the rest with unseen rows."""
    trainer, log = curriculum_run
    assert trainer.state.global_step == 6 and len(log) == 6
    difficulty = arithmetic()["difficulty"]
    for b in range(2, 6):
        known = {r for batch in log[: b - 1] for r in batch}
        drawn = set(log[b])
        for level in (1, 3):
            expected = min(2, sum(difficulty[r] == level for r in known))
            assert sum(difficulty[r] == level for r in drawn & known) == expected, (b + 1, level)
        assert not {r for r in drawn & known if difficulty[r] == 2}, f"batch {b + 1} re-draws a p = 1/2 row"
    # compared with TRL's uniform sampler on the same seed (a run without the plugin draws these)
    uniform = make_trainer(tmp_path, [], [])
    baseline = []
    while len(baseline) < 6:
        baseline += [[row["row"] for row in batch][::G] for batch in uniform.get_train_dataloader()]
    share = lambda batches: sum(difficulty[r] != 2 for b in batches for r in b) / sum(map(len, batches))
    assert share(baseline[2:6]) <= 0.5                             # 12 of 32 rows are q+ or q- material
    assert share(log[2:6]) >= 0.55 and share(log[3:6]) >= 0.65    # this seed: 11/16 and 9/12
    assert share(log[2:6]) >= 1.5 * share(baseline[2:6])
    for batch in log[3:6]:                                         # every batch holds a pair
        assert {difficulty[r] for r in batch} >= {1, 3}


def test_same_seed_draws_identical_prompts(curriculum_run, tmp_path):
    trainer, log = curriculum_run
    again = []
    second = make_trainer(tmp_path, [{"name": "pos_neg_pairing"}], again)
    second.train()
    assert again == log
    for key in ("seen", "passed", "reward_sum", "last_step"):
        assert torch.equal(getattr(second.prompt_stats, key), getattr(trainer.prompt_stats, key))
