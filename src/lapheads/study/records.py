"""A finished cell's record (``lapheads.runs.records``) built from its run directory, and the sweep's plan.

Design choices:

* **One builder for both paths**: ``lapheads sweep --records`` writes what :func:`build_record` returns, and
  ``lapheads report SWEEP_DIR`` builds the same records in memory from the run directories, so a report from a
  records folder and one from the run directories are the same computation on the same numbers.
* **Everything a report reads, nothing it does not**: config, environment, every metrics.jsonl entry, the report/
  JSONs an evaluation left (eval_dino.json, eval_chat.json), ``lapheads analyze`` at the latest checkpoint (geometry
  at every block and after the final norm, per-head mechanism scores with each head's kind), the weight-only
  mechanism scores of every kept checkpoint, the wall time. No weights.
* **A plan is data, fixed before the first cell** (:class:`Plan`): the study's preset, arms, seeds and overrides
  (the sweep must be exactly that), its primary endpoint, the declared family, the contrasts with their claimed
  direction ("fewer" / "more" of a metric's paper direction, or "no claim"), margins, n and the stopping rule. It
  is copied unchanged into the records folder as plan.json and its sha256 stamped into every record.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from pathlib import Path
from typing import Any

from lapheads.io import MAX_JSON_DEPTH, json_depth, json_loads, read_regular_bytes, read_regular_text
from lapheads.runs import RunDir, checkpoint_steps, load_model
from lapheads.runs.layout import PLAN_FILE, record_file
from lapheads.runs.records import (
    CellRecord,
    RecordError,
    config_difference,
    environment,
    file_sha256,
    read_record,
    record_in_memory,
)
from lapheads.study.verdicts import MIN_ALPHA, Declaration
from lapheads.tasks import get_task

__all__ = [
    "DIRECTIONS",
    "Plan",
    "build_record",
    "holds_analysis",
    "check_record",
    "declaration",
    "RECORD_MAX_TOKENS",
    "install_plan",
    "load_plan",
    "record_or_none",
]

#: the tokens per layer a record's analysis reads (a random subset of the evaluation set)
RECORD_MAX_TOKENS = 262_144

#: what a contrast may claim: "paper" (the arm moves each metric the way the paper says Laplacian heads move it,
#: relative to the baseline), "reverse" (the baseline is the more-Laplacian arm: the opposite), "no claim"
DIRECTIONS = ("paper", "reverse", "no claim")


@dataclasses.dataclass(frozen=True)
class Plan:
    """A pre-registered study (plan.json). Every field is required except ``notes``."""

    study: str
    preset: str
    task: str
    arms: list[str]
    seeds: list[int]
    overrides: list[str]  # --set KEY=VALUE items, precision and threads pinned here
    primary: str  # the primary endpoint's report label, e.g. "within-sequence fraction (after the final norm)"
    family: list[str]  # the declared family: report labels Holm-corrected across the contrasts
    contrasts: list[dict[str, str]]  # {"arm", "baseline", "direction"}: the compared pairs, with their claim
    margins: dict[str, float]  # equivalence margins by label (TOST), in the label's unit
    alpha: float
    stopping: str  # the stopping rule, in words
    notes: str = ""
    sha256: str = dataclasses.field(default="", compare=False)  # of the file read, not a field a plan writes
    #: the file's bytes as read: hashed, parsed and (:func:`install_plan`) copied from one read, so a file changed
    #: between two reads can never be hashed as one plan and installed as another
    source: bytes = dataclasses.field(default=b"", compare=False, repr=False)
    path: str = dataclasses.field(default="", compare=False)  # where it was read from, for messages


def load_plan(path: str | Path) -> Plan:
    """Read and check a plan file; a bad plan is one line naming the field and what is allowed."""
    path = Path(path)
    try:
        source = read_regular_bytes(path)
        if json_depth(source) > MAX_JSON_DEPTH:  # as json_loads refuses it, before parsing
            raise json.JSONDecodeError(f"nested deeper than {MAX_JSON_DEPTH} levels", "", 0)
        data = json.loads(source.decode(), object_pairs_hook=_refuse_repeated_keys)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RecordError(f"--plan {path}: cannot be read as JSON ({type(err).__name__}: {err})") from None
    if not isinstance(data, dict):
        raise RecordError(f"--plan {path}: allowed: a JSON object with the fields of a plan")
    fields = {f.name: f for f in dataclasses.fields(Plan) if f.name not in ("sha256", "source", "path")}
    missing = [name for name, f in fields.items() if f.default is dataclasses.MISSING and name not in data]
    unknown = sorted(set(data) - set(fields))
    if missing or unknown:
        raise RecordError(f"--plan {path}: missing {missing}, unknown {unknown}; allowed fields: {', '.join(fields)}")
    for name, value in data.items():  # each field's JSON type, before any value is read as one
        expected = _PLAN_TYPES[name]
        if not _has_type(value, expected):
            raise RecordError(f"--plan {path}: {name} {value!r:.80}; allowed: {_TYPE_WORDS[expected]}")
    plan = Plan(**data, sha256=hashlib.sha256(source).hexdigest(), source=source, path=str(path))
    _check_plan_values(plan, f"--plan {path}")
    for contrast in plan.contrasts:
        if set(contrast) != {"arm", "baseline", "direction"} or not all(type(v) is str for v in contrast.values()):
            raise RecordError(f"--plan {path}: contrast {contrast!r}; allowed: {{arm, baseline, direction}}, strings")
        if contrast["direction"] not in DIRECTIONS:
            raise RecordError(
                f"--plan {path}: contrast {contrast!r}; allowed: {{arm, baseline, direction}} with direction one of "
                f"{', '.join(DIRECTIONS)}"
            )
        for side in ("arm", "baseline"):
            if contrast[side] not in plan.arms:
                raise RecordError(
                    f"--plan {path}: contrast {side} {contrast[side]!r} is not one of the arms {plan.arms}"
                )
    pairs = [(c["arm"], c["baseline"]) for c in plan.contrasts]
    for arm, baseline in pairs:
        if arm == baseline:
            raise RecordError(f"--plan {path}: a contrast of arm {arm!r} with itself; allowed: two distinct arms")
        if pairs.count((arm, baseline)) + pairs.count((baseline, arm)) > 1:
            raise RecordError(
                f"--plan {path}: arms {arm!r} and {baseline!r} are contrasted more than once; allowed: one contrast "
                "per pair, with one direction"
            )
    return plan


#: each plan field's JSON type (``_has_type``): a wrong one is refused in one line, never a TypeError later
_PLAN_TYPES = {
    "study": str, "preset": str, "task": str, "primary": str, "stopping": str, "notes": str,
    "arms": list[str], "overrides": list[str], "family": list[str], "seeds": list[int],
    "contrasts": list[dict], "margins": dict, "alpha": float,
}  # fmt: skip
_TYPE_WORDS = {
    str: "a string", list[str]: "a list of strings", list[int]: "integers >= 0, as a list",
    list[dict]: "a list of objects", dict: "an object", float: "a number",
}  # fmt: skip
#: the largest equivalence margin a plan may fix: far above any metric's scale here (top-1 in points, bpb, counts)
MAX_MARGIN = 1e6


def _has_type(value: Any, expected: Any) -> bool:
    """JSON-typed: a bool is no number, a float no integer."""
    if expected is float:
        return type(value) in (int, float)
    if expected in (str, dict):
        return type(value) is expected
    item = expected.__args__[0]
    return type(value) is list and all(type(v) is item for v in value)


def _refuse_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are each given once: json.loads would keep the last of a repeated key silently, and
    a plan read two ways is no pre-registration."""
    keys = [key for key, _ in pairs]
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:
        raise json.JSONDecodeError(f"key {repeated[0]!r} given more than once", "", 0)
    return dict(pairs)


def report_labels(task: str) -> list[str]:
    """The rows a report of ``task`` can hold, by label: its headline metrics, and each geometry metric at each
    layer the task reports ("within-sequence fraction (after the final norm)"): what a plan may name."""
    spec = get_task(task)
    geometry = [f"{m.label} ({layer})" for m in spec.geometry for layer in spec.geometry_layers]
    return [m.label for m in spec.headline] + geometry


def _check_plan_values(plan: Plan, where: str) -> None:
    """What a plan fixes before the data is well formed: a known task and preset; unique arms and integer seeds;
    its primary, family and margins report rows the task has (a misspelt label would leave the report to choose);
    margins finite and > 0; alpha in (0, 1)."""
    from lapheads.tasks import TASKS

    if plan.task not in TASKS:
        raise RecordError(f"{where}: task {plan.task!r}; allowed: {', '.join(TASKS)}")
    if not plan.arms or not all(isinstance(a, str) and a for a in plan.arms) or len(set(plan.arms)) < len(plan.arms):
        raise RecordError(f"{where}: arms {plan.arms!r}; allowed: distinct head specs, as strings")
    if not plan.seeds or any(type(seed) is not int or seed < 0 for seed in plan.seeds):
        raise RecordError(f"{where}: seeds {plan.seeds!r}; allowed: integers >= 0")
    if len(set(plan.seeds)) < len(plan.seeds):
        raise RecordError(f"{where}: seeds {plan.seeds!r} repeat a seed; allowed: each seed once")
    labels = report_labels(plan.task)
    named = [("primary", plan.primary), *(("family", label) for label in plan.family)]
    named += [("margins", label) for label in plan.margins]
    for field, label in named:
        if label not in labels:
            raise RecordError(
                f"{where}: {field} {label!r} is not a row of a {plan.task} report; allowed: {'; '.join(labels)}"
            )
    if len(set(plan.family)) < len(plan.family):
        raise RecordError(f"{where}: family {plan.family!r} repeats a label; allowed: each row once")
    for label, margin in plan.margins.items():
        if type(margin) not in (int, float) or not math.isfinite(margin) or not 0 < margin <= MAX_MARGIN:
            raise RecordError(f"{where}: margin {margin!r} for {label!r}; allowed: a number in (0, {MAX_MARGIN:g}]")
    if type(plan.alpha) not in (int, float) or not (MIN_ALPHA <= plan.alpha < 1):
        raise RecordError(f"{where}: alpha {plan.alpha!r}; allowed: a number in [{MIN_ALPHA:g}, 1)")


def install_plan(plan: Plan, records_dir: str | Path) -> None:
    """Copy the plan into the records folder (the bytes it was read from, so its hash is the file's) or check the
    one there."""
    target = Path(records_dir) / PLAN_FILE
    if target.exists():
        if file_sha256(target) != plan.sha256:
            raise RecordError(
                f"{target} holds another plan (sha256 {file_sha256(target)[:12]}, this one {plan.sha256[:12]}); a "
                "records folder keeps the plan it started with; allowed: the same plan, or another --records"
            )
    else:
        if list(Path(records_dir).glob("*.json")):
            raise RecordError(
                f"{records_dir} already holds records made without this plan; a plan is declared before the first "
                "cell; allowed: another --records"
            )
        Path(records_dir).mkdir(parents=True, exist_ok=True)
        target.write_bytes(plan.source)


def _comparable(config: dict[str, Any]) -> dict[str, Any]:
    from lapheads.train.configs.run import RESUME_FREE

    normal = json.loads(json.dumps(config, default=str))
    return {key: value for key, value in normal.items() if key not in RESUME_FREE}


def record_or_none(records_dir: str | Path, cell_name: str, config: dict[str, Any]) -> CellRecord | None:
    """The cell's record in ``records_dir`` if it is there and holds this config; a record of another config is
    refused in one line (never overwritten)."""
    path = Path(records_dir) / record_file(cell_name)
    if not path.exists():
        return None
    record = read_record(path)
    difference = config_difference(_comparable(record.data["cell"]["config"]), _comparable(config))
    if difference:
        raise RecordError(
            f"{path} records cell {cell_name} with another config ({difference}); allowed: the same sweep, or "
            "another --records (a record is never overwritten)"
        )
    return record


def check_record(record: CellRecord, plan: Plan | None) -> None:
    """A record found for a sweep with a plan must carry that plan's hash."""
    stamped = record.data.get("plan_sha256")
    if plan is not None and stamped != plan.sha256:
        raise RecordError(
            f"{record.path} was made under plan {str(stamped)[:12]}, not this plan ({plan.sha256[:12]}); allowed: "
            "the plan its folder holds"
        )


def holds_analysis(task: str) -> bool:
    """Whether a record of this task holds ``lapheads analyze`` at the latest checkpoint (tasks with geometry)."""
    spec = get_task(task)
    return bool(spec.geometry and spec.analyzer is not None)


def build_record(
    run_dir: str | Path,
    *,
    name: str,
    spec: str,
    seed: int,
    sweep: dict[str, Any],
    plan_sha256: str | None = None,
    threads: int | None = None,
    wall_seconds: float | None = None,
    max_tokens: int = RECORD_MAX_TOKENS,
    analysed: bool = True,
) -> dict[str, Any]:
    """Everything a report reads from one finished cell's run directory (see the module docstring); with
    ``analysed`` False, no geometry analysis and no checkpoint's heads (a report without geometry reads neither)."""
    from lapheads.evals.geometry import AnalyzeOptions
    from lapheads.geometry.mechanism import gated_heads, ov_circuits
    from lapheads.study.analyze import analyze_run

    run = RunDir(run_dir)
    config = run.read_config()
    cell = {"name": name, "spec": spec, "seed": seed, "config": config["config"]}
    recipe = {key: sweep[key] for key in ("preset", "task", "overrides")}
    # the cell is the config that trained it (arm, seed, task), checked before anything is analysed
    record_in_memory({"cell": cell, "sweep": recipe, "config": config, "metrics": [], "environment": {}}, str(run_dir))
    task = get_task(config["task"])
    analysis = None
    if analysed and holds_analysis(config["task"]):
        analysis = analyze_run(run.path, AnalyzeOptions(max_tokens=max_tokens))
    heads = {}
    if analysed and task.analyzer is not None:
        for step in checkpoint_steps(run):
            model = load_model(run, task.analyzed_weights, step)
            if gated_heads(model) is None:  # a gated head has no fixed circuit to score
                heads[str(step)] = ov_circuits(model)
    reports = {}
    if run.report_dir.is_dir():
        for path in sorted(run.report_dir.glob("eval_*.json")):
            reports[path.name] = json_loads(read_regular_text(path))
    # where the cell trained (its own process wrote it into config.json); a run older than that: this process
    env = config.get("environment") or environment(threads if threads is not None else int(config.get("threads") or 0))
    env["precision"] = config.get("precision")
    return {
        "cell": cell,
        "sweep": recipe,
        "sweep_arms": {"specs": sweep["specs"], "seeds": sweep["seeds"]},
        "plan_sha256": plan_sha256,
        "config": config,
        "environment": env,
        "metrics": run.read_metrics(),
        "reports": reports,
        "analysis": analysis,
        "checkpoint_heads": heads,
        "wall_seconds": wall_seconds,
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def declaration(records_folder: str | Path | None, cells: tuple[CellRecord, ...]) -> Declaration:
    """Whether a report's family was declared before the data: a plan.json in the records folder whose sha256
    every reported cell's record carries. Anything else (no plan, a record without its hash, cells reported from
    run directories alone) is "declared after the data"."""
    plan_file = None if records_folder is None else Path(records_folder) / PLAN_FILE
    if plan_file is None or not plan_file.exists() or not cells:
        return {"before_data": False, "plan_sha256": None, "why": "no plan in a records folder"}
    sha = file_sha256(plan_file)
    stamped = [cell.data.get("plan_sha256") for cell in cells]
    unstamped = sum(s != sha for s in stamped)
    why = "every record carries the plan's sha256" if not unstamped else f"{unstamped} cell(s) without the plan's hash"
    return {"before_data": not unstamped, "plan_sha256": sha, "why": why}
