"""``trl-credit new-plugin NAME``: a plugin package skeleton whose generated tests pass."""

from __future__ import annotations

import re
from pathlib import Path

PYPROJECT = '''[build-system]
requires = ["setuptools>=77,<85"]
build-backend = "setuptools.build_meta"

[project]
name = "trl-credit-{dist}"
version = "0.1.0"
description = "{title}: a trl-credit plugin"
readme = "README.md"
requires-python = ">=3.10"
dependencies = ["{host_requirement}"]

[project.entry-points.trl_credit]
{name} = "trl_credit_{module}:{cls}"

[tool.setuptools.packages.find]
where = ["src"]
'''

MODULE = '''"""{title}.

Method: one paragraph on what the method changes in GRPO and why.

Formula (paper notation)::

    {formula}

Source: <paper, arXiv id>; <official code path@commit> or "reconstructed from the abstract".
Defaults: ``{option}`` = {default} (<where the default comes from>).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from trl_credit import Plugin, hookimpl


class {cls}(Plugin):
    """{title}: {summary} (replace with your method's one-line summary)."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        {option}: float = Field({default}, {bound}, description="{option_help}")

    @hookimpl
{body}'''

#: per hook: (formula, summary, option, default, pydantic bound, option help, hook body, test of values)
HOOK_TEMPLATES = {
    "shape_rewards": (
        "r'_ik = scale * r_ik", "scale every reward column", "scale", "2.0", "gt=0", "multiplier on the rewards",
        '''    def shape_rewards(self, batch):
        self.log_metric(batch, "scale", self.config.scale)
        return batch.rewards * self.config.scale
''',
        '''def test_formula_vector():
    result = run_plugin({cls}, make_batch([1, 0, 0.5, 0], num_generations=2), {{"scale": 2.0}})
    torch.testing.assert_close(result.rewards, torch.tensor([[2.0], [0.0], [1.0], [0.0]]))
    assert result.metrics["{name}/scale"] == 2.0
'''),
    "filter_rollouts": (
        "keep group g  <=>  mean_g r >= low", "drop groups whose mean reward is below low", "low", "0.25",
        "ge=0", "smallest group mean reward kept",
        '''    def filter_rollouts(self, batch):
        import torch

        mean = batch.grouped(torch.nan_to_num(batch.total_reward(), nan=0.0)).mean(dim=1)
        return mean >= self.config.low
''',
        '''def test_formula_vector():
    result = run_plugin({cls}, make_batch([1, 0, 0, 0, 0, 0, 0, 0], num_generations=4), {{"low": 0.25}})
    assert result.keep.tolist() == [True] * 4 + [False] * 4
    assert torch.all(result.advantages[4:] == 0)
'''),
    "compute_advantages": (
        "A_i = (r_i - mean_g r) * scale", "scale the group-centred reward", "scale", "1.0", "gt=0",
        "multiplier on the centred reward",
        '''    def compute_advantages(self, batch):
        import torch

        # a row no reward function scored is out of the mean and gets 0, as in TRL (check_plugin asserts it)
        scored = batch.grouped(batch.scorable).float()
        rewards = batch.grouped(torch.nan_to_num(batch.total_reward(), nan=0.0)) * scored
        mean = rewards.sum(dim=1, keepdim=True) / scored.sum(dim=1, keepdim=True).clamp(min=1)
        centred = (rewards - mean) * scored
        self.log_metric(batch, "scale", self.config.scale)
        return (centred * self.config.scale).reshape(-1)
''',
        '''def test_formula_vector():
    batch = make_batch([1, 0, 0, 0, 1, 1, 0, 0], num_generations=4)
    result = run_plugin({cls}, batch, {{"scale": 2.0}})
    expected = torch.tensor([1.5, -0.5, -0.5, -0.5, 1.0, 1.0, -1.0, -1.0])
    torch.testing.assert_close(result.advantages, expected)
    assert result.metrics["{name}/scale"] == 2.0
'''),
    "transform_advantages": (
        "A'_i = min(A_i, ceiling)", "cap the advantages from above", "ceiling", "0.0", "ge=-100",
        "upper bound on the advantages",
        '''    def transform_advantages(self, batch, advantages):
        return advantages.clamp(max=self.config.ceiling)
''',
        '''def test_formula_vector():
    result = run_plugin({cls}, make_batch([1, 0, 0, 0], num_generations=4), {{"ceiling": 0.0}})
    grpo = run_plugin("grpo", make_batch([1, 0, 0, 0], num_generations=4)).advantages
    torch.testing.assert_close(result.advantages, grpo.clamp(max=0.0))
    assert result.advantages[0] == 0 and result.advantages[1] < 0
'''),
    "kl_coefficient": (
        "beta = base * (1 - mean_i r_i)", "less KL as accuracy rises", "base", "0.04", "ge=0",
        "beta at zero accuracy",
        '''    def kl_coefficient(self, batch):
        import torch

        accuracy = float(torch.nan_to_num(batch.total_reward(), nan=0.0).mean())
        return self.config.base * (1.0 - accuracy)
''',
        '''def test_formula_vector():
    result = run_plugin({cls}, make_batch([1, 0, 0, 0], num_generations=4), {{"base": 0.04}})
    assert result.beta == pytest.approx(0.03)
'''),
    "loss_weights": (
        "w_it = negative_weight if A_i < 0 else 1", "weight the loss of negative-advantage tokens", "negative_weight",
        "0.5", "ge=0", "loss weight of the tokens of completions with a negative advantage",
        '''    def loss_weights(self, loss):
        import torch

        from trl_credit import LossWeights

        negative = (loss.sequence_advantages < 0).unsqueeze(1).expand_as(loss.mask)
        return LossWeights(token=torch.where(negative, self.config.negative_weight, 1.0).to(loss.mask.dtype))
''',
        '''def test_formula_vector():
    from trl_credit.testing import loss_inputs, run_loss

    batch = make_batch([1, 0, 0, 0], num_generations=4, lengths=[2, 2, 2, 2])
    result = run_loss({cls}, loss_inputs(batch, torch.tensor([1.5, -0.5, -0.5, -0.5])), {{"negative_weight": 0.5}})
    torch.testing.assert_close(result.weights.token, torch.tensor([[1.0, 1.0]] + [[0.5, 0.5]] * 3))
'''),
    "loss_terms": (
        "L += coef * aggregate(logp_it ** 2)", "a log-prob anchor term", "coef", "0.01", "ge=0",
        "weight of the term",
        '''    def loss_terms(self, loss):
        return {{"anchor": self.config.coef * loss.aggregate(loss.logps**2)}}
''',
        '''def test_formula_vector():
    from trl_credit.testing import loss_inputs, run_loss

    batch = make_batch([1, 0, 0, 0], num_generations=4, lengths=[2, 1, 2, 1])
    loss = loss_inputs(batch, torch.zeros(4))  # log-probs -1 on every token, dapo: masked sum / 6 tokens
    result = run_loss({cls}, loss, {{"coef": 0.5}})
    assert result.terms["anchor"].item() == pytest.approx(0.5)
    (grad,) = torch.autograd.grad(result.terms["anchor"], loss.logps)
    torch.testing.assert_close(grad, 0.5 * 2 * -1.0 / 6 * batch.completion_mask.float())
'''),
    "augment_rollouts": (
        "all_i r_gi < threshold  =>  G more completions of 'prompt + hint'", "re-sample all-fail groups with a hint",
        "threshold", "0.5", "ge=0", "a completion fails below this reward",
        '''    def augment_rollouts(self, batch):
        from trl_credit import Augmentation

        rewards = batch.grouped(batch.total_reward().nan_to_num(0.0))
        failed = (rewards < self.config.threshold).all(dim=1).nonzero().squeeze(1).tolist()
        return [Augmentation(g, str(batch.prompts[g * batch.num_generations]) + " Think step by step.",
                             context="hint") for g in failed]
''',
        '''def test_formula_vector():
    from trl_credit.testing import plugin_set

    plugin = plugin_set({cls}, {{"threshold": 0.5}}).plugins[0].instance
    requests = plugin.augment_rollouts(make_batch([0, 0, 1, 0], num_generations=2))
    assert [r.group for r in requests] == [0] and requests[0].prompt == "prompt 0 Think step by step."
'''),
    "prompt_weights": (
        "w_x = 1 + bonus * 1[x never seen]", "favour prompts not seen yet", "bonus", "1.0", "ge=0",
        "extra weight of an unseen prompt",
        '''    def prompt_weights(self, stats, step):
        return 1.0 + self.config.bonus * (stats.seen == 0).double()
''',
        '''def test_formula_vector():
    from trl_credit import PromptStats
    from trl_credit.testing import run_curriculum

    stats = PromptStats.empty(3)
    stats.update(torch.tensor([0, 0]), torch.tensor([1.0, 0.0]), step=0)
    weights = run_curriculum({cls}, stats, {{"bonus": 1.0}})
    torch.testing.assert_close(weights, torch.tensor([0.2, 0.4, 0.4], dtype=torch.float64))
'''),
    "on_batch_end": (
        "logs mean_i |A_i| * factor", "log the mean absolute advantage", "factor", "1.0", "gt=0",
        "multiplier on the logged value",
        '''    def on_batch_end(self, batch, advantages):
        self.log_metric(batch, "mean_abs_advantage", float(advantages.abs().mean()) * self.config.factor)
''',
        '''def test_formula_vector():
    result = run_plugin({cls}, make_batch([1, 0], num_generations=2), {{"factor": 1.0}})
    assert result.metrics["{name}/mean_abs_advantage"] == pytest.approx(float(result.advantages.abs().mean()))
'''),
}

TEST = '''import pytest
import torch

from trl_credit import ConfigError
from trl_credit.testing import check_plugin, make_batch, run_plugin
from trl_credit_{module} import {cls}


{test}

def test_bad_option_is_rejected():
    with pytest.raises(ConfigError, match="option '{option}'"):
        run_plugin({cls}, make_batch([1, 0], num_generations=2), {{"{option}": -1e10}})


def test_contract():
    check_plugin({cls})
'''

README = '''# trl-credit-{dist}

{title} as a [trl-credit](https://pypi.org/project/trl-credit/) plugin.

- Paper: <title, arXiv id>
- Formula: `{formula}` (provenance: official code path, or reconstructed from the abstract)
- Hook: `{hook}`

| option | type | default | meaning |
|---|---|---|---|
| `{option}` | float | {default} | {option_help} |

```yaml
plugins:
  - {{name: {name}, {option}: {default}}}
```
'''


HOOK_CHOICES = tuple(HOOK_TEMPLATES)


def host_requirement() -> str:
    """``trl-credit>=X.Y,<X.(Y+1)``: the host range a new plugin pins (this host's minor version)."""
    from trl_credit import __version__

    major, minor = (int(x) for x in __version__.split(".")[:2])
    return f"trl-credit>={major}.{minor},<{major}.{minor + 1}"


def new_plugin(name: str, parent: Path, hook: str = "compute_advantages") -> Path:
    """Write ``parent/trl-credit-<name>/`` with a skeleton for ``hook`` and return its path (refuses to overwrite).

    The skeleton's module implements a toy formula on that hook and its tests assert its values.
    """
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name.replace("-", "_")):
        raise ValueError(f"plugin name {name!r}: use lowercase letters, digits and underscores")
    if hook not in HOOK_TEMPLATES:
        raise ValueError(f"--hook {hook!r}: choose one of {', '.join(HOOK_CHOICES)}")
    module = name.replace("-", "_")
    dist = module.replace("_", "-")
    cls = "".join(part.capitalize() for part in module.split("_"))
    title = " ".join(part.capitalize() for part in module.split("_"))
    root = Path(parent) / f"trl-credit-{dist}"
    if root.exists():
        raise FileExistsError(f"{root} exists; choose another name or remove it")
    formula, summary, option, default, bound, option_help, body, test = HOOK_TEMPLATES[hook]
    values = dict(name=module, module=module, dist=dist, cls=cls, title=title, hook=hook, formula=formula,
                  summary=summary, option=option, default=default, bound=bound, option_help=option_help,
                  host_requirement=host_requirement())
    values["body"] = body.format(**values)
    values["test"] = test.format(**values)
    files = {
        "pyproject.toml": PYPROJECT,
        f"src/trl_credit_{module}/__init__.py": MODULE,
        f"tests/test_{module}.py": TEST,
        "README.md": README,
    }
    for rel, template in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(template.format(**values))
    return root
