"""S-GRPO: methods.md 2.31's vector (both decays), exit points, the serial group's advantages beside the parallel
ones, the requests it makes (prefix + cue prompts), the contract, and a real run through TRL's generation."""

from __future__ import annotations

import torch

from trl_credit.testing import check_plugin, make_batch, run_plugin, tiny_tokenizer, train_tiny
from trl_credit_s_grpo import CONTEXT, CUE, SGRPO, exit_positions, serial_advantages, serial_rewards


def test_decaying_rewards_vector():
    correct = torch.tensor([[0, 1, 1, 0, 1]])
    r = serial_rewards(correct)
    torch.testing.assert_close(r, torch.tensor([[0.0, 1.0, 0.5, 0.0, 0.25]]))  # 1 / 2^(rank - 1)
    torch.testing.assert_close(serial_advantages(r), torch.tensor([[-0.35, 0.65, 0.15, -0.35, -0.10]]))
    positional = serial_rewards(correct, "position")  # 1 / 2^(j - 1)
    torch.testing.assert_close(positional, torch.tensor([[0.0, 0.5, 0.25, 0.0, 0.0625]]))


def test_exit_positions():
    assert exit_positions(10, 4) == [3, 5, 8, 10]  # floor(2.5 + .5), 5, floor(7.5 + .5), 10
    assert exit_positions(1, 4) == [1, 1, 1, 1]
    random = exit_positions(20, 4, "random", torch.Generator().manual_seed(0))
    assert random == sorted(random) and random[-1] == 20 and all(1 <= e < 20 for e in random[:-1])


def test_serial_rows_get_decayed_advantages_parallel_rows_keep_grpo():
    batch = make_batch([1, 0, 0, 1, 0, 1, 1, 1], 4, columns={"trl_credit_augmented": [None] * 4 + [CONTEXT] * 4})
    result = run_plugin(SGRPO, batch)
    # serial: correct [0, 1, 1, 1] -> r [0, 1, 0.5, 0.25], mean 0.4375
    torch.testing.assert_close(result.advantages[4:], torch.tensor([-0.4375, 0.5625, 0.0625, -0.1875]))
    grpo = 0.5 / (torch.tensor([1.0, 0, 0, 1]).std() + 1e-4)  # TRL's (r - mean) / (std + 1e-4)
    torch.testing.assert_close(result.advantages[:4], torch.tensor([grpo, -grpo, -grpo, grpo]), rtol=1e-5, atol=1e-6)
    assert result.metrics["s_grpo/first_correct_exit"] == 2.0 and result.metrics["s_grpo/exit_accuracy"] == 0.75


def test_an_unscored_exit_is_out_of_the_serial_mean_and_gets_nothing():
    batch = make_batch([1, 0, 0, 1, 0, 1, None, 1], 4, columns={"trl_credit_augmented": [None] * 4 + [CONTEXT] * 4})
    result = run_plugin(SGRPO, batch)
    # serial: correct [0, 1, -, 1] -> r [0, 1, (0), 0.5]; the scored mean 0.5; the third exit gets 0
    torch.testing.assert_close(result.advantages[4:], torch.tensor([-0.5, 0.5, 0.0, 0.0]))


def test_requests_continue_the_first_completion_of_each_group_after_the_cue():
    tok = tiny_tokenizer()
    texts = ["1 + 2 = 3 so", "x", "4 + 4 = 8", "y"]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    batch = make_batch([1, 0, 1, 0], 2, completion_ids=ids, completions=texts, tokenizer=tok, prompts=["Q1:"] * 2
                       + ["Q2:"] * 2)
    from trl_credit.testing import plugin_set

    plugin = plugin_set(SGRPO).plugins[0].instance
    requests = plugin.augment_rollouts(batch)
    assert [r.group for r in requests] == [0, 1] and all(r.context == CONTEXT for r in requests)
    ends = exit_positions(len(ids[0]), 2)
    assert requests[0].prompts == [f"Q1:{tok.decode(ids[0][:e])}{CUE}" for e in ends]
    assert requests[0].prompts[-1] == f"Q1:{texts[0]}{CUE}"  # the last exit is the full path
    capped = plugin_set(SGRPO, {"max_groups": 1}).plugins[0].instance.augment_rollouts(batch)
    assert len(capped) == 1


def test_contract():
    tok = tiny_tokenizer()
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in ("1 + 1 = 2", "", "3", "4 4")]

    def edge():  # a real tokenizer, an empty completion, one serial group
        return make_batch([1, 0, 1, None], 2, completion_ids=ids, tokenizer=tok,
                          columns={"trl_credit_augmented": [None, None, CONTEXT, CONTEXT]})

    check_plugin(SGRPO, batches=[edge])


def test_trains_with_serial_groups_through_trls_generation(tmp_path):
    trainer = train_tiny([{"name": "s_grpo", "max_groups": 1}], output_dir=tmp_path, max_steps=2,
                         max_completion_length=6)
    logs = trainer.state.log_history[0]
    assert logs["trl_credit/augmented_groups"] == 1.0 and logs["trl_credit/s_grpo/serial_groups"] == 1.0
    assert logs["trl_credit/augmented_tokens"] > 0 and logs["trl_credit/cost/augment_seconds"] > 0
