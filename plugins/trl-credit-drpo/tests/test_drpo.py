"""DRPO / DisCO: methods.md vectors, the on-policy gradient equivalence, edge cases, contract, a real run."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import yaml

from trl_credit import ConfigError
from trl_credit.testing import check_args, check_plugin, default_args, make_batch, plugin_set, run_plugin, train_tiny
from trl_credit_drpo import DRPO

NAN = None  # make_batch turns None into NaN
G = 4


def grpo_args(max_completion_length, **overrides):
    values = dict(max_completion_length=max_completion_length, loss_type="grpo", num_generations=G)
    values.update(overrides)
    return default_args(**values)


def vector_batch(logps=None, max_completion_length=10, rewards=(1, 1, 0, 0), lengths=(2, 6, 5, 9)):
    """methods.md 2.4: l = |o|/L_max = [0.2, 0.6, 0.5, 0.9] with L_max = 10 (padded width is only 9)."""
    return make_batch(list(rewards), G, lengths=list(lengths), logps=logps,
                      args=grpo_args(max_completion_length))


def logps_with_means(means, lengths=(2, 6, 5, 9)):
    """(N, 9) per-token log-probs whose masked token means are ``means``."""
    out = torch.zeros(len(means), max(lengths))
    for i, (m, n) in enumerate(zip(means, lengths)):
        out[i, :n] = m
    return out


# ------------------------------------------------------------------ methods.md test vectors
def test_vector_drpo():
    result = run_plugin(DRPO, vector_batch(logps_with_means([-0.3, -0.2, -0.7, -0.7])))
    expected = torch.tensor([0.982014, 0.017986, -0.5, -0.5]) * G
    torch.testing.assert_close(result.advantages, expected, rtol=0, atol=4e-6)
    assert result.metrics["drpo/valid_groups"] == 1.0
    assert result.metrics["drpo/ignored_rewards"] == 0.0
    # exact closed form: w_1 = 1 / (1 + e^{-(0.6 - 0.2)/0.1})
    torch.testing.assert_close(result.advantages[0].item(), G / (1 + math.exp(-4.0)), rtol=1e-6, atol=0)


def test_vector_disco_logL():
    result = run_plugin(DRPO, vector_batch(logps_with_means([-0.3, -0.2, -0.1, -0.5])), {"mode": "disco"})
    expected = torch.tensor([0.5, 0.5, -0.509999, -0.490001]) * G
    torch.testing.assert_close(result.advantages, expected, rtol=0, atol=4e-6)


def test_vector_disco_Lratio():
    # on-policy every ratio score is 1: no scoring pass needed (the batch has no log-probs at all)
    result = run_plugin(DRPO, vector_batch(None), {"mode": "disco", "score": "Lratio", "tau": 1.0})
    torch.testing.assert_close(result.advantages, torch.tensor([0.5, 0.5, -0.5, -0.5]) * G, rtol=0, atol=1e-7)


def test_length_ratio_uses_max_completion_length_not_padded_width():
    # L_max = 20: l = [0.1, 0.3, ...], w_1 = 1 / (1 + e^{-2}) = 0.880797
    result = run_plugin(DRPO, vector_batch(logps_with_means([0.0] * 4), max_completion_length=20))
    torch.testing.assert_close(result.advantages[:2], torch.tensor([0.880797, 0.119203]) * G, rtol=0, atol=4e-6)


def test_lambda_alias_and_large_lambda_is_disco():
    lp = logps_with_means([-0.3, -0.2, -0.1, -0.5])
    big = run_plugin(DRPO, vector_batch(lp), {"lambda": 1e6})
    disco = run_plugin(DRPO, vector_batch(lp), {"mode": "disco"})
    torch.testing.assert_close(big.advantages, disco.advantages, rtol=0, atol=1e-5)
    assert plugin_set(DRPO, {"lambda": 0.5}).plugins[0].instance.config.lambda_ == 0.5


def test_lambda_is_set_by_its_alias_from_yaml():
    """``lambda`` is a Python keyword: the field is ``lambda_``, the YAML key its alias ``lambda``."""
    (item,) = yaml.safe_load("- name: drpo\n  lambda: 0.5\n")
    assert item == {"name": "drpo", "lambda": 0.5}
    name = item.pop("name")
    assert plugin_set(name, item).plugins[0].instance.config.lambda_ == 0.5
    check_args(name, item, per_device_train_batch_size=8, num_generations=4, loss_type="grpo")   # validate: fine
    with pytest.raises(ConfigError, match=r"\(drpo\): option 'lambda'"):
        check_args(name, {"lambda": 0.0}, per_device_train_batch_size=8, num_generations=4, loss_type="grpo")


# ------------------------------------------------------------------ on-policy gradient equivalence
class TinyLM(torch.nn.Module):
    """A causal toy LM: logits of token t depend on token t-1 (the prompt token at t = 0) and t."""

    def __init__(self, vocab=7, dim=5, width=6):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.tok = torch.nn.Parameter(torch.randn(vocab, dim, generator=gen, dtype=torch.float64))
        self.pos = torch.nn.Parameter(torch.randn(width, dim, generator=gen, dtype=torch.float64) * 0.5)
        self.out = torch.nn.Parameter(torch.randn(dim, vocab, generator=gen, dtype=torch.float64))

    def token_logps(self, prompt, ids):
        prev = torch.cat([prompt[:, None], ids[:, :-1]], dim=1)           # (N, T)
        h = torch.tanh(self.tok[prev] + self.pos[: ids.shape[1]])
        logp = torch.log_softmax(h @ self.out, dim=-1)
        return logp.gather(-1, ids[..., None]).squeeze(-1)                 # (N, T)


def toy_rollouts():
    gen = torch.Generator().manual_seed(1)
    rewards = [1, 0, 1, 0,   0, 1, 0, 0,   1, 1, 1, 1,   0, 0, 0, 0,   1, 1, 0, 1]
    n, width = len(rewards), 6
    lengths = torch.randint(1, width + 1, (n,), generator=gen)
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    ids = torch.randint(1, 7, (n, width), generator=gen) * mask
    prompt = torch.arange(n) // G
    return rewards, ids, mask, prompt


def trl_grpo_loss(logp, advantages, mask, eps_low=0.2, eps_high=0.2):
    """TRL 1.16 ``_compute_loss`` for loss_type="grpo", beta=0, num_iterations=1 (old logps = logp.detach())."""
    coef_1 = torch.exp(logp - logp.detach())
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    a = advantages.unsqueeze(1)
    per_token = -torch.min(coef_1 * a, coef_2 * a)
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def drpo_objective_loss(s, rewards, length_ratio, lam, tau):
    """-(1/Q) sum_q J_q written out per question, straight from the paper's objective."""
    r = torch.tensor(rewards)
    q_count = len(rewards) // G
    total = s.new_zeros(())
    for q in range(q_count):
        rows = torch.arange(q * G, (q + 1) * G)
        pos, neg = rows[r[rows] == 1], rows[r[rows] == 0]
        if len(pos) == 0 or len(neg) == 0:
            continue
        if lam is None:
            w = torch.full((len(pos),), 1.0 / len(pos), dtype=s.dtype)
        else:
            e = torch.exp((1 - length_ratio[pos]) / lam)
            w = e / e.sum()
        neg_sum = torch.exp(s[neg] / tau).sum()
        total = total + (w * s[pos]).sum() - tau * neg_sum / neg_sum.detach()
    return -total / q_count


@pytest.mark.parametrize("options", [{}, {"mode": "disco"}, {"lambda": 0.5, "tau": 2.0},
                                     {"mode": "disco", "score": "Lratio", "tau": 1.0}])
def test_on_policy_gradient_equals_drpo_objective_gradient(options):
    """num_iterations = 1: grad of TRL's grpo loss with these advantages == grad of -(1/Q) sum_q J_q."""
    cfg = DRPO.Config(**options)
    rewards, ids, mask, prompt = toy_rollouts()
    max_len = 8                                                            # > padded width 6
    model = TinyLM()
    params = list(model.parameters())
    logp = model.token_logps(prompt, ids)
    m = mask.to(torch.float64)

    batch = make_batch(rewards, G, completion_ids=ids, completion_mask=mask, logps=logp.detach(),
                       args=grpo_args(max_len))
    adv = run_plugin(DRPO, batch, options).advantages.to(torch.float64)
    grad_trl = torch.autograd.grad(trl_grpo_loss(logp, adv, m), params)

    logp = model.token_logps(prompt, ids)
    if cfg.score == "logL":
        s = (logp * m).sum(1) / m.sum(1)                                   # mean token log-prob
    else:
        s = (torch.exp(logp - logp.detach()) * m).sum(1) / m.sum(1)        # mean token ratio pi/pi_old
    lam = cfg.lambda_ if cfg.mode == "drpo" else None
    loss = drpo_objective_loss(s, rewards, m.sum(1) / max_len, lam, cfg.tau)
    grad_drpo = torch.autograd.grad(loss, params)

    assert any(g.abs().max() > 1e-3 for g in grad_drpo)                    # a real, non-trivial gradient
    for a, b in zip(grad_trl, grad_drpo):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------ edge cases
def test_constant_groups_and_single_completion_groups_get_zero():
    lp = torch.zeros(8, 4)
    result = run_plugin(DRPO, make_batch([1, 1, 1, 1, 0, 0, 0, 0], G, logps=lp, loss_type="grpo"))
    assert torch.equal(result.advantages, torch.zeros(8))
    assert result.metrics["drpo/valid_groups"] == 0.0
    single = run_plugin(DRPO, make_batch([1, 0, 1], 1, logps=torch.zeros(3, 4), loss_type="grpo"))
    assert torch.equal(single.advantages, torch.zeros(3))


def test_nan_rewards_are_neither_positive_nor_negative():
    lp = torch.zeros(8, 4)
    result = run_plugin(DRPO, make_batch([1, NAN, 0, NAN, NAN, NAN, NAN, NAN], G, logps=lp, loss_type="grpo"))
    torch.testing.assert_close(result.advantages, torch.tensor([G, 0, -G, 0, 0, 0, 0, 0], dtype=torch.float32))
    assert result.metrics["drpo/valid_groups"] == 0.5


def test_non_binary_rewards_ignored_or_thresholded():
    lp = logps_with_means([0.0] * 4, lengths=(4, 4, 4, 4))
    batch = lambda: make_batch([1, 0.5, 0, 0.2], G, logps=lp, loss_type="grpo")  # noqa: E731
    with pytest.warns(UserWarning, match="threshold"):
        ignored = run_plugin(DRPO, batch())
    torch.testing.assert_close(ignored.advantages, torch.tensor([1.0, 0, -1.0, 0]) * G)
    assert ignored.metrics["drpo/ignored_rewards"] == 0.5
    split = run_plugin(DRPO, batch(), {"threshold": 0.5})          # pos {1, 0.5} (same length), neg {0, 0.2}
    torch.testing.assert_close(split.advantages, torch.tensor([0.5, 0.5, -0.5, -0.5]) * G)
    assert split.metrics["drpo/ignored_rewards"] == 0.0


def test_empty_completion_is_excluded():
    lp = torch.zeros(4, 5)
    result = run_plugin(DRPO, make_batch([1, 1, 0, 0], G, lengths=[0, 5, 0, 3], logps=lp, loss_type="grpo"))
    torch.testing.assert_close(result.advantages, torch.tensor([0.0, 1.0, 0.0, -1.0]) * G)


def test_equal_tokens_and_extreme_scores_are_stable():
    # identical completions: equal scores -> uniform negatives; very low log-probs do not overflow
    ids = torch.full((4, 6), 3)
    lp = torch.tensor([[-1.0] * 6, [-1.0] * 6, [-2000.0] * 6, [-1000.0] * 6])
    result = run_plugin(DRPO, make_batch([1, 1, 0, 0], G, completion_ids=ids, logps=lp, loss_type="grpo"))
    assert torch.isfinite(result.advantages).all()
    torch.testing.assert_close(result.advantages[:2], torch.tensor([0.5, 0.5]) * G)
    torch.testing.assert_close(result.advantages[2:], torch.tensor([0.0, -1.0]) * G, rtol=0, atol=1e-6)


def test_reward_column_selection():
    rewards = [[1, 0], [0, 1], [1, 1], [0, 0]]
    lp = torch.zeros(4, 4)
    acc = run_plugin(DRPO, make_batch(rewards, G, reward_names=["accuracy", "format"], logps=lp, loss_type="grpo"),
                     {"reward": "accuracy", "mode": "disco"})
    torch.testing.assert_close(acc.advantages, torch.tensor([0.5, -0.5, 0.5, -0.5]) * G)
    assert plugin_set(DRPO, {"reward": "accuracy"}).plugins[0].instance.required_rewards() == ["accuracy"]
    assert plugin_set(DRPO).plugins[0].instance.required_rewards() == []


@pytest.mark.parametrize("options, key", [({"lam": 0.1}, "lam"), ({"tau": 0.0}, "tau"),
                                          ({"lambda": -1.0}, "lambda"), ({"mode": "grpo"}, "mode"),
                                          ({"score": "logp"}, "score")])
def test_bad_options(options, key):
    with pytest.raises(ConfigError, match=key):
        plugin_set(DRPO, options)


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo", "dr_grpo"])
def test_check_args_rejects_other_loss_types(loss_type):
    with pytest.raises(ConfigError) as error:
        check_args(DRPO, per_device_train_batch_size=8, num_generations=4, loss_type=loss_type)
    message = str(error.value)
    assert "plugins[0] (drpo): loss_type:" in message
    assert f"got {loss_type!r}" in message
    assert "fix: set `loss_type: grpo` in the config" in message
    check_args(DRPO, per_device_train_batch_size=8, num_generations=4, loss_type="grpo")          # accepted


def test_run_time_warnings():
    lp = torch.zeros(4, 4)
    with pytest.warns(UserWarning, match="num_iterations=2"):
        run_plugin(DRPO, make_batch([1, 0, 0, 0], G, logps=lp, loss_type="grpo", num_iterations=2))
    with pytest.warns(UserWarning, match="steps_per_generation=4"):
        run_plugin(DRPO, make_batch([1, 0, 0, 0], G, logps=lp, loss_type="grpo", num_iterations=1,
                                    steps_per_generation=4, gradient_accumulation_steps=1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_plugin(DRPO, make_batch([1, 0, 0, 0], G, logps=lp, loss_type="grpo", num_iterations=1,
                                    steps_per_generation=2, gradient_accumulation_steps=2))
    # warnings are not errors: num_iterations and steps_per_generation pass check_args
    check_args(DRPO, per_device_train_batch_size=8, num_generations=4, loss_type="grpo", num_iterations=2)
    with pytest.warns(UserWarning, match="loss_type='grpo'"):                # unit batches: warn, not raise
        run_plugin(DRPO, make_batch([1, 0, 0, 0], G, logps=lp))             # make_batch default: dapo


def scored_edge_batches():
    """The host's edge cases (trl_credit.testing.edge_case_batches) with log-probs as wide as the
    completions, each built once: the host's factories give (N, 6) log-probs to 3-token batches and
    draw new random log-probs on every call, which breaks its own determinism check."""
    gen = torch.Generator().manual_seed(0)

    def scored(rewards, num_generations, lengths):
        lp = -torch.rand(len(rewards), max(max(lengths), 1), generator=gen)
        return make_batch(rewards, num_generations, lengths=lengths, logps=lp, reward_names=["accuracy"])

    return [
        scored([1, 0, 1, 0, 1, 1, 0, 0], 4, [6, 3, 5, 1, 2, 6, 4, 3]),         # mixed groups
        scored([1, 1, 1, 1, 0, 0, 0, 0], 4, [6] * 8),                          # constant groups
        scored([1, None, 0, 1, None, None, None, None], 4, [3] * 8),           # NaN rewards
        scored([1, 0, 1], 1, [2, 6, 4]),                                       # one completion per group
        scored([0.5, 0.25, 0.75, 0.0], 2, [6, 0, 6, 1]),                       # non-binary, empty completion
    ]


def test_contract():
    batches = scored_edge_batches()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)                           # make_batch's loss_type is dapo
        check_plugin(DRPO, batches=batches)
        check_plugin(DRPO, {"mode": "disco", "threshold": 0.5}, batches=batches)
        check_plugin(DRPO, {"score": "Lratio", "tau": 1.0, "lambda": 0.3}, batches=batches)


# ------------------------------------------------------------------ a real run
def test_training_run(tmp_path):
    def half_right(completions, **kwargs):
        """Every group of 4 gets rewards [0, 1, 0, 1]: each group has positives and negatives."""
        return [float(i % 2) for i in range(len(completions))]

    trainer = train_tiny([{"name": "drpo", "lambda": 0.5}], output_dir=tmp_path, reward_funcs=[half_right],
                         loss_type="grpo")
    logs = [e for e in trainer.state.log_history if "trl_credit/drpo/seconds" in e]
    assert trainer.state.global_step == 2
    assert len(logs) == 2
    for entry in logs:
        assert entry["trl_credit/drpo/valid_groups"] == 1.0
        assert math.isfinite(entry["loss"])
