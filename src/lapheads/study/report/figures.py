"""The figures of a sweep report: a metric against spec, the paired gap and the diffusion scores against step."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

from lapheads.plots import panel_grid
from lapheads.study.comparison import Comparison


def _spec_order(spec: str) -> tuple[int, int, str]:
    """k values in numeric order, then per-layer specs as written."""
    return (0, int(spec), "") if spec.isdigit() else (1, 0, spec)


def plot_steps(panels: dict[str, dict[str, list[dict]]], path: Path, ylabel: str, legend: Callable[[str], str]) -> Path:
    """One panel per entry: each spec's ``paired_test`` rows against step, the mean with its 95% interval."""
    specs = sorted({spec for rows_by_spec in panels.values() for spec in rows_by_spec}, key=_spec_order)
    color = {spec: f"C{i}" for i, spec in enumerate(specs)}  # one colour per spec in every panel
    with panel_grid(path, len(panels), cols=2, size=(5.0, 3.4)) as axes:
        for ax, (title, rows_by_spec) in zip(axes, panels.items()):
            if not any(rows_by_spec.values()):  # nothing measured here: say so, no empty axes or legend
                ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes, color="gray")
                ax.set_xticks([])
                ax.set_yticks([])
                ax.set_title(title, fontsize=9)
                continue
            for spec, rows in rows_by_spec.items():
                if not rows:  # a spec without points gets no legend entry
                    continue
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


def _spec_axis(specs: list[str]) -> tuple[list[float], list[str]]:
    if all(s.isdigit() for s in specs):
        return [float(s) for s in specs], specs
    return list(range(len(specs))), specs


def plot_metric(panels: dict[str, dict[str, Comparison]], specs: list[str], path: Path) -> Path:
    xs, labels = _spec_axis(specs)
    with panel_grid(path, len(panels)) as axes:
        for ax, (title, stats) in zip(axes, panels.items()):
            means = [stats[s].mean for s in specs]
            stds = [0.0 if math.isnan(stats[s].std) else stats[s].std for s in specs]
            ax.errorbar(xs, means, yerr=stds, marker="o", capsize=4)
            for x, s in zip(xs, specs):
                seeds = list(stats[s].values.values())
                ax.scatter([x] * len(seeds), seeds, s=10, alpha=0.5, color="gray")
            ax.set_xticks(xs, labels)
            ax.set_xlabel("Laplacian heads per layer")
            ax.set_title(title, fontsize=9)
            ax.grid(alpha=0.3)
    return path
