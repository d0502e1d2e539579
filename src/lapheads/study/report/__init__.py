"""``lapheads report SWEEP_DIR``: per-spec statistics over seeds, tests against k = 0, plots, geometry against k.

Design choices:

* **Numbers come from the run directories** (metrics.jsonl, report/eval_dino.json, analyze's cached
  analysis.json), never from logs. DINO cells are evaluated here (``lapheads eval dino``: k-NN, linear probe,
  segmentation mIoU, PCA pictures of every cell in one grid); each cell's result is cached in its run directory and
  reused while its checkpoint and the eval options are unchanged.
* **Statistics, paired**: the arms of a sweep share the seed, hence the initialisation and the data order, so each
  spec is compared with spec "0" seed by seed: the mean paired difference, its t-based 95% interval and a two-sided
  paired t-test (Welch's unpaired test only where fewer than two seeds pair up); ``--baseline SPEC`` compares
  with another spec instead (a per-layer schedule study: early-only against late-only), into report-vs-<SPEC>/.
  The verdicts follow one rule (:mod:`lapheads.study.verdicts`): the paradigm's primary test alone at alpha 0.05, a
  declared geometry family Holm-corrected across claims x arms, every other row secondary and uncorrected; each row
  states its minimum detectable effect at the alpha it faces, "excluded" when a paper-sized gain is ruled out, the
  exact sign-flip p and the seeds that moved the paper's way; **no claim** for metrics the paper makes none about.
* **Geometry against k**: ``lapheads analyze`` on every cell (cached per run), the last block's metrics, the same
  statistics.
* **The dose**: where the sweep has k = 0, 1, 2, ... Laplacian heads per block, each seed's slope of the primary,
  headline and declared metrics against k, tested over seeds, and each seed's slope of the headline against the
  declared geometry across those arms (does accuracy follow geometry?); secondary, uncorrected.
* **The heat-diffusion mechanism**: each head's output-value circuit score (``geometry.mechanism``: positive =
  the head moves tokens toward their attention-weighted neighbours) read from every cell's analysis, per spec, for
  the Laplacian and the ordinary heads, averaged over blocks and per block, the null (ordinary heads read as
  Laplacian) and the Laplacian heads' excess over it; tested against 0 over seeds (one-sample t-test, Holm across
  the section per spec, MDE at each row's Holm step). The paper's reading predicts an excess > 0.
  When they turn diffusive: the same scores at every checkpoint the cells kept (read from the weights, no data),
  tested against 0 step by step, and the step from which on every interval lies on one side of 0.
* **The gap over training**: a headline metric logged at every evaluation (validation bpb, test top-1) is also
  compared seed by seed at each evaluated step (mean paired difference and its t-based 95% interval), so a gap
  that closes or opens with training shows; and each arm's change over the last quarter of training says whether
  it was still improving, so a short run is not mistaken for a converged one. Classification cells trained with
  ``--fit-subset`` also get their final top-1 on training images without augmentation beside the test top-1: a
  model that scores about as well on the images it trained on as on the test set is underfit.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lapheads.io import json_loads, read_regular_text
from lapheads.runs import SWEEP_FILE, SweepError, load_sweep, spec_dir_name
from lapheads.runs.layout import writable_report_folder
from lapheads.study.comparison import Comparison, per_seed_values, rows_json
from lapheads.study.recordset import RecordSet, finished_run_dirs, sweep_seeds
from lapheads.study.report.figures import plot_metric, plot_steps
from lapheads.study.report.statistics import (
    FitRow,
    LateChange,
    code_revisions,
    collect,
    diffusion_against_zero,
    dose_response,
    fit_against_test,
    gap_over_training,
    geometry_values,
    holm,
    late_change,
    mechanism_over_training,
    paired_test,
    summarize,
    welch_t_test,
)
from lapheads.study.report.tables import (
    MECHANISM_HEADER,
    dose_lines,
    fit_lines,
    gap_lines,
    late_change_lines,
    mechanism_row,
    revisions_line,
    rule_lines,
    settled_text,
    step_lines,
    table_header,
    table_row,
)
from lapheads.study.verdicts import ALPHA, RuleRecord, apply_rule, mechanism_verdict
from lapheads.tasks import get_task
from lapheads.tasks.metrics import Metric, claim, logged

__all__ = [
    "collect",
    "diffusion_against_zero",
    "mechanism_report",
    "fit_against_test",
    "gap_over_training",
    "holm",
    "late_change",
    "load_sweep",
    "paired_test",
    "restate",
    "summarize",
    "mechanism_verdict",
    "welch_t_test",
    "write_report",
    "ReportStats",
    "compute_report",
    "plot_report",
    "render_report",
]


def _judge(
    rows: dict[str, dict[str, Comparison]],
    primary_label: str,
    baseline: str,
    margin: float | None,
    plan: Any = None,
    claims: dict[str, int | None] | None = None,
) -> tuple[dict[str, dict[str, Comparison]], RuleRecord]:
    """Apply the verdict rule to every row (``primary_label`` the primary test; a plan's primary, family and
    contrasts where the sweep has one); a row's claim is the one in ``claims``, else its label's declared metric's
    (``tasks.metrics.claim``). Returns the rows in table order (primary, declared family, secondary) and the rule's
    record."""
    directions = planned = family = None
    if plan is not None:  # the plan's primary and family, or no report: a report never picks its own
        missing = [label for label in (plan.primary, *plan.family) if label not in rows]
        if missing:
            raise SweepError(
                f"the plan names {', '.join(map(repr, missing))}, which this report does not compute (--no-geometry "
                "leaves out every geometry row); allowed: a report that computes the plan's primary and family"
            )
        primary_label = plan.primary
        _check_finite(rows[primary_label], primary_label)
        family, planned, directions = plan.family, set(), {}
        for contrast in plan.contrasts:
            arm, against = contrast["arm"], contrast["baseline"]
            key = arm if against == baseline else f"{arm} vs {against}"
            planned.add(key)
            directions[key] = {"paper": 1, "reverse": -1, "no claim": None}[contrast["direction"]]
            if against == baseline:
                continue
            for by_key in rows.values():  # the contrast's own pairs: arm - its baseline, seed by seed
                values = {
                    spec: {int(seed): float(v) for seed, v in by_key[spec].values.items()}
                    for spec in (arm, against)
                    if spec in by_key
                }
                if len(values) == 2:
                    by_key[key] = replace(summarize(values, against)[arm], arm=arm)
    primary = {primary_label: rows[primary_label]}
    others = {label: value for label, value in rows.items() if label != primary_label}
    claims = {label: (claims or {}).get(label, claim(label)) for label in rows}
    margins = None if plan is None else plan.margins  # fixed before the data: they outrank the paper's default
    alpha = ALPHA if plan is None else plan.alpha
    rule = apply_rule(primary, others, claims, baseline, margin, directions, family, planned, margins, alpha)
    rule["plan"] = None if plan is None else {"study": plan.study, "sha256": plan.sha256}
    declared = [label for label in rule["declared"] if label in others]
    rest = {label: value for label, value in others.items() if label not in declared}
    return {**primary, **{label: others[label] for label in declared}, **rest}, rule


def _check_finite(rows: dict[str, Comparison], label: str) -> None:
    """A plan's primary is tested on finite values only: a NaN or inf value is a broken cell, not "no spread"."""
    for spec, row in rows.items():
        bad = {seed: value for seed, value in row.values.items() if not math.isfinite(float(value))}
        if bad:
            raise SweepError(f"the primary {label!r} of arm {spec} is not finite at seed(s) {bad}; allowed: finite "
                             "values (rerun or remove those cells)")  # fmt: skip


def _table_keys(stats: dict[str, Comparison], specs: list[str]) -> list[str]:
    """A metric's rows in table order: every arm against the report's baseline, then a plan's other contrasts."""
    return [s for s in specs if s in stats] + [key for key in stats if key not in specs]


def rule_and_table(rule: RuleRecord, table: dict[str, dict[str, Comparison]], baseline: str, keys) -> list[str]:
    """The rule's words and the statistics table (``keys(rows)``: the keys of a label's rows, in table order): one
    renderer for ``lapheads report`` and for a stats.json restated."""
    rows = [table_row(label, key, by_key[key]) for label, by_key in table.items() for key in keys(by_key)]
    return [*rule_lines(rule), *table_header(baseline), *rows]


def restated(stats_file: str | Path, margin: float | None = None):
    """An existing stats.json judged again by the current tests and verdict rule (:mod:`lapheads.study.verdicts`),
    from its per-seed values alone, under the plan it was judged under: returns (rule, judged rows by label,
    mechanism rows, baseline). The plan is the records folder's plan.json beside ``RECORDS/report/stats.json``,
    refused unless its sha256 is the one the report names; a contrast row ("sum:1 vs 1") is that arm against its
    own baseline, seed by seed; without a plan, the primary and its margin are the ones the report stored."""
    from lapheads.study.records import load_plan

    path = Path(stats_file)
    try:
        saved = json_loads(read_regular_text(path))
        groups = [*saved["metrics"].items(), *saved.get("geometry", {}).items()]
        baseline = str(saved["baseline"])
        stored = saved.get("rule") or {}
        family = {label: _restated_rows(rows, baseline) for label, rows in groups}
        primary_label = (stored.get("primary") or [next(iter(saved["metrics"]))])[0]
        mechanism = diffusion_against_zero(
            {label: _per_seed(rows) for label, rows in saved.get("mechanism", {}).items()}
        )
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError, StopIteration) as err:
        raise SweepError(f"{stats_file} is not a lapheads report stats.json ({type(err).__name__}: {err})") from None
    plan = None
    named = (stored.get("plan") or {}).get("sha256")
    if named:
        plan_file = path.parent.parent / "plan.json"
        plan = load_plan(plan_file) if plan_file.is_file() else None
        if plan is None or plan.sha256 != named:
            raise SweepError(
                f"{stats_file} was judged under plan {named[:12]}, which {plan_file} "
                f"{'does not hold' if plan is not None else 'is not'}; allowed: the report inside its records folder, "
                "beside the plan it names"
            )
    if margin is None and plan is None:
        margin = (stored.get("margin") or {}).get(primary_label)
    family, rule = _judge(family, primary_label, baseline, margin, plan)
    rule["declaration"] = stored.get("declaration") or {
        "before_data": False,
        "plan_sha256": None,
        "why": "restated: no plan was declared",
    }
    return rule, family, mechanism, baseline


def _per_seed(rows: dict[str, Any]) -> dict[str, dict[int, float]]:
    return {spec: per_seed_values(row["values"]) for spec, row in rows.items()}


def _restated_rows(rows: dict[str, Any], baseline: str) -> dict[str, Comparison]:
    """One label's rows summarised again: each arm against the report's baseline; a contrast row (its stored
    ``arm`` against its stored ``baseline``, another arm) from the two arms' per-seed values."""
    values = _per_seed(rows)
    contrasts = {key: row for key, row in rows.items() if row.get("arm") and str(row["baseline"]) != baseline}
    out = summarize({spec: v for spec, v in values.items() if spec not in contrasts}, baseline)
    for key, row in contrasts.items():
        arm, against = str(row["arm"]), str(row["baseline"])
        out[key] = replace(summarize({arm: values[key], against: values[against]}, against)[arm], arm=arm)
    return out


def restate(stats_file: str | Path, margin: float | None = None) -> str:
    """The statistics table of an existing stats.json (any version: it keeps every cell's per-seed value),
    recomputed with the current tests and verdict rule (:func:`restated`); no run directory needed."""
    rule, family, mechanism, baseline = restated(stats_file, margin)
    lines = rule_and_table(rule, family, baseline, lambda rows: list(rows))
    if mechanism:
        lines += [
            "",
            "**Withdrawn**: the per-head diffusion scores below are as this stats.json stored them, computed by the "
            "version of the diagnostic that wrote it (kind-blind weight scores; before 2026-11-30 also LayerScale-"
            "blind); kept for the record, no verdict is drawn from them.",
            "",
            *MECHANISM_HEADER,
        ]
        lines += [
            mechanism_row(label, spec, replace(row, verdict="withdrawn"))
            for label, rows in mechanism.items()
            for spec, row in rows.items()
        ]
    return "\n".join(lines)


#: what the mechanism section measures and how it is tested (report.md and mechanism.md)
MECHANISM_INTRO = (
    "Heat-diffusion mechanism: each head's whole circuit diag(LayerScale) W_O W_V diag(gamma) against the "
    "identity on its subspace, normalised by what a rank-D head can attain (`lapheads.geometry.mechanism`; "
    "diffusion = -alignment x the sign of the head kind's token operator: +1, the head lowers the "
    "within-sequence variance, a Laplacian head by a heat step on its attention graph; -1: it raises it), "
    "mean over seeds, tested against 0 (one-sample t-test, Holm across these rows per spec). The null: the "
    "ordinary heads' circuits read as if they were Laplacian (an ordinary-looking circuit in a Laplacian "
    "head already scores that); the excess rows test the Laplacian heads against it, in their own blocks "
    "and against the k = 0 run of the same seed. The heat-diffusion reading predicts an excess > 0. "
    "Measured on data (analysis version 5): each changed head's drop of the within-sequence fraction when "
    "its own write is added to the stream entering its block, and its P-aware score (-alignment x the "
    "token operator's gain tau on the within-sequence part, from the model's own P), each minus its twin "
    "(the same block and head of the k = 0 run of the same seed); a verdict needs 3 seed pairs."
)


def _mechanism_lines(mechanism_stats: dict[str, dict[str, Comparison]]) -> list[str]:
    rows = [mechanism_row(label, spec, row) for label, rows in mechanism_stats.items() for spec, row in rows.items()]
    return ["", MECHANISM_INTRO, "", *MECHANISM_HEADER, *rows]


def mechanism_report(sweep_dir: str | Path, max_tokens: int = 1_000_000) -> Path:
    """SWEEP_DIR/report/mechanism.md and mechanism.json: the mechanism section alone (every finished cell analysed,
    or its cached analysis reused), for a question asked of trained models after a study's plan was written: it
    states no headline or geometry verdict, so it reads nothing a pre-registered report has yet to read."""
    sweep_dir = Path(sweep_dir)
    sweep = load_sweep(sweep_dir)
    if not get_task(sweep["task"]).geometry:
        raise SweepError(f"{sweep_dir}: {sweep['task']} runs have no geometry analysis; allowed: classify, dino, lm")
    if not finished_run_dirs(sweep):
        raise SweepError(f"{sweep_dir}: no finished cell; run or resume the sweep first")
    study = RecordSet.from_sweep(sweep, max_tokens)
    _, mechanism_values = geometry_values(study)
    stats = diffusion_against_zero(mechanism_values)
    seeds, cells = sorted({cell.seed for cell in study.cells}), study.cells
    lines = [
        f"# Mechanism: {study.preset} ({study.task})",
        "",
        f"Arms {', '.join(study.specs)}; the finished cells of seeds {', '.join(map(str, seeds))} "
        f"({len(cells)} cells); analysed with `lapheads analyze` (its defaults), reported by `lapheads mechanism`. "
        "No headline or geometry row is computed here.",
        *_mechanism_lines(stats),
    ]
    out = writable_report_folder(sweep_dir, None)
    out.mkdir(parents=True, exist_ok=True)
    mechanism_json = {"seeds": seeds, "mechanism": rows_json(stats)}
    (out / "mechanism.json").write_text(json.dumps(mechanism_json, indent=1, default=str) + "\n")
    path = out / "mechanism.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _left_out(study: RecordSet) -> str:
    left_out = study.left_out
    return f" (--seeds; left out: {', '.join(map(str, left_out))})" if left_out else ""


def write_report(
    sweep_dir: str | Path,
    metric: str | None = None,
    geometry: bool = True,
    max_tokens: int = 262_144,
    baseline: str = "0",
    margin: float | None = None,
    seeds: list[int] | None = None,
) -> Path:
    """Write SWEEP_DIR/report/{report.md, stats.json, metric.png, gap.png, geometry.png (, pca.png)}; returns
    report.md.

    Args:
        metric: a key of metrics.jsonl to report instead of the task's headline metrics.
        geometry: run (or reuse) ``lapheads analyze`` on every finished cell and report the last block's geometry.
        max_tokens: analyze's token budget per cell.
        baseline: the spec every other is compared with, seed by seed (a per-layer schedule study compares its
            schedules with each other this way); other than "0", the report goes to SWEEP_DIR/report-vs-L<spec>/
            ("3,0" -> report-vs-L3_0) so the k = 0 report stays.
        margin: the primary metric's equivalence margin (None: the plan's, where the sweep has a plan with one; else
            the paper's effect on this baseline, where known).
        seeds: report only these seeds (a plan's pre-registered stop: e.g. its first 6 pairs); None: every seed.
    """
    study, out, pictures = _read_for_report(Path(sweep_dir), metric, geometry, max_tokens, baseline, seeds)
    stats = compute_report(study, metric, geometry, baseline, margin)
    if not any(row.n for rows in stats.headline.values() for row in rows.values()):
        names = ", ".join(stats.headline)
        raise SweepError(f"{sweep_dir}: no finished cell has {names}; run or resume the sweep first")
    out.mkdir(parents=True, exist_ok=True)
    images = plot_report(stats, list(study.specs), out)
    (out / "stats.json").write_text(json.dumps(stats.to_json(), indent=1, default=str) + "\n")
    path = out / "report.md"
    path.write_text("\n".join(render_report(study, stats, images, pictures)) + "\n")
    return path


def _read_for_report(
    sweep_dir: Path, metric, geometry: bool, max_tokens: int, baseline: str, seeds
) -> tuple[RecordSet, Path, bool]:
    """(the finished cells' records, the report folder, whether it shows PCA pictures): a records folder's records,
    or a sweep folder's cells' records built in memory."""
    if not (sweep_dir / SWEEP_FILE).exists() and sweep_dir.is_dir() and any(sweep_dir.glob("*.json")):
        study = RecordSet.from_folder(sweep_dir)
        study = study if seeds is None else study.only_seeds(seeds, sweep_dir)
        _check_baseline(baseline, study.specs)
        return study, _report_folder(sweep_dir, baseline), False
    sweep = load_sweep(sweep_dir)
    if seeds is not None:
        sweep = sweep_seeds(sweep, seeds, sweep_dir)
    _check_baseline(baseline, sweep["specs"])
    out = _report_folder(sweep_dir, baseline)
    task = get_task(sweep["task"])
    run_dirs = finished_run_dirs(sweep)
    pictures = task.pictures and metric is None and bool(run_dirs)  # pictures need the weights
    if pictures:  # before the records are built: the evaluation writes each run's report/eval_dino.json they read
        from lapheads.evals.dino import eval_dino
        from lapheads.evals.options import DinoEvalOptions

        eval_dino(DinoEvalOptions(run_dirs=tuple(run_dirs), out=str(out), reuse=True))
    # each finished cell's record, built in memory: one way of reading a cell
    return RecordSet.from_sweep(sweep, max_tokens, analysed=geometry and bool(task.geometry)), out, pictures


def _check_baseline(baseline: str, specs) -> None:
    if baseline != "0" and baseline not in specs:  # a sweep without k = 0 still reports its arms, untested
        raise SweepError(f"--baseline {baseline!r} is not a spec of this sweep; choose one of {', '.join(specs)}")


def _report_folder(sweep_dir: Path, baseline: str) -> Path:
    return writable_report_folder(sweep_dir, None if baseline == "0" else spec_dir_name(baseline))


@dataclass
class ReportStats:
    """Every number of one report, computed from the cells' records alone (stats.json is :meth:`to_json`)."""

    baseline: str
    metrics: list[Metric]  # the headline metrics (or the one ``--metric``), the primary first
    rule: RuleRecord  # the verdict rule's record (alpha, families, margins, the declaration)
    table: dict[str, dict[str, Comparison]]  # every row by label, judged (the headline and geometry rows)
    headline: dict[str, dict[str, Comparison]]
    geometry: dict[str, dict[str, Comparison]]
    mechanism: dict[str, dict[str, Comparison]]
    over_training: dict[str, Any]
    late_change: dict[str, dict[str, LateChange]]  # by metric label, by arm
    fit: dict[str, FitRow]
    dose: dict[str, Any]
    mechanism_over_training: dict[str, Any]
    code_revisions: dict[str, list[str]]
    seeds_left_out: Any = None

    def to_json(self) -> dict[str, Any]:
        return {
            "baseline": self.baseline,
            "rule": self.rule,
            "metrics": rows_json(self.headline),
            "geometry": rows_json(self.geometry),
            "mechanism": rows_json(self.mechanism),
            "over_training": self.over_training,
            "late_change": self.late_change,
            "fit": self.fit,
            "dose": self.dose,
            "mechanism_over_training": self.mechanism_over_training,
            **({"seeds_left_out": self.seeds_left_out} if self.seeds_left_out else {}),
            **({"code_revisions": self.code_revisions} if self.code_revisions else {}),
        }


def compute_report(study: RecordSet, metric: str | None, geometry: bool, baseline: str,
                   margin: float | None) -> ReportStats:  # fmt: skip
    """Every statistic of the report, from the records of the study's finished cells."""
    from lapheads.study.records import declaration

    task = study.task
    metrics = [logged(metric)] if metric else list(get_task(task).headline)
    headline = {m.label: summarize(collect(study, m), baseline) for m in metrics}
    geometry_stats: dict[str, dict[str, Comparison]] = {}
    mechanism_stats: dict[str, dict[str, Comparison]] = {}
    if geometry and get_task(task).geometry:  # mid/sft runs: their bases' geometry is the pre-training report's
        by_row, mechanism_values = geometry_values(study)
        geometry_stats = {name: summarize(by_spec, baseline) for name, by_spec in by_row.items()}
        mechanism_stats = diffusion_against_zero(mechanism_values)
    claims = {m.label: m.claim for m in metrics}  # a --metric KEY row keeps its declared metric's claim
    table, rule = _judge({**headline, **geometry_stats}, metrics[0].label, baseline, margin, study.plan, claims)
    rule["declaration"] = declaration(study.records_folder, study.cells)
    fitted = list(dict.fromkeys([*rule["primary"], *headline, *rule["declared"]]))
    return ReportStats(
        baseline=baseline,
        metrics=metrics,
        rule=rule,
        table=table,
        headline=headline,
        geometry=geometry_stats,
        mechanism=mechanism_stats,
        over_training={m.label: g for m in metrics if (g := gap_over_training(study, m, baseline))},
        late_change={m.label: c for m in metrics if (c := late_change(study, m))},
        fit=fit_against_test(study, baseline) if metric is None else {},
        dose=dose_response(table, fitted, metrics[0].label, [g for g in fitted if g in geometry_stats]),
        mechanism_over_training=mechanism_over_training(study) if mechanism_stats else {},
        code_revisions=code_revisions(study),
        seeds_left_out=list(study.left_out) or None,
    )


def plot_report(stats: ReportStats, specs: list[str], out: Path) -> set[str]:
    """The report's figures in ``out``; returns the names of those drawn."""
    plot_metric(stats.headline, specs, out / "metric.png")
    drawn = {"metric.png"}
    if stats.over_training:
        titles = {f"{label}: gap over training": by_spec for label, by_spec in stats.over_training.items()}
        baseline = stats.baseline
        plot_steps(titles, out / "gap.png", "paired difference (95% CI)", lambda spec: f"{spec} - {baseline}")
        drawn.add("gap.png")
    if stats.geometry:
        plot_metric(stats.geometry, specs, out / "geometry.png")
        drawn.add("geometry.png")
    if stats.mechanism:  # drawn, as the section is, wherever diffusion scores were measured
        plot_steps(stats.mechanism_over_training, out / "mechanism.png", "mean diffusion score (95% CI)",
                   lambda spec: f"k = {spec}")  # fmt: skip
        drawn.add("mechanism.png")
    return drawn


def render_report(study: RecordSet, stats: ReportStats, images: set[str], pictures: bool) -> list[str]:
    """report.md's lines: the sweep, the rule, the table, then each section the statistics hold."""
    baseline, specs = stats.baseline, list(study.specs)
    lines = [
        f"# Sweep report: {study.preset} ({study.task})",
        "",
        f"Specs {', '.join(specs)}; seeds {', '.join(map(str, study.seeds))}{_left_out(study)}; overrides "
        f"`{' '.join(study.overrides) or 'none'}`. Difference = spec - {baseline}, paired by seed, with its "
        "t-based 95% interval; p = two-sided paired t-test; verdict: held / opposite (p below the row's alpha, "
        "with / against the paper's direction), excluded (a paper-sized gain ruled out) or not detected.",
        "",
    ]
    for seed, environments in study.mixed_environments.items():
        lines += [f"Seed {seed} left out: its arms ran in different environments ({environments}).", ""]
    if stats.code_revisions:  # what trained each cell, as its record says: never a plan's intention
        lines += [revisions_line(stats.code_revisions), ""]
    lines += rule_and_table(stats.rule, stats.table, baseline, lambda rows: _table_keys(rows, specs))
    lines += ["", "![metric](metric.png)", *dose_lines(stats.dose)]
    for label, by_spec in stats.late_change.items():
        lines += late_change_lines(label, by_spec)
    if stats.fit:
        lines += fit_lines(stats.fit, baseline)
    for label, by_spec in stats.over_training.items():
        lines += gap_lines(label, by_spec, baseline)
    if "gap.png" in images:
        lines += ["", "![gap over training](gap.png)"]
    if "geometry.png" in images:
        lines += ["![geometry](geometry.png)"]
    if stats.mechanism:
        lines += _mechanism_lines(stats.mechanism)
    for label, by_spec in stats.mechanism_over_training.items():
        intro = f"{label} (mean over blocks) at every kept checkpoint, mean over seeds [95% CI] (seeds); " + "; ".join(
            f"k = {spec}: {settled_text(rows)}" for spec, rows in by_spec.items()
        )
        lines += step_lines(intro, by_spec, lambda spec: f"k = {spec}")
    if "mechanism.png" in images:
        lines += ["", "![diffusion scores over training](mechanism.png)"]
    if pictures:
        lines += ["", "PCA pictures of the teachers' patch tokens (columns: cells, seed-major):", "", "![pca](pca.png)"]
    return lines
