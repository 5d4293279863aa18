"""E-GRPO: methods.md 2.15 vectors, entity matching, gold formats, chat completions, contract, a real run."""

from __future__ import annotations

import math
import re

import pytest
import torch
from trl_credit_e_grpo import (
    EntityGRPO,
    entity_match_rate,
    normalize_text,
    parse_entities,
    trajectory_text,
)

from trl_credit import ConfigError, PluginRuntimeError, completion_text, grpo_advantages, hookimpl
from trl_credit.testing import (
    check_args,
    check_plugin,
    make_batch,
    plugin_set,
    run_plugin,
    tiny_dataset,
    tiny_model_path,
    train_tiny,
)

NAN = None  # make_batch turns None into NaN
TIGHT = {"rtol": 1e-6, "atol": 1e-6}
GOLD = ["Leonardo DiCaprio", "Titanic", "James Cameron", "1997"]


def batch(correct, completions, entities, G=None, **kwargs):
    G = G or len(correct)
    return make_batch(list(correct), G, reward_names=["accuracy_reward"], completions=completions,
                      columns={"entities": entities}, **kwargs)


def shaped(correct, completions, entities, options=None, G=None):
    return run_plugin(EntityGRPO, batch(correct, completions, entities, G), options)


# ------------------------------------------------------------------------- methods.md 2.15 vectors
def test_vectors():
    completions = [
        "Titanic (1997) starred Leonardo DiCaprio. Answer: Kate Winslet",    # correct -> 1
        "The film Titanic was directed by James Cameron. Answer: Avatar",    # wrong, 2/4 -> 0.5 * 0.5
        "I do not know. Answer: Inception",                                  # wrong, 0/4 -> 0
        "Titanic, James Cameron, 1997. Answer: Avatar",                      # wrong, empty gold list -> 0
    ]
    result = shaped([1, 0, 0, 0], completions, [GOLD, GOLD, GOLD, []])
    torch.testing.assert_close(result.batch.total_reward(), torch.tensor([1.0, 0.25, 0.0, 0.0]), **TIGHT)
    assert result.reward_names == ["accuracy_reward"]                  # the correctness column is replaced
    m = result.metrics
    assert m["e_grpo/match_rate"] == pytest.approx((0.75 + 0.5 + 0 + 0) / 4)
    assert m["e_grpo/partial_credit"] == pytest.approx(0.25 / 3)
    assert m["e_grpo/credited_wrong"] == pytest.approx(1 / 3)


def test_alpha_scales_partial_credit_and_must_stay_below_one():
    result = shaped([0, 0], ["Titanic and James Cameron", "Titanic"], [GOLD, GOLD], {"alpha": 0.3})
    torch.testing.assert_close(result.batch.total_reward(), torch.tensor([0.15, 0.075]), **TIGHT)
    # every near miss stays below a success, even with all entities found
    full = shaped([1, 0], ["x", "Leonardo DiCaprio, Titanic, James Cameron, 1997"], [GOLD, GOLD], {"alpha": 0.99})
    assert full.batch.total_reward().tolist() == pytest.approx([1.0, 0.99])
    for bad in (1.0, 1.5, -0.1):
        with pytest.raises(ConfigError, match="alpha"):
            plugin_set(EntityGRPO, {"alpha": bad})


def test_correct_gets_one_even_without_entities():
    result = shaped([1, 1, 0, 0], ["none", "", "none", ""], [GOLD, [], GOLD, []])
    assert result.batch.total_reward().tolist() == [1.0, 1.0, 0.0, 0.0]


# ------------------------------------------------------------------------- matching
def test_normalisation():
    assert normalize_text("  New-York   City!! ") == "new york city"
    assert normalize_text("Café ÉCLAIR_au\tchocolat") == "café éclair au chocolat"
    assert normalize_text("ﬁnal ①") == "final 1"                     # NFKC: ligature, circled digit
    assert normalize_text("O'Brien, U.S.A.") == "o brien u s a"


@pytest.mark.parametrize("text, entity, hit", [
    ("He moved to NEW YORK city.", "New York", True),
    ("a new-york based firm", "New York", True),               # punctuation between words
    ("the U.S.A. won", "U.S.A.", True),
    ("Parisian cafés", "Paris", False),                        # word boundary
    ("in 1997.", "1997", True),
    ("in 19970", "1997", False),
    ("Dr. O'Brien said", "O Brien", True),
    ("café crème", "CAFÉ", True),
    ("", "Paris", False),
])
def test_word_boundary_matching(text, entity, hit):
    assert entity_match_rate(text, parse_entities([entity])) == float(hit)


def test_matcher_equals_normalised_substring_definition():
    # the fast matcher (no whole-text normalisation) against the definition, on random texts
    import random

    rng = random.Random(0)
    pieces = ["new", "york", "New", "YORK", "o", "brien", "1997", "19970", "x", "é", "É", "_", "-", " ", "  ",
              ", ", ".", "'", "(", ")", "\t", "\n", "ﬁ", "fi", "ab"]
    entities = ["New York", "O'Brien", "1997", "x", "fi", "é", "york o", "ab ab", "new-york x"]
    for _ in range(400):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        for entity in entities:
            gold = parse_entities([entity])
            expected = f" {normalize_text(entity)} " in f" {normalize_text(text)} "
            assert entity_match_rate(text, gold) == float(expected), (text, entity)


def test_gold_formats():
    assert parse_entities("Paris; Berlin ;ROME;;  ") == {"paris", "berlin", "rome"}
    assert parse_entities("Paris | Berlin", delimiter="|") == {"paris", "berlin"}
    assert parse_entities("Paris, France", delimiter="") == {"paris france"}
    assert parse_entities(["Paris", "paris", "PARIS!", "", None, "?!"]) == {"paris"}    # duplicates, empties
    assert parse_entities(None) == frozenset() and parse_entities([]) == frozenset()
    assert parse_entities(("Berlin", 1997)) == {"berlin", "1997"}
    # a delimited string column gives the same rewards as a list column
    text = ["Titanic by James Cameron", "Titanic by James Cameron"]
    as_list = shaped([0, 0], text, [GOLD, GOLD]).rewards
    as_string = shaped([0, 0], text, ["; ".join(GOLD)] * 2).rewards
    assert torch.equal(as_list, as_string) and as_list[0, 0] == pytest.approx(0.25)
    bars = shaped([0, 0], text, [" | ".join(GOLD)] * 2, {"delimiter": "|"}).rewards
    assert torch.equal(bars, as_list)


def test_chat_completions_and_scope():
    trajectory = [
        {"role": "assistant", "content": "Searching for the director of Titanic."},
        {"role": "tool", "content": "James Cameron directed Titanic (1997) with Leonardo DiCaprio."},
        {"role": "assistant", "content": [{"type": "text", "text": "So the answer is James Cameron."}]},
    ]
    assert trajectory_text(trajectory) == "Searching for the director of Titanic.\nSo the answer is James Cameron."
    assert trajectory_text(trajectory, "last") == "So the answer is James Cameron."
    assistant = shaped([0, 0], [trajectory, "nothing"], [GOLD, GOLD])   # tool output is not the agent's reasoning
    torch.testing.assert_close(assistant.rewards[:, 0], torch.tensor([0.25, 0.0]), **TIGHT)
    last = shaped([0, 0], [trajectory, "nothing"], [GOLD, GOLD], {"scope": "last"})
    torch.testing.assert_close(last.rewards[:, 0], torch.tensor([0.125, 0.0]), **TIGHT)


# ------------------------------------------------------------------------- NaN, thresholds, edge cases
def test_nan_correctness_stays_nan_and_threshold():
    result = shaped([NAN, 0.4, 0.6, 0], ["Titanic"] * 4, [GOLD] * 4)
    r = result.rewards[:, 0]
    assert math.isnan(r[0]) and r[1:].tolist() == pytest.approx([0.125, 1.0, 0.125])
    assert torch.isfinite(result.advantages).all() and result.advantages[0] == 0.0
    strict = shaped([0.4, 0.6, 1.0, 0], ["Titanic"] * 4, [GOLD] * 4, {"correct_threshold": 1.0})
    assert strict.rewards[:, 0].tolist() == pytest.approx([0.125, 0.125, 1.0, 0.125])


def test_all_wrong_group_gets_a_gradient_from_entities():
    # plain GRPO: every advantage 0; E-GRPO ranks the near misses
    result = shaped([0, 0, 0, 0], ["Titanic, James Cameron, 1997", "Titanic", "", "James Cameron and 1997"],
                    [GOLD] * 4)
    a = result.advantages
    assert a[0] > a[3] > a[1] > a[2]
    const = shaped([0, 0, 0, 0], ["a", "b", "c", "d"], [GOLD] * 4)
    assert torch.equal(const.advantages, torch.zeros(4))


def test_single_completion_per_group_and_empty_completions():
    result = shaped([0, 1, 0], ["", "", "Titanic"], [GOLD, GOLD, GOLD], G=1)
    assert result.rewards[:, 0].tolist() == pytest.approx([0.0, 1.0, 0.125])
    assert torch.equal(result.advantages, torch.zeros(3))


# ------------------------------------------------------------------------- config
def test_missing_columns_are_named():
    instance = EntityGRPO()
    assert instance.required_columns() == ["entities"] and instance.required_rewards() == ["accuracy_reward"]
    with pytest.raises(ConfigError, match=r"\(e_grpo\).*dataset column 'entities'"):
        check_args(EntityGRPO, reward_names=["accuracy_reward"], columns=["prompt", "answer"])
    with pytest.raises(ConfigError, match=r"\(e_grpo\).*reward column 'accuracy_reward'"):
        check_args(EntityGRPO, reward_names=["format_reward"], columns=["prompt", "entities"])
    with pytest.raises(ConfigError, match=r"dataset column 'gold'"):
        check_args(EntityGRPO, {"entities_column": "gold"}, reward_names=["accuracy_reward"],
                   columns=["prompt", "entities"])
    check_args(EntityGRPO, reward_names=["accuracy_reward"], columns=["prompt", "entities"])
    check_args(EntityGRPO, reward_names=["accuracy_reward"], columns=None)     # columns unknown: not checked
    with pytest.raises(PluginRuntimeError, match="no dataset column 'entities'"):
        run_plugin(EntityGRPO, make_batch([1, 0], 2, reward_names=["accuracy_reward"]))


@pytest.mark.parametrize("options, key", [({"scope": "all"}, "scope"), ({"entity_column": "x"}, "entity_column")])
def test_bad_options(options, key):
    with pytest.raises(ConfigError, match=key):
        plugin_set(EntityGRPO, options)


def contract_batches():
    texts = ["Titanic by James Cameron", "no idea", "1997", "", "Leonardo DiCaprio", "Titanic", "x", "1997 Titanic"]
    return [
        lambda: batch([1, 0, 1, 0, 0, 0, 0, 0], texts, [GOLD] * 8, G=4),
        lambda: batch([1, 1, 1, 1, 0, 0, 0, 0], texts, [GOLD] * 4 + [[]] * 4, G=4),
        lambda: batch([1, NAN, 0, 1, NAN, NAN, NAN, NAN], texts, ["; ".join(GOLD)] * 8, G=4),
        lambda: batch([1, 0, 0], texts[:3], [GOLD] * 3, G=1),
        lambda: batch([0.5, 0.25, 0.75, 0.0], ["Titanic", "", "x", "James Cameron"], [GOLD] * 4, G=2,
                      lengths=[6, 0, 6, 1]),
    ]


def test_contract():
    check_plugin(EntityGRPO, batches=contract_batches())
    check_plugin(EntityGRPO, {"alpha": 0.3, "scope": "last"}, batches=contract_batches())


# ------------------------------------------------------------------------- a real run
class Spy:
    """Records what the host trained on: completions, gold entities, shaped rewards and advantages."""

    def __init__(self):
        self.seen = []

    @hookimpl
    def on_batch_end(self, batch, advantages):
        self.seen.append((list(batch.completions), list(batch.column("entities")), batch.rewards.clone(),
                          batch.reward_weights.clone(), advantages.clone()))


def test_training_run(tmp_path):
    from transformers import AutoTokenizer

    model = tiny_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model)
    # the untrained tiny model samples near-uniformly from its vocabulary: bias two entity tokens so that
    # some completions mention them (the run stays seeded and deterministic)
    paris, berlin = (tokenizer.encode(w, add_special_tokens=False) for w in (" Paris", " Berlin"))
    bias = [[paris, 9.0], [berlin, 8.0]]
    cities = ["Paris", "Berlin", "Rome", "Madrid"]
    dataset = tiny_dataset(32, seed=0)
    dataset = dataset.add_column("entities", [cities] * len(dataset))

    def correct(completions, **kwargs):        # deterministic: one correct completion per group of 4
        return [1.0 if i % 4 == 0 else 0.0 for i in range(len(completions))]

    trainer = train_tiny([{"name": "e_grpo", "correct_reward": "correct"}, Spy], output_dir=tmp_path,
                         reward_funcs=[correct], dataset=dataset, generation_kwargs={"sequence_bias": bias})
    assert trainer.state.global_step == 2
    spy = trainer.credit_plugins.plugins[1].instance
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(spy.seen) == len(logs) == 2
    credited = 0
    for (completions, entities, rewards, weights, advantages), entry in zip(spy.seen, logs):
        assert isinstance(completions[0], list)                        # chat completions
        assert all(e == cities for e in entities)
        # written out: 1 if correct, else 0.5 * (cities mentioned as words) / 4
        words = [set(re.split(r"[\W_]+", completion_text(c).lower())) for c in completions]
        rates = torch.tensor([sum(city.lower() in w for city in cities) / 4 for w in words])
        is_correct = torch.arange(8) % 4 == 0
        expected = torch.where(is_correct, torch.ones(8), 0.5 * rates)
        torch.testing.assert_close(rewards[:, 0], expected)
        credited += int((expected[~is_correct] > 0).sum())
        # the advantages trained on are GRPO's on the shaped reward
        torch.testing.assert_close(advantages, grpo_advantages(rewards, weights, 4, "group", "sum_then_normalize"))
        assert entry["trl_credit/e_grpo/match_rate"] == pytest.approx(rates.mean().item(), abs=1e-6)
        assert entry["rewards/correct/mean"] == 0.25                   # TRL logs the reward before shaping
    assert credited > 0                                                # some near misses got partial credit
