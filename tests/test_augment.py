"""``augment_rollouts``: more completions for chosen groups from a changed prompt, through TRL's generation."""

from __future__ import annotations

import copy

import pytest
import torch

from trl_credit import Augmentation, Plugin, hookimpl
from trl_credit.augment import AUGMENTED, SOURCE_PROMPT
from trl_credit.pipeline import PluginRuntimeError

HINT = "Hint: add the two numbers."


def char_count(completions, **kwargs):
    """A deterministic reward of the completion text (so the augmented rows' rewards can be recomputed)."""
    text = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(len(t)) for t in text]


class HintGroupZero(Plugin):
    replace = False
    seen: list = []

    @hookimpl
    def augment_rollouts(self, batch):
        prompt = [{"role": "system", "content": HINT}, *batch.prompts[0]]
        return [Augmentation(0, prompt, context=HINT, replace=HintGroupZero.replace)]

    @hookimpl
    def on_batch_end(self, batch, advantages):
        HintGroupZero.seen.append((batch, advantages))


def _round(make_trainer, arithmetic, plugin=HintGroupZero, **overrides):
    HintGroupZero.seen.clear()
    trainer = make_trainer(plugins=[plugin], reward_funcs=[char_count], **overrides)
    trainer.model.train()
    torch.manual_seed(0)
    rows = trainer.train_dataset  # with the prompt index column the host adds
    out = trainer._generate_and_score_completions([copy.deepcopy(rows[i // 4]) for i in range(8)])
    return trainer, out


def test_an_augmented_group_is_generated_scored_and_added(make_trainer, arithmetic):
    trainer, out = _round(make_trainer, arithmetic)
    batch, advantages = HintGroupZero.seen[-1]
    assert out["completion_ids"].shape[0] == 12 and batch.num_groups == 3 and advantages.shape == (12,)
    marks = batch.column(AUGMENTED)
    assert marks[:8] == [None] * 8 and marks[8:] == [HINT] * 4
    assert batch.column(SOURCE_PROMPT)[8:] == [batch.prompts[0]] * 4 and batch.column(SOURCE_PROMPT)[0] is None
    assert all(p[0]["content"] == HINT for p in batch.prompts[8:])
    # scored with the run's reward function, by TRL
    assert batch.rewards[8:, 0].tolist() == char_count(batch.completions[8:])
    # the loss sees the hinted prompt the completions were generated from
    tok = trainer.processing_class
    assert all(HINT in tok.decode(ids[mask.bool()]) for ids, mask in zip(out["prompt_ids"][8:], out["prompt_mask"][8:]))
    assert not any(HINT in tok.decode(ids[mask.bool()]) for ids, mask in zip(out["prompt_ids"][:8], out["prompt_mask"][:8]))
    metrics = trainer._metrics["train"]
    tokens = float(batch.completion_mask[8:].sum())
    assert metrics["trl_credit/augmented_groups"] == [1.0] and metrics["trl_credit/augmented_tokens"] == [tokens]
    assert metrics["trl_credit/augmented_ratio"] == [pytest.approx(tokens / float(batch.completion_mask[:8].sum()))]
    assert metrics["trl_credit/hint_group_zero/augmented_groups"] == [1.0]
    # curricula count plain rollouts only
    assert float(trainer.prompt_stats.seen.sum()) == 8.0
    # the token normaliser (dapo, TRL's default) counts the 12 rows trained on, not TRL's count of the 8 generated
    assert out["num_items_in_batch"] == out["completion_mask"].sum() > out["completion_mask"][:8].sum()


def test_replace_swaps_the_group_for_its_augmented_one(make_trainer, arithmetic):
    HintGroupZero.replace = True
    try:
        trainer, out = _round(make_trainer, arithmetic)
    finally:
        HintGroupZero.replace = False
    batch, _ = HintGroupZero.seen[-1]
    assert out["completion_ids"].shape[0] == 8 and batch.num_groups == 2
    assert batch.column(AUGMENTED) == [None] * 4 + [HINT] * 4  # group 1 kept, group 0's place taken


def test_training_with_augmentation_runs_and_meters(make_trainer):
    trainer = make_trainer(plugins=[HintGroupZero], reward_funcs=[char_count], max_steps=2)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2 and all(h["trl_credit/augmented_groups"] == 1.0 for h in logged)
    assert all(h["trl_credit/augmented_ratio"] > 0 for h in logged)


class BadGroup(Plugin):
    @hookimpl
    def augment_rollouts(self, batch):
        return [Augmentation(batch.num_groups, "x")]


class Twice(Plugin):
    @hookimpl
    def augment_rollouts(self, batch):
        return [Augmentation(1, "x", replace=True), Augmentation(1, "y", replace=True)]


@pytest.mark.parametrize(("plugin", "message"), [
    (BadGroup, r"plugin 'bad_group' returned group 2; the round has groups 0..1 from augment_rollouts at step 0"),
    (Twice, r"augment_rollouts \(twice\) asked to replace the same group twice at step 0"),
])  # fmt: skip
def test_bad_requests_are_named(make_trainer, arithmetic, plugin, message):
    with pytest.raises(PluginRuntimeError, match=message):
        _round(make_trainer, arithmetic, plugin)


class HintOnSource(HintGroupZero):
    @hookimpl
    def augment_rollouts(self, batch):
        prompt = [{"role": "system", "content": HINT}, *batch.prompts[0]]
        return [Augmentation(0, prompt, context=HINT, train_on_source=True)]


def test_train_on_source_scores_after_the_own_prompt_against_the_hinted_behaviour(make_trainer, arithmetic):
    """Guide's correction: the loss sees the group's own prompt, and the old log-probs are the hinted ones."""
    trainer, out = _round(make_trainer, arithmetic, HintOnSource)
    batch, _ = HintGroupZero.seen[-1]
    tok = trainer.processing_class
    decoded = [tok.decode(ids[mask.bool()]) for ids, mask in zip(out["prompt_ids"], out["prompt_mask"])]
    assert not any(HINT in text for text in decoded)  # every row trains after its plain prompt
    assert decoded[8] == decoded[0]  # the augmented group's source is group 0
    assert out["old_per_token_logps"] is not None
    hinted = batch.completion_logps(batch.prompts)  # the prompts they were sampled from (hinted for rows 8..11)
    sources = batch.column(SOURCE_PROMPT)
    plain = batch.completion_logps([p if s is None else s for p, s in zip(batch.prompts, sources)])
    t = out["completion_ids"].shape[1]
    mask = out["completion_mask"].float()
    torch.testing.assert_close(out["old_per_token_logps"][8:] * mask[8:], hinted[8:, :t], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(hinted[8:], plain[8:])  # the ratio pi(y|x) / pi_old(y|x + hint) is not 1
    # the correction's extra passes report their cost: old log-probs of the round's 8 rows and the 4 hinted ones
    logged = trainer._metrics["train"]
    assert logged["trl_credit/cost/source_logps_seconds"][-1] > 0
    assert logged["trl_credit/cost/source_logps_sequences"][-1] == 12


def test_with_context_adds_text_without_touching_the_prompt():
    from trl_credit import with_context

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q?"}]
    assert with_context(chat, "H") == [chat[0], {"role": "user", "content": "Q?\n\nH"}]
    assert with_context(chat, "H", "system") == [{"role": "system", "content": "Be brief.\n\nH"}, chat[1]]
    assert with_context(chat[1:], "H", "system") == [{"role": "system", "content": "H"}, chat[1]]
    assert with_context("Q?", "H", separator=" ") == "Q? H" and with_context("Q?", "H", "system") == "H\n\nQ?"
    assert chat[1]["content"] == "Q?"  # copies, not edits
    with pytest.raises(ValueError, match="no user message"):
        with_context(chat[:1], "H")


class ExitsOfGroupZero(Plugin):
    """S-GRPO style: one completion of group 0 cut at four points, each continued after a cue."""

    seen: list = []

    @hookimpl
    def augment_rollouts(self, batch):
        if any(m is not None for m in batch.columns.get(AUGMENTED, [])):
            return None
        length = int(batch.completion_lengths[0])
        ends = [length * j // 4 for j in range(1, 5)]
        ExitsOfGroupZero.seen.append([batch.prefix_prompt(0, e, " So the answer is") for e in ends])
        return [Augmentation(0, prompts=ExitsOfGroupZero.seen[-1], context="exits")]

    @hookimpl
    def on_batch_end(self, batch, advantages):
        ExitsOfGroupZero.seen.append(batch)


def test_per_completion_prompts_continue_a_prefix_after_a_cue(make_trainer, arithmetic):
    ExitsOfGroupZero.seen.clear()
    trainer = make_trainer(plugins=[ExitsOfGroupZero], reward_funcs=[char_count], max_completion_length=8)
    trainer.model.train()
    torch.manual_seed(0)
    rows = trainer.train_dataset
    out = trainer._generate_and_score_completions([copy.deepcopy(rows[i // 4]) for i in range(8)])
    prompts, batch = ExitsOfGroupZero.seen
    tok = trainer.processing_class
    rendered = tok.apply_chat_template(batch.prompts[0], add_generation_prompt=True, tokenize=False)
    assert all(p.startswith(rendered) and p.endswith(" So the answer is") for p in prompts)
    assert len(set(prompts)) > 1  # four different exit points
    assert batch.column(AUGMENTED)[8:] == ["exits"] * 4 and batch.prompts[8:] == prompts
    # each new row was generated from its own prompt: the loss sees exactly that text before its completion
    for j in range(4):
        ids = out["prompt_ids"][8 + j][out["prompt_mask"][8 + j].bool()]
        assert tok.decode(ids) == tok.decode(tok(prompts[j], add_special_tokens=False)["input_ids"])
    assert batch.rewards[8:, 0].tolist() == char_count(batch.completions[8:])  # scored by the run's reward


def test_prompts_must_be_one_per_completion(make_trainer, arithmetic):
    class Short(Plugin):
        @hookimpl
        def augment_rollouts(self, batch):
            return [Augmentation(0, prompts=["a", "b"])]

    with pytest.raises(PluginRuntimeError, match=r"plugin 'short' returned 2 prompts for group 0 \(expected one per "
                                                 r"completion: 4\) from augment_rollouts at step 0"):
        _round(make_trainer, arithmetic, plugin=Short)
    with pytest.raises(ValueError, match="give prompt .* or prompts"):
        Augmentation(0)
