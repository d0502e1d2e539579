"""A learned head assignment: what each ``mix`` head (a V + b P V, learnable a and b) became.

Train a model whose heads are all ``mix`` (``--laplacian-heads mix``): each starts as an ordinary head (a = 0,
b = 1) and may move anywhere in the (a, b) plane, whose named points are the kinds the paper and its ablations
talk about. :func:`mix_report` reads a, b from every kept checkpoint of the run (the weights, no data) and writes
what each head became: a table per layer with (a, b) and the nearest named point at the last checkpoint, a figure
of heads x layers coloured by that point, and a and b against step.

Design choices:

* **Named points, not thresholds**: ordinary (0, 1), laplacian (1, -1), negated (0, -1), identity (1, 0) and off
  (0, 0). A head is reported with its nearest point and the distance to it, so "near Laplacian" is a number.
* **Scale is a head's own business**: W_O can absorb a common factor of (a, b), so the direction of (a, b) is what
  distinguishes kinds; the table gives both the raw point and the nearest named point by direction (the angle).
* **An optional decisiveness penalty** (``core.kinds.decisiveness_penalty``, off by default): the squared
  distance of each head's (a, b) to its nearest named point: it pushes heads towards a named kind, not a chosen one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from lapheads.core.kinds import NAMED_POINTS, nearest_kind
from lapheads.errors import InputError
from lapheads.runs.layout import WEIGHTS

__all__ = ["mix_report"]


def _mix_tensors(folder: Path) -> dict[int, tuple[list[float], list[float]]]:
    """Layer -> (a per head, b per head) from a checkpoint's model.safetensors."""
    from lapheads.io import load_safetensors

    tensors = load_safetensors(folder / WEIGHTS["model"])
    layers: dict[int, dict[str, list[float]]] = {}
    for key, value in tensors.items():
        parts = key.split(".")
        if parts[-1] in ("mix_a", "mix_b") and "blocks" in parts:
            layer = int(parts[parts.index("blocks") + 1])
            layers.setdefault(layer, {})[parts[-1]] = value.double().tolist()
    return {layer: (v["mix_a"], v["mix_b"]) for layer, v in sorted(layers.items())}


def mix_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write RUN_DIR/report/mix/{mix.md, mix.json, kinds.png, trajectories.png} for a run with mix heads."""
    from lapheads.runs import RunDir, checkpoint_folder, checkpoint_steps

    run = RunDir(run_dir)
    steps = checkpoint_steps(run)
    if not steps:
        raise InputError(f"{run.path} has no checkpoint; train it first")
    history = {step: _mix_tensors(checkpoint_folder(run, step)) for step in steps}
    final = history[steps[-1]]
    if not final:
        raise InputError(f"{run.path} has no mix heads; allowed: a run trained with --laplacian-heads mix (or kinds)")
    out = Path(out) if out is not None else run.report_dir / "mix"
    out.mkdir(parents=True, exist_ok=True)
    rows, table = [], []
    for layer, (a_list, b_list) in final.items():
        for head, (a, b) in enumerate(zip(a_list, b_list)):
            name, distance, direction = nearest_kind(a, b)
            rows.append(
                {
                    "layer": layer,
                    "head": head,
                    "a": a,
                    "b": b,
                    "nearest": name,
                    "distance": distance,
                    "direction": direction,
                }
            )
            table.append(f"| {layer + 1} | {head} | {a:+.3f} | {b:+.3f} | {name} ({distance:.2f}) | {direction} |")
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["direction"]] = counts.get(row["direction"], 0) + 1
    _plot_kinds(out / "kinds.png", rows, final, counts)
    _plot_trajectories(out / "trajectories.png", steps, history)
    summary = ", ".join(f"{n}: {c}" for n, c in sorted(counts.items(), key=lambda item: -item[1]))
    text = "\n".join(
        [
            f"# What the mix heads of `{run.path}` became",
            "",
            f"Each head outputs a V + b P V, learnable, ordinary at the start (a = 0, b = 1); {len(rows)} heads, "
            f"checkpoints at steps {', '.join(map(str, steps))}. Named points: "
            + ", ".join(f"{n} {p}" for n, p in NAMED_POINTS.items())
            + ". Nearest by direction (W_O absorbs a common scale): "
            + summary
            + ".",
            "",
            "| block | head | a | b | nearest point (distance) | nearest direction |",
            "|---|---|---|---|---|---|",
            *table,
            "",
            "![kinds](kinds.png)",
            "",
            "![a and b against step](trajectories.png)",
            "",
        ]
    )
    (out / "mix.md").write_text(text)
    (out / "mix.json").write_text(
        json.dumps(
            {
                "steps": steps,
                "final": rows,
                "history": {
                    str(s): {str(layer): {"a": ab[0], "b": ab[1]} for layer, ab in h.items()}
                    for s, h in history.items()
                },
            },
            indent=1,
        )
        + "\n"
    )
    return out / "mix.md"


def _plot_kinds(path: Path, rows: list[dict[str, Any]], final: dict[int, Any], counts: dict[str, int]) -> None:
    """Each head's nearest kind by direction of (a, b), a grid of blocks x heads with a and b written in."""
    from matplotlib.patches import Patch

    from lapheads.plots import panel_grid

    names = list(NAMED_POINTS)
    layers = sorted(final)
    heads = max(len(final[layer][0]) for layer in layers)
    with panel_grid(path, 1, size=(1.2 + 0.9 * heads, 1.0 + 0.45 * len(layers))) as (ax,):
        grid = torch.full((len(layers), heads), float("nan"))
        for row in rows:
            grid[layers.index(row["layer"]), row["head"]] = names.index(row["direction"])
        image = ax.imshow(grid.numpy(), cmap="tab10", vmin=0, vmax=9, aspect="auto")
        for row in rows:
            text = f"{row['a']:+.2f}\n{row['b']:+.2f}"
            ax.text(row["head"], layers.index(row["layer"]), text, ha="center", va="center", fontsize=7)
        ax.set_xticks(range(heads), [str(h) for h in range(heads)])
        ax.set_yticks(range(len(layers)), [str(layer + 1) for layer in layers])
        ax.set_xlabel("head")
        ax.set_ylabel("block")
        ax.set_title("nearest kind by direction of (a, b); text: a, b", fontsize=9)
        handles = [Patch(color=image.cmap(image.norm(i)), label=n) for i, n in enumerate(names) if n in counts]
        ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _plot_trajectories(path: Path, steps: list[int], history: dict[int, Any]) -> None:
    """a and b of every head against the checkpoint step."""
    from lapheads.plots import panel_grid

    final = history[steps[-1]]
    layers = sorted(final)
    heads = max(len(final[layer][0]) for layer in layers)
    with panel_grid(path, 2, size=(5, 3.2)) as (ax_a, ax_b):
        for layer in layers:
            for head in range(len(final[layer][0])):
                label = f"block {layer + 1} head {head}"
                ax_a.plot(steps, [history[s][layer][0][head] for s in steps], marker=".", label=label)
                ax_b.plot(steps, [history[s][layer][1][head] for s in steps], marker=".", label=label)
        for ax, name in ((ax_a, "a (coefficient of V)"), (ax_b, "b (coefficient of P V)")):
            ax.set_xlabel("step")
            ax.set_ylabel(name)
            ax.grid(alpha=0.3)
        if len(layers) * heads <= 12:
            ax_b.legend(fontsize=6)
