"""Reg-GRPO: hand-computed predictions and losses, written-objective gradients, partial groups, checks, real runs."""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from trl_credit import ConfigError, grpo_advantages
from trl_credit.testing import check_args, check_plugin, loss_inputs, make_batch, plugin_set, run_loss, train_tiny
from trl_credit_reg_grpo import RegGRPO, predicted_advantages, sequence_log_ratio

README = Path(__file__).resolve().parents[1] / "README.md"
EPS = 1e-4


def micro_batch(old, logp, advantages, lengths, num_generations, rows=None, **kwargs):
    """`loss_inputs` of a generation batch of len(lengths) rows, cut to the micro-batch ``rows`` (TRL's shuffle)."""
    n = len(lengths)
    batch = make_batch([float(i % 2) for i in range(n)], num_generations, lengths=list(lengths),
                       **kwargs.pop("grpo", {}))
    lp = torch.tensor(logp, dtype=torch.float32)
    full = loss_inputs(batch, torch.tensor(advantages, dtype=torch.float32), logps=lp,
                       old_logps=None if old is None else torch.tensor(old, dtype=torch.float32), **kwargs)
    rows = torch.arange(n) if rows is None else torch.tensor(rows)
    leaf = lp[rows].clone().requires_grad_(True)
    cut = dataclasses.replace(
        full, rows=rows, prompt_ids=full.prompt_ids[rows], prompt_mask=full.prompt_mask[rows],
        completion_ids=full.completion_ids[rows], mask=full.mask[rows], advantages=full.advantages[rows],
        old_logps=None if full.old_logps is None else full.old_logps[rows], logps=leaf,
        ref_logps=None if full.ref_logps is None else full.ref_logps[rows], entropies=full.entropies[rows],
        num_items=full.mask[rows].sum().clamp(min=1.0))
    return leaf, cut


def written_loss(logp, old, mask, adv, groups, predictor="normalized", reduce="mean", beta=1.0, eps=EPS, scale=1.0):
    """The objective written out row by row (python loops, no vectorised helper)."""
    b = logp.shape[0]
    r, valid = [], []
    for i in range(b):
        n_tok = float(mask[i].sum())
        s = sum((logp[i, t] - old[i, t]) * mask[i, t] for t in range(logp.shape[1]))
        r.append(s / n_tok if (reduce == "mean" and n_tok > 0) else s)
        valid.append(n_tok > 0)
    total, count = 0.0, 0
    for i in range(b):
        if not valid[i]:
            continue
        peers = [j for j in range(b) if valid[j] and groups[j] == groups[i]]
        mean = sum(r[j] for j in peers) / len(peers)
        if predictor == "raw":
            pred = beta * r[i]
        elif predictor == "centered":
            pred = beta * (r[i] - mean)
        else:
            var = sum((r[j] - mean) ** 2 for j in peers) / max(len(peers) - 1, 1)
            std = torch.sqrt(torch.clamp(torch.as_tensor(var), min=1e-20))
            pred = (r[i] - mean) / (std + eps)
        total = total + (pred - adv[i]) ** 2
        count += 1
    return scale * total / max(count, 1)


# ------------------------------------------------------------------ predictions and values by hand
def test_normalized_predictions_are_grpo_advantages_of_the_log_ratios():
    """With r = rewards, a_hat = TRL's GRPO advantages (group mean, unbiased std + 1e-4), two groups of 4."""
    r = torch.tensor([1.0, 2.0, 3.0, 6.0, 0.0, 0.0, 1.0, 1.0])
    a_hat = predicted_advantages(r, torch.arange(8) // 4, torch.ones(8, dtype=torch.bool))
    # group 1: mean 3, std sqrt((4 + 1 + 0 + 9) / 3) = 2.160247 -> [-2, -1, 0, 3] / 2.160347
    torch.testing.assert_close(a_hat[:4], torch.tensor([-2.0, -1.0, 0.0, 3.0]) / (math.sqrt(14 / 3) + EPS))
    trl = grpo_advantages(r.unsqueeze(1), torch.ones(1), 4, "group", "sum_then_normalize")
    torch.testing.assert_close(a_hat, trl, rtol=1e-6, atol=1e-6)


def test_regression_value_by_hand_centered():
    # two groups of 2; r (token means of logp - old) = [0.2, -0.2, 0.1, 0.3]; group means 0 and 0.2
    old = [[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]]
    logp = [[-0.8, -0.8], [-1.2, -1.2], [-0.9, -0.9], [-0.7, -0.7]]
    leaf, loss = micro_batch(old, logp, [1.0, -1.0, -1.0, 1.0], [2, 2, 2, 2], 2)
    result = run_loss(RegGRPO, loss, {"predictor": "centered"})
    # a_hat = [0.2, -0.2, -0.1, 0.1]; errors [-0.8, 0.8, 0.9, -0.9]: (0.64 + 0.64 + 0.81 + 0.81) / 4 = 0.725
    assert result.terms["regression"].item() == pytest.approx(0.725, abs=1e-6)
    assert set(result.terms) == {"regression"}                               # beta = 0: no KL term
    assert torch.equal(result.weights.token, torch.zeros(4, 2))               # TRL's surrogate removed
    # sum log-ratio doubles r (2 tokens each): a_hat = [0.4, -0.4, -0.2, 0.2] -> (0.36*2 + 0.64*2) / 4 = 0.5
    assert run_loss(RegGRPO, loss, {"predictor": "centered", "log_ratio": "sum"}).terms["regression"].item() \
        == pytest.approx(0.5, abs=1e-6)
    # raw, beta 2, scale 3: a_hat = [0.4, -0.4, 0.2, 0.6]; errors [-0.6, 0.6, 1.2, -0.4] -> 3 * 2.32 / 4 = 1.74
    raw = run_loss(RegGRPO, loss, {"predictor": "raw", "reward_beta": 2.0, "scale": 3.0}).terms["regression"]
    assert raw.item() == pytest.approx(1.74, abs=1e-5)
    assert loss.batch.metrics["reg_grpo/paired_fraction"][0] == 1.0
    assert loss.batch.metrics["reg_grpo/abs_log_ratio"][0] == pytest.approx(0.2, abs=1e-6)   # mean |r|


# ------------------------------------------------------------------ gradients
@pytest.mark.parametrize("options", [{}, {"log_ratio": "sum"}, {"predictor": "centered", "reward_beta": 0.7},
                                     {"predictor": "raw", "scale": 2.0}, {"eps": 0.05}])
def test_gradient_is_autograd_of_the_written_objective_on_a_shuffled_partial_micro_batch(options):
    """12 rows in groups of 4; the micro-batch holds rows of all three groups, one of them alone, and an empty row."""
    g = torch.Generator().manual_seed(0)
    lengths = [5, 3, 4, 2, 5, 1, 0, 4, 3, 5, 2, 4]
    old = (-torch.rand(12, 5, generator=g) * 2).tolist()
    logp = (torch.tensor(old) + 0.3 * torch.randn(12, 5, generator=g)).tolist()
    adv = torch.randn(12, generator=g).tolist()
    rows = [7, 1, 6, 10, 4, 2, 5]                  # groups [1, 0, 1, 2, 1, 0, 1]: group 2 alone; row 6 empty
    leaf, loss = micro_batch(old, logp, adv, lengths, 4, rows=rows)
    term = run_loss(RegGRPO, loss, options).terms["regression"]
    (ours,) = torch.autograd.grad(term, leaf)
    cfg = RegGRPO.Config(**options)
    lp = leaf.detach().clone().requires_grad_(True)
    written = written_loss(lp, loss.old_logps, loss.mask, loss.advantages, [r // 4 for r in rows], cfg.predictor,
                           cfg.log_ratio, cfg.reward_beta, cfg.eps, cfg.scale)
    (expected,) = torch.autograd.grad(written, lp)
    assert term.item() == pytest.approx(written.item(), rel=1e-5)
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-6)
    assert ours.abs().sum() > 0
    assert torch.equal(ours[2], torch.zeros(5))                               # the empty row
    if cfg.predictor != "raw":
        assert torch.equal(ours[3], torch.zeros(5))                           # alone in its group: a_hat = 0
    assert loss.batch.metrics["reg_grpo/paired_fraction"] == [pytest.approx(5 / 6)]   # 6 rows with tokens


def grpo_on_policy_loss(logp, advantages, mask, eps_low=0.2, eps_high=0.2):
    """TRL 1.16 ``_compute_loss`` for loss_type grpo, beta 0, on-policy (old = logp.detach())."""
    coef_1 = torch.exp(logp - logp.detach())
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    a = advantages.unsqueeze(1)
    per_token = -torch.min(coef_1 * a, coef_2 * a)
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def test_on_policy_predictions_are_zero_and_centered_half_is_grpos_gradient():
    g = torch.Generator().manual_seed(1)
    lengths = [4, 2, 3, 1, 4, 4, 2, 3]
    logp = (-torch.rand(8, 4, generator=g)).tolist()
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    adv = grpo_advantages(rewards.unsqueeze(1), torch.ones(1), 4, "group", "sum_then_normalize")
    leaf, loss = micro_batch(None, logp, adv.tolist(), lengths, 4)            # old_logps None: on-policy
    result = run_loss(RegGRPO, loss, {"predictor": "centered", "reward_beta": 0.5})
    assert result.terms["regression"].item() == pytest.approx((adv**2).mean().item(), rel=1e-6)   # a_hat = 0
    (ours,) = torch.autograd.grad(result.terms["regression"], leaf)
    lp = leaf.detach().clone().requires_grad_(True)
    (trl,) = torch.autograd.grad(grpo_on_policy_loss(lp, adv, loss.mask), lp)
    assert ours.abs().sum() > 0
    torch.testing.assert_close(ours, trl, rtol=1e-5, atol=1e-7)
    # normalized: singular at r = 0, the same direction scaled by 1 / eps: -(2 / (B eps)) A_i m_it / |o_i|
    (norm,) = torch.autograd.grad(run_loss(RegGRPO, loss).terms["regression"], leaf)
    expected = -2.0 / (8 * EPS) * adv.unsqueeze(1) * loss.mask / loss.mask.sum(-1, keepdim=True)
    torch.testing.assert_close(norm, expected, rtol=1e-4, atol=1e-3)


def test_a_solved_regression_has_zero_loss_and_zero_gradient():
    """Off-policy: once reward_beta * (r - mean_g r) equals A the gradient vanishes (Reg-GRPO's trust region)."""
    adv = [1.5, -0.5, -0.5, -0.5]
    beta = 10.0
    old = [[-1.0] * 3] * 4
    logp = [[-1.0 + a / beta] * 3 for a in adv]                                 # r_i = A_i / beta, group mean 0
    leaf, loss = micro_batch(old, logp, adv, [3, 3, 3, 3], 4)
    term = run_loss(RegGRPO, loss, {"predictor": "centered", "reward_beta": beta}).terms["regression"]
    assert term.item() == pytest.approx(0.0, abs=1e-10)
    torch.testing.assert_close(torch.autograd.grad(term, leaf)[0], torch.zeros(4, 3), rtol=0, atol=1e-6)
    # normalized: any positive rescaling of A reproduces it (beta cancels): 0 up to eps
    logp2 = [[-1.0 + 0.01 * a] * 3 for a in adv]
    _, loss2 = micro_batch(old, logp2, adv, [3, 3, 3, 3], 4)                    # adv has unbiased std 1
    assert run_loss(RegGRPO, loss2).terms["regression"].item() == pytest.approx(0.0, abs=1e-3)


# ------------------------------------------------------------------ edge cases
def test_zero_advantages_equal_group_and_masked_tokens():
    # all-equal group, zero advantages, on-policy: loss 0 and gradient 0
    leaf, loss = micro_batch(None, [[-0.5] * 3] * 4, [0.0] * 4, [3, 3, 3, 3], 4)
    term = run_loss(RegGRPO, loss).terms["regression"]
    assert term.item() == 0.0 and torch.equal(torch.autograd.grad(term, leaf)[0], torch.zeros(4, 3))
    # masked positions do not count: logp at a masked token changes nothing
    old = [[-1.0] * 3] * 4
    a = [[-0.9, -0.8, -1.0], [-1.1, -1.2, 7.0], [-1.0, -0.7, -1.0], [-1.3, -1.0, -1.0]]
    b = [row[:] for row in a]
    b[1][2] = -50.0
    _, la = micro_batch(old, a, [1.0, -1.0, 0.5, -0.5], [3, 2, 3, 3], 4)
    _, lb = micro_batch(old, b, [1.0, -1.0, 0.5, -0.5], [3, 2, 3, 3], 4)
    assert run_loss(RegGRPO, la).terms["regression"].item() == run_loss(RegGRPO, lb).terms["regression"].item()
    # a micro-batch whose rows are all empty (dropped by a filter): 0, finite
    _, empty = micro_batch(old, a, [0.0] * 4, [0, 0, 0, 0], 4)
    assert run_loss(RegGRPO, empty).terms["regression"].item() == 0.0


def test_per_token_advantages_are_reduced_by_their_masked_mean():
    old = [[-1.0, -1.0], [-1.0, -1.0]]
    leaf, loss = micro_batch(old, old, [0.0, 0.0], [2, 1], 2)
    loss = dataclasses.replace(loss, advantages=torch.tensor([[1.0, 3.0], [-2.0, 9.0]]))   # row 1: 1 token
    term = run_loss(RegGRPO, loss).terms["regression"]
    assert term.item() == pytest.approx((2.0**2 + 2.0**2) / 2)                  # targets [2, -2], a_hat 0


def test_kl_term_is_trls_with_and_without_bias_correction():
    old = [[-1.0, -2.0], [-0.5, -1.0]]
    logp = [[-1.2, -1.8], [-0.5, -1.4]]
    ref = torch.tensor([[-1.0, -1.5], [-0.7, -1.0]])
    for correction in (False, True):
        leaf, loss = micro_batch(old, logp, [1.0, -1.0], [2, 2], 2, ref_logps=ref, beta=0.1, loss_type="dapo",
                                 grpo={"use_bias_correction_kl": correction})
        kl = run_loss(RegGRPO, loss).terms["kl"]
        lp = leaf.detach().clone().requires_grad_(True)
        d = ref - lp
        per_token = torch.exp(d) - d - 1
        if correction:
            per_token = per_token * torch.exp(lp - torch.tensor(old))
        written = 0.1 * per_token.sum() / 4                                    # dapo: sum / num_items (4 tokens)
        assert kl.item() == pytest.approx(written.item(), rel=1e-6)
        torch.testing.assert_close(torch.autograd.grad(kl, leaf)[0], torch.autograd.grad(written, lp)[0])
    # sequence-level importance sampling: the row's exp(mean log-ratio) weights its tokens
    leaf, loss = micro_batch(old, logp, [1.0, -1.0], [2, 2], 2, ref_logps=ref, beta=0.1, loss_type="grpo",
                             grpo={"use_bias_correction_kl": True, "importance_sampling_level": "sequence"})
    d = ref - torch.tensor(logp)
    weight = torch.exp((torch.tensor(logp) - torch.tensor(old)).mean(-1, keepdim=True))   # 2 tokens per row
    written = 0.1 * ((torch.exp(d) - d - 1) * weight).mean(-1).mean()                      # grpo: row means
    assert run_loss(RegGRPO, loss).terms["kl"].item() == pytest.approx(written.item(), rel=1e-6)
    # on-policy the bias correction still changes the gradient (the ratio's value is 1, its gradient is not 0)
    grads = []
    for correction in (False, True):
        leaf, loss = micro_batch(None, logp, [1.0, -1.0], [2, 2], 2, ref_logps=ref, beta=0.1, loss_type="grpo",
                                 grpo={"use_bias_correction_kl": correction})
        grads.append(torch.autograd.grad(run_loss(RegGRPO, loss).terms["kl"], leaf)[0])
    assert not torch.allclose(grads[0], grads[1])


# ------------------------------------------------------------------ config, checks, contract
@pytest.mark.parametrize(("options", "key"), [
    ({"predictor": "linear"}, "predictor"), ({"log_ratio": "max"}, "log_ratio"), ({"reward_beta": 0.0}, "reward_beta"),
    ({"eps": 0.0}, "eps"), ({"scale": -1.0}, "scale"), ({"beta": 0.1}, "beta"),
])
def test_bad_options(options, key):
    with pytest.raises(ConfigError, match=rf"\(reg_grpo\): option '{key}'"):
        plugin_set(RegGRPO, options)


@pytest.mark.parametrize("grpo", [{"entropy_coef": 0.01}, {"use_adaptive_entropy": True}])
def test_check_args_refuses_an_entropy_bonus(grpo):
    with pytest.raises(ConfigError) as error:
        check_args(RegGRPO, per_device_train_batch_size=8, num_generations=4, **grpo)
    message = str(error.value)
    assert "plugins[0] (reg_grpo): entropy_coef: reg_grpo gives every token of TRL's loss weight 0" in message
    assert "fix: set `entropy_coef: 0.0` and `use_adaptive_entropy: false`" in message


def test_check_args_accepts_beta_and_warns_on_unscaled_rewards():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        check_args(RegGRPO, per_device_train_batch_size=8, num_generations=4, beta=0.04, loss_type="grpo")
        check_args(RegGRPO, {"predictor": "centered"}, per_device_train_batch_size=8, num_generations=4,
                   scale_rewards="none")
    with pytest.warns(UserWarning, match="scale_rewards='none'; consider predictor 'centered'"):
        check_args(RegGRPO, per_device_train_batch_size=8, num_generations=4, scale_rewards="none")


def test_contract():
    check_plugin(RegGRPO)
    check_plugin(RegGRPO, {"predictor": "centered", "log_ratio": "sum", "reward_beta": 0.5, "scale": 2.0})


def test_readme_yaml_validates():
    snippets = re.findall(r"^```yaml\n(.*?)^```", README.read_text(encoding="utf-8"), re.M | re.S)
    assert snippets
    for snippet in snippets:
        config = yaml.safe_load(snippet)
        grpo = {k: v for k, v in config.items() if k in ("loss_type", "num_iterations", "beta", "num_generations",
                                                         "scale_rewards", "steps_per_generation",
                                                         "gradient_accumulation_steps")}
        items = [dict(p) for p in config["plugins"]]
        first = items[0].pop("name")
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            check_args(first, items[0], others=items[1:], per_device_train_batch_size=8, **grpo)


def test_helpers_reduce_as_documented():
    lp = torch.tensor([[0.5, 0.1, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    assert sequence_log_ratio(lp, torch.zeros(1, 3), mask).item() == pytest.approx(0.3)
    assert sequence_log_ratio(lp, torch.zeros(1, 3), mask, "sum").item() == pytest.approx(0.6)
    assert sequence_log_ratio(lp, None, mask).item() == 0.0


# ------------------------------------------------------------------ real runs
def half_right(completions, **kwargs):
    """Every group of 4 gets rewards [0, 1, 0, 1]: every group has a signal."""
    return [float(i % 2) for i in range(len(completions))]


RUNS = {
    # defaults; 2 micro-batches of 4 rows per generation batch of 8, shuffled: groups are split
    "on-policy": ([{"name": "reg_grpo"}], {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2}),
    # num_iterations 2: the second pass sees the moved policy; beta > 0: the plugin's own KL term
    "off-policy": ([{"name": "reg_grpo", "predictor": "centered"}], {"num_iterations": 2, "beta": 0.1}),
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    cache = {}

    def run(key):
        if key not in cache:
            plugins, grpo = RUNS[key]
            cache[key] = train_tiny(plugins, output_dir=tmp_path_factory.mktemp(key), reward_funcs=[half_right],
                                    learning_rate=1e-3, **grpo)
        return [h for h in cache[key].state.log_history if "loss" in h]

    return run


def test_on_policy_run_with_split_groups(trained):
    logs = trained("on-policy")
    assert len(logs) == 2
    for h in logs:
        assert math.isfinite(h["trl_credit/reg_grpo/regression"]) and h["trl_credit/reg_grpo/regression"] > 0
        assert h["grad_norm"] > 0                             # TRL's surrogate is gone, the regression trains


def test_off_policy_run_with_kl_learns_the_regression(trained):
    first, second = trained("off-policy")
    assert second["trl_credit/reg_grpo/regression"] < first["trl_credit/reg_grpo/regression"]
    assert first["trl_credit/reg_grpo/kl"] == pytest.approx(0.0, abs=1e-7)      # policy = reference at step 0
    assert second["trl_credit/reg_grpo/kl"] > 0


def test_metrics_reach_the_training_logs(trained):
    for h in trained("on-policy"):
        assert 0.0 <= h["trl_credit/reg_grpo/paired_fraction"] <= 1.0           # micro-batches of split groups
        assert h["trl_credit/reg_grpo/abs_log_ratio"] == 0.0                    # on-policy: r = 0
    first, second = trained("off-policy")
    assert first["trl_credit/reg_grpo/paired_fraction"] == 1.0                  # one micro-batch: whole groups
    assert first["trl_credit/reg_grpo/abs_log_ratio"] < 1e-6 < second["trl_credit/reg_grpo/abs_log_ratio"]
