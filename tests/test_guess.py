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
