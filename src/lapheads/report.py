"""``lapheads report SWEEP_DIR``: per-spec statistics over seeds, tests against k = 0, plots, geometry against k.

Design choices:

* **Numbers come from the run directories** (metrics.jsonl, report/eval_dino.json, analyze's cached
  analysis.json), never from logs. DINO cells are evaluated here (``lapheads eval dino``: k-NN, linear probe,
  segmentation mIoU, PCA pictures of every cell in one grid); each cell's result is cached in its run directory and
  reused while its checkpoint and the eval options are unchanged.
* **Statistics**: mean, sample std (ddof 1) and n per spec; against the spec "0" a Welch t-test (unequal variances,
  Welch-Satterthwaite degrees of freedom, two-sided) and a paired bootstrap 95% interval of the mean difference over
  the seeds both specs share (10,000 resamples, seeded). With 3 seeds both are coarse; they are reported as they are.
* **Geometry against k**: ``lapheads analyze`` on every cell (cached per run), the last block's metrics, the same
  statistics.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["HEADLINE", "collect", "load_sweep", "paired_bootstrap", "summarize", "welch_t_test", "write_report"]

# task -> [(label, source, path)]; source "metrics": the last logged value in metrics.jsonl, "eval_dino": a path
# into report/eval_dino.json
Metric = tuple[str, str, tuple[str, ...]]
HEADLINE: dict[str, list[Metric]] = {
    "classify": [("test top-1 (%)", "metrics", ("eval_top1",))],
    "lm": [("validation bits per byte", "metrics", ("val_bpb",))],
    "dino": [
        ("k-NN top-1, k = 20 (%)", "eval_dino", ("knn", "20")),
        ("k-NN top-1 at random init, k = 20 (%)", "eval_dino", ("knn_random_init", "20")),
        ("linear probe top-1 (%)", "eval_dino", ("linear", "test_accuracy")),
        ("segmentation mIoU (%)", "eval_dino", ("segmentation", "miou")),
        ("PCA foreground IoU (%)", "eval_dino", ("pca_foreground_iou",)),
    ],
}
# task -> (label, path into a layer's analyze entry)
GEOMETRY = {
    "classify": [
        ("within-sequence fraction", ("anova", "within_seq_fraction")),
        ("between-class fraction", ("anova", "between_class_fraction")),
        ("NC1, sequence means", ("collapse_seq", "nc1")),
        ("ETF distance, sequence means", ("collapse_seq", "etf_distance")),
        ("components for 99%, pooled", ("spectrum", "n_components")),
        ("components for 99%, per sequence", ("spectrum", "n_components_per_seq")),
        ("token cosine similarity", ("similarity",)),
    ],
    "lm": [
        ("CDNV, next-token classes", ("linguistic", "cdnv")),
        ("NC1, next-token classes", ("linguistic", "nc1")),
        ("components for 99%, pooled", ("spectrum", "n_components")),
        ("components for 99%, per sequence", ("spectrum", "n_components_per_seq")),
        ("token cosine similarity", ("similarity",)),
    ],
}
GEOMETRY["dino"] = GEOMETRY["classify"]


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


def paired_bootstrap(a: dict[int, float], b: dict[int, float], resamples: int = 10_000, seed: int = 0) -> dict[str, Any]:
    """95% percentile interval of the mean paired difference a[s] - b[s] over shared seeds s."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return {"n_pairs": 0, "mean_difference": math.nan, "low": math.nan, "high": math.nan}
    diff = np.array([a[s] - b[s] for s in seeds])
    rng = np.random.default_rng(seed)
    means = diff[rng.integers(0, len(diff), size=(resamples, len(diff)))].mean(1)
    low, high = np.percentile(means, [2.5, 97.5])
    return {"n_pairs": len(seeds), "mean_difference": float(diff.mean()), "low": float(low), "high": float(high)}


def _final(run_dir: Path, metric: Metric) -> float | None:
    """One finished run's value of ``metric``, or None where the run has not produced it."""
    _, source, path = metric
    if source == "eval_dino":
        from lapheads.evals.dino import EVAL_FILE

        file = run_dir / "report" / EVAL_FILE
        value: Any = json.loads(file.read_text()) if file.exists() else None
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        return value
    file = run_dir / "metrics.jsonl"
    if not file.exists():
        return None
    values = [r[path[0]] for r in map(json.loads, filter(str.strip, file.read_text().splitlines())) if path[0] in r]
    return values[-1] if values else None


def load_sweep(sweep_dir: Path) -> dict[str, Any]:
    from lapheads.sweep import SWEEP_FILE, SweepError

    try:
        return json.loads((sweep_dir / SWEEP_FILE).read_text())
    except FileNotFoundError:
        raise SweepError(f"{sweep_dir} holds no sweep ({SWEEP_FILE} missing); run `lapheads sweep` first") from None


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


def summarize(values: dict[str, dict[int, float]], baseline: str = "0") -> dict[str, dict[str, Any]]:
    """Per spec: n, mean, std, and (if the baseline spec is present) Welch and paired-bootstrap tests against it."""
    out = {}
    for spec, by_seed in values.items():
        xs = list(by_seed.values())
        row: dict[str, Any] = {"n": len(xs), "mean": float(np.mean(xs)) if xs else math.nan,
                               "std": float(np.std(xs, ddof=1)) if len(xs) > 1 else math.nan, "values": by_seed}
        if spec != baseline and baseline in values:
            row["welch"] = welch_t_test(xs, list(values[baseline].values()))
            row["bootstrap"] = paired_bootstrap(by_seed, values[baseline])
        out[spec] = row
    return out


def _geometry_values(record: dict[str, Any], max_tokens: int) -> dict[str, dict[str, dict[int, float]]]:
    from lapheads.geometry.analyze import AnalyzeOptions, analyze_run

    options = AnalyzeOptions(max_tokens=max_tokens)
    metrics = GEOMETRY[record["task"]]
    out: dict[str, dict[str, dict[int, float]]] = {label: {s: {} for s in record["specs"]} for label, _ in metrics}
    for cell in _done_cells(record):
        analysis = analyze_run(cell["run_dir"], options)
        last = [n for n in analysis["layers"] if n.isdigit()][-1]
        for label, path in metrics:
            value: Any = analysis["per_layer"][last]
            for key in path:
                value = value[key]
            out[label][cell["spec"]][cell["seed"]] = float(value)
    return out


def _spec_axis(specs: list[str]) -> tuple[list[float], list[str]]:
    if all(s.isdigit() for s in specs):
        return [float(s) for s in specs], specs
    return list(range(len(specs))), specs


def _plot(panels: dict[str, dict[str, dict[str, Any]]], specs: list[str], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs, labels = _spec_axis(specs)
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), dpi=110, squeeze=False)
    for ax, (title, stats) in zip(axes.flat, panels.items()):
        means = [stats[s]["mean"] for s in specs]
        stds = [0.0 if math.isnan(stats[s]["std"]) else stats[s]["std"] for s in specs]
        ax.errorbar(xs, means, yerr=stds, marker="o", capsize=4)
        for x, s in zip(xs, specs):
            ax.scatter([x] * len(stats[s]["values"]), list(stats[s]["values"].values()), s=10, alpha=0.5, color="gray")
        ax.set_xticks(xs, labels)
        ax.set_xlabel("Laplacian heads per layer")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _row(label: str, spec: str, stats: dict[str, Any]) -> str:
    cells = [label, spec, str(stats["n"]), f"{stats['mean']:.4g} ± {stats['std']:.2g}"]
    if "welch" in stats:
        boot = stats["bootstrap"]
        cells += [f"{boot['mean_difference']:+.4g}", f"{stats['welch']['p']:.3g}",
                  f"[{boot['low']:+.3g}, {boot['high']:+.3g}]"]
    else:
        cells += ["(baseline)", "", ""]
    return "| " + " | ".join(cells) + " |"


def write_report(sweep_dir: str | Path, metric: str | None = None, geometry: bool = True,
                 max_tokens: int = 262_144) -> Path:
    """Write SWEEP_DIR/report/{report.md, stats.json, metric.png, geometry.png (, pca.png)}; returns report.md.

    Args:
        metric: a key of metrics.jsonl to report instead of the task's headline metrics.
        geometry: run (or reuse) ``lapheads analyze`` on every finished cell and report the last block's geometry.
        max_tokens: analyze's token budget per cell.
    """
    from lapheads.sweep import SweepError

    sweep_dir = Path(sweep_dir)
    record = load_sweep(sweep_dir)
    task, specs = record["task"], record["specs"]
    out = sweep_dir / "report"
    cells = _done_cells(record)
    pictures = task == "dino" and metric is None and bool(cells)
    if pictures:
        from lapheads.evals.dino import eval_dino

        eval_dino([c["run_dir"] for c in cells], out, reuse=True)
    metrics = [(metric, "metrics", (metric,))] if metric else HEADLINE[task]
    headline = {m[0]: summarize(collect(record, m)) for m in metrics}
    if not any(row["n"] for rows in headline.values() for row in rows.values()):
        names = ", ".join(headline)
        raise SweepError(f"{sweep_dir}: no finished cell has {names}; run or resume the sweep first")
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        f"# Sweep report: {record['preset']} ({task})",
        "",
        f"Specs {', '.join(specs)}; seeds {', '.join(map(str, record['seeds']))}; overrides "
        f"`{' '.join(record['overrides']) or 'none'}`. Difference = spec - 0; p = two-sided Welch t-test; interval = "
        "paired bootstrap 95% over shared seeds.",
        "",
        "| metric | Laplacian heads | n | mean ± std | difference vs 0 | Welch p | bootstrap 95% |",
        "|---|---|---|---|---|---|---|",
        *[_row(label, s, stats[s]) for label, stats in headline.items() for s in specs],
    ]
    geometry_stats: dict[str, Any] = {}
    if geometry:
        for name, by_spec in _geometry_values(record, max_tokens).items():
            geometry_stats[name] = summarize(by_spec)
            lines += [_row(name + " (last block)", s, geometry_stats[name][s]) for s in specs]
    _plot(headline, specs, out / "metric.png")
    lines += ["", "![metric](metric.png)"]
    if geometry_stats:
        _plot(geometry_stats, specs, out / "geometry.png")
        lines += ["![geometry](geometry.png)"]
    if pictures:
        lines += ["", "PCA pictures of the teachers' patch tokens (columns: cells, seed-major):", "",
                  "![pca](pca.png)"]
    (out / "stats.json").write_text(json.dumps({"metrics": headline, "geometry": geometry_stats}, indent=1,
                                               default=str) + "\n")
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
