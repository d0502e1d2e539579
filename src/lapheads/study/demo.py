"""``lapheads demo``: the fmnist-cpu recipe with 0 and with k Laplacian heads, same seed, and a report.

The report directory holds ``report.md`` (test accuracy, wall time, parameters per run; the paper's claims with
each measure's direction on this one seed), PNG plots of the training loss (minibatches and their EMA) and the test
accuracy at every evaluation of both runs, the token geometry of both (``lapheads analyze``: ANOVA and spectrum plots
in the report, every metric in summary.md), and the geometry over training: the within-sequence and between-class
fractions after the final norm at every kept checkpoint of both runs, with a paragraph that places a one-epoch pair
against the converged, pre-registered studies (docs/reproduction.md). Everything is read back from the two run
directories, the contract between training and reporting.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from pathlib import Path

from lapheads.data.images import fetch_fashion_mnist, find_fashion_mnist
from lapheads.evals.geometry import AnalyzeOptions
from lapheads.io import json_loads
from lapheads.plots import panel_grid
from lapheads.runs import RunDir, checkpoint_steps, spec_dir_name
from lapheads.runs.layout import report_folder
from lapheads.study.analyze import analyze_run, analyze_runs
from lapheads.tasks.metrics import claim
from lapheads.tasks.presets import resolve_classify_config
from lapheads.train.classify import train_classify

log = logging.getLogger(__name__)

__all__ = [
    "accuracy_direction",
    "agreement_counts",
    "geometry_over_training",
    "measure_direction",
    "plot_runs",
    "run_demo",
    "write_report",
]


def _ema(values: list[float], decay: float = 0.9) -> list[float]:
    """Exponential moving average, debiased from the first value on (as TensorBoard's smoothing)."""
    out, mean, weight = [], 0.0, 0.0
    for value in values:
        mean, weight = decay * mean + (1 - decay) * value, decay * weight + (1 - decay)
        out.append(mean / weight)
    return out


def plot_runs(runs: dict[str, RunDir], out: Path) -> list[Path]:
    """Training loss (each logged minibatch faint, its EMA solid) and test accuracy at every evaluation (marked
    points), one colour per run, each plot with its title, axis labels and legend."""
    paths = []
    for key, ylabel, name, title in (
        ("loss", "training loss (one minibatch)", "loss.png", "Training loss: logged minibatches (faint), EMA 0.9"),
        ("eval_top1", "test top-1 accuracy (%)", "accuracy.png", "Test accuracy at each evaluation"),
    ):
        with panel_grid(out / name, 1, size=(5.5, 3.8), dpi=120) as (ax,):
            for label, run in runs.items():
                points = [(r["epoch"], r[key]) for r in run.read_metrics() if key in r]
                if not points:
                    continue
                xs, ys = zip(*points)
                if key == "loss":
                    (line,) = ax.plot(xs, ys, alpha=0.25, linewidth=0.8)
                    ax.plot(xs, _ema(list(ys)), color=line.get_color(), label=f"{label} (EMA)")
                else:
                    ax.plot(xs, ys, marker="o", label=label)
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("epoch")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        paths.append(out / name)
    return paths


#: The paper's claims the demo can look at: (claim, the summary rows that measure it); the direction the paper
#: reports is each row's (``tasks.metrics.claim``). A geometry claim is read at the last block and after the final
#: norm; spectra both pooled and per sequence. One seed per arm gives a direction and its size, never a verdict:
#: "the paper's way" / "the other way" for each measure, and for a claim how many of its measures went which way.
CLAIMS = [
    ("within-sequence variance falls", ("within-sequence fraction",)),
    ("between-class variance rises", ("between-class fraction",)),
    ("spectra decay faster", ("components for 99%, pooled", "components for 99%, per sequence")),
]

PAPERS_WAY, OTHER_WAY, NO_CHANGE = "the paper's way", "the other way", "no change"


def accuracy_direction(baseline: float, laplacian: float, num_images: int) -> tuple[str, float]:
    """(direction, the noise band) of a top-1 difference between two runs scored on the same ``num_images``:
    "within test-set noise" inside two standard errors of a difference of two binomial proportions (an upper bound
    for paired scores), else "higher" or "lower", beyond that noise. Seed-to-seed noise is not in the band: a
    direction, not a test."""
    p = max(min((baseline + laplacian) / 200.0, 1.0), 0.0)
    band = 2 * 100.0 * (2 * p * (1 - p) / max(num_images, 1)) ** 0.5
    change = laplacian - baseline
    if abs(change) <= band:
        return "within test-set noise", band
    return ("higher" if change > 0 else "lower"), band


def measure_direction(change: float, direction: int) -> str:
    """Which way one measure moved against the paper's ``direction`` (+1 rises, -1 falls)."""
    sign = (change > 0) - (change < 0)
    return NO_CHANGE if sign == 0 else PAPERS_WAY if sign == direction else OTHER_WAY


def agreement_counts(changes: list[float], direction: int) -> str:
    """A claim's measures counted by direction: "4 of 4 the paper's way", "1 of 2 the paper's way, 1 the other"."""
    ways = [measure_direction(c, direction) for c in changes]
    words = f"{ways.count(PAPERS_WAY)} of {len(ways)} the paper's way"
    if ways.count(OTHER_WAY):
        words += f", {ways.count(OTHER_WAY)} the other way"
    return words + (f", {ways.count(NO_CHANGE)} unchanged" if ways.count(NO_CHANGE) else "")


def _claim_rows(runs: dict[str, RunDir], analyses: list[dict]) -> list[str]:
    from lapheads.study.analyze import SUMMARY_ROWS, last_block

    readers = dict(SUMMARY_ROWS)
    rows = []
    lap_run = list(runs.values())[1]
    evals = [r for r in lap_run.read_metrics() if "eval_top1" in r]
    base_evals = [r for r in list(runs.values())[0].read_metrics() if "eval_top1" in r]
    if evals and base_evals:
        base, lap = base_evals[-1]["eval_top1"], evals[-1]["eval_top1"]
        images = int(evals[-1].get("eval_count", 0) or _eval_images(lap_run))
        words, band = accuracy_direction(base, lap, images)
        rows.append(
            f"| accuracy rises | test top-1 (%), {images:,} images | {base:.2f} | {lap:.2f} | {lap - base:+.2f} | "
            f"{words} (±{band:.2f}) |"
        )
    for words, metrics in CLAIMS:
        direction = claim(metrics[0])
        measured = []
        for metric in metrics:
            for place, layer_of in (("last block", last_block), ("after the final norm", lambda a: "norm")):
                try:
                    base, lap = (float(readers[metric](a, layer_of(a))) for a in analyses[:2])
                except (KeyError, TypeError):
                    continue
                if not (math.isnan(base) or math.isnan(lap)):
                    measured.append((f"{metric}, {place}", base, lap))
        counts = agreement_counts([lap - base for _, base, lap in measured], direction)
        for i, (measure, base, lap) in enumerate(measured):
            first = f"{words} ({counts})" if i == 0 else ""
            rows.append(
                f"| {first} | {measure} | {base:.4g} | {lap:.4g} | {lap - base:+.4g} | "
                f"{measure_direction(lap - base, direction)} |"
            )
    return rows


def _eval_images(run: RunDir) -> int:
    cfg = run.settings()
    return int(cfg.eval_subset) if getattr(cfg, "eval_subset", None) else 10_000


def _heads_words(masks: list[list[bool]]) -> str:
    """[[F, T, T]] * 6 -> '2 of 3 heads Laplacian in every block'; all True adds ': every head'."""
    counts, heads = [sum(m) for m in masks], len(masks[0]) if masks else 0
    if len(set(counts)) > 1:
        return f"per block {','.join(map(str, counts))} of {heads} heads Laplacian"
    k = counts[0] if counts else 0
    return f"{k} of {heads} heads Laplacian in every block" + (": every head" if k == heads and k else "")


def _recipe_line(runs: dict[str, RunDir], walls: dict[str, float], reused: bool = False) -> str:
    """What was run, from the stored configs (not a preset's prose): model, data, schedule, precision, wall time."""
    record = next(iter(runs.values())).read_config()
    cfg = record["config"]
    precision = (record.get("precision") or {}).get("reason", "bf16 autocast" if cfg.get("amp") is True else "fp32")
    threads = record.get("threads")
    masks = list(runs.values())[1].read_config().get("laplacian_masks") or [[]]
    minutes = sum(walls.values()) / 60
    epochs = f"{cfg['epochs']:g} epoch{'' if cfg['epochs'] == 1 else 's'}"
    patch = (cfg.get("model_kwargs") or {}).get("patch_size")
    model = cfg["model"] if patch is None else f"{cfg['model']} built with patch {patch} (model_kwargs)"
    return (
        f"Recipe `{record.get('preset') or 'fmnist-cpu'}` as run: {model} on {cfg['dataset']} "
        f"{cfg['img_size']} px, {epochs} of batch {cfg['batch_size']} ({record.get('steps', '?')} "
        f"steps a run), AdamW lr {cfg['lr']:g}, seed {cfg['seed']} for both runs; Laplacian run: "
        f"{_heads_words(masks)}; precision: {precision}; threads: {threads} (the CPUs left free when the run "
        "started: another count changes the rounding, so the same command on a busier or idler machine gives other "
        f"numbers); both runs trained in {minutes:.1f} minutes on this machine"
        + (" (the first time they ran: a rerun reuses them)." if reused else ".")
    )


def write_report(
    runs: dict[str, RunDir],
    walls: dict[str, float],
    out: Path,
    geometry: list[Path] | None = None,
    analyses: list[dict] | None = None,
    over_training: Path | None = None,
    reused: bool = False,
) -> Path:
    """report.md: accuracy (the runs' own final evaluations), curves, and the paper's claims with a verdict each;
    ``reused``: the runs were trained by an earlier demo (their wall times are that one's)."""
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
    text = "\n".join(
        [
            "# lapheads demo: Fashion-MNIST, with and without Laplacian heads",
            "",
            _recipe_line(runs, walls, reused),
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
            *(_over_training_section(over_training) if over_training else []),
        ]
    )
    report = out / "report.md"
    report.write_text(text)
    return report


def _claims_section(runs: dict[str, RunDir], analyses: list[dict]) -> list[str]:
    return [
        "## The paper's claims, on this one pair of runs: directions, not verdicts",
        "",
        "One seed per arm shows which way each measure moved and by how much; seed-to-seed noise can be as large as "
        "these differences, so nothing here is a test. Accuracy: higher / lower beyond two standard errors of the "
        "test set's binomial noise (± in the row), else within it. Geometry: each claim at the last block and after "
        "the final norm (spectra pooled and per sequence), each measure the paper's way or the other way. For "
        "verdicts run `lapheads sweep` over several seeds and `lapheads report` (docs/reproduction.md).",
        "",
        "| paper's claim | measure | baseline | Laplacian | difference | direction (one seed) |",
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


def _over_training_section(plot: Path) -> list[str]:
    return [
        "## Geometry over training, and what one epoch can show",
        "",
        "The within-sequence fraction (how much of the token variance lies within an image rather than between "
        "images) and the between-class fraction after the final norm, at every checkpoint both runs kept (the first "
        "is the weights as built, before any step), on a fixed subset of test tokens (over_training.json holds the "
        "numbers). A Laplacian head starts as a high-pass filter on its attention graph (V - PV keeps what differs "
        "from the neighbours), so early in training it tends to keep tokens apart; where each run starts and "
        "whether the runs cross later is what the curves show. One epoch of one seed is "
        "early and noisy: the claims the paper makes are about trained models, and docs/reproduction.md tests them "
        "in pre-registered studies that train to convergence over several seeds and pair arms by seed (its "
        "decomposition study: the fraction after the final norm with 0 to 3 Laplacian heads of 3). Where this pair "
        "and those studies disagree, the studies are the answer; this figure shows where on the way a one-epoch "
        "pair stands.",
        "",
        f"![geometry over training]({plot.name})",
        "",
        *_against_the_study(plot.with_name("over_training.json")),
    ]


#: the converged, pre-registered study the demo's pair is read against (in a checkout of the repository)
DECOMPOSITION_STATS = Path(__file__).resolve().parents[3] / "docs/reproduction/decomposition/cells/report/stats.json"
FRACTION_ROW = "within-sequence fraction (after the final norm)"


def _against_the_study(series_file: Path) -> list[str]:
    """This pair's last within-sequence fraction after the final norm (Laplacian - baseline) beside the
    decomposition study's paired mean for the same number of Laplacian heads, both in numbers, and whether their
    signs agree; where the study's stats.json is not here (an installed package), where to read it."""
    series = json.loads(series_file.read_text())
    (_, base), (label, arm) = list(series.items())[:2]
    change = arm[FRACTION_ROW.split(" (")[0]][-1] - base[FRACTION_ROW.split(" (")[0]][-1]
    heads = re.match(r"(\d+) of", label)
    here = f"This pair at its last checkpoint: {change:+.3f} (Laplacian minus baseline, one seed, one epoch)."
    if not DECOMPOSITION_STATS.is_file() or heads is None:
        return [here + " The converged study's number: docs/reproduction.md, the decomposition study.", ""]
    row = json.loads(DECOMPOSITION_STATS.read_text())["geometry"].get(FRACTION_ROW, {}).get(heads.group(1))
    if not row or "paired" not in row:
        return [here + f" The decomposition study has no arm with {heads.group(1)} Laplacian heads to set it by.", ""]
    paired = row["paired"]
    agree = "agree" if (change > 0) == (paired["mean_difference"] > 0) else "differ"  # no verdict words: one seed
    return [
        f"{here} The decomposition study, converged, {paired['n_pairs']} seeds paired, {heads.group(1)} Laplacian "
        f"heads per block: {paired['mean_difference']:+.3f} [{paired['ci_low']:+.3f}, {paired['ci_high']:+.3f}]. "
        f"The signs {agree}; the study is the answer.",
        "",
    ]


#: the geometry-over-training figure's measurements: after the final norm only, on a fixed subset of the test
#: tokens (seconds a checkpoint), at every checkpoint the demo keeps (:data:`DEMO_OVERRIDES`)
OVER_TRAINING = AnalyzeOptions(layers="norm", max_tokens=65_536)


def geometry_over_training(runs: dict[str, RunDir], out: Path) -> Path:
    """over_training.png and .json in ``out``: the within-sequence and between-class fractions after the final norm
    at every kept checkpoint of each run, against epoch."""
    import dataclasses

    series: dict[str, dict[str, list[float]]] = {}
    for label, run in runs.items():
        record = run.read_config()
        per_epoch = max(1, int(record.get("steps") or 1) / float(record["config"]["epochs"]))
        steps = checkpoint_steps(run)
        rows = [analyze_run(run.path, dataclasses.replace(OVER_TRAINING, step=s))["per_layer"]["norm"] for s in steps]
        series[label] = {
            "epoch": [s / per_epoch for s in steps],
            "within-sequence fraction": [row["anova"]["within_seq_fraction"] for row in rows],
            "between-class fraction": [row["anova"]["between_class_fraction"] for row in rows],
        }
    (out / "over_training.json").write_text(json.dumps(series, indent=1) + "\n")
    path = out / "over_training.png"
    names = ("within-sequence fraction", "between-class fraction")
    with panel_grid(path, 2, size=(4.6, 3.4), dpi=120, title="After the final norm, over training") as axes:
        for ax, name in zip(axes, names):
            for label, values in series.items():
                ax.plot(values["epoch"], values[name], marker="o", markersize=3, label=label)
            ax.set_title(name, fontsize=10)
            ax.set_xlabel("epoch")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)
    return path


#: The demo's runs are fmnist-cpu for one epoch (468 steps), to keep the demo within the time README.md states
#: (measured there); ``--epochs 2`` restores the preset's length. A checkpoint is kept each eighth of an epoch
#: (58 steps) and of the weights as built (step 0), for the geometry over training from its start.
DEMO_OVERRIDES = ["--epochs", "1", "--keep-checkpoints", "0", "--checkpoint-every", "58",
                  "--checkpoint-at-start", "true"]  # fmt: skip


def run_demo(
    out: Path, laplacian_heads: str = "3", data_root: str | None = None, overrides: list[str] | None = None
) -> Path:
    """Train fmnist-cpu (one epoch, :data:`DEMO_OVERRIDES`) with 0 and with ``laplacian_heads`` Laplacian heads,
    then write the report."""
    if find_fashion_mnist(data_root) is None:
        folder, what = fetch_fashion_mnist(data_root or out / "data")
        log.info(f"fashion-mnist: {what}")
        data_root = str(folder)
    runs, walls = {}, {}
    saved = report_folder(out) / "walls.json"  # a rerun resumes finished runs in a second: keep their first times
    first = json_loads(saved.read_text()) if saved.is_file() else {}
    for number, heads in enumerate(("0", laplacian_heads)):
        cfg = resolve_classify_config(
            "fmnist-cpu",
            heads,
            [*DEMO_OVERRIDES, *(overrides or []), *(["--data-root", data_root] if data_root else [])],
        )
        run_dir = out / f"fmnist-cpu-{spec_dir_name(heads)}"
        log.info(f"== {'baseline' if heads == '0' else f'--laplacian-heads {heads}'}: training into {run_dir}")
        start = time.perf_counter()
        train_classify(cfg, run_dir, resume=RunDir(run_dir).exists(), preset="fmnist-cpu")
        masks = RunDir(run_dir).read_config().get("laplacian_masks") or [[]]
        label = "baseline (no Laplacian head)" if heads == "0" else _heads_words(masks)  # "3 of 3 heads ..."
        walls[label] = time.perf_counter() - start
        if isinstance(first.get(label), (int, float)) and first[label] > walls[label]:
            walls[label] = first[label]  # this run was reused: its wall time is the one it trained in
        runs[label] = RunDir(run_dir)
        if number == 0:  # the expected time from this machine's own pace, not a constant
            log.info(
                f"== the first run took {walls[label] / 60:.1f} min here; expect about as long again for the second, "
                "then the geometry of both runs at every kept checkpoint"
            )
    log.info("== token geometry of both runs (lapheads analyze)")
    analyses, _ = analyze_runs([run.path for run in runs.values()], report_folder(out))
    geometry = [report_folder(out) / name for name in ("anova.png", "spectrum.png")]
    log.info("== the geometry over training of both runs (after the final norm, every kept checkpoint)")
    over_training = geometry_over_training(runs, report_folder(out))
    report = write_report(runs, walls, report_folder(out), geometry, analyses, over_training, reused=bool(first))
    (report_folder(out) / "walls.json").write_text(json.dumps(walls, indent=1))
    return report
