"""The bundled multi-turn game ``guess``, played through TRL's ``rollout_func`` by CreditGRPOTrainer."""

from __future__ import annotations

import pytest

from trl_credit import Plugin, hookimpl
from trl_credit.app.guess import GuessRollout, guess_reward, make_guess, parse_game, target_of


def test_games_prompts_and_secrets():
    ds = make_guess(20, seed=3, max_value=10, turns=3)
    games = ds["game"]
    assert len(set(games)) == 20 and all(1 <= int(a) <= 10 for a in ds["answer"])
    assert parse_game(ds["prompt"][0]) == (games[0], 10, 3) and ds["answer"][0] == str(target_of(games[0], 10))
    held = make_guess(5, seed=4, exclude_games=set(games))
    assert not set(held["game"]) & set(games)
    assert guess_reward(None, guess_solved=[1.0, 0.0]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="not a guess prompt"):
        parse_game("What is 1 + 1?")


class SeeTurns(Plugin):
    seen: list = []

    @hookimpl
    def on_batch_end(self, batch, advantages):
        SeeTurns.seen.append((batch.turns(), batch.column("guess_turns"), batch.column("guess_distance")))


def test_a_run_plays_the_game_turn_by_turn(tmp_path, monkeypatch):
    """The tiny model never guesses right: every game runs its 3 turns; it never ends a turn itself within 4
    tokens, so each turn's end-of-turn token is the environment's (mask 0): 2 replies + the last turn's end."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl import GRPOConfig

    from trl_credit.testing.tiny import tiny_model_path
    from trl_credit.trainer import CreditGRPOTrainer

    SeeTurns.seen.clear()
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=64, max_steps=1, logging_steps=1, report_to="none", save_strategy="no",
                      use_cpu=True, bf16=False, seed=0, learning_rate=1e-3, disable_tqdm=True)
    trainer = CreditGRPOTrainer(model=tiny_model_path(), reward_funcs=[guess_reward], args=args,
                                train_dataset=make_guess(16, seed=0), rollout_func=GuessRollout(max_new_tokens=4),
                                plugins=[SeeTurns])
    trainer.train()
    turns, played, distance = SeeTurns.seen[-1]
    assert played == [3] * 8 and turns.count.tolist() == [3] * 8 and turns.replies.tolist() == [3] * 8
    assert all(len(d) == 3 for d in distance)
    assert (turns.lengths <= 4).all()  # at most max_new_tokens per model turn (the end-of-turn included)


def test_distance_is_capped_at_the_range():
    from trl_credit.app.guess import distance_of

    assert [distance_of(g, 3, 4) for g in (1, 3, 4, 52341, -7)] == [2, 0, 1, 4, 4]


def test_guess_splits_keep_held_out_games_out_of_train_and_check_options():
    from trl_credit.app.data import load_train_eval

    train, heldout = load_train_eval("guess:n=40,eval_n=10,max_value=7,turns=4")
    assert len(train) == 40 and len(heldout) == 10
    assert not set(train["game"]) & set(heldout["game"])
    assert parse_game(train[0]["prompt"])[1:] == (7, 4)
    assert all(1 <= int(a) <= 7 for a in train["answer"])
    with pytest.raises(ValueError, match=r"unknown guess option\(s\) \['colour'\]"):
        load_train_eval("guess:colour=3")
    with pytest.raises(ValueError, match="eval_seed must differ"):
        load_train_eval("guess:seed=2,eval_seed=2")


def test_cli_trains_on_the_guess_task_and_reports_held_out_success(tmp_path, capsys):
    """`dataset_name: guess` plays the game through the rollout_func, rewards `guess_solved` by default,
    lets plugins read the rollout's fields, and reports held-out success and turns before and after."""
    import json
    import textwrap

    from trl_credit.app import cli
    from trl_credit.testing.tiny import tiny_model_path

    path = tmp_path / "run.yaml"
    path.write_text(textwrap.dedent(f"""\
        model_name_or_path: {tiny_model_path()}
        use_cpu: true
        bf16: false
        dataset_name: "guess:n=16,eval_n=4,turn_tokens=3"
        per_device_train_batch_size: 8
        num_generations: 4
        max_completion_length: 48
        max_steps: 1
        logging_steps: 1
        report_to: none
        save_strategy: "no"
        disable_tqdm: true
        output_dir: {tmp_path / "out"}
        heldout_samples: 4
        plugins:
          - {{name: dynamic_sampling, mode: replace}}
        """))
    assert cli.main(["validate", str(path)]) == 0
    assert cli.main(["train", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "held-out guess: success" in printed
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["heldout_accuracy_before"] == 0.0 and metrics["heldout_accuracy_after"] == 0.0  # random model
    assert metrics["heldout_turns"] == [3.0, 3.0]  # every game played to its last turn
    assert [f["games"] for f in metrics["heldout_feedback"]] == [4, 4]  # feedback_use, before and after
    assert all(f["follows"] == 0.0 for f in metrics["heldout_feedback"])  # the random model writes no numbers
    steps = [h for h in metrics["log_history"] if "loss" in h]
    assert len(steps) == 1 and steps[0]["rewards/guess_reward/mean"] == 0.0


class ScriptedGuesser:
    """A stand-in for a causal LM's ``generate``: reads the last guess and reply in each context and writes the
    next guess by ``policy(last_guess, reply)`` (None before the first guess), then the end-of-turn token."""

    def __init__(self, tokenizer, policy, template="{}"):
        import torch

        self.tok, self.policy, self.template, self.training = tokenizer, policy, template, False
        self._p = torch.nn.Parameter(torch.zeros(1))

    def parameters(self):
        return iter([self._p])

    def eval(self):
        return self

    def train(self, mode=True):
        return self

    def generate(self, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, **options):
        import re

        import torch

        assert options == {"do_sample": False}  # feedback_use plays greedily
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            text = self.tok.decode([t for t, m in zip(ids, mask) if m])
            guesses = re.findall(r"assistant\n(\d+)", text)
            replies = re.findall(r"user\n(Higher|Lower)\.", text)
            guess = self.policy(int(guesses[-1]) if guesses else None, replies[-1] if replies else None)
            new = self.tok(self.template.format(guess), add_special_tokens=False)["input_ids"] + [eos_token_id]
            rows.append(ids + new + [pad_token_id] * (max_new_tokens - len(new)))
        return torch.tensor(rows)


@pytest.mark.parametrize("policy,follows,changes", [
    (lambda g, r: 3 if g is None else (g + 2 if r == "Higher" else g - 2), 1.0, 1.0),  # halving 1..6: 3, then 5 or 1
    (lambda g, r: 1 if g is None else g + 1, 0.0, 0.0),  # the sweep 1, 2, 3: the reply changes nothing
    (lambda g, r: 3 if g is None else (g + 1 if r == "Higher" else g + 2), 0.0, 1.0),  # reads it, the wrong way
])
def test_feedback_use_tells_a_sweep_from_halving(policy, follows, changes):
    from trl_credit.app.guess import feedback_use
    from trl_credit.testing.tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    held = make_guess(5, seed=1, max_value=6, turns=3)
    result = feedback_use(ScriptedGuesser(tok, policy), tok, held, turn_tokens=4, batch_size=2)
    assert result == {"follows": follows, "changes": changes, "games": 5}


def test_strict_play_counts_only_a_turn_that_is_just_the_number():
    """The embedded model learns to enumerate ("1. I am thinking of", "2. ..."): read leniently that is the sweep
    1, 2, 3; with ``strict`` no turn guesses and every game is lost."""
    from trl_credit.app.guess import guess_of, guess_success, rollout_options
    from trl_credit.testing.tiny import tiny_tokenizer

    assert guess_of("2. I am thinking of") == 2 and guess_of("2. I am thinking of", strict=True) is None
    assert [guess_of(t, strict=True) for t in ("4", " 4.\n", "4 or 5", "four", "")] == [4, 4, None, None, None]
    assert rollout_options({}) == {"turn_tokens": 8, "strict": False}
    assert rollout_options({"strict": True, "turn_tokens": 6}) == {"turn_tokens": 6, "strict": True}
    with pytest.raises(ValueError, match="strict must be true or false"):
        rollout_options({"strict": "maybe"})
    tok = tiny_tokenizer()
    held = make_guess(12, seed=1, max_value=6, turns=3)
    secrets = [int(a) for a in held["answer"]]
    won = [s for s in secrets if s <= 3]  # the sweep 1, 2, 3 wins these, in s turns
    sweep = lambda g, r: 1 if g is None else g + 1  # noqa: E731
    lenient = guess_success(ScriptedGuesser(tok, sweep, "{}. I"), tok, held, turn_tokens=4, batch_size=5)
    assert lenient == {"success": len(won) / 12, "turns": (sum(won) + 3 * (12 - len(won))) / 12}
    strict = guess_success(ScriptedGuesser(tok, sweep, "{}. I"), tok, held, turn_tokens=4, batch_size=5, strict=True)
    assert strict == {"success": 0.0, "turns": 3.0}
    bare = guess_success(ScriptedGuesser(tok, sweep), tok, held, turn_tokens=4, batch_size=5, strict=True)
    assert bare == lenient  # a bare number is a guess either way


def test_halving_wins_every_game_and_each_turn_records_its_distance():
    """Played through the rollout: halving 1..6 (3; then 5 or 1; then 6, 4 or 2) wins every game in the turns binary
    search takes, which it can only do if "Higher." / "Lower." point the right way; and every turn records
    |guess - secret|, 0 on the winning one."""
    from trl_credit.app.guess import greedy_games, guess_success
    from trl_credit.testing.tiny import tiny_tokenizer

    nxt = {(None, None): 3, (3, "Higher"): 5, (3, "Lower"): 1, (5, "Higher"): 6, (5, "Lower"): 4, (1, "Higher"): 2}
    halving = lambda g, r: nxt[(g, r)]  # noqa: E731
    tok = tiny_tokenizer()
    held = make_guess(12, seed=1, max_value=6, turns=3)
    secrets = [int(a) for a in held["answer"]]
    path = {3: [3], 5: [3, 5], 1: [3, 1], 6: [3, 5, 6], 4: [3, 5, 4], 2: [3, 1, 2]}
    assert guess_success(ScriptedGuesser(tok, halving), tok, held, turn_tokens=4, batch_size=5) == {
        "success": 1.0, "turns": sum(len(path[s]) for s in secrets) / 12}
    games = greedy_games(ScriptedGuesser(tok, halving), tok, held, turn_tokens=4, batch_size=5)
    assert games["guess_distance"] == [[float(abs(g - s)) for g in path[s]] for s in secrets]
    sweep = greedy_games(ScriptedGuesser(tok, lambda g, r: 1 if g is None else g + 1), tok, held, turn_tokens=4,
                         batch_size=5)
    assert sweep["guess_distance"] == [[float(abs(g - s)) for g in (1, 2, 3)[:s]] for s in secrets]  # stops on a win
    assert sweep["guess_solved"] == [float(s <= 3) for s in secrets]
    # no sampling log-probs are kept: NaN (TRL's "not scored"), never 0.0 (probability 1)
    assert all(len(lp) == len(ids) and all(x != x for x in lp) for lp, ids in zip(games["logprobs"],
                                                                                games["completion_ids"]))


def test_validate_names_a_bad_strict_before_any_model_loads(tmp_path):
    from trl_credit.app.train_command import validate
    from trl_credit.config import ConfigError
    from trl_credit.testing.tiny import tiny_model_path

    path = tmp_path / "run.yaml"
    for value, ok in (("true", True), ("maybe", False)):
        path.write_text(f"model_name_or_path: {tiny_model_path()}\ndataset_name: guess:n=16,eval_n=4,strict={value}\n"
                        "per_device_train_batch_size: 8\nnum_generations: 4\noutput_dir: out\nuse_cpu: true\n")
        if ok:
            validate(str(path))
        else:
            with pytest.raises(ConfigError, match=r"dataset 'guess:n=16,eval_n=4,strict=maybe': guess: strict must be true"):
                validate(str(path))
