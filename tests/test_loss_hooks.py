"""The loss hooks: ``loss_weights`` (token weights, per-sample clip bounds) and ``loss_terms`` (extra terms).

Parity: a pass-through loss plugin leaves TRL's loss and every gradient bit-identical, for every
``loss_type`` TRL 1.16 has. Values: token weights and clip bounds give the loss the written formula
gives; an extra term's gradient is autograd of the written objective on an independent forward pass.
"""

from __future__ import annotations

import copy

import pytest
import torch
from trl import GRPOTrainer

from trl_credit import LossWeights, Plugin, hookimpl
from trl_credit.loss import CLIPPED_LOSSES, aggregate
from trl_credit.pipeline import PluginRuntimeError

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "vespo", "luspo"]  # TRL 1.16's, all of them


def answer_len(completions, **kwargs):
    """A reward that varies within groups on a random tiny model: the completion's length."""
    text = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(len(t) % 7) for t in text]


class PassThroughLoss(Plugin):
    """Weights 1, the config's own clip bounds, a zero term: TRL's loss must come out unchanged."""

    @hookimpl
    def loss_weights(self, loss):
        b = loss.completion_ids.shape[0]
        clipped = loss.loss_type in CLIPPED_LOSSES
        return LossWeights(token=torch.ones_like(loss.mask),
                           epsilon_low=torch.full((b,), loss.epsilon_low) if clipped else None,
                           epsilon_high=torch.full((b,), loss.epsilon_high) if clipped else None)

    @hookimpl
    def loss_terms(self, loss):
        return {"zero": loss.logps.sum() * 0.0}


class SquaredLogp(Plugin):
    """A term with a known objective: 0.3 * mean over rows of (masked mean token log-prob)^2."""

    seen: list = []

    @hookimpl
    def loss_terms(self, loss):
        SquaredLogp.seen.append(loss)
        per_row = (loss.logps * loss.mask).sum(-1) / loss.mask.sum(-1).clamp(min=1.0)
        return {"sq": 0.3 * (per_row**2).mean()}


def _batch(make_trainer, arithmetic, plugin, **overrides):
    trainer = make_trainer(plugins=[plugin], reward_funcs=[answer_len], **overrides)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs = [copy.deepcopy(arithmetic[i // 4]) for i in range(8)]
    torch.manual_seed(0)
    return trainer, trainer._generate_and_score_completions(inputs)


def _loss_and_grads(trainer, fn, inputs):
    trainer.model.zero_grad(set_to_none=True)
    loss = fn(trainer, trainer.model, inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _without_row(inputs):
    return {k: v for k, v in inputs.items() if k != "trl_credit_row"}


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_a_pass_through_loss_plugin_is_bit_identical_to_trl(make_trainer, arithmetic, loss_type):
    extra = {"importance_sampling_level": "sequence"} if loss_type == "luspo" else {}
    trainer, out = _batch(make_trainer, arithmetic, PassThroughLoss, loss_type=loss_type, **extra)
    assert "trl_credit_row" in out
    ours, our_grads = _loss_and_grads(trainer, type(trainer).compute_loss, out)
    theirs, their_grads = _loss_and_grads(trainer, GRPOTrainer.compute_loss, _without_row(out))
    assert torch.equal(ours, theirs)
    assert our_grads.keys() == their_grads.keys() and any(bool(g.abs().sum() > 0) for g in our_grads.values())
    assert all(torch.equal(our_grads[n], their_grads[n]) for n in our_grads)


def test_pass_through_with_a_kl_term_and_off_policy_ratios(make_trainer, arithmetic):
    trainer, out = _batch(make_trainer, arithmetic, PassThroughLoss, loss_type="grpo", beta=0.1)
    assert out["ref_per_token_logps"] is not None
    out["old_per_token_logps"] = out["ref_per_token_logps"] + 0.05  # ratios away from 1: clipping acts
    ours, our_grads = _loss_and_grads(trainer, type(trainer).compute_loss, out)
    theirs, their_grads = _loss_and_grads(trainer, GRPOTrainer.compute_loss, _without_row(out))
    assert torch.equal(ours, theirs) and all(torch.equal(our_grads[n], their_grads[n]) for n in our_grads)


class HalfWeights(Plugin):
    weights: torch.Tensor | None = None

    @hookimpl
    def loss_weights(self, loss):
        return LossWeights(token=HalfWeights.weights[: loss.mask.shape[0], : loss.mask.shape[1]])


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_token_weights_give_the_written_loss(make_trainer, arithmetic, loss_type):
    """On-policy (ratio 1, beta 0) the per-token loss is -A: the weighted loss is the written reduction."""
    generator = torch.Generator().manual_seed(1)
    HalfWeights.weights = torch.rand(8, 8, generator=generator) * torch.randint(0, 2, (8, 8), generator=generator)
    trainer, out = _batch(make_trainer, arithmetic, HalfWeights, loss_type=loss_type)
    loss = type(trainer).compute_loss(trainer, trainer.model, out).detach()
    t = out["completion_ids"].shape[1]
    w = HalfWeights.weights[:, :t]
    m = out["completion_mask"].float()
    per_token = -out["advantages"].unsqueeze(1).expand(-1, t)
    if loss_type == "dapo":
        expected = (per_token * m * w).sum() / out["num_items_in_batch"].clamp(min=1.0)
    elif loss_type == "grpo":  # the weights are part of the per-sequence normaliser, as TRL's tool_mask is
        expected = ((per_token * m * w).sum(-1) / (m * w).sum(-1).clamp(min=1.0)).mean()
    else:
        expected = (per_token * m * w).sum() / (8 * trainer.max_completion_length)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)


class RowBounds(Plugin):
    @hookimpl
    def loss_weights(self, loss):
        b = loss.completion_ids.shape[0]
        high = torch.where(torch.arange(b) % 2 == 0, 0.02, 0.5)  # even rows clip tightly
        return LossWeights(epsilon_low=torch.full((b,), 0.2), epsilon_high=high)


def test_per_sample_clip_bounds_clip_each_row_at_its_own_bound(make_trainer, arithmetic):
    trainer, out = _batch(make_trainer, arithmetic, RowBounds, loss_type="dapo")
    with torch.no_grad():
        out["old_per_token_logps"] = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([out["prompt_ids"], out["completion_ids"]], 1),
            torch.cat([out["prompt_mask"], out["completion_mask"]], 1), out["completion_ids"].shape[1])[0] - 0.1
    out["advantages"] = torch.ones_like(out["advantages"])  # every ratio e^0.1 = 1.105 wants the upper clip
    loss = type(trainer).compute_loss(trainer, trainer.model, out).detach()
    ratio = torch.full((8, 1), 1.0).new_tensor([[1.02] if i % 2 == 0 else [torch.e ** 0.1] for i in range(8)])
    m = out["completion_mask"].float()
    expected = (-ratio * m).sum() / out["num_items_in_batch"].clamp(min=1.0)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert trainer.epsilon_high == trainer.args.epsilon_high or trainer.epsilon_high == trainer.args.epsilon  # restored


def _token_logps(trainer, out):
    """An independent forward pass: log-softmax of the model's logits, gathered at the completion ids."""
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    logits = trainer.model(input_ids=ids, attention_mask=mask).logits[:, :-1] / trainer.temperature
    t = out["completion_ids"].shape[1]
    return torch.log_softmax(logits[:, -t:].float(), -1).gather(-1, out["completion_ids"].unsqueeze(-1)).squeeze(-1)


def test_an_extra_term_adds_the_gradient_of_its_written_objective(make_trainer, arithmetic):
    SquaredLogp.seen.clear()
    trainer, out = _batch(make_trainer, arithmetic, SquaredLogp, loss_type="dapo")
    total, total_grads = _loss_and_grads(trainer, type(trainer).compute_loss, out)
    base, base_grads = _loss_and_grads(trainer, GRPOTrainer.compute_loss, _without_row(out))
    trainer.model.zero_grad(set_to_none=True)
    m = out["completion_mask"].float()
    written = 0.3 * (((_token_logps(trainer, out) * m).sum(-1) / m.sum(-1).clamp(min=1.0)) ** 2).mean()
    written.backward()
    assert (total - base).item() == pytest.approx(written.item(), rel=1e-4)
    for name, grad in base_grads.items():
        param = dict(trainer.model.named_parameters())[name]
        assert torch.allclose(total_grads[name] - grad, param.grad, atol=1e-5, rtol=1e-3), name
    view = SquaredLogp.seen[-1]
    assert view.logps.requires_grad and view.entropies is not None and view.loss_type == "dapo"
    # rows map the micro-batch back to the generation batch the rollout hooks saw
    assert torch.equal(view.batch.completion_ids[view.rows][:, : view.completion_ids.shape[1]], view.completion_ids)
    assert trainer._metrics["train"]["trl_credit/squared_logp/sq"] == [pytest.approx(written.item(), rel=1e-4)]


def test_aggregate_matches_trl_for_every_loss_type(make_trainer, arithmetic):
    """``LossInputs.aggregate`` of TRL's on-policy per-token loss (-A, beta 0) is TRL's loss."""
    for loss_type in LOSS_TYPES:
        if loss_type in ("sapo", "vespo", "cispo"):  # their on-policy per-token loss is not -A
            continue
        extra = {"importance_sampling_level": "sequence"} if loss_type == "luspo" else {}
        trainer, out = _batch(make_trainer, arithmetic, SquaredLogp, loss_type=loss_type, **extra)
        theirs = GRPOTrainer.compute_loss(trainer, trainer.model, _without_row(out)).detach()
        view = trainer._loss_inputs(out)
        t = out["completion_ids"].shape[1]
        ours = view.aggregate(-out["advantages"].unsqueeze(1).expand(-1, t))
        assert ours.item() == pytest.approx(theirs.item(), rel=1e-5, abs=1e-8), loss_type
    with pytest.raises(ValueError, match="unknown loss_type"):
        aggregate(torch.ones(2, 2), torch.ones(2, 2), "nope", 4)


class Bad(Plugin):
    """Returns broken loss weights (mode: sapo-bounds, negative, shape)."""

    mode = "sapo-bounds"

    @hookimpl
    def loss_weights(self, loss):
        b, t = loss.mask.shape
        if Bad.mode == "negative":
            return LossWeights(token=-torch.ones(b, t))
        if Bad.mode == "shape":
            return LossWeights(token=torch.ones(b, t + 1))
        return LossWeights(epsilon_high=torch.full((b,), 0.3))


class BadTerm(Plugin):
    @hookimpl
    def loss_terms(self, loss):
        return {"vector": loss.logps.sum(-1)}


@pytest.mark.parametrize(("plugin", "mode", "loss_type", "message"), [
    (Bad, "sapo-bounds", "sapo", r"epsilon_high under loss_type sapo, which has no clip bounds \(only grpo, bnpo, "
                                 r"dr_grpo, dapo, luspo, cispo do\)"),
    (Bad, "negative", "dapo", "negative token weights"),
    (Bad, "shape", "dapo", r"token weights of shape \(8, 9\), expected \(8, 8\)"),
    (BadTerm, None, "dapo", r"term 'vector' as shape \(8,\) \(expected a 0-dim tensor\)"),
])  # fmt: skip
def test_a_broken_loss_plugin_is_named_with_hook_and_step(make_trainer, arithmetic, plugin, mode, loss_type,
                                                          message):
    Bad.mode = mode
    trainer, out = _batch(make_trainer, arithmetic, plugin, loss_type=loss_type)
    key, hook = ("bad_term", "loss_terms") if plugin is BadTerm else ("bad", "loss_weights")
    with pytest.raises(PluginRuntimeError, match=rf"^plugin '{key}' returned {message} from {hook} at step 0$"):
        type(trainer).compute_loss(trainer, trainer.model, out)


def test_two_plugins_may_not_both_set_clip_bounds(make_trainer, arithmetic):
    trainer = make_trainer(plugins=[RowBounds, PassThroughLoss], reward_funcs=[answer_len], loss_type="dapo")
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    torch.manual_seed(0)
    out = trainer._generate_and_score_completions([copy.deepcopy(arithmetic[i // 4]) for i in range(8)])
    with pytest.raises(PluginRuntimeError, match="already set the clip bounds"):
        type(trainer).compute_loss(trainer, trainer.model, out)


def test_a_loss_term_trains_end_to_end_and_is_logged(make_trainer, arithmetic):
    trainer = make_trainer(plugins=[SquaredLogp], reward_funcs=[answer_len], max_steps=2,
                           gradient_accumulation_steps=2, per_device_train_batch_size=4)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2
    assert all(h["trl_credit/squared_logp/sq"] > 0 for h in logged)


def test_the_testing_kit_runs_loss_plugins_through_the_host_checks():
    from trl_credit.testing import loss_inputs, make_batch, run_loss

    batch = make_batch([1.0, 0.0, 0.0, 0.0], num_generations=4, lengths=[3, 3, 2, 1])
    loss = loss_inputs(batch, torch.tensor([1.5, -0.5, -0.5, -0.5]))
    result = run_loss(SquaredLogp, loss)
    assert result.weights is None and set(result.terms) == {"sq"}
    assert result.terms["sq"].item() == pytest.approx(0.3)  # every row's mean log-prob is -1
    (grad,) = torch.autograd.grad(result.terms["sq"], loss.logps)
    # d/dl of 0.3 * mean_rows(mean_tokens(l)^2) = 0.3 * 2 * (-1) / (rows * tokens_in_row) on masked tokens
    expected = -0.6 / 4 / batch.completion_mask.float().sum(-1, keepdim=True) * batch.completion_mask.float()
    assert torch.allclose(grad, expected)
    Bad.mode = "sapo-bounds"
    with pytest.raises(PluginRuntimeError, match="epsilon_high under loss_type sapo"):
        run_loss(Bad, loss_inputs(batch, torch.zeros(4), loss_type="sapo"))


class LogsInLoss(Plugin):
    @hookimpl
    def loss_weights(self, loss):
        self.log_metric(loss.batch, "rows_seen", float(loss.rows.numel()))
        return None


def test_metrics_logged_in_loss_hooks_reach_the_training_logs(make_trainer):
    trainer = make_trainer(plugins=[LogsInLoss], reward_funcs=[answer_len], max_steps=2,
                           gradient_accumulation_steps=2, per_device_train_batch_size=4)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["trl_credit/logs_in_loss/rows_seen"] for h in logged] == [4.0, 4.0]  # per micro-batch, averaged


def test_check_plugin_runs_the_loss_hooks_through_the_host_checks():
    from trl_credit.testing import check_plugin

    check_plugin(SquaredLogp)
    Bad.mode = "negative"
    with pytest.raises(AssertionError, match="negative token weights"):
        check_plugin(Bad)
