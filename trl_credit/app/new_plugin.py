"""``trl-credit new-plugin NAME``: a plugin package skeleton whose generated tests pass."""

from __future__ import annotations

import re
from pathlib import Path

PYPROJECT = '''[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "trl-credit-{dist}"
version = "0.1.0"
description = "{title}: a trl-credit plugin"
readme = "README.md"
requires-python = ">=3.10"
dependencies = ["trl-credit"]

[project.entry-points.trl_credit]
{name} = "trl_credit_{module}:{cls}"

[tool.setuptools.packages.find]
where = ["src"]
'''

MODULE = '''"""{title}.

Method: one paragraph on what the method changes in GRPO and why.

Formula (paper notation)::

    A_i = (r_i - mean_g r) * scale

Source: <paper, arXiv id>; <official code path@commit> or "reconstructed from the abstract".
Defaults: ``scale`` = 1.0 (<where the default comes from>).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from trl_credit import hookimpl


class {cls}:
    """{title}: scale the group-centred reward (replace with your method's one-line summary)."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        scale: float = Field(1.0, gt=0, description="multiplier on the centred reward")

    def __init__(self, config: Config | None = None):
        self.config = config or self.Config()

    @hookimpl
    def compute_advantages(self, batch):
        import torch

        rewards = batch.grouped(torch.nan_to_num(batch.total_reward(), nan=0.0))
        centred = rewards - rewards.mean(dim=1, keepdim=True)
        batch.log_metric("scale", self.config.scale)
        return (centred * self.config.scale).reshape(-1)
'''

TEST = '''import pytest
import torch

from trl_credit.testing import check_plugin, make_batch, run_plugin
from trl_credit_{module} import {cls}


def test_formula_vector():
    batch = make_batch([1, 0, 0, 0, 1, 1, 0, 0], num_generations=4)
    result = run_plugin({cls}, batch, {{"scale": 2.0}})
    expected = torch.tensor([1.5, -0.5, -0.5, -0.5, 1.0, 1.0, -1.0, -1.0])
    torch.testing.assert_close(result.advantages, expected)
    assert result.metrics["{name}/scale"] == 2.0


def test_constant_group_gets_zero():
    result = run_plugin({cls}, make_batch([1, 1, 1, 1], num_generations=4))
    assert torch.equal(result.advantages, torch.zeros(4))


def test_bad_option_is_rejected():
    with pytest.raises(Exception, match="scale"):
        run_plugin({cls}, make_batch([1, 0], num_generations=2), {{"scale": -1}})


def test_contract():
    check_plugin({cls})
'''

README = '''# trl-credit-{dist}

{title} as a [trl-credit](https://pypi.org/project/trl-credit/) plugin.

- Paper: <title, arXiv id>
- Formula: `A_i = (r_i - mean_g r) * scale` (provenance: official code path, or reconstructed from the abstract)
- Hook: `compute_advantages`

| option | type | default | meaning |
|---|---|---|---|
| `scale` | float > 0 | 1.0 | multiplier on the centred reward |

```yaml
plugins:
  - {{name: {name}, scale: 1.0}}
```
'''


def new_plugin(name: str, parent: Path) -> Path:
    """Write ``parent/trl-credit-<name>/`` and return its path (refuses to overwrite)."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name.replace("-", "_")):
        raise ValueError(f"plugin name {name!r}: use lowercase letters, digits and underscores")
    module = name.replace("-", "_")
    dist = module.replace("_", "-")
    cls = "".join(part.capitalize() for part in module.split("_"))
    title = " ".join(part.capitalize() for part in module.split("_"))
    root = Path(parent) / f"trl-credit-{dist}"
    if root.exists():
        raise FileExistsError(f"{root} exists; choose another name or remove it")
    values = dict(name=module, module=module, dist=dist, cls=cls, title=title)
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
