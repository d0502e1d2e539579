"""A run directory: its paths, config.json, metrics.jsonl, checkpoints/latest and the report/ cache."""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

import lapheads
from lapheads.errors import CheckpointError
from lapheads.io import atomic_write_text, json_loads, sole_owner
from lapheads.runs.layout import (
    CHECKPOINTS,
    CONFIG_FILE,
    LATEST,
    METRICS_FILE,
    RUN_LOCK,
    SAMPLES_FILE,
    STEP_PREFIX,
    TEMPORARY_PREFIX,
    TOKENIZER,
    report_folder,
    step_name,
)

log = logging.getLogger(__name__)


def git_revision() -> str | None:
    """The commit of the lapheads checkout this code runs from (None for an installed copy): ``git rev-parse``, or
    where git is not installed or refuses the folder (a GPU container given a copy of the checkout, owned by another
    user) read from .git's HEAD and refs."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=here, timeout=5)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return _revision_from_files(here)


#: how many changed paths a record lists (a count of the rest follows): enough to see what changed
UNCOMMITTED_LISTED = 20


def uncommitted_changes() -> list[str] | None:
    """The paths under the lapheads package that differ from the commit :func:`git_revision` names (changed,
    staged, deleted or untracked; ``git status --porcelain``), so a record can say its code was not that commit:
    [] for a clean package, None where git cannot tell (not installed, not a checkout, or it refuses the folder)."""
    here = Path(__file__).resolve().parent.parent  # the package folder, src/lapheads: what trains a cell
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=normal", "--", "."],
            capture_output=True, text=True, cwd=here, timeout=10,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    paths = sorted(line[3:] for line in out.stdout.splitlines() if line.strip())
    if len(paths) > UNCOMMITTED_LISTED:
        paths = [*paths[:UNCOMMITTED_LISTED], f"... and {len(paths) - UNCOMMITTED_LISTED} more"]
    return paths


def _revision_from_files(start: Path) -> str | None:
    """HEAD's commit read from the first .git above ``start`` (a loose ref, else packed-refs). A .git file is a
    worktree's (``gitdir: PATH``, as `git worktree add` writes it): its HEAD is there, its branches' refs in the
    repository it names (``commondir``)."""
    git = next((folder / ".git" for folder in (start, *start.parents) if (folder / ".git").exists()), None)
    if git is None:
        return None
    try:
        if git.is_file():
            git = (git.parent / git.read_text().strip().removeprefix("gitdir: ")).resolve()
        common = (git / (git / "commondir").read_text().strip()).resolve() if (git / "commondir").is_file() else git
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head or None  # a detached HEAD holds the commit itself
        ref = head.removeprefix("ref: ")
        for folder in (git, common):
            if (folder / ref).is_file():
                return (folder / ref).read_text().strip() or None
        for line in (common / "packed-refs").read_text().splitlines():
            if line.endswith(" " + ref):
                return line.split()[0]
    except OSError:
        pass
    return None


#: the run folders the current training call holds (``owning_runs``): an exit stack of their locks
_HELD_RUNS: contextvars.ContextVar[tuple[contextlib.ExitStack, set[Path]] | None] = contextvars.ContextVar(
    "lapheads_held_runs", default=None
)


@contextlib.contextmanager
def owning_runs() -> Iterator[None]:
    """Hold every run folder claimed in the block (:meth:`RunDir.claim`) until it ends, however it ends: a task's
    train function runs in one (``lapheads.tasks.Task.train_function``), so a training call owns its folder from
    the moment it is known to be a run of its own until the call returns."""
    with contextlib.ExitStack() as stack:
        token = _HELD_RUNS.set((stack, set()))
        try:
            yield
        finally:
            _HELD_RUNS.reset(token)


class RunDir:
    """A run directory: config.json, metrics.jsonl, checkpoints/, report/."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.checkpoints = self.path / CHECKPOINTS
        self.metrics_file = self.path / METRICS_FILE
        self.samples_file = self.path / SAMPLES_FILE  # lm: a sample per evaluation
        self.tokenizer_dir = self.path / TOKENIZER  # lm, mid, sft: the tokenizer the model was trained with
        self.config_file = self.path / CONFIG_FILE
        self.report_dir = report_folder(self.path)  # readers' caches: eval_*.json, analysis*.json, plots
        self.trackers: list[
            Any
        ] = []  # TensorBoard / W&B mirrors of metrics.jsonl (lapheads.integrations.tracking), rank 0

    def exists(self) -> bool:
        """Whether a run was started here (config.json is written before anything else)."""
        return self.config_file.is_file()

    def check_is_directory(self) -> None:
        """A run directory is a directory (or does not exist yet); anything else is a one-line error."""
        if self.path.exists() and not self.path.is_dir():
            raise CheckpointError(f"--out {self.path} is a file; allowed: a new directory or a run directory")

    def claim(self) -> None:
        """Make this process the folder's one writer for the enclosing :func:`owning_runs` (a second training of
        the same folder, a resumed run while the first still trains, is refused in one line naming the holder's
        pid). Called once the folder is known to be this run's, so a refusal before never writes a lock into a
        folder that is not a run. Outside ``owning_runs`` (a trainer called directly) nothing is held."""
        held = _HELD_RUNS.get()
        if held is None or self.path.resolve() in held[1]:
            return
        self.path.mkdir(parents=True, exist_ok=True)
        held[0].enter_context(sole_owner(self.path / RUN_LOCK, f"run folder {self.path}"))
        held[1].add(self.path.resolve())

    def write_config(self, task: str, config: dict[str, Any], extra: dict[str, Any] | None = None) -> None:
        self.check_is_directory()
        self.path.mkdir(parents=True, exist_ok=True)
        record = {
            "task": task,
            "config": config,
            "lapheads_version": lapheads.__version__,
            "torch_version": torch.__version__,
            "git_revision": git_revision(),
            **(extra or {}),
        }
        atomic_write_text(self.config_file, json.dumps(record, indent=2) + "\n")

    def read_config(self) -> dict[str, Any]:
        try:
            record = json_loads(self.config_file.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{self.path} is not a run directory: no config.json") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{self.config_file} is corrupt: {err}") from None
        if not isinstance(record, dict) or not isinstance(record.get("config", {}), dict):
            raise CheckpointError(
                f"{self.config_file} holds {type(record).__name__ if not isinstance(record, dict) else 'a config'} "
                "that is not a lapheads run record; allowed: a JSON object with task and config"
            )
        return record

    def settings(self) -> SimpleNamespace:
        """The run's training config as attributes (``run.settings().dataset``), without importing training code."""
        return SimpleNamespace(**self.read_config().get("config", {}))

    def task(self, *allowed: str) -> str:
        """The run's task; with ``allowed``, anything else is a one-line error."""
        task = self.read_config().get("task")
        if allowed and task not in allowed:
            raise CheckpointError(f"{self.path} holds a {task!r} run; allowed here: {', '.join(allowed)}")
        return task

    def log(self, record: dict[str, Any]) -> None:
        with open(self.metrics_file, "a") as f:
            f.write(json.dumps(record) + "\n")
        for tracker in self.trackers:
            tracker.log(record)

    def read_metrics(self) -> list[dict[str, Any]]:
        return read_jsonl(self.metrics_file)[0]

    def last_metric(self, name: str) -> Any:
        """The last value of ``name`` in metrics.jsonl, or None where the run has not logged it."""
        values = [r[name] for r in self.read_metrics() if name in r]
        return values[-1] if values else None

    def finished(self) -> bool:
        """Whether the run reached its last step: ``latest`` names the step config.json records as the last."""
        try:
            folder = latest_checkpoint(self)
            steps = self.read_config().get("steps")
        except CheckpointError:
            return False
        return folder is not None and steps is not None and folder.name == step_name(steps)

    def read_report(self, name: str) -> dict[str, Any] | None:
        """A reader's cached JSON in report/ (eval_chat.json, eval_dino.json, analysis.json, ...), None if absent."""
        file = self.report_dir / name
        if not file.is_file():
            return None
        try:
            return json_loads(file.read_text())
        except json.JSONDecodeError as err:
            raise CheckpointError(f"{file} is corrupt ({err}); delete it to measure again") from None

    def write_report(self, name: str, value: Any) -> Path:
        """Write a reader's cache into report/ atomically."""
        self.report_dir.mkdir(parents=True, exist_ok=True)
        file = self.report_dir / name
        atomic_write_text(file, json.dumps(value, indent=1) + "\n")
        return file

    def truncate_log(self, name: str, after_step: int) -> None:
        """Drop records of the JSONL log ``name`` written after ``after_step`` (a resumed run writes them again)."""
        path = self.path / name
        if not path.exists():
            return
        records, _ = read_jsonl(path)
        kept = [r for r in records if r.get("step", 0) <= after_step]
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))

    def repair(self, logs: tuple[str, ...]) -> None:
        """Undo what a kill can leave behind, saying so in one line each: half-written checkpoint folders (never
        published, so never loaded) and a torn last line in a JSONL log."""
        for partial in sorted(self.checkpoints.glob(TEMPORARY_PREFIX + "*")):
            shutil.rmtree(partial, ignore_errors=True)
            log.warning(f"lapheads: removed the half-written checkpoint {partial}")
        for name in logs:
            path = self.path / name
            records, torn = read_jsonl(path)
            if torn:
                atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in records))
                log.warning(f"lapheads: dropped a torn last line of {path}")


def read_jsonl(path: Path) -> tuple[list[dict[str, Any]], bool]:
    """(records, whether a torn last line was skipped) of a JSONL log; a missing file has no records.

    A last line cut off by a kill is skipped (it is rewritten on resume); a bad line before it is corruption and a
    one-line error naming the file and line.
    """
    if not path.exists():
        return [], False
    lines = path.read_text().split("\n")
    records, torn = [], False
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json_loads(line))
        except json.JSONDecodeError as err:
            if number == len(lines):  # no newline after it: the write was interrupted
                torn = True
                continue
            raise CheckpointError(
                f"{path} line {number} is corrupt ({err}); allowed: one JSON object per line"
            ) from None
    return records, torn


def _within_run(run: RunDir, path: Path) -> Path:
    """``path`` itself, if neither it nor anything above it inside the run directory is a symlink leading out."""
    if path.is_symlink() or run.checkpoints.is_symlink() or not path.resolve().is_relative_to(run.path.resolve()):
        raise CheckpointError(
            f"{path} is a symlink or leads out of {run.path}; allowed: files inside the run directory"
        )
    return path


def files_within(folder: Path) -> Path:
    """``folder`` itself, if neither it nor anything in it is a symlink: a checkpoint's or tokenizer's files are the
    run's own, never a link to a file elsewhere."""
    if folder.is_symlink():
        raise CheckpointError(f"{folder} is a symlink; allowed: files inside the run directory")
    linked = next((entry for entry in folder.iterdir() if entry.is_symlink()), None) if folder.is_dir() else None
    if linked is not None:
        raise CheckpointError(f"{linked} is a symlink; allowed: files inside the run directory")
    return folder


def latest_checkpoint(run: RunDir) -> Path | None:
    pointer = run.checkpoints / LATEST
    if not pointer.is_file():
        return None
    _within_run(run, pointer)
    name = pointer.read_text().strip()
    if not re.fullmatch(re.escape(STEP_PREFIX) + r"\d+", name):  # never follow a pointer out of the run directory
        raise CheckpointError(f"{pointer} holds {name[:60]!r}; allowed: the name of a step-<N> folder beside it")
    folder = run.checkpoints / name
    if not folder.is_dir():
        raise CheckpointError(f"{pointer} points at {folder}, which does not exist")
    return files_within(_within_run(run, folder))


def checkpoint_folder(run: RunDir, step: int | None = None) -> Path:
    """The latest checkpoint (``step`` None) or the one of ``step``; a one-line error naming what exists."""
    if step is None:
        folder = latest_checkpoint(run)
        if folder is None:
            raise CheckpointError(f"{run.path} has no checkpoint yet")
        return folder
    folder = run.checkpoints / step_name(step)
    if not folder.is_dir():
        kept = ", ".join(str(s) for s in checkpoint_steps(run)) or "none"
        raise CheckpointError(
            f"{run.path} has no checkpoint of step {step}; allowed: {kept} (train with "
            "--keep-checkpoints 0 to keep them all)"
        )
    return files_within(_within_run(run, folder))


def checkpoint_steps(run: RunDir) -> list[int]:
    """The steps of the checkpoints a run directory holds, ascending."""
    return sorted(
        int(p.name.split("-")[1])
        for p in run.checkpoints.glob(STEP_PREFIX + "*")
        if p.name[len(STEP_PREFIX) :].isdigit()
    )
