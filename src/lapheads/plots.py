"""One way to draw a figure: a grid of panels, saved as a PNG and closed (analyze, report, demo, DINO evals).

matplotlib's non-interactive Agg backend is selected on first use, so plotting never needs a display; unused panels of
the grid are hidden; the figure is laid out tightly and closed even when drawing fails.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["panel_grid"]


@contextlib.contextmanager
def panel_grid(
    path: str | Path, panels: int, *, cols: int = 3, size: tuple[float, float] = (4.2, 3.2), dpi: int = 110,
    title: str | None = None,
) -> Iterator[list[Any]]:  # fmt: skip
    """Yield ``panels`` axes laid out ``cols`` to a row (fewer when there are fewer panels); on leaving the block the
    figure is written to ``path`` (its folder created) and closed.

    Args:
        path: the PNG to write.
        panels: how many axes to draw on.
        cols: at most this many per row.
        size: inches per panel (width, height).
        dpi: resolution.
        title: a title over the whole figure.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = max(1, min(cols, panels))
    rows = max(1, math.ceil(panels / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(size[0] * cols, size[1] * rows), dpi=dpi, squeeze=False)
    try:
        flat = list(axes.flat)
        for ax in flat[panels:]:
            ax.axis("off")
        yield flat[:panels]
        if title:
            fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
    finally:
        plt.close(fig)
