"""The LM benchmarks' data (ARC, MMLU, GSM8K, HumanEval) in the Hugging Face hub's schema, and nanochat's
multiple-choice rendering.

Rows come from local jsonl / parquet files in the hub's schema (``--data-dir``), else from the hub when online; a
file that is not readable, or rows without the task's fields, are a one-line error. Evaluations
(``lapheads.evals``) and conversation mixtures (``lapheads.data.conversations``) both read them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lapheads.data.images import DataError
from lapheads.errors import InputError

__all__ = ["HUB_DATASETS", "LETTERS", "load_task", "read_task_rows", "render_mc"]

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
            return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    except Exception as err:  # OSError, JSONDecodeError, pyarrow's ArrowInvalid
        raise DataError(f"{path} is not readable jsonl/parquet: {str(err)[:100]}") from None


_REQUIRED = {
    "arc_easy": ("question", "choices", "answerKey"),
    "arc_challenge": ("question", "choices", "answerKey"),
    "mmlu": ("question", "choices", "answer"),
    "gsm8k": ("question", "answer"),
    "humaneval": ("task_id", "prompt", "test", "entry_point"),
}


def read_task_rows(name: str, data_dir: str | Path | None, hub: tuple[str, str | None, str] | None,
                   label: str | None = None) -> list[dict[str, Any]]:
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
        raise DataError(f"{label}: {where}, and the hub dataset {path} could not be loaded ({type(err).__name__}); "
                        "allowed: local files in the hub's schema") from None


def load_task(task: str, data_dir: str | Path | None = None) -> list[dict[str, Any]]:
    """Rows of ``task`` in the hub's schema, from ``data_dir`` if it holds them, else from the hub."""
    if task not in HUB_DATASETS:
        raise InputError(f"unknown task {task!r}; allowed: {', '.join(HUB_DATASETS)}")
    rows = read_task_rows(task, data_dir, HUB_DATASETS[task], label=f"task {task}")
    missing = [k for k in _REQUIRED[task] if rows and k not in rows[0]]
    if missing or not rows:
        raise DataError(f"task {task}: rows lack {', '.join(missing) or 'everything (no rows)'}; allowed: the "
                        f"schema of {HUB_DATASETS[task][0]}")
    return rows


def render_mc(question: str, choices: list[str]) -> str:
    """nanochat's multiple-choice rendering."""
    lines = [f"Multiple Choice question: {question}"]
    lines += [f"- {choice}={letter}" for letter, choice in zip(LETTERS, choices)]
    return "\n".join(lines) + "\n\nRespond only with the letter of the correct answer."
