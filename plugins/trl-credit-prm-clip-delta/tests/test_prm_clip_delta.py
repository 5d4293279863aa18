"""PRM Clip / Delta: methods.md 2.9 vectors, token credit end to end, options, edge cases, a real run."""

from __future__ import annotations

import math

import pytest
import torch
from trl_credit_prm_clip_delta import (
    PRMClipDelta,
    clip_rewards,
    delta_rewards,
    group_normalize_steps,
    refine_rewards,
    reward_to_go,
)

from trl_credit import ConfigError, grpo_advantages, hookimpl
from trl_credit.testing import (
    answer_reward,
    check_args,
    check_plugin,
    make_batch,
    plugin_set,
    run_plugin,
    tiny_model_path,
    train_tiny,
)

TIGHT = {"rtol": 1e-6, "atol": 1e-6}
R = [0.9, 0.7, 0.8, 0.2]
SCORER = "test_prm_clip_delta:text_scores"


def text_scores(prompts, completions, steps, columns):
    """Test scorer: a step written ``s=0.7 ...`` scores 0.7 (the methods.md vectors as texts)."""
    return [[float(step.split()[0][2:]) for step in row] for row in steps]


def t(values):
    return torch.tensor(values, dtype=torch.float32)


# ------------------------------------------------------------------------- methods.md 2.9 vectors
def test_clip_vector():
    torch.testing.assert_close(clip_rewards(R, 0.5), t([[0, 0, 0, -0.3]]), **TIGHT)


def test_delta_vectors():
    keep = delta_rewards(R)
    torch.testing.assert_close(keep, t([[0.2, -0.1, 0.6, 0.2]]), **TIGHT)
    assert keep.sum().item() == pytest.approx(0.9)                          # telescopes to r_1
    torch.testing.assert_close(delta_rewards(R, last="zero"), t([[0.2, -0.1, 0.6, 0.0]]), **TIGHT)


def test_delta_clip_vectors():
    torch.testing.assert_close(refine_rewards(R, "delta_clip", 0.5), t([[0, 0, 0.3, -0.3]]), **TIGHT)
    torch.testing.assert_close(refine_rewards(R, "delta_clip", 0.5, "zero"), t([[0, 0, 0.3, 0]]), **TIGHT)
    torch.testing.assert_close(refine_rewards(R, "clip", 0.5), clip_rewards(R, 0.5))
    torch.testing.assert_close(refine_rewards(R, "none"), t([R]))


def test_reward_to_go():
    torch.testing.assert_close(reward_to_go([1.0, 2.0, 3.0]), t([[6, 5, 3]]))
    # Delta (keep): the return of step k is the PRM score r_k itself; (zero): r_k - r_K
    torch.testing.assert_close(reward_to_go(delta_rewards(R)), t([R]), **TIGHT)
    torch.testing.assert_close(reward_to_go(delta_rewards(R, last="zero")), t([[0.7, 0.5, 0.6, 0.0]]), **TIGHT)
    torch.testing.assert_close(reward_to_go(clip_rewards(R, 0.5)), t([[-0.3] * 4]), **TIGHT)


def test_single_and_no_step_and_padding():
    torch.testing.assert_close(delta_rewards([0.4]), t([[0.4]]))             # single step: Delta = r_1
    torch.testing.assert_close(delta_rewards([0.4], last="zero"), t([[0.0]]))
    assert refine_rewards(torch.zeros(2, 0), "delta_clip").shape == (2, 0)  # no steps: no process reward
    # ragged rows: padding never leaks into a real step (r_{K+1} is 0, padded entries stay 0)
    r = t([[0.9, 0.7, 0.8, 0.2], [0.6, 0.9, 5.0, 5.0], [0.3, 7.0, 7.0, 7.0]])
    counts = [4, 2, 1]
    torch.testing.assert_close(delta_rewards(r, counts), t([[0.2, -0.1, 0.6, 0.2], [-0.3, 0.9, 0, 0], [0.3, 0, 0, 0]]),
                               **TIGHT)
    torch.testing.assert_close(delta_rewards(r, counts, "zero"), t([[0.2, -0.1, 0.6, 0], [-0.3, 0, 0, 0], [0, 0, 0, 0]]),
                               **TIGHT)
    torch.testing.assert_close(clip_rewards(r, 0.5, counts), t([[0, 0, 0, -0.3], [0, 0, 0, 0], [-0.2, 0, 0, 0]]),
                               **TIGHT)


def test_group_normalize_steps():
    # group 0: steps {1, 0, 0.5} over two completions; group 1: one step only
    r = t([[1.0, 0.0], [0.5, 9.0], [0.2, 0.0], [9.0, 9.0]])
    out = group_normalize_steps(r, [2, 1, 1, 0], num_generations=2)
    std = 0.5  # unbiased std of {1, 0, 0.5}
    torch.testing.assert_close(out, t([[0.5 / (std + 1e-4), -0.5 / (std + 1e-4)], [0, 0], [0, 0], [0, 0]]), **TIGHT)


# ------------------------------------------------------------------------- token credit end to end
@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path())


def text_batch(tokenizer, texts, rewards, num_generations, **kwargs):
    """Ids = the tokenizer's encoding of each text + EOS, right-padded with the pad id (as TRL)."""
    ids = [tokenizer.encode(x, add_special_tokens=False) + [tokenizer.eos_token_id] for x in texts]
    width = max(len(i) for i in ids)
    mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids])
    return make_batch(rewards, num_generations, completion_ids=ids, completion_mask=mask, completions=texts,
                      tokenizer=tokenizer, reward_names=["answer_reward"], **kwargs)


def expected_token_steps(tokenizer, text, ids, n):
    """Independent token -> step map: the last step that starts before the token ends (0 before any)."""
    starts = [i for i, line in _line_starts(text)]
    out = []
    for tpos in range(n):
        end = len(tokenizer.decode(ids[: tpos + 1], skip_special_tokens=True))
        out.append(max(sum(1 for s in starts if s < end) - 1, 0))
    return out


def _line_starts(text):
    pos = 0
    for line in text.split("\n"):
        stripped = line.lstrip()
        if stripped.strip():
            yield pos + len(line) - len(stripped), line
        pos += len(line) + 1


TEXTS = ["s=0.9 first\ns=0.7 second\n\ns=0.8 third\ns=0.2 last",   # methods.md r
         "s=0.1 wrong start\ns=0.6 then\n",
         "",                                                          # empty completion
         "  s=1.0 only one step"]


@pytest.mark.parametrize("mode, last, returns", [
    ("clip", "keep", [[-0.3, -0.3, -0.3, -0.3], [-0.4, 0.0], [], [0.0]]),
    ("delta", "keep", [[0.9, 0.7, 0.8, 0.2], [0.1, 0.6], [], [1.0]]),
    ("delta", "zero", [[0.7, 0.5, 0.6, 0.0], [-0.5, 0.0], [], [0.0]]),
    ("delta_clip", "keep", [[0, 0, 0, -0.3], [-0.4, 0], [], [0.0]]),
    ("delta_clip", "zero", [[0.3, 0.3, 0.3, 0.0], [-0.4, 0], [], [0.0]]),
    ("none", "keep", [[2.6, 1.7, 1.0, 0.2], [0.7, 0.6], [], [1.0]]),
])
def test_token_advantage_is_outcome_plus_reward_to_go_of_its_step(tokenizer, mode, last, returns):
    rewards = [1.0, 0.0, 0.0, 1.0]
    batch = text_batch(tokenizer, TEXTS, rewards, num_generations=2)
    ids, mask = batch.completion_ids.clone(), batch.completion_mask.clone()
    result = run_plugin(PRMClipDelta, batch, {"scorer": SCORER, "mode": mode, "last": last, "eta": 0.5,
                                              "process_weight": 2.0})
    outcome = grpo_advantages(t(rewards)[:, None], t([1.0]), 2, "group", "sum_then_normalize")
    assert result.advantages.shape == ids.shape
    for i, text in enumerate(TEXTS):
        n = int(mask[i].sum())
        expected = torch.full((ids.shape[1],), float(outcome[i]))
        if returns[i]:
            steps = expected_token_steps(tokenizer, text, ids[i].tolist(), n)
            expected[:n] += 2.0 * t([returns[i][k] for k in steps])
        torch.testing.assert_close(result.advantages[i], expected, **TIGHT)
    assert result.metrics["prm_clip_delta/steps"] == pytest.approx(7 / 4)
    assert result.metrics["prm_clip_delta/step_score"] == pytest.approx(sum(R + [0.1, 0.6, 1.0]) / 7)
    assert result.metrics["prm_clip_delta/process_return"] == pytest.approx((returns[0][0] + returns[1][0]
                                                                              + returns[3][0]) / 3, abs=1e-6)


def test_sequence_and_token_advantages_both_accepted(tokenizer):
    batch = text_batch(tokenizer, TEXTS[:2], [1.0, 0.0], num_generations=2)
    plugin = plugin_set(PRMClipDelta, {"scorer": SCORER, "mode": "clip"}).plugins[0].instance
    seq = plugin.transform_advantages(batch, t([0.5, -0.5]))
    tok = plugin.transform_advantages(batch, t([0.5, -0.5])[:, None].expand_as(batch.completion_ids).clone())
    torch.testing.assert_close(seq, tok)
    n0 = int(batch.completion_mask[0].sum())
    torch.testing.assert_close(seq[0, :n0], torch.full((n0,), 0.5 - 0.3), **TIGHT)


def test_arithmetic_scorer_default(tokenizer):
    texts = ["12 + 7 = 19\nThen 19 * 2 = 37\nSo 37", "2 + 2 = 4\n4 * 3 = 12"]
    batch = text_batch(tokenizer, texts, [0.0, 1.0], num_generations=2)
    result = run_plugin(PRMClipDelta, batch)                    # clip, eta 0.5, arithmetic checker, neutral 0
    outcome = grpo_advantages(t([[0.0], [1.0]]), t([1.0]), 2, "group", "sum_then_normalize")
    steps = expected_token_steps(tokenizer, texts[0], batch.completion_ids[0].tolist(),
                                 int(batch.completion_mask[0].sum()))
    rtg = [-1.0, -1.0, -0.5]                                    # scores [1, 0, 0] -> clip [0, -0.5, -0.5]
    n0 = len(steps)
    torch.testing.assert_close(result.advantages[0, :n0], outcome[0] + t([rtg[k] for k in steps]), **TIGHT)
    n1 = int(batch.completion_mask[1].sum())
    torch.testing.assert_close(result.advantages[1, :n1], torch.full((n1,), float(outcome[1])), **TIGHT)


def test_eta_from_batch_mean_and_group_normalisation(tokenizer):
    batch = text_batch(tokenizer, TEXTS[:2], [1.0, 0.0], num_generations=2)
    result = run_plugin(PRMClipDelta, batch, {"scorer": SCORER, "eta": None})
    mean = sum(R + [0.1, 0.6]) / 6
    assert result.metrics["prm_clip_delta/eta"] == pytest.approx(mean)
    first = min(0.2 - mean, 0) + min(0.8 - mean, 0) + min(0.7 - mean, 0) + min(0.9 - mean, 0)
    assert result.metrics["prm_clip_delta/process_return"] == pytest.approx(
        (first + min(0.1 - mean, 0) + min(0.6 - mean, 0)) / 2, abs=1e-6)
    # normalize=group, mode=none: DeepSeekMath process supervision on top of the outcome advantage
    batch = text_batch(tokenizer, TEXTS[:2], [1.0, 0.0], num_generations=2)
    result = run_plugin(PRMClipDelta, batch, {"scorer": SCORER, "mode": "none", "normalize": "group"})
    z = group_normalize_steps(t([R, [0.1, 0.6, 0, 0]]), [4, 2], 2)
    outcome = grpo_advantages(t([[1.0], [0.0]]), t([1.0]), 2, "group", "sum_then_normalize")
    assert result.advantages[1, 0].item() == pytest.approx(float(outcome[1] + z[1].sum()), abs=1e-5)
    assert result.advantages[0, 0].item() == pytest.approx(float(outcome[0] + z[0].sum()), abs=1e-5)


def test_nan_reward_rows_get_no_process_credit(tokenizer):
    batch = text_batch(tokenizer, TEXTS[:2], [None, None], num_generations=2)
    result = run_plugin(PRMClipDelta, batch, {"scorer": SCORER})
    assert torch.equal(result.advantages, torch.zeros_like(result.advantages))


def test_an_unscored_row_leaves_the_group_normalisation_and_eta(tokenizer):
    two = text_batch(tokenizer, TEXTS[:2], [1.0, 0.0], num_generations=2)
    three = text_batch(tokenizer, [*TEXTS[:2], TEXTS[3]], [1.0, 0.0, None], num_generations=3)
    for config in ({"scorer": SCORER, "mode": "none", "normalize": "group"}, {"scorer": SCORER, "eta": None}):
        a2 = run_plugin(PRMClipDelta, two, config).advantages
        a3 = run_plugin(PRMClipDelta, three, config).advantages
        torch.testing.assert_close(a3[:2, : a2.shape[1]], a2, **TIGHT)  # as if the unscored row were not there
        assert (a3[2] == 0).all()


def test_single_completion_groups(tokenizer):
    batch = text_batch(tokenizer, TEXTS[:2], [1.0, 0.0], num_generations=1)
    result = run_plugin(PRMClipDelta, batch, {"scorer": SCORER, "normalize": "group"})
    assert torch.isfinite(result.advantages).all()
    n1 = int(batch.completion_mask[1].sum())
    z = group_normalize_steps(t([[0.1, 0.6]]), [2], 1)                     # one completion's own steps
    assert z[0].tolist() == pytest.approx([-0.25 / (0.353553 + 1e-4), 0.25 / (0.353553 + 1e-4)], rel=1e-5)
    # GRPO gives 0 to a lone completion; the process term is Clip(z) reward-to-go
    first = min(float(z[0, 0]) - 0.5, 0) + min(float(z[0, 1]) - 0.5, 0)
    assert result.advantages[1, 0].item() == pytest.approx(first, abs=1e-5)
    assert (result.advantages[1, n1:] == 0).all()


class DropsConstantGroups(PRMClipDelta):
    """PRMClipDelta behind a filter that drops every group whose rewards are all equal (as dynamic sampling)."""

    name = "prm_clip_delta"

    @hookimpl
    def filter_rollouts(self, batch):
        r = batch.grouped(batch.total_reward())
        return r.max(dim=1).values > r.min(dim=1).values


def test_hook_sees_the_kept_rows_only(tokenizer):
    texts = ["s=0.9 a\ns=0.1 b", "s=0.2 c", "s=0.4 d", "s=0.8 e\ns=0.3 f"]
    # group 0 has constant rewards and is dropped by the filter; group 1 is kept
    batch = text_batch(tokenizer, texts, [1.0, 1.0, 1.0, 0.0], num_generations=2)
    result = run_plugin(DropsConstantGroups, batch, {"scorer": SCORER, "mode": "delta"})
    assert result.keep.tolist() == [False, False, True, True]
    assert (result.advantages[:2] == 0).all()
    outcome = grpo_advantages(t([[1.0], [0.0]]), t([1.0]), 2, "group", "sum_then_normalize")
    n2 = int(batch.completion_mask[2].sum())
    torch.testing.assert_close(result.advantages[2, :n2], torch.full((n2,), float(outcome[0]) + 0.4), **TIGHT)
    steps = expected_token_steps(tokenizer, texts[3], batch.completion_ids[3].tolist(),
                                 int(batch.completion_mask[3].sum()))
    torch.testing.assert_close(result.advantages[3, :len(steps)], outcome[1] + t([[0.8, 0.3][k] for k in steps]),
                               **TIGHT)
    assert result.metrics["prm_clip_delta/steps"] == pytest.approx(1.5)    # over the kept rows


# ------------------------------------------------------------------------- config and contract
def test_config_errors():
    with pytest.raises(ConfigError, match=r"scorer.*unknown step scorer 'nope'"):
        plugin_set(PRMClipDelta, {"scorer": "nope"})
    with pytest.raises(ConfigError, match=r"scorer.*cannot import module 'no_such_mod_xyz'"):
        plugin_set(PRMClipDelta, {"scorer": "no_such_mod_xyz:score"})
    with pytest.raises(ConfigError, match="pattern.*not a valid regex"):
        plugin_set(PRMClipDelta, {"pattern": "(unclosed"})
    with pytest.raises(ConfigError, match="mode"):
        plugin_set(PRMClipDelta, {"mode": "clipped"})
    with pytest.raises(ConfigError, match="last"):
        plugin_set(PRMClipDelta, {"last": "drop"})


GRPO_ARGS = {"per_device_train_batch_size": 8, "num_generations": 4}


def test_check_args_scorer_kwargs_the_scorer_does_not_take():
    with pytest.raises(ConfigError) as info:
        check_args(PRMClipDelta, {"scorer_kwargs": {"neutrall": 0.5}}, **GRPO_ARGS)
    message = str(info.value)
    assert "plugins[0] (prm_clip_delta): scorer_kwargs:" in message and "'neutrall'" in message
    assert "fix: pass only keyword options the scorer takes" in message and "neutral=0.0" in message
    with pytest.raises(ConfigError, match=r"\(prm_clip_delta\): scorer_kwargs: .*fix: pass only keyword options"):
        check_args(PRMClipDelta, {"scorer": SCORER, "scorer_kwargs": {"scale": 2}}, **GRPO_ARGS)
    check_args(PRMClipDelta, {"scorer_kwargs": {"neutral": 0.5}}, **GRPO_ARGS)
    check_args(PRMClipDelta, {"scorer": SCORER}, **GRPO_ARGS)


def test_scorer_errors_name_the_scorer(tokenizer):
    batch = text_batch(tokenizer, TEXTS[:2], [1.0, 0.0], num_generations=2)
    with pytest.raises(Exception, match="step scorer 'test_prm_clip_delta:bad_scores' returned 1 scores"):
        run_plugin(PRMClipDelta, batch, {"scorer": "test_prm_clip_delta:bad_scores"})


def bad_scores(prompts, completions, steps, columns):
    return [[1.0] for _ in steps]


def real_text_batches(tokenizer):
    def make(rewards, g, texts):
        return lambda: text_batch(tokenizer, texts, rewards, g)

    mixed = ["1 + 1 = 2\n2 + 2 = 5", "3 * 3 = 9", "", "hmm\n\n4 - 1 = 3\nso 3"]
    return [
        make([1, 0, 1, 0], 2, mixed),
        make([1, 1, 0, 0], 2, mixed),                          # constant groups
        make([1, None, None, None], 2, mixed),                 # NaN rewards
        make([1, 0, 0.5], 1, mixed[:3]),                       # one completion per group
        make([0, 0], 2, ["", ""]),                             # no steps anywhere
    ]


def test_contract_on_the_kits_edge_cases():
    check_plugin(PRMClipDelta)                                 # stand-in tokenizer: text spread over tokens


def test_contract(tokenizer):
    check_plugin(PRMClipDelta, batches=real_text_batches(tokenizer))
    for options in ({"mode": "delta_clip", "last": "zero"}, {"mode": "none", "normalize": "group"},
                    {"eta": None, "scorer_kwargs": {"neutral": 0.5}}):
        check_plugin(PRMClipDelta, options, batches=real_text_batches(tokenizer))


# ------------------------------------------------------------------------- a real run
def test_training_run(tmp_path):
    trainer = train_tiny([{"name": "prm_clip_delta", "eta": 0.5}], output_dir=tmp_path, reward_funcs=[answer_reward])
    assert trainer.state.global_step == 2
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2
    for entry in logs:
        assert math.isfinite(entry["loss"])
        assert entry["trl_credit/prm_clip_delta/steps"] > 0
        # random 8-token texts hold no checkable equation: every step scores 0 and costs eta
        assert entry["trl_credit/prm_clip_delta/step_score"] == 0.0
        assert entry["trl_credit/prm_clip_delta/process_return"] <= -0.5
