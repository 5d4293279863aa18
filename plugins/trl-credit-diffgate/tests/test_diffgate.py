"""DiffGate: hand-computed terms and gradients, the gate and difficulty weights, both teachers, checks, a real run."""

from __future__ import annotations

import math

import pytest
import torch
from trl_credit_diffgate import (
    DiffGate,
    bounded_discrepancy,
    difficulty_gate,
    with_context,
)

from trl_credit import ConfigError, PluginRuntimeError
from trl_credit.testing import (
    check_args,
    check_plugin,
    loss_inputs,
    make_batch,
    run_loss,
    run_plugin,
    train_tiny,
)

NAN = float("nan")

# Two groups of G = 2; row 2 has one token (its second position is padding, teacher NaN there on purpose).
REWARDS = [1, 0, 0, 0]
LENGTHS = [2, 2, 1, 2]
STUDENT = [[-1.0, -1.0], [-1.0, -2.0], [-0.5, -7.0], [-3.0, -1.0]]
TEACHER = [[-2.0, -2.0], [-1.5, -1.0], [-1.0, NAN], [-1.0, -1.0]]
# gate a = [0, 0.5, 1, 1]: group 0 passes 1 of 2 (w = 1 - 1/2), group 1 passes none (w = 1); row 0 passed.
# d = s - t on gated tokens: row 1 [0.5, -1], row 2 [0.5, (pad)], row 3 [-2, 0].  dapo normaliser = 7 tokens.


def batch(rewards=REWARDS, teacher=TEACHER, **kw):
    return make_batch(rewards, 2, lengths=LENGTHS, ref_logps=torch.tensor(teacher), **kw)


def term_and_grad(config, loss_type="dapo", b=None):
    logps = torch.tensor(STUDENT, requires_grad=True)
    loss = loss_inputs(b if b is not None else batch(), torch.zeros(4), logps=logps, loss_type=loss_type)
    result = run_loss(DiffGate, loss, config)
    (grad,) = torch.autograd.grad(result.terms["distill"], logps)
    return result.terms["distill"], grad, loss


# ------------------------------------------------------------------ hand-computed values
def test_plain_opd_term_and_gradient_by_hand():
    term, grad, _ = term_and_grad({"bound": "none"})
    # rho = d^2/2: 0.5*(0.125 + 0.5) + 1*0.125 + 1*(2 + 0) = 2.4375, over 7 tokens
    assert term.item() == pytest.approx(2.4375 / 7)
    # gradient a_i * d / 7: the reverse-KL OPD direction (log s - log t) on the sampled tokens
    expected = torch.tensor([[0, 0], [0.5 * 0.5, 0.5 * -1.0], [0.5, 0], [-2.0, 0]]) / 7
    torch.testing.assert_close(grad, expected)


def test_tanh_bound_by_hand():
    term, grad, _ = term_and_grad({})  # defaults: tanh, tau = 1, coef = 1
    lc = lambda x: math.log(math.cosh(x))
    value = 0.5 * (lc(0.5) + lc(-1.0)) + lc(0.5) + lc(-2.0) + lc(0.0)
    assert term.item() == pytest.approx(value / 7, rel=1e-6)
    t = math.tanh
    expected = torch.tensor([[0, 0], [0.5 * t(0.5), 0.5 * t(-1.0)], [t(0.5), 0], [t(-2.0), 0]]) / 7
    torch.testing.assert_close(grad, expected)
    # the pull is bounded: |rho'| <= tau, where plain OPD would pull with |d| = 2 on row 3
    assert grad[3, 0].item() * 7 == pytest.approx(-0.964028, abs=1e-6)


def test_clip_bound_and_tau_and_coef_by_hand():
    term, grad, _ = term_and_grad({"bound": "clip", "tau": 1.0, "coef": 2.0})
    # Huber at 1: 0.5*(0.125 + 0.5) + 0.125 + (2 - 0.5) = 1.9375; coef 2
    assert term.item() == pytest.approx(2 * 1.9375 / 7)
    expected = 2 * torch.tensor([[0, 0], [0.25, -0.5], [0.5, 0], [-1.0, 0]]) / 7  # row 3 clamped at -tau
    torch.testing.assert_close(grad, expected)
    term, grad, _ = term_and_grad({"bound": "tanh", "tau": 0.5})
    # tau * tanh(d / tau) with tau = 0.5: row 3 token 0 pulls with 0.5 * tanh(-4)
    assert grad[3, 0].item() * 7 == pytest.approx(0.5 * math.tanh(-4.0), rel=1e-6)


def test_difficulty_power_and_threshold():
    _, grad, _ = term_and_grad({"bound": "none", "difficulty_power": 2.0})
    assert grad[1, 0].item() == pytest.approx(0.25 * 0.5 / 7)          # (1 - 1/2)^2 = 0.25
    assert grad[3, 0].item() == pytest.approx(-2.0 / 7)                # (1 - 0)^2 = 1
    _, grad, _ = term_and_grad({"bound": "none", "difficulty_power": 0.0})
    assert grad[1, 0].item() == pytest.approx(0.5 / 7)                 # gate only: weight 1
    # threshold 1.5: every 0/1 reward failed, group pass rates 0: row 0 is guided too (d = [1, 1])
    _, grad, _ = term_and_grad({"bound": "none", "threshold": 1.5})
    torch.testing.assert_close(grad[0], torch.tensor([1.0, 1.0]) / 7)
    torch.testing.assert_close(grad[1], torch.tensor([0.5, -1.0]) / 7)


def test_gate_vector():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.3, NAN, NAN, NAN, NAN, NAN])
    a = difficulty_gate(r, 4, 0.5, 1.0)
    # group 0: p = 1/4 -> 0.75 on its 3 failures; group 1: finite {1, 1, 0.3}, p = 2/3 -> 1/3 on 0.3, NaN ungated;
    # group 2: no finite reward -> nothing gated
    torch.testing.assert_close(a, torch.tensor([0, 0.75, 0.75, 0.75, 0, 0, 1 / 3, 0, 0, 0, 0, 0]))


def test_all_passed_group_and_nan_rewards_get_no_guidance():
    term, grad, _ = term_and_grad({}, b=batch(rewards=[1, 1, None, None]))
    assert term.item() == 0.0 and not grad.any()
    _, grad, _ = term_and_grad({"bound": "none"}, b=batch(rewards=[1, 1, 0, None]))
    # group 1: one finite reward, failed: p = 0, row 2 guided with d = 0.5; row 3 (NaN) not
    torch.testing.assert_close(grad, torch.tensor([[0, 0], [0, 0], [0.5, 0], [0, 0]]) / 7)


def test_outcome_reward_column_decides_failure():
    # accuracy says rows 0, 1 passed; the total (accuracy + format) would say the same for rows 0..3 >= 0.5
    rewards = [[1, 0], [1, 0], [0, 1], [0, 0]]
    b = make_batch(rewards, 2, lengths=LENGTHS, ref_logps=torch.tensor(TEACHER), reward_names=["accuracy", "fmt"])
    _, grad, _ = term_and_grad({"bound": "none", "outcome_reward": "accuracy"}, b=b)
    assert not grad[:2].any() and grad[2, 0].item() == pytest.approx(0.5 / 7)  # group 1 all failed, w = 1
    b = make_batch(rewards, 2, lengths=LENGTHS, ref_logps=torch.tensor(TEACHER), reward_names=["accuracy", "fmt"])
    _, grad, _ = term_and_grad({"bound": "none"}, b=b)
    assert not grad[:3].any() and grad[3, 0].item() == pytest.approx(-2.0 * 0.5 / 7)  # total: only row 3 failed


def test_gradient_is_autograd_of_the_written_objective_under_grpo():
    """The term's gradient on loss_inputs(...).logps equals autograd of the objective written out here."""
    torch.manual_seed(0)
    n, t = 8, 5
    lengths = [5, 3, 4, 1, 5, 2, 5, 4]
    rewards = [1, 0, 0, 1, 0, 0, 0, 0]
    teacher = -torch.rand(n, t) * 4
    logps = (-torch.rand(n, t) * 4).requires_grad_()
    b = make_batch(rewards, 4, lengths=lengths, ref_logps=teacher)
    result = run_loss(DiffGate, loss_inputs(b, torch.zeros(n), logps=logps, loss_type="grpo"), {"tau": 0.7})
    (ours,) = torch.autograd.grad(result.terms["distill"], logps)

    leaf = logps.detach().clone().requires_grad_()
    m = b.completion_mask.float()
    a = torch.tensor([0, 0.5, 0.5, 0, 1, 1, 1, 1]).unsqueeze(1)  # group pass rates 2/4 and 0
    d = leaf - teacher
    written = (a * 0.7**2 * torch.log(torch.cosh(d / 0.7)) * m).sum(1) / m.sum(1)
    (theirs,) = torch.autograd.grad(written.mean(), leaf)
    torch.testing.assert_close(ours, theirs)
    # and it is the bounded policy-gradient form: a_i * tau tanh(d / tau) / (rows * tokens of the row)
    torch.testing.assert_close(ours, a * 0.7 * torch.tanh(d.detach() / 0.7) * m / m.sum(1, keepdim=True) / n)


def test_masked_tokens_and_dropped_rows_take_no_gradient():
    _, grad, _ = term_and_grad({})
    assert grad[2, 1].item() == 0.0  # padding (teacher NaN there) contributes nothing
    # a dropped row (kept = False) is not guided even though it failed
    b = batch()
    b.kept = torch.tensor([True, True, True, False])
    _, grad, _ = term_and_grad({"bound": "none"}, b=b)
    assert not grad[3].any() and grad[2, 0].item() == pytest.approx(0.5 / 7)


def test_bounded_discrepancy_is_finite_for_extreme_gaps():
    d = torch.tensor([-1e4, -30.0, 0.0, 30.0, 1e4], requires_grad=True)
    rho = bounded_discrepancy(d, "tanh", 1.0)
    (g,) = torch.autograd.grad(rho.sum(), d)
    assert torch.isfinite(rho).all() and rho[2].item() == 0.0
    assert rho[0].item() == pytest.approx(1e4 - math.log(2.0))  # |x| - log 2 asymptote
    torch.testing.assert_close(g, torch.tensor([-1.0, -1.0, 0.0, 1.0, 1.0]))


# ------------------------------------------------------------------ the hint teacher
PROMPTS = [[{"role": "user", "content": f"What is {i}+1?"}] for i in (2, 2, 7, 7)]


def hint_batch(hints, answers=("3", "3", "8", "8"), calls=None, **kw):
    def fn(row, prompt, model):
        if calls is not None:
            calls.append((row, prompt, model))
        return TEACHER[row][:1] + [0.0] if row == 2 else TEACHER[row]

    return make_batch(REWARDS, 2, lengths=LENGTHS, prompts=PROMPTS, completion_logps_fn=fn,
                      columns={"hint": list(hints), "answer": list(answers)}, **kw)


def test_hint_teacher_scores_the_policy_under_the_hinted_prompt():
    calls = []
    b = hint_batch(["add one", "add one", "", "count up"], calls=calls)
    run_plugin(DiffGate, b, {"teacher": "hint"})  # on_batch_end: one scoring call per row, cached
    assert [c[2] for c in calls] == ["policy"] * 4
    assert calls[0][1] == [{"role": "user", "content": "What is 2+1?\n\nHint: add one"}]
    assert calls[2][1] == PROMPTS[2]  # no hint: the own prompt, and no guidance for the row
    assert calls[3][1][0]["content"].endswith("Hint: count up")
    logps = torch.tensor(STUDENT, requires_grad=True)
    result = run_loss(DiffGate, loss_inputs(b, torch.zeros(4), logps=logps), {"teacher": "hint", "bound": "none"})
    (grad,) = torch.autograd.grad(result.terms["distill"], logps)
    assert len(calls) == 4  # a new plugin instance, but the batch's cache answered
    torch.testing.assert_close(grad, torch.tensor([[0, 0], [0.25, -0.5], [0, 0], [-2.0, 0]]) / 7)
    assert PROMPTS[0] == [{"role": "user", "content": "What is 2+1?"}]  # the batch's prompts are untouched


def test_hint_template_and_system_position():
    assert with_context([{"role": "user", "content": "Q"}], "H", "system") == [
        {"role": "system", "content": "H"}, {"role": "user", "content": "Q"}]
    assert with_context([{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}], "H", "system")[0] == {
        "role": "system", "content": "S\n\nH"}
    assert with_context("Q?", "H", "user") == "Q?\n\nH" and with_context("Q?", "H", "system") == "H\n\nQ?"
    calls = []
    run_plugin(DiffGate, hint_batch(["one"] * 4, calls=calls),
               {"teacher": "hint", "hint_template": "Teacher notes: {hint}.", "hint_position": "system"})
    assert calls[0][1] == [{"role": "system", "content": "Teacher notes: one."}, PROMPTS[0][0]]
    with pytest.raises(ConfigError, match="must contain the placeholder"):
        run_plugin(DiffGate, hint_batch(["one"] * 4), {"teacher": "hint", "hint_template": "no placeholder"})


def test_a_hint_with_the_answer_is_refused_unless_allowed():
    b = hint_batch(["add one", "add one", "it is 8.", "add one"])
    with pytest.raises(PluginRuntimeError, match=r"the hint of completion 2 \(dataset row 1\) contains its answer "
                                                 r"'8'.*allow_answer_in_hint: true"):
        run_plugin(DiffGate, b, {"teacher": "hint"})
    run_plugin(DiffGate, hint_batch(["add one", "add one", "it is 8.", "add one"]),
               {"teacher": "hint", "allow_answer_in_hint": True})
    # whole words only: "18" and "x8" do not contain the answer 8
    run_plugin(DiffGate, hint_batch(["a", "b", "not 18", "nor x8"]), {"teacher": "hint"})


# ------------------------------------------------------------------ metrics, checks, contract
def test_metrics():
    result = run_plugin(DiffGate, batch())
    assert result.metrics["diffgate/gated_fraction"] == 0.75  # rows 1, 2, 3 of 4
    assert result.metrics["diffgate/mean_weight"] == pytest.approx((0.5 + 1 + 1) / 3)
    _, _, loss = term_and_grad({})
    assert loss.batch.metrics["diffgate/mean_abs_d"] == [pytest.approx((0.5 + 1 + 0.5 + 2 + 0) / 5)]


def test_check_reference_teacher_needs_a_reference():
    with pytest.raises(ConfigError) as info:
        check_args(DiffGate, peft=False, beta=0.0, per_device_train_batch_size=8, num_generations=4)
    message = str(info.value)
    assert "(diffgate)" in message and "teacher: 'reference' needs a reference model, but beta is 0.0" in message
    assert "set `beta` > 0" in message and "use_peft: true" in message and "teacher: hint" in message
    check_args(DiffGate, peft=False, beta=0.04, per_device_train_batch_size=8, num_generations=4)
    check_args(DiffGate, peft=True, beta=0.0, per_device_train_batch_size=8, num_generations=4)


def test_check_hint_teacher_needs_its_columns():
    with pytest.raises(ConfigError) as info:
        check_args(DiffGate, {"teacher": "hint"}, columns=["prompt", "answer"], per_device_train_batch_size=8,
                   num_generations=4)
    message = str(info.value)
    assert "(diffgate)" in message and "hint_column: 'hint' is not a dataset column" in message
    assert "fix: add the hint column" in message
    with pytest.raises(ConfigError) as info:
        check_args(DiffGate, {"teacher": "hint", "hint_column": "tip"}, columns=["prompt", "tip"],
                   per_device_train_batch_size=8, num_generations=4)
    message = str(info.value)
    assert "(diffgate)" in message and "answer_column: 'answer' is not a dataset column" in message
    assert "allow_answer_in_hint: true" in message
    check_args(DiffGate, {"teacher": "hint", "hint_column": "tip", "allow_answer_in_hint": True},
               columns=["prompt", "tip"], peft=False, per_device_train_batch_size=8, num_generations=4)
    check_args(DiffGate, {"teacher": "hint"}, columns=None, peft=False, per_device_train_batch_size=8,
               num_generations=4)  # columns unknown before loading: nothing to check


def test_check_outcome_reward_must_exist():
    with pytest.raises(ConfigError, match="correctness"):
        check_args(DiffGate, {"outcome_reward": "correctness"}, reward_names=["accuracy"],
                   per_device_train_batch_size=8, num_generations=4)


def test_contract():
    check_plugin(DiffGate)

    def hinted():
        n = 8
        return make_batch([1, 0, 0, 0, 0, 0, 0, 0], 4, lengths=[3, 1, 2, 3, 3, 3, 0, 2],
                          completion_logps_fn=lambda row, prompt, model: [-0.5 * row, -1.0, -2.0],
                          columns={"hint": ["h"] * n, "answer": ["1"] * n})

    check_plugin(DiffGate, {"teacher": "hint"}, batches=[hinted])


# ------------------------------------------------------------------ a real run
def test_trains_with_a_hint_teacher(tmp_path):
    from trl_credit.testing import tiny_dataset

    data = tiny_dataset(16).map(lambda row: {"hint": "Add the two numbers and write only the sum."})
    trainer = train_tiny([{"name": DiffGate, "teacher": "hint"}], output_dir=tmp_path, dataset=data, train=False,
                         max_steps=2, loss_type="dapo")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logged = [h for h in trainer.state.log_history if "trl_credit/diffgate/distill" in h]
    assert len(logged) == 2 and all(h["trl_credit/diffgate/distill"] > 0 for h in logged)
    assert all(h["trl_credit/diffgate/gated_fraction"] == 1.0 for h in logged)  # the random model fails everything
    assert all(h["trl_credit/diffgate/mean_abs_d"] > 0 for h in logged)  # a loss-hook metric reaches the logs
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
