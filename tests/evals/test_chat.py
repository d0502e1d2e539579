"""Chat evals: generative scoring (GSM8K's final number, HumanEval's tests in the sandbox) and ChatCORE."""

from __future__ import annotations

import json

import pytest

from lapheads.apps.chat import ChatEngine
from lapheads.evals.chat import _rows, chatcore, score_generative
from tests.apps.test_chat import ScriptedModel
from tests.data.test_conversations import TOKENIZER

CODE_TOKENIZER = type(TOKENIZER).char("abcdefghijklmnopqrstuvwxyz0123456789 ()+-:,=`\n#")
HUMANEVAL = {
    "task_id": "t/0",
    "prompt": "def add(a, b):\n",
    "entry_point": "add",
    "test": "def check(f):\n    assert f(1, 2) == 3 and f(-1, 1) == 0\n",
}


def _engine(reply: str, tokenizer=CODE_TOKENIZER) -> ChatEngine:
    script = [*tokenizer.encode(reply), tokenizer.special_id("<|assistant_end|>")]
    return ChatEngine(ScriptedModel(script, tokenizer.vocab_size, sequence_len=512), tokenizer)


@pytest.mark.parametrize(
    "reply, passed",
    [
        ("```python\ndef add(a, b):\n    return a + b\n```", 1.0),  # a fenced whole function
        ("    return a + b\n", 1.0),  # a body completing the prompt
        ("    return a - b\n", 0.0),
    ],
)
def test_humaneval_runs_the_replys_code_against_the_tests(reply, passed):
    result = score_generative(_engine(reply), "humaneval", [HUMANEVAL], progress=False, unsafe_code_execution=True)
    assert result["pass@1"] == result["accuracy"] == passed and result["n"] == 1


def test_gsm8k_is_scored_on_the_number_after_the_marks(tmp_path):
    (tmp_path / "gsm8k.jsonl").write_text(json.dumps({"question": "q", "answer": "so <<2*3=6>>6\n#### 6"}) + "\n")
    rows = _rows("gsm8k", str(tmp_path), None)
    assert rows[0]["reference"] == "6" and rows[0]["conversation"]["messages"][0]["content"] == "q"
    assert score_generative(_engine("it is 5 then\n#### 6"), "gsm8k", rows, progress=False)["accuracy"] == 1.0
    assert score_generative(_engine("#### 7"), "gsm8k", rows, progress=False)["accuracy"] == 0.0
    assert score_generative(_engine("6"), "gsm8k", rows, progress=False)["accuracy"] == 0.0  # no final answer


def test_chatcore_centres_each_task_on_its_chance_level():
    results = {"arc_easy": {"accuracy": 0.625, "chance": 0.25}, "gsm8k": {"accuracy": 0.1, "chance": 0.0}}
    assert chatcore(results) == pytest.approx((0.5 + 0.1) / 2)
