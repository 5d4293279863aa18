"""MRT: methods.md 2.30's baseline vector (A = R - R_termination), what is scored (the cue's answer part + the
sample), J as the mean over forced answers with NaN skipped, the progress bonus on the tokens of each step, the
mode switch (estimator or transform), the checks, the contract and one real training run with both modes."""

from __future__ import annotations

import math

import pytest
import torch

from trl_credit import ConfigError, token_steps
from trl_credit.testing import check_args, check_plugin, make_batch, run_plugin, tiny_tokenizer, train_tiny
from trl_credit_mrt import MRT, MRT_CUE, answer_prefix


# row 0: three lines, ends 8, 12 and 14 (its EOS), 13 without the EOS; row 1: one token, no EOS
TEXTS = ["2 + 3 = 5\nso 5\n5", "4"]


def judge(row, text):
    """1 when the last word is 5, None (unscorable) when it has a '?', else 0."""
    return None if "?" in text else float(text.split()[-1] == "5") if text.split() else 0.0


def mrt_batch(rewards, answers, texts=TEXTS, calls=None, scored=None, score=judge, eos_on=(0,), samples=None, **kw):
    """``answers[(row, end)]``: the forced answers sampled after that prefix (one per sample; ``samples``: repeated
    or cut to that many)."""
    tok = tiny_tokenizer()
    ids = [tok(t, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if i in eos_on else [])
           for i, t in enumerate(texts)]

    def probe_fn(row, end, cue, model):
        if calls is not None:
            calls.append((row, end, cue))
        out = answers[(row, end)]
        out = (out * samples)[:samples] if samples else out
        return {"tokens": [[1]] * len(out), "texts": list(out)}

    def score_fn(row, text):
        if scored is not None:
            scored.append((row, text))
        return score(row, text)

    batch = make_batch(list(rewards), kw.pop("num_generations", 2), completion_ids=ids, completions=texts,
                       tokenizer=tok, probe_fn=probe_fn, score_fn=score_fn, scale_rewards="none", **kw)
    return batch, ids


def test_answer_prefix_of_the_cue():
    assert answer_prefix(MRT_CUE) == "The final answer is"
    assert answer_prefix("Time is up.\n</think>\n\n**Answer:**") == "**Answer:**" and answer_prefix(" A:") == "A:"


def test_baseline_vector_forced_wrong_and_both_correct():
    calls, scored = [], []
    batch, _ = mrt_batch([1.0, 1.0], {(0, 13): [" 3"], (1, 1): [" 5"]}, calls=calls, scored=scored)
    result = run_plugin(MRT, batch)
    # R = 1 and the forced answer wrong -> A = 1 - 0 = 1; R = 1 and the forced answer right -> A = 0
    assert result.advantages.tolist() == [1.0, 0.0]
    assert sorted(calls) == [(0, 13, MRT_CUE), (1, 1, MRT_CUE)]  # the end, without row 0's closing EOS
    assert sorted(scored) == [(0, "The final answer is 3"), (1, "The final answer is 5")]
    assert result.metrics["mrt/termination_reward"] == 0.5 and result.metrics["mrt/same_as_outcome"] == 0.5
    # R = 0 with the forced answer right: A = 0 - 1 = -1 (no group baseline, no std scaling)
    batch, _ = mrt_batch([0.0, 1.0], {(0, 13): [" 5"], (1, 1): [" 5"]})
    assert run_plugin(MRT, batch).advantages.tolist() == [-1.0, 0.0]


def test_j_is_the_mean_over_samples_and_the_prefix_is_configurable():
    scored = []
    batch, _ = mrt_batch([1.0, 0.0], {(0, 13): [" 5", " 4", " 5", "?"], (1, 1): [" 4", " 4", " 4", " 4"]},
                         scored=scored)
    result = run_plugin(MRT, batch, {"num_samples": 4, "answer_prefix": "Answer:"})
    # row 0: scores [1, 0, 1, None] -> J = 2/3 -> A = 1 - 2/3; row 1: J = 0 -> A = 0
    assert result.advantages.tolist() == pytest.approx([1 / 3, 0.0])
    assert {t for _, t in scored} == {"Answer: 5", "Answer: 4", "Answer:?"}  # duplicates scored once
    assert len(scored) == 4


def test_last_step_baseline():
    calls = []
    batch, _ = mrt_batch([1.0, 1.0], {(0, 12): [" 4"], (1, 0): [" 5"]}, calls=calls)
    result = run_plugin(MRT, batch, {"baseline_at": "last_step"})
    # row 0: forced at the end of its second line (12); row 1 has one step: after the prompt alone
    assert sorted((r, e) for r, e, _ in calls) == [(0, 12), (1, 0)]
    assert result.advantages.tolist() == [1.0, 0.0]


def test_baseline_nan_rewards_and_weighted_columns():
    texts = ["2 + 3 = 5\nso 5\n5", "4", "4", "4"]
    calls = []
    answers = {(1, 1): ["?", "?"], (2, 1): [" 5", " 5"], (3, 1): ["?", " 5"]}
    batch, _ = mrt_batch([None, 1.0, 0.0, 1.0], answers, texts=texts, calls=calls, samples=2)
    a = run_plugin(MRT, batch, {"num_samples": 2}).advantages
    # row 0: no reward -> 0, not probed; row 1: its forced answers unscorable -> J NaN -> 0; row 2: 0 - 1 = -1;
    # row 3: scores [None, 1] -> J = 1 (NaN skipped) -> 1 - 1 = 0
    assert a.tolist() == [0.0, 0.0, -1.0, 0.0] and 0 not in {r for r, _, _ in calls}
    assert run_plugin(MRT, mrt_batch([None, 1.0, 0.0, 1.0], answers, texts=texts, samples=1)[0]).metrics[
        "mrt/scored_fraction"] == 0.25  # one sample: row 3's only answer is unscorable too: row 2 alone of 4
    # two reward columns, weights [1, 0.5]: R = 1 * 1 + 0.5 * 0 = 1, J = 1 + 0.5 = 1.5 -> A = -0.5
    batch, _ = mrt_batch([[1.0, 0.0], [0.0, 0.0]], {(0, 13): [" 5"], (1, 1): [" 5"]}, score=lambda r, t: [1.0, 1.0],
                         reward_names=["a", "b"], reward_weights=[1.0, 0.5])
    assert run_plugin(MRT, batch).advantages.tolist() == [-0.5, -1.5]
    batch, _ = mrt_batch([[1.0, 0.0], [0.0, 0.0]], {(0, 13): [" 5"], (1, 1): [" 5"]}, score=lambda r, t: [1.0, 1.0],
                         reward_names=["a", "b"], reward_weights=[1.0, 0.5])
    assert run_plugin(MRT, batch, {"reward": "b"}).advantages.tolist() == [-1.0, -1.0]  # column b alone: 0 - 1


PROGRESS = {(0, 0): [" 4", " 4"], (0, 8): [" 5", " 4"], (0, 12): [" 5", " 5"], (0, 13): [" 5", " 3"],
            (1, 0): [" 5", " 5"], (1, 1): [" 4", " 4"]}


def per_step(advantages, batch, row, n_tokens):
    index, _ = token_steps(batch, r"\n+", fill=True)
    out = {}
    for t in range(n_tokens):
        out.setdefault(int(index[row, t]), set()).add(round(advantages[row, t].item(), 6))
    return out


def test_progress_bonus_on_the_tokens_of_each_step():
    calls = []
    batch, ids = mrt_batch([1.0, 0.0], PROGRESS, calls=calls)
    result = run_plugin(MRT, batch, {"mode": "progress", "num_samples": 2})
    a = result.advantages
    # GRPO (scale none): A = [.5, -.5]. Row 0: J after the prompt, lines 1, 2, 3 = [0, .5, 1, .5] -> progress
    # [.5, .5, -.5] -> .5 + .5 * [.5, .5, -.5] = [.75, .75, .25]; row 1: J [1, 0] -> -.5 + .5 * -1 = -1
    assert per_step(a, batch, 0, len(ids[0])) == {0: {0.75}, 1: {0.75}, 2: {0.25}}
    assert per_step(a, batch, 1, len(ids[1])) == {0: {-1.0}}
    assert sorted((r, e) for r, e, _ in calls) == sorted(PROGRESS)
    m = result.metrics
    assert m["mrt/j_prompt"] == 0.5 and m["mrt/j_end"] == 0.25 and m["mrt/episodes"] == 2.0
    assert m["mrt/progress"] == pytest.approx((0.5 + 0.5 - 0.5 - 1.0) / 4)
    # bonus_coef 2: row 0 line 3: .5 + 2 * -.5 = -.5
    a = run_plugin(MRT, mrt_batch([1.0, 0.0], PROGRESS)[0], {"mode": "progress", "num_samples": 2,
                                                              "bonus_coef": 2.0}).advantages
    assert a[0, 12].item() == pytest.approx(-0.5)


def test_progress_over_the_whole_completion_and_max_steps():
    batch, ids = mrt_batch([1.0, 0.0], PROGRESS)
    a = run_plugin(MRT, batch, {"mode": "progress", "num_samples": 2, "budget": "end"}).advantages
    # one episode: row 0 J [0, .5] -> .5 + .25 on every token (its EOS too); row 1 J [1, 0] -> -1
    assert set(a[0, : len(ids[0])].tolist()) == {0.75} and a[1, 0].item() == -1.0
    calls = []
    batch, ids = mrt_batch([1.0, 0.0], PROGRESS, calls=calls)
    a = run_plugin(MRT, batch, {"mode": "progress", "num_samples": 2, "max_steps": 2}).advantages
    # row 0 keeps the ends 12, 13: lines 1-2 are one episode, J [0, 1, .5] -> [.5 + .5, .5 - .25]
    assert per_step(a, batch, 0, len(ids[0])) == {0: {1.0}, 1: {1.0}, 2: {0.25}}
    assert (0, 8) not in {(r, e) for r, e, _ in calls}


def test_progress_edge_cases_empty_completion_nan_and_constant_group():
    texts = ["2 + 3 = 5\nso 5\n5", "", "4", "4"]
    answers = {**PROGRESS, (2, 0): ["?", "?"], (2, 1): [" 5", " 5"], (3, 0): [" 4", " 4"], (3, 1): [" 5", " 5"]}
    calls = []
    batch, _ = mrt_batch([None, 1.0, 1.0, 1.0], answers, texts=texts, calls=calls, num_generations=4, eos_on=())
    a = run_plugin(MRT, batch, {"mode": "progress", "num_samples": 2}).advantages
    assert torch.isfinite(a).all() and not {r for r, _, _ in calls} & {0, 1}  # no reward / empty: not probed
    assert (a[0] == 0).all() and (a[1] == 0).all()
    # rows 2, 3 (A = 0 in a group of equal rewards): row 2's J_0 is unscorable -> no bonus; row 3: 0 + .5 * 1
    assert a[2, 0].item() == 0.0 and a[3, 0].item() == 0.5


def test_modes_switch_the_hooks():
    from trl_credit.testing import plugin_set

    baseline = plugin_set(MRT, {}).plugins[0]
    progress = plugin_set(MRT, {"mode": "progress"}).plugins[0]
    assert "compute_advantages" in baseline.hooks and "transform_advantages" not in baseline.hooks
    assert "transform_advantages" in progress.hooks and "compute_advantages" not in progress.hooks
    # progress on completions without a step: GRPO's own (N,) advantages pass through
    batch, _ = mrt_batch([1.0, 0.0], {}, texts=["", ""], eos_on=())
    assert run_plugin(MRT, batch, {"mode": "progress"}).advantages.tolist() == [0.5, -0.5]


def test_checks():
    grpo = {"per_device_train_batch_size": 8, "num_generations": 4}
    for options, key in (({"budget": "end"}, "budget"), ({"bonus_coef": 1.0}, "bonus_coef"),
                         ({"mode": "progress", "baseline_at": "last_step"}, "baseline_at"),
                         ({"mode": "progress", "pattern": "\n*"}, "pattern")):
        with pytest.raises(ConfigError) as err:
            check_args(MRT, options, reward_names=["answer_reward"], **grpo)
        text = str(err.value)
        assert "(mrt)" in text and f"{key}:" in text and "fix:" in text, text
    with pytest.raises(ConfigError, match="correct"):  # the reward column must be produced by a reward function
        check_args(MRT, {"reward": "correct"}, reward_names=["answer_reward"], **grpo)
    check_args(MRT, {"mode": "progress", "budget": "end", "bonus_coef": 1.0}, reward_names=["answer_reward"], **grpo)


def test_contract():
    answers = {**PROGRESS, (0, 13): [" 5", " 3", "?", " 5"]}
    for options, samples in (({}, 1), ({"mode": "progress"}, 4)):
        batches = [lambda s=samples: mrt_batch([1.0, 0.0], answers, samples=s)[0],
                   lambda s=samples: mrt_batch([None, 1.0], answers, samples=s)[0],
                   lambda s=samples: mrt_batch([1.0, 1.0], answers, samples=s)[0]]
        check_plugin(MRT, options, batches=batches)


def test_trains_on_the_tiny_model_in_both_modes(tmp_path):
    small = {"num_samples": 2, "max_new_tokens": 3, "max_steps": 2}
    trainer = train_tiny([{"name": "mrt", **small}, {"name": "mrt", "mode": "progress", **small}],
                         output_dir=tmp_path, max_steps=2)
    logs = trainer.state.log_history[0]
    assert math.isfinite(logs["trl_credit/mrt/termination_reward"]) and math.isfinite(logs["trl_credit/mrt#2/j_prompt"])
    assert logs["trl_credit/mrt/scored_fraction"] == 1.0 and logs["trl_credit/mrt#2/episodes"] >= 1
    assert logs["trl_credit/cost/probe_tokens"] > 0 and logs["trl_credit/cost/score_texts_seconds"] >= 0
    assert trainer.state.log_history[-1]["train_loss"] is not None
