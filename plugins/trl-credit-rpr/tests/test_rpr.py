"""RPR: the methods.md 2.10 vectors, hand-computed repetition ratios, spans, the three combine modes,
the host contract and a short real run."""

from __future__ import annotations

import math

import pytest
import torch
from trl_credit_rpr import (
    PHRASES,
    ReasoningPatternReward,
    repetition_ratio,
    rpr_reward,
    rpr_score,
    rpr_terms,
    score_spans,
    thinking_span,
)

from trl_credit import ConfigError, PluginRuntimeError
from trl_credit.testing import answer_reward, check_args, check_plugin, make_batch, plugin_set, run_plugin, train_tiny

# methods.md 2.10, written out again here as the spec (order, typo and trailing spaces included)
SPEC_PHRASES = [
    "i need to", "we need to", "wait", "alternatively", "let me check", "let me see", "let's focus on",
    "we know that", "we can observe ", "we can see ", "let me try", "let's try", "let us try", "first, ",
    "firstly, ", "next, ", "finally, ", "let us first", "let's first", "let me first", "try again", "still not",
    "not working", "not correct", "does not work", "doesn't work", "makes sence", "since we ", "because we ",
    "consequently", "as a result", "thus", "therefore", "hence", "so that", "thereby", "if we",
    "given there ", "for instance ", "for example ",
]
EXAMPLE = "First, I need to compute 3+4. Therefore the answer is 7."
PERIODIC = " ".join(f"w{i}" for i in range(10))               # 10 distinct words


# ------------------------------------------------------------------------- the score
def test_phrase_list_is_the_official_one():
    assert list(PHRASES) == SPEC_PHRASES
    assert len(PHRASES) == 40 and len(set(PHRASES)) == 40
    assert "makes sence" in PHRASES and "makes sense" not in PHRASES


@pytest.mark.parametrize("text, expected", [
    (EXAMPLE, 0.15),                                            # "first, ", "i need to", "therefore"
    ("wait wait", 0.05),                                        # presence, not count
    ("wait wait wait, wait.", 0.05),
    ("First, I need to... User: what is 2+2? Therefore", 0.0),  # any "user: " -> 0
    ("user: ", 0.0),
    ("", 0.0),
    ("thus we can see", 0.05),                                  # "we can see " needs its trailing space
    ("thus we can see it", 0.10),
    ("it makes sense", 0.0),                                    # only the typo counts
    ("it makes sence", 0.05),
    ("FIRST, WAIT", 0.10),                                      # lower-cased
])
def test_methods_vectors(text, expected):
    assert rpr_score(text) == pytest.approx(expected, abs=1e-12)


def test_phrase_score_is_capped_at_one():
    text = " ".join(PHRASES)                                    # all 40 present, fewer than 20-gram repeats
    present, rep, users = rpr_terms(text)
    assert (present, rep, users) == (40, 0.0, 0)
    assert rpr_score(text) == 1.0
    assert rpr_score(text, full_score_phrases=80) == 0.5


def test_repetition_ratio_hand_computed():
    # 30 words with period 10: 11 20-grams (positions 0..10); position 10 repeats position 0, nothing else
    assert repetition_ratio(" ".join([PERIODIC] * 3)) == pytest.approx(1 / 11)
    # 40 words: 21 20-grams, 10 distinct ones, every one occurring 2 or 3 times -> 10 / 21
    assert repetition_ratio(" ".join([PERIODIC] * 4)) == pytest.approx(10 / 21)
    # 25 equal words: 6 identical 20-grams -> 1 distinct repeated / 6
    assert repetition_ratio(" ".join(["a"] * 25)) == pytest.approx(1 / 6)
    assert repetition_ratio(" ".join(["a"] * 20)) == 0.0          # one 20-gram: nothing to repeat
    assert repetition_ratio(" ".join(["a"] * 21)) == 0.5          # two equal 20-grams
    assert repetition_ratio(PERIODIC, n=2) == 0.0
    assert repetition_ratio("a b a b a", n=2) == pytest.approx(2 / 4)   # "a b" x2, "b a" x2


def test_repetition_enters_the_score():
    # 4 phrases + the 30-word periodic text: 34 words, 15 20-grams, 1 repeated -> 4/20 - 1/15
    text = "wait therefore thus hence " + " ".join([PERIODIC] * 3)
    assert rpr_terms(text) == (4, pytest.approx(1 / 15), 0)
    assert rpr_score(text) == pytest.approx(0.2 - 1 / 15)
    # repetition larger than the phrase score clamps at 0
    assert rpr_score("wait " + " ".join([PERIODIC] * 4)) == 0.0


def test_batched_scoring_matches_the_reference():
    texts = [EXAMPLE, "wait wait", "", "User: x", " ".join([PERIODIC] * 4) + " thus", "nothing here",
             "let us first, then let's first", "a\0wait", "for example \0 next, "]
    rpr, present, rep, users = score_spans(texts)
    assert rpr == [rpr_score(t) for t in texts]
    assert present == [rpr_terms(t)[0] for t in texts]
    assert rep == [rpr_terms(t)[1] for t in texts]
    assert users == [rpr_terms(t)[2] for t in texts]
    assert present[6] == 3                                      # overlapping phrases: "let us first", "first, "...
    assert score_spans([]) == ([], [], [], [])


# ------------------------------------------------------------------------- the span
def test_thinking_span():
    assert thinking_span("<think>wait</think> therefore 7") == "wait"
    assert thinking_span("no markers at all") == "no markers at all"          # absent: the whole completion
    assert thinking_span("wait</think> therefore") == "wait"                  # start in the prompt
    assert thinking_span("<think>wait, therefore") == "wait, therefore"       # unfinished thinking
    assert thinking_span("<think>a</think><think>b</think>") == "a"
    assert thinking_span("x<think>a</think>", end=None) == "a</think>"
    # the official code's slicing: one more character skipped, and the 18-character quirk
    marker = "Assistant: <think>"
    assert thinking_span("User: q Assistant: <think> wait", marker, repo_slicing=True) == "wait"
    alphabet = "abcdefghijklmnopqrstuvwxyz"
    assert thinking_span(alphabet, marker, repo_slicing=True) == alphabet[18:]
    with pytest.raises(ValueError, match="start marker"):
        thinking_span("x", None, repo_slicing=True)


# ------------------------------------------------------------------------- the plugin
COMPLETIONS = ["<think>First, I need to compute 3+4. Therefore</think> 7",   # 0.15
               "<think>wait wait</think> therefore 5",                        # 0.05 (answer not scored)
               "plain answer 7",                                              # 0
               "<think>wait. User: again</think>",                            # 0
               ]


def rpr_batch(rewards=(1, 0, 1, 0), names=("accuracy",), completions=COMPLETIONS, **kwargs):
    return make_batch([list(r) if isinstance(r, tuple) else r for r in rewards], num_generations=4,
                      completions=completions, reward_names=list(names), **kwargs)


def test_append_column():
    result = run_plugin(ReasoningPatternReward, rpr_batch(), {"weight": 0.5})
    assert result.reward_names == ["accuracy", "rpr"]
    assert result.batch.reward_weights.tolist() == [1.0, 0.5]
    torch.testing.assert_close(result.rewards[:, 1], torch.tensor([0.15, 0.05, 0.0, 0.0]))
    assert result.rewards[:, 0].tolist() == [1, 0, 1, 0]
    m = result.metrics
    assert m["rpr/mean"] == pytest.approx(0.05)
    assert m["rpr/phrases"] == pytest.approx((3 + 1 + 0 + 1) / 4)
    assert m["rpr/user_turn_fraction"] == 0.25
    assert m["rpr/repetition"] == 0.0
    # the estimator sees the weighted total accuracy + 0.5 * rpr
    total = torch.tensor([1.075, 0.025, 1.0, 0.0], dtype=torch.float64)
    expected = ((total - total.mean()) / (total.std() + 1e-4)).float()
    torch.testing.assert_close(result.advantages, expected, rtol=1e-5, atol=1e-6)


def test_markers_and_repo_slicing_options():
    to_end = run_plugin(ReasoningPatternReward, rpr_batch(), {"think_end": None})
    torch.testing.assert_close(to_end.rewards[:, 1], torch.tensor([0.15, 0.10, 0.0, 0.0]))
    # no "<think>": the code's slicing drops len("<think>") = 7 characters, "wait, t", leaving "hus"
    repo = run_plugin(ReasoningPatternReward, rpr_batch(completions=["wait, thus"] * 4), {"repo_slicing": True})
    torch.testing.assert_close(repo.rewards[:, 1], torch.zeros(4))
    span = run_plugin(ReasoningPatternReward, rpr_batch(completions=["wait, thus"] * 4))
    torch.testing.assert_close(span.rewards[:, 1], torch.full((4,), 0.10))


def test_chat_completions():
    chat = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    result = run_plugin(ReasoningPatternReward, rpr_batch(completions=chat))
    torch.testing.assert_close(result.rewards[:, 1], torch.tensor([0.15, 0.05, 0.0, 0.0]))


def test_existing_column_is_replaced():
    batch = rpr_batch(rewards=[(1, 9), (0, 9), (1, 9), (0, 9)], names=("accuracy", "rpr"), reward_weights=[1.0, 2.0])
    result = run_plugin(ReasoningPatternReward, batch)
    assert result.reward_names == ["accuracy", "rpr"]
    assert result.batch.reward_weights.tolist() == [1.0, 1.0]                # weight given by the plugin
    torch.testing.assert_close(result.rewards[:, 1], torch.tensor([0.15, 0.05, 0.0, 0.0]))


def test_alone_uses_only_rpr():
    batch = rpr_batch(rewards=[(1, 1), (0, 1), (1, 0), (0, 0)], names=("accuracy", "format"))
    result = run_plugin(ReasoningPatternReward, batch, {"combine": "alone"})
    assert result.reward_names == ["accuracy", "format", "rpr"]
    assert result.batch.reward_weights.tolist() == [0.0, 0.0, 1.0]
    only = torch.tensor([0.15, 0.05, 0.0, 0.0], dtype=torch.float64)
    expected = ((only - only.mean()) / (only.std() + 1e-4)).float()
    torch.testing.assert_close(result.advantages, expected, rtol=1e-5, atol=1e-6)


def test_calibrate_a_noisy_column():
    # rpr = [0.15, 0.05, 0, 0]; below 0.5: r + 0.1 * rpr (capped at 1), else unchanged; NaN stays NaN
    batch = rpr_batch(rewards=[0.2, 0.7, None, 0.45])
    result = run_plugin(ReasoningPatternReward, batch, {"combine": "calibrate"})
    assert result.reward_names == ["accuracy"]
    out = result.rewards[:, 0]
    torch.testing.assert_close(out[[0, 1, 3]], torch.tensor([0.215, 0.7, 0.45]))
    assert math.isnan(out[2].item())
    assert result.metrics["rpr/calibrated_fraction"] == 0.5
    capped = run_plugin(ReasoningPatternReward, rpr_batch(rewards=[0.49, 0, 0, 0]),
                        {"combine": "calibrate", "calibration_scale": 10.0})
    torch.testing.assert_close(capped.rewards[:, 0], torch.tensor([1.0, 0.5, 0.0, 0.0]))
    named = run_plugin(ReasoningPatternReward, rpr_batch(rewards=[(1, 0.2), (1, 0.2), (1, 0.2), (1, 0.2)],
                                                         names=("accuracy", "rm")),
                       {"combine": "calibrate", "target": "rm"})
    torch.testing.assert_close(named.rewards, torch.tensor([[1, 0.215], [1, 0.205], [1, 0.2], [1, 0.2]]))


def test_missing_target_column():
    with pytest.raises(ConfigError, match=r"\(rpr\).*reward column 'rm'.*\['accuracy'\]"):
        check_args(ReasoningPatternReward, {"combine": "calibrate", "target": "rm"}, reward_names=["accuracy"])
    check_args(ReasoningPatternReward, {"combine": "calibrate", "target": "rm"}, reward_names=["accuracy", "rm"],
               per_device_train_batch_size=8, num_generations=4)
    with pytest.raises(PluginRuntimeError, match="no reward column 'rm'"):
        run_plugin(ReasoningPatternReward, rpr_batch(), {"combine": "calibrate", "target": "rm"})
    assert plugin_set(ReasoningPatternReward).plugins[0].instance.required_rewards() == []


@pytest.mark.parametrize("options, key", [({"repo_slicing": True, "think_start": None}, "repo_slicing"),
                                          ({"ngram": 0}, "ngram"), ({"full_score_phrases": 0}, "full_score_phrases"),
                                          ({"combine": "sum"}, "combine"), ({"phrase_list": []}, "phrase_list")])
def test_bad_options(options, key):
    with pytest.raises(ConfigError, match=key):
        plugin_set(ReasoningPatternReward, options)


def test_reward_function():
    assert rpr_reward(COMPLETIONS) == pytest.approx([0.15, 0.05, 0.0, 0.0])
    assert rpr_reward([[{"role": "assistant", "content": "wait"}]]) == [0.05]


def test_contract():
    check_plugin(ReasoningPatternReward)
    mixed = COMPLETIONS + ["", "<think></think>", "so that " * 30, "Wait"]
    batches = [lambda: make_batch([1, 0, 1, None, 0, 0, 1, 1], 4, completions=mixed),
               lambda: make_batch([1, 0, 1], 1, completions=mixed[:3])]
    check_plugin(ReasoningPatternReward, batches=batches)
    check_plugin(ReasoningPatternReward, {"combine": "alone"}, batches=batches)
    check_plugin(ReasoningPatternReward, {"combine": "calibrate"}, batches=batches)


# ------------------------------------------------------------------------- a real run
def test_training_run(tmp_path):
    # "" occurs in every text, so every completion scores at least 1/2 (8 tokens: no 20-gram repeats)
    plugin = {"name": "rpr", "phrases": ["", "wait", "the"], "full_score_phrases": 2.0, "user_marker": None}
    trainer = train_tiny([plugin], output_dir=tmp_path, reward_funcs=[answer_reward])
    assert trainer.state.global_step == 2
    logs = [entry for entry in trainer.state.log_history if "trl_credit/rpr/mean" in entry]
    assert len(logs) == 2
    for entry in logs:
        assert math.isfinite(entry["loss"])
        assert 0.5 <= entry["trl_credit/rpr/mean"] <= 1.0
        assert entry["trl_credit/rpr/phrases"] >= 1.0
        assert entry["trl_credit/rpr/repetition"] == 0.0
        assert "trl_credit/rpr/seconds" in entry
