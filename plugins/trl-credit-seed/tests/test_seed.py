"""SEED: hand-computed terms and gradients, both bases, the skill context, checks, contract, a real run."""

from __future__ import annotations

import math

import pytest
import torch
from trl_credit_seed import SEED, bounded_shift, with_context

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

# Two groups of G = 2; row 2 has one token (position 1 is padding) and no skill.
LENGTHS = [2, 2, 1, 2]
PROMPTS = [[{"role": "user", "content": f"What is {i}+1?"}] for i in (2, 2, 7, 7)]
SKILLS = ["carry the one", "carry the one", "", "count up by one"]
STUDENT = [[-1.0, -1.0], [-1.0, -2.0], [-0.5, -7.0], [-3.0, -1.0]]     # loss.logps (current policy, with grad)
SKILLED = [[-0.5, -3.0], [-1.0, -1.5], [9.0, 9.0], [-1.0, -1.0]]       # q: log pi(a | ctx + skill)
ROLLOUT = [[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0], [-2.0, -2.0]]     # batch.policy_logps() (generation weights)
# base current: delta = q - s = row 0 [0.5, -2], row 1 [0, 0.5], row 3 [2, 0]; row 2 has no skill.
# dapo normaliser: 7 tokens.


def batch(skills=SKILLS, calls=None, **kw):
    def fn(row, prompt, model):
        if calls is not None:
            calls.append((row, prompt, model))
        return SKILLED[row]

    return make_batch([1, 0, 0, 1], 2, lengths=LENGTHS, prompts=PROMPTS, completion_logps_fn=fn,
                      logps=torch.tensor(ROLLOUT), columns={"skill": list(skills)}, **kw)


def term_and_grad(config, loss_type="dapo", b=None, student=STUDENT):
    logps = torch.tensor(student, requires_grad=True)
    loss = loss_inputs(b if b is not None else batch(), torch.zeros(len(student)), logps=logps, loss_type=loss_type)
    result = run_loss(SEED, loss, config)
    (grad,) = torch.autograd.grad(result.terms["distill"], logps)
    return result.terms["distill"], grad, loss


# ------------------------------------------------------------------ hand-computed values
def test_clip_current_base_by_hand():
    term, grad, _ = term_and_grad({})  # defaults: clip, tau = 1, coef = 1, base current
    # b = clip(delta): row 0 [0.5, -1], row 1 [0, 0.5], row 3 [1, 0]
    # term = -(0.5*-1 + -1*-1 + 0*-1 + 0.5*-2 + 1*-3 + 0*-1) / 7 = 3.5 / 7
    assert term.item() == pytest.approx(0.5)
    # gradient -b / 7: the token the skill makes more likely (delta > 0) is pushed up by descent
    torch.testing.assert_close(grad, torch.tensor([[-0.5, 1.0], [0.0, -0.5], [0.0, 0.0], [-1.0, 0.0]]) / 7)


def test_rollout_base_uses_the_generation_time_scores():
    _, grad, _ = term_and_grad({"base": "rollout"})
    # delta = q - policy_logps: row 0 [0.5, -2], row 1 [0, -0.5], row 3 [1, 1]; clipped: [0.5, -1], [0, -0.5], [1, 1]
    torch.testing.assert_close(grad, torch.tensor([[-0.5, 1.0], [0.0, 0.5], [0.0, 0.0], [-1.0, -1.0]]) / 7)


def test_tanh_none_tau_coef_by_hand():
    _, grad, _ = term_and_grad({"bound": "tanh", "tau": 0.5, "coef": 3.0})
    t = lambda x: 0.5 * math.tanh(x / 0.5)
    expected = -3.0 * torch.tensor([[t(0.5), t(-2.0)], [t(0.0), t(0.5)], [0.0, 0.0], [t(2.0), t(0.0)]]) / 7
    torch.testing.assert_close(grad, expected)
    term, grad, _ = term_and_grad({"bound": "none"})
    torch.testing.assert_close(grad, -torch.tensor([[0.5, -2.0], [0.0, 0.5], [0.0, 0.0], [2.0, 0.0]]) / 7)
    # -(0.5*-1 + -2*-1 + 0 + 0.5*-2 + 2*-3 + 0) / 7 = 5.5 / 7
    assert term.item() == pytest.approx(5.5 / 7)


def test_gradient_is_autograd_of_the_written_objective_under_grpo():
    torch.manual_seed(0)
    n, t = 8, 5
    lengths = [5, 3, 4, 1, 5, 2, 5, 4]
    q = -torch.rand(n, t) * 4
    s = -torch.rand(n, t) * 4
    skills = ["k"] * 5 + ["", None, "k"]
    b = make_batch([0] * n, 4, lengths=lengths, prompts=[[{"role": "user", "content": "Q"}]] * n,
                   completion_logps_fn=lambda row, prompt, model: q[row].tolist(), columns={"skill": skills})
    logps = s.clone().requires_grad_()
    result = run_loss(SEED, loss_inputs(b, torch.zeros(n), logps=logps, loss_type="grpo"), {"tau": 0.8})
    (ours,) = torch.autograd.grad(result.terms["distill"], logps)

    leaf = s.clone().requires_grad_()
    m = b.completion_mask.float()
    has = torch.tensor([1, 1, 1, 1, 1, 0, 0, 1.0]).unsqueeze(1)
    shift = (q - leaf.detach()).clamp(-0.8, 0.8)
    written = -((has * shift * leaf * m).sum(1) / m.sum(1)).mean()
    (theirs,) = torch.autograd.grad(written, leaf)
    torch.testing.assert_close(ours, theirs)

    # base current, bound none: the on-policy reverse-KL self-distillation gradient towards pi(. | ctx + skill),
    # i.e. autograd of the k2 objective mean_rows(mean_t(has * (s - q)^2 / 2))
    logps = s.clone().requires_grad_()
    result = run_loss(SEED, loss_inputs(b, torch.zeros(n), logps=logps, loss_type="grpo"), {"bound": "none"})
    (ours,) = torch.autograd.grad(result.terms["distill"], logps)
    leaf = s.clone().requires_grad_()
    k2 = ((has * 0.5 * (leaf - q) ** 2 * m).sum(1) / m.sum(1)).mean()
    (theirs,) = torch.autograd.grad(k2, leaf)
    torch.testing.assert_close(ours, theirs)


def test_no_skill_masked_and_dropped_rows_take_no_gradient():
    b = batch()
    b.kept = torch.tensor([True, False, True, True])
    _, grad, _ = term_and_grad({}, b=b)
    assert not grad[1].any() and not grad[2].any()  # dropped row 1; row 2 has no skill (its q of 9 is ignored)
    term, grad, _ = term_and_grad({}, b=batch(skills=["", None, " ", ""]))
    assert term.item() == 0.0 and not grad.any()
    # a masked position never counts, even where q is far off
    assert term_and_grad({"bound": "none"})[1][2, 1].item() == 0.0


def test_zero_shift_gives_zero_term():
    term, grad, _ = term_and_grad({}, student=SKILLED)  # current policy already equals the skill-context policy
    assert term.item() == 0.0 and not grad.any()


def test_bounded_shift():
    d = torch.tensor([-5.0, -0.5, 0.0, 0.5, 5.0])
    torch.testing.assert_close(bounded_shift(d, "clip", 1.0), torch.tensor([-1.0, -0.5, 0.0, 0.5, 1.0]))
    torch.testing.assert_close(bounded_shift(d, "tanh", 2.0), 2.0 * torch.tanh(d / 2.0))
    torch.testing.assert_close(bounded_shift(d, "none", 1.0), d)


# ------------------------------------------------------------------ the skill context
def test_skill_prompts_as_scored():
    calls = []
    b = batch(calls=calls)
    run_plugin(SEED, b)
    assert [c[2] for c in calls] == ["policy"] * 4
    assert calls[0][1] == [{"role": "user", "content": "What is 2+1?\n\nUseful skill from earlier attempts: "
                                                       "carry the one"}]
    assert calls[2][1] == PROMPTS[2]  # no skill: its own prompt, and the row is not distilled
    term_and_grad({}, b=b)
    assert len(calls) == 4  # a fresh instance in the loss hook: the batch's cache answered
    assert PROMPTS[0] == [{"role": "user", "content": "What is 2+1?"}]
    calls.clear()
    run_plugin(SEED, batch(calls=calls), {"skill_template": "Skill: {skill}", "skill_position": "system"})
    assert calls[0][1] == [{"role": "system", "content": "Skill: carry the one"}, PROMPTS[0][0]]
    assert with_context("Q?", "K", "user") == "Q?\n\nK" and with_context("Q?", "K", "system") == "K\n\nQ?"
    with pytest.raises(ConfigError, match="must contain the placeholder"):
        run_plugin(SEED, batch(), {"skill_template": "Skill:"})


# ------------------------------------------------------------------ metrics, checks, contract
def test_metrics():
    result = run_plugin(SEED, batch())
    assert result.metrics["seed/skill_fraction"] == 0.75
    _, _, loss = term_and_grad({})
    assert loss.batch.metrics["seed/mean_shift"] == [pytest.approx((0.5 - 2 + 0 + 0.5 + 2 + 0) / 6)]
    assert loss.batch.metrics["seed/clipped_fraction"] == [pytest.approx(2 / 6)]  # |delta| = 2 twice


def test_check_skill_column():
    with pytest.raises(ConfigError) as info:
        check_args(SEED, columns=["prompt", "answer"], per_device_train_batch_size=8, num_generations=4)
    message = str(info.value)
    assert "(seed)" in message and "skill_column: 'skill' is not a dataset column (columns: prompt, answer)" in message
    assert "fix: add a column of skills to the dataset" in message
    check_args(SEED, {"skill_column": "tips"}, columns=["prompt", "tips"], per_device_train_batch_size=8,
               num_generations=4)
    check_args(SEED, columns=None, per_device_train_batch_size=8, num_generations=4)


def test_contract():
    def scored(rewards, g, lengths, skill="k"):
        n, t = len(rewards), max(max(lengths), 1)
        gen = torch.Generator().manual_seed(n * 10 + t)
        q = -torch.rand(n, t, generator=gen)
        return lambda: make_batch(rewards, g, lengths=lengths, logps=-torch.rand(n, t, generator=gen),
                                  completion_logps_fn=lambda row, prompt, model: q[row].tolist(),
                                  columns={"skill": [skill] * n})

    batches = [scored([1, 0, 1, 0, 1, 1, 0, 0], 4, [6, 3, 5, 1, 2, 6, 4, 3]),
               scored([1, 1, 1, 1], 4, [6] * 4, skill=""),
               scored([1, None, 0, 1], 4, [3] * 4),
               scored([0.5, 0.25], 1, [6, 0])]
    check_plugin(SEED, batches=batches)
    check_plugin(SEED, {"base": "rollout"}, batches=batches)


# ------------------------------------------------------------------ a real run
def test_trains_with_skills_from_the_dataset(tmp_path):
    from trl_credit.testing import tiny_dataset

    data = tiny_dataset(16).map(lambda row: {"skill": "Add the two numbers; write only the digits of the sum."})
    trainer = train_tiny([{"name": SEED}], output_dir=tmp_path, dataset=data, train=False, max_steps=2)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logged = [h for h in trainer.state.log_history if "trl_credit/seed/distill" in h]
    assert len(logged) == 2 and all(h["trl_credit/seed/distill"] != 0 for h in logged)
    assert all(h["trl_credit/seed/skill_fraction"] == 1.0 for h in logged)
    assert all(h["trl_credit/seed/mean_shift"] != 0 and "trl_credit/seed/clipped_fraction" in h for h in logged)
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
