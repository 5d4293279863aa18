"""Scripted tool-calling rollouts on the tiny model, for TRL's ``tools`` and ``environment_factory`` paths
(testing kit: plugin tests of tool-call credit, e.g. failures per turn).

The tiny random model never writes a tool call, so `ScriptedToolTrainer` replaces the one TRL method
that samples tokens (``_generate_single_turn``) with a script; everything else (TRL's tool loop,
parsing, tool execution, masks, rewards) is TRL's own. The script reads the conversation so far:

- plan 0 (question's first number % 3 == 0): answers at once (one turn, no call);
- plan 1: calls ``add`` (a success), then answers (two turns);
- plan 2: calls ``subtract`` (no such tool: TRL records a failure), then ``add``, then answers (three turns).

The answer is a random digit (the trainer's seeded generator), so groups have varied rewards.
"""

from __future__ import annotations

import re

import torch

from trl_credit.trainer import CreditGRPOTrainer

CALL = '<tool_call>\n{{"name": "{name}", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'


def plan_of(text: str) -> int:
    """The script's plan for a conversation: the question's first number modulo 3."""
    question = text.split("user\n", 1)[-1]
    return int(re.search(r"\d+", question).group()) % 3


def chatml_tool_tokenizer():
    """The embedded model's tokenizer with TRL's Qwen2.5 (ChatML + tools) template, which TRL can parse."""
    import importlib.resources

    from transformers import AutoTokenizer

    from trl_credit.testing.tiny import tiny_model_path

    tok = AutoTokenizer.from_pretrained(tiny_model_path())
    tok.chat_template = (importlib.resources.files("trl") / "chat_templates" / "qwen2_5.jinja").read_text()
    return tok


def add(a: int, b: int) -> int:
    """Add two whole numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


class AddEnvironment:
    """An ``environment_factory`` environment: a running total; records the total after each call."""

    def reset(self, **kwargs):
        self.total = 0
        self.turn_values = {"total": []}

    def add(self, a: int, b: int) -> int:
        """Add two whole numbers to the running total.

        Args:
            a: The first number.
            b: The second number.
        """
        self.total += a + b
        self.turn_values["total"].append(self.total)
        return self.total


def env_reward(environments, **kwargs):
    """The environment's running total (0 without a call), scaled."""
    return [env.total / 10.0 for env in environments]


def digit_reward(completions, **kwargs):
    """1.0 when the final answer is odd."""
    out = []
    for messages in completions:
        text = messages[-1].get("content") or ""
        digits = re.findall(r"\d", text)
        out.append(float(int(digits[-1]) % 2) if digits else 0.0)
    return out


class ScriptedToolTrainer(CreditGRPOTrainer):
    """TRL's own tool loop with scripted sampling (see the module docstring)."""

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        tok = self.processing_class
        out = []
        for ids in prompt_ids:
            text = tok.decode(ids)
            done = text.count("<tool_response>")
            plan = plan_of(text)
            if plan == 2 and done == 0:
                reply = CALL.format(name="subtract", a=2, b=1)
            elif plan >= 1 and done == plan - 1:
                reply = CALL.format(name="add", a=2, b=3)
            else:
                reply = str(int(torch.randint(0, 10, (1,))))
            out.append(tok(reply + tok.eos_token, add_special_tokens=False)["input_ids"])
        return out, None


def expected_turns(prompt_text: str) -> tuple[list[int], list[int]]:
    """The script's tool calls and failures per turn for a conversation."""
    plan = plan_of(prompt_text)
    return ([0], [0]) if plan == 0 else ([1, 0], [0, 0]) if plan == 1 else ([1, 1, 0], [1, 0, 0])


def conversation_text(prompt) -> str:
    return "user\n" + " ".join(m["content"] for m in prompt if m["role"] == "user")


__all__ = ["AddEnvironment", "ScriptedToolTrainer", "add", "chatml_tool_tokenizer", "conversation_text",
           "digit_reward", "env_reward", "expected_turns", "plan_of"]
