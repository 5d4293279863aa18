"""Search-E1: sibling choice, hand-computed terms and gradients, schedules, checks, contract, real runs."""

from __future__ import annotations

import math

import pytest
import torch
from trl_credit_search_e1 import (
    SearchE1,
    choose_siblings,
    trajectory_text,
    with_context,
)

from trl_credit import ConfigError
from trl_credit.testing import (
    check_args,
    check_plugin,
    loss_inputs,
    make_batch,
    run_loss,
    run_plugin,
    train_tiny,
)

# ------------------------------------------------------------------ a hand-built batch for the sibling choice
# G = 4, three groups; ids as lists (pad = EOS = 0, never used in them), width 3.
#   group 0: rewards 1 0 1 0, lengths 3 2 2 3       -> shortest correct: row 2 (2 tokens; row 0 has 3)
#   group 1: rewards 0 0 0 NaN                        -> no correct completion: no term
#   group 2: rewards 1 1 0 1, lengths 2 2 1 0         -> rows 8 and 9 tie at 2 tokens: the lower row, 8;
#            row 9 is a copy of row 8 (same ids) and row 11 is empty (not a sibling, not a student)
IDS = [[5, 6, 7], [5, 6], [8, 9], [5, 6, 9],
       [1], [2], [3], [4],
       [5, 7], [5, 7], [6], []]
REWARDS = [1, 0, 1, 0, 0, 0, 0, None, 1, 1, 0, 1]
PROMPTS = [[{"role": "user", "content": f"Q{i // 4}?"}] for i in range(12)]


def sibling_batch(calls=None, **kw):
    def fn(row, prompt, model):
        if calls is not None:
            calls.append((row, prompt, model))
        return [-1.0, -1.0, -1.0]

    return make_batch(REWARDS, 4, completion_ids=IDS, prompts=PROMPTS, completion_logps_fn=fn, **kw)


def selection(b, config=None):
    plugin = SearchE1(SearchE1.Config(**(config or {})))
    plugin._select(b)
    return plugin._sibling.tolist(), plugin._weight.tolist()


def test_the_shortest_correct_sibling_on_a_hand_built_batch():
    sibling, weight = selection(sibling_batch())
    # group 0: rows 0, 1, 3 distil towards row 2; row 2 (the sibling) gets no term
    # group 1: nothing; group 2: row 10 towards row 8; row 8 is the sibling, row 9 a copy of it, row 11 empty
    assert sibling == [2, 2, -1, 2, -1, -1, -1, -1, -1, -1, 8, -1]
    assert weight == [1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 1, 0]
    # sibling_row next: row 2 distils towards the second shortest correct completion, row 0; row 8 towards
    # row 9, but row 9 is identical to row 8, so neither of the two copies distils towards the other
    sibling, weight = selection(sibling_batch(), {"sibling_row": "next"})
    assert sibling == [2, 2, 0, 2, -1, -1, -1, -1, -1, -1, 8, -1]
    assert weight == [1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 0]
    # students failed: only the incorrect rows 1, 3 (group 0) and 10 (group 2)
    assert selection(sibling_batch(), {"students": "failed"})[1] == [0, 1, 0, 1, 0, 0, 0, 0, 0, 0, 1, 0]


def test_dropped_rows_are_neither_siblings_nor_students():
    b = sibling_batch()
    b.kept = torch.tensor([True, True, False, True] + [True] * 8)
    sibling, weight = selection(b)
    assert sibling[:4] == [-1, 0, -1, 0] and weight[:4] == [0, 1, 0, 1]  # row 2 dropped: row 0 (3 tokens) instead
    b = sibling_batch()
    b.kept = torch.tensor([True] * 8 + [False] * 4)
    assert selection(b)[1][8:] == [0, 0, 0, 0]


def test_threshold_outcome_column_and_nan():
    # two reward columns: the outcome column decides, not the total; NaN never counts as correct
    rewards = [[0.6, 5.0], [0.4, 0.0], [None, 9.0], [0.9, 0.0]]
    b = make_batch(rewards, 4, lengths=[1, 2, 3, 4], reward_names=["em", "format"])
    sibling, _ = selection(b, {"outcome_reward": "em"})
    assert sibling == [-1, 0, 0, 0]  # rows 0 and 3 correct (>= 0.5), row 0 shorter
    sibling, _ = selection(b, {"outcome_reward": "em", "threshold": 0.7})
    assert sibling == [3, 3, 3, -1]
    assert selection(b)[0] == [-1, 0, 0, 0]  # total reward 5.6, 0.4, 9.0, 0.9: row 0 is the shortest >= 0.5


def test_shortest_by_turns():
    # row 0: 3 tokens in 2 model turns (a tool reply between); row 1: 4 tokens in 1 turn; row 2 wrong
    b = make_batch([1, 1, 0], 3, completion_ids=[[5, 6, 7], [5, 6, 7, 8], [9]],
                   tool_mask=[[1, 0, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]])
    assert selection(b)[0] == [-1, 0, 0]
    assert selection(b, {"shortest_by": "turns"})[0] == [1, -1, 1]


def test_choose_siblings_edge_cases():
    candidate = torch.tensor([False, False, True, True, False, False])
    key = torch.tensor([1.0, 1.0, 5.0, 5.0, 1.0, 2.0])
    # G = 2: group 1 ties (rows 2, 3): row 2; next gives row 2 the other one; G = 1 never has a sibling
    assert choose_siblings(candidate, key, 2).tolist() == [-1, -1, -1, 2, -1, -1]
    assert choose_siblings(candidate, key, 2, "next").tolist() == [-1, -1, 3, 2, -1, -1]
    assert choose_siblings(candidate, key, 1, "next").tolist() == [-1] * 6
    # G = 3: row 2 is group 0's only candidate, row 3 group 1's; the candidates themselves have no second
    assert choose_siblings(candidate, key, 3, "next").tolist() == [2, 2, -1, -1, 3, 3]


def test_privileged_prompts_as_scored():
    calls = []
    b = sibling_batch(calls=calls, completions=[f"answer {i}" for i in range(12)])
    run_plugin(SearchE1, b, {"schedule": "joint"})
    # only the four distilling rows are scored, each once, with the policy, under prompt + its sibling
    assert sorted(c[0] for c in calls) == [0, 1, 3, 10] and {c[2] for c in calls} == {"policy"}
    prompt_of = {row: prompt for row, prompt, _ in calls}
    assert prompt_of[0] == [{"role": "user", "content": "Q0?\n\nA correct and efficient solution to this question "
                                                        "from an earlier attempt:\nanswer 2\n\nSolve the question "
                                                        "yourself, as efficiently."}]
    assert prompt_of[10][0]["content"].startswith("Q2?\n\n") and "answer 8" in prompt_of[10][0]["content"]
    assert PROMPTS[0] == [{"role": "user", "content": "Q0?"}]  # the batch's prompts are not edited
    run_loss(SearchE1, loss_inputs(b, torch.zeros(12)), {"schedule": "joint"})
    assert len(calls) == 4  # a fresh instance in the loss hook: the batch's cache answered
    calls.clear()
    run_plugin(SearchE1, sibling_batch(calls=calls), {"schedule": "joint", "sibling_template": "Sib: {sibling}",
                                                       "sibling_position": "system"})
    assert calls[0][1] == [{"role": "system", "content": "Sib: completion 2"}, PROMPTS[0][0]]
    with pytest.raises(ConfigError, match="must contain the placeholder"):
        run_plugin(SearchE1, sibling_batch(), {"sibling_template": "Sibling:"})


def test_trajectory_text_and_with_context():
    messages = [{"role": "assistant", "content": "<search>x</search>"}, {"role": "tool", "content": "doc"},
                {"role": "assistant", "content": "42"}]
    assert trajectory_text(messages) == "<search>x</search>\n\n[tool] doc\n\n42"
    assert trajectory_text("plain") == "plain"
    assert with_context("Q?", "S", "user") == "Q?\n\nS" and with_context("Q?", "S", "system") == "S\n\nQ?"
    assert with_context([{"role": "system", "content": "sys"}, {"role": "user", "content": "Q"}], "S", "system") == \
        [{"role": "system", "content": "sys\n\nS"}, {"role": "user", "content": "Q"}]


# ------------------------------------------------------------------ hand-computed terms and gradients
# G = 2. Group 0: rewards 0 1, row 1 (1 token) is the sibling of row 0. Group 1: rewards 1 1, 2 tokens each:
# row 2 (the lower row) is the sibling of row 3. Distilled: rows 0 and 3, 2 tokens each. dapo normaliser: 7 tokens.
G_IDS = [[3, 4], [5], [6, 7], [6, 8]]
STUDENT = [[-1.0, -1.0], [-2.0, -2.0], [-1.0, -1.0], [-1.5, -1.0]]   # l: loss.logps
TEACHER = [[-0.5, -3.0], [9.0, 9.0], [9.0, 9.0], [0.0, -2.0]]       # q; rows 1, 2 are never distilled
# log r = q - l: row 0 [0.5, -2.0], row 3 [1.5, -1.0]; r = e^0.5, e^-2, e^1.5 = 4.48 (-> clipped to 2), e^-1


def grad_batch(teacher=TEACHER, step=1, calls=None, **kw):
    def fn(row, prompt, model):
        if calls is not None:
            calls.append(row)
        return teacher[row]

    return make_batch([0, 1, 1, 1], 2, completion_ids=G_IDS, completion_logps_fn=fn, step=step, **kw)


def term_and_grad(config=None, loss_type="dapo", b=None, student=STUDENT, old=None):
    logps = torch.tensor(student, requires_grad=True)
    loss = loss_inputs(b if b is not None else grad_batch(), torch.zeros(4), logps=logps, loss_type=loss_type,
                       old_logps=None if old is None else torch.tensor(old))
    result = run_loss(SearchE1, loss, config)
    (grad,) = torch.autograd.grad(result.terms["opsd"], logps)
    return result, grad, loss


def test_forward_estimator_by_hand():
    result, grad, _ = term_and_grad()  # defaults: forward, baseline, c = 2, coef 1; step 1 distils (every 2)
    e = math.exp
    # value: sum w (q - l) / 7 = (e^0.5 * 0.5 + e^-2 * -2 + 2 * 1.5 + e^-1 * -1) / 7
    value = (e(0.5) * 0.5 - 2 * e(-2) + 2 * 1.5 - e(-1)) / 7
    assert result.terms["opsd"].item() == pytest.approx(value)
    # gradient (1 - w) / 7: tokens the teacher prefers (w > 1) get a negative gradient (pushed up by descent)
    expected = torch.tensor([[1 - e(0.5), 1 - e(-2)], [0.0, 0.0], [0.0, 0.0], [1 - 2.0, 1 - e(-1)]]) / 7
    torch.testing.assert_close(grad, expected)
    # no baseline: -w / 7; ratio_clip 10 leaves e^1.5 unclipped; coef scales both
    _, grad, _ = term_and_grad({"baseline": False, "ratio_clip": 10.0, "coef": 3.0})
    torch.testing.assert_close(grad, -3 * torch.tensor([[e(0.5), e(-2)], [0, 0], [0, 0], [e(1.5), e(-1)]]) / 7)


def test_reverse_estimator_by_hand():
    result, grad, _ = term_and_grad({"estimator": "reverse"})
    # (l - q)^2 / 2 summed / 7 = (0.25 + 4 + 2.25 + 1) / 2 / 7; gradient (l - q) / 7
    assert result.terms["opsd"].item() == pytest.approx(7.5 / 2 / 7)
    torch.testing.assert_close(grad, torch.tensor([[-0.5, 2.0], [0, 0], [0, 0], [-1.5, 1.0]]) / 7)


def test_off_policy_weights_use_the_sampler_log_probs():
    old = [[-0.5, -1.0], [0, 0], [0, 0], [-1.0, -2.0]]
    # w = min(e^(q - old), 2): row 0 [e^0, e^-2], row 3 [2 (e^1), e^0]
    _, grad, _ = term_and_grad(old=old)
    e = math.exp
    torch.testing.assert_close(grad, torch.tensor([[0.0, 1 - e(-2)], [0, 0], [0, 0], [1 - 2.0, 0.0]]) / 7)


def test_gradient_is_autograd_of_the_written_objective():
    torch.manual_seed(0)
    n, t, g = 8, 5, 4
    lengths = [5, 3, 4, 1, 5, 2, 5, 4]
    ids = [[10 + i * 7 + j for j in range(length)] for i, length in enumerate(lengths)]  # all different
    q = -torch.rand(n, t) * 3
    s = -torch.rand(n, t) * 3
    old = -torch.rand(n, t) * 3
    rewards = [0, 1, 0, 1, 1, 1, 0, 0]   # group 0: sibling row 3 (1 token); group 1: sibling row 5 (2 tokens)
    b = make_batch(rewards, g, completion_ids=ids, completion_logps_fn=lambda row, prompt, model: q[row].tolist(),
                   step=1)
    m = b.completion_mask.float()
    has = torch.tensor([1, 1, 1, 0, 1, 0, 1, 1.0]).unsqueeze(1)
    for config, sampler in (({}, None), ({"ratio_clip": 1.5}, old), ({"baseline": False}, None),
                            ({"estimator": "reverse"}, None)):
        logps = s.clone().requires_grad_()
        loss = loss_inputs(b, torch.zeros(n), logps=logps, loss_type="grpo", old_logps=sampler)
        (ours,) = torch.autograd.grad(run_loss(SearchE1, loss, config).terms["opsd"], logps)

        leaf = s.clone().requires_grad_()
        if config.get("estimator") == "reverse":
            per_token = 0.5 * (leaf - q) ** 2
        else:
            w = torch.minimum((q - (s if sampler is None else sampler)).exp(), torch.tensor(config.get("ratio_clip", 2.0)))
            per_token = w * (q - leaf) + (leaf - leaf.detach() if config.get("baseline", True) else 0.0)
        written = ((has * per_token * m).sum(1) / m.sum(1)).mean()   # grpo: mean over rows of the token mean
        (theirs,) = torch.autograd.grad(written, leaf)
        torch.testing.assert_close(ours, theirs)


def test_zero_gap_masked_tokens_and_no_sibling():
    # the student already equals the privileged teacher: r = 1, value 0, gradient (1 - 1) = 0
    result, grad, _ = term_and_grad(student=[[-0.5, -3.0], [-2, -2], [-1, -1], [0.0, -2.0]])
    assert result.terms["opsd"].item() == 0.0 and not grad.any()
    # the padded position of row 1 and the rows that do not distil never get a gradient, whatever q says
    _, grad, _ = term_and_grad({"estimator": "reverse"})
    assert not grad[1].any() and not grad[2].any()
    # no correct completion anywhere: no term, no teacher pass
    calls = []
    b = make_batch([0, 0, 0, 0], 2, completion_ids=G_IDS, step=1,
                   completion_logps_fn=lambda row, prompt, model: calls.append(row) or [0.0, 0.0])
    result, grad, _ = term_and_grad(b=b)
    assert result.terms["opsd"].item() == 0.0 and not grad.any() and calls == []
    assert result.weights is None  # nothing to distil: the step is not muted, GRPO trains


# ------------------------------------------------------------------ schedules
def test_alternate_schedule_mutes_grpo_on_distillation_steps():
    for step, distils in ((0, False), (1, True), (2, False), (3, True)):
        result = run_loss(SearchE1, loss_inputs(grad_batch(step=step), torch.zeros(4)))
        assert ("opsd" in result.terms) is distils
        if distils:  # TRL's loss off for every token of the micro-batch
            assert torch.equal(result.weights.token, torch.zeros(4, 2))
        else:
            assert result.weights is None
    for step, distils in ((0, False), (1, False), (2, True), (5, True), (6, False)):
        assert ("opsd" in run_loss(SearchE1, loss_inputs(grad_batch(step=step), torch.zeros(4)),
                                   {"every": 3}).terms) is distils
    result = run_loss(SearchE1, loss_inputs(grad_batch(step=1), torch.zeros(4)), {"mute_grpo": False})
    assert result.weights is None and "opsd" in result.terms


def test_joint_schedule_adds_the_term_every_step():
    for step in (0, 1, 2):
        result = run_loss(SearchE1, loss_inputs(grad_batch(step=step), torch.zeros(4)), {"schedule": "joint"})
        assert result.weights is None and result.terms["opsd"].item() != 0.0


def test_the_teacher_is_scored_only_for_batches_that_distil():
    calls = []
    run_plugin(SearchE1, grad_batch(step=0, calls=calls))   # alternate: step 0 is a GRPO step
    assert calls == []
    run_plugin(SearchE1, grad_batch(step=1, calls=calls))
    assert sorted(calls) == [0, 3]
    calls.clear()  # a generation batch trained over two optimiser steps (0 and 1): step 1 distils
    run_plugin(SearchE1, grad_batch(step=0, calls=calls, steps_per_generation=2))
    assert sorted(calls) == [0, 3]


# ------------------------------------------------------------------ metrics, checks, contract
def test_metrics():
    result = run_plugin(SearchE1, sibling_batch(), {"schedule": "joint"})
    # 4 distilled rows of 12 kept; siblings: rows 2, 2, 2 (2 tokens) and 8 (2 tokens)
    assert result.metrics["search_e1/distilled_fraction"] == pytest.approx(4 / 12)
    assert result.metrics["search_e1/sibling_tokens"] == 2.0
    _, _, loss = term_and_grad()
    m = loss.batch.metrics
    assert m["search_e1/mean_log_ratio"] == [pytest.approx((0.5 - 2.0 + 1.5 - 1.0) / 4)]
    assert m["search_e1/clipped_fraction"] == [pytest.approx(1 / 4)]  # e^1.5 > 2
    assert m["search_e1/grpo_muted"] == [1.0]


def test_check_outcome_reward_column():
    with pytest.raises(ConfigError) as info:
        check_args(SearchE1, {"outcome_reward": "em"}, reward_names=["accuracy", "format"], num_generations=4,
                   per_device_train_batch_size=8)
    message = str(info.value)
    assert "(search_e1)" in message
    assert "outcome_reward: 'em' is not a reward column (reward functions: accuracy, format)" in message
    assert "fix: set `outcome_reward` to the column that says whether a completion is correct" in message
    check_args(SearchE1, {"outcome_reward": "accuracy"}, num_generations=4, per_device_train_batch_size=8)
    check_args(SearchE1, num_generations=4, per_device_train_batch_size=8)


def test_contract():
    def scored(rewards, g, lengths, step=0):
        n, t = len(rewards), max(max(lengths), 1)
        gen = torch.Generator().manual_seed(n * 10 + t)
        q = -torch.rand(n, t, generator=gen)
        ids = [[2 + i * t + j for j in range(length)] for i, length in enumerate(lengths)]
        return lambda: make_batch(rewards, g, completion_ids=ids, step=step, logps=-torch.rand(n, t, generator=gen),
                                  completion_logps_fn=lambda row, prompt, model: q[row].tolist())

    batches = [scored([1, 0, 1, 0, 1, 1, 0, 0], 4, [6, 3, 5, 1, 2, 6, 4, 3]),
               scored([1, 1, 1, 1], 4, [6] * 4, step=1),
               scored([0, 0, 0, 0], 4, [6] * 4, step=1),
               scored([1, None, 0, 1], 4, [3] * 4, step=1),
               scored([0.5, 0.25], 1, [6, 0])]
    check_plugin(SearchE1, batches=batches)
    check_plugin(SearchE1, {"schedule": "joint", "estimator": "reverse", "sibling_row": "next"}, batches=batches)


# ------------------------------------------------------------------ real runs
def even_correct(completions, **kwargs):
    """A stand-in outcome reward: the tiny random model never answers right, so rows 0 and 2 of each group 'pass'."""
    return [1.0 if i % 2 == 0 else 0.0 for i in range(len(completions))]


def _run(tmp_path, **options):
    trainer = train_tiny([{"name": SearchE1, "outcome_reward": "even_correct", **options}], output_dir=tmp_path,
                         reward_funcs=[even_correct], train=False, max_steps=2)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    changed = any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    return [h for h in trainer.state.log_history if "trl_credit/search_e1/distilled_fraction" in h], changed


def test_alternate_run_grpo_then_self_distillation(tmp_path):
    logged, changed = _run(tmp_path)
    assert len(logged) == 2 and changed
    assert "trl_credit/search_e1/opsd" not in logged[0]             # step 0: GRPO
    assert logged[1]["trl_credit/search_e1/opsd"] != 0.0             # step 1: OPSD, GRPO muted
    assert logged[1]["trl_credit/search_e1/grpo_muted"] == 1.0
    assert all(h["trl_credit/search_e1/distilled_fraction"] > 0 for h in logged)
    assert logged[1]["trl_credit/search_e1/mean_log_ratio"] != 0.0  # the sibling changed the teacher's scores


def test_joint_run(tmp_path):
    logged, changed = _run(tmp_path, schedule="joint", estimator="reverse")
    assert changed and len(logged) == 2 and all(h["trl_credit/search_e1/opsd"] > 0 for h in logged)
    assert all("trl_credit/search_e1/grpo_muted" not in h for h in logged)
