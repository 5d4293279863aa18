"""The CLI: listing, validation errors, the new-plugin skeleton (installed and tested), install."""

from __future__ import annotations

import json
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
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(package)]
    subprocess.run(pip, check=True, capture_output=True)
    try:
        listed = subprocess.run([sys.executable, "-m", "trl_credit.app.cli", "plugins", "--json"], capture_output=True,
                                text=True, check=True)
        assert "shiny_method" in {e["name"] for e in json.loads(listed.stdout)}
        tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(package / "tests")],
                               capture_output=True, text=True, cwd=tmp_path)
        assert tests.returncode == 0, tests.stdout + tests.stderr
        assert "4 passed" in tests.stdout
    finally:
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", "trl-credit-shiny-method"],
                       capture_output=True)
    with pytest.raises(FileExistsError):
        cli.main(["new-plugin", "shiny_method", "--dir", str(tmp_path)])


def test_install_prefers_the_monorepo_package(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(cli.subprocess, "call", lambda cmd, env=None: calls.append(cmd) or 0)
    monkeypatch.chdir(ROOT)
    assert cli.main(["install", "dynamic_sampling"]) == 0
    assert calls[-1][-2:] == ["-e", str(ROOT / "plugins" / "trl-credit-dynamic-sampling")]
    assert cli.main(["install", "some_method"]) == 0
    assert calls[-1][-1] == "trl-credit-some-method"
