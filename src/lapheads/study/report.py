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
from pathlib import Path
from typing import Any, Callable

import numpy as np

from lapheads.plots import panel_grid
from lapheads.runs import RunDir, SweepError, load_sweep, spec_dir_name
from lapheads.runs.layout import report_folder
from lapheads.study.verdicts import apply_rule, holm_steps, mde
from lapheads.tasks import Metric, get_task

__all__ = [
    "CLAIMS",
    "collect",
    "diffusion_against_zero",
    "fit_against_test",
    "gap_over_training",
    "holm",
    "late_change",
    "load_sweep",
    "paired_test",
    "restate",
    "summarize",
    "verdict",
    "welch_t_test",
    "write_report",
]

# the headline metrics, geometry rows and geometry layers of each task are in lapheads.tasks (Task.headline, ...)
_LAYER_WORDS = ("last block", "after the final norm")
#: The direction the paper reports for a metric with Laplacian heads (+1 rises, -1 falls); absent = no claim.
CLAIMS: dict[str, int] = {
    "test top-1 (%)": +1,
    "validation bits per byte": -1,
    "k-NN top-1, k = 20 (%)": +1,
    "linear probe top-1 (%)": +1,
    "segmentation mIoU (%)": +1,
    "PCA foreground IoU (%)": +1,
    "within-sequence fraction": -1,
    "between-class fraction": +1,
    "within / between-class variance": -1,
    "within-sequence variance / mean |h|^2": -1,
    "NC1, sequence means": -1,
    "ETF distance, sequence means": -1,
    "components for 99%, pooled": -1,
    "components for 99%, per sequence": -1,
    "CDNV, next-token classes": -1,
    "NC1, next-token classes": -1,
    "ChatCORE": +1,
    "diffusion score, Laplacian heads": +1,  # the heat-diffusion reading: a Laplacian head smooths
    "Laplacian excess over ordinary heads": +1,  # ... more than an ordinary head's circuit would in its place
}
#: Headline metrics where a fall is an improvement (the rest improve by rising).
LOWER_IS_BETTER = frozenset({"validation bits per byte", "validation loss (nats)"})
ALPHA, POWER = 0.05, 0.80


def welch_t_test(a: list[float], b: list[float]) -> dict[str, float]:
    """Two-sided Welch t-test of mean(a) - mean(b): t, degrees of freedom, p."""
    from scipy.special import stdtr

    a_, b_ = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if len(a_) < 2 or len(b_) < 2:
        return {"t": math.nan, "df": math.nan, "p": math.nan}
    va, vb = a_.var(ddof=1) / len(a_), b_.var(ddof=1) / len(b_)
    if va + vb == 0:
        return {"t": math.nan, "df": math.nan, "p": math.nan}
    t = (a_.mean() - b_.mean()) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a_) - 1) + vb**2 / (len(b_) - 1))
    return {"t": float(t), "df": float(df), "p": float(2 * stdtr(df, -abs(t)))}


def paired_test(a: dict[int, float], b: dict[int, float]) -> dict[str, Any]:
    """Paired comparison of a[s] - b[s] over the seeds s both have: mean difference, its t-based 95% interval, the
    two-sided paired t-test, and the minimum detectable effect (80% power, alpha 0.05) at the observed spread."""
    from scipy import stats

    seeds = sorted(set(a) & set(b))
    diff = np.array([a[s] - b[s] for s in seeds], dtype=float)
    out: dict[str, Any] = {
        "n_pairs": len(seeds),
        "mean_difference": float(diff.mean()) if len(diff) else math.nan,
        "ci_low": math.nan,
        "ci_high": math.nan,
        "t": math.nan,
        "df": math.nan,
        "p": math.nan,
        "mde": math.nan,
    }
    if len(diff) < 2:
        return out
    df = len(diff) - 1
    se = float(diff.std(ddof=1)) / math.sqrt(len(diff))
    critical = float(stats.t.ppf(1 - ALPHA / 2, df))
    out.update(
        df=float(df),
        ci_low=out["mean_difference"] - critical * se,
        ci_high=out["mean_difference"] + critical * se,
        mde=(critical + float(stats.t.ppf(POWER, df))) * se,
    )
    if se > 0:
        t = out["mean_difference"] / se
        out.update(t=float(t), p=float(2 * stats.t.sf(abs(t), df)))
    return out


def holm(p_values: dict[str, float]) -> dict[str, float]:
    """Holm's step-down adjustment of a family of p-values (NaN entries stay NaN and do not count)."""
    finite = sorted((p, name) for name, p in p_values.items() if not math.isnan(p))
    adjusted, running = {name: math.nan for name in p_values}, 0.0
    for i, (p, name) in enumerate(finite):
        running = max(running, min(1.0, (len(finite) - i) * p))
        adjusted[name] = running
    return adjusted


def verdict(difference: float, p_holm: float, mde_: float, direction: int | None) -> str:
    """The mechanism section's rule: held / opposite when significant after Holm, else not detected (with the MDE
    at the alpha of the row's Holm step)."""
    if direction is None:
        return "no claim"
    if not math.isnan(p_holm) and p_holm < ALPHA:
        return "held" if difference * direction > 0 else "opposite"
    if not math.isnan(mde_):
        return f"not detected (MDE {mde_:.3g})"
    return "not detected" if not math.isnan(p_holm) else "not tested (fewer than 2 seeds)"


def _fmt(x: float, spec: str) -> str:
    """A number for a table cell; an undefined one (a statistic of fewer than 2 seeds) as a dash, not "nan"."""
    return "–" if math.isnan(x) else format(x, spec)


def _mean_std(row: dict[str, Any], spec: str) -> str:
    return format(row["mean"], spec) + ("" if math.isnan(row["std"]) else f" ± {row['std']:.2g}")


def _final(run_dir: Path, metric: Metric) -> float | None:
    """One finished run's value of ``metric``, or None where the run has not produced it."""
    _, source, path = metric
    run = RunDir(run_dir)
    if source == "metrics":
        return run.last_metric(path[0])
    value: Any = run.read_report(source)
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _done_cells(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Finished cells, seed-major in spec order (the order of the PCA grid's columns)."""
    cells = [c for c in record["cells"].values() if c.get("status") == "done"]
    return sorted(cells, key=lambda c: (c["seed"], record["specs"].index(c["spec"])))


def collect(record: dict[str, Any], metric: Metric) -> dict[str, dict[int, float]]:
    """{spec: {seed: value of metric}} over the sweep's finished cells."""
    values: dict[str, dict[int, float]] = {spec: {} for spec in record["specs"]}
    for cell in _done_cells(record):
        value = _final(Path(cell["run_dir"]), metric)
        if value is not None:
            values[cell["spec"]][cell["seed"]] = value
    return values


def _series(record: dict[str, Any], metric: Metric) -> dict[str, dict[int, dict[int, float]]]:
    """{spec: {step: {seed: value}}} of a metric logged in metrics.jsonl at every evaluation ({} for others)."""
    _, source, path = metric
    if source != "metrics":
        return {}
    series: dict[str, dict[int, dict[int, float]]] = {spec: {} for spec in record["specs"]}
    for cell in _done_cells(record):
        for entry in RunDir(cell["run_dir"]).read_metrics():
            if path[0] in entry and "step" in entry:
                series[cell["spec"]].setdefault(int(entry["step"]), {})[cell["seed"]] = float(entry[path[0]])
    return series


def late_change(record: dict[str, Any], metric: Metric, fraction: float = 0.25) -> dict[str, dict[str, Any]]:
    """Is the metric still moving at the end? Per spec, each seed's change over the last ``fraction`` of training
    (last evaluation minus the first evaluation at or after (1 - fraction) of the last step), its mean over seeds,
    t-based 95% interval, and "still improving" when that interval excludes 0 in the metric's better direction."""
    better = -1 if metric[0] in LOWER_IS_BETTER else +1
    out = {}
    for spec, by_step in _series(record, metric).items():
        steps = sorted(by_step)
        if len(steps) < 2:
            continue
        start = next(step for step in steps if step >= (1 - fraction) * steps[-1])
        start = start if start != steps[-1] else steps[-2]
        change = {
            seed: by_step[steps[-1]][seed] - v for seed, v in by_step[start].items() if seed in by_step[steps[-1]]
        }
        if not change:
            continue
        test = paired_test(change, dict.fromkeys(change, 0.0))
        improving = (  # None: one seed, no interval to decide it
            None if math.isnan(test["ci_low"]) else (test["ci_low"] > 0 if better > 0 else test["ci_high"] < 0)
        )
        out[spec] = {"from_step": start, "to_step": steps[-1], **test, "still_improving": improving}
    return out


_YES_NO = {True: "yes", False: "no"}


def _with_interval(row: dict[str, Any]) -> str:
    """A ``paired_test`` row as "+mean [low, high]" ("+mean" alone where there is no interval: one pair)."""
    interval = "" if math.isnan(row["ci_low"]) else f" [{row['ci_low']:+.3g}, {row['ci_high']:+.3g}]"
    return f"{row['mean_difference']:+.3g}{interval}"


def _late_change_lines(label: str, changes: dict[str, dict[str, Any]]) -> list[str]:
    lines = [
        "",
        f"{label}, change over the last quarter of training (each seed's last evaluation minus its evaluation at "
        "the quarter's start; mean [95% CI] over seeds): a model still improving there is not converged.",
        "",
        "| Laplacian heads | steps | change [95% CI] | seeds | still improving |",
        "|---|---|---|---|---|",
    ]
    for spec, row in changes.items():
        lines.append(
            f"| {spec} | {row['from_step']} -> {row['to_step']} | {_with_interval(row)} | "
            f"{row['n_pairs']} | {_YES_NO.get(row['still_improving'], 'untested (1 seed)')} |"
        )
    return lines


_FIT, _TEST = ("fit_top1", "metrics", ("fit_top1",)), ("eval_top1", "metrics", ("eval_top1",))
# against the baseline: a regularising bias fits less (fit top-1 down, fit loss up) and generalises better (test
# loss down); at a fit top-1 near 100% only the losses can still show it
_AGAINST_BASELINE = {
    "fit top-1": _FIT,
    "fit loss": ("fit_loss", "metrics", ("fit_loss",)),
    "test loss": ("eval_loss", "metrics", ("eval_loss",)),
}


def fit_against_test(record: dict[str, Any], baseline: str = "0") -> dict[str, dict[str, Any]]:
    """Per spec, the final top-1 on training images without augmentation (``--fit-subset``) and on the test set,
    their paired difference over seeds (fit - test; near 0: the model does not even fit its training data), and
    under "against_baseline" the paired differences from the baseline spec of the fit top-1, the fit loss and the
    test loss (None for the baseline itself, or without baseline cells). {} when no finished cell logged a fit
    score."""
    fit, test = collect(record, _FIT), collect(record, _TEST)
    others = {name: collect(record, metric) for name, metric in _AGAINST_BASELINE.items()}
    out = {}
    for spec, by_seed in fit.items():
        if by_seed:
            against = None
            if spec != baseline and fit.get(baseline):
                against = {name: paired_test(values[spec], values[baseline]) for name, values in others.items()}
            mean = float(np.mean(list(by_seed.values())))
            out[spec] = {"fit_top1": mean, **paired_test(by_seed, test[spec]), "against_baseline": against}
    return out


def _fit_lines(rows: dict[str, dict[str, Any]], baseline: str) -> list[str]:
    lines = [
        "",
        "Fit: final top-1 on the first training images without augmentation (`--fit-subset`) against the test "
        "top-1, paired within each cell, mean [95% CI] over seeds. A fit score near the test score means the model "
        "has not fitted its training data: underfit, where a regularising bias has little to act on. Against "
        f"k = {baseline}, paired by seed: a regularising bias lowers the fit top-1, raises the fit loss and lowers the "
        "test loss.",
        "",
        "| Laplacian heads | fit top-1 (%) | fit - test [95% CI] | "
        + " | ".join(f"{name} - at k = {baseline}" for name in _AGAINST_BASELINE)
        + " | seeds |",
        "|---|---|---|---|---|---|---|",
    ]
    for spec, row in rows.items():
        against = row["against_baseline"] or {}
        columns = [_with_interval(against[name]) if name in against else "–" for name in _AGAINST_BASELINE]
        lines.append(
            f"| {spec} | {row['fit_top1']:.2f} | {_with_interval(row)} | {' | '.join(columns)} | {row['n_pairs']} |"
        )
    return lines


def gap_over_training(record: dict[str, Any], metric: Metric, baseline: str = "0") -> dict[str, list[dict]]:
    """{spec: [paired_test of spec - baseline at one step, with "step"], ...} for a metric logged in metrics.jsonl
    at every evaluation; a step is listed where at least one seed has both arms."""
    series = _series(record, metric)
    if baseline not in series:
        return {}
    gaps = {}
    for spec, by_step in series.items():
        if spec == baseline:
            continue
        rows = []
        for step in sorted(set(by_step) & set(series[baseline])):
            test = paired_test(by_step[step], series[baseline][step])
            if test["n_pairs"]:
                rows.append({"step": step, **test})
        if rows:
            gaps[spec] = rows
    return gaps


def _step_lines(intro: str, rows_by_spec: dict[str, list[dict]], column: Callable[[str], str]) -> list[str]:
    """Markdown: one row per step, one column per spec: mean [95% CI] (pairs) of ``paired_test`` rows."""
    specs = list(rows_by_spec)
    steps = sorted({row["step"] for rows in rows_by_spec.values() for row in rows})
    at = {(spec, row["step"]): row for spec, rows in rows_by_spec.items() for row in rows}
    lines = ["", intro, "", "| step | " + " | ".join(map(column, specs)) + " |", "|---|" + "---|" * len(specs)]
    for step in steps:
        cells = []
        for spec in specs:
            row = at.get((spec, step))
            cells.append("" if row is None else f"{_with_interval(row)} ({row['n_pairs']})")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return lines


def _gap_lines(label: str, gaps: dict[str, list[dict]], baseline: str) -> list[str]:
    intro = f"{label}, paired gap over training (spec - {baseline} at each evaluation; mean [95% CI] (pairs)):"
    return _step_lines(intro, gaps, lambda spec: f"{spec} - {baseline}")


def _spec_order(spec: str) -> tuple[int, int, str]:
    """k values in numeric order, then per-layer specs as written."""
    return (0, int(spec), "") if spec.isdigit() else (1, 0, spec)


def _plot_steps(
    panels: dict[str, dict[str, list[dict]]], path: Path, ylabel: str, legend: Callable[[str], str]
) -> Path:
    """One panel per entry: each spec's ``paired_test`` rows against step, the mean with its 95% interval."""
    specs = sorted({spec for rows_by_spec in panels.values() for spec in rows_by_spec}, key=_spec_order)
    color = {spec: f"C{i}" for i, spec in enumerate(specs)}  # one colour per spec in every panel
    with panel_grid(path, len(panels), cols=2, size=(5.0, 3.4)) as axes:
        for ax, (title, rows_by_spec) in zip(axes, panels.items()):
            for spec, rows in rows_by_spec.items():
                steps = [r["step"] for r in rows]
                means = [r["mean_difference"] for r in rows]
                ax.plot(steps, means, marker="o", color=color[spec], label=legend(spec))
                low, high = [r["ci_low"] for r in rows], [r["ci_high"] for r in rows]
                ax.fill_between(steps, low, high, color=color[spec], alpha=0.2, linewidth=0)
            ax.axhline(0.0, color="black", linewidth=0.8)
            ax.set_xlabel("step")
            ax.set_ylabel(ylabel)
            ax.set_title(title, fontsize=9)
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3)
    return path


def mechanism_over_training(record: dict[str, Any]) -> dict[str, dict[str, list[dict]]]:
    """When do heads turn diffusive? {"diffusion score, Laplacian heads" / "... ordinary heads": {spec: [the
    seeds' mean score over blocks at one step, tested against 0 (``paired_test`` against a zero arm), with
    "step"], ...}} at every checkpoint the finished cells kept. Read from the weights alone (no data), so each
    kept step costs one model load."""
    from lapheads.geometry.mechanism import ov_circuits
    from lapheads.runs import checkpoint_steps, load_model

    weights = get_task(record["task"]).analyzed_weights
    scores: dict[str, dict[str, dict[int, dict[int, float]]]] = {}
    for cell in _done_cells(record):
        run = RunDir(cell["run_dir"])
        for step in checkpoint_steps(run):
            heads = [head for block in ov_circuits(load_model(run, weights, step)) for head in block]
            for kind, laplacian in (("Laplacian", True), ("ordinary", False)):
                kind_scores = [head["diffusion"] for head in heads if head["laplacian"] == laplacian]
                if kind_scores:
                    by_step = scores.setdefault(f"diffusion score, {kind} heads", {}).setdefault(cell["spec"], {})
                    by_step.setdefault(step, {})[cell["seed"]] = float(np.mean(kind_scores))

    def against_zero(by_seed: dict[int, float]) -> dict[str, Any]:
        return paired_test(by_seed, dict.fromkeys(by_seed, 0.0))

    return {
        label: {
            spec: [{"step": step, **against_zero(by_seed)} for step, by_seed in sorted(by_step.items())]
            for spec, by_step in scores[label].items()
        }
        for label in sorted(scores, key=lambda label: "ordinary" in label)  # Laplacian heads first
    }


def _settled_text(rows: list[dict]) -> str:
    settled = settled_from(rows)
    if settled is None:
        return "one seed so far, untested" if rows[-1]["n_pairs"] < 2 else "its interval includes 0 at the last step"
    sign, step = settled
    return f"{'diffusive (above 0)' if sign > 0 else 'sharpening (below 0)'} from step {step} on"


def settled_from(rows: list[dict]) -> tuple[int, int] | None:
    """(side, step): the first step from which on every step's 95% interval lies on one side of 0 (+1 above,
    -1 below), that side being the last step's; None when the last step's interval includes 0 (or is undefined)."""
    settled = None
    for row in rows:
        side = 0 if math.isnan(row["ci_low"]) else (1 if row["ci_low"] > 0 else -1 if row["ci_high"] < 0 else 0)
        if side == 0:  # the interval holds 0 (or there is none): whatever came before does not count
            settled = None
        elif settled is None or settled[0] != side:
            settled = (side, row["step"])
    return settled


def summarize(values: dict[str, dict[int, float]], baseline: str = "0") -> dict[str, dict[str, Any]]:
    """Per spec: n, mean, std, and (if the baseline spec is present) the paired test against it (Welch's unpaired
    test as well, used in its place when fewer than two seeds pair up)."""
    out = {}
    for spec, by_seed in values.items():
        xs = list(by_seed.values())
        row: dict[str, Any] = {
            "n": len(xs),
            "mean": float(np.mean(xs)) if xs else math.nan,
            "std": float(np.std(xs, ddof=1)) if len(xs) > 1 else math.nan,
            "values": by_seed,
            "baseline": baseline,
        }
        if spec != baseline and baseline in values:
            row["paired"] = paired_test(by_seed, values[baseline])
            row["welch"] = welch_t_test(xs, list(values[baseline].values()))
            baseline_values = list(values[baseline].values())
            row["baseline_mean"] = float(np.mean(baseline_values)) if baseline_values else math.nan
            row["test"] = "paired" if row["paired"]["n_pairs"] >= 2 else "welch"
        out[spec] = row
    return out


def _claim(label: str) -> int | None:
    """The paper's direction for a row label, whatever layer the row was measured at."""
    for where in _LAYER_WORDS:
        label = label.removesuffix(f" ({where})")
    if label in CLAIMS:
        return CLAIMS[label]
    return CLAIMS.get(label.rsplit(" (", 1)[0])  # "diffusion score, Laplacian heads (block 3)" and the like


Values = dict[str, dict[str, dict[int, float]]]  # row label -> spec -> seed -> value


def _geometry_values(record: dict[str, Any], max_tokens: int) -> tuple[Values, Values]:
    """(geometry rows, mechanism rows) from every finished cell's analysis (``lapheads analyze``, cached)."""
    from lapheads.study.analyze import AnalyzeOptions, analyze_run

    options = AnalyzeOptions(max_tokens=max_tokens)
    task = get_task(record["task"])
    metrics, where = task.geometry, task.geometry_layers
    out: Values = {f"{label} ({w})": {s: {} for s in record["specs"]} for w in where for label, _ in metrics}
    mechanism: Values = {}
    for cell in _done_cells(record):
        analysis = analyze_run(cell["run_dir"], options)
        for label, value in _diffusion_scores(analysis).items():
            mechanism.setdefault(label, {s: {} for s in record["specs"]})[cell["spec"]][cell["seed"]] = value
        layers = {"last block": [n for n in analysis["layers"] if n.isdigit()][-1], "after the final norm": "norm"}
        for w in where:
            for label, path in metrics:
                value: Any = analysis["per_layer"].get(layers[w], {})
                for key in path:
                    value = value.get(key) if isinstance(value, dict) else None
                if value is not None:
                    out[f"{label} ({w})"][cell["spec"]][cell["seed"]] = float(value)
    _against_k0(mechanism)
    return out, mechanism


NULL_ROW = "null: ordinary heads read as Laplacian (mean over blocks)"
EXCESS_ROW = "Laplacian excess over ordinary heads (same block)"
AGAINST_K0_ROW = "Laplacian excess over ordinary heads (k = 0 run, paired by seed)"


def _diffusion_scores(analysis: dict[str, Any]) -> dict[str, float]:
    """Mean diffusion score of a run's Laplacian and of its ordinary heads over every analysed block, the
    Laplacian heads' per block, the null (ordinary heads' circuits read as if Laplacian) and the Laplacian heads'
    excess over the null of their own blocks; a kind absent from the run gives no row."""
    rows: dict[str, float] = {}
    layers = [(block, layer.get("mechanism") or {}) for block, layer in analysis["per_layer"].items()]
    for kind, key in (("Laplacian", "laplacian_diffusion"), ("ordinary", "ordinary_diffusion")):
        heads = [h["diffusion"] for _, m in layers for h in m.get("heads", []) if _kind_of(h) == kind.lower()]
        if heads:
            rows[f"diffusion score, {kind} heads (mean over blocks)"] = float(np.mean(heads))
        if kind == "Laplacian":
            for block, mechanism in layers:
                if mechanism.get(key) is not None:
                    rows[f"diffusion score, Laplacian heads (block {block})"] = float(mechanism[key])
    null = [
        h["as_laplacian"]
        for _, m in layers
        for h in m.get("heads", [])
        if _kind_of(h) == "ordinary" and "as_laplacian" in h
    ]
    if null:
        rows[NULL_ROW] = float(np.mean(null))
    excess = [
        m["laplacian_diffusion"] - m["ordinary_as_laplacian"]
        for _, m in layers
        if m.get("laplacian_diffusion") is not None and m.get("ordinary_as_laplacian") is not None
    ]
    if excess:
        rows[EXCESS_ROW] = float(np.mean(excess))
    return rows


def _kind_of(head: dict[str, Any]) -> str:
    """A head's kind as analyze recorded it (older analyses: Laplacian or ordinary); only ordinary heads are
    ordinary here, and only Laplacian heads Laplacian."""
    return head.get("kind", "laplacian" if head["laplacian"] else "ordinary")


def _against_k0(mechanism: Values) -> None:
    """Add each spec's Laplacian heads minus the k = 0 run's null, seed by seed (the same initialisation and data
    order: what an ordinary head's circuit would have scored as a Laplacian head in the same training)."""
    laplacian = mechanism.get("diffusion score, Laplacian heads (mean over blocks)", {})
    null = mechanism.get(NULL_ROW, {}).get("0", {})
    rows = {
        spec: {seed: value - null[seed] for seed, value in by_seed.items() if seed in null}
        for spec, by_seed in laplacian.items()
        if spec != "0"
    }
    if any(rows.values()):
        mechanism[AGAINST_K0_ROW] = {spec: by_seed for spec, by_seed in rows.items() if by_seed}


def diffusion_against_zero(mechanism: Values) -> dict[str, dict[str, dict[str, Any]]]:
    """Each row's specs tested against 0 (a one-sample t-test = the paired test against a zero arm)."""
    family: dict[str, dict[str, dict[str, Any]]] = {}
    for label, by_spec in sorted(mechanism.items(), key=lambda item: "ordinary" in item[0]):  # Laplacian rows first
        rows = {}
        for spec, by_seed in by_spec.items():
            if by_seed:
                rows[spec] = summarize({"zero": dict.fromkeys(by_seed, 0.0), spec: by_seed}, baseline="zero")[spec]
        family[label] = rows
    for spec in {spec for rows in family.values() for spec in rows}:
        raw = {label: rows[spec]["paired"]["p"] for label, rows in family.items() if spec in rows}
        adjusted, faced = holm_steps(raw)
        for label, p_holm in adjusted.items():
            row = family[label][spec]
            values = np.array(list(row["values"].values()), dtype=float)
            se = float(values.std(ddof=1)) / math.sqrt(len(values)) if len(values) > 1 else math.nan
            alpha = faced[label] if not math.isnan(faced[label]) else ALPHA
            row.update(p_holm=p_holm, alpha=alpha, mde_at_alpha=mde(se, len(values) - 1, alpha))
            row["verdict"] = verdict(row["paired"]["mean_difference"], p_holm, row["mde_at_alpha"], _claim(label))
    return family


def _spec_axis(specs: list[str]) -> tuple[list[float], list[str]]:
    if all(s.isdigit() for s in specs):
        return [float(s) for s in specs], specs
    return list(range(len(specs))), specs


def _plot(panels: dict[str, dict[str, dict[str, Any]]], specs: list[str], path: Path) -> Path:
    xs, labels = _spec_axis(specs)
    with panel_grid(path, len(panels)) as axes:
        for ax, (title, stats) in zip(axes, panels.items()):
            means = [stats[s]["mean"] for s in specs]
            stds = [0.0 if math.isnan(stats[s]["std"]) else stats[s]["std"] for s in specs]
            ax.errorbar(xs, means, yerr=stds, marker="o", capsize=4)
            for x, s in zip(xs, specs):
                seeds = list(stats[s]["values"].values())
                ax.scatter([x] * len(seeds), seeds, s=10, alpha=0.5, color="gray")
            ax.set_xticks(xs, labels)
            ax.set_xlabel("Laplacian heads per layer")
            ax.set_title(title, fontsize=9)
            ax.grid(alpha=0.3)
    return path


def _row(label: str, spec: str, stats: dict[str, Any]) -> str:
    cells = [label, stats.get("role", ""), spec, str(stats["n"]), _mean_std(stats, ".4g")]
    if "test" in stats:
        pair = stats["paired"]
        test = stats[stats["test"]]
        if stats["test"] == "paired":
            difference = f"{pair['mean_difference']:+.4g} [{pair['ci_low']:+.3g}, {pair['ci_high']:+.3g}]"
        elif not math.isnan(test["p"]):  # arms on different seeds: the difference of their means
            difference = f"{stats['mean'] - stats['baseline_mean']:+.4g} (Welch)"
        elif pair["n_pairs"]:  # one pair so far: its difference, untested
            difference = f"{pair['mean_difference']:+.4g} (1 pair)"
        elif math.isnan(stats["baseline_mean"]):
            difference = f"– (k = {stats['baseline']} has no value)"
        else:
            difference = f"{stats['mean'] - stats['baseline_mean']:+.4g} (unpaired)"
        holm_p = stats.get("p_holm", math.nan)
        cells += [
            difference,
            f"{_fmt(test['p'], '.3g')} / {_fmt(holm_p, '.3g') if stats.get('role') == 'declared' else '–'} / "
            f"{_fmt(stats.get('permutation_p', math.nan), '.3g')}",
            stats.get("signs", ""),
            f"{_fmt(stats.get('alpha', math.nan), '.2g')}: {_fmt(stats.get('mde_at_alpha', math.nan), '.3g')}",
            stats.get("verdict", ""),
        ]
    else:
        no_arm = "(baseline)" if spec == stats["baseline"] else f"– (no k = {stats['baseline']} arm)"
        cells += [no_arm, "", "", "", ""]
    return "| " + " | ".join(cells) + " |"


def _mechanism_row(label: str, spec: str, row: dict[str, Any]) -> str:
    pair = row["paired"]
    interval = "" if math.isnan(pair["ci_low"]) else f"[{pair['ci_low']:+.3g}, {pair['ci_high']:+.3g}]"
    cells = [
        label,
        spec,
        str(row["n"]),
        _mean_std(row, "+.3g"),
        interval,
        f"{_fmt(pair['p'], '.3g')} / {_fmt(row['p_holm'], '.3g')}",
        f"{_fmt(row['alpha'], '.2g')}: {_fmt(row['mde_at_alpha'], '.3g')}",
        row["verdict"],
    ]
    return "| " + " | ".join(cells) + " |"


MECHANISM_HEADER = [
    "| quantity | Laplacian heads | n | mean ± std | 95% CI | p raw / Holm | alpha: MDE | verdict |",
    "|---|---|---|---|---|---|---|---|",
]


def _table_header(baseline: str) -> list[str]:
    return [
        f"| metric | role | Laplacian heads | n | mean ± std | difference vs {baseline} [95% CI] | p: t-test / Holm / "
        "sign-flip | seeds in the paper's direction | alpha: MDE | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]


def _rule_lines(rule: dict[str, Any]) -> list[str]:
    """The verdict rule in words, with this report's family and margins (lapheads.study.verdicts)."""
    margins = "; ".join(
        f"{label}: {'none (the paper reports no such effect)' if m is None else f'{m:.3g}'}"
        for label, m in rule["margin"].items()
    )
    declared = ", ".join(rule["declared"]) or "none of its rows in this sweep"
    return [
        f"Verdict rule (`lapheads.study.verdicts`): the **primary** test ({', '.join(rule['primary'])}) alone at alpha "
        f"{rule['alpha']}; the **declared** geometry family ({declared}), Holm-corrected across claims x arms "
        f"({rule['declared_family_size']} tests); every other row **secondary**, raw p, uncorrected. MDE: the "
        f"difference detected with {rule['power']:.0%} power at the alpha the row faces (its Holm step for "
        "declared rows), exact noncentral t. Equivalence margin (a gain this large or larger ruled out by a "
        f"one-sided test reads 'excluded'): {margins}. Beside each t-test p: the exact sign-flip permutation p "
        "(floor 2/2^n: 0.0625 with 5 pairs) and the seeds that moved in the paper's direction.",
        "",
    ]


def _judge(
    rows: dict[str, dict[str, dict[str, Any]]], primary_label: str, baseline: str, margin: float | None
) -> tuple[dict[str, dict[str, dict[str, Any]]], dict[str, Any]]:
    """Apply the verdict rule to every row (``primary_label`` the primary test); returns the rows in table order
    (primary, declared family, secondary) and the rule's record."""
    primary = {primary_label: rows[primary_label]}
    others = {label: value for label, value in rows.items() if label != primary_label}
    rule = apply_rule(primary, others, {label: _claim(label) for label in rows}, baseline, margin)
    declared = [label for label in rule["declared"] if label in others]
    rest = {label: value for label, value in others.items() if label not in declared}
    return {**primary, **{label: others[label] for label in declared}, **rest}, rule


def restate(stats_file: str | Path, margin: float | None = None) -> str:
    """The statistics table of an existing stats.json (any version: it keeps every cell's per-seed value),
    recomputed with the current tests and verdict rule (:mod:`lapheads.study.verdicts`); no run directory needed."""

    try:
        saved = json.loads(Path(stats_file).read_text())
        groups = [(label, rows) for label, rows in saved["metrics"].items()]
        # reports before 2026-11-30 measured geometry at the last block and did not say so in the label
        groups += [
            (label if label.endswith(")") else f"{label} (last block)", rows)
            for label, rows in saved.get("geometry", {}).items()
        ]

        def values(rows: dict[str, Any]) -> dict[str, dict[int, float]]:
            return {spec: {int(seed): float(v) for seed, v in row["values"].items()} for spec, row in rows.items()}

        baseline = str(saved.get("baseline", "0"))  # reports before 2026-12-01 always compared with k = 0
        family = {label: summarize(values(rows), baseline) for label, rows in groups}
        primary_label = next(iter(saved["metrics"]))
        mechanism = diffusion_against_zero({label: values(rows) for label, rows in saved.get("mechanism", {}).items()})
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError, StopIteration) as err:
        raise SweepError(f"{stats_file} is not a lapheads report stats.json ({type(err).__name__}: {err})") from None
    family, rule = _judge(family, primary_label, baseline, margin)
    lines = [
        *_rule_lines(rule),
        *_table_header(baseline),
        *[_row(label, spec, stats[spec]) for label, stats in family.items() for spec in stats],
    ]
    if mechanism:
        lines += ["", *MECHANISM_HEADER]
        lines += [_mechanism_row(label, spec, row) for label, rows in mechanism.items() for spec, row in rows.items()]
    return "\n".join(lines)


def write_report(
    sweep_dir: str | Path,
    metric: str | None = None,
    geometry: bool = True,
    max_tokens: int = 262_144,
    baseline: str = "0",
    margin: float | None = None,
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
        margin: the primary metric's equivalence margin (None: the paper's effect on this baseline, where known).
    """

    sweep_dir = Path(sweep_dir)
    record = load_sweep(sweep_dir)
    task, specs = record["task"], record["specs"]
    if baseline != "0" and baseline not in specs:  # a sweep without k = 0 still reports its arms, untested
        raise SweepError(f"--baseline {baseline!r} is not a spec of this sweep; choose one of {', '.join(specs)}")
    out = report_folder(sweep_dir, None if baseline == "0" else spec_dir_name(baseline))
    cells = _done_cells(record)
    pictures = task == "dino" and metric is None and bool(cells)
    if pictures:
        from lapheads.evals.dino import eval_dino

        eval_dino([c["run_dir"] for c in cells], out, reuse=True)
    metrics = [(metric, "metrics", (metric,))] if metric else list(get_task(task).headline)
    headline = {m[0]: summarize(collect(record, m), baseline) for m in metrics}
    if not any(row["n"] for rows in headline.values() for row in rows.values()):
        names = ", ".join(headline)
        raise SweepError(f"{sweep_dir}: no finished cell has {names}; run or resume the sweep first")
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        f"# Sweep report: {record['preset']} ({task})",
        "",
        f"Specs {', '.join(specs)}; seeds {', '.join(map(str, record['seeds']))}; overrides "
        f"`{' '.join(record['overrides']) or 'none'}`. Difference = spec - {baseline}, paired by seed, with its "
        "t-based 95% interval; p = two-sided paired t-test; verdict: held / opposite (p below the row's alpha, "
        "with / against the paper's direction), excluded (a paper-sized gain ruled out) or not detected.",
        "",
    ]
    geometry_stats: dict[str, Any] = {}
    mechanism_stats: dict[str, Any] = {}
    if geometry and get_task(task).geometry:  # mid/sft runs: their bases' geometry is the pre-training report's
        geometry_values, mechanism_values = _geometry_values(record, max_tokens)
        geometry_stats = {name: summarize(by_spec, baseline) for name, by_spec in geometry_values.items()}
        mechanism_stats = diffusion_against_zero(mechanism_values)
    table, rule = _judge({**headline, **geometry_stats}, metrics[0][0], baseline, margin)
    lines += [*_rule_lines(rule), *_table_header(baseline)]
    lines += [_row(label, s, stats[s]) for label, stats in table.items() for s in specs]
    _plot(headline, specs, out / "metric.png")
    lines += ["", "![metric](metric.png)"]
    gaps = {m[0]: g for m in metrics if (g := gap_over_training(record, m, baseline))}
    changes = {m[0]: c for m in metrics if (c := late_change(record, m))}
    for label, by_spec in changes.items():
        lines += _late_change_lines(label, by_spec)
    fit = fit_against_test(record, baseline) if metric is None else {}
    if fit:
        lines += _fit_lines(fit, baseline)
    for label, by_spec in gaps.items():
        lines += _gap_lines(label, by_spec, baseline)
    if gaps:
        titles = {f"{label}: gap over training": by_spec for label, by_spec in gaps.items()}
        _plot_steps(titles, out / "gap.png", "paired difference (95% CI)", lambda spec: f"{spec} - {baseline}")
        lines += ["", "![gap over training](gap.png)"]
    if geometry_stats:
        _plot(geometry_stats, specs, out / "geometry.png")
        lines += ["![geometry](geometry.png)"]
    if mechanism_stats:
        lines += [
            "",
            "Heat-diffusion mechanism: each head's whole circuit diag(LayerScale) W_O W_V diag(gamma) against the "
            "identity on its subspace, normalised by what a rank-D head can attain (`lapheads.geometry.mechanism`; "
            "+1: the head moves tokens toward their attention-weighted neighbours as a heat step does, -1: away), "
            "mean over seeds, tested against 0 (one-sample t-test, Holm across these rows per spec). The null: the "
            "ordinary heads' circuits read as if they were Laplacian (an ordinary-looking circuit in a Laplacian "
            "head already scores that); the excess rows test the Laplacian heads against it, in their own blocks "
            "and against the k = 0 run of the same seed. The heat-diffusion reading predicts an excess > 0.",
            "",
            *MECHANISM_HEADER,
        ]
        lines += [
            _mechanism_row(label, spec, row) for label, rows in mechanism_stats.items() for spec, row in rows.items()
        ]
    emergence: dict[str, Any] = {}
    if mechanism_stats:
        emergence = mechanism_over_training(record)
        for label, by_spec in emergence.items():
            intro = (
                f"{label} (mean over blocks) at every kept checkpoint, mean over seeds [95% CI] (seeds); "
                + "; ".join(f"k = {spec}: {_settled_text(rows)}" for spec, rows in by_spec.items())
            )
            lines += _step_lines(intro, by_spec, lambda spec: f"k = {spec}")
        _plot_steps(emergence, out / "mechanism.png", "mean diffusion score (95% CI)", lambda spec: f"k = {spec}")
        lines += ["", "![diffusion scores over training](mechanism.png)"]
    if pictures:
        lines += ["", "PCA pictures of the teachers' patch tokens (columns: cells, seed-major):", "", "![pca](pca.png)"]
    (out / "stats.json").write_text(
        json.dumps(
            {
                "baseline": baseline,
                "rule": rule,
                "metrics": headline,
                "geometry": geometry_stats,
                "mechanism": mechanism_stats,
                "over_training": gaps,
                "late_change": changes,
                "fit": fit,
                "mechanism_over_training": emergence,
            },
            indent=1,
            default=str,
        )
        + "\n"
    )
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
