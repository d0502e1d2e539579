"""Every file and folder name of a run directory and of a sweep directory, in one place.

No other module of lapheads spells these names (tests/test_architecture.py checks it): they read and write runs
through :class:`lapheads.runs.RunDir` and the helpers here. The layout itself is documented in docs/design.md
("The run directory", "The sweep directory").
"""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "ANALYSIS_FILE",
    "CHECKPOINTS",
    "CONFIG_FILE",
    "LATEST",
    "METRICS_FILE",
    "REPORT",
    "PLAN_FILE",
    "RECORDS_LOCK",
    "RUN_LOCK",
    "RUN_TASKS",
    "SAMPLES_FILE",
    "STATE_FILE",
    "SWEEP_FILE",
    "SWEEP_LOCK",
    "TOKENIZER",
    "WEIGHTS",
    "analysis_file",
    "external_report_dir",
    "nanochat_tokenizer_dir",
    "record_file",
    "report_folder",
    "step_name",
    "temporary_step_name",
]

CONFIG_FILE = "config.json"  # the full resolved config, written before anything else
#: the tasks a run's config.json may name: the task table's names (lapheads.tasks.TASKS, which sits above runs/;
#: tests/tasks pins the two equal), so a loader refuses a record no lapheads trainer wrote
RUN_TASKS = ("classify", "lm", "dino", "mid", "sft")
METRICS_FILE = "metrics.jsonl"  # one JSON object per logged step or evaluation
SAMPLES_FILE = "samples.jsonl"  # lm: a generated sample per evaluation
CHECKPOINTS = "checkpoints"  # step folders and the `latest` pointer
LATEST = "latest"  # the name of the newest complete step folder
STATE_FILE = "state.json"  # a checkpoint's trainer state: step, world size, optimizer metadata
TOKENIZER = "tokenizer"  # lm, mid, sft: the tokenizer the model was trained with (JSON)
REPORT = "report"  # readers' caches: eval_*.json, analysis*.json, plots
ANALYSIS_FILE = "analysis.json"  # lapheads analyze's cache of the latest checkpoint
SWEEP_FILE = "sweep.json"  # a sweep's definition and cell states
SWEEP_LOCK = ".lapheads-sweep.lock"  # held by the one process writing a sweep folder (its pid beside it)
RECORDS_LOCK = ".lapheads-records.lock"  # held by the one sweep writing a records folder
RUN_LOCK = ".lapheads-run.lock"  # held by the one training process writing a run folder (rank 0)
PLAN_FILE = "plan.json"  # a records folder's pre-registered plan (lapheads sweep --plan), copied in unchanged
RECORD_SUFFIX = ".json"  # a cell's record: <cell name>.json in the records folder
#: the weight files of a checkpoint ``load_model`` may read: a run's model, its EMA (classify --ema-decay), DINO's
#: teacher
WEIGHTS = {"model": "model.safetensors", "ema": "ema.safetensors", "teacher": "teacher.safetensors"}
STEP_PREFIX = "step-"
TEMPORARY_PREFIX = ".tmp-step-"  # a checkpoint being written; never loaded, removed by --resume


def step_name(step: int) -> str:
    """The folder of step ``step``'s checkpoint: ``step-00000400``."""
    return f"{STEP_PREFIX}{step:08d}"


def temporary_step_name(step: int) -> str:
    """Where step ``step``'s checkpoint is written before it is published by a rename."""
    return f"{TEMPORARY_PREFIX}{step:08d}"


def record_file(cell_name: str) -> str:
    """A cell's record in a records folder: ``L3-s0.json``."""
    return f"{cell_name}{RECORD_SUFFIX}"


def analysis_file(step: int | None) -> str:
    """The analysis cache of the latest checkpoint (None) or of a kept step's."""
    return ANALYSIS_FILE if step is None else f"analysis-{STEP_PREFIX}{step}.json"  # unpadded, as written since 0.1


def report_folder(folder: str | Path, baseline_dir_name: str | None = None) -> Path:
    """The report/ folder of a run or sweep directory; a sweep compared against another arm than k = 0 writes to
    ``report-vs-<arm>`` beside it."""
    name = REPORT if baseline_dir_name is None else f"{REPORT}-vs-{baseline_dir_name}"
    return Path(folder) / name


def writable_report_folder(folder: str | Path, baseline_dir_name: str | None = None) -> Path:
    """:func:`report_folder`, to write into: refused in one line where it, or anything in it, is a symbolic link, so
    a report never writes through a link to a place lapheads does not own (issue 60)."""
    from lapheads.errors import InputError

    out = report_folder(folder, baseline_dir_name)
    links = [out] if out.is_symlink() else sorted(p for p in out.iterdir() if p.is_symlink()) if out.is_dir() else []
    if links:
        raise InputError(
            f"{links[0]} is a symbolic link; a report writes only into a folder of its own; allowed: remove the link"
        )
    return out


def nanochat_tokenizer_dir(checkpoint_folder: str | Path) -> Path:
    """Where nanochat keeps the tokenizer of a checkpoint folder: ``<base>/tokenizer`` beside
    ``<base>/base_checkpoints/<model>/`` (nanochat's own layout, not a lapheads run)."""
    return Path(checkpoint_folder).resolve().parent.parent / TOKENIZER


def external_report_dir(name: str) -> Path:
    """Where every command writes its results for a model that is not a lapheads run (a nanochat checkpoint
    folder, ``name`` = "nanochat-<model>-step<N>"): ``runs/<name>/report/``, the place a run keeps its own."""
    return Path("runs") / name / REPORT
