"""Every installed plugin on a multi-turn batch (#15): TRL's tool mask marks environment replies inside the
completions. `check_plugin` runs each hook family the plugin has on it (shapes, finite values, determinism,
state round trip, loss hooks, extra generation), with every scorer available and the columns it asks for."""

from __future__ import annotations

import math

import pytest
import torch

from trl_credit.plugins import available
from trl_credit.testing import check_plugin, plugin_set, tiny_tokenizer

TEXTS = ["1 + 2 = 3\nso 3", "<tool>calc</tool> 3", "2 + 2 = 5\n5", "no", "4 + 4 = 8\nthe answer is 8", "", "8", "7\n8"]
REWARDS = [1.0, 1.0, 0.0, 0.0, 1.0, None, 1.0, 0.0]


def _options(name, tmp_path):
    if name == "fixed_prm":
        folder = tmp_path / "prm"
        folder.mkdir(exist_ok=True)
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            (folder / f).write_text("{}")
        return {"path": str(folder)}
    return {"riskpo": {"bundle_size": 2}, "scaf_grpo": {"warmup_steps": 0}}.get(name, {})  # the batch's 2 groups


def multi_turn_batch(name, config):
    from trl_credit.testing import make_batch

    tok = tiny_tokenizer()
    ids = [tok(t, add_special_tokens=False)["input_ids"] or [] for t in TEXTS]
    width = max(len(i) for i in ids)
    tool = torch.ones(len(ids), width, dtype=torch.long)
    for row, seq in enumerate(ids):
        if len(seq) >= 4:
            tool[row, 1:3] = 0  # an environment reply between two model turns
    members = plugin_set(name, config).plugins[0].members
    rewards = sorted(set(members.required_rewards) | {"accuracy"})
    columns = {c: ["8" if c != "hint" else "add them"] * len(ids) for c in
               set(members.required_columns) | {"answer"}}
    g = torch.Generator().manual_seed(3)
    n = len(ids)

    def prefix(row, end, text, model):
        return [-0.5 - 0.1 * ((row + end) % 3)] * max(len(tok(text, add_special_tokens=False)["input_ids"]), 1)

    def probe(row, end, cue, model):
        return {"tokens": [[23, 24], [25, 0]], "mask": [[1, 1], [1, 0]], "logps": [[-0.5, -1.0], [-0.2, 0.0]],
                "topk_ids": [[[23, 5], [24, 6]], [[25, 7], [0, 0]]], "topk_logps": [[[-0.5, -1.5], [-1.0, -2.0]],
                                                                               [[-0.2, -2.0], [-9.0, -9.0]]],
                "texts": [" 8", " 7"]}

    return make_batch(
        [[r] + [0.5] * (len(rewards) - 1) if r is not None else [None] * len(rewards) for r in REWARDS], 4,
        reward_names=[rewards[0]] + rewards[1:] if "accuracy" in rewards else rewards,
        completion_ids=ids, completions=TEXTS, tokenizer=tok, tool_mask=tool[:, :width], columns=columns,
        logps=-torch.rand(n, width, generator=g), entropies=torch.rand(n, width, generator=g),
        ref_logps=-torch.rand(n, width, generator=g), adapters={"*": -torch.rand(n, width, generator=g)},
        continuation_fn=lambda p, c, m: [-1.0] * max(len(c), 1), prefix_logps_fn=prefix,
        completion_logps_fn=lambda row, prompt, m: [-0.7] * width, probe_fn=probe,
        score_fn=lambda row, text: [1.0 if text.strip().endswith("8") else 0.0] + [0.5] * (len(rewards) - 1),
        soft_values=(torch.randn(n, width, generator=g), torch.randn(n, width + 1, generator=g)))


NAMES = sorted(name for name, entry in available().items() if not entry.builtin)


@pytest.mark.parametrize("name", NAMES)
def test_every_plugin_survives_a_multi_turn_batch(name, tmp_path):
    config = _options(name, tmp_path)
    check_plugin(name, config, batches=[lambda: multi_turn_batch(name, config)])


def test_the_batch_really_is_multi_turn():
    batch = multi_turn_batch("dynamic_sampling", {})
    turns = batch.turns()
    assert int(turns.count.max()) == 2 and int(turns.replies.sum()) >= 4 and not math.isnan(float(turns.lengths.sum()))
