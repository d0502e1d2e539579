"""``lapheads demo``: the fmnist-cpu recipe with 0 and with k Laplacian heads, same seed, and a report.

The report directory holds ``report.md`` (test accuracy, wall time, parameters per run; the paper's claims with
a one-seed verdict each), PNG plots of the training loss and test accuracy of both runs, and the token geometry of
both (``lapheads analyze``: ANOVA and spectrum plots in the report, every metric in summary.md). Everything is read
back from the two run directories, the contract between training and reporting.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from lapheads.analyze import analyze_runs
from lapheads.data.images import fetch_fashion_mnist, find_fashion_mnist
from lapheads.plots import panel_grid
from lapheads.presets import resolve_classify_config
from lapheads.runs import RunDir
from lapheads.train.classify import train_classify

__all__ = ["plot_runs", "run_demo", "write_report"]


def plot_runs(runs: dict[str, RunDir], out: Path) -> list[Path]:
    """Loss and test-accuracy curves of several runs, one line per run."""
    paths = []
    for key, ylabel, name in (
        ("loss", "training loss", "loss.png"),
        ("eval_top1", "test top-1 accuracy (%)", "accuracy.png"),
    ):
        with panel_grid(out / name, 1, size=(5, 3.5), dpi=120) as (ax,):
            for label, run in runs.items():
                points = [(r["epoch"], r[key]) for r in run.read_metrics() if key in r]
                if points:
                    xs, ys = zip(*points)
                    ax.plot(xs, ys, marker="o" if key.startswith("eval") else None, label=label)
            ax.set_xlabel("epoch")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend()
        paths.append(out / name)
    return paths


#: The paper's claims the demo can look at, as (claim, summary row, the direction the paper reports: -1 falls, +1
#: rises). Read at the last block, as ``lapheads analyze`` reports them.
CLAIMS = [
    ("accuracy rises", "test top-1 (%), the run's final eval", +1),
    ("within-sequence variance falls", "within-sequence fraction", -1),
    ("between-class variance rises", "between-class fraction", +1),
    ("spectra decay faster", "components for 99%, pooled", -1),
]
#: Below this relative change a one-seed difference is called "no change" (it is not a test either way).
NO_CHANGE = 0.01


def verdict(baseline: float, laplacian: float, direction: int) -> str:
    """The direction of one seed pair against the paper's: "as claimed", "opposite" or "no change"."""
    change = laplacian - baseline
    if abs(change) <= NO_CHANGE * max(abs(baseline), 1e-12):
        return "no change"
    return "as claimed" if change * direction > 0 else "opposite"


def _claim_rows(runs: dict[str, RunDir], analyses: list[dict]) -> list[str]:
    from lapheads.analyze import SUMMARY_ROWS, _last_block

    readers = dict(SUMMARY_ROWS)
    rows = []
    for claim, metric, direction in CLAIMS:
        read = readers[metric]
        base, lap = (read(a, _last_block(a)) for a in analyses[:2])
        rows.append(
            f"| {claim} | {metric} | {base:.4g} | {lap:.4g} | {lap - base:+.4g} | {verdict(base, lap, direction)} |"
        )
    return rows


def write_report(
    runs: dict[str, RunDir],
    walls: dict[str, float],
    out: Path,
    geometry: list[Path] | None = None,
    analyses: list[dict] | None = None,
) -> Path:
    """report.md: accuracy (the runs' own final evaluations), curves, and the paper's claims with a verdict each."""
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for label, run in runs.items():
        record = run.read_config()
        evals = [r for r in run.read_metrics() if "eval_top1" in r]
        final = evals[-1] if evals else {}
        rows.append(
            f"| {label} | {final.get('eval_top1', float('nan')):.2f} | {final.get('eval_top5', float('nan')):.2f} | "
            f"{final.get('eval_loss', float('nan')):.4f} | {walls.get(label, float('nan')):.0f} | "
            f"{record['num_params']:,} | `{run.path}` |"
        )
    plots = plot_runs(runs, out)
    first = next(iter(runs.values())).read_config()["config"]
    text = "\n".join(
        [
            "# lapheads demo: Fashion-MNIST, with and without Laplacian heads",
            "",
            f"Recipe `fmnist-cpu`: {first['description']}. Same seed ({first['seed']}) for both runs.",
            "",
            "Test accuracy is each run's own evaluation of its final checkpoint (metrics.jsonl); summary.md quotes the "
            "same numbers. Wall time depends on this machine and on whatever else it ran meanwhile.",
            "",
            "| run | test top-1 (%) | test top-5 (%) | test loss | wall time (s, machine-dependent) | parameters | "
            "run directory |",
            "|---|---|---|---|---|---|---|",
            *rows,
            "",
            *[f"![{p.stem}]({p.name})" for p in plots],
            "",
            *(_claims_section(runs, analyses) if analyses and len(analyses) >= 2 else []),
            *(_geometry_section(geometry) if geometry else []),
        ]
    )
    report = out / "report.md"
    report.write_text(text)
    return report


def _claims_section(runs: dict[str, RunDir], analyses: list[dict]) -> list[str]:
    return [
        "## The paper's claims, on this one pair of runs",
        "",
        "Verdicts compare the direction of this pair with the paper's: **as claimed**, **opposite**, or **no change** "
        f"(a relative difference under {NO_CHANGE:.0%}). One seed per arm is a direction, not a test: seed-to-seed "
        "noise can be as large as these differences. For statistics run `lapheads sweep` over several seeds and "
        "`lapheads report` (docs/reproduction.md).",
        "",
        "| paper's claim | metric (last block) | baseline | Laplacian | difference | verdict (one seed) |",
        "|---|---|---|---|---|---|",
        *_claim_rows(runs, analyses),
        "",
    ]


def _geometry_section(plots: list[Path]) -> list[str]:
    return [
        "## Token geometry (lapheads analyze, test set, every layer)",
        "",
        "ANOVA of token variance and spectral decay at every layer, both runs; every metric side by side: "
        "[summary.md](summary.md).",
        "",
        *[f"![{p.stem}]({p.name})" for p in plots],
        "",
    ]


def run_demo(
    out: Path, laplacian_heads: str = "3", data_root: str | None = None, overrides: list[str] | None = None
) -> Path:
    """Train fmnist-cpu with 0 and with ``laplacian_heads`` Laplacian heads, then write the report."""
    if find_fashion_mnist(data_root) is None:
        folder, what = fetch_fashion_mnist(data_root or out / "data")
        print(f"fashion-mnist: {what}", flush=True)
        data_root = str(folder)
    runs, walls = {}, {}
    for heads in ("0", laplacian_heads):
        cfg = resolve_classify_config(
            "fmnist-cpu", heads, [*(overrides or []), *(["--data-root", data_root] if data_root else [])]
        )
        label = f"{heads} Laplacian heads" if heads != "0" else "baseline (0 Laplacian heads)"
        run_dir = out / f"fmnist-cpu-L{heads.replace(',', '_')}"
        print(f"== {label}: training into {run_dir}", flush=True)
        start = time.perf_counter()
        train_classify(cfg, run_dir, resume=RunDir(run_dir).exists())
        walls[label] = time.perf_counter() - start
        runs[label] = RunDir(run_dir)
    print("== token geometry of both runs (lapheads analyze)", flush=True)
    analyses, _ = analyze_runs([run.path for run in runs.values()], out / "report")
    geometry = [out / "report" / name for name in ("anova.png", "spectrum.png")]
    report = write_report(runs, walls, out / "report", geometry, analyses)
    (out / "report" / "walls.json").write_text(json.dumps(walls, indent=1))
    print(report.read_text())
    print(f"report: {report}")
    return report
