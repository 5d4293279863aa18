"""The declared plugin contract: `trl_credit.Plugin`, check_args before the model loads, the public API,
near-miss names, option suggestions, the core/application split, host pins of the plugins."""

from __future__ import annotations

import ast
import re
import textwrap
import tomllib
from pathlib import Path

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field

import trl_credit
from trl_credit import ConfigError, Plugin, Refill, hookimpl
from trl_credit.app import cli
from trl_credit.config import build_plugins
from trl_credit.plugins import available
from trl_credit.testing import check_plugin, make_batch, run_plugin, tiny_dataset, tiny_model_path

ROOT = Path(__file__).resolve().parent.parent
PLUGIN_DIRS = sorted(p for p in (ROOT / "plugins").iterdir() if (p / "pyproject.toml").exists())


def _entry_points(plugin_dir: Path) -> list[tuple[str, str]]:
    """The package's plugins: one per method, or several keys of one method (TACO's `taco` and `taco_probe`)."""
    data = tomllib.loads((plugin_dir / "pyproject.toml").read_text())
    points = list(data["project"]["entry-points"]["trl_credit"].items())
    assert points, f"{plugin_dir.name} declares no trl_credit entry point"
    return points


# ---------------------------------------------------------------- the base class


@pytest.mark.parametrize("plugin_dir", PLUGIN_DIRS, ids=lambda p: p.name)
def test_every_plugin_in_this_repository_subclasses_plugin(plugin_dir):
    for name, value in _entry_points(plugin_dir):
        cls = available()[name].load()
        assert issubclass(cls, Plugin), f"{value} must subclass trl_credit.Plugin"
        assert f"{cls.__module__}:{cls.__qualname__}" == value


def test_plugin_defaults_do_nothing_and_plain_classes_keep_working():
    class Plain:
        """A plain class: no base, no Config."""

        @hookimpl
        def transform_advantages(self, batch, advantages):
            return advantages * 2

    class Based(Plugin):
        """Same through the base class."""

        @hookimpl
        def transform_advantages(self, batch, advantages):
            return advantages * 2

    batch = [1, 0, 0, 0]
    plain = run_plugin(Plain, make_batch(batch, 4)).advantages
    based = run_plugin(Based, make_batch(batch, 4)).advantages
    assert torch.equal(plain, based) and plain[0] > 0
    plugins = build_plugins([Based, Plain])
    assert [p.members.refill for p in plugins.plugins] == [None, None]
    assert not any(p.members.stateful for p in plugins.plugins)
    assert isinstance(plugins.plugins[0].config, Based.Config)


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    lambda_: float = Field(0.5, alias="lambda", description="a keyword-named option")
    window: int = Field(4, description="steps")


def test_unknown_option_gets_a_did_you_mean():
    class Windowed(Plugin):
        """Options with an alias."""

        Config = _Options

        @hookimpl
        def on_batch_end(self, batch, advantages):
            pass

    with pytest.raises(ConfigError) as err:
        build_plugins([{"name": Windowed, "windw": 3}])
    message = str(err.value)
    assert "option 'windw': unknown option; did you mean 'window'?" in message
    assert "lambda" in message and "lambda_" not in message  # options listed under their YAML keys
    plugins = build_plugins([{"name": Windowed, "lambda": 0.25}])
    assert plugins.plugins[0].config.lambda_ == 0.25


def test_listing_shows_keyword_options_under_the_yaml_key(capsys):
    assert cli.main(["plugins", "show", "drpo", "--json"]) == 0
    import json

    config = json.loads(capsys.readouterr().out)["config"]
    assert "lambda" in config and "lambda_" not in config


@pytest.mark.parametrize("method, expected", [
    ("filter_rollout", "did you mean the hook 'filter_rollouts'?"),
    ("stat_dict", "did you mean the plugin member 'state_dict'?"),
    ("check_arg", "did you mean the plugin member 'check_args'?"),
    ("shape_rewards", "named like a hook but is not marked @trl_credit.hookimpl"),
])
def test_near_miss_members_are_refused_at_registration(method, expected):
    def body(self, *args):
        return None

    cls = type("Misspelt", (Plugin,), {"__doc__": "x", method: body,
                                       "on_batch_end": hookimpl(lambda self, batch, advantages: None)})
    with pytest.raises(ConfigError, match=re.escape(expected)):
        build_plugins([cls])
    with pytest.raises(AssertionError, match=re.escape(expected)):
        check_plugin(cls)


def test_refill_is_declared_not_read_off_an_option():
    class HasRefillOption(Plugin):
        """A filter whose Config has `refill: true` but which declares no refill: no refill."""

        class Config(BaseModel):
            model_config = ConfigDict(extra="forbid")
            refill: bool = Field(True, description="an option that merely has the name")

        @hookimpl
        def filter_rollouts(self, batch):
            return None

    class Declares(HasRefillOption):
        """Declares refill."""

        def refill(self):
            return Refill(max_rounds=2, max_tokens=100)

    from trl_credit.pipeline import Pipeline

    assert Pipeline(build_plugins([HasRefillOption])).max_refill_rounds == 0
    pipeline = Pipeline(build_plugins([Declares, {"name": Declares, "refill": True}]))
    assert (pipeline.max_refill_rounds, pipeline.max_refill_tokens) == (2, 100)

    class RefillWithoutFilter(Plugin):
        """Asks for refill but filters nothing."""

        def refill(self):
            return Refill()

        @hookimpl
        def on_batch_end(self, batch, advantages):
            pass

    with pytest.raises(ConfigError, match="no active filter_rollouts hook"):
        build_plugins([RefillWithoutFilter])


# ---------------------------------------------------------------- check_args before the model loads


class _NeedsGrpoLoss(Plugin):
    """Refuses every loss type but grpo."""

    @hookimpl
    def compute_advantages(self, batch):
        return torch.zeros(batch.num_completions)

    def check_args(self, run):
        if run.args.loss_type != "grpo":
            raise ConfigError.for_key("loss_type", f"needs 'grpo', got {run.args.loss_type!r}",
                                      "set `loss_type: grpo`")


def test_check_args_runs_in_the_trainer_before_the_model_loads(tmp_path, monkeypatch):
    import transformers

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the configuration was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_load)
    from trl import GRPOConfig

    from trl_credit import CreditGRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, report_to="none",
                      use_cpu=True, bf16=False, loss_type="dapo")
    with pytest.raises(ConfigError) as err:
        CreditGRPOTrainer(model=tiny_model_path(), reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                          args=args, train_dataset=tiny_dataset(8), plugins=[_NeedsGrpoLoss])
    assert "plugins[0] (needs_grpo_loss): loss_type: needs 'grpo', got 'dapo'; fix: set `loss_type: grpo`" \
        in str(err.value)


def _validate(tmp_path, capsys, body: str) -> tuple[int, str]:
    path = tmp_path / "run.yaml"
    path.write_text(textwrap.dedent(body))
    code = cli.main(["validate", str(path)])
    return code, capsys.readouterr().err


#: (plugins entry and trl keys that the plugin refuses, the text its error must hold)
REFUSED = [
    ("plugins: [drpo]\nloss_type: dapo\n", ["(drpo)", "loss_type", "fix"]),
    ("plugins: [{name: riskpo, bundle_size: 3}]\nper_device_train_batch_size: 8\nnum_generations: 4\n",
     ["(riskpo)", "bundle_size", "fix"]),
    ("plugins: [gtpo]\nloss_type: dapo\n", ["(gtpo)", "loss_type", "fix"]),
    ("plugins: [balanced_aggregation]\nloss_type: bnpo\n", ["(balanced_aggregation)", "loss_type", "fix"]),
    ("plugins: [balanced_aggregation, dynamic_sampling]\nloss_type: grpo\nper_device_train_batch_size: 8\n"
     "num_generations: 4\n",
     ["(balanced_aggregation)", "dynamic_sampling", "fix"]),
    ("plugins: [{name: riskpo, bundle_size: 2}, dynamic_sampling]\n", ["(riskpo)", "dynamic_sampling", "fix"]),
    ("plugins: [fg_expo]\nbeta: 0.0\nuse_peft: false\n", ["(fg_expo)", "beta", "use_peft"]),
]


@pytest.mark.parametrize("body, expected", REFUSED, ids=[e[0][0] for e in REFUSED])
def test_validate_rejects_what_a_plugin_cannot_run_with(tmp_path, capsys, body, expected):
    code, err = _validate(tmp_path, capsys, textwrap.dedent(f"""\
        model_name_or_path: no-such-model-is-loaded
        dataset_name: "arithmetic:n=16"
        use_cpu: true
        output_dir: {tmp_path}/out
        """) + body)
    assert code == 2, err
    for text in expected:
        assert text in err, err


# ---------------------------------------------------------------- the public API


def test_every_public_name_resolves():
    for name in trl_credit.__all__:
        assert getattr(trl_credit, name) is not None
    import trl_credit.testing as kit

    for name in kit.__all__:
        assert getattr(kit, name) is not None


def _host_imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every import of trl_credit in a file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "trl_credit":
            found.append((node.lineno, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names if a.name.split(".")[0] == "trl_credit"]
    return found


@pytest.mark.parametrize("plugin_dir", PLUGIN_DIRS, ids=lambda p: p.name)
def test_plugins_import_only_the_public_api(plugin_dir):
    import trl_credit.testing as kit

    bad = []
    for path in sorted(plugin_dir.rglob("*.py")):
        if "build" in path.parts:
            continue
        for line, module, names in _host_imports(path):
            rel = f"{path.relative_to(ROOT)}:{line}"
            if module == "trl_credit":
                bad += [f"{rel}: trl_credit.{n} is not public" for n in names if n not in trl_credit.__all__]
            elif module == "trl_credit.testing" and "tests" in path.parts:
                bad += [f"{rel}: trl_credit.testing.{n} is not in the kit" for n in names if n not in kit.__all__]
            else:
                bad.append(f"{rel}: imports {module} (only `trl_credit` and, in tests, `trl_credit.testing`)")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("plugin_dir", PLUGIN_DIRS, ids=lambda p: p.name)
def test_plugins_pin_a_compatible_host_range(plugin_dir):
    deps = tomllib.loads((plugin_dir / "pyproject.toml").read_text())["project"]["dependencies"]
    host = [d for d in deps if re.match(r"trl-credit\b", d)]
    major, minor = (int(x) for x in trl_credit.__version__.split(".")[:2])
    # this host's minor series; a plugin that needs a newer patch (an API added in it) pins that patch
    assert len(host) == 1 and re.fullmatch(rf"trl-credit>={major}\.{minor}(\.\d+)?,<{major}\.{minor + 1}", host[0]), host


def test_every_package_builds_with_the_setuptools_the_install_pins():
    """The README installs the plugins with ``--no-build-isolation``, i.e. with the environment's setuptools, which
    its first install pins: every package (host, plugins, the ``new-plugin`` skeleton) declares that same range."""
    from trl_credit.app.new_plugin import PYPROJECT

    readme = (ROOT / "README.md").read_text()
    pinned = set(re.findall(r'pip install torch==[\d.]+ "(setuptools[^"]+)"', readme))
    assert len(pinned) == 1 and readme.count("--no-build-isolation ./plugins/*/") == 2, pinned
    requires = {str(p.relative_to(ROOT)): tomllib.loads(p.read_text())["build-system"]["requires"]
                for p in [ROOT / "pyproject.toml", *(d / "pyproject.toml" for d in PLUGIN_DIRS)]}
    requires["new-plugin skeleton"] = tomllib.loads(PYPROJECT.format(dist="x", title="x", host_requirement="x",
                                                                     name="x", module="x", cls="X"))["build-system"]["requires"]
    bad = {k: v for k, v in requires.items() if v != sorted(pinned)}
    assert not bad, bad


def test_host_version_matches_pyproject():
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"] == trl_credit.__version__


def test_the_core_never_imports_the_application():
    core = [p for p in (ROOT / "trl_credit").rglob("*.py") if "app" not in p.relative_to(ROOT / "trl_credit").parts]
    bad = [f"{p.relative_to(ROOT)}:{line}: {module}" for p in core for line, module, _ in _host_imports(p)
           if module.startswith("trl_credit.app")]
    assert not bad, "\n".join(bad)
    assert len(core) >= 15
