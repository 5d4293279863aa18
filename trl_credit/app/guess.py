"""``guess``: a bundled offline multi-turn task, a number-guessing game played through TRL's ``rollout_func``.

The prompt says "Game <k>: I am thinking of a whole number from 1 to <m>. You have <t> guesses...";
the model answers with a number, the environment replies "Higher." or "Lower." (or "Reply with just a
number."), for at most ``t`` turns or until the guess is right. The secret is a deterministic function
of the game number (`target_of`), so the rollout needs nothing but the prompt. One completion is the
whole transcript after the prompt: the model's turns (``env_mask`` 1) and the replies (0), exactly as
TRL's multi-turn paths build it, so the loss trains on the model's tokens only and ``batch.turns()``
sees the turns.

Verifiable outcome: ``guess_solved`` (1.0 when a guess was right). Verifiable per-turn progress:
``guess_distance`` (|guess - secret| after each turn, capped at ``max_value`` so that an out-of-range guess such
as an echoed game number cannot dwarf the in-range ones; None when the turn held no number). Both reach
the reward functions (and ``batch.column``) as TRL passes a rollout's extra fields.
"""

from __future__ import annotations

import random
import re
from typing import Any

__all__ = ["ROLLOUT_FIELDS", "GuessRollout", "distance_of", "feedback_use", "guess_of", "greedy_games", "guess_reward", "guess_splits", "guess_success", "make_guess", "parse_game",
           "target_of"]

#: the fields every guess rollout adds to its rows (reward functions and `RolloutBatch.column` read them)
ROLLOUT_FIELDS = ("guess_solved", "guess_distance", "guess_turns")
#: ``guess:`` options that shape the rollout rather than the dataset
ROLLOUT_OPTIONS = {"turn_tokens": 8, "strict": False}
_BARE = re.compile(r"\s*(\d+)\.?\s*")  # a turn that is just a whole number (a closing period allowed)

_PROMPT = ("Game {game}: I am thinking of a whole number from 1 to {max_value}. You have {turns} guesses. "
           "Answer with just the number you guess; after each guess I say higher or lower.")
_PARSE = re.compile(r"Game (\d+): I am thinking of a whole number from 1 to (\d+)\. You have (\d+) guesses")


def target_of(game: int, max_value: int) -> int:
    """The secret number of a game (Knuth's multiplicative hash: spread over 1..max_value)."""
    return 1 + (game * 2654435761) % (2**32) % max_value


def parse_game(prompt: Any) -> tuple[int, int, int]:
    """``(game, max_value, turns)`` from a guess prompt (a string or chat messages)."""
    text = prompt if isinstance(prompt, str) else " ".join(str(m.get("content", "")) for m in prompt)
    match = _PARSE.search(text)
    if match is None:
        raise ValueError(f"not a guess prompt: {text[:120]!r}")
    return int(match.group(1)), int(match.group(2)), int(match.group(3))


def make_guess(n: int = 1000, seed: int = 0, max_value: int = 5, turns: int = 3, *,
               exclude_games: set[int] | frozenset[int] = frozenset()) -> Any:
    """``n`` games as a ``datasets.Dataset``: ``prompt`` (one user message), ``game``, ``answer`` (the secret)."""
    from datasets import Dataset

    if max_value < 2 or turns < 1 or n < 0:
        raise ValueError(f"guess: need max_value >= 2, turns >= 1, n >= 0; got {max_value}, {turns}, {n}")
    rng = random.Random(seed)
    games: list[int] = []
    seen = set(exclude_games)
    while len(games) < n:
        game = rng.randrange(1, 10**6)
        if game not in seen:
            seen.add(game)
            games.append(game)
    return Dataset.from_dict({
        "prompt": [[{"role": "user", "content": _PROMPT.format(game=g, max_value=max_value, turns=turns)}]
                   for g in games],
        "game": games,
        "answer": [str(target_of(g, max_value)) for g in games],
    })


def guess_splits(options: dict[str, Any]) -> tuple[Any, Any]:
    """``(train, eval)`` for ``dataset_name: guess:key=value,...``: ``n`` (1000), ``max_value`` (5), ``turns``
    (3), ``seed`` (0), ``eval_n`` (50), ``eval_seed`` (seed + 1); held-out games never occur in train.
    ``turn_tokens`` and ``strict`` belong to the rollout (`rollout_options`)."""
    options = {k: v for k, v in options.items() if k not in ROLLOUT_OPTIONS}
    known = {"n", "max_value", "turns", "seed", "eval_n", "eval_seed"}
    unknown = set(options) - known
    if unknown:
        raise ValueError(f"unknown guess option(s) {sorted(unknown)}; known: {sorted(known | set(ROLLOUT_OPTIONS))}")
    seed = int(options.get("seed", 0))
    eval_seed = int(options.get("eval_seed", seed + 1))
    if eval_seed == seed:
        raise ValueError("eval_seed must differ from seed")
    shape = {"max_value": int(options.get("max_value", 5)), "turns": int(options.get("turns", 3))}
    eval_ds = make_guess(int(options.get("eval_n", 50)), seed=eval_seed, **shape)
    train_ds = make_guess(int(options.get("n", 1000)), seed=seed, exclude_games=set(eval_ds["game"]), **shape)
    return train_ds, eval_ds


def rollout_options(options: dict[str, Any]) -> dict[str, Any]:
    """The rollout's options from a ``guess:`` spec (defaults filled in), validated: ``turn_tokens`` (8, tokens per
    model turn) and ``strict`` (false; true: a turn's guess counts only when the turn is just the number, see
    `guess_of`)."""
    strict = options.get("strict", ROLLOUT_OPTIONS["strict"])
    if strict not in (True, False, 0, 1):
        raise ValueError(f"guess: strict must be true or false, got {strict!r}")
    out = {"turn_tokens": int(options.get("turn_tokens", ROLLOUT_OPTIONS["turn_tokens"])), "strict": bool(strict)}
    if out["turn_tokens"] < 1:
        raise ValueError(f"guess: turn_tokens must be >= 1, got {out['turn_tokens']}")
    return out


def greedy_games(model: Any, tokenizer: Any, dataset: Any, turn_tokens: int = 8, batch_size: int = 16,
                 strict: bool = False) -> dict[str, list]:
    """Greedy play of ``dataset``'s games in batches of ``batch_size``, as held-out evaluation plays them: the
    `GuessRollout` fields of every game, in order (``completion_ids``, ``env_mask``, ``guess_solved``, ...)."""
    from types import SimpleNamespace

    holder = SimpleNamespace(processing_class=tokenizer, model=model, temperature=1.0,
                             accelerator=SimpleNamespace(unwrap_model=lambda m: m))
    rollout = GuessRollout(max_new_tokens=turn_tokens, greedy=True, strict=strict)
    games: dict[str, list] = {}
    prompts = list(dataset["prompt"])
    for start in range(0, len(prompts), batch_size):  # a loop over batches of games
        for key, values in rollout(prompts[start:start + batch_size], holder).items():
            games.setdefault(key, []).extend(values)
    return games


def guess_success(model: Any, tokenizer: Any, dataset: Any, turn_tokens: int = 8, batch_size: int = 16,
                  strict: bool = False) -> dict[str, float]:
    """Greedy play of ``dataset``'s games: ``success`` (fraction solved) and ``turns`` (mean turns played,
    a solved game stopping at its winning guess), for held-out evaluation before and after training."""
    games = greedy_games(model, tokenizer, dataset, turn_tokens, batch_size, strict)
    solved, turns = games.get("guess_solved", []), games.get("guess_turns", [])
    n = max(len(solved), 1)
    return {"success": sum(solved) / n, "turns": sum(turns) / n}


def guess_of(text: str, strict: bool = False) -> int | None:
    """The guess a model turn makes: the last whole number in its text, or None. ``strict``: only a turn that is
    just the number (``"4"``, ``" 4.\n"``) makes one, so an enumeration such as ``"2. I am thinking of"`` does not
    guess 2 (the prompt asks for just the number)."""
    from trl_credit.answers import last_number

    if strict:
        bare = _BARE.fullmatch(text)
        return int(bare.group(1)) if bare else None
    value = last_number(text)
    return int(value) if value is not None and value == value.to_integral_value() else None


def feedback_use(model: Any, tokenizer: Any, dataset: Any, turn_tokens: int = 8, batch_size: int = 16,
                 strict: bool = False) -> dict[str, float | int]:
    """Does greedy play read the feedback? A counterfactual test on each game: the model's first guess ``g1``, then
    its second guess after the reply "Higher." and, separately, after "Lower.".

    - ``follows``: the fraction of games where both second guesses move as told (above ``g1`` after "Higher.",
      below it after "Lower."). A fixed sweep scores 0 (its second guess is the same after either reply), halving
      the range 1. Games without a numeric first guess count as not following.
    - ``changes``: the fraction where the two second guesses differ at all (reading the reply in any way).
    - ``games``: how many games were tested.

    Greedy success alone cannot tell a sweep from feedback use: on 1..6 in 3 turns the sweep "1, 2, 3" wins 0.625.
    """
    def number(ids: list[int]) -> int | None:
        return guess_of(tokenizer.decode(ids, skip_special_tokens=True), strict)

    rollout = GuessRollout(max_new_tokens=turn_tokens, greedy=True, strict=strict)
    eos = tokenizer.eos_token_id
    follows = changes = 0
    prompts = list(dataset["prompt"])
    for start in range(0, len(prompts), batch_size):  # a loop over batches of games
        messages = [list(p) for p in prompts[start:start + batch_size]]
        heads = [list(tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)
                      ["input_ids"]) for m in messages]
        first = [ids if ids and ids[-1] == eos else ids + [eos] for ids in rollout._generate(model, tokenizer, heads, 1.0)]
        for m, ids in zip(messages, first):
            m.append({"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)})
        second = {reply: [number(ids) for ids in rollout._generate(
            model, tokenizer, [h + f + rollout._reply_ids(tokenizer, m, reply) for h, f, m in zip(heads, first, messages)],
            1.0)] for reply in ("Higher.", "Lower.")}
        for j, ids in enumerate(first):  # a loop over the batch's games
            g1, up, down = number(ids), second["Higher."][j], second["Lower."][j]
            changes += up != down
            follows += None not in (g1, up, down) and up > g1 > down
    n = len(prompts)
    return {"follows": follows / max(n, 1), "changes": changes / max(n, 1), "games": n}


def distance_of(guess: int, secret: int, max_value: int) -> int:
    """The per-turn progress signal: ``|guess - secret|``, capped at ``max_value`` (an out-of-range guess such as
    an echoed game number must not dwarf the in-range ones)."""
    return min(abs(guess - secret), max_value)


def guess_reward(completions: Any, guess_solved: list[float], **kwargs: Any) -> list[float]:
    """1.0 when the game was solved within its turns, else 0.0 (from the rollout's ``guess_solved``)."""
    return [float(s) for s in guess_solved]


class GuessRollout:
    """TRL ``rollout_func``: plays each prompt's game with the trainer's model, a batched ``generate`` per turn.

    Sampling follows the trainer's ``temperature`` (``greedy=True``: greedy, for held-out evaluation); each
    model turn has at most ``max_new_tokens`` tokens and ends with the end-of-turn token (added, and marked
    as not the model's, when the model ran out of tokens). ``strict``: see `guess_of`.
    """

    #: the extra fields every rollout returns (the host checks plugins' ``required_turn_values`` against them)
    fields = ROLLOUT_FIELDS

    def __init__(self, max_new_tokens: int = 8, greedy: bool = False, strict: bool = False):
        self.max_new_tokens, self.greedy, self.strict = max_new_tokens, greedy, strict

    def __call__(self, prompts: list, trainer: Any) -> dict[str, Any]:
        tok = trainer.processing_class
        model = trainer.accelerator.unwrap_model(trainer.model)
        eos = tok.eos_token_id
        games = [parse_game(p) for p in prompts]
        secrets = [target_of(g, m) for g, m, _ in games]
        messages = [list(p) for p in prompts]
        prompt_ids = [list(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)
                           ["input_ids"]) for m in messages]
        context = [list(ids) for ids in prompt_ids]
        completion = [[] for _ in prompts]
        env_mask = [[] for _ in prompts]
        solved = [0.0] * len(prompts)
        distance: list[list[float | None]] = [[] for _ in prompts]
        active = list(range(len(prompts)))
        turn = 0
        was_training = model.training
        model.eval()
        try:
            while active and turn < max(t for _, _, t in games):
                active = [i for i in active if turn < games[i][2]]
                if not active:
                    break
                new = self._generate(model, tok, [context[i] for i in active], getattr(trainer, "temperature", 1.0))
                still = []
                for i, ids in zip(active, new):  # a loop over rows, bounded by the batch
                    forced = not ids or ids[-1] != eos
                    ids = ids + [eos] if forced else ids
                    completion[i] += ids
                    env_mask[i] += [1] * (len(ids) - 1) + [0 if forced else 1]
                    text = tok.decode(ids, skip_special_tokens=True)
                    guess = guess_of(text, self.strict)
                    distance[i].append(None if guess is None else float(distance_of(guess, secrets[i], games[i][1])))
                    messages[i].append({"role": "assistant", "content": text})
                    if guess == secrets[i]:
                        solved[i] = 1.0
                        continue
                    if turn + 1 < games[i][2]:
                        reply = ("Reply with just a number." if guess is None else
                                 "Higher." if guess < secrets[i] else "Lower.")
                        reply_ids = self._reply_ids(tok, messages[i], reply)
                        completion[i] += reply_ids
                        env_mask[i] += [0] * len(reply_ids)
                        messages[i].append({"role": "user", "content": reply})
                        still.append(i)
                    context[i] = prompt_ids[i] + completion[i]
                for i in still:
                    context[i] = prompt_ids[i] + completion[i]
                active = still
                turn += 1
        finally:
            model.train(was_training)
        return {"prompt_ids": prompt_ids, "completion_ids": completion, "env_mask": env_mask,
                # NaN: not scored (the turns are sampled by `generate`, which keeps no log-probs). TRL reads a NaN
                # sampling log-prob as "no evidence": no importance correction, no off-policy drop; 0.0 would claim
                # every token had probability 1
                "logprobs": [[float("nan")] * len(c) for c in completion], "guess_solved": solved,
                "guess_distance": distance, "guess_turns": [len(d) for d in distance]}

    def _generate(self, model: Any, tok: Any, contexts: list[list[int]], temperature: float) -> list[list[int]]:
        import torch

        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        width = max(len(c) for c in contexts)
        device = next(model.parameters()).device
        ids = torch.full((len(contexts), width), pad, dtype=torch.long)
        mask = torch.zeros((len(contexts), width), dtype=torch.long)
        for j, c in enumerate(contexts):  # left padding
            ids[j, width - len(c):] = torch.tensor(c)
            mask[j, width - len(c):] = 1
        options: dict[str, Any] = {"do_sample": False} if self.greedy else {
            "do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        with torch.no_grad():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                 max_new_tokens=self.max_new_tokens, eos_token_id=tok.eos_token_id,
                                 pad_token_id=pad, **options)
        rows = []
        for row in out[:, width:].tolist():
            cut = next((k + 1 for k, t in enumerate(row) if t == tok.eos_token_id), len(row))
            rows.append(row[:cut])
        return rows

    @staticmethod
    def _reply_ids(tok: Any, messages: list[dict[str, str]], reply: str) -> list[int]:
        """Token ids of the environment's reply as the chat template renders it after the model's turn."""
        head = tok.apply_chat_template(messages, tokenize=False)
        full = tok.apply_chat_template([*messages, {"role": "user", "content": reply}], tokenize=False,
                                       add_generation_prompt=True)
        if not full.startswith(head):
            raise ValueError("guess: the chat template is not prefix-stable; cannot render the reply")
        after_eos = head[head.rindex(tok.eos_token) + len(tok.eos_token):] if tok.eos_token in head else ""
        return list(tok(after_eos + full[len(head):], add_special_tokens=False)["input_ids"])
