"""DisCO / DRPO KL constraint: hand-computed values, written-objective gradients, edge cases, checks, real runs."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from trl_credit import ConfigError
from trl_credit.testing import check_args, check_plugin, loss_inputs, make_batch, plugin_set, run_loss, train_tiny
from trl_credit_disco_constraint import DiscoConstraint, disco_constraint, stores_old_logps

G = 2
README = Path(__file__).resolve().parents[1] / "README.md"


def toy(logps, old, lengths=(3, 2), **kwargs):
    """Two rows of width 3 (the second has 2 tokens: its third position is masked)."""
    batch = make_batch([1.0, 0.0], G, lengths=list(lengths))
    lp = torch.tensor(logps, requires_grad=True)
    return lp, loss_inputs(batch, torch.tensor([1.0, -1.0]), logps=lp,
                           old_logps=None if old is None else torch.tensor(old), **kwargs)


# old - logp per token: row 0 = [0.2, 0.1, 0.3], row 1 = [0.0, -0.2, (masked 5.0)]
LOGP = [[-1.2, -1.1, -1.3], [-1.0, -0.8, -9.0]]
OLD = [[-1.0, -1.0, -1.0], [-1.0, -1.0, -4.0]]
KL = (0.2 + 0.1 + 0.3 + 0.0 - 0.2) / 5            # = 0.08: the token mean over the 5 unmasked tokens


# ------------------------------------------------------------------ values and gradients
def test_sg_form_value_and_gradient_by_hand():
    lp, loss = toy(LOGP, OLD)
    result = run_loss(DiscoConstraint, loss, {"delta": 0.03, "beta_c": 10.0})
    term = result.terms["constraint"]
    # sg(max(10 * (0.08 - 0.03), 0)) * 0.08 = 0.5 * 0.08 = 0.04
    assert term.item() == pytest.approx(0.04, abs=1e-7)
    (grad,) = torch.autograd.grad(term, lp)
    # d/dlogp_t of 0.5 * KL = 0.5 * (-1/5) on each unmasked token, 0 on the masked one
    expected = torch.tensor([[-0.1, -0.1, -0.1], [-0.1, -0.1, 0.0]])
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-7)
    assert loss.batch.metrics["disco_constraint/kl"] == [pytest.approx(KL, abs=1e-7)]
    assert loss.batch.metrics["disco_constraint/active"] == [1.0]


@pytest.mark.parametrize(("form", "factor"), [("sg", 0.5), ("squared_hinge", 1.0)])
def test_gradient_is_autograd_of_the_written_squared_hinge(form, factor):
    """sg: grad of (beta_c / 2) [KL - delta]_+^2; squared_hinge: grad of beta_c [KL - delta]_+^2 (written out)."""
    g = torch.Generator().manual_seed(0)
    batch = make_batch([1, 0, 1, 0, 0, 1], G, lengths=[5, 3, 1, 4, 5, 2])
    n, t = batch.completion_ids.shape
    old = -torch.rand(n, t, generator=g) * 3
    lp = (old - 0.05 + 0.1 * torch.randn(n, t, generator=g)).requires_grad_(True)
    loss = loss_inputs(batch, torch.zeros(n), logps=lp, old_logps=old)
    for kl_type in ("kl", "low_var_kl"):
        cfg = {"delta": 1e-3, "beta_c": 50.0, "kl_type": kl_type, "form": form}
        (ours,) = torch.autograd.grad(run_loss(DiscoConstraint, loss, cfg).terms["constraint"], lp)
        # the written objective, token by token (no vectorised helper)
        mask = batch.completion_mask.float()
        total, count = 0.0, 0.0
        for i in range(n):
            for j in range(t):
                if mask[i, j] > 0:
                    d = lp[i, j] - old[i, j]
                    total = total + (-d if kl_type == "kl" else torch.exp(d) - 1 - d)
                    count += 1
        kl = total / count
        assert kl.item() > 1e-3                                     # the constraint is active
        written = factor * 50.0 * torch.clamp(kl - 1e-3, min=0) ** 2
        (expected,) = torch.autograd.grad(written, lp)
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-8)
        assert ours.abs().sum() > 0


def test_low_var_kl_by_hand():
    # d = logp - old = [[1, 0, -1], [0, 0, masked]]: k3(d) = e^d - 1 - d = [e - 2, 0, 1/e]; mean over 5 tokens
    _, loss = toy([[0.0, -1.0, -2.0], [-1.0, -1.0, 3.0]], [[-1.0] * 3] * 2)
    result = run_loss(DiscoConstraint, loss, {"kl_type": "low_var_kl", "delta": 0.0, "beta_c": 2.0})
    kl = (torch.e - 2 + torch.e ** -1) / 5
    assert result.terms["constraint"].item() == pytest.approx(2.0 * kl * kl, rel=1e-6)   # sg(2 kl) * kl
    assert loss.batch.metrics["disco_constraint/kl"] == [pytest.approx(kl, rel=1e-6)]


# ------------------------------------------------------------------ edge cases
def test_on_policy_old_logps_none_gives_zero_term_and_zero_gradient():
    lp, loss = toy(LOGP, None)
    for kl_type in ("kl", "low_var_kl"):
        term = run_loss(DiscoConstraint, loss, {"delta": 0.0, "kl_type": kl_type}).terms["constraint"]
        assert term.item() == 0.0
        (grad,) = torch.autograd.grad(term, lp)
        assert torch.equal(grad, torch.zeros_like(grad))
    assert loss.batch.metrics["disco_constraint/active"] == [0.0, 0.0]


def test_below_delta_and_negative_kl_are_inactive():
    lp, loss = toy(LOGP, OLD)
    term = run_loss(DiscoConstraint, loss, {"delta": 0.1}).terms["constraint"]          # KL 0.08 <= 0.1
    assert term.item() == 0.0 and torch.equal(torch.autograd.grad(term, lp)[0], torch.zeros(2, 3))
    _, loss2 = toy(OLD, LOGP)                                    # swapped: KL = -0.08 (the "kl" estimator's sign)
    term2 = run_loss(DiscoConstraint, loss2, {"delta": 0.0}).terms["constraint"]
    assert term2.item() == 0.0
    assert loss2.batch.metrics["disco_constraint/kl"] == [pytest.approx(-KL, abs=1e-7)]
    assert loss2.batch.metrics["disco_constraint/active"] == [0.0]


def test_masked_tokens_and_empty_rows_do_not_count():
    _, loss = toy(LOGP, OLD)
    far = [row[:] for row in LOGP]
    far[1][2] = 100.0                                           # only the masked position changes
    _, loss_far = toy(far, OLD)
    cfg = {"delta": 0.0, "beta_c": 1.0}
    assert run_loss(DiscoConstraint, loss, cfg).terms["constraint"].item() == pytest.approx(
        run_loss(DiscoConstraint, loss_far, cfg).terms["constraint"].item(), abs=0)
    # a micro-batch without any unmasked token (all rows dropped): KL = 0, finite
    _, empty = toy(LOGP, OLD, lengths=(0, 0))
    assert run_loss(DiscoConstraint, empty, cfg).terms["constraint"].item() == 0.0


def test_functional_form_matches_the_official_expression():
    """verl: constraint = torch.maximum(beta*(ppo_kl-delta), 0).detach() * ppo_kl."""
    lp = torch.tensor(LOGP, requires_grad=True)
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    term, _ = disco_constraint(lp, torch.tensor(OLD), mask, delta=1e-4, beta_c=1e3)
    ppo_kl = ((torch.tensor(OLD) - lp) * mask).sum() / mask.sum()
    official = torch.maximum(1e3 * (ppo_kl - 1e-4), torch.zeros_like(ppo_kl)).detach() * ppo_kl
    torch.testing.assert_close(term, official)
    torch.testing.assert_close(torch.autograd.grad(term, lp)[0], torch.autograd.grad(official, lp)[0])


# ------------------------------------------------------------------ config, checks, contract
@pytest.mark.parametrize(("options", "key"), [({"delta": -1.0}, "delta"), ({"beta_c": 0.0}, "beta_c"),
                                              ({"kl_type": "k2"}, "kl_type"), ({"form": "hinge"}, "form"),
                                              ({"beta": 1.0}, "beta")])
def test_bad_options(options, key):
    with pytest.raises(ConfigError, match=rf"\(disco_constraint\): option '{key}'"):
        plugin_set(DiscoConstraint, options)


def test_check_args_refuses_nothing_and_warns_when_on_policy():
    with pytest.warns(UserWarning, match="TRL keeps no old log-probs: KL = 0"):
        check_args(DiscoConstraint, per_device_train_batch_size=8, num_generations=4)
    with pytest.warns(UserWarning, match="always 0"):                 # GA 4 is a multiple of 2 x 2: on-policy
        check_args(DiscoConstraint, per_device_train_batch_size=8, num_generations=4, gradient_accumulation_steps=4,
                   steps_per_generation=2, num_iterations=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        for grpo in ({"num_iterations": 2}, {"steps_per_generation": 4, "gradient_accumulation_steps": 1},
                     {"num_iterations": 2, "gradient_accumulation_steps": 2, "steps_per_generation": 2}):
            run = check_args(DiscoConstraint, per_device_train_batch_size=8, num_generations=4, **grpo)
            assert stores_old_logps(run.args)
        check_args("drpo", per_device_train_batch_size=8, num_generations=4, loss_type="grpo", num_iterations=2,
                   others=["disco_constraint"])


def test_contract():
    check_plugin(DiscoConstraint)
    check_plugin(DiscoConstraint, {"kl_type": "low_var_kl", "form": "squared_hinge", "delta": 0.0})


def test_readme_yaml_validates_with_its_plugins():
    snippets = re.findall(r"^```yaml\n(.*?)^```", README.read_text(encoding="utf-8"), re.M | re.S)
    assert snippets
    for snippet in snippets:
        config = yaml.safe_load(snippet)
        grpo = {k: v for k, v in config.items() if k in ("loss_type", "num_iterations", "beta", "num_generations",
                                                         "gradient_accumulation_steps", "steps_per_generation")}
        items = [dict(p) for p in config["plugins"]]
        first = items[0].pop("name")
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)                    # the documented runs are not on-policy
            check_args(first, items[0], others=items[1:], per_device_train_batch_size=8, **grpo)


# ------------------------------------------------------------------ real runs
def half_right(completions, **kwargs):
    """Every group of 4 gets rewards [0, 1, 0, 1]: drpo sees positives and negatives."""
    return [float(i % 2) for i in range(len(completions))]


# low_var_kl >= 0 and delta = 0: the term is > 0 as soon as the policy has moved (the "kl" estimator's sign
# on 64 sampled tokens is noise); lr 1e-2 so one step moves it measurably
CONSTRAINT = {"name": "disco_constraint", "kl_type": "low_var_kl", "delta": 0.0}


RUNS = {"alone": [CONSTRAINT], "drpo-first": [{"name": "drpo"}, CONSTRAINT],
        "constraint-first": [CONSTRAINT, {"name": "drpo"}]}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One 2-step run per plugin list (num_iterations=2: the second step reuses the rollout), built once."""
    cache = {}

    def run(key):
        if key not in cache:
            plugins = RUNS[key]
            extra = {"loss_type": "grpo"} if len(plugins) == 2 else {}      # drpo requires loss_type grpo
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)                # drpo warns about num_iterations=2
                cache[key] = train_tiny(plugins, output_dir=tmp_path_factory.mktemp(key), reward_funcs=[half_right],
                                        num_iterations=2, learning_rate=1e-2, max_steps=2, **extra)
        return cache[key]

    return run


@pytest.mark.parametrize("key", list(RUNS))
def test_training_run_with_old_logps(trained, key):
    logs = [h for h in trained(key).state.log_history if "loss" in h]
    assert len(logs) == 2
    first, second = (h["trl_credit/disco_constraint/constraint"] for h in logs)
    assert abs(first) < 1e-6            # first pass over the rollout: old = current weights
    assert second > 1e-6                # second pass: the policy moved, the constraint acts
    assert logs[1]["loss"] != logs[0]["loss"]
    if key != "alone":
        assert logs[0]["trl_credit/drpo/valid_groups"] == 1.0


@pytest.mark.parametrize("key", list(RUNS))
def test_kl_and_active_fraction_reach_the_training_logs(trained, key):
    first, second = (h for h in trained(key).state.log_history if "loss" in h)
    assert abs(first["trl_credit/disco_constraint/kl"]) < 1e-6
    assert second["trl_credit/disco_constraint/kl"] > 0 and second["trl_credit/disco_constraint/active"] == 1.0
    # sg form: the logged term is beta_c * max(KL - delta, 0) * KL with delta = 0
    assert second["trl_credit/disco_constraint/constraint"] == pytest.approx(
        1e3 * second["trl_credit/disco_constraint/kl"] ** 2, rel=1e-4)
