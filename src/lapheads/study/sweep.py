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
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lapheads.core.heads import HEAD_SPEC_PATTERN, HeadSpecError, parse_spec_arms
from lapheads.io import json_loads, sole_owner
from lapheads.runs import SWEEP_FILE, RunDir, SweepError, spec_dir_name
from lapheads.runs.layout import PLAN_FILE, RECORDS_LOCK, SWEEP_LOCK
from lapheads.runs.sweep import ARM_SETTING, arm_overrides, arm_parts
from lapheads.study.records import RECORD_MAX_TOKENS, holds_analysis
from lapheads.tasks import get_task

__all__ = ["SweepError", "cell_name", "parse_seeds", "parse_specs", "run_sweep", "sweep_cells"]


def parse_specs(text: str) -> list[str]:
    """A sweep's arms (``--laplacian-heads``), split by the one head-spec parser (``core.heads.parse_spec_arms``);
    an arm may add training settings after its spec ("0;0+within_seq_penalty=0.5": ``runs.sweep.arm_parts``)."""
    if ARM_SETTING not in text:
        try:
            return parse_spec_arms(text)
        except HeadSpecError as err:
            raise SweepError(str(err)) from None
    arms = [item.strip() for item in text.split(";")]
    for arm in arms:
        spec, _ = arm_parts(arm)
        if not HEAD_SPEC_PATTERN.fullmatch(spec):
            raise SweepError(
                f"arm {arm!r}: head spec {spec!r}; allowed: a spec like 3, 0,2,2,0 or sum:3, then settings"
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


def cell_name(spec: str, seed: int) -> str:
    return f"{spec_dir_name(spec)}-s{seed}"


def _task_of(preset: str, task: str | None) -> str:
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


@dataclass
class Cell:
    spec: str  # the arm: a head spec, and any settings of its own (runs.sweep.arm_parts)
    seed: int
    run_dir: Path

    @property
    def name(self) -> str:
        return cell_name(self.spec, self.seed)

    @property
    def head_spec(self) -> str:
        return arm_parts(self.spec)[0]

    def argv(self, overrides: list[str]) -> list[str]:
        """The cell's config overrides: the sweep's (with {spec} and {seed} filled in), its arm's settings, its
        seed."""
        return [*_for_cell(overrides, self), *arm_overrides(self.spec), "--seed", str(self.seed)]


def sweep_cells(sweep_dir: Path, specs: list[str], seeds: list[int]) -> list[Cell]:
    """Seed-major: a sweep stopped part-way holds complete pairs (every spec of the first seeds), which is what the
    paired statistics of ``lapheads report`` compare."""
    return [Cell(spec, seed, sweep_dir / cell_name(spec, seed)) for seed in seeds for spec in specs]


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


def _finished(run_dir: Path) -> bool:
    """A cell is finished when its latest checkpoint is at the run's last step."""
    return RunDir(run_dir).finished()


_AXES = ("seed", "laplacian_heads")  # set per cell by the sweep itself


def _overrides(sets: list[str]) -> list[str]:
    """``--set key=value`` -> ``--key value``; ``{spec}`` and ``{seed}`` in a value stay for :func:`_for_cell`."""
    out = []
    for item in sets:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise SweepError(f"--set {item!r}: allowed: key=value (a config field of the preset)")
        if key.strip().replace("-", "_") in _AXES:
            raise SweepError(
                f"--set {item!r}: {key.strip()} is an axis of the sweep (every cell has its own); allowed: "
                "--seeds and --laplacian-heads"
            )
        out += [f"--{key.strip().replace('_', '-')}", value]
    return out


def _for_cell(overrides: list[str], cell: "Cell") -> list[str]:
    """The overrides of one cell: ``{spec}`` / ``{seed}`` in a value become the cell's (e.g. an SFT sweep's
    ``--set base=runs/sweeps/chat-cpu-base/L{spec}-s{seed}``: each arm fine-tunes its own base)."""
    spec = cell.spec.replace(",", "_")
    return [o.replace("{spec}", spec).replace("{seed}", str(cell.seed)) for o in overrides]


def run_sweep(
    preset: str,
    specs: list[str],
    seeds: list[int],
    out: str | Path,
    sets: list[str] | None = None,
    dry_run: bool = False,
    task: str | None = None,
    nproc: int | None = None,
    log=print,
    jobs: int = 1,
    threads: int | None = None,
    records: str | Path | None = None,
    plan: str | Path | None = None,
    cpu_kernels: str = "native",
    slurm: Any = None,
    wait: bool = False,
) -> dict[str, Any]:
    """Run (or print, with ``dry_run``) every cell of the sweep; returns the sweep record.

    Args:
        jobs: cells trained at once, each in its own process with ``threads // jobs`` threads (on a small CPU, two
            one-thread runs do ~1.7x the work of one two-thread run); 1 trains the cells in this process.
        threads: the threads all jobs share (default: the CPU count).
        records: a folder for the cells' records (committable): finished cells write theirs there, cells with a
            record there are skipped.
        plan: a plan file (``lapheads.study.records.Plan``) the sweep must match; needs ``records``.
        cpu_kernels: "native", or the instruction set ("avx2", "avx512") every CPU kernel library of the cells is
            capped at (:func:`lapheads.hardware.pin_cpu_kernels`), so cells trained on different CPUs agree bit for
            bit and pair as one environment; the cells then train in child processes even with ``jobs`` 1.
        slurm: a :class:`lapheads.study.slurm.SlurmOptions`: the cells run as SLURM jobs (one array) instead of here; a
            rerun reports their states and resubmits only cells whose job ended unfinished (lapheads.study.slurm).
        wait: with ``slurm``, wait until every job is over (else submit and return).
    """
    from lapheads.hardware import pin_cpu_kernels
    from lapheads.io import atomic_write_text
    from lapheads.study.records import install_plan, load_plan
    from lapheads.tasks.presets import resolve_config

    task = _task_of(preset, task)
    overrides = _overrides(sets or [])
    pins = pin_cpu_kernels(cpu_kernels, environ={})
    if plan is not None:
        if records is None:
            raise SweepError("--plan needs --records DIR: the plan is kept with the records it governs")
        _check_against_plan(load_plan(plan), preset, task, specs, seeds, sets or [], plan)
    for cell in sweep_cells(Path(out), specs, seeds[:1]):  # every cell's config and spec, before anything runs
        get_task(task).check(resolve_config(task, preset, cell.head_spec, cell.argv(overrides)))
    sweep_dir = Path(out)
    definition = {"preset": preset, "task": task, "specs": specs, "seeds": seeds, "overrides": overrides}
    record_file = sweep_dir / SWEEP_FILE
    jobs_before: dict[str, str] = {}  # a SLURM sweep's job ids: a rerun must not submit a live cell twice
    if record_file.exists():
        existing = _read_sweep(record_file)
        added = _extension(existing, definition, sweep_dir)
        if added:
            log(f"sweep: extending {sweep_dir} with {added}")
        jobs_before = {n: c["slurm_job"] for n, c in (existing.get("cells") or {}).items() if c.get("slurm_job")}
    cells = sweep_cells(sweep_dir, specs, seeds)
    if dry_run:
        single = nproc is None and preset.endswith("-cpu")  # a CPU recipe: one process a cell, no torchrun
        for cell in cells:
            launcher = ["python", "-m"] if single else ["torchrun", f"--nproc_per_node={nproc or 8}", "-m"]
            prefix = [f"{name}={value}" for name, value in pins.items()]
            log(shlex.join([*prefix, *launcher, *_train_argv(task, preset, cell, overrides)]))
        return {
            **definition,
            "cells": {c.name: {"spec": c.spec, "seed": c.seed, "run_dir": c.run_dir.name} for c in cells},
        }
    with contextlib.ExitStack() as locks:  # one writer per sweep folder and per records folder, pid named if not
        sweep_dir.mkdir(parents=True, exist_ok=True)
        locks.enter_context(sole_owner(sweep_dir / SWEEP_LOCK, f"sweep folder {sweep_dir}"))
        if records is not None:
            Path(records).mkdir(parents=True, exist_ok=True)
            locks.enter_context(sole_owner(Path(records) / RECORDS_LOCK, f"records folder {records}"))
        plan_ = install_plan(plan, records) if plan is not None else None
        recorder = None if records is None else CellRecorder(Path(records), definition, plan_, task, preset, overrides)
        record = {**definition, "records": None if records is None else str(records), "cells": {}}

        def save() -> None:
            atomic_write_text(record_file, json.dumps(record, indent=1) + "\n")

        todo = []
        for cell in cells:
            entry = {
                "spec": cell.spec,
                "seed": cell.seed,
                "run_dir": cell.run_dir.name,
                **({"slurm_job": jobs_before[cell.name]} if cell.name in jobs_before else {}),
            }  # relative: a sweep moves whole
            if recorder is not None and recorder.has(cell):
                record["cells"][cell.name] = {**entry, "status": "recorded"}
                log(f"sweep: {cell.name} has its record in {records}, skipped")
            elif _finished(cell.run_dir):
                record["cells"][cell.name] = {**entry, "status": "done"}
                log(f"sweep: {cell.name} finished before, skipped")
                if recorder is not None and slurm is None and (jobs > 1 or pins) and holds_analysis(task):
                    todo.append(cell)  # no record yet: analysed side by side with the others (_schedule)
                elif recorder is not None:
                    recorder.write(cell, None, threads or 0)
            else:
                record["cells"][cell.name] = {**entry, "status": "pending"}
                todo.append(cell)
        save()
        if slurm is not None:
            _run_on_slurm(todo, sweep_dir, record, save, log, definition, records, plan, slurm, pins, wait)
            return record
        if jobs > 1 or pins:  # pins act only on a torch not yet loaded: the cells' own processes
            _run_parallel(todo, sweep_dir, task, preset, overrides, record, save, log, jobs, threads, recorder, pins)
            return record
        import torch

        previous = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)  # cells train in this process: --threads caps it as it caps each job
        try:
            for cell in todo:
                record["cells"][cell.name]["status"] = "running"
                save()
                resume = RunDir(cell.run_dir).exists()
                log(f"sweep: {cell.name} {'resuming' if resume else 'training'} into {cell.run_dir}")
                began = time.monotonic()
                train_cell(task, preset, overrides, cell)
                if recorder is not None:
                    recorder.write(cell, time.monotonic() - began, torch.get_num_threads())
                record["cells"][cell.name]["status"] = "done"
                save()
        finally:
            torch.set_num_threads(previous)
        return record


def _read_sweep(path: Path) -> dict[str, Any]:
    try:
        return json_loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SweepError(
            f"{path} is corrupt ({type(err).__name__}: {err}); allowed: a sweep.json lapheads wrote"
        ) from None


def _check_against_plan(
    plan, preset: str, task: str, specs: list[str], seeds: list[int], sets: list[str], path
) -> None:
    """The sweep must be the plan's, field for field (a plan that a sweep may deviate from is no plan)."""
    wanted = {
        "preset": plan.preset,
        "task": plan.task,
        "arms": plan.arms,
        "seeds": plan.seeds,
        "overrides": plan.overrides,
    }
    given = {"preset": preset, "task": task, "arms": specs, "seeds": seeds, "overrides": list(sets)}
    for key, value in wanted.items():
        if given[key] != value:
            raise SweepError(
                f"--plan {path} declares {key} {value!r}; this sweep has {given[key]!r}; allowed: the plan's"
            )


class CellRecorder:
    """The records folder of a sweep: which cells have a record, and writing a finished cell's."""

    def __init__(self, folder: Path, definition: dict[str, Any], plan, task: str, preset: str, overrides: list[str]):
        self.folder, self.definition, self.plan = folder, definition, plan
        self.task, self.preset, self.overrides = task, preset, overrides

    def config(self, cell: Cell) -> dict[str, Any]:
        import dataclasses

        from lapheads.tasks.presets import resolve_config

        return dataclasses.asdict(resolve_config(self.task, self.preset, cell.head_spec, cell.argv(self.overrides)))

    def has(self, cell: Cell) -> bool:
        from lapheads.study.records import check_record, record_or_none

        found = record_or_none(self.folder, cell.name, self.config(cell))
        if found is not None:
            check_record(found, self.plan)
        return found is not None

    def write(self, cell: Cell, wall_seconds: float | None, threads: int) -> None:
        from lapheads.runs.records import write_record
        from lapheads.study.records import build_record

        data = build_record(
            cell.run_dir,
            name=cell.name,
            spec=cell.spec,
            seed=cell.seed,
            sweep=self.definition,
            plan_sha256=None if self.plan is None else self.plan.sha256,
            threads=threads or None,
            wall_seconds=wall_seconds,
        )
        write_record(self.folder, data)


def _run_on_slurm(todo, sweep_dir, record, save, log, definition, records, plan, options, pins, wait) -> None:
    """The cells as SLURM jobs (lapheads.study.slurm): each trains and writes its own record; with ``wait``, a cell
    whose job ended unfinished fails the command with its log's last lines (a rerun resubmits only those)."""
    from lapheads.study import slurm

    folder = sweep_dir / "slurm"
    sweep = {
        "task": definition["task"],
        "preset": str(Path(definition["preset"]).resolve())
        if Path(definition["preset"]).is_file()
        else definition["preset"],
        "overrides": definition["overrides"],
        "definition": definition,
        "records": None if records is None else str(Path(records).resolve()),
        "plan": None if plan is None else str((Path(records) / PLAN_FILE).resolve()),
    }
    live = slurm.submit_cells(todo, record["cells"], folder, options, sweep, pins, log)
    save()
    if not wait:
        if live:
            log(f"sweep: {len(live)} cell(s) with SLURM; run the same command again to see their states")
        return
    failed = slurm.wait_for(live, record["cells"], folder, save, log)
    if failed:
        raise SweepError(f"{len(failed)} cell(s) failed: {'; '.join(failed)}; rerun the same command to resubmit them")


def _run_parallel(
    cells: list[Any],
    sweep_dir: Path,
    task: str,
    preset: str,
    overrides: list[str],
    record: dict[str, Any],
    save,
    log,
    jobs: int,
    threads: int | None,
    recorder: CellRecorder | None = None,
    pins: dict[str, str] | None = None,
) -> None:
    """Train ``cells`` as ``jobs`` concurrent ``lapheads train`` processes; this process alone writes sweep.json
    (and the records, each as its cell finishes, with one thread). Each cell's output goes to
    SWEEP_DIR/logs/<cell>.log; a failed cell is recorded and the others go on."""
    import os

    per_job = max(1, (threads or os.cpu_count() or 1) // jobs)
    env = {**os.environ, **(pins or {}), "OMP_NUM_THREADS": str(per_job), "MKL_NUM_THREADS": str(per_job)}
    logs = sweep_dir / "logs"
    queue, running, failed = list(cells), {}, []
    with _children_end_with_the_sweep(running):
        _schedule(
            queue, running, failed, task, preset, overrides, record, save, log, jobs, per_job, env, logs, recorder
        )
    if failed:
        raise SweepError(f"{len(failed)} cell(s) failed: {'; '.join(failed)}; rerun the same command to retry them")


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


def _schedule(queue, running, failed, task, preset, overrides, record, save, log, jobs, per_job, env, logs, recorder):
    """The job loop of :func:`_run_parallel`: start cells while slots are free, collect the finished ones. With
    records, a cell that finished training keeps its slot for a second process, ``lapheads analyze`` with the
    record's options (cached in its run directory): cells are analysed side by side with their own threads, and
    this process then writes each record from the cache (on a many-core GPU host it would otherwise analyse every
    cell one after another, ~1 min each)."""
    import torch

    analysing: set[str] = set()
    analysed = recorder is not None and holds_analysis(task)
    while queue or running:
        while queue and len(running) < jobs:
            cell = queue.pop(0)
            if analysed and _finished(cell.run_dir):  # trained before (an interrupted sweep): only its analysis
                running[cell.name] = (cell, *_analyse(cell, env, logs), None)
                analysing.add(cell.name)
                log(f"sweep: {cell.name} trained before; analysing it for its record")
                continue
            resume = RunDir(cell.run_dir).exists()
            argv = [
                sys.executable,
                "-m",
                *_train_argv(task, preset, cell, overrides),
                *(["--resume"] if resume else []),
            ]
            logs.mkdir(parents=True, exist_ok=True)
            handle = open(logs / f"{cell.name}.log", "a")
            process = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, env=env)
            running[cell.name] = (cell, process, handle, time.monotonic())
            record["cells"][cell.name]["status"] = "running"
            save()
            log(
                f"sweep: {cell.name} {'resuming' if resume else 'training'} into {cell.run_dir} "
                f"({per_job} thread{'s' if per_job > 1 else ''}; log {logs / (cell.name + '.log')})"
            )
        time.sleep(0.5)
        for name, (cell, proc, handle, began) in list(running.items()):
            if proc.poll() is None:
                continue
            handle.close()
            del running[name]
            done = proc.returncode == 0 and _finished(cell.run_dir)
            if done and analysed and name not in analysing:
                analysing.add(name)
                running[name] = (cell, *_analyse(cell, env, logs), began)
                log(f"sweep: {name} trained; analysing it for its record")
                continue
            if name in analysing:  # trained; an analysis that failed is redone below, where its error is raised
                done = _finished(cell.run_dir)
            if done and recorder is not None:
                previous = torch.get_num_threads()
                torch.set_num_threads(per_job)  # beside the cells still training
                try:
                    recorder.write(cell, None if began is None else time.monotonic() - began, per_job)
                finally:
                    torch.set_num_threads(previous)
            record["cells"][name]["status"] = "done" if done else "failed"
            save()
            if not done:
                failed.append(f"{name} (exit {proc.returncode}, see {logs / (name + '.log')})")
            log(f"sweep: {name} {'done' if done else 'FAILED'}")


def _analyse(cell: Cell, env: dict[str, str], logs: Path) -> tuple[subprocess.Popen, Any]:
    """Start ``lapheads analyze`` on a trained cell with the options its record reads (the result is cached in its
    run directory); its output goes to the cell's log. Returns the process and the open log."""
    argv = [sys.executable, "-m", "lapheads", "analyze", str(cell.run_dir), "--max-tokens", str(RECORD_MAX_TOKENS)]
    logs.mkdir(parents=True, exist_ok=True)
    handle = open(logs / f"{cell.name}.log", "a")
    return subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, env=env), handle


def _train_argv(task: str, preset: str, cell: Cell, overrides: list[str]) -> list[str]:
    """``lapheads train ...`` for one cell (after ``python -m`` or ``torchrun ... -m``)."""
    seed = ["--seed", str(cell.seed)]
    return ["lapheads", "train", task, "--preset", preset, "--laplacian-heads", cell.head_spec, *seed,
            "--out", str(cell.run_dir), *_for_cell(overrides, cell), *arm_overrides(cell.spec)]  # fmt: skip


def _train(task: str):
    return get_task(task).train_function()


def train_cell(task: str, preset: str, overrides: list[str], cell: Cell) -> None:
    """Train one cell in this process (resuming its run directory when it holds a run): the sweep's own loop and
    a SLURM job (lapheads.study.slurm) both train a cell this way."""
    from lapheads.tasks.presets import resolve_config

    cfg = resolve_config(task, preset, cell.head_spec, cell.argv(overrides))
    _train(task)(cfg, cell.run_dir, resume=RunDir(cell.run_dir).exists())
