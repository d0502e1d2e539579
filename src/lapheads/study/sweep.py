"""``lapheads sweep``: one preset over Laplacian specs x seeds, one run directory per cell, resumable.

Design choices:

* **A sweep directory is a contract too**: ``sweep.json`` records the preset, task, specs, seeds and overrides, and
  each cell's run directory and status. A directory holding a different sweep is refused, so cells of two
  experiments never mix.
* **Cells run one after another here** (each is an ordinary ``lapheads train`` run, so its own directory has the
  full config and seed); finished cells are skipped, an interrupted cell resumes from its last checkpoint.
  ``--dry-run`` prints one ``torchrun`` command per cell for a cluster scheduler instead (a ``*-cpu`` preset: one
  ``python -m lapheads train`` command per cell).
* **Spec lists**: ``0,1,3,6`` are k values; per-layer specs are separated by ``;`` (``0;2,2,0,0``).
* **Records outlive the machine** (``--records DIR``): each finished cell's record (``lapheads.runs.records``) is
  written into DIR; a cell whose record is there with the same config is skipped (another config: refused in one
  line, never overwritten), so a sweep continues from a folder of committed records on a fresh machine.
* **A plan is declared before the first cell** (``--plan PLAN``): the sweep must be exactly the plan's (preset,
  arms, seeds, overrides); the plan is copied into the records folder and its sha256 stamped into every record.
* **A sweep's own axes are its own**: ``--set seed=`` and ``--set laplacian_heads=`` are refused (they would make
  every cell the same run), and seeds and specs are normalised before duplicates are checked.
* **Read once, typed**: the CLI reads the options and the plan once into a :class:`SweepOptions` and a
  ``lapheads.study.cells.SweepDefinition``; every executor (here, a pool of processes, SLURM) has one signature,
  ``executor(run, cells)``, and cells, their configs and their records come from ``lapheads.study.cells``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lapheads.core.vocabulary import HEAD_SPEC_PATTERN
from lapheads.distributed import Interrupted, StoppedError
from lapheads.io import json_loads, read_regular_text, sole_owner
from lapheads.runs import SWEEP_FILE, SweepError
from lapheads.runs.layout import RECORDS_LOCK, SWEEP_LOCK
from lapheads.runs.sweep import arm_parts
from lapheads.study.cells import Cell, CellRecorder, CellStatus, SweepDefinition, train_argv, train_cell
from lapheads.study.records import RECORD_MAX_TOKENS, Plan, holds_analysis

__all__ = ["SweepOptions", "define_sweep", "parse_seeds", "parse_specs", "run_sweep"]


def parse_specs(text: str) -> list[str]:
    """A sweep's arms (``--laplacian-heads``), each one written head spec (``core.heads.HEAD_SPEC_PATTERN``):
    "0,1,3,6" -> ["0", "1", "3", "6"]; per-layer specs and kinds need ";" ("0;2,2,0,0", "0;3;negated:3;mix"); an arm
    may add training settings after its spec ("0;0+within_seq_penalty=0.5": ``runs.sweep.arm_parts``)."""
    plain_ks = re.fullmatch(r"\s*\d+\s*(,\s*\d+\s*)*", text) is not None
    arms = [item.strip() for item in (text.split(";") if ";" in text or not plain_ks else text.split(","))]
    for arm in arms:
        spec, _ = arm_parts(arm)
        if not HEAD_SPEC_PATTERN.fullmatch(spec):
            raise SweepError(
                f"malformed --laplacian-heads {text!r} (arm {arm!r}); allowed: k values like 0,1,3,6, or specs "
                "separated by ';' like 0;2,2,0,0 or 0;3;negated:3;mix (head kinds), each optionally followed by "
                "settings (0+within_seq_penalty=0.5)"
            )
    if len(set(arms)) < len(arms):
        raise SweepError(f"--laplacian-heads {text!r} repeats an arm")
    return arms


def parse_seeds(text: str) -> list[int]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items or not all(re.fullmatch(r"\d+", item) for item in items):
        raise SweepError(f"--seeds {text!r}: allowed: a non-empty comma list of integers like 0,1,2")
    seeds = [int(item) for item in items]
    if len(set(seeds)) < len(seeds):  # "0,00" is seed 0 twice
        raise SweepError(f"--seeds {text!r} repeats a seed; allowed: distinct integers")
    return seeds


def _flag_uncommitted_code(log) -> None:
    """A plan's cells should be trained by a commit: say so where this code is not one (each record says it too)."""
    from lapheads.runs.directory import uncommitted_changes

    changed = uncommitted_changes()
    if changed:
        log(
            f"sweep: warning: the lapheads code has uncommitted changes ({', '.join(changed[:3])}"
            f"{', ...' if len(changed) > 3 else ''}); each record will say so and the report lists its cells under "
            "'<revision>+uncommitted': train a study's cells from a commit (a frozen worktree)"
        )


@dataclasses.dataclass(frozen=True)
class SweepOptions:
    """How and where a sweep runs (not what it trains: that is its ``SweepDefinition``).

    Args:
        out: the sweep folder (sweep.json and one run directory per cell).
        records: a folder for the cells' records (committable): finished cells write theirs there, cells with a
            record there are skipped.
        plan: the plan (``lapheads.study.records.Plan``, read once) the sweep must match; needs ``records``.
        jobs: cells trained at once, each in its own process with ``threads // jobs`` threads (on a small CPU, two
            one-thread runs do more work than one two-thread run: docs/sweeps.md); 1 trains the cells in this
            process.
        threads: the threads all jobs share (default: the CPU count).
        cpu_kernels: "native", or the instruction set ("avx2", "avx512") every CPU kernel library of the cells is
            capped at (:func:`lapheads.hardware.pin_cpu_kernels`), so cells trained on different CPUs agree bit for
            bit and pair as one environment; the cells then train in child processes even with ``jobs`` 1.
        slurm: a :class:`lapheads.study.slurm.SlurmOptions`: the cells run as SLURM jobs (one array) instead of here;
            a rerun reports their states and resubmits only cells whose job ended unfinished.
        wait: with ``slurm``, wait until every job is over (else submit and return).
        dry_run: print one command per cell instead of training.
        nproc: with ``dry_run``, the processes per node of each printed ``torchrun`` command.
    """

    out: Path
    records: Path | None = None
    plan: Plan | None = None
    jobs: int = 1
    threads: int | None = None
    cpu_kernels: str = "native"
    slurm: Any = None
    wait: bool = False
    dry_run: bool = False
    nproc: int | None = None


def define_sweep(preset: str, task: str | None, arms: list[str], seeds: list[int], sets: list[str],
                 plan: Plan | None = None) -> SweepDefinition:  # fmt: skip
    """The sweep's definition from its options; with a plan, it must be exactly the plan's, field for field (a plan
    that a sweep may deviate from is no plan)."""
    definition = SweepDefinition.build(preset, task, arms, seeds, sets)
    if plan is not None:
        wanted = {"preset": plan.preset, "task": plan.task, "arms": plan.arms, "seeds": plan.seeds,
                  "overrides": plan.overrides}  # fmt: skip
        given = {"preset": preset, "task": definition.task, "arms": arms, "seeds": seeds, "overrides": list(sets)}
        for key, value in wanted.items():
            if given[key] != value:
                raise SweepError(
                    f"--plan {plan.path} declares {key} {value!r}; this sweep has {given[key]!r}; allowed: the plan's"
                )
    return definition


def run_sweep(definition: SweepDefinition, options: SweepOptions, log=print) -> dict[str, Any]:
    """Run (or print, with ``options.dry_run``) every cell of the sweep; returns the sweep record (sweep.json)."""
    from lapheads.hardware import pin_cpu_kernels

    if options.plan is not None and options.records is None:
        raise SweepError("--plan needs --records DIR: the plan is kept with the records it governs")
    if options.records is not None:
        out, records = Path(options.out).resolve(), Path(options.records).resolve()
        if out == records or records in out.parents or out in records.parents:
            # a sweep.json among the records makes `lapheads report DIR` read it as a sweep folder, not its records
            raise SweepError(
                f"--out {options.out} and --records {options.records} overlap; allowed: two separate folders (the "
                "records folder holds records and its plan alone)"
            )
    pins = pin_cpu_kernels(options.cpu_kernels, environ={})
    cells = definition.cells(Path(options.out))  # every cell's config resolved and checked before anything runs
    jobs_before = _check_sweep_folder(definition, Path(options.out), log)
    if options.dry_run:
        _print_commands(definition, options, cells, pins, log)
        return {**definition.to_json(), "cells": {c.name: _entry(c) for c in cells}}
    with contextlib.ExitStack() as locks:  # one writer per sweep folder and per records folder, pid named if not
        run = _SweepRun.start(definition, options, pins, log, locks, jobs_before)
        todo = run.todo(cells)
        run.save()
        executor = _on_slurm if options.slurm is not None else _in_processes if options.jobs > 1 or pins else _here
        try:
            executor(run, todo)
        except (KeyboardInterrupt, StoppedError, SystemExit) as err:  # its cells stopped at their last checkpoint
            if options.slurm is not None and not isinstance(err, SystemExit):  # only the waiting stopped
                raise Interrupted("interrupted while waiting; the SLURM jobs go on; rerun the same command to see "
                                  "their states") from None  # fmt: skip
            stopped = run.interrupted()
            if isinstance(err, SystemExit):  # SIGTERM (exit 143): the status is saved; the exit stays the signal's
                raise
            raise _interrupted(stopped) from None
        return run.ledger


def _interrupted(stopped: list[str]) -> Interrupted:
    return Interrupted(
        f"interrupted; {', '.join(stopped) or 'no cell'} stopped at its last checkpoint; rerun the same command to "
        "resume"
    )


def _check_sweep_folder(definition: SweepDefinition, sweep_dir: Path, log) -> dict[str, str]:
    """A folder holding a sweep must hold this one (or fewer of its arms and seeds); returns the SLURM job ids its
    sweep.json keeps, by cell (a rerun must not submit a live cell twice)."""
    if not (sweep_dir / SWEEP_FILE).exists():
        return {}
    existing = _read_sweep(sweep_dir / SWEEP_FILE)
    added = _extension(existing, definition.to_json(), sweep_dir)
    if added:
        log(f"sweep: extending {sweep_dir} with {added}")
    return {name: c["slurm_job"] for name, c in (existing.get("cells") or {}).items() if c.get("slurm_job")}


def _entry(cell: Cell) -> dict[str, Any]:
    """A cell in sweep.json (its run directory relative: a sweep folder moves whole)."""
    return {"spec": cell.arm, "seed": cell.seed, "run_dir": cell.run_dir.name}


def _print_commands(definition: SweepDefinition, options: SweepOptions, cells: list[Cell], pins, log) -> None:
    """One command per cell for a cluster scheduler: ``torchrun`` (a ``*-cpu`` preset: ``python -m``)."""
    single = options.nproc is None and definition.preset.endswith("-cpu")
    for cell in cells:
        launcher = ["python", "-m"] if single else ["torchrun", f"--nproc_per_node={options.nproc or 8}", "-m"]
        prefix = [f"{name}={value}" for name, value in pins.items()]
        log(shlex.join([*prefix, *launcher, *train_argv(definition, cell)]))


@dataclasses.dataclass
class _SweepRun:
    """One invocation of a sweep: its definition and options, sweep.json's ledger (this process alone writes it),
    the records folder and the kernel pins. Every executor takes it and the cells to train."""

    definition: SweepDefinition
    options: SweepOptions
    ledger: dict[str, Any]
    recorder: CellRecorder | None
    pins: dict[str, str]
    log: Any
    jobs_before: dict[str, str]  # a SLURM sweep's job ids: a rerun must not submit a live cell twice

    @classmethod
    def start(cls, definition, options, pins, log, locks, jobs_before) -> _SweepRun:
        """Lock the folders and install the plan."""
        from lapheads.study.records import install_plan

        sweep_dir = Path(options.out)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        locks.enter_context(sole_owner(sweep_dir / SWEEP_LOCK, f"sweep folder {sweep_dir}"))
        recorder = None
        if options.records is not None:
            records = Path(options.records)
            records.mkdir(parents=True, exist_ok=True)
            locks.enter_context(sole_owner(records / RECORDS_LOCK, f"records folder {records}"))
            if options.plan is not None:
                install_plan(options.plan, records)
                _flag_uncommitted_code(log)
            recorder = CellRecorder(records, definition, options.plan)
        records_name = None if options.records is None else str(options.records)
        ledger = {**definition.to_json(), "records": records_name, "cells": {}}
        return cls(definition, options, ledger, recorder, pins, log, jobs_before)

    def save(self) -> None:
        from lapheads.io import atomic_write_text

        atomic_write_text(Path(self.options.out) / SWEEP_FILE, json.dumps(self.ledger, indent=1) + "\n")

    def mark(self, cell: Cell, status: CellStatus) -> None:
        self.ledger["cells"][cell.name]["status"] = status.value
        self.save()

    def interrupted(self) -> list[str]:
        """Mark the cells that were training here as interrupted (a rerun resumes them; a SLURM job goes on);
        returns the names of every interrupted cell."""
        cells = self.ledger["cells"].items()
        for _, cell in cells:
            if cell.get("status") == CellStatus.RUNNING.value and not cell.get("slurm_job"):
                cell["status"] = CellStatus.INTERRUPTED.value
        self.save()
        return [name for name, cell in cells if cell.get("status") == CellStatus.INTERRUPTED.value]

    def analysed_here(self) -> bool:
        """Cells' analyses for their records run as processes of their own, side by side (:func:`_schedule`)."""
        return self.recorder is not None and holds_analysis(self.definition.task)

    def todo(self, cells: list[Cell]) -> list[Cell]:
        """The cells still to train (or, trained before without a record, to analyse); the others' status said."""
        todo = []
        for cell in cells:
            entry = _entry(cell)
            if cell.name in self.jobs_before:
                entry["slurm_job"] = self.jobs_before[cell.name]
            if self.recorder is not None and self.recorder.has(cell):
                self.ledger["cells"][cell.name] = {**entry, "status": CellStatus.RECORDED.value}
                self.log(f"sweep: {cell.name} has its record in {self.options.records}, skipped")
                continue
            if not cell.finished():
                self.ledger["cells"][cell.name] = {**entry, "status": CellStatus.PENDING.value}
                todo.append(cell)
                continue
            self.ledger["cells"][cell.name] = {**entry, "status": CellStatus.DONE.value}
            self.log(f"sweep: {cell.name} finished before, skipped")
            in_processes = self.options.slurm is None and (self.options.jobs > 1 or self.pins)
            if in_processes and self.analysed_here():
                todo.append(cell)  # no record yet: analysed side by side with the others (_schedule)
            elif self.recorder is not None:
                self.recorder.write(cell, None, self.options.threads or 0)
        return todo


def _here(run: _SweepRun, todo: list[Cell]) -> None:
    """Train the cells one after another in this process (``--jobs 1``, native kernels)."""
    import torch

    previous = torch.get_num_threads()
    if run.options.threads:
        torch.set_num_threads(run.options.threads)  # cells train in this process: --threads caps it as it caps a job
    try:
        for cell in todo:
            run.mark(cell, CellStatus.RUNNING)
            run.log(f"sweep: {cell.name} {'resuming' if cell.started() else 'training'} into {cell.run_dir}")
            began = time.monotonic()
            train_cell(run.definition, cell)
            if run.recorder is not None:
                run.recorder.write(cell, time.monotonic() - began, torch.get_num_threads())
            run.mark(cell, CellStatus.DONE)
    finally:
        torch.set_num_threads(previous)


def _on_slurm(run: _SweepRun, todo: list[Cell]) -> None:
    """The cells as SLURM jobs (lapheads.study.slurm): each trains and writes its own record; with ``wait``, a cell
    whose job ended unfinished fails the command with its log's last lines (a rerun resubmits only those)."""
    from lapheads.study import slurm

    folder = Path(run.options.out) / "slurm"
    records = None if run.options.records is None else Path(run.options.records).resolve()
    job = slurm.CellJobInput(run.definition, records, run.options.plan)
    live = slurm.submit_cells(todo, run.ledger["cells"], folder, run.options.slurm, job, run.pins, run.log)
    run.save()
    if not run.options.wait:
        if live:
            run.log(f"sweep: {len(live)} cell(s) with SLURM; run the same command again to see their states")
        return
    failed = slurm.wait_for(live, run.ledger["cells"], folder, run.save, run.log)
    if failed:
        raise SweepError(f"{len(failed)} cell(s) failed: {'; '.join(failed)}; rerun the same command to resubmit them")


def _in_processes(run: _SweepRun, todo: list[Cell]) -> None:
    """Train the cells as ``jobs`` concurrent ``lapheads train`` processes; this process alone writes sweep.json
    (and the records, each as its cell finishes, with one thread). Each cell's output goes to
    SWEEP_DIR/logs/<cell>.log; a failed cell is recorded and the others go on."""
    import os

    per_job = max(1, (run.options.threads or os.cpu_count() or 1) // run.options.jobs)
    env = {**os.environ, **run.pins, "OMP_NUM_THREADS": str(per_job), "MKL_NUM_THREADS": str(per_job)}
    queue, running, failed = list(todo), {}, []
    with _children_end_with_the_sweep(running):
        _schedule(run, queue, running, failed, per_job, env)
    stopped = [name for name, cell in run.ledger["cells"].items() if cell["status"] == CellStatus.INTERRUPTED.value]
    if stopped:  # the terminal's Ctrl-C reached the cells (this process may ignore SIGINT: a background job)
        raise _interrupted(stopped)
    if failed:
        raise SweepError(f"{len(failed)} cell(s) failed: {'; '.join(failed)}; rerun the same command to retry them")


def _read_sweep(path: Path) -> dict[str, Any]:
    try:
        return json_loads(read_regular_text(path))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SweepError(
            f"{path} is corrupt ({type(err).__name__}: {err}); allowed: a sweep.json lapheads wrote"
        ) from None


def _extension(existing: dict[str, Any], definition: dict[str, Any], sweep_dir: Path) -> str:
    """What ``definition`` adds to the sweep recorded in ``sweep_dir`` ("" when it is the same sweep).

    The same preset, task and overrides with the same or more specs and seeds resumes or extends the sweep (a
    third seed for every arm, a new arm against the same baseline); anything else is another experiment.
    """
    same_recipe = all(existing.get(key) == definition[key] for key in ("preset", "task", "overrides"))
    old_specs, old_seeds = existing.get("specs") or [], existing.get("seeds") or []
    grows = set(old_specs) <= set(definition["specs"]) and set(old_seeds) <= set(definition["seeds"])
    if not (same_recipe and grows):
        raise SweepError(
            f"{sweep_dir} holds a different sweep ({existing.get('preset')}, overrides {existing.get('overrides')}, "
            f"specs {old_specs}, seeds {old_seeds}); allowed: the same preset and overrides with these specs and "
            "seeds or more of them (to resume or extend it), or another --out"
        )
    new_specs = [spec for spec in definition["specs"] if spec not in old_specs]
    new_seeds = [seed for seed in definition["seeds"] if seed not in old_seeds]
    return ", ".join(
        f"{what} {','.join(map(str, items))}" for what, items in (("specs", new_specs), ("seeds", new_seeds)) if items
    )


@contextlib.contextmanager
def _children_end_with_the_sweep(running: dict[str, Any]):
    """A sweep stopped (Ctrl-C, SIGTERM, an error) stops its cells too: each is sent SIGTERM, checkpoints its step
    and exits, so no orphan keeps writing a cell a rerun would start again."""
    import signal
    import threading

    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143)) if main else None  # 128 + SIGTERM
    try:
        yield
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
        for _, proc, handle, _ in running.values():
            if proc.poll() is None:
                proc.terminate()
        for _, proc, handle, _ in running.values():
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
            handle.close()


def _schedule(run: _SweepRun, queue: list[Cell], running: dict[str, Any], failed: list[str], per_job: int, env):
    """The job loop of :func:`_in_processes`: start cells while slots are free, collect the finished ones. With
    records, a cell that finished training keeps its slot for a second process, ``lapheads analyze`` with the
    record's options (cached in its run directory): cells are analysed side by side with their own threads, and
    this process then writes each record from the cache (on a many-core host it would otherwise analyse every cell
    one after another)."""
    logs = Path(run.options.out) / "logs"
    analysing: set[str] = set()
    while queue or running:
        while queue and len(running) < run.options.jobs:
            cell = queue.pop(0)
            if run.analysed_here() and cell.finished():  # trained before (an interrupted sweep): only its analysis
                running[cell.name] = (cell, *_analyse(cell, env, logs), None)
                analysing.add(cell.name)
                run.log(f"sweep: {cell.name} trained before; analysing it for its record")
                continue
            running[cell.name] = (cell, *_start_training(run, cell, env, logs, per_job), time.monotonic())
        time.sleep(0.5)
        for name, (cell, proc, handle, began) in list(running.items()):
            if proc.poll() is None:
                continue
            handle.close()
            del running[name]
            done = proc.returncode == 0 and cell.finished()
            if done and run.analysed_here() and name not in analysing:
                analysing.add(name)
                running[name] = (cell, *_analyse(cell, env, logs), began)
                run.log(f"sweep: {name} trained; analysing it for its record")
                continue
            if name in analysing:  # trained; an analysis that failed is redone below, where its error is raised
                done = cell.finished()
            if done and run.recorder is not None:
                _record_beside_the_others(run, cell, None if began is None else time.monotonic() - began, per_job)
            if not done and proc.returncode == Interrupted.exit_code:  # stopped at its checkpoint, not failed
                run.mark(cell, CellStatus.INTERRUPTED)
                run.log(f"sweep: {name} interrupted")
                queue.clear()  # a Ctrl-C stops the sweep: no new cell starts
                continue
            run.mark(cell, CellStatus.DONE if done else CellStatus.FAILED)
            if not done:
                failed.append(f"{name} (exit {proc.returncode}, see {logs / (name + '.log')})")
            run.log(f"sweep: {name} {'done' if done else 'FAILED'}")


def _start_training(run: _SweepRun, cell: Cell, env, logs: Path, per_job: int) -> tuple[subprocess.Popen, Any]:
    """Start ``lapheads train`` for one cell in a child process (``--resume`` when its folder holds a run)."""
    resume = cell.started()
    argv = [sys.executable, "-m", *train_argv(run.definition, cell), *(["--resume"] if resume else [])]
    logs.mkdir(parents=True, exist_ok=True)
    handle = open(logs / f"{cell.name}.log", "a")
    process = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, env=env)
    run.mark(cell, CellStatus.RUNNING)
    run.log(
        f"sweep: {cell.name} {'resuming' if resume else 'training'} into {cell.run_dir} "
        f"({per_job} thread{'s' if per_job > 1 else ''}; log {logs / (cell.name + '.log')})"
    )
    return process, handle


def _record_beside_the_others(run: _SweepRun, cell: Cell, wall_seconds: float | None, per_job: int) -> None:
    """Write a finished cell's record with one job's threads (the cells still training keep theirs)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(per_job)
    try:
        run.recorder.write(cell, wall_seconds, per_job)
    finally:
        torch.set_num_threads(previous)


def _analyse(cell: Cell, env: dict[str, str], logs: Path) -> tuple[subprocess.Popen, Any]:
    """Start ``lapheads analyze`` on a trained cell with the options its record reads (the result is cached in its
    run directory); its output goes to the cell's log. Returns the process and the open log."""
    argv = [sys.executable, "-m", "lapheads", "analyze", str(cell.run_dir), "--max-tokens", str(RECORD_MAX_TOKENS)]
    logs.mkdir(parents=True, exist_ok=True)
    handle = open(logs / f"{cell.name}.log", "a")
    return subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, env=env), handle
