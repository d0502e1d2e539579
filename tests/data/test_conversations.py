"""Conversation rendering (nanochat's token sequence and loss mask), the hub-schema sources and the generated tasks."""

from __future__ import annotations

import json
import re

import pytest

from lapheads.data.conversations import (
    conversation_mixture,
    parse_mixture,
    render_conversation,
    render_for_completion,
)
from lapheads.data.synthetic import generated_items
from lapheads.data.tokenizers import Tokenizer
from lapheads.data.turns import gsm8k_conversation
from lapheads.errors import InputError

TOKENIZER = Tokenizer.char("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 ?+=.#\n'()")
CONVERSATION = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Yo"},
        {"role": "user", "content": "2+3?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "So "},
                {"type": "python", "text": "2+3"},
                {"type": "python_output", "text": "5"},
                {"type": "text", "text": "5"},
            ],
        },
    ]
}


def _special(name: str) -> int:
    return TOKENIZER.special_id(f"<|{name}|>")


def test_a_fixed_conversation_renders_to_nanochats_tokens_and_mask():
    enc = TOKENIZER.encode
    expected = [  # (tokens, trained?) in order
        ([TOKENIZER.bos_id], 0),
        ([_special("user_start"), *enc("Be brief.\n\nHi"), _special("user_end")], 0),  # the system prompt merged
        ([_special("assistant_start")], 0),
        ([*enc("Yo"), _special("assistant_end")], 1),
        ([_special("user_start"), *enc("2+3?"), _special("user_end")], 0),
        ([_special("assistant_start")], 0),
        ([*enc("So "), _special("python_start"), *enc("2+3"), _special("python_end")], 1),
        ([_special("output_start"), *enc("5"), _special("output_end")], 0),  # the tool's output is given
        ([*enc("5"), _special("assistant_end")], 1),
    ]
    ids, mask = render_conversation(TOKENIZER, CONVERSATION)
    assert ids == [t for tokens, _ in expected for t in tokens]
    assert mask == [m for tokens, m in expected for _ in tokens]
    assert TOKENIZER.decode(ids).startswith("<|bos|><|user_start|>Be brief.\n\nHi<|user_end|><|assistant_start|>Yo")
    short_ids, short_mask = render_conversation(TOKENIZER, CONVERSATION, max_tokens=7)
    assert short_ids == ids[:7] and short_mask == mask[:7]


def test_the_completion_prompt_is_the_conversation_up_to_the_assistants_turn():
    prompt = render_for_completion(TOKENIZER, CONVERSATION)
    full, _ = render_conversation(TOKENIZER, CONVERSATION)
    assert prompt[-1] == _special("assistant_start")
    assert full[: len(prompt)] == prompt and full[len(prompt)] == TOKENIZER.encode("So ")[0]


def test_a_continued_final_message_is_the_assistants_turn_left_open():
    """vLLM's and transformers' continue_final_message: the rendering of the whole conversation without the last
    assistant turn's end, so the model continues the started reply inside its turn."""
    started = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo, wh"}]}
    prompt = render_for_completion(TOKENIZER, started, continue_final_message=True)
    full, _ = render_conversation(TOKENIZER, started)
    assert prompt == full[:-1] and full[-1] == _special("assistant_end")
    assert prompt[: -len(TOKENIZER.encode("Yo, wh"))] == render_for_completion(TOKENIZER, started)
    with pytest.raises(InputError, match="continue_final_message with a final user message; allowed: a final assist"):
        render_for_completion(TOKENIZER, {"messages": started["messages"][:1]}, continue_final_message=True)


@pytest.mark.parametrize(
    "conversation, message",
    [
        ({}, "a conversation needs a non-empty 'messages' list"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "message 0 has role 'bot'; allowed: system, user, assistant"),
        ({"messages": [{"role": "assistant", "content": "x"}]}, "message 0 is 'assistant' where 'user' is due"),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]},
            "message 1 is a system message; allowed: only the first message",
        ),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": [{"type": "image"}]}]},
            "an assistant part",
        ),
        ({"messages": [{"role": "user", "content": ["a"]}]}, "a user message's content is a list"),
    ],
)
def test_malformed_conversations_are_one_line_errors(conversation, message):
    with pytest.raises(InputError, match=re.escape(message)):
        render_conversation(TOKENIZER, conversation)


def test_gsm8k_calculator_annotations_become_tool_calls():
    conversation = gsm8k_conversation("Q?", "Half is 48/2 = <<48/2=24>>24 eggs.\n#### 24")
    assert conversation["messages"][1]["content"] == [
        {"type": "text", "text": "Half is 48/2 = "},
        {"type": "python", "text": "48/2"},
        {"type": "python_output", "text": "24"},
        {"type": "text", "text": "24 eggs.\n#### 24"},
    ]


def test_sources_read_local_files_in_the_hubs_schema_and_mix_by_epochs(tmp_path):
    (tmp_path / "smoltalk.jsonl").write_text(
        json.dumps({"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]}) + "\n"
    )
    (tmp_path / "mmlu_aux.jsonl").write_text(
        json.dumps(
            {
                "train": {  # the hub nests auxiliary rows under "train"
                    "question": "Sky?",
                    "choices": ["red", "blue"],
                    "answer": 1,
                    "subject": "",
                }
            }
        )
        + "\n"
    )
    (tmp_path / "gsm8k_train.jsonl").write_text(json.dumps({"question": "1+1?", "answer": "<<1+1=2>>2\n#### 2"}) + "\n")
    mixture = conversation_mixture("smoltalk,mmlu_aux*3,gsm8k", tmp_path, seed=0)
    assert len(mixture) == 5
    mc = [c for c in mixture if "Multiple Choice" in c["messages"][0]["content"]]
    assert len(mc) == 3 and mc[0]["messages"][1]["content"] == "B"
    assert mixture == conversation_mixture("smoltalk,mmlu_aux*3,gsm8k", tmp_path, seed=0)
    orders = {json.dumps(conversation_mixture("smoltalk,mmlu_aux*3,gsm8k", tmp_path, seed=s)) for s in range(6)}
    assert len(orders) > 1  # the seed shuffles


@pytest.mark.parametrize(
    "spec, message",
    [
        ("wiki", "conversation source 'wiki'; allowed: NAME or NAME*EPOCHS"),
        ("arith*0", "conversation source 'arith*0'"),
        (",", "an empty conversation mixture"),
    ],
)
def test_bad_mixtures_are_one_line_errors(spec, message):
    with pytest.raises(InputError, match=re.escape(message)):
        parse_mixture(spec)


def test_a_missing_local_source_offline_names_the_file(tmp_path, monkeypatch):
    from lapheads.data.images import DataError

    with pytest.raises(DataError, match="identity: no identity.jsonl / identity.parquet in"):
        conversation_mixture("identity", tmp_path, seed=0)


@pytest.mark.parametrize("task", ["arith", "letters"])
def test_generated_tasks_are_fixed_correct_and_held_out(task):
    train, test = generated_items(task, "train"), generated_items(task, "test")
    assert len(train) > 10 * len(test) / 2 > 0
    first = lambda items: {json.dumps(c["messages"][0]) for c, _ in items}  # noqa: E731
    assert first(train) == first(generated_items.__wrapped__(task, "train"))  # the same items every time

    def operands(conversation):
        call = [p for p in conversation["messages"][1]["content"] if p["type"] == "python"][0]["text"]
        return call if task == "letters" else tuple(sorted(re.findall(r"\d+", call))) + (re.sub(r"[\d]", "", call),)

    def key(conversation):
        return operands(conversation).split("'")[1] if task == "letters" else operands(conversation)

    assert not {key(c) for c, _ in train} & {key(c) for c, _ in test}  # no test word / operand pair in training
    for conversation, reference in train[:200] + test[:200]:
        parts = conversation["messages"][1]["content"]
        call = [p["text"] for p in parts if p["type"] == "python"][0]
        output = [p["text"] for p in parts if p["type"] == "python_output"][0]
        assert str(eval(call)) == output == reference  # noqa: S307 - our own generated expressions
        assert parts[-1]["text"].endswith(f"#### {reference}")


@pytest.mark.parametrize(
    "source, rows, message",
    [
        (
            "smoltalk",
            [{"messages": [{"role": "user", "content": "hi"}]}, {"text": "x"}],
            r"conversation source smoltalk: row 2 lacks messages",
        ),
        (
            "smoltalk",
            [{"messages": [{"role": "user", "content": "hi"}]}, {"messages": [{"role": "bot", "content": ""}]}],
            r"conversation source smoltalk: row 2 has messages .*allowed: a non-empty list of \{role",
        ),
        ("smoltalk", [{"messages": []}], r"row 1 has messages '\[\]'"),
        (
            "mmlu_aux",
            [{"question": "q", "choices": ["a", "b"], "answer": 1}, {"question": "q", "choices": ["a"], "answer": 3}],
            r"conversation source mmlu_aux: row 2 is unusable \(answer 3 is not an index among 1 choices\)",
        ),
        # a bool or a float is not index 1, a string of letters is not a list of choices
        ("mmlu_aux", [{"question": "q", "choices": ["a", "b"], "answer": True}], r"row 1 is unusable \(answer True "),
        ("mmlu_aux", [{"question": "q", "choices": ["a", "b"], "answer": 1.7}], r"row 1 is unusable \(answer 1.7 "),
        ("mmlu_aux", [{"question": "q", "choices": "ab", "answer": 1}], r"row 1 is unusable \(choices 'ab' are not"),
        (
            "gsm8k_train",
            [{"question": "q", "answer": "#### 1"}, {"question": "q"}],
            r"conversation source gsm8k_train: row 2 lacks answer",
        ),
    ],
)
def test_every_row_of_a_conversation_source_is_checked(tmp_path, source, rows, message):
    from lapheads.data.images import DataError

    (tmp_path / f"{source}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=message):
        conversation_mixture(source.replace("_train", ""), tmp_path, seed=0)
