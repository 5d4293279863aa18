"""trl_credit.steps: step splitting, token -> step maps, step scorers, the arithmetic checker and reward."""

from __future__ import annotations

import math
import re

import pytest
import torch

from trl_credit.app.rewards import (
    arithmetic_steps,
    known_reward_names,
    resolve_reward_funcs,
)
from trl_credit.app.arithmetic_steps import arithmetic_step_scores, check_equations
from trl_credit.steps import (
    _prefix_ends,
    known_step_scorers,
    pad_step_scores,
    resolve_step_scorer,
    score_steps,
    split_steps,
    step_scores,
    token_char_offsets,
    token_steps,
)
from trl_credit.testing import make_batch


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from trl_credit.testing.tiny import local_tokenizer_path

    return AutoTokenizer.from_pretrained(local_tokenizer_path())


def text_batch(tokenizer, texts, num_generations=None, eos=True, **kwargs):
    """A batch whose ids are the tokenizer's encoding of ``texts`` (+ EOS), right-padded, as TRL builds it."""
    ids = [tokenizer.encode(t, add_special_tokens=False) + ([tokenizer.eos_token_id] if eos else []) for t in texts]
    width = max(max(len(i) for i in ids), 1)
    mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids])
    batch = make_batch(kwargs.pop("rewards", [0.0] * len(texts)), num_generations or len(texts),
                       completion_ids=ids, completion_mask=mask, completions=kwargs.pop("completions", texts),
                       pad_token_id=tokenizer.pad_token_id, **kwargs)
    batch.tokenizer = tokenizer
    return batch


# ------------------------------------------------------------------------------ split_steps
def test_split_steps_default_lines_strips_and_drops_empty():
    text = "  12 + 7 = 19 \n\n\nThen 19 * 2 = 38.\n   \nDone\n"
    steps, spans = split_steps(text)
    assert steps == ["12 + 7 = 19", "Then 19 * 2 = 38.", "Done"]
    assert spans == [(2, 13), (17, 34), (39, 43)]
    assert [text[a:b] for a, b in spans] == steps


def test_split_steps_other_patterns():
    assert split_steps("a\nb\n\nc", r"\n\s*\n")[0] == ["a\nb", "c"]
    steps, spans = split_steps("Step 1: x = 2 Step 2: y", r"(?=Step \d)")     # zero-width delimiter
    assert steps == ["Step 1: x = 2", "Step 2: y"] and spans == [(0, 13), (14, 23)]
    assert split_steps("a; b;; c", re.compile(r";+"))[0] == ["a", "b", "c"]
    assert split_steps("") == ([], []) and split_steps(" \n\n \n") == ([], [])
    assert split_steps("one step") == (["one step"], [(0, 8)])


# ------------------------------------------------------------------------------ arithmetic checker
@pytest.mark.parametrize("text, verdicts", [
    ("12 + 7 = 19", [True]),
    ("12+7=20", [False]),
    ("(3 + 4) * 2 = 14", [True]),
    ("3 * 4 - 2 = 10.", [True]),                       # sentence period after the result
    ("2 * 3 + 4 = 10", [True]),                        # precedence
    ("2 + 3 * 4 = 20", [False]),
    ("So -3 + 5 = 2 and 2 × 3 = 6", [True, True]),     # unary minus, ×
    ("2 * (3 + 4) = 14, then 14 - 4 = 11", [True, False]),
    ("a = 3 + 4 = 7", [True]),                         # chain: the checkable part
    ("(3 + 4 = 7)", [True]),                           # unmatched parenthesis dropped
    ("-(2+3) = -5", [True]),
    ("007 + 1 = 8", [True]),
    ("1 + 2 + 3 + 4 = 10", [True]),
    ("x - 3 = 4", []),                                 # a variable: not judged
    ("8 / 2 + 1 = 5", []),                             # division: not judged
    ("3.5 + 2 = 5", []),                               # decimals: not judged
    ("3 + 4 = 7.5", []),
    ("3 + 4 = 10 - 3", []),                            # right side continues
    ("1,000 + 2 = 1,002", []),
    ("7 = 7", []),                                     # no operator
    ("2 + 2 = 4x", []),
    ("no maths here", []),
])
def test_check_equations(text, verdicts):
    assert check_equations(text) == verdicts


def test_arithmetic_step_scores_and_neutral():
    steps = [["12 + 7 = 19", "Then 19 * 2 = 37", "So the answer", "1+1=2 and 2+2=5", "2+2=4, 3*3=9"], []]
    assert arithmetic_step_scores(None, None, steps) == [[1.0, 0.0, 0.0, 0.0, 1.0], []]
    assert arithmetic_step_scores(None, None, [["hello", "3+3=6", "3+3=7"]], neutral=0.5) == [[0.5, 1.0, 0.0]]
    # an equation never spans two steps, even when the steps are checked in one pass
    assert arithmetic_step_scores(None, None, [["3 +", "4 = 7"]]) == [[0.0, 0.0]]


# ------------------------------------------------------------------------------ scorers
def my_scorer(prompts, completions, steps, columns, bonus=0.0):
    return [[len(s) / 10 + bonus for s in row] for row in steps]


def test_resolve_step_scorer():
    assert "arithmetic" in known_step_scorers()
    assert resolve_step_scorer("arithmetic")(None, None, [["1+1=2"]], {}) == [[1.0]]
    assert resolve_step_scorer("trl_credit.app.arithmetic_steps:arithmetic_step_scores") is arithmetic_step_scores
    assert resolve_step_scorer("trl_credit.app.arithmetic_steps.arithmetic_step_scores") is arithmetic_step_scores
    assert resolve_step_scorer(my_scorer) is my_scorer
    with pytest.raises(ValueError, match="unknown step scorer 'arithmetc'.*arithmetic"):
        resolve_step_scorer("arithmetc")
    with pytest.raises(ValueError, match="step scorer 'no_such_mod_xyz:f': cannot import module 'no_such_mod_xyz'"):
        resolve_step_scorer("no_such_mod_xyz:f")
    with pytest.raises(ValueError, match="step scorer 'trl_credit.steps:nope'.*no attribute 'nope'"):
        resolve_step_scorer("trl_credit.steps:nope")
    with pytest.raises(ValueError, match="step scorer 'trl_credit.steps:DEFAULT_PATTERN' is not callable"):
        resolve_step_scorer("trl_credit.steps:DEFAULT_PATTERN")


def test_score_steps_checks_the_answer():
    steps = [["a", "bb"], ["ccc"]]
    assert score_steps(my_scorer, ["p", "p"], ["", ""], steps, {}, bonus=1.0) == [[1.1, 1.2], [1.3]]
    with pytest.raises(ValueError, match="step scorer 'short' returned 1 score lists for 2 completions"):
        score_steps(_named("short", lambda *a: [[1.0, 1.0]]), [], [], steps, {})
    with pytest.raises(ValueError, match="returned 1 scores for the 2 steps of completion 0"):
        score_steps(lambda *a: [[1.0], [1.0]], [], [], steps, {})
    with pytest.raises(ValueError, match="non-finite score for completion 1"):
        score_steps(lambda *a: [[1.0, 1.0], [math.nan]], [], [], steps, {})


def _named(name, fn):
    fn.__name__ = name
    return fn


def test_pad_step_scores():
    r, counts = pad_step_scores([[0.5, 1.0, 0.0], [], [2.0]])
    torch.testing.assert_close(r, torch.tensor([[0.5, 1.0, 0.0], [0.0, 0.0, 0.0], [2.0, 0.0, 0.0]]))
    assert counts.tolist() == [3, 0, 1]
    r, counts = pad_step_scores([[], []])
    assert r.shape == (2, 0) and counts.tolist() == [0, 0]


# ------------------------------------------------------------------------------ token offsets and steps
TEXTS = [
    "12 + 7 = 19\n\nThen 19 * 2 = 38.\nSo the answer is 38",
    "\n\nonly one step  \n",
    "",
    "x × 3 → 7 ü\n\n€5 + 2 = 7",       # non-ASCII: byte tokens split characters (exact fallback)
]


def test_token_offsets_cover_the_text(tokenizer, monkeypatch):
    import trl_credit.steps as steps_module

    exact_rows = []
    prefix_ends = steps_module._prefix_ends
    monkeypatch.setattr(steps_module, "_prefix_ends", lambda tok, ids, n: exact_rows.append(n) or prefix_ends(tok, ids, n))
    batch = text_batch(tokenizer, TEXTS, num_generations=2)
    starts, ends = token_char_offsets(batch)
    assert exact_rows == [len(TEXTS[3])]       # only the row with split characters needed prefix decoding
    for i, text in enumerate(TEXTS):
        n = int(batch.completion_mask[i].sum())
        s, e = starts[i].tolist(), ends[i].tolist()
        assert s[0] == 0 and e[n - 1] == len(text)                      # whole text, EOS zero-width
        assert all(a <= b for a, b in zip(s, e)) and s[1:] == e[:-1]      # contiguous
        assert "".join(text[a:b] for a, b in zip(s, e)) == text
        if text.isascii():  # each token's span is its own decoded text
            pieces = tokenizer.batch_decode([[t] for t in batch.completion_ids[i, :n].tolist()],
                                            skip_special_tokens=True)
            assert [text[a:b] for a, b in zip(s[:n], e[:n])] == pieces


def test_fast_offsets_equal_exact_prefix_decoding(tokenizer):
    text = "Step 1: 12 + 7 = 19\n\nStep 2: (19 - 4) * 3 = 45 -- answer: 45\n  done."
    batch = text_batch(tokenizer, [text], eos=False)
    _, ends = token_char_offsets(batch)
    exact = _prefix_ends(tokenizer, batch.completion_ids[0].tolist(), len(text))
    assert ends[0].tolist() == exact


def test_token_steps_maps_tokens_to_their_step(tokenizer):
    batch = text_batch(tokenizer, TEXTS, num_generations=2)
    index, steps = token_steps(batch)
    assert steps == [["12 + 7 = 19", "Then 19 * 2 = 38.", "So the answer is 38"], ["only one step"], [],
                     ["x × 3 → 7 ü", "€5 + 2 = 7"]]
    assert index.shape == batch.completion_ids.shape and index.dtype == torch.long
    starts, ends = token_char_offsets(batch)
    for i, text in enumerate(TEXTS):
        for k, step in enumerate(steps[i]):
            toks = (index[i] == k).nonzero().flatten().tolist()
            covered = "".join(text[starts[i, t]:ends[i, t]] for t in toks)
            assert covered.strip() == step                             # the step's tokens spell the step
            assert toks == list(range(toks[0], toks[-1] + 1))          # contiguous, in order
    assert (index[batch.completion_mask == 0] == -1).all()             # padding
    assert (index[2] == -1).all()                                      # empty completion: no step
    # delimiter / whitespace / EOS tokens belong to no step
    n0 = int(batch.completion_mask[0].sum())
    outside = [t for t in range(n0) if index[0, t] == -1]
    assert all(TEXTS[0][starts[0, t]:ends[0, t]].strip() == "" for t in outside)
    assert index[0, n0 - 1] == -1                                       # EOS
    # fill: gap tokens take the step before them, leading ones the first step; padding stays -1
    filled, _ = token_steps(batch, fill=True)
    for i in range(len(TEXTS)):
        n = int(batch.completion_mask[i].sum())
        row, strict = filled[i, :n].tolist(), index[i, :n].tolist()
        if not steps[i]:
            assert row == [-1] * n
            continue
        first = next(t for t in range(n) if strict[t] >= 0)
        expected = [0] * first
        for t in range(first, n):
            expected.append(strict[t] if strict[t] >= 0 else expected[-1])
        assert row == expected
        assert (filled[i, n:] == -1).all()
    # cached per batch, pattern and fill
    assert token_steps(batch)[0] is index and token_steps(batch, fill=True)[0] is filled
    assert token_steps(batch, r"\n\n")[1][0] == ["12 + 7 = 19", "Then 19 * 2 = 38.\nSo the answer is 38"]


def test_token_straddling_a_delimiter_belongs_to_the_first_step(tokenizer):
    text = "1+1=2.\n\nok"
    batch = text_batch(tokenizer, [text], eos=False)
    starts, ends = token_char_offsets(batch)
    index, steps = token_steps(batch, r"\.\s*")                        # delimiter ".\n\n"
    assert steps == [["1+1=2", "ok"]]
    for t in range(batch.completion_ids.shape[1]):
        a, b = int(starts[0, t]), int(ends[0, t])
        if a < 5:
            assert index[0, t] == 0                                    # overlaps step 0 (first overlap wins)
        elif b <= 8:
            assert index[0, t] == -1                                   # only delimiter text
        else:
            assert index[0, t] == 1
    filled = token_steps(batch, r"\.\s*", fill=True)[0][0]
    assert filled.tolist() == [max(i, 0) for i in index[0].tolist()]   # delimiter tokens close step 0


def test_masked_tokens_and_conversational_completions(tokenizer):
    texts = ["1 + 1 = 2\n2 + 2 = 4", "3 + 3 = 6"]
    chat = [[{"role": "assistant", "content": t}] for t in texts]
    batch = text_batch(tokenizer, texts, completions=chat)
    batch.completion_mask[1] = 0                                       # e.g. a masked truncated completion
    index, steps = token_steps(batch)
    assert steps == [["1 + 1 = 2", "2 + 2 = 4"], ["3 + 3 = 6"]]
    assert set(index[0].tolist()) == {-1, 0, 1} and (index[1] == -1).all()


def test_stub_tokenizer_spreads_text_evenly():
    batch = make_batch([1, 0], 2, lengths=[4, 2], completions=["ab\ncd", "xyz"])
    starts, ends = token_char_offsets(batch)
    assert ends.tolist() == [[1, 2, 3, 5], [1, 3, 3, 3]]
    assert starts.tolist() == [[0, 1, 2, 3], [0, 1, 3, 3]]
    index, steps = token_steps(batch)
    assert steps == [["ab", "cd"], ["xyz"]]
    assert index.tolist() == [[0, 0, -1, 1], [0, 0, -1, -1]]


def test_step_scores_on_a_batch_is_cached(tokenizer):
    batch = text_batch(tokenizer, ["1 + 1 = 2\n1 + 1 = 3\nhmm", "2 * 3 = 6"], columns={"answer": ["2", "6"]})
    seen = []

    def spy(prompts, completions, steps, columns, **kw):
        seen.append((list(prompts), columns["answer"], kw))
        return arithmetic_step_scores(prompts, completions, steps, columns, **kw)

    steps, scores = step_scores(batch, spy, neutral=0.25)
    assert steps == [["1 + 1 = 2", "1 + 1 = 3", "hmm"], ["2 * 3 = 6"]]
    assert scores == [[1.0, 0.0, 0.25], [1.0]]
    assert step_scores(batch, spy, neutral=0.25) == (steps, scores) and len(seen) == 1
    assert seen[0] == (["prompt 0", "prompt 0"], ["2", "6"], {"neutral": 0.25})
    assert step_scores(batch, "arithmetic")[1] == [[1.0, 0.0, 0.0], [1.0]]


# ------------------------------------------------------------------------------ the reward function
def test_arithmetic_steps_reward():
    completions = ["12 + 7 = 19\nThen 19 * 2 = 37\nSo 37", "2 + 2 = 4", "", "no equations at all",
                   [{"role": "assistant", "content": "1 + 1 = 2\n\n2 + 2 = 4"}]]
    rewards = arithmetic_steps(completions, answer=["38", "4", "1", "0", "4"])
    assert rewards == pytest.approx([1 / 3, 1.0, 0.0, 0.0, 1.0])
    assert None not in rewards
    assert "arithmetic_steps" in known_reward_names()
    (func,) = resolve_reward_funcs(["arithmetic_steps"])
    assert func is arithmetic_steps and func.__name__ == "arithmetic_steps"


# ------------------------------------------------------------------------------ speed (smoke)
def test_token_steps_is_vectorised_enough(tokenizer):
    import random
    import time

    rng = random.Random(0)
    texts = ["\n".join(f"Step {k}: {rng.randint(1, 99)} + {rng.randint(1, 99)} = {rng.randint(2, 198)}"
                       for k in range(12)) for _ in range(256)]
    batch = text_batch(tokenizer, texts, num_generations=8)
    token_steps(batch)                                      # fills the tokenizer's length table
    batch.token_cache.clear()
    start = time.perf_counter()
    index, steps = token_steps(batch)
    elapsed = time.perf_counter() - start
    assert all(len(s) == 12 for s in steps) and int(index.max()) == 11
    assert elapsed < 5.0                                    # ~0.03 s on a quiet core; generous for CI
