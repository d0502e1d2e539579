"""The LM benchmarks' data (ARC, MMLU, GSM8K, HumanEval) in the Hugging Face hub's schema, and nanochat's
multiple-choice rendering.

Rows come from local jsonl / parquet files in the hub's schema (``--data-dir``), else from the hub when online; a
file that is not readable, or rows without the task's fields, are a one-line error. Evaluations
(``lapheads.evals``) and conversation mixtures (``lapheads.data.conversations``) both read them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from lapheads.data.images import DataError
from lapheads.errors import InputError
from lapheads.io import json_loads

__all__ = ["HUB_DATASETS", "LETTERS", "load_task", "read_task_rows", "render_mc", "usable_rows"]

LETTERS = "ABCDEFGHIJ"
# task -> (hub path, config, split)
HUB_DATASETS: dict[str, tuple[str, str | None, str]] = {
    "arc_easy": ("allenai/ai2_arc", "ARC-Easy", "test"),
    "arc_challenge": ("allenai/ai2_arc", "ARC-Challenge", "test"),
    "mmlu": ("cais/mmlu", "all", "test"),
    "gsm8k": ("openai/gsm8k", "main", "test"),
    "humaneval": ("openai/openai_humaneval", None, "test"),
}


def _read_rows(path: Path) -> list[dict[str, Any]]:
    try:
        if path.suffix == ".jsonl":
            return [json_loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        from lapheads.data.text import parquet_module

        return parquet_module().read_table(path).to_pylist()
    except DataError:
        raise
    except Exception as err:  # OSError, JSONDecodeError, pyarrow's ArrowInvalid
        raise DataError(f"{path} is not readable jsonl/parquet: {str(err)[:100]}") from None


_REQUIRED = {
    "arc_easy": ("question", "choices", "answerKey"),
    "arc_challenge": ("question", "choices", "answerKey"),
    "mmlu": ("question", "choices", "answer"),
    "gsm8k": ("question", "answer"),
    "humaneval": ("task_id", "prompt", "test", "entry_point"),
}


def read_task_rows(
    name: str, data_dir: str | Path | None, hub: tuple[str, str | None, str] | None, label: str | None = None
) -> list[dict[str, Any]]:
    """Rows named ``name``: ``data_dir/<name>.jsonl`` / ``.parquet`` or a ``data_dir/<name>/`` folder of them, else
    the hub dataset ``hub`` = (path, config, split) when online (``hub`` None: local files only)."""
    if data_dir is not None:
        base = Path(data_dir)
        files = [p for p in (base / f"{name}.jsonl", base / f"{name}.parquet") if p.is_file()]
        if (base / name).is_dir():
            files += sorted([*(base / name).glob("*.parquet"), *(base / name).glob("*.jsonl")])
        if files:
            return [row for f in files for row in _read_rows(f)]
    where = f"no {name}.jsonl / {name}.parquet in {data_dir}" if data_dir else "no --data-dir"
    label = label or name
    if hub is None:
        raise DataError(f"{label}: {where}; allowed: a local jsonl/parquet file of it")
    path, config, split = hub
    try:
        from datasets import load_dataset

        return list(load_dataset(path, config, split=split))
    except Exception as err:  # ImportError, offline, hub errors
        raise DataError(
            f"{label}: {where}, and the hub dataset {path} could not be loaded ({type(err).__name__}); "
            "allowed: local files in the hub's schema"
        ) from None


def load_task(benchmark: str, data_dir: str | Path | None = None) -> list[dict[str, Any]]:
    """Rows of ``benchmark`` in the hub's schema, from ``data_dir`` if it holds them, else from the hub."""
    if benchmark not in HUB_DATASETS:
        raise InputError(f"unknown task {benchmark!r}; allowed: {', '.join(HUB_DATASETS)}")
    rows = read_task_rows(benchmark, data_dir, HUB_DATASETS[benchmark], label=f"task {benchmark}")
    if not rows:
        raise DataError(f"task {benchmark}: no rows; allowed: the schema of {HUB_DATASETS[benchmark][0]}")
    for number, row in enumerate(rows, 1):  # every row, not the first: a bad row 900 is as bad as a bad row 1
        missing = [k for k in _REQUIRED[benchmark] if not isinstance(row, dict) or k not in row]
        if missing:
            raise DataError(
                f"task {benchmark}: row {number} lacks {', '.join(missing)}; allowed: the schema of "
                f"{HUB_DATASETS[benchmark][0]} ({', '.join(_REQUIRED[benchmark])})"
            )
    return rows


#: a GSM8K reference answer after "####": one plain number (commas and a leading $ allowed), nothing else: "1/2",
#: "1e3" or "3 or 4" cannot be scored against a reply's number
_REFERENCE_NUMBER = re.compile(r"\$?-?(\d{1,3}(,\d{3})+|\d+)(\.\d+)?")


def choice_index(answer: Any, choices: Any) -> int:
    """A multiple-choice answer as an index into its choices: an int (not a bool, not a float) among a list of
    1-10 strings; ValueError naming what is wrong otherwise (``True`` and ``1.7`` are not index 1)."""
    if not isinstance(choices, list) or not 0 < len(choices) <= 10 or not all(isinstance(c, str) for c in choices):
        raise ValueError(f"choices {str(choices)[:40]!r} are not a list of 1-10 strings")
    if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < len(choices):
        raise ValueError(f"answer {answer!r} is not an index among {len(choices)} choices")
    return answer


def _ground_truth_usable(benchmark: str, row: dict[str, Any]) -> bool:
    """Whether a row's reference answer can be scored: an MMLU answer index among its choices, an ARC answerKey
    among its distinct labels, exactly one number after a GSM8K solution's "####", HumanEval's code as text."""
    try:
        if benchmark == "mmlu":
            choice_index(row["answer"], row["choices"])
            return True
        if benchmark in ("arc_easy", "arc_challenge"):
            choices = row["choices"]
            labels, texts = choices["label"], choices["text"]
            if not isinstance(labels, list) or not isinstance(texts, list):
                return False
            distinct = len(set(labels)) == len(labels) and all(isinstance(t, str) for t in labels + texts)
            return distinct and len(labels) == len(texts) <= 10 and row["answerKey"] in labels
        if benchmark == "gsm8k":
            answer = row["answer"]
            return (
                isinstance(answer, str)
                and "####" in answer
                and _REFERENCE_NUMBER.fullmatch(answer.split("####")[-1].strip()) is not None
            )
        return all(isinstance(row[k], str) for k in _REQUIRED[benchmark])
    except (KeyError, TypeError, ValueError):
        return False


def usable_rows(benchmark: str, rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[int]]:
    """(the rows whose ground truth can be scored, the 1-based numbers of those that cannot): an evaluation scores
    the first and reports how many it left out, instead of scoring an unusable item as a wrong answer."""
    usable, unusable = [], []
    for number, row in enumerate(rows, 1):
        if _ground_truth_usable(benchmark, row):
            usable.append(row)
        else:
            unusable.append(number)
    return usable, unusable


def render_mc(question: str, choices: list[str]) -> str:
    """nanochat's multiple-choice rendering."""
    lines = [f"Multiple Choice question: {question}"]
    lines += [f"- {choice}={letter}" for letter, choice in zip(LETTERS, choices)]
    return "\n".join(lines) + "\n\nRespond only with the letter of the correct answer."
