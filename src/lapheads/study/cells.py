"""A sweep's cells: the sweep's definition, one cell (its config resolved once), training it, and its record.

Design choices:

* **A sweep is one frozen value** (:class:`SweepDefinition`): preset, task, arms, seeds and the config overrides.
  ``lapheads sweep`` builds it once from its options (and checks it against a plan there), sweep.json stores it, a
  SLURM job receives it. On disk its arms sit under ``"specs"``: the key every committed record's ``sweep`` already
  carries (records are never rewritten).
* **A cell is one frozen value** (:class:`Cell`): arm, seed, run directory and its config, resolved once when the
  sweep lists its cells; training, the record's config check and the record all read that one config.
* **An arm is one word**: a head spec, optionally with training settings of its own after ``+``
  (``lapheads.runs.sweep.arm_parts``); ``{arm}`` (or the older ``{spec}``) in an override is the arm as the cell's
  folder spells it, so ``--set base=runs/sweeps/chat-cpu-base/L{arm}-s{seed}`` names that folder.
* **Every executor trains a cell the same way**: in this process and in a SLURM job with :func:`train_cell`, in a
  child process with the ``lapheads train`` command :func:`train_argv` spells (the same config, from the same
  overrides). This module imports no executor, so ``lapheads.study.slurm`` and ``lapheads.study.sweep`` both
  import it and not each other.
"""

from __future__ import annotations

import dataclasses
import enum
from pathlib import Path
from typing import Any

from lapheads.runs import RunDir, SweepError, spec_dir_name
from lapheads.runs.sweep import arm_overrides, arm_parts
from lapheads.tasks import get_task

__all__ = [
    "Cell",
    "CellRecorder",
    "CellStatus",
    "SweepDefinition",
    "cell_name",
    "train_argv",
    "train_cell",
]


class CellStatus(str, enum.Enum):
    """A cell's status in sweep.json (a SLURM cell also shows SLURM's own state while its job is queued or runs)."""

    PENDING = "pending"  # not trained yet
    RUNNING = "running"  # training here or in a child process
    SUBMITTED = "submitted"  # handed to SLURM
    DONE = "done"  # trained to its last step
    RECORDED = "recorded"  # its record was already in the records folder: not trained again
    FAILED = "failed"  # its process or job ended before its last step
    INTERRUPTED = "interrupted"  # the sweep was stopped (Ctrl-C, SIGTERM) while it trained: a rerun resumes it


def cell_name(arm: str, seed: int) -> str:
    """The cell's folder and record name: ``L<arm>-s<seed>``."""
    return f"{spec_dir_name(arm)}-s{seed}"


#: the config fields a sweep sets per cell itself: ``--set`` may not
SWEEP_AXES = ("seed", "laplacian_heads")


def config_overrides(sets: list[str]) -> tuple[str, ...]:
    """``--set key=value`` items -> ``--key value`` arguments; ``{arm}``/``{seed}`` in a value stay for each cell."""
    out: list[str] = []
    for item in sets:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise SweepError(f"--set {item!r}: allowed: key=value (a config field of the preset)")
        if key.strip().replace("-", "_") in SWEEP_AXES:
            raise SweepError(
                f"--set {item!r}: {key.strip()} is an axis of the sweep (every cell has its own); allowed: "
                "--seeds and --laplacian-heads"
            )
        out += [f"--{key.strip().replace('_', '-')}", value]
    return tuple(out)


def task_of(preset: str, task: str | None) -> str:
    """The task a preset trains (a preset file names none: ``task`` must)."""
    from lapheads.tasks.presets import PRESETS

    tasks = [name for name, presets in PRESETS.items() if preset in presets]
    if tasks:
        if task is not None and task != tasks[0]:
            raise SweepError(f"preset {preset!r} is a {tasks[0]} preset, not {task}")
        return tasks[0]
    if preset.endswith(".json") or Path(preset).is_file():
        if task not in PRESETS:
            raise SweepError(f"a preset file needs --task; allowed: {', '.join(PRESETS)}")
        return task
    names = [name for presets in PRESETS.values() for name in presets]
    raise SweepError(f"unknown preset {preset!r}; allowed: {', '.join(names)} or a .json preset file with --task")


@dataclasses.dataclass(frozen=True)
class SweepDefinition:
    """What a sweep trains: every arm at every seed, from one preset with the same overrides.

    Args:
        preset: a preset name, or a preset file.
        task: the task the preset trains.
        arms: head specs, each optionally with settings of its own (``lapheads.runs.sweep.arm_parts``).
        seeds: the seeds every arm is trained at (cells are paired by seed).
        overrides: ``--key value`` config arguments every cell gets (:func:`config_overrides`).
    """

    preset: str
    task: str
    arms: tuple[str, ...]
    seeds: tuple[int, ...]
    overrides: tuple[str, ...]

    @classmethod
    def build(cls, preset: str, task: str | None, arms: list[str], seeds: list[int], sets: list[str]):
        """The definition from the sweep's options: the task found from the preset, ``--set`` items checked."""
        return cls(preset, task_of(preset, task), tuple(arms), tuple(seeds), config_overrides(sets))

    def to_json(self) -> dict[str, Any]:
        """sweep.json's and each record's ``sweep``: the arms under their on-disk key, ``specs``."""
        return {
            "preset": self.preset,
            "task": self.task,
            "specs": list(self.arms),
            "seeds": list(self.seeds),
            "overrides": list(self.overrides),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SweepDefinition:
        return cls(data["preset"], data["task"], tuple(data["specs"]), tuple(data["seeds"]), tuple(data["overrides"]))

    def cell(self, sweep_dir: Path, arm: str, seed: int) -> Cell:
        """One cell, its config resolved (and checked by its task) here, once."""
        from lapheads.tasks.presets import resolve_config

        run_dir = Path(sweep_dir) / cell_name(arm, seed)
        spec = arm_parts(arm)[0]
        config = resolve_config(self.task, self.preset, spec, [*self.cell_overrides(arm, seed), "--seed", str(seed)])
        get_task(self.task).check(config)
        return Cell(arm, seed, run_dir, config)

    def cells(self, sweep_dir: Path) -> list[Cell]:
        """Seed-major: a sweep stopped part-way holds complete pairs (every arm of the first seeds), which is what
        the paired statistics of ``lapheads report`` compare."""
        return [self.cell(sweep_dir, arm, seed) for seed in self.seeds for arm in self.arms]

    def cell_overrides(self, arm: str, seed: int) -> list[str]:
        """One cell's overrides: the sweep's (``{arm}``/``{spec}`` and ``{seed}`` filled in), then its arm's
        settings."""
        spelled = spec_dir_name(arm).removeprefix("L")  # the arm as its folder spells it
        filled = [o.replace("{arm}", spelled).replace("{spec}", spelled).replace("{seed}", str(seed)) for o in
                  self.overrides]  # fmt: skip
        return [*filled, *arm_overrides(arm)]


@dataclasses.dataclass(frozen=True)
class Cell:
    """One arm at one seed: its run directory and its resolved config (a task's config dataclass)."""

    arm: str
    seed: int
    run_dir: Path
    config: Any = dataclasses.field(compare=False, repr=False)

    @property
    def name(self) -> str:
        return cell_name(self.arm, self.seed)

    @property
    def head_spec(self) -> str:
        return arm_parts(self.arm)[0]

    def finished(self) -> bool:
        """Trained to the run's last step (its latest checkpoint is there)."""
        return RunDir(self.run_dir).finished()

    def started(self) -> bool:
        """Its run directory holds a run to resume."""
        return RunDir(self.run_dir).exists()


def train_argv(definition: SweepDefinition, cell: Cell) -> list[str]:
    """``lapheads train ...`` for one cell (after ``python -m`` or ``torchrun ... -m``): the config
    :meth:`SweepDefinition.cell` resolved, spelled as the command that resolves it again in a child process."""
    head = ["lapheads", "train", definition.task, "--preset", definition.preset, "--laplacian-heads", cell.head_spec]
    return [*head, "--seed", str(cell.seed), "--out", str(cell.run_dir),
            *definition.cell_overrides(cell.arm, cell.seed)]  # fmt: skip


def _train(task: str):
    return get_task(task).train_function()


def train_cell(definition: SweepDefinition, cell: Cell) -> None:
    """Train one cell in this process (resuming its run directory when it holds a run): the sweep's own loop and
    a SLURM job (lapheads.study.slurm) both train a cell this way."""
    _train(definition.task)(cell.config, cell.run_dir, resume=cell.started())


class CellRecorder:
    """The records folder of a sweep: which cells have a record, and writing a finished cell's."""

    def __init__(self, folder: Path, definition: SweepDefinition, plan: Any = None):
        self.folder, self.definition, self.plan = Path(folder), definition, plan

    def has(self, cell: Cell) -> bool:
        """Its record is there, for this config (a record of another config is refused, never overwritten)."""
        from lapheads.study.records import check_record, record_or_none

        found = record_or_none(self.folder, cell.name, dataclasses.asdict(cell.config))
        if found is not None:
            check_record(found, self.plan)
        return found is not None

    def write(self, cell: Cell, wall_seconds: float | None, threads: int) -> None:
        from lapheads.runs.records import write_record
        from lapheads.study.records import build_record

        data = build_record(
            cell.run_dir,
            name=cell.name,
            spec=cell.arm,
            seed=cell.seed,
            sweep=self.definition.to_json(),
            plan_sha256=None if self.plan is None else self.plan.sha256,
            threads=threads or None,
            wall_seconds=wall_seconds,
        )
        write_record(self.folder, data)
