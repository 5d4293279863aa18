"""The CLI: listing, validation errors, the new-plugin skeleton (installed and tested), install."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trl_credit.app import cli

ROOT = Path(__file__).resolve().parent.parent


def run(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def write(tmp_path, text: str, name="cfg.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_plugins_lists_hooks_and_options_as_json(capsys):
    code, out, _ = run(capsys, "plugins", "--json", "--all")
    entries = {e["name"]: e for e in json.loads(out)}
    assert code == 0
    assert entries["grpo"]["hooks"] == ["compute_advantages"] and entries["grpo"]["builtin"]
    assert set(entries["grpo"]["config"]) == {"scale_rewards", "multi_objective_aggregation"}
    code, out, _ = run(capsys, "plugins", "--json")
    assert "grpo" not in {e["name"] for e in json.loads(out)}  # built-ins are hidden unless asked


def test_plugins_show(capsys):
    code, out, _ = run(capsys, "plugins", "show", "grpo")
    assert code == 0 and "hooks: compute_advantages" in out and "scale_rewards:" in out
    code, _, err = run(capsys, "plugins", "show", "grpoo")
    assert code == 2 and "Did you mean 'grpo'?" in err


def test_validate_accepts_the_quickstart(capsys):
    code, out, _ = run(capsys, "validate", str(ROOT / "examples" / "quickstart.yaml"))
    assert code == 0 and "OK" in out


@pytest.mark.parametrize("body, expected", [
    ("plugins: [grpoo]\n", "plugins[0] (grpoo): no plugin named 'grpoo' is installed. Did you mean 'grpo'?"),
    ("plugins: [{name: grpo, scale: 1}]\n", "plugins[0] (grpo): option 'scale': unknown option"),
    ("plugins: [{name: grpo, scale_rewards: sometimes}]\n", "option 'scale_rewards': Input should be 'group'"),
    ("plugins: [grpo, grpo]\n", "two advantage estimators are enabled"),
    ("learning_rat: 0.1\n", "unknown key 'learning_rat'; did you mean 'learning_rate'?"),
    ("plugins: [grpo\n", "malformed YAML"),
    ("reward_funcs: [no_such_reward]\n", "unknown reward function 'no_such_reward'"),
])
def test_validate_reports_errors_before_any_model_load(tmp_path, capsys, body, expected):
    path = write(tmp_path, "model_name_or_path: /does/not/exist\ndataset_name: arithmetic\nuse_cpu: true\n" + body)
    code, out, err = run(capsys, "validate", path)
    assert code == 2
    assert expected in err


def test_train_override_errors_are_reported(tmp_path, capsys):
    path = write(tmp_path, "dataset_name: arithmetic\nuse_cpu: true\n")
    code, _, err = run(capsys, "validate", path, "--max_steps", "many")
    assert code == 2 and "invalid value for a TRL option: argument --max_steps/--max-steps: invalid int value: 'many'" in err
    assert "usage:" not in err


def test_bad_dataset_option_is_a_config_error(tmp_path, capsys):
    path = write(tmp_path, "dataset_name: 'arithmetic:digits=3'\nuse_cpu: true\n")
    code, _, err = run(capsys, "validate", path)
    assert code == 2 and "dataset 'arithmetic:digits=3'" in err and "digits" in err


def test_new_plugin_skeleton_installs_and_its_tests_pass(tmp_path, capsys):
    code, out, _ = run(capsys, "new-plugin", "shiny_method", "--dir", str(tmp_path))
    package = tmp_path / "trl-credit-shiny-method"
    assert code == 0 and package.is_dir()
    assert 'dependencies = ["trl-credit>=0.2,<0.3"]' in (package / "pyproject.toml").read_text()
    # installed into a folder of its own, never the shared environment: the suite's other worker (pytest-xdist)
    # lists the installed plugins meanwhile, and must not see this one
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(site),
           str(package)]
    subprocess.run(pip, check=True, capture_output=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    listed = subprocess.run([sys.executable, "-m", "trl_credit.app.cli", "plugins", "--json"], capture_output=True,
                            text=True, check=True, env=env)
    assert "shiny_method" in {e["name"] for e in json.loads(listed.stdout)}
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(package / "tests")],
                           capture_output=True, text=True, cwd=tmp_path, env=env)
    assert tests.returncode == 0, tests.stdout + tests.stderr
    assert "3 passed" in tests.stdout
    with pytest.raises(FileExistsError):
        cli.main(["new-plugin", "shiny_method", "--dir", str(tmp_path)])


def test_new_plugin_for_every_hook_writes_tests_that_assert_values_and_pass(tmp_path, capsys):
    from trl_credit.app.new_plugin import HOOK_CHOICES

    paths = []
    for hook in HOOK_CHOICES:
        code, _, _ = run(capsys, "new-plugin", f"my_{hook}", "--hook", hook, "--dir", str(tmp_path))
        assert code == 0
        package = tmp_path / f"trl-credit-my-{hook.replace('_', '-')}"
        module = (package / "src" / f"trl_credit_my_{hook}" / "__init__.py").read_text()
        assert f"def {hook}(self" in module and "@hookimpl" in module
        test = (package / "tests" / f"test_my_{hook}.py").read_text()
        assert "assert" in test.split("def test_formula_vector")[1].split("def ")[0]
        paths.append(package)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p / "src") for p in paths)}
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            *(str(p / "tests") for p in paths)], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert tests.returncode == 0, tests.stdout + tests.stderr
    assert f"{3 * len(HOOK_CHOICES)} passed" in tests.stdout


def test_install_prefers_the_monorepo_package(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(cli.subprocess, "call", lambda cmd, env=None: calls.append(cmd) or 0)
    monkeypatch.chdir(ROOT)
    assert cli.main(["install", "dynamic_sampling"]) == 0
    assert calls[-1][-2:] == ["-e", str(ROOT / "plugins" / "trl-credit-dynamic-sampling")]


def test_install_looks_a_name_up_on_the_index_before_pip_installs(monkeypatch, capsys):
    calls, looked_up = [], []

    def fake_run(cmd, **kwargs):
        looked_up.append(cmd)
        return subprocess.CompletedProcess(cmd, 0 if cmd[-1] == "trl-credit-some-method" else 1, "", "")

    monkeypatch.setattr(cli.subprocess, "call", lambda cmd, env=None: calls.append(cmd) or 0)
    monkeypatch.setattr(cli.subprocess, "run", fake_run)
    monkeypatch.chdir(ROOT)
    assert cli.main(["install", "some_method"]) == 0
    assert looked_up[-1][-3:] == ["index", "versions", "trl-credit-some-method"]
    assert calls[-1][-1] == "trl-credit-some-method"
    calls.clear()
    assert cli.main(["install", "dynamic_samplin"]) == 2  # not on the index: pip install never runs
    assert not calls and "Did you mean 'dynamic_sampling'?" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["../etc", "./plugins/trl-credit-gdpo", "gdpo==0.1", "gdpo>=1", "git+https://x/y",
                                  "a b", "-e", "--index-url=http://x", "gdpo[extra]", "", "/tmp/x"])
def test_install_refuses_anything_but_a_plugin_name(monkeypatch, capsys, name):
    calls = []
    monkeypatch.setattr(cli.subprocess, "call", lambda cmd, env=None: calls.append(cmd) or 0)
    monkeypatch.setattr(cli.subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    assert cli.main(["install", "--", name]) == 2  # "--": argparse passes even "-e" through as the name
    assert not calls and "not a plugin name" in capsys.readouterr().err


def _tiny_run(tmp_path, extra: str) -> Path:
    from trl_credit.testing import tiny_model_path

    path = tmp_path / "run.yaml"
    path.write_text(textwrap.dedent(f"""\
        model_name_or_path: {tiny_model_path()}
        use_cpu: true
        bf16: false
        num_generations: 4
        max_completion_length: 4
        max_steps: 2
        report_to: none
        save_strategy: "no"
        disable_tqdm: true
        output_dir: {tmp_path / "out"}
        """) + extra)
    return path


@pytest.mark.parametrize("extra, reason", [
    ('dataset_name: "arithmetic:n=1"\nper_device_train_batch_size: 8\n', "distinct prompts"),
    ('dataset_name: "arithmetic:n=16"\nper_device_train_batch_size: 4\nnum_iterations: 0\n',
     "num_iterations must be at least 1"),
])
def test_a_run_that_trains_nothing_fails(tmp_path, capsys, extra, reason):
    code = cli.main(["train", str(_tiny_run(tmp_path, extra))])
    err = capsys.readouterr().err
    assert code == 1 and "the run made 0 optimiser steps" in err and reason in err


@pytest.mark.parametrize("raised, code, shown", [("SystemExit(0)", 1, "SystemExit(0)"),
                                                 ("KeyboardInterrupt()", 130, "KeyboardInterrupt")])
def test_a_reward_function_that_exits_does_not_end_the_run_with_exit_0(tmp_path, capsys, monkeypatch, raised, code,
                                                                       shown):
    module = f"quitter_{code}"  # one module per case: an imported module is cached
    (tmp_path / f"{module}.py").write_text(f"def reward(completions, **kw):\n    raise {raised}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = _tiny_run(tmp_path, 'dataset_name: "arithmetic:n=16"\nper_device_train_batch_size: 4\n'
                               f"reward_funcs: [{module}.reward]\n")
    assert cli.main(["train", str(path)]) == code
    err = capsys.readouterr().err
    assert f"training was stopped by {shown}" in err and "no final model was saved" in err
    assert not (tmp_path / "out" / "adapter_model.safetensors").exists()
    assert not (tmp_path / "out" / "model.safetensors").exists()
