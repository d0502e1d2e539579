"""``lapheads analyze``: every geometry metric that applies to a run, per layer, side by side across runs.

Design choices:

* **Run directories are the input.** The model is rebuilt from config.json and the latest checkpoint; the data is
  the run's evaluation split with evaluation transforms. Nothing else about the training is assumed.
* **Streaming.** Each batch's residual stream is captured by hooks, fed to the accumulators of every layer and
  dropped; only per-sequence means (N_seq x D per layer, float32) are kept, for the nearest-class-centre test.
* **A fixed random subset.** ``max_tokens`` caps the tokens per layer; the sequences are a seeded random subset of
  the split (evaluation sets are often sorted by class, so the first N would miss classes).
* **All tokens.** Prefix tokens (CLS) count as tokens of their sequence, as in the paper's token-level analyses.
* **Cached per run.** Each run's numbers go to RUN_DIR/report/analysis.json and are reused while the checkpoint
  and options are unchanged; the comparison (plots, summary.md) goes to ``out``.

Per task: classify runs get ANOVA, Neural Collapse on sequence means and on tokens (and on the classifier's input,
with nc3/nc4), spectra and token similarity; lm runs get spectra, token similarity and linguistic collapse (CDNV
and NC1 with the K most frequent next tokens as classes) on validation windows; dino runs get the supervised set
without the classifier rows (the teacher backbone, with the dataset's labels as classes).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from lapheads.errors import InputError
from lapheads.evals.geometry import AnalyzeOptions, lm_geometry
from lapheads.plots import panel_grid
from lapheads.runs import RunDir, checkpoint_folder, checkpoint_steps
from lapheads.runs.layout import ANALYSIS_FILE, analysis_file
from lapheads.tasks import get_task

__all__ = ["analyze_nanochat", "analyze_over_training", "analyze_run", "analyze_runs", "plot_analyses", "write_summary"]


def analyze_nanochat(
    folder: str | os.PathLike,
    options: AnalyzeOptions | None = None,
    *,
    step: int | None = None,
    tokenizer_dir: str | os.PathLike | None = None,
    data_root: str = "data",
    out: str | os.PathLike | None = None,
) -> tuple[list[dict[str, Any]], Path]:
    """The geometry of a nanochat checkpoint on held-out text: the Shakespeare plays lapheads holds out (every
    10th), tokenised with the checkpoint's own tokenizer, each play after BOS. Writes analysis.json, the plots and
    summary.md into ``out`` (default: runs/nanochat-<tag>-step<N>/report)."""
    import numpy as np

    from lapheads.data.text import shakespeare_plays
    from lapheads.evals.lm import load_lm

    options = options or AnalyzeOptions()
    if options.ema:
        raise InputError("--ema: a nanochat checkpoint holds one set of weights")
    lm = load_lm(nanochat=folder, step=step, tokenizer_dir=tokenizer_dir, device=options.device)
    held_out = [text for i, (_, text) in enumerate(shakespeare_plays(data_root)) if i % 10 == 9]
    tokens = np.concatenate([np.asarray(ids, dtype=np.int64) for ids in lm.tokenizer.encode_batch(held_out, bos=True)])
    config = lm.model.config
    analysis = {
        "run_dir": str(folder),
        "options": options.cache_key(),
        "checkpoint": lm.name,
        "laplacian_heads": config.laplacian_heads,
        "seed": None,
        "dataset": "shakespeare (held out)",
        **lm_geometry(lm.model, tokens, config.sequence_len, options, lm.name),
    }
    out = Path(out) if out is not None else lm.report_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / ANALYSIS_FILE).write_text(json.dumps([analysis]) + "\n")
    return [analysis], write_summary([analysis], out, plot_analyses([analysis], out))


def analyze_run(
    run_dir: str | os.PathLike, options: AnalyzeOptions | None = None, force: bool = False
) -> dict[str, Any]:
    """Measure one run directory at its latest checkpoint, or at ``options.step`` (or reuse the cached
    RUN_DIR/report/analysis.json, analysis-step-<N>.json); returns the analysis."""
    options = options or AnalyzeOptions()
    run = RunDir(run_dir)
    task = get_task(run.task())
    name = analysis_file(options.step)
    folder = checkpoint_folder(run, options.step)
    cached = None if force else run.read_report(name)
    if cached and cached.get("options") == options.cache_key() and cached.get("checkpoint") == folder.name:
        return cached
    result = {"run_dir": str(run.path), "options": options.cache_key(), **task.analyze(run, options)}
    run.write_report(name, result)
    return result


def analyze_over_training(
    run_dir: str | os.PathLike, options: AnalyzeOptions | None = None, out: str | os.PathLike | None = None
) -> Path:
    """Geometry and the heads' diffusion scores at every checkpoint a run kept (``--keep-checkpoints 0`` keeps all),
    against step: RUN_DIR/report/over_training.{json,png} (or ``out``); each step's analysis is cached."""
    import dataclasses

    options = options or AnalyzeOptions()
    run = RunDir(run_dir)
    steps = checkpoint_steps(run)
    if not steps:
        raise InputError(f"{run.path} has no checkpoint yet; analyze needs a trained run")
    analyses = [analyze_run(run_dir, dataclasses.replace(options, step=s)) for s in steps]
    task = _task(analyses)
    readers = dict([*SUMMARY_ROWS, *LM_ROWS])
    series = {}
    for title in get_task(task).over_training:
        values = []
        for analysis in analyses:
            try:
                values.append(float(readers[title](analysis, _summary_layer(analysis))))
            except (KeyError, TypeError):
                values.append(math.nan)
        series[title] = values
    per_block = _mechanism_per_block(analyses)
    out = Path(out) if out is not None else run.report_dir
    out.mkdir(parents=True, exist_ok=True)
    record = {"steps": steps, "layer": _summary_layer(analyses[-1]), "series": series, "per_block": per_block}
    (out / "over_training.json").write_text(json.dumps(record, indent=1) + "\n")
    path = out / "over_training.png"
    title = f"{run.path.name}: {_summary_layer(analyses[-1])} layer over training; diffusion scores per block"
    panels = len(series) + len(per_block)
    with panel_grid(path, panels, cols=3, size=(3.6, 3.0), title=title) as axes:
        for ax, (name, values) in zip(axes, series.items()):
            ax.plot(steps, values, marker="o", markersize=3)
            ax.set_title(name, fontsize=9)
        for ax, (name, blocks) in zip(axes[len(series) :], per_block.items()):
            for block, values in blocks.items():
                ax.plot(steps, values, marker="o", markersize=3, label=f"block {block}")
            ax.axhline(0.0, color="black", linewidth=0.8)
            ax.set_title(f"{name}, per block", fontsize=9)
            ax.legend(fontsize=7)
        for ax in axes:
            ax.set_xlabel("step", fontsize=8)
            ax.grid(alpha=0.3)
    return path


def _mechanism_per_block(analyses: list[dict[str, Any]]) -> dict[str, dict[str, list[float]]]:
    """{"diffusion score, Laplacian heads" / "... ordinary heads": {block: [mean score at each step]}} for the
    blocks that have heads of that kind (a per-layer schedule leaves some blocks without Laplacian heads)."""
    kinds = {
        "diffusion score, Laplacian heads": "laplacian_diffusion",
        "diffusion score, ordinary heads": "ordinary_diffusion",
    }
    blocks = [name for name in analyses[-1]["per_layer"] if name.isdigit()]
    out: dict[str, dict[str, list[float]]] = {}
    for title, key in kinds.items():
        by_block = {}
        for block in blocks:
            values = [(a["per_layer"].get(block, {}).get("mechanism") or {}).get(key) for a in analyses]
            if any(v is not None for v in values):
                by_block[block] = [math.nan if v is None else float(v) for v in values]
        if by_block:
            out[title] = by_block
    return out


def _labels(analyses: list[dict[str, Any]]) -> list[str]:
    """A legend label per run: its Laplacian spec, plus the seed or folder when specs repeat."""
    labels = [f"k={a['laplacian_heads']}" for a in analyses]
    if len(set(labels)) < len(labels):
        labels = [f"{label} seed {a.get('seed')}" for label, a in zip(labels, analyses)]
    if len(set(labels)) < len(labels):
        labels = [f"{label} ({Path(a['run_dir']).name})" for label, a in zip(labels, analyses)]
    return labels


# (group, key, title, log scale) of every scalar plotted against layer, per task and figure
PLOTS: dict[str, list[tuple[str, str, str, bool]]] = {
    "anova": [
        ("anova", "within_seq_fraction", "within-sequence fraction", False),
        ("anova", "between_seq_fraction", "between-sequence (within class) fraction", False),
        ("anova", "between_class_fraction", "between-class fraction", False),
    ],
    "collapse": [
        ("collapse_seq", "nc1", "NC1, sequence means", True),
        ("collapse_tokens", "nc1", "NC1, tokens", True),
        ("collapse_seq", "etf_distance", "distance to simplex ETF, sequence means", False),
        ("collapse_seq", "equinorm", "equinorm, sequence means", False),
        ("collapse_seq", "nc4", "NC4: NCC agrees with network, sequence means", False),
        ("collapse_seq", "ncc_accuracy", "NCC accuracy, sequence means", False),
    ],
    "spectrum": [
        ("spectrum", "n_components", "components for 99% variance, pooled", False),
        ("spectrum", "n_components_per_seq", "components for 99% variance, per sequence", False),
    ],
    "similarity": [("similarity", "", "mean pairwise cosine of tokens", False)],
    "linguistic": [
        ("linguistic", "cdnv", "CDNV, top-K next-token classes", True),
        ("linguistic", "nc1", "NC1, top-K next-token classes", True),
    ],
    "mechanism": [
        ("mechanism", "laplacian_diffusion", "diffusion score, Laplacian heads (mean)", False),
        ("mechanism", "ordinary_diffusion", "diffusion score, ordinary heads (mean)", False),
    ],
}


def _value(layer: dict[str, Any], group: str, key: str) -> float:
    value = layer.get(group, math.nan)
    value = value.get(key, math.nan) if isinstance(value, dict) else value
    return math.nan if value is None else value


def plot_analyses(analyses: list[dict[str, Any]], out: Path) -> list[Path]:
    """One PNG per metric group: each metric against layer, one line per run; spectrum.png adds the spectra."""
    labels = _labels(analyses)
    paths = []
    for name in get_task(_task(analyses)).figures:
        panels = PLOTS[name]
        extra = 1 if name == "spectrum" else 0
        path = out / f"{name}.png"
        with panel_grid(path, len(panels) + extra) as axes:
            for ax, (group, key, title, log) in zip(axes, panels):
                for label, analysis in zip(labels, analyses):
                    layers = analysis["layers"]
                    values = [_value(analysis["per_layer"][n], group, key) for n in layers]
                    ax.plot(range(len(layers)), values, marker="o", markersize=3, label=label)
                    ax.set_xticks(range(len(layers)), layers, fontsize=7)
                ax.set_title(title, fontsize=9)
                ax.set_xlabel("layer", fontsize=8)
                if log:
                    ax.set_yscale("log")
                ax.grid(alpha=0.3)
            if extra:
                ax = axes[len(panels)]
                for label, analysis in zip(labels, analyses):
                    eigenvalues = analysis["per_layer"][last_block(analysis)]["spectrum"]["eigenvalues"]
                    ax.semilogy(range(1, len(eigenvalues) + 1), eigenvalues,
                                label=f"{label} (layer {last_block(analysis)})")  # fmt: skip
                ax.set_title("normalised eigenvalues, last block", fontsize=9)
                ax.set_xlabel("component", fontsize=8)
                ax.grid(alpha=0.3)
            axes[0].legend(fontsize=7)
        paths.append(path)
    return paths


def _task(analyses: list[dict[str, Any]]) -> str:
    tasks = sorted({a["task"] for a in analyses})
    if len(tasks) > 1:
        raise InputError(f"analyze compares runs of one task; got {', '.join(tasks)}")
    return tasks[0]


def last_block(analysis: dict[str, Any]) -> str:
    blocks = [n for n in analysis["layers"] if n.isdigit()]
    return blocks[-1] if blocks else analysis["layers"][-1]


# The heads' diffusion scores stay in analysis.json and the over-training plot, not in summary.md: docs/reproduction.md
# withdraws them as a reading of the mechanism (they omit LayerScale and P), and a summary states what holds.
_SHARED_ROWS = [
    ("components for 99%, pooled", lambda a, layer: a["per_layer"][layer]["spectrum"]["n_components"]),
    ("components for 99%, per sequence", lambda a, layer: a["per_layer"][layer]["spectrum"]["n_components_per_seq"]),
    ("token cosine similarity", lambda a, layer: a["per_layer"][layer]["similarity"]),
]
LM_ROWS = [
    ("next-token loss (nats)", lambda a, layer: a["next_token_loss"]),
    ("CDNV, top-K next tokens", lambda a, layer: a["per_layer"][layer]["linguistic"]["cdnv"]),
    ("NC1, top-K next tokens", lambda a, layer: a["per_layer"][layer]["linguistic"]["nc1"]),
    # each window one class; an analysis before version 6 has none (nan)
    ("within-sequence fraction", lambda a, layer: _value(a["per_layer"][layer], "anova", "within_seq_fraction")),
    *_SHARED_ROWS,
]


def _run_eval_top1(analysis: dict[str, Any]) -> float:
    """The run's own final test top-1 (metrics.jsonl): the one accuracy every report quotes for a checkpoint."""
    value = RunDir(analysis["run_dir"]).last_metric("eval_top1")
    return math.nan if value is None else value


SUMMARY_ROWS = [
    ("test top-1 (%), the run's final eval", lambda a, layer: _run_eval_top1(a)),
    ("within-sequence fraction", lambda a, layer: a["per_layer"][layer]["anova"]["within_seq_fraction"]),
    ("between-sequence fraction", lambda a, layer: a["per_layer"][layer]["anova"]["between_seq_fraction"]),
    ("between-class fraction", lambda a, layer: a["per_layer"][layer]["anova"]["between_class_fraction"]),
    (
        "within / between-class variance",
        lambda a, layer: _value(a["per_layer"][layer], "anova", "within_to_between_class"),
    ),
    ("within-sequence variance / mean |h|^2", lambda a, layer: a["per_layer"][layer]["anova"]["within_seq_scale_free"]),
    ("NC1, sequence means", lambda a, layer: a["per_layer"][layer]["collapse_seq"]["nc1"]),
    ("NC1, tokens", lambda a, layer: a["per_layer"][layer]["collapse_tokens"]["nc1"]),
    ("ETF distance, sequence means", lambda a, layer: a["per_layer"][layer]["collapse_seq"]["etf_distance"]),
    ("equinorm, sequence means", lambda a, layer: a["per_layer"][layer]["collapse_seq"]["equinorm"]),
    ("NC4, sequence means", lambda a, layer: a["per_layer"][layer]["collapse_seq"]["nc4"]),
    *_SHARED_ROWS,
    ("NC1, classifier input", lambda a, layer: a["head_input"]["nc1"]),
    ("NC3, classifier input", lambda a, layer: a["head_input"]["nc3"]),
    ("NC4, classifier input", lambda a, layer: a["head_input"]["nc4"]),
]

# DINO runs have no classifier: no accuracy, no NC4, no classifier-input rows
DINO_ROWS = [row for row in SUMMARY_ROWS[1:-3] if not row[0].startswith("NC4")]


def _summary_layer(analysis: dict[str, Any]) -> str:
    """Where summary.md reads each run: LMs at the LM head's input (after the final norm, where linguistic-collapse
    studies measure), other models at the last block (before the final norm)."""
    if analysis.get("task") == "lm" and "norm" in analysis["layers"]:
        return "norm"
    return last_block(analysis)


def write_summary(analyses: list[dict[str, Any]], out: Path, plots: list[Path]) -> Path:
    """summary.md: the metrics of each run side by side (at ``_summary_layer``), and the plots."""
    labels = _labels(analyses)
    where = (
        "after the final norm (the LM head's input)"
        if _summary_layer(analyses[0]) == "norm"
        else "at the last block (before the final norm)"
    )
    lines = [
        "# Token geometry, side by side",
        "",
        f"Metrics {where}; classifier-input rows (vision) use the head's input; "
        "LM classes are the K most frequent next tokens. Definitions: docs/geometry.md. Per-layer numbers: each "
        "run's report/analysis.json.",
        "",
        "| metric | " + " | ".join(labels) + " |",
        "|---|" + "---|" * len(labels),
    ]
    rows = {"lm": LM_ROWS, "dino": DINO_ROWS}.get(_task(analyses), SUMMARY_ROWS)
    for title, read in rows:
        cells = []
        for analysis in analyses:
            try:
                value = read(analysis, _summary_layer(analysis))
            except KeyError:
                value = math.nan
            cells.append("n/a" if math.isnan(value) else f"{value:.4g}")  # e.g. an accuracy an LM has not
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    lines += ["", "| run | directory | checkpoint | sequences x tokens |", "|---|---|---|---|"]
    lines += [
        f"| {label} | `{a['run_dir']}` | {a['checkpoint']} | {a['num_sequences']} x {a['tokens_per_sequence']} |"
        for label, a in zip(labels, analyses)
    ]
    lines += ["", *[f"![{p.stem}]({p.name})" for p in plots], ""]
    path = out / "summary.md"
    path.write_text("\n".join(lines))
    return path


def analyze_runs(
    run_dirs: list[str | os.PathLike],
    out: str | os.PathLike | None = None,
    options: AnalyzeOptions | None = None,
    force: bool = False,
) -> tuple[list[dict[str, Any]], Path]:
    """Analyse several runs and write analysis.json (all runs), the plots and summary.md into ``out``.

    ``out`` defaults to RUN_DIR/report for one run and to <common parent>/analysis for several.
    """
    if not run_dirs:
        raise InputError("analyze needs at least one RUN_DIR")
    analyses = [analyze_run(path, options, force=force) for path in run_dirs]
    if out is None:
        out = (
            RunDir(run_dirs[0]).report_dir
            if len(run_dirs) == 1
            else Path(os.path.commonpath([Path(p).resolve() for p in run_dirs])) / "analysis"
        )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if len(run_dirs) > 1:
        (out / ANALYSIS_FILE).write_text(json.dumps(analyses) + "\n")
    plots = plot_analyses(analyses, out)
    return analyses, write_summary(analyses, out, plots)
