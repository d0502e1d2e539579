"""What a report reads: a frozen :class:`RecordSet` of finished cells' records, built from a records folder or from a
sweep folder's run directories, with the study's definition and plan.

Design choices:

* **Records only.** Every cell is a ``lapheads.runs.records.CellRecord``: read from a records folder, or built in
  memory from a run directory by the sweep's own builder (``study.records.build_record``), so a report from either
  kind of folder is the same computation on the same numbers. Nothing downstream reads sweep.json.
* **Finished cells, in the report's order**: seed-major, in the arms' order (the PCA grid's columns); cells that are
  pending, running or failed are not in the set.
* **What a report says about the set travels with it**: seeds whose arms ran in different environments (left out:
  they pair nothing), seeds left out by ``--seeds``, the plan of the records folder, and whether the cells came from
  a records folder.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lapheads.errors import SweepError
from lapheads.runs import RunDir
from lapheads.runs.layout import PLAN_FILE, record_file
from lapheads.runs.records import CellRecord, RecordError, environment_key, read_record, record_in_memory
from lapheads.study.cells import CellStatus
from lapheads.study.records import Plan, build_record, load_plan

__all__ = ["FINISHED", "RecordSet", "finished_run_dirs", "sweep_seeds"]

#: the statuses of a cell that has its numbers: trained here to its last step, or recorded elsewhere
FINISHED = (CellStatus.DONE.value, CellStatus.RECORDED.value)


@dataclass(frozen=True)
class RecordSet:
    """The finished cells of one study as records, and what its report needs to know about them.

    Args:
        preset, task, overrides: the sweep every cell ran (one preset, task and overrides).
        specs: the arms, in the plan's (or sweep's) order, those with a cell in the set.
        seeds: the seeds reported, in order.
        cells: the finished cells' records, seed-major in the order of ``specs``.
        records_folder: where the records (and the plan) live; None for run directories alone.
        plan: the records folder's plan, where it has one.
        mixed_environments: {seed: the environments its arms ran in}, for seeds left out because they differ.
        left_out: seeds with finished cells that ``--seeds`` left out.
        from_records: whether the cells were read from a records folder (no run directories, so no pictures).
    """

    preset: str
    task: str
    overrides: tuple[str, ...]
    specs: tuple[str, ...]
    seeds: tuple[int, ...]
    cells: tuple[CellRecord, ...]
    records_folder: str | None = None
    plan: Plan | None = None
    mixed_environments: Mapping[int, str] = field(default_factory=dict)
    left_out: tuple[int, ...] = ()
    from_records: bool = False

    @classmethod
    def from_folder(cls, folder: str | Path) -> RecordSet:
        """A folder of records, with the plan it was declared under; records of different presets, tasks or
        overrides are refused, and so is a cell the folder's plan does not have."""
        from lapheads.runs.records import load_records

        found = load_records(folder)
        if not found:
            raise RecordError(f"{folder} holds no cell records; allowed: a sweep directory or a --records folder")
        recipes = {json.dumps(r.data["sweep"], sort_keys=True) for r in found}
        if len(recipes) > 1:
            raise RecordError(f"{folder} mixes records of {len(recipes)} sweeps (preset, task, overrides differ)")
        plan = _plan_in(folder)
        specs: list[str] = list(plan.arms) if plan else []
        seeds: list[int] = list(plan.seeds) if plan else []
        for r in found if plan else []:  # a plan's folder holds its cells only: no arm or seed joins after the fact
            if r.spec not in plan.arms or r.seed not in plan.seeds or r.data["sweep"].get("task") != plan.task:
                raise RecordError(
                    f"{r.path} is cell {r.name} ({r.data['sweep'].get('task')}), which the plan in {folder} does not "
                    f"have (task {plan.task}, arms {plan.arms}, seeds {plan.seeds}); allowed: the plan's cells"
                )
        for r in found:
            specs += [r.spec] if r.spec not in specs else []
            seeds += [r.seed] if r.seed not in seeds else []
        mixed = {}  # a seed whose arms ran in different environments pairs nothing: reported apart, left out
        for seed in {r.seed for r in found}:
            keys = {environment_key(r.data["environment"]) for r in found if r.seed == seed}
            if len(keys) > 1:
                mixed[seed] = " / ".join(sorted(", ".join(map(str, key)) for key in keys))
        kept = [r for r in found if r.seed not in mixed]
        sweep = found[0].data["sweep"]
        return cls(
            preset=sweep["preset"],
            task=sweep["task"],
            overrides=tuple(sweep["overrides"]),
            specs=tuple(spec for spec in specs if any(r.spec == spec for r in kept)),
            seeds=tuple(sorted(seed for seed in seeds if seed not in mixed)),
            cells=_in_report_order(kept, specs),
            records_folder=str(folder),
            plan=plan,
            mixed_environments=mixed,
            from_records=True,
        )

    @classmethod
    def from_sweep(cls, sweep: dict[str, Any], max_tokens: int, analysed: bool = True) -> RecordSet:
        """A sweep folder's finished cells (sweep.json as ``runs.load_sweep`` reads it, perhaps narrowed by
        :func:`sweep_seeds`), each as the record the sweep's own builder makes of its run directory, in memory and
        checked as a record file is. A cell trained elsewhere (no finished run directory here) carries its
        committed record; a built one keeps the plan stamp of its committed record, if the records folder holds one."""
        definition = {key: sweep[key] for key in ("preset", "task", "specs", "seeds", "overrides")}
        folder = Path(sweep["records"]) if sweep.get("records") else None
        records = []
        for name, cell in sweep["cells"].items():
            if cell.get("status") not in FINISHED:
                continue
            committed = None if folder is None else folder / record_file(name)
            committed = committed if committed is not None and committed.exists() else None
            if not RunDir(cell["run_dir"]).finished() and committed is not None:
                records.append(read_record(committed))
                continue
            stamp = None if committed is None else read_record(committed).data.get("plan_sha256")
            data = build_record(cell["run_dir"], name=name, spec=cell["spec"], seed=cell["seed"], sweep=definition,
                                plan_sha256=stamp, max_tokens=max_tokens, analysed=analysed)  # fmt: skip
            records.append(record_in_memory(data, str(cell["run_dir"])))
        return cls(
            preset=sweep["preset"],
            task=sweep["task"],
            overrides=tuple(sweep["overrides"]),
            specs=tuple(sweep["specs"]),
            seeds=tuple(sweep["seeds"]),
            cells=_in_report_order(records, sweep["specs"]),
            records_folder=None if folder is None else str(folder),
            plan=None if folder is None else _plan_in(folder),
            left_out=tuple(sweep.get("left_out") or ()),
        )

    def only_seeds(self, seeds: list[int], where: Path) -> RecordSet:
        """The set restricted to ``seeds`` (each one the set has); the others with a finished cell are named in the
        report as left out."""
        _check_seeds(seeds, list(self.seeds), where)
        ran = {cell.seed for cell in self.cells}
        return replace(
            self,
            seeds=tuple(seed for seed in self.seeds if seed in seeds),
            cells=tuple(cell for cell in self.cells if cell.seed in seeds),
            left_out=tuple(seed for seed in self.seeds if seed in ran and seed not in seeds),
        )


def sweep_seeds(sweep: dict[str, Any], seeds: list[int], where: Path) -> dict[str, Any]:
    """sweep.json narrowed to ``seeds`` before any record is built (each one the sweep has); ``left_out`` names the
    seeds with a finished cell that are not reported (a declared seed that never ran is not)."""
    _check_seeds(seeds, sweep["seeds"], where)
    cells = {name: cell for name, cell in sweep["cells"].items() if cell["seed"] in seeds}
    ran = {cell["seed"] for cell in sweep["cells"].values() if cell.get("status") in FINISHED}
    left_out = [seed for seed in sweep["seeds"] if seed in ran and seed not in seeds]
    return {**sweep, "seeds": [seed for seed in sweep["seeds"] if seed in seeds], "cells": cells, "left_out": left_out}


def finished_run_dirs(sweep: dict[str, Any]) -> list[str]:
    """The run directories of a sweep's finished cells, in the report's order (what an evaluation before the
    records are built reads: DINO's pictures)."""
    cells = [c for c in sweep["cells"].values() if c.get("status") in FINISHED]
    return [str(c["run_dir"]) for c in sorted(cells, key=lambda c: (c["seed"], sweep["specs"].index(c["spec"])))]


def _check_seeds(seeds: list[int], have: list[int], where: Path) -> None:
    unknown = [seed for seed in seeds if seed not in have]
    if unknown:
        allowed = ", ".join(map(str, have))
        raise SweepError(f"--seeds {','.join(map(str, unknown))}: not a seed of {where}; allowed: {allowed}")


def _in_report_order(records: list[CellRecord], specs: list[str] | tuple[str, ...]) -> tuple[CellRecord, ...]:
    """Seed-major in the arms' order (the order of the PCA grid's columns)."""
    return tuple(sorted(records, key=lambda r: (r.seed, list(specs).index(r.spec))))


def _plan_in(folder: str | Path) -> Plan | None:
    plan_file = Path(folder) / PLAN_FILE
    return load_plan(plan_file) if plan_file.exists() else None
