"""IGPO: methods.md 2.26's vectors (information gain, joint normalisation, accumulation), the gold-token
probability read from the prefix scorer, step broadcasting, edge cases, the contract and a real training run."""

from __future__ import annotations

import math

import pytest
import torch

from trl_credit.testing import check_plugin, make_batch, run_plugin, tiny_dataset, tiny_tokenizer, train_tiny
from trl_credit_igpo import IGPO, IGPO_CUE, accumulate, information_gain, normalise


def test_information_gain_vector():
    rewards, valid = information_gain(torch.tensor([[0.1, 0.4, 0.5]]), torch.tensor([3]), torch.tensor([1.0]))
    torch.testing.assert_close(rewards, torch.tensor([[0.3, 0.1, 1.0]]))  # IG [0.3, 0.1], then the outcome
    assert valid.all()


def test_joint_normalisation_and_accumulation_vector():
    # c1 turn rewards [0.3, 0.1, F1 = 1.0], c2 [-0.05, F1 = 0.0]: mu = 0.27, sigma = sqrt(0.1476 + 1e-8) = 0.384187
    rewards = torch.tensor([[0.3, 0.1, 1.0], [-0.05, 0.0, 0.0]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    z = normalise(rewards, valid, 2)
    assert z[0, 2].item() == pytest.approx((1.0 - 0.27) / (math.sqrt(0.1476 + 1e-8) + 1e-6), abs=1e-6)
    advantages = accumulate(z, 1.0)
    torch.testing.assert_close(advantages, torch.tensor([[1.535705, 1.457618, 1.900109], [-1.535705, -0.702780, 0.0]]),
                               atol=1e-5, rtol=0)
    half = accumulate(z, 0.5)  # A_k = z_k + 0.5 A_k+1
    assert half[0, 0].item() == pytest.approx(z[0, 0].item() + 0.5 * (z[0, 1].item() + 0.5 * z[0, 2].item()), abs=1e-6)


TEXTS = ["1 + 1 = 2\nso 2 + 3 = 5\n5", "2 + 3 = 5\n5"]  # three steps, two steps
P = {0: [0.1, 0.4, 0.5], 1: [0.2, 0.15]}  # gold probability before each turn


def igpo_batch(texts=TEXTS, outcome=(1.0, 0.0), p=P, gold=None, **kw):
    tok = tiny_tokenizer()
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    boundaries = {}  # (row, prefix end) -> P

    def prefix_logps_fn(row, end, text, model):
        n = len(tok(text, add_special_tokens=False)["input_ids"])
        return [math.log(boundaries[(row, end)])] * n  # every token (cue and gold) at log P: the gold mean is log P

    batch = make_batch(list(outcome), len(texts), completion_ids=ids, completions=texts, tokenizer=tok,
                       columns={"answer": gold or ["5"] * len(texts)}, prefix_logps_fn=prefix_logps_fn, **kw)
    from trl_credit import step_ends

    ends = step_ends(batch)
    for row, values in p.items():
        before = [0] + [e for e in ends[row].tolist() if e >= 0][:-1]
        for end, value in zip(before, values):
            boundaries[(row, end)] = value
    return batch, ids


def test_end_to_end_advantages_on_the_tokens_of_each_step():
    batch, ids = igpo_batch()
    result = run_plugin(IGPO, batch)
    a = result.advantages
    expected = [[1.535705, 1.457618, 1.900109], [-1.535705, -0.702780]]
    from trl_credit import token_steps

    index, _ = token_steps(batch, r"\n+", fill=True)
    for row in range(2):
        for t in range(len(ids[row])):
            assert a[row, t].item() == pytest.approx(expected[row][int(index[row, t])], abs=1e-4), (row, t)
    assert result.metrics["igpo/mean_information_gain"] == pytest.approx((0.3 + 0.1 - 0.05) / 3, abs=1e-6)
    assert result.metrics["igpo/turns"] == 2.5


def test_an_unscored_completion_is_not_scored_and_leaves_the_statistics():
    # a third member no reward function scored: no prefix is scored for it (the scorer has no P for row 2 and
    # would raise), its turns enter no normalisation, and it gets 0
    batch, ids = igpo_batch(TEXTS + ["1 + 2 = 3\n3"], outcome=(1.0, 0.0, None))
    a = run_plugin(IGPO, batch).advantages
    expected = [[1.535705, 1.457618, 1.900109], [-1.535705, -0.702780]]
    from trl_credit import token_steps

    index, _ = token_steps(batch, r"\n+", fill=True)
    for row in range(2):
        for t in range(len(ids[row])):
            assert a[row, t].item() == pytest.approx(expected[row][int(index[row, t])], abs=1e-4), (row, t)
    assert (a[2] == 0).all()


def test_the_cue_is_context_and_the_gold_tokens_alone_are_averaged():
    tok = tiny_tokenizer()
    texts = ["a\nb"]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    seen = []

    def fn(row, end, text, model):  # the host passes the scored text only: the gold, without the cue
        seen.append(text)
        return [math.log(0.5), math.log(0.125)]

    batch = make_batch([1.0, 0.0], 2, completion_ids=ids * 2, completions=texts * 2, tokenizer=tok,
                       columns={"answer": ["12", "12"]}, prefix_logps_fn=fn)
    p = IGPO().gold_probability(batch, torch.tensor([[0, 1], [0, -1]]))
    torch.testing.assert_close(p[0], torch.tensor([0.25, 0.25]))  # exp(mean(log 0.5, log 0.125)) = 0.25
    assert p[1, 0].item() == pytest.approx(0.25) and math.isnan(p[1, 1])
    assert set(seen) == {"12"} and IGPO_CUE.strip()


def test_separate_mode_normalises_gains_and_outcomes_apart():
    batch, _ = igpo_batch()
    a = run_plugin(IGPO, batch, {"mode": "separate"}).advantages
    gains = torch.tensor([0.3, 0.1, -0.05])
    zg = (gains - gains.mean()) / ((((gains - gains.mean()) ** 2).mean() + 1e-8).sqrt() + 1e-6)
    outcomes = torch.tensor([1.0, 0.0])
    zo = (outcomes - 0.5) / (math.sqrt(0.25 + 1e-8) + 1e-6)
    # c2's last turn (its outcome) is its second step: A = zo[1]; its first step: zg[2] + zo[1]
    assert a[1, -1].item() == pytest.approx(0.0)  # padding
    expected_c1_first = zg[0] + zg[1] + zo[0]
    assert a[0, 0].item() == pytest.approx(expected_c1_first.item(), abs=1e-4)


def test_edge_cases_empty_completion_one_step_and_nan_outcome():
    texts = ["1 + 1 = 2\n2", "2", "3", "4"]
    # only row 0 has two steps: the one-step rows earn their outcome and read no P (the scorer raises for them)
    batch, ids = igpo_batch(texts, outcome=(1.0, None, 0.0, 1.0), p={0: [0.2, 0.6]})
    a = run_plugin(IGPO, batch).advantages
    assert torch.isfinite(a).all()
    assert torch.equal(a[1], torch.zeros_like(a[1]))  # NaN outcome: its only turn gets 0
    # one-step completions hold only their outcome: pure outcome credit, sign of (o - mu)
    assert a[2, 0] < 0 < a[3, 0]


def test_a_row_without_a_gold_answer_keeps_only_its_outcome():
    # a third member with no gold answer (None): no prefix is scored for it (the scorer would raise), its steps
    # earn no IG and enter no pool; its last step holds its outcome, which joins the pool as usual
    texts = TEXTS + ["1 + 2 = 3\n3"]
    batch, ids = igpo_batch(texts, outcome=(1.0, 0.0, 1.0), gold=["5", "5", None])
    a = run_plugin(IGPO, batch).advantages
    from trl_credit import token_steps

    index, _ = token_steps(batch, r"\n+", fill=True)
    first = index[2, : len(ids[2])] == 0
    assert (a[2, : len(ids[2])][first] == a[2, len(ids[2]) - 1]).all()  # its first step carries its outcome's z only
    assert a[2, len(ids[2]) - 1] > 0  # a correct outcome in a pool of [IG..., 1, 0, 1]


def test_a_bad_pattern_is_a_config_error():
    from trl_credit import ConfigError

    with pytest.raises(ConfigError, match="pattern"):
        run_plugin(IGPO, igpo_batch()[0], {"pattern": "("})


def test_check_args_refuses_a_reference_without_one():
    from trl_credit import ConfigError
    from trl_credit.testing import check_args

    with pytest.raises(ConfigError, match=r"\(igpo\) reads the reference model with these options, but this run has none \(no PEFT adapter, beta 0\): train a PEFT adapter"):
        check_args(IGPO, {"model": "reference"}, peft=False)
    check_args(IGPO, {"model": "reference"}, peft=True)
    check_args(IGPO, {}, peft=False)


def test_contract():
    batch, _ = igpo_batch()
    check_plugin(IGPO, batches=[lambda: igpo_batch()[0]])


def test_trains_on_the_tiny_model(tmp_path):
    dataset = tiny_dataset(32)
    trainer = train_tiny([{"name": "igpo", "max_steps": 3}], output_dir=tmp_path, dataset=dataset,
                         max_completion_length=12)
    logs = trainer.state.log_history[0]
    assert math.isfinite(logs["trl_credit/igpo/turns"]) and logs["trl_credit/cost/prefix_sequences"] > 0
    assert trainer.state.log_history[-1]["train_loss"] is not None


def test_turn_mode_on_a_multi_turn_rollout_reproduces_the_vector():
    # c1: model turns at tokens 0-1, 4-5, 7 (environment replies at 2-3 and 6); c2: turns at 0-1 and 3
    tool = [[1, 1, 0, 0, 1, 1, 0, 1], [1, 1, 0, 1, 0, 0, 0, 0]]
    mask = [[1] * 8, [1, 1, 1, 1, 0, 0, 0, 0]]
    p = {(0, 0): 0.1, (0, 4): 0.4, (0, 7): 0.5, (1, 0): 0.2, (1, 3): 0.15}  # before each turn (after the reply)
    seen = []

    def fn(row, end, text, model):
        seen.append((row, end))
        return [math.log(p[(row, end)])]

    batch = make_batch([1.0, 0.0], 2, completion_mask=mask, tool_mask=tool, columns={"answer": ["5", "5"]},
                       prefix_logps_fn=fn)
    a = run_plugin(IGPO, batch, {"segments": "turns"}).advantages
    assert sorted(seen) == sorted(p)  # the prefix before turn k ends where turn k begins
    expected = torch.tensor([[1.535705, 1.535705, 0, 0, 1.457618, 1.457618, 0, 1.900109],
                             [-1.535705, -1.535705, 0, -0.702780, 0, 0, 0, 0]])
    torch.testing.assert_close(a, expected, atol=1e-5, rtol=0)  # environment tokens get 0
    capped = run_plugin(IGPO, batch, {"segments": "turns", "max_steps": 2}).advantages
    # c1's turns 0 and 1 merge into its first kept turn (prefix 0), turn 2 starts at 7: gains [0.5 - 0.1, 0.15 - 0.2]
    pool = torch.tensor([0.4, 1.0, -0.05, 0.0])  # c1: IG, outcome; c2: IG, outcome
    z = (pool - pool.mean()) / ((((pool - pool.mean()) ** 2).mean() + 1e-8).sqrt() + 1e-6)
    first, last = z[0] + z[1], z[1]
    expected = torch.tensor([[first, first, 0, 0, first, first, 0, last],
                             [z[2] + z[3], z[2] + z[3], 0, z[3], 0, 0, 0, 0]])
    torch.testing.assert_close(capped, expected, atol=1e-5, rtol=0)
    assert capped[0, 0].item() == pytest.approx(1.724630, abs=1e-5)


def test_turn_mode_reads_no_probability_for_one_turn_rows():
    """A one-turn row earns its outcome; IGPO scores no prefix for it (the scorer raises if asked), and a batch
    without any model turn (every row masked as truncated) gives zeros."""
    def fn(row, end, text, model):
        raise AssertionError(f"scored row {row} at {end}")

    batch = make_batch([1.0, 0.0], 2, completion_mask=[[1] * 4] * 2, tool_mask=[[1] * 4] * 2,
                       columns={"answer": ["5", "5"]}, prefix_logps_fn=fn)
    a = run_plugin(IGPO, batch, {"segments": "turns"}).advantages
    torch.testing.assert_close(a, torch.tensor([[1.0] * 4, [-1.0] * 4]), atol=1e-5, rtol=0)
    empty = make_batch([1.0, 0.0], 2, completion_mask=[[0] * 4] * 2, tool_mask=[[1] * 4] * 2,
                       columns={"answer": ["5", "5"]}, prefix_logps_fn=fn)
    assert torch.equal(run_plugin(IGPO, empty, {"segments": "turns"}).advantages, torch.zeros(2, 4))


def test_turn_mode_on_a_real_multi_turn_run_is_what_trains(tmp_path):
    """A real run on the kit's scripted multi-turn rollouts. What TRL's loss trained on is IGPO's output on the
    recorded batch, and that output is the paper's composition rebuilt here from the vector-tested pieces:
    P before each turn (after the environment's reply) -> information gain, the last turn's outcome -> joint z-score
    over the group -> backward sum, on the model's tokens (0 on the environment's)."""
    from trl_credit.testing import train_scripted_turns

    options = {"segments": "turns"}
    trainer, batch, trained = train_scripted_turns({"name": "igpo", **options}, output_dir=tmp_path)
    logs = trainer.state.log_history[0]
    assert math.isfinite(logs["loss"]) and logs["trl_credit/cost/prefix_sequences"] > 0
    turns = batch.turns()
    seen = ~trained.isnan()  # the positions the loss received (the kit checked them against run_plugin)
    assert trained.dim() == 2
    assert trained[seen & turns.model].abs().sum() > 0 and trained[seen & turns.env].abs().sum() == 0
    # rebuilt: P_k read where turn k starts (turn 0: after the prompt), only for rows of two or more turns
    count = turns.count
    k = torch.arange(turns.max_turns).unsqueeze(0)
    before = torch.where((k < count.unsqueeze(1)) & (count >= 2).unsqueeze(1), turns.starts(), -1)
    before[:, 0] = torch.where(count >= 2, 0, -1)
    gold = [str(a) for a in batch.column("answer")]
    p = batch.prefix_logps(before, gold, model="policy", reduce="mean", context=IGPO_CUE).exp().nan_to_num(0.0)
    rewards, valid = information_gain(p, count.clamp(min=1), batch.total_reward())
    rebuilt = turns.broadcast(accumulate(normalise(rewards, valid, batch.num_generations), 1.0))
    torch.testing.assert_close(trained[seen], rebuilt[seen], atol=1e-5, rtol=0)
