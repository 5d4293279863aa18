"""benchmarks/multiturn.py: every variant is the example config plus its plugin entry and validates before any
model loads; the report pairs each plugin with GRPO on the same seeds (values from hand-made run files)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def mt():
    sys.path.insert(0, str(BENCH))
    import multiturn

    yield multiturn
    sys.path.remove(str(BENCH))


def test_every_variant_is_the_example_plus_its_plugin_and_validates(mt, tmp_path):
    from trl_credit.app.train_command import validate

    example = yaml.safe_load(mt.EXAMPLE.read_text())
    for label, plugins in mt.VARIANTS.items():
        config = mt.config_of(label, 2, str(tmp_path / "out"))
        assert config["plugins"] == plugins and config["seed"] == 2
        assert config["heldout_before"] is False  # "before" is the base model's play (base_play), measured once
        own = ("plugins", "seed", "output_dir", "heldout_before")
        assert {k: v for k, v in config.items() if k not in own} == {k: v for k, v in example.items() if k not in own}
        path = tmp_path / f"{label}.yaml"
        path.write_text(yaml.safe_dump(config))
        validate(str(path))  # raises ConfigError on a bad option or a per-turn column the game does not record


def test_report_pairs_plugins_with_grpo_on_the_same_seeds(mt, tmp_path):
    def write(label, seed, after, turns, trained):
        path = mt.result_path(tmp_path, label, seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"label": label, "seed": seed, "before": 0.0, "after": after, "turns_before": 3.0,
                                    "turns_after": turns, "seconds_per_step": 25.0, "train_reward": trained,
                                    "config": mt.config_of(label, seed, f"/elsewhere/{label}{seed}")}))

    write("grpo", 0, 0.75, 2.25, [1.0] * 5 + [0.1] * 10)  # only the last 10 steps count: 0.1
    write("grpo", 1, 0.5, 2.5, [0.2, float("nan")])  # NaN steps are left out: 0.2
    write("salt", 0, 0.875, 2.0, [0.3] * 10)
    write("salt", 1, 0.5, 2.75, [0.2, 0.6])  # 0.4
    write("salt", 2, 1.0, 1.0, [1.0])  # no GRPO seed 2: not paired
    for seed, cost in ((0, 0.5), (1, 1.0), (2, None)):  # a run from before the cost was recorded: left out
        path = mt.result_path(tmp_path, "salt", seed)
        path.write_text(json.dumps({**json.loads(path.read_text()), "plugin_x_generation": cost}))
    table = mt.report(tmp_path)
    row = next(line for line in table.splitlines() if line.startswith("| `salt`"))
    # paired over seeds 0 and 1: deltas +0.125 and 0.0 -> mean +0.0625, t(1) 12.706 * std 0.0884 / sqrt 2 = 0.794
    assert "| 3 | 0.000 | 0.792" in row and "+0.062 ± 0.794" in row and "+0.000 ± 3.176" in row
    # sampled training success: mean over seeds 0.3, 0.4, 1.0 = 0.567; paired deltas +0.2, +0.2: no spread, so
    # no interval (not a zero-width one). s/step: runs without a median step time count their mean, marked *
    assert "| 25.0* | 0.75x | 0.567 | +0.200 (no spread over 2) |" in row
    for seed, median in ((0, 20.0), (1, 40.0)):  # seed 2 without one: left out
        path = mt.result_path(tmp_path, "salt", seed)
        path.write_text(json.dumps({**json.loads(path.read_text()), "median_step_seconds": median}))
    row = next(line for line in mt.report(tmp_path).splitlines() if line.startswith("| `salt`"))
    assert "| 30.0 | 0.75x |" in row
    path = mt.result_path(tmp_path, "salt", 2)  # a run slowed for its whole length moves the median, not to 186
    path.write_text(json.dumps({**json.loads(path.read_text()), "median_step_seconds": 186.0}))
    row = next(line for line in mt.report(tmp_path).splitlines() if line.startswith("| `salt`"))
    assert "| 40.0 | 0.75x |" in row
    assert "| `empg` | 0 |" in table and "not run yet" in table
    # a run made with another setting (here another learning rate) is left out of the table, and named
    path = mt.result_path(tmp_path, "grpo", 1)
    run = json.loads(path.read_text())
    run["config"]["learning_rate"] = 1.0
    path.write_text(json.dumps(run))
    assert mt.stale_keys(run) == ["learning_rate"]
    table = mt.report(tmp_path)
    assert "| `grpo` | 1 |" in table and "Left out: grpo/seed1 (made with another setting" in table
    assert mt.stale_keys({**run, "config": mt.config_of("grpo", 1, "/any/where")}) == []  # where it ran is no setting


def test_plugin_cost_is_the_median_hook_time_over_generation_time_after_the_first_step(mt):
    def h(gen, a, b=None):
        row = {"trl_credit/cost/generation_seconds": gen, "trl_credit/taco/seconds": a}
        return row if b is None else {**row, "trl_credit/other/seconds": b}

    steps = [h(1.0, 50.0), h(2.0, 1.0), h(4.0, 1.0), h(1.0, 3.0)]
    assert mt.plugin_cost(steps, ["taco"]) == 0.5  # 0.5, 0.25, 3.0 (step 1 left out)
    assert mt.plugin_cost([h(1.0, 0.0, 1.0), h(2.0, 1.0, 1.0)], ["taco", "other"]) == 1.0
    assert mt.plugin_cost(steps, []) is None


def test_every_turn_plugin_the_learning_grid_skips_is_run_here_or_said_not_to_apply(mt):
    """A turn plugin is left out of the arithmetic grid because the guess game runs it: none falls between."""
    from learning import MULTI_TURN  # benchmarks/ is on the path (the mt fixture)

    from trl_credit.plugins import available

    installed = {name for name, info in available().items() if not info.builtin}
    here = {entry["name"] for entries in mt.VARIANTS.values() for entry in entries} | set(mt.NOT_APPLICABLE)
    assert set(MULTI_TURN) - here == set()
    assert {"igpo", "trace", "siop", "pica", "infopo", "taco"} <= here  # the turn modes of the step scorers too
    assert here <= installed and set(mt.NOT_APPLICABLE).isdisjoint(
        {entry["name"] for entries in mt.VARIANTS.values() for entry in entries})


def test_median_step_seconds_ignores_a_few_slowed_steps(mt):
    steps = [{"step_time": t} for t in (23.0, 24.0, 369.0, 25.0, 180.0)] + [{"loss": 0.1}]
    assert mt.median_step_seconds(steps) == 25.0
    assert mt.median_step_seconds([{"loss": 0.1}]) is None


def test_feedback_is_measured_from_the_saved_adapter_of_a_run_that_predates_it(mt, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from trl_credit.testing.tiny import tiny_model_path

    folder = tmp_path / "work" / "out"
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path()), LoraConfig(r=2, target_modules="all-linear"))
    model.save_pretrained(folder)
    (folder / "metrics.json").write_text(json.dumps({"log_history": [{"loss": 0.1, "step_time": t} for t in (3.0, 90.0, 4.0)]}))
    config = {"model_name_or_path": tiny_model_path(), "dataset_name": "guess:eval_n=3,turn_tokens=3",
              "heldout_samples": 2, "output_dir": str(folder)}
    for label, seed, out_dir in (("grpo", 0, folder), ("salt", 0, tmp_path / "gone")):
        path = mt.result_path(tmp_path, label, seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"label": label, "seed": seed, "config": {**config, "output_dir": str(out_dir)}}))
    lines = mt.measure_feedback(tmp_path)
    assert any(line.startswith("salt/seed0.json: no adapter") for line in lines)
    run = json.loads(mt.result_path(tmp_path, "grpo", 0).read_text())
    assert run["feedback_before"]["games"] == run["feedback_after"]["games"] == 2  # heldout_samples of eval_n
    assert run["feedback_after"]["follows"] == 0.0  # a random model writes no numbers
    assert run["median_step_seconds"] == 4.0  # from the run's metrics.json
    assert mt.measure_feedback(tmp_path) == [line for line in lines if "no adapter" in line]  # measured once


def test_before_is_the_base_models_play_measured_once_and_every_run_records_it(mt, tmp_path, monkeypatch):
    from trl_credit.testing.tiny import tiny_model_path

    config = {"model_name_or_path": tiny_model_path(), "dataset_name": "guess:eval_n=3,turn_tokens=3",
              "heldout_samples": 2}
    play = mt.base_play(tmp_path, config)
    assert play["success"] == 0.0 and play["turns"] == 3.0  # a random model writes no numbers: every game lost
    assert play["feedback"] == {"follows": 0.0, "changes": 0.0, "games": 2}
    monkeypatch.setattr(mt, "_load", lambda config: pytest.fail("measured again"))
    assert mt.base_play(tmp_path, config) == play  # kept in base.json
    with pytest.raises(pytest.fail.Exception):  # another held-out set is measured anew
        mt.base_play(tmp_path, {**config, "heldout_samples": 3})
    after = {"follows": 0.5, "changes": 1.0, "games": 2}
    metrics = {"log_history": [{"loss": 0.1, "step_time": 2.0, "rewards/guess_reward/mean": 0.5}],
               "heldout_accuracy_after": 0.5, "heldout_turns": [2.5], "heldout_feedback": [after],
               "seconds_per_step": 2.0}
    run = mt.record("grpo", 0, config, metrics, tmp_path, play)
    assert (run["before"], run["turns_before"], run["after"], run["turns_after"]) == (0.0, 3.0, 0.5, 2.5)
    assert run["feedback_before"] == play["feedback"] and run["feedback_after"] == after
    assert json.loads(mt.result_path(tmp_path, "grpo", 0).read_text()) == run
    # the code that made the run: the checkout's commit (abbreviated, "-dirty" when its code is edited)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=mt.ROOT, capture_output=True, text=True).stdout.strip()
    if head:
        assert head.startswith(run["code"].removesuffix("-dirty")) and len(run["code"]) >= 7
    else:  # not a git checkout (an unpacked sdist): nothing to name
        assert run["code"] is None
    # a run that evaluated before training itself (the grid's first runs) keeps its own "before"
    early = {**metrics, "heldout_accuracy_before": 0.25, "heldout_turns": [2.75, 2.5],
             "heldout_feedback": [{"follows": 0.0, "changes": 0.5, "games": 2}, after]}
    run = mt.record("grpo", 1, config, early, tmp_path)
    assert (run["before"], run["turns_before"], run["feedback_before"]["changes"]) == (0.25, 2.75, 0.5)


def test_play_shows_each_held_out_game_turn_by_turn(mt, tmp_path):
    from trl_credit.testing.tiny import tiny_model_path

    config = {"model_name_or_path": tiny_model_path(), "dataset_name": "guess:eval_n=3,turn_tokens=3,turns=2",
              "heldout_samples": 3}
    games = mt.greedy_play(tmp_path, config)  # no adapter there: the base model
    assert [len(g["turns"]) for g in games] == [2, 2, 2] and not any(g["solved"] for g in games)
    assert all(1 <= g["secret"] <= 5 for g in games)  # guess's default max_value
    lines = mt.play_lines(games + [{"secret": 9, "turns": ["1.", "2."], "solved": True}] * 2)
    assert lines[-1] == "2 x secret 9: 1. | 2. (won)" and sum(int(line.split(" x ")[0]) for line in lines) == 5
