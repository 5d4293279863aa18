"""Auxiliary adapters (`trl_credit.adapters`): a plugin's own LoRA adapters on the policy's base model."""

from __future__ import annotations

import zlib

import pytest
import torch
from peft import LoraConfig
from transformers import TrainerCallback

import plugins_for_tests as fx
from trl_credit import Adapter, ConfigError, Plugin, hookimpl
from trl_credit.adapters import peft_name
from trl_credit.checkpoint import STATE_FILE
from trl_credit.testing import make_batch, run_plugin, train_tiny

LORA = dict(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)


def parity_reward(completions, **kwargs):
    """Half-random 0/1 outcomes, a deterministic function of the text (so labels are not constant)."""
    return [float(zlib.crc32(c[-1]["content"].encode()) % 2) for c in completions]


def lora_weights(trainer, adapter):
    model = trainer.accelerator.unwrap_model(trainer.model)
    return {n.replace(f".{adapter}.", "."): p.detach().clone() for n, p in model.named_parameters()
            if f".{adapter}." in n}


def train(plugins, tmp_path, **kw):
    kw.setdefault("max_steps", 2)
    return train_tiny(plugins, output_dir=tmp_path, reward_funcs=[parity_reward], peft_config=LoraConfig(**LORA),
                      learning_rate=1e-2, **kw)


PRM = peft_name("adapter:aux_prm/prm")


def test_the_auxiliary_update_leaves_the_policy_exactly_as_a_run_without_it(tmp_path):
    with_aux = train([{"name": fx.AuxPRM}], tmp_path / "a")
    without = train([{"name": fx.AuxPRM, "update": False}], tmp_path / "b")  # same scoring, no update
    plain = train([fx.Passthrough], tmp_path / "c")
    policy = [lora_weights(t, "default") for t in (with_aux, without, plain)]
    initial = train([fx.Passthrough], tmp_path / "d", train=False)
    assert policy[0].keys() == policy[2].keys() and len(policy[0]) > 0
    for name in policy[0]:
        assert torch.equal(policy[0][name], policy[1][name]) and torch.equal(policy[0][name], policy[2][name]), name
    assert any(not torch.equal(policy[0][n], p) for n, p in lora_weights(initial, "default").items())  # it trained
    aux = lora_weights(with_aux, PRM)
    assert any(not torch.equal(aux[n], p) for n, p in lora_weights(without, PRM).items())  # the PRM was trained
    plugin = with_aux.credit_plugins.plugins[0].instance
    assert [result["loss"] > 0 for _, result, _ in plugin.seen] == [True, True]
    # a fresh adapter starts as the base model: its first scores are the reference's
    assert torch.allclose(plugin.seen[0][0], without.credit_plugins.plugins[0].instance.seen[0][0])
    # TRL's optimiser holds the policy's weights only
    held = {id(p) for group in with_aux.optimizer.param_groups for p in group["params"]}
    model = with_aux.accelerator.unwrap_model(with_aux.model)
    assert all((id(p) in held) == (".default." in n) for n, p in model.named_parameters() if "lora_" in n)
    logs = with_aux.state.log_history[0]
    assert logs["trl_credit/aux_prm/prm_loss"] > 0 and logs["trl_credit/cost/aux_prm/prm_update_seconds"] > 0
    assert logs["trl_credit/cost/aux_prm/prm_score_seconds"] > 0 and logs["trl_credit/cost/generation_seconds"] > 0


def test_the_step_minimises_the_mean_loss_computed_on_the_scores_with_grad(tmp_path):
    """The with-grad pass under the adapter gives the no-grad scores: the reported loss is the mean of
    the plugin's per-row losses at the weights before the step, and the step lowers it."""
    trainer = train([{"name": fx.AuxPRM, "lr": 1e-3}], tmp_path, max_steps=1)
    (before, result, expected), = trainer.credit_plugins.plugins[0].instance.seen
    assert result["loss"] == pytest.approx(expected, rel=1e-5) and result["grad_norm"] > 0
    # the step's own forward pass returns the pre-step scores (what PRIME rewards with, no extra pass)
    torch.testing.assert_close(result["logps"], before, rtol=1e-5, atol=1e-5)


class ViewPRM(Plugin):
    """An estimator that trains its adapter on the optimiser batch: a view of the round when a group is dropped."""

    name = "view_prm"
    seen: list = []

    def adapters(self):
        return [Adapter("prm", lr=1e-2)]

    @hookimpl
    def compute_advantages(self, batch):
        prm = self.adapter("prm")
        label = batch.total_reward().nan_to_num(0.0).clamp(0, 1)
        ref, mask = batch.ref_logps(), batch.completion_mask.float()

        def loss_fn(logps, rows):  # rows index this batch (the view), as the contract says
            score = 0.05 * ((logps - ref[rows]) * mask[rows]).sum(1)
            return torch.nn.functional.binary_cross_entropy_with_logits(score, label[rows], reduction="none")

        expected = float(loss_fn(prm.logps(batch), torch.arange(batch.num_completions)).mean())
        ViewPRM.seen.append((batch.num_completions, prm.update(batch, loss_fn)["loss"], expected))
        return torch.zeros(batch.num_completions)


@pytest.mark.parametrize("where", ["trainer", "kit"])
def test_an_update_on_a_view_passes_the_views_own_rows(tmp_path, where):
    # two groups of four, the first dropped: the estimator sees a view of rows 4..7 and its loss indexes the view
    ViewPRM.seen = []
    if where == "trainer":
        train([{"name": ViewPRM}, fx.DropFirstGroup], tmp_path, max_steps=1)
    else:
        prm = torch.tensor([[-0.5, -0.5]] * 4 + [[-1.0, 0.0], [0.0, 0.0], [-2.0, -1.0], [-0.3, -0.1]])
        run_plugin(ViewPRM, make_batch([1, 0, 1, 0, 1, 1, 0, 0], 4, lengths=[2] * 8, adapters={"prm": prm},
                                       ref_logps=torch.zeros(8, 2)),
                   others=[fx.DropFirstGroup])
    (rows, loss, expected), = ViewPRM.seen
    assert rows == 4 and loss == pytest.approx(expected, rel=1e-5)


def test_policy_init_copies_the_policy_adapter_and_ema_follows_it(tmp_path):
    policies = []

    class Record(TrainerCallback):  # runs before the host's callback: the policy after each optimiser step
        def on_step_end(self, args, state, control, model=None, **kwargs):
            policies.append(lora_weights(trainer_ref[0], "default"))

    trainer_ref = []
    trainer = train([{"name": fx.AuxPRM, "init": "policy", "ema": 0.5}], tmp_path, train=False, callbacks=[Record()])
    trainer_ref.append(trainer)
    start = lora_weights(trainer, "default")
    ema0 = lora_weights(trainer, peft_name("adapter:aux_prm/ema"))
    prm0 = lora_weights(trainer, PRM)
    assert all(torch.equal(start[n], ema0[n]) and torch.equal(start[n], prm0[n]) for n in start)
    trainer.train()
    expected = start
    for policy in policies:  # w <- 0.5 w + 0.5 w_policy after every step
        expected = {n: 0.5 * expected[n] + 0.5 * policy[n] for n in expected}
    ema = lora_weights(trainer, peft_name("adapter:aux_prm/ema"))
    assert len(policies) == 2
    assert all(torch.allclose(ema[n], expected[n], atol=1e-7) for n in ema)
    assert trainer.aux_adapters.updates == {"adapter:aux_prm/prm": 2, "adapter:aux_prm/ema": 2}


def test_resume_restores_the_adapter_weights_and_optimiser(tmp_path):
    full = train([{"name": fx.AuxPRM}], tmp_path / "full", max_steps=2, save_strategy="steps", save_steps=1)
    checkpoint = tmp_path / "full" / "checkpoint-1"
    saved = torch.load(checkpoint / STATE_FILE, weights_only=True)
    entry = saved["adapters"]["adapter:aux_prm/prm"]
    assert entry["updates"] == 1 and entry["optimizer"]["state"] and len(entry["weights"]) > 0
    assert (checkpoint / PRM / "adapter_model.safetensors").exists()  # PEFT saves it too (a fixed_prm can load it)
    resumed = train([{"name": fx.AuxPRM}], tmp_path / "full", max_steps=2, save_strategy="steps", save_steps=1,
                    train=False)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    a, b = lora_weights(full, PRM), lora_weights(resumed, PRM)
    assert all(torch.allclose(a[n], b[n], atol=1e-6) for n in a)
    assert resumed.aux_adapters.updates["adapter:aux_prm/prm"] == 2
    fresh = lora_weights(train([{"name": fx.AuxPRM}], tmp_path / "x", train=False), PRM)
    assert any(not torch.allclose(fresh[n], b[n]) for n in b)


def test_resume_without_the_adapter_weights_is_refused(tmp_path):
    from trl_credit.checkpoint import CheckpointError

    train([fx.Passthrough], tmp_path, max_steps=1, save_strategy="steps", save_steps=1)
    resumed = train([{"name": fx.AuxPRM}], tmp_path, max_steps=2, train=False)
    with pytest.raises(CheckpointError, match=r"no weights for the auxiliary adapter\(s\) adapter:aux_prm/prm"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))


def test_qlora_on_cpu_trains_the_auxiliary_adapter_on_the_4bit_base(tmp_path):
    from transformers import BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    trainer = train([{"name": fx.AuxPRM}], tmp_path, model_init_kwargs={"quantization_config": quant})
    model = trainer.accelerator.unwrap_model(trainer.model)
    assert any("Linear4bit" in type(m).__name__ for m in model.modules())
    plugin = trainer.credit_plugins.plugins[0].instance
    assert all(torch.isfinite(torch.tensor(r["loss"])) for _, r, _ in plugin.seen)
    assert not torch.equal(plugin.seen[0][0], plugin.seen[1][0])  # the second batch is scored by the updated PRM
    assert trainer.aux_adapters.updates["adapter:aux_prm/prm"] == 2


def test_without_peft_the_run_is_refused_before_the_model_loads(tmp_path):
    with pytest.raises(ConfigError, match=r"plugins\[0\] \(aux_prm\) owns the auxiliary adapter\(s\) 'prm'.*"
                                          r"use_peft: true"):
        train_tiny([{"name": fx.AuxPRM}], output_dir=tmp_path, train=False)


def test_declarations_are_checked():
    with pytest.raises(ValueError, match="adapter name 'PRM'"):
        Adapter("PRM")
    with pytest.raises(ValueError, match="ema_decay must be in"):
        Adapter("ema", ema_decay=1.0)

    class Twice(Plugin):
        name = "twice"

        def adapters(self):
            return [Adapter("a"), Adapter("a")]

        @hookimpl
        def shape_rewards(self, batch):
            return None

    with pytest.raises(ConfigError, match="declares the same name twice"):
        run_plugin(Twice, make_batch([1, 0], 2))


def test_the_kit_records_updates_with_the_gradient_of_the_mean_loss():
    class Uses(Plugin):
        name = "uses"

        def adapters(self):
            return [Adapter("prm")]

        @hookimpl
        def shape_rewards(self, batch):
            prm = self.adapter("prm")
            score = prm.logps(batch).sum(1)
            prm.update(batch, lambda logps, rows: (logps.sum(1) - 1.0) ** 2)
            return {"score": score}

    prm = torch.tensor([[-0.5, -0.5], [-1.0, 0.0], [0.0, 0.0], [-2.0, -1.0]])
    result = run_plugin(Uses, make_batch([1, 0, 1, 0], 2, lengths=[2] * 4, adapters={"prm": prm}))
    update, = result.adapter_updates
    assert torch.allclose(update.losses, torch.tensor([4.0, 4.0, 1.0, 16.0]))
    assert update.loss == pytest.approx(6.25)
    assert torch.equal(result.batch.root.scorer.adapter_updates[0].rows, torch.arange(4))
    # d/dlogps of mean_i (sum_t l_it - 1)^2 = 2 (s_i - 1) / N on every token of row i
    assert torch.allclose(update.grad, torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-0.5, -0.5], [-2.0, -2.0]]))
    assert result.metrics["uses/prm_loss"] == pytest.approx(6.25)
    with pytest.raises(KeyError, match="has no adapter 'other'"):
        result.plugin.adapter("other")
