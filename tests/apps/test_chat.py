"""The chat engine: the sandboxed calculator, forced tool outputs, streaming and its limits."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lapheads.apps.chat import ChatEngine, use_calculator
from lapheads.errors import InputError
from tests.data.test_conversations import TOKENIZER


@pytest.mark.parametrize(
    "expression, result",
    [
        ("40 + 2", "42"),
        ("48/2", "24"),
        ("7/2", "3.5"),
        ("(3+4)*5", "35"),
        ("'strawberry'.count('r')", "3"),
        ("__import__('os').system('true')", None),
        ("2**100000", None),
        ("open('x')", None),
        ("1/0", None),
        ("'a'.count('a'); import os", None),
    ],
)
def test_the_calculator_answers_arithmetic_and_letter_counts_only(expression, result):
    assert use_calculator(expression) == result


class ScriptedModel(torch.nn.Module):
    """A GPT with a KV cache whose likeliest next token is ``script[r]`` at reply position r (the last entry from
    there on), whatever it was fed; it records every token it is fed (one reply: a new cache starts it over)."""

    def __init__(self, script: list[int], vocab: int, sequence_len: int = 64) -> None:
        super().__init__()
        self.lm_head = torch.nn.Linear(1, 1)
        self.config = SimpleNamespace(sequence_len=sequence_len)
        self.script, self.vocab, self.fed, self.prompt = list(script), vocab, [], 0

    def new_kv_cache(self, batch_size, max_len):
        return SimpleNamespace(pos=0, max_len=max_len, keep=lambda rows: None)  # one reply: nothing to move

    def prefill(self, prompts, max_len=None):  # one reply at a time, as GPT.prefill: its cache and its last logits
        cache = self.new_kv_cache(1, self.config.sequence_len)
        return cache, self(torch.tensor([list(prompts[0])]), kv_cache=cache)[:, -1]

    def forward(self, idx, kv_cache=None, document_ids=None):
        if kv_cache.pos == 0:  # a new reply: its prompt
            self.fed, self.prompt = [], idx.shape[1]
        kv_cache.pos += idx.shape[1]
        self.fed.extend(idx[0].tolist())
        logits = torch.zeros(1, idx.shape[1], self.vocab)
        logits[0, -1, self.script[min(len(self.fed) - self.prompt, len(self.script) - 1)]] = 1.0
        return logits


def _special(name: str) -> int:
    return TOKENIZER.special_id(f"<|{name}|>")


def test_a_tool_call_gets_the_calculators_output_forced_into_the_sequence():
    forced = [_special("output_start"), *TOKENIZER.encode("42"), _special("output_end")]
    script = [  # the reply position by position; where the tool's output is forced, the model's choice is unused
        *TOKENIZER.encode("So "),
        _special("python_start"),
        *TOKENIZER.encode("40+2"),
        _special("python_end"),
        *forced,
        *TOKENIZER.encode("42"),
        _special("assistant_end"),
    ]
    model = ScriptedModel(script, TOKENIZER.vocab_size)
    engine = ChatEngine(model, TOKENIZER)
    prompt = [TOKENIZER.bos_id, _special("assistant_start")]
    pieces = list(engine.stream(prompt, max_tokens=50))
    assert "".join(pieces) == "So [calc: 40+2 = 42]42" and len(pieces) > 3  # streamed, not one block
    after_call = model.fed.index(_special("python_end")) + 1
    assert model.fed[after_call : after_call + len(forced)] == forced
    assert _special("assistant_end") not in model.fed  # generation stopped there


def test_without_tools_the_call_is_left_to_the_model():
    script = [_special("python_start"), *TOKENIZER.encode("1+1"), _special("python_end"), _special("assistant_end")]
    model = ScriptedModel(script, TOKENIZER.vocab_size)
    assert "".join(ChatEngine(model, TOKENIZER, tools=False).stream([TOKENIZER.bos_id], 20)) == "[calc: 1+1"
    assert _special("output_start") not in model.fed


def test_generation_stops_at_the_token_limit_and_the_context():
    a = TOKENIZER.encode("a")[0]
    engine = ChatEngine(ScriptedModel([a], TOKENIZER.vocab_size, sequence_len=16), TOKENIZER)
    assert "".join(engine.stream([TOKENIZER.bos_id], max_tokens=5)) == "aaaaa"
    assert "".join(engine.stream([TOKENIZER.bos_id] * 10, max_tokens=50)) == "a" * 6  # the context is 16
    with pytest.raises(
        InputError, match="the conversation has 16 tokens; allowed: fewer than the model's sequence_len 16"
    ):
        list(engine.stream([TOKENIZER.bos_id] * 16))
    with pytest.raises(InputError, match="an empty prompt"):
        list(engine.stream([]))
