"""Trust-GRPO: the four methods.md 2.8 vectors, trust and group rules, NaN handling, contract, a real run."""

from __future__ import annotations

import math

import pytest
import torch
from trl_credit_trust_grpo import TrustGRPO, trust_thinking_reward

from trl_credit import ConfigError, PluginRuntimeError, completion_text, grpo_advantages, hookimpl
from trl_credit.testing import check_args, check_plugin, make_batch, plugin_set, run_plugin, train_tiny

NAN = None  # make_batch turns None into NaN
TIGHT = {"rtol": 1e-6, "atol": 1e-6}
NAMES = ["accuracy_reward", "thinking_reward"]
ANSWERS, THINKING = [1, 1, 0, 0], [0.6, 0.8, 0.9, 0.9]


def batch(answers, thinking, G=4, step=0, **kwargs):
    return make_batch([[a, p] for a, p in zip(answers, thinking)], G, reward_names=NAMES, step=step, **kwargs)


def shaped(answers, thinking, options=None, G=4, step=0):
    return run_plugin(TrustGRPO, batch(answers, thinking, G, step), options)


# ------------------------------------------------------------------------- methods.md 2.8 vectors
def test_vector_paper_mode_step_0():
    result = shaped(ANSWERS, THINKING)
    torch.testing.assert_close(result.batch.total_reward(),
                               torch.tensor([1.147372, 1.196495, 0.221057, 0.221057]), **TIGHT)
    f = 0.3 * math.exp(0.7 - 0.9)                                      # mu_c = 0.7 < mu_i = 0.9
    assert f == pytest.approx(0.245619, abs=1e-6)
    torch.testing.assert_close(result.rewards[:, 1], f * torch.tensor(THINKING), **TIGHT)
    torch.testing.assert_close(result.rewards[:, 0], torch.tensor([1.0, 1.0, 0.0, 0.0]))   # answers untouched
    m = result.metrics
    assert m["trust_grpo/gamma"] == pytest.approx(math.exp(2 * (0.7 - 0.9)), abs=1e-6)     # 0.670320
    assert m["trust_grpo/f"] == pytest.approx(f, abs=1e-6)
    assert m["trust_grpo/f0"] == pytest.approx(0.3)
    assert m["trust_grpo/active_groups"] == 1.0 and m["trust_grpo/untrusted_groups"] == 1.0


def test_vector_code_mode():
    result = shaped(ANSWERS, THINKING, {"mode": "code"})
    torch.testing.assert_close(result.batch.total_reward(), torch.tensor([1.18, 1.24, 0.0, 0.0]), **TIGHT)
    assert result.metrics["trust_grpo/gamma"] == 1.0                  # incorrect p -> 0: mu_i = 0, trusted
    assert result.metrics["trust_grpo/f"] == pytest.approx(0.3)


def test_vector_paper_mode_step_500():
    result = shaped(ANSWERS, THINKING, step=500)
    torch.testing.assert_close(result.batch.total_reward(),
                               torch.tensor([1.054215, 1.072287, 0.081322, 0.081322]), **TIGHT)
    assert result.metrics["trust_grpo/f"] == pytest.approx(0.090358, abs=1e-6)
    assert result.metrics["trust_grpo/f0"] == pytest.approx(0.3 / math.e)


@pytest.mark.parametrize("mode", ["paper", "code"])
@pytest.mark.parametrize("answers", [[1, 1, 1, 1], [0.9, 1, 0.95, 1], [0, 0, 0, 0], [0.1, 0, 0.05, 0]])
def test_vector_all_correct_or_all_wrong_group_is_unchanged(mode, answers):
    result = shaped(answers, THINKING, {"mode": mode})
    torch.testing.assert_close(result.batch.total_reward(), torch.tensor(answers, dtype=torch.float32))
    assert torch.equal(result.rewards[:, 1], torch.zeros(4))
    assert result.metrics["trust_grpo/active_groups"] == 0.0
    assert "trust_grpo/gamma" not in result.metrics                   # averaged over active groups only


# ------------------------------------------------------------------------- the rules
def test_groups_are_independent():
    answers = ANSWERS + [1, 1, 1, 1] + [1, 0, 1, 0]
    thinking = THINKING + [0.5, 0.4, 0.3, 0.2] + [0.9, 0.1, 0.7, 0.3]
    result = shaped(answers, thinking)
    r = result.batch.total_reward()
    torch.testing.assert_close(r[:4], torch.tensor([1.147372, 1.196495, 0.221057, 0.221057]), **TIGHT)
    torch.testing.assert_close(r[4:8], torch.ones(4))
    # group 3: mu_c = 0.8 >= mu_i = 0.2, trusted, f = 0.3
    torch.testing.assert_close(r[8:], torch.tensor([1.27, 0.03, 1.21, 0.09]), **TIGHT)
    m = result.metrics
    assert m["trust_grpo/active_groups"] == pytest.approx(2 / 3)
    assert m["trust_grpo/gamma"] == pytest.approx((math.exp(-0.4) + 1) / 2, abs=1e-6)
    assert m["trust_grpo/f"] == pytest.approx((0.245619 + 0.3) / 2, abs=1e-6)
    assert m["trust_grpo/untrusted_groups"] == 0.5


def test_code_mode_trust_fires_with_non_binary_answers():
    # a >= 0.2 are scored; correct = [1], incorrect = [0.3, 0.3, 0 (not queried: p -> 0)]
    answers, thinking = [1, 0.3, 0.3, 0], [0.2, 0.9, 0.9, 0.5]
    result = shaped(answers, thinking, {"mode": "code"})
    mu_c, mu_i = 0.2, (0.9 + 0.9 + 0.0) / 3
    f = 0.3 * math.exp(mu_c - mu_i)
    expected = torch.tensor(answers) + f * torch.tensor([0.2, 0.9, 0.9, 0.0])
    torch.testing.assert_close(result.batch.total_reward(), expected, **TIGHT)
    assert result.metrics["trust_grpo/gamma"] == pytest.approx(math.exp(2 * (mu_c - mu_i)), abs=1e-6)
    paper = shaped(answers, thinking)                                  # paper: p = 0.5 counts, mu_i = 2.3 / 3
    f_paper = 0.3 * math.exp(0.2 - 2.3 / 3)
    torch.testing.assert_close(paper.rewards[:, 1], f_paper * torch.tensor(thinking), **TIGHT)


def test_no_correct_answer_untrusted_but_f_not_shrunk():
    # not all <= 0.1 but none >= 0.5: mu_c = 0 < mu_i; the official code leaves f alone, gamma still < 1
    answers, thinking = [0.3, 0.3, 0.2, 0.4], [0.5, 0.7, 0.1, 0.3]
    result = shaped(answers, thinking)
    torch.testing.assert_close(result.rewards[:, 1], 0.3 * torch.tensor(thinking), **TIGHT)
    assert result.metrics["trust_grpo/gamma"] == pytest.approx(math.exp(-2 * 0.4), abs=1e-6)


def test_thresholds_are_options():
    # with high = 0.95 the group [0.9, 1, 1, 1] is no longer all-correct; correct_threshold 0.95 -> 0.9 wrong
    answers, thinking = [0.9, 1, 1, 1], [0.4, 0.2, 0.2, 0.2]
    result = shaped(answers, thinking, {"high": 0.95, "correct_threshold": 0.95})
    f = 0.3 * math.exp(0.2 - 0.4)
    torch.testing.assert_close(result.rewards[:, 1], f * torch.tensor(thinking), **TIGHT)
    assert torch.equal(shaped(answers, thinking).rewards[:, 1], torch.zeros(4))      # defaults: all >= 0.9


def test_annealing_with_alpha_and_T():
    result = shaped([1, 0, 1, 0], [0.5, 0.5, 0.5, 0.5], {"alpha": 1.0, "T": 10.0}, step=20)
    torch.testing.assert_close(result.rewards[:, 1], torch.full((4,), 0.5 * math.exp(-2.0)), **TIGHT)


def test_helper_shapes():
    a = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    p = torch.tensor([THINKING, THINKING])
    term, f, gamma, active = trust_thinking_reward(a, p, 0)
    assert term.shape == (2, 4) and f.shape == gamma.shape == active.shape == (2,)
    assert active.tolist() == [True, False] and torch.equal(term[1], torch.zeros(4))


# ------------------------------------------------------------------------- NaN, edge cases
def test_nan_thinking_score_is_zero():
    result = shaped([1, 1, 0, 0], [0.6, NAN, 0.9, NAN])
    # p = [0.6, 0, 0.9, 0]: mu_c = 0.3 < mu_i = 0.45
    f = 0.3 * math.exp(0.3 - 0.45)
    torch.testing.assert_close(result.rewards[:, 1], f * torch.tensor([0.6, 0.0, 0.9, 0.0]), **TIGHT)


def test_nan_answer_counts_as_wrong_and_unscored_rows_stay_unscored():
    result = shaped([1, NAN, NAN, 0], [0.6, 0.8, NAN, 0.2])
    # a = [1, 0, 0, 0]: mu_c = 0.6 >= mu_i = (0.8 + 0 + 0.2) / 3, f = 0.3
    col = result.rewards[:, 1]
    torch.testing.assert_close(col[[0, 1, 3]], 0.3 * torch.tensor([0.6, 0.8, 0.2]), **TIGHT)
    assert math.isnan(col[2]) and math.isnan(result.rewards[1, 0])
    assert torch.isfinite(result.advantages).all() and result.advantages[2] == 0.0


def test_single_completion_per_group():
    result = shaped([1, 0, 0.5], [0.3, 0.9, 0.4], G=1)
    # [1] and [0] are all-correct / all-wrong groups; [0.5] is mixed-range, correct, mu_i = 0 -> f = 0.3
    torch.testing.assert_close(result.batch.total_reward(), torch.tensor([1.0, 0.0, 0.5 + 0.3 * 0.4]), **TIGHT)
    assert torch.equal(result.advantages, torch.zeros(3))


# ------------------------------------------------------------------------- config
def test_missing_column_is_named():
    assert plugin_set(TrustGRPO).plugins[0].instance.required_rewards() == NAMES
    with pytest.raises(ConfigError, match=r"\(trust_grpo\).*reward column 'thinking_reward'"):
        check_args(TrustGRPO, reward_names=["accuracy_reward"])
    check_args(TrustGRPO, reward_names=NAMES, per_device_train_batch_size=8, num_generations=4)
    with pytest.raises(PluginRuntimeError, match="no reward column 'thinking_reward'"):
        run_plugin(TrustGRPO, make_batch([1, 0], 2, reward_names=["accuracy_reward"]))


@pytest.mark.parametrize("options, key", [({"mode": "score_all"}, "mode"), ({"T": 0}, "T"), ({"alpha": -1}, "alpha"),
                                          ({"thinking_reward": "accuracy_reward"}, "different"),
                                          ({"beta": 1}, "beta")])
def test_bad_options(options, key):
    with pytest.raises(ConfigError, match=key):
        plugin_set(TrustGRPO, options)


def contract_batches():
    return [
        lambda: batch([1, 0, 1, 0, 1, 1, 0, 0], [0.9, 0.2, 0.1, 0.7, 0.5, 0.5, 0.3, 0.3]),
        lambda: batch([1, 1, 1, 1, 0, 0, 0, 0], [0.2] * 8, step=40),
        lambda: batch([1, NAN, 0, 1, NAN, NAN, NAN, NAN], [NAN, 0.3, 0.4, NAN, NAN, 0.1, NAN, NAN]),
        lambda: batch([1, 0, 0.5], [0.5, 0.5, 0.1], G=1),
        lambda: batch([0.5, 0.25, 0.75, 0.0], [0.3, 0.6, 0.2, 0.9], G=2, lengths=[6, 0, 6, 1]),
    ]


@pytest.mark.parametrize("mode", ["paper", "code"])
def test_contract(mode):
    check_plugin(TrustGRPO, {"mode": mode}, batches=contract_batches())


# ------------------------------------------------------------------------- a real run
class Spy:
    """Records what the host trained on: the step, the shaped reward matrix and the advantages."""

    def __init__(self):
        self.seen = []

    @hookimpl
    def on_batch_end(self, batch, advantages):
        self.seen.append((batch.step, batch.rewards.clone(), batch.reward_weights.clone(), advantages.clone()))


def test_training_run(tmp_path):
    raw = {"answer": [], "thinking": []}

    def answer(completions, **kwargs):         # deterministic: two correct, two wrong per group of 4
        values = [1.0 if i % 4 < 2 else 0.0 for i in range(len(completions))]
        raw["answer"].append(values)
        return values

    def thinking(completions, **kwargs):       # deterministic judge stand-in: a score of the text in {0, .1, .., .9}
        values = [(len(completion_text(c)) % 10) / 10 for c in completions]
        raw["thinking"].append(values)
        return values

    plugin = {"name": "trust_grpo", "answer_reward": "answer", "thinking_reward": "thinking", "T": 1.0}
    trainer = train_tiny([plugin, Spy], output_dir=tmp_path, reward_funcs=[answer, thinking])
    assert trainer.state.global_step == 2
    spy = trainer.credit_plugins.plugins[1].instance
    assert [step for step, *_ in spy.seen] == [0, 1]
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2
    for (step, rewards, weights, advantages), a, p, entry in zip(spy.seen, raw["answer"], raw["thinking"], logs):
        a, p = torch.tensor(a).view(2, 4), torch.tensor(p).view(2, 4)
        assert p.std() > 0                                            # the judge stand-in is not constant
        # written out from the formula, per group
        mu_c, mu_i = p[:, :2].mean(1), p[:, 2:].mean(1)
        f = 0.3 * math.exp(-step / 1.0) * torch.where(mu_c < mu_i, torch.exp(mu_c - mu_i), torch.ones(2))
        gamma = torch.where(mu_c < mu_i, torch.exp(2 * (mu_c - mu_i)), torch.ones(2))
        torch.testing.assert_close(rewards[:, 0], a.view(-1))
        torch.testing.assert_close(rewards[:, 1], (f[:, None] * p).view(-1))
        # the advantages trained on are GRPO's on the shaped total a + f p
        torch.testing.assert_close(advantages, grpo_advantages(rewards, weights, 4, "group", "sum_then_normalize"))
        assert entry["trl_credit/trust_grpo/f0"] == pytest.approx(0.3 * math.exp(-step))
        assert entry["trl_credit/trust_grpo/f"] == pytest.approx(f.mean().item(), rel=1e-5)
        assert entry["trl_credit/trust_grpo/gamma"] == pytest.approx(gamma.mean().item(), rel=1e-5)
        assert entry["trl_credit/trust_grpo/active_groups"] == 1.0
