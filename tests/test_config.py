"""Configuration errors: raised before any model loads, naming plugin and key, with a fix."""

from __future__ import annotations

import sys
import textwrap

import pytest

import plugins_for_tests as fx
from trl_credit.config import ConfigError, build_plugins, check_columns, normalize_items
from trl_credit.plugins import Available, available


def fake(**classes) -> dict[str, Available]:
    return {name: Available(name, f"plugins_for_tests:{cls}", "trl-credit-" + name, "0.1") for name, cls in classes.items()}


INSTALLED = fake(add_bonus="AddBonus", drop_constant="DropConstant", constant_estimator="ConstantEstimator",
                 other_estimator="OtherEstimator", unknown_hook="UnknownHook", needs_column="NeedsColumn",
                 fixed_beta="FixedBeta", other_beta="OtherBeta", switchable="Switchable")


def problems(raw, installed=INSTALLED) -> list[str]:
    with pytest.raises(ConfigError) as info:
        build_plugins(raw, installed)
    return info.value.problems


def test_items_in_every_form_keep_their_order():
    items = normalize_items(["a", {"name": "b", "x": 1}, {"c": {"y": 2}}, {"d": None}])
    assert items == [("a", {}), ("b", {"x": 1}), ("c", {"y": 2}), ("d", {})]


def test_enabled_plugins_are_built_in_config_order_with_validated_options():
    plugins = build_plugins([{"name": "drop_constant", "max_refill_rounds": 5}, "add_bonus",
                             {"name": "add_bonus", "bonus": 2}], INSTALLED)
    assert plugins.names == ["drop_constant", "add_bonus", "add_bonus#2"]
    assert plugins.plugins[0].config.max_refill_rounds == 5
    assert plugins.plugins[2].config.bonus == 2.0
    assert plugins.plugins[0].hooks == ["filter_rollouts"]


def test_unknown_plugin_suggests_name_lists_installed_and_says_how_to_install():
    (msg,) = problems(["add_bonnus"])
    assert "plugins[0] (add_bonnus)" in msg
    assert "Did you mean 'add_bonus'?" in msg
    assert "Installed: add_bonus, constant_estimator" in msg
    assert "pip install" not in msg  # a close match is the fix; install hints are for names with none
    (other,) = problems(["zzz_method"])
    assert "pip install trl-credit-zzz-method" in other and "trl-credit install zzz_method" in other


def test_ill_typed_and_unknown_options_name_plugin_and_key():
    msgs = problems([{"name": "add_bonus", "bonus": "lots", "colour": "red"}])
    assert any("plugins[0] (add_bonus): option 'bonus'" in m and "valid number" in m for m in msgs)
    assert any("plugins[0] (add_bonus): option 'colour': unknown option" in m for m in msgs)


def test_two_kl_coefficient_plugins_are_a_startup_error():
    (msg,) = problems(["fixed_beta", "other_beta"])
    assert "two plugins set the KL coefficient: plugins[0] (fixed_beta), plugins[1] (other_beta)" in msg


def test_two_estimators_are_a_startup_error():
    (msg,) = problems(["constant_estimator", "other_estimator"])
    assert "two advantage estimators" in msg
    assert "plugins[0] (constant_estimator), plugins[1] (other_estimator)" in msg


def test_hook_not_in_the_spec_is_rejected():
    (msg,) = problems(["unknown_hook"])
    assert "plugins[0] (unknown_hook)" in msg and "compute_advantage" in msg
    assert "unknown hook" in msg.lower()


def test_import_failure_is_reported_with_traceback():
    installed = {"broken": Available("broken", "no_such_module_xyz:Plugin", "trl-credit-broken", "0.1")}
    (msg,) = problems(["broken"], installed)
    assert "plugins[0] (broken): importing no_such_module_xyz:Plugin" in msg
    assert "Traceback" in msg and "ModuleNotFoundError" in msg


def test_all_problems_are_collected():
    msgs = problems(["nope", {"name": "add_bonus", "bonus": "x"}, 42])
    assert len(msgs) == 1 and "plugins[2]" in msgs[0]  # malformed list is reported first, alone
    msgs = problems(["nope", {"name": "add_bonus", "bonus": "x"}])
    assert len(msgs) == 2


def test_missing_dataset_column_names_plugin_and_column():
    plugins = build_plugins(["needs_column"], INSTALLED)
    check_columns(plugins, ["prompt", "gold_entities"])
    with pytest.raises(ConfigError, match=r"plugins\[0\] \(needs_column\): needs dataset column 'gold_entities'"):
        check_columns(plugins, ["prompt", "answer"])


def test_plugin_classes_can_be_passed_directly():
    plugins = build_plugins([fx.Passthrough, {"name": fx.AddBonus, "bonus": 1.0}])
    assert plugins.names == ["passthrough", "add_bonus"]


@pytest.fixture
def broken_entry_point(tmp_path, monkeypatch):
    """An installed distribution whose plugin cannot be imported, and one that works."""
    dist = tmp_path / "trl_credit_fake-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: trl-credit-fake\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(textwrap.dedent("""
        [trl_credit]
        fake_broken = fake_broken_module:Plugin
        fake_ok = plugins_for_tests:AddBonus
    """))
    (tmp_path / "fake_broken_module.py").write_text("raise ImportError('this plugin is broken')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("fake_broken_module", None)


def test_broken_plugin_that_is_not_enabled_does_not_break_other_runs(broken_entry_point):
    found = available()
    assert {"fake_broken", "fake_ok"} <= set(found)
    assert build_plugins(["fake_ok"]).names == ["fake_ok"]
    with pytest.raises(ConfigError, match="this plugin is broken"):
        build_plugins(["fake_broken"])


def test_entry_points_can_be_switched_off(broken_entry_point, monkeypatch):
    monkeypatch.setenv("TRL_CREDIT_NO_ENTRY_POINTS", "1")
    assert set(available()) == {"grpo"}


def test_hook_with_an_argument_the_spec_lacks_is_a_config_error():
    from trl_credit import hookimpl

    class ExtraArgument:
        """Asks for an argument no hook gives."""

        @hookimpl
        def shape_rewards(self, batch, tokenizer):
            return None

    with pytest.raises(ConfigError, match=r"(?s)plugins\[0\] \(extra_argument\).*tokenizer"):
        build_plugins([ExtraArgument])


def test_kl_coefficient_needs_a_reference_model_or_peft():
    from trl_credit.config import check_reference

    plugins = build_plugins(["fixed_beta"], INSTALLED)
    with pytest.raises(ConfigError, match=r"plugins\[0\] \(fixed_beta\) sets the KL coefficient.*`beta` > 0.*use_peft"):
        check_reference(plugins, beta=0.0, peft=False)
    check_reference(plugins, beta=0.0, peft=True)    # the base model under the adapter is the reference
    check_reference(plugins, beta=0.04, peft=False)  # TRL keeps a reference copy
    check_reference(build_plugins(["add_bonus"], INSTALLED), beta=0.0, peft=False)  # nobody asks for KL


def test_a_plugin_that_reads_the_reference_declares_it_and_the_host_checks():
    from trl_credit import Plugin, hookimpl
    from trl_credit.config import check_reference

    class ReadsRef(Plugin):
        name = "reads_ref"

        class Config(Plugin.Config):
            reference: bool = True

        def needs_reference(self):
            return self.config.reference

        @hookimpl
        def shape_rewards(self, batch):
            return None

    with pytest.raises(ConfigError, match=r"plugins\[1\] \(reads_ref\) reads the reference model with these "
                                          r"options, but this run has none.*use_peft: true.*`beta` > 0"):
        check_reference(build_plugins(["add_bonus", ReadsRef], INSTALLED), beta=0.0, peft=False)
    check_reference(build_plugins([ReadsRef], INSTALLED), beta=0.0, peft=True)
    check_reference(build_plugins([ReadsRef], INSTALLED), beta=0.1, peft=False)
    check_reference(build_plugins([{"name": ReadsRef, "reference": False}], INSTALLED), beta=0.0, peft=False)


def test_options_can_switch_a_hook_off():
    from trl_credit.config import check_reference

    plugins = build_plugins([{"name": "switchable", "kl": False}, "fixed_beta"], INSTALLED)
    assert plugins.plugins[0].hooks == ["shape_rewards"]
    assert [p.name for p in plugins.with_hook("kl_coefficient")] == ["fixed_beta"]  # no "two KL plugins" error
    check_reference(build_plugins([{"name": "switchable", "kl": False}], INSTALLED), beta=0.0, peft=False)
    (msg,) = problems([{"name": "switchable", "kl": False, "shape": False}])
    assert "plugins[0] (switchable): its options switch every hook off" in msg


def test_num_generations_zero_is_a_config_error(tmp_path, capsys):
    from trl_credit.app import cli

    path = tmp_path / "ng0.yaml"
    path.write_text('dataset_name: "arithmetic:n=16"\nuse_cpu: true\nnum_generations: 0\n')
    assert cli.main(["validate", str(path)]) == 2
    assert "num_generations must be at least 2" in capsys.readouterr().err


def test_same_name_entry_points_and_builtin_shadows_are_reported(monkeypatch, capsys):
    import warnings

    from trl_credit import plugins as loader
    from trl_credit.app import cli
    from trl_credit.plugins import Available

    eps = [Available("twin", "pkg_a:Twin", "trl-credit-twin-a", "1.0"),
           Available("twin", "pkg_b:Twin", "trl-credit-twin-b", "2.0"),
           Available("grpo", "pkg_c:Mine", "someone-elses-grpo", "0.1")]
    monkeypatch.setattr(loader, "_entry_points", lambda: eps)
    with pytest.raises(ConfigError, match=r"two installed distributions name a plugin 'twin': "
                                          r"trl-credit-twin-a \(pkg_a:Twin\) and trl-credit-twin-b \(pkg_b:Twin\)"):
        build_plugins(["twin"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plugins = build_plugins(["grpo"])  # the built-in is used, and the shadowing entry point is reported
    assert plugins.plugins[0].info.builtin
    assert any("someone-elses-grpo (pkg_c:Mine) has the name of a built-in plugin" in str(w.message) for w in caught)
    assert cli.main(["plugins"]) == 0
    err = capsys.readouterr().err
    assert "two installed distributions name a plugin 'twin'" in err and "name of a built-in" in err


@pytest.mark.parametrize("line, expected", [
    ("loss_type: dapoo", "loss_type: 'dapoo' is not a TRL 1.16 loss type (grpo, bnpo, dr_grpo, dapo, cispo, sapo, "
                         "luspo, vespo); did you mean 'dapo'?"),
    ("scale_rewards: groups", "scale_rewards: 'groups' must be one of group, batch, none; did you mean 'group'?"),
    ("temperature: 0", "temperature: 0 must be > 0"),
    ("beta: -0.5", "beta: -0.5 must be >= 0"),
    ("reward_weights: [1.0, 2.0]", "reward_weights: 2 weight(s) for 1 reward function(s) (arithmetic_accuracy)"),
    ("resume_from_checkpoint: nope/checkpoint-3", "resume_from_checkpoint: 'nope/checkpoint-3' is not a directory"),
    ("model_name_or_path: smollm2-135m-instrct", "did you mean 'smollm2-135m-instruct'?"),
    ("model_name_or_path: ./models/missing", "'./models/missing' looks like a local path but does not exist"),
    ("dataset_name: ./nofile.jsonl", "dataset_name: './nofile.jsonl' does not exist"),
    ('dataset_name: "arithmetic:n=0"', "the training dataset is empty"),
    ("reward_funcs: [needs_gold.reward]", "reward function reward reads dataset column(s) gold"),
])
def test_validate_checks_what_the_run_will_meet(tmp_path, capsys, monkeypatch, line, expected):
    from trl_credit.app import cli

    (tmp_path / "needs_gold.py").write_text("def reward(completions, gold, **kwargs):\n    return [0.0]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    body = 'use_cpu: true\n' + ('' if line.startswith("dataset_name") else 'dataset_name: "arithmetic:n=16"\n')
    path = tmp_path / "run.yaml"
    path.write_text(body + line + "\n")
    assert cli.main(["validate", str(path)]) == 2
    assert expected in capsys.readouterr().err


def test_use_vllm_without_vllm_is_refused(tmp_path, capsys):
    import importlib.util

    from trl_credit.app import cli

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    path = tmp_path / "run.yaml"
    path.write_text('use_cpu: true\ndataset_name: "arithmetic:n=16"\nuse_vllm: true\n')
    assert cli.main(["validate", str(path)]) == 2
    assert "use_vllm: true, but vLLM is not installed" in capsys.readouterr().err


def test_bf16_on_a_cpu_without_bf16_is_warned_about(tmp_path, capsys, monkeypatch):
    from trl_credit.app import cli, train_command

    path = tmp_path / "run.yaml"
    path.write_text('use_cpu: true\nbf16: true\ndataset_name: "arithmetic:n=16"\n')
    monkeypatch.setattr(train_command, "cpu_has_bf16", lambda: False)
    assert cli.main(["validate", str(path)]) == 0
    assert "bf16 is on, but this CPU has no bf16 instructions" in capsys.readouterr().err
    monkeypatch.setattr(train_command, "cpu_has_bf16", lambda: True)
    assert cli.main(["validate", str(path)]) == 0
    assert "bf16" not in capsys.readouterr().err
