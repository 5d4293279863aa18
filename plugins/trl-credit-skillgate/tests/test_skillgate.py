"""SkillGate: hand-computed selector and execution channels (token by token, on single-turn and tool-masked
rollouts), the readings offered as options, real-tokenizer offsets, edge cases, the options' checks, the contract
and a real multi-turn training run whose rollouts read skills."""

from __future__ import annotations

import math

import pytest
import torch

from trl_credit import ConfigError, Plugin, hookimpl
from trl_credit.testing import check_plugin, make_batch, plugin_set, run_plugin, tiny_dataset, tiny_tokenizer, train_tiny
from trl_credit_skillgate import SkillGate, find_reads, gold_names, selector_rewards

# The kit's stand-in tokenizer spreads a text evenly over its tokens: 26 characters over 13 tokens -> token t is
# characters [2t, 2t + 2). "<skill>pdf</skill>" is characters [4, 22) -> tokens 2..10; its name "pdf" [11, 14) -> 5, 6.
READ_PDF = "abcd<skill>pdf</skill>efgh"
READ_XLS = "abcd<skill>xls</skill>efgh"
NO_READ = "abcdefghijklmnopqrstuvwxyz"
TWO_READS = "<skill>pdf</skill><skill>xls</skill>"  # 36 characters over 18 tokens: every token in a read
A = 0.5 / (math.sqrt(1 / 3) + 1e-4)  # TRL's GRPO advantage of outcomes [0, 1, 1, 0]: -+.866


def group(rewards=(0.0, 1.0, 1.0, 0.0), gold=("pdf",) * 4, texts=(READ_PDF, READ_XLS, NO_READ, TWO_READS), **kwargs):
    return make_batch(list(rewards), len(rewards), lengths=[len(t) // 2 for t in texts], completions=list(texts),
                      columns={"gold_skill": list(gold)}, **kwargs)


def rows(*spec, width=18):
    """A token-advantage tensor from runs ``(value, count)`` per row, padded with the row's last value."""
    out = []
    for runs in spec:
        row = [v for v, c in runs for _ in range(c)]
        out.append(row + [row[-1]] * (width - len(row)))
    return torch.tensor(out)


def test_hand_computed_channels_and_metrics():
    # c0 reads pdf (correct) but its outcome failed: +1 on tokens 2-10, its outcome advantage -A elsewhere.
    # c1 reads xls (wrong) and succeeded: -1 on its read, +A elsewhere. c2 reads nothing: +A everywhere.
    # c3 reads twice: -1 on every token (all of them name a skill).
    result = run_plugin(SkillGate, group())
    expected = rows([(-A, 2), (1.0, 9), (-A, 2)], [(A, 2), (-1.0, 9), (A, 2)], [(A, 13)], [(-1.0, 18)])
    torch.testing.assert_close(result.advantages, expected)
    m = result.metrics
    assert m["skillgate/read_rate"] == pytest.approx(3 / 4)
    assert m["skillgate/reads"] == pytest.approx(4 / 3)
    assert m["skillgate/correct_rate"] == pytest.approx(1 / 3) and m["skillgate/multiple_rate"] == pytest.approx(1 / 3)
    assert m["skillgate/selector_token_share"] == pytest.approx(36 / 57)  # 9 + 9 + 18 of 13 + 13 + 13 + 18
    # the broadcast outcome advantage would have punished c0's correct read and rewarded c1's wrong one
    assert m["skillgate/outcome_sign_errors"] == pytest.approx(2 / 3)
    assert m["skillgate/selector_reward"] == pytest.approx(-1 / 3)


def test_name_tokens_only():
    # tokens: name: c0 "pdf" -> tokens 5, 6; c3's names [7, 10) -> tokens 3, 4 and [25, 28) -> tokens 12, 13
    a = run_plugin(SkillGate, group(), {"tokens": "name"}).advantages
    expected = rows([(-A, 5), (1.0, 2), (-A, 6)], [(A, 5), (-1.0, 2), (A, 6)], [(A, 13)],
                    [(-A, 3), (-1.0, 2), (-A, 7), (-1.0, 2), (-A, 4)])
    torch.testing.assert_close(a, expected)


def test_baselines_and_rewards_as_options():
    # pooled s = [1, -1, -1] (c2 has no read): mean -1/3 -> [4/3, -2/3, -2/3]; group: / population sigma sqrt(8/9)
    mean = run_plugin(SkillGate, group(), {"baseline": "mean"}).advantages
    torch.testing.assert_close(mean[:, 5], torch.tensor([4 / 3, -2 / 3, A, -2 / 3]))
    z = run_plugin(SkillGate, group(), {"baseline": "group", "coef": 0.5}).advantages
    s = math.sqrt(8 / 9) + 1e-6
    torch.testing.assert_close(z[:, 5], torch.tensor([0.5 * (4 / 3) / s, -0.5 * (2 / 3) / s, A, -0.5 * (2 / 3) / s]))
    other = run_plugin(SkillGate, group(), {"correct": 2.0, "wrong": -0.5, "multiple": 0.0}).advantages
    torch.testing.assert_close(other[:, 5], torch.tensor([2.0, -0.5, A, 0.0]))


def test_gold_lists_missing_gold_and_case():
    gold = (["PDF", "doc"], "xls", None, [])
    a = run_plugin(SkillGate, group(gold=gold)).advantages[:, 5]
    torch.testing.assert_close(a, torch.tensor([-1.0, 1.0, A, -1.0]))  # case matters; no gold: every read is wrong
    a = run_plugin(SkillGate, group(gold=gold), {"ignore_case": True}).advantages[:, 5]
    torch.testing.assert_close(a, torch.tensor([1.0, 1.0, A, -1.0]))
    assert gold_names([" a ", ["b", None, ""], None]) == [{"a"}, {"b"}, set()]


def test_only_reads_on_the_models_tokens_count():
    # two rows of TWO_READS; r0 wrote the pdf read (tokens 0-8) and the environment echoed xls (tokens 9-17); r1 the
    # other way round. Each makes one read; environment tokens keep the outcome advantage (the loss ignores them).
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    tool = [[1] * 9 + [0] * 9, [0] * 9 + [1] * 9]
    batch = make_batch([1.0, 0.0], 2, lengths=[18, 18], completions=[TWO_READS] * 2, tool_mask=tool,
                       columns={"gold_skill": ["pdf", "pdf"]})
    result = run_plugin(SkillGate, batch)
    torch.testing.assert_close(result.advantages, rows([(1.0, 9), (a, 9)], [(-a, 9), (-1.0, 9)]))
    assert result.metrics["skillgate/reads"] == 1.0 and result.metrics["skillgate/multiple_rate"] == 0.0
    # a read whose text straddles into the model's tokens counts, and only its model tokens get the selector credit
    straddle = make_batch([1.0, 0.0], 2, lengths=[18, 18], completions=[TWO_READS] * 2,
                          tool_mask=[[0] * 7 + [1] * 2 + [0] * 9, [0] * 18], columns={"gold_skill": ["pdf", "pdf"]})
    out = run_plugin(SkillGate, straddle).advantages
    torch.testing.assert_close(out, rows([(a, 7), (1.0, 2), (a, 9)], [(-a, 18)]))


def test_per_token_input_keeps_its_execution_values():
    instance = plugin_set(SkillGate).plugins[0].instance
    batch = group()
    incoming = torch.arange(4 * 18, dtype=torch.float32).reshape(4, 18)
    out = instance.transform_advantages(batch, incoming)
    selector = instance.reads(batch)["selector"]
    torch.testing.assert_close(out[~selector], incoming[~selector])
    assert out[0, 2:11].tolist() == [1.0] * 9 and out[3].tolist() == [-1.0] * 18


def test_real_tokenizer_offsets():
    tok = tiny_tokenizer()
    text = "Plan: <skill>pdf-tools</skill> then extract the table."
    ids = tok.encode(text, add_special_tokens=False)
    batch = make_batch([1.0, 0.0], 2, completion_ids=[ids, ids], completions=[text, text], tokenizer=tok,
                       columns={"gold_skill": ["pdf-tools", "other"]})
    instance = plugin_set(SkillGate).plugins[0].instance
    selector = instance.reads(batch)["selector"][0]
    chosen = tok.decode([i for i, s in zip(ids, selector.tolist()) if s])
    assert chosen.strip() == "<skill>pdf-tools</skill>"
    rest = tok.decode([i for i, s in zip(ids, selector.tolist()) if not s])
    assert "skill" not in rest and "then extract" in rest
    names = plugin_set(SkillGate, {"tokens": "name"}).plugins[0].instance.reads(batch)["selector"][0]
    named = tok.decode([i for i, s in zip(ids, names.tolist()) if s])
    assert "pdf-tools" in named and named in "<skill>pdf-tools</skill>" and names.sum() < selector.sum()
    a = run_plugin(SkillGate, batch).advantages
    assert a[0][selector].eq(1.0).all() and a[1][selector].eq(-1.0).all()


def test_find_reads_and_rewards():
    import re

    spans, names = find_reads(["x<skill> pdf </skill>y", "none"], re.compile(r"<skill>(?P<skill>[^<]*)</skill>"),
                              "name")
    assert spans == [[(9, 12)], []] and names == [["pdf"], []]  # the name span trimmed of its spaces
    spans, names = find_reads(["call read_skill(pdf)"], re.compile(r"read_skill\(\w+\)"))
    assert spans == [[(5, 20)]] and names == [["read_skill(pdf)"]]  # no `skill` group: the match is the name
    s = selector_rewards(torch.tensor([0, 1, 1, 2]), torch.tensor([False, True, False, False]), 1.0, -1.0, -0.5)
    assert s.tolist() == [0.0, 1.0, -1.0, -0.5]


def test_edge_cases():
    # nothing reads: the run's outcome advantage everywhere (single-turn rows of plain text)
    plain = make_batch([1.0, 0.0, 0.0, 1.0], 4, lengths=[3, 2, 3, 1], columns={"gold_skill": ["a"] * 4})
    out = run_plugin(SkillGate, plain).advantages
    torch.testing.assert_close(out, run_plugin(SkillGate, plain, {"coef": 0.0}).advantages)
    assert "skillgate/reads" not in run_plugin(SkillGate, plain).metrics
    # a constant group still credits its reads: the selector channel does not depend on the outcome
    const = run_plugin(SkillGate, group(rewards=(1.0,) * 4)).advantages
    torch.testing.assert_close(const, rows([(0.0, 2), (1.0, 9), (0.0, 2)], [(0.0, 2), (-1.0, 9), (0.0, 2)], [(0.0, 13)],
                                           [(-1.0, 18)]))


class DropFirst(Plugin):
    """Drops the first completion of each group."""

    @hookimpl
    def filter_rollouts(self, batch):
        return torch.arange(batch.num_completions) % batch.num_generations != 0


def test_dropped_rows_are_out_of_the_baseline():
    result = run_plugin(SkillGate, group(), {"baseline": "mean"}, others=[DropFirst])
    assert torch.equal(result.advantages[0], torch.zeros(18))
    torch.testing.assert_close(result.advantages[[1, 3], 5], torch.tensor([0.0, 0.0]))  # pool [-1, -1]: mean -1


def test_unscored_rows_are_out_of_the_baseline():
    # the first row unscored (every reward None) instead of dropped: the same pool, and it gets 0
    result = run_plugin(SkillGate, group(rewards=(None, 1.0, 1.0, 0.0)), {"baseline": "mean"})
    assert torch.equal(result.advantages[0], torch.zeros(18))
    torch.testing.assert_close(result.advantages[[1, 3], 5], torch.tensor([0.0, 0.0]))


def test_tool_path_messages_are_refused_with_the_reason():
    messages = [[{"role": "assistant", "content": "<skill>pdf</skill>"}, {"role": "tool", "content": "ok"},
                 {"role": "assistant", "content": "done"}]] * 2
    batch = make_batch([1.0, 0.0], 2, completions=messages, columns={"gold_skill": ["pdf"] * 2})
    with pytest.raises(RuntimeError, match="token offsets cover only the last message"):
        run_plugin(SkillGate, batch)


@pytest.mark.parametrize("options, text", [
    ({"pattern": "(?P<skill>x*)"}, "matches the empty string"),
    ({"pattern": "[unclosed"}, "not a valid regex"),
    ({"pattern": r"read\(\w+\)", "tokens": "name"}, "lacks; fix: add (?P<skill>...)"),
    ({"correct": 0.0}, "correct"),
    ({"wrong": 0.5}, "wrong"),
    ({"multiple": 1.0}, "multiple"),
    ({"gold_column": " "}, "gold_column must name"),
    ({"baseline": "mean", "wrong": -0.5}, "wrong (-0.5) != multiple (-1.0)"),
])
def test_options_are_checked_at_construction(options, text):
    with pytest.raises(ConfigError, match=r"plugins\[0\] \(skillgate\)") as info:
        plugin_set(SkillGate, options, name="skillgate")
    assert text in str(info.value)


def test_contract():
    assert plugin_set(SkillGate, {"gold_column": "skill"}).plugins[0].members.required_columns == ("skill",)
    tool = [[1] * 9 + [0] * 9, [0] * 9 + [1] * 9]
    check_plugin(SkillGate, batches=[group, lambda: make_batch([1.0, 0.0], 2, lengths=[18, 18],
                                                               completions=[TWO_READS] * 2, tool_mask=tool,
                                                               columns={"gold_skill": ["pdf", None]})])
    check_plugin(SkillGate, {"gold_column": "answer"})  # the kit's edge cases: no reads


class SkillRollout:
    """A ``rollout_func``: turn 0 reads a skill (``<skill>pdf</skill>`` or ``xls``, at random), the environment replies
    with 2 tokens, turn 1 writes 3 random tokens; ``solved`` is a coin flip, independent of the read."""

    def __call__(self, prompts, trainer):
        tok = trainer.processing_class
        prompt_ids = [list(tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=True)
                           ["input_ids"]) for p in prompts]
        completion_ids, env_mask, solved = [], [], []
        for _ in prompts:  # a loop over rollouts, bounded by the batch
            name = ["pdf", "xls"][int(torch.randint(2, ()))]
            read = tok.encode(f"<skill>{name}</skill>", add_special_tokens=False)
            reply, work = torch.randint(300, 400, (2,)).tolist(), torch.randint(100, 200, (3,)).tolist()
            completion_ids.append(read + reply + work + [tok.eos_token_id])
            env_mask.append([1] * len(read) + [0, 0] + [1] * 4)
            solved.append(float(torch.randint(2, ())))
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "env_mask": env_mask,
                "logprobs": [[float("nan")] * len(c) for c in completion_ids], "solved": solved}


def solved_reward(completions, solved, **kwargs):
    return [float(s) for s in solved]


class Record(Plugin):
    """Keeps every final batch and its advantages."""

    seen: list = []

    @hookimpl
    def on_batch_end(self, batch, advantages):
        Record.seen.append((batch, advantages.clone()))


def test_trains_on_rollouts_that_read_skills(tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    Record.seen.clear()
    data = tiny_dataset(32)
    data = data.add_column("gold_skill", ["pdf"] * len(data))
    trainer = train_tiny(["skillgate", Record], output_dir=tmp_path, rollout_func=SkillRollout(), dataset=data,
                         reward_funcs=[solved_reward], max_completion_length=32)
    logs = trainer.state.log_history[0]
    assert math.isfinite(logs["loss"]) and logs["trl_credit/skillgate/read_rate"] == 1.0
    assert logs["trl_credit/skillgate/reads"] == 1.0 and 0.0 < logs["trl_credit/skillgate/selector_token_share"] < 1.0
    batch, advantages = Record.seen[-1]
    assert int(batch.turns().count.max()) == 2 and advantages.dim() == 2
    torch.testing.assert_close(advantages, run_plugin(SkillGate, batch).advantages)
    # the selector tokens are exactly the read's tokens of turn 0, +1 for pdf and -1 for xls, whatever the outcome
    channel = plugin_set(SkillGate).plugins[0].instance.reads(batch)
    tok = tiny_tokenizer()
    for i in range(batch.num_completions):
        chosen = tok.decode(batch.completion_ids[i][channel["selector"][i]].tolist())
        assert chosen in ("<skill>pdf</skill>", "<skill>xls</skill>")
        assert advantages[i][channel["selector"][i]].eq(1.0 if "pdf" in chosen else -1.0).all()
