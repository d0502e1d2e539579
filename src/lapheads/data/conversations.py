"""Conversations: nanochat's chat format, its loss mask, and the conversation datasets of mid-training and SFT.

Design choices:

* **nanochat's rendering**, token for token: ``<|bos|>``, then per turn ``<|user_start|> text <|user_end|>`` or
  ``<|assistant_start|> ... <|assistant_end|>``; a system message is merged into the first user message (two
  newlines apart); an assistant message is a string or a list of parts, ``text``, ``python`` (a tool call, between
  ``<|python_start|>`` and ``<|python_end|>``) and ``python_output`` (the tool's answer, between
  ``<|output_start|>`` and ``<|output_end|>``).
* **The loss mask trains on what the assistant writes**: its text, its tool calls (with their delimiters) and its
  ``<|assistant_end|>`` (so it learns to stop). Everything the model is given is 0: BOS, user turns, the
  ``<|assistant_start|>`` that opens a turn, and tool outputs (the tool writes those, at inference too).
* **Data in the hub's schema** (a local ``<name>.jsonl`` / ``.parquet`` / folder first, the HF hub when online):
  SmolTalk (``messages``), MMLU auxiliary train (``question``/``choices``/``answer``, rendered as nanochat's
  multiple-choice prompt with the letter as the answer), GSM8K train (``question``/``answer``; each
  ``<<expr=result>>`` becomes a calculator call and its output, as nanochat does), and any jsonl of ``messages``
  (identity conversations). The generated tasks of :mod:`lapheads.data.synthetic` need no files at all.
* **A mixture is a string** such as ``"smoltalk,mmlu_aux*3,gsm8k*4"`` (nanochat's SFT mixture: MMLU three times,
  GSM8K four times); it is shuffled once with the run's seed, so every rank and every resume sees the same order.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lapheads.data.benchmarks import choice_index
from lapheads.data.images import DataError
from lapheads.data.synthetic import generated_conversations
from lapheads.data.tokenizers import Tokenizer
from lapheads.data.turns import Conversation, gsm8k_conversation, mc_conversation
from lapheads.errors import InputError

__all__ = [
    "CONVERSATION_SOURCES",
    "conversation_mixture",
    "parse_mixture",
    "render_conversation",
    "render_for_completion",
]

PART_TYPES = ("text", "python", "python_output")
ROLES = ("system", "user", "assistant")


def _check_messages(conversation: Conversation) -> list[dict[str, Any]]:
    messages = conversation.get("messages") if isinstance(conversation, dict) else None
    if not isinstance(messages, list) or not messages:
        raise InputError(
            "a conversation needs a non-empty 'messages' list; allowed: {'messages': [{'role': 'user', "
            "'content': ...}, ...]}"
        )
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            raise InputError(f"message {i} has role {role!r}; allowed: {', '.join(ROLES)}")
        if role == "system" and i != 0:
            raise InputError(f"message {i} is a system message; allowed: only the first message")
    body = messages[1:] if messages[0]["role"] == "system" else messages
    for i, message in enumerate(body):
        expected = "user" if i % 2 == 0 else "assistant"
        if message["role"] != expected:
            raise InputError(
                f"message {i + len(messages) - len(body)} is {message['role']!r} where {expected!r} is "
                "due; allowed: user and assistant turns alternating, the user first"
            )
    if not body:
        raise InputError("a conversation with only a system message; allowed: at least one user turn")
    return messages


def render_conversation(
    tokenizer: Tokenizer,
    conversation: Conversation,
    max_tokens: int | None = None,
) -> tuple[list[int], list[int]]:
    """Token ids and loss mask (1 = trained on) of ``conversation``, cut to ``max_tokens``.

    Args:
        tokenizer: a tokenizer with the chat special tokens (every lapheads and nanochat tokenizer has them).
        conversation: ``{"messages": [...]}``; see the module docstring for the parts of an assistant message.
        max_tokens: keep at most this many tokens (None: all).
    """
    messages = _check_messages(conversation)
    special = {
        name: tokenizer.special_id(f"<|{name}|>")
        for name in (
            "user_start",
            "user_end",
            "assistant_start",
            "assistant_end",
            "python_start",
            "python_end",
            "output_start",
            "output_end",
        )
    }
    ids, mask = [tokenizer.bos_id], [0]

    def add(tokens: Sequence[int], trained: int) -> None:
        ids.extend(tokens)
        mask.extend([trained] * len(tokens))

    if messages[0]["role"] == "system":  # nanochat has no system turn: the prompt leads the first user message
        first = dict(messages[1])
        first["content"] = f"{messages[0]['content']}\n\n{first['content']}"
        messages = [first, *messages[2:]]
    for message in messages:
        content = message["content"]
        if message["role"] == "user":
            if not isinstance(content, str):
                raise InputError(f"a user message's content is a {type(content).__name__}; allowed: a string")
            add([special["user_start"], *tokenizer.encode(content), special["user_end"]], 0)
            continue
        add([special["assistant_start"]], 0)
        for part in [{"type": "text", "text": content}] if isinstance(content, str) else content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in PART_TYPES or not isinstance(part.get("text"), str):
                raise InputError(
                    f"an assistant part {str(part)[:60]!r}; allowed: {{'type': one of "
                    f"{', '.join(PART_TYPES)}, 'text': str}}"
                )
            if kind == "text":
                add(tokenizer.encode(part["text"]), 1)
            elif kind == "python":
                add([special["python_start"], *tokenizer.encode(part["text"]), special["python_end"]], 1)
            else:  # the tool's output is given, never predicted
                add([special["output_start"], *tokenizer.encode(part["text"]), special["output_end"]], 0)
        add([special["assistant_end"]], 1)
    if max_tokens is not None:
        ids, mask = ids[:max_tokens], mask[:max_tokens]
    return ids, mask


def render_for_completion(
    tokenizer: Tokenizer, conversation: Conversation, continue_final_message: bool = False
) -> list[int]:
    """The ids that prompt the assistant's next turn: the conversation without a final assistant message, then
    ``<|assistant_start|>`` (as nanochat primes its engine for evals and chat).

    Args:
        tokenizer, conversation: as :func:`render_conversation` takes them.
        continue_final_message: the final message is the assistant's started reply (a string), left open for the
            model to continue (a prefill: transformers' and vLLM's ``continue_final_message``); its text follows
            ``<|assistant_start|>``.
    """
    messages = _check_messages(conversation)
    prefill: list[int] = []
    if continue_final_message:
        last = messages[-1]
        if last["role"] != "assistant" or not isinstance(last["content"], str):
            raise InputError(
                f"continue_final_message with a final {last['role']} message; allowed: a final assistant message "
                "whose content is a string, the reply to continue"
            )
        prefill = tokenizer.encode(last["content"])
    if messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    if messages[-1]["role"] != "user":
        raise InputError("a completion prompt must end with a user turn")
    ids, _ = render_conversation(tokenizer, {"messages": [*messages, {"role": "assistant", "content": ""}]})
    return [*ids[:-1], *prefill]  # drop <|assistant_end|> of the empty turn; <|assistant_start|> stays


# ----------------------------------------------------------------------------------------------------------------
# Conversations from the hub's task schemas


def _rows(
    name: str, data_dir: str | Path | None, hub: tuple[str, str | None, str] | None, keys: tuple[str, ...]
) -> list[dict[str, Any]]:
    """The rows of a source, each checked for ``keys`` (the row number in the error: a bad row 9,000 is as bad as a
    bad row 1)."""
    from lapheads.data.benchmarks import read_task_rows

    rows = read_task_rows(name, data_dir, hub)
    for number, row in enumerate(rows, 1):
        missing = [k for k in keys if not isinstance(row, dict) or k not in row]
        if missing:
            raise DataError(
                f"conversation source {name}: row {number} lacks {', '.join(missing)}; allowed: rows "
                f"with {', '.join(keys)} (the hub's schema)"
            )
    return rows


def _messages(name: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows whose "messages" are a list of {"role", "content"}; anything else is a one-line error naming the row."""
    for number, row in enumerate(rows, 1):
        messages = row["messages"]
        if (
            not isinstance(messages, list)
            or not messages
            or not all(
                isinstance(m, dict) and m.get("role") in ("system", "user", "assistant") and "content" in m
                for m in messages
            )
        ):
            raise DataError(
                f"conversation source {name}: row {number} has messages {str(messages)[:60]!r}; allowed: "
                "a non-empty list of {role: system|user|assistant, content}"
            )
    return [{"messages": row["messages"]} for row in rows]


def _smoltalk(data_dir):
    return _messages(
        "smoltalk", _rows("smoltalk", data_dir, ("HuggingFaceTB/smol-smoltalk", None, "train"), ("messages",))
    )


def _mmlu_aux(data_dir):
    rows = _rows("mmlu_aux", data_dir, ("cais/mmlu", "auxiliary_train", "train"), ())
    rows = [row.get("train", row) for row in rows]  # the hub nests each auxiliary row under "train"
    conversations = []
    for number, r in enumerate(rows, 1):
        try:
            choices = r["choices"]
            answer = choice_index(r["answer"], list(choices) if isinstance(choices, tuple) else choices)
            conversations.append(mc_conversation(r["question"], list(choices), answer))
        except (KeyError, TypeError, ValueError) as err:
            raise DataError(
                f"conversation source mmlu_aux: row {number} is unusable ({str(err)[:60]}); allowed: "
                "question, choices and an answer index among them"
            ) from None
    return conversations


def _gsm8k(data_dir):
    rows = _rows("gsm8k_train", data_dir, ("openai/gsm8k", "main", "train"), ("question", "answer"))
    return [gsm8k_conversation(r["question"], r["answer"]) for r in rows]


def _identity(data_dir):
    return _messages("identity", _rows("identity", data_dir, None, ("messages",)))


def _generated(task: str, split: str):
    def load(data_dir):
        return generated_conversations(task, split)

    return load


#: name -> loader(data_dir) of a list of conversations
CONVERSATION_SOURCES = {
    "smoltalk": _smoltalk,
    "mmlu_aux": _mmlu_aux,
    "gsm8k": _gsm8k,
    "identity": _identity,
    "arith": _generated("arith", "train"),
    "letters": _generated("letters", "train"),
    "arith_test": _generated("arith", "test"),
    "letters_test": _generated("letters", "test"),
}


def parse_mixture(spec: str) -> list[tuple[str, int]]:
    """``"smoltalk,mmlu_aux*3"`` -> [("smoltalk", 1), ("mmlu_aux", 3)]; one-line error for anything else."""
    out = []
    for item in [s.strip() for s in spec.split(",") if s.strip()]:
        match = re.fullmatch(r"([a-z0-9_]+)(?:\*(\d+))?", item)
        if not match or match.group(1) not in CONVERSATION_SOURCES or match.group(2) == "0":
            raise InputError(
                f"conversation source {item!r}; allowed: NAME or NAME*EPOCHS with NAME one of "
                f"{', '.join(CONVERSATION_SOURCES)}"
            )
        out.append((match.group(1), int(match.group(2) or 1)))
    if not out:
        raise InputError("an empty conversation mixture; allowed: e.g. smoltalk,mmlu_aux*3,gsm8k*4")
    return out


def conversation_mixture(spec: str, data_dir: str | Path | None, seed: int) -> list[Conversation]:
    """Every conversation of the mixture ``spec`` (sources repeated by their epochs), shuffled with ``seed``."""
    conversations = []
    for name, epochs in parse_mixture(spec):
        rows = CONVERSATION_SOURCES[name](data_dir)
        if not rows:
            raise DataError(f"conversation source {name} has no rows")
        conversations.extend(rows * epochs)
    random.Random(seed).shuffle(conversations)
    return conversations
