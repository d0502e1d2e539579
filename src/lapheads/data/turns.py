"""The conversation format every chat part of lapheads shares, and the items of the hub's task schemas as
conversations (no I/O, no tokenizer): what :mod:`lapheads.data.conversations` renders and mixes, and what the
generated sets (:mod:`lapheads.data.synthetic`) and the chat evaluations (:mod:`lapheads.evals.chat`) build.
"""

from __future__ import annotations

import re
from typing import Any

from lapheads.data.benchmarks import LETTERS, render_mc

__all__ = ["Conversation", "gsm8k_conversation", "mc_conversation"]

#: A conversation: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str | list[part]}, ...]}``
Conversation = dict[str, Any]


def mc_conversation(question: str, choices: list[str], answer: int) -> Conversation:
    """A multiple-choice item as nanochat trains and evaluates it: the lettered prompt, the letter as the reply."""
    return {
        "messages": [
            {"role": "user", "content": render_mc(question, choices)},
            {"role": "assistant", "content": LETTERS[answer]},
        ]
    }


_CALCULATOR = re.compile(r"<<([^<>=]*)=([^<>]*)>>")


def gsm8k_conversation(question: str, answer: str) -> Conversation:
    """A GSM8K item with its calculator annotations ``<<48/2=24>>`` turned into tool calls and outputs."""
    parts, last = [], 0
    for match in _CALCULATOR.finditer(answer):
        if match.start() > last:
            parts.append({"type": "text", "text": answer[last : match.start()]})
        parts.append({"type": "python", "text": match.group(1)})
        parts.append({"type": "python_output", "text": match.group(2)})
        last = match.end()
    if last < len(answer):
        parts.append({"type": "text", "text": answer[last:]})
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": parts}]}
