"""What the host adds to a checkpoint: plain data only, written before transformers' files, checked on resume."""

from __future__ import annotations

import os

import pytest
import torch

import plugins_for_tests as fx
from trl_credit import PluginRuntimeError
from trl_credit.checkpoint import STATE_FILE, CheckpointError, check_plain, read_state, write_state


class _WritesAFile:
    """Unpickling this would create a file: what a crafted checkpoint could do with weights_only=False."""

    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (open, (self.target, "w"))


def test_a_crafted_pickle_is_refused_and_runs_nothing(tmp_path):
    target = tmp_path / "pwned"
    folder = tmp_path / "checkpoint-2"
    folder.mkdir()
    torch.save({"plugins": {"x": _WritesAFile(str(target))}, "prompt_stats": {}}, folder / STATE_FILE)
    with pytest.raises(CheckpointError, match=f"cannot read {folder / STATE_FILE}"):
        read_state(str(folder), [])
    assert not target.exists()


def test_plugin_state_must_be_plain_data(tmp_path):
    check_plain({"table": [[1, {"a": torch.ones(2)}]], "n": 3, "name": None}, "state_dict()")
    with pytest.raises(CheckpointError, match=r"plugin 'counter' cannot be checkpointed: its state_dict\(\)\['seen'\] "
                                              r"is a builtins.set"):
        write_state(str(tmp_path), {"counter": {"seen": {1, 2}}}, {}, 0)
    with pytest.raises(CheckpointError, match=r"numpy.ndarray"):
        import numpy as np

        write_state(str(tmp_path), {"counter": {"x": [np.zeros(2)]}}, {}, 0)
    assert not (tmp_path / STATE_FILE).exists()


def test_missing_truncated_or_foreign_state_stops_the_resume_naming_the_file(tmp_path):
    folder = tmp_path / "checkpoint-2"
    folder.mkdir()
    with pytest.raises(CheckpointError, match=rf"{folder / STATE_FILE} is missing, but plugin\(s\) counter keep state"):
        read_state(str(folder), ["counter"])
    assert read_state(str(folder), []) is None
    path = write_state(str(folder), {"counter": {"count": 2}}, {"seen": torch.zeros(2)}, 1)
    data = open(path, "rb").read()
    with open(path, "wb") as handle:
        handle.write(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"cannot read {path}"):
        read_state(str(folder), ["counter"])
    write_state(str(folder), {"other": {"count": 2}}, {"seen": torch.zeros(2)}, 1)
    with pytest.raises(CheckpointError, match=r"holds no state for plugin\(s\) counter \(it has: other\)"):
        read_state(str(folder), ["counter"])


def test_state_is_written_before_transformers_files(make_trainer, tmp_path, monkeypatch):
    """A kill inside transformers' save (here: an error in save_model) leaves the host's state already written."""
    from transformers import Trainer

    trainer = make_trainer(plugins=[fx.Counter], reward_funcs=[lambda completions, **kw: [1.0] * len(completions)],
                           max_steps=1, save_strategy="steps", save_steps=1)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed while saving")

    monkeypatch.setattr(Trainer, "save_model", killed)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    checkpoint = tmp_path / "out" / "checkpoint-1"
    assert (checkpoint / STATE_FILE).exists() and not (checkpoint / "trainer_state.json").exists()
    assert read_state(str(checkpoint), ["counter"])["plugins"] == {"counter": {"count": 1}}


def test_resume_stops_when_a_plugin_cannot_load_its_state(make_trainer, tmp_path):
    reward = [lambda completions, **kw: [1.0] * len(completions)]
    trainer = make_trainer(plugins=[fx.Counter], reward_funcs=reward, max_steps=1, save_strategy="steps", save_steps=1)
    trainer.train()
    checkpoint = str(tmp_path / "out" / "checkpoint-1")

    class Refuses(fx.Counter):
        name = "counter"

        def load_state_dict(self, state):
            raise ValueError("bad state")

    resumed = make_trainer(plugins=[Refuses], reward_funcs=reward, max_steps=2)
    with pytest.raises(PluginRuntimeError, match=rf"plugin 'counter' raised in load_state_dict while resuming from "
                                                 rf"{os.path.join(checkpoint, STATE_FILE)}: ValueError: bad state"):
        resumed.train(resume_from_checkpoint=checkpoint)
    os.remove(os.path.join(checkpoint, STATE_FILE))
    again = make_trainer(plugins=[fx.Counter], reward_funcs=reward, max_steps=2)
    with pytest.raises(CheckpointError, match="is missing, but plugin"):
        again.train(resume_from_checkpoint=checkpoint)


def test_resume_on_a_dataset_of_another_size_names_the_file(make_trainer, tmp_path):
    from trl_credit.app.data import make_arithmetic

    reward = [lambda completions, **kw: [1.0] * len(completions)]
    trainer = make_trainer(plugins=[fx.Counter], reward_funcs=reward, max_steps=1, save_strategy="steps", save_steps=1)
    trainer.train()
    checkpoint = str(tmp_path / "out" / "checkpoint-1")
    resumed = make_trainer(plugins=[fx.Counter], reward_funcs=reward, max_steps=2, dataset=make_arithmetic(32, seed=0))
    with pytest.raises(CheckpointError, match=rf"{os.path.join(checkpoint, STATE_FILE)}: the prompt statistics do not "
                                              r"fit this training set of 32 prompts .*was the dataset changed"):
        resumed.train(resume_from_checkpoint=checkpoint)
