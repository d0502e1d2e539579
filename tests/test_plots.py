"""The one figure helper: a grid of panels written as a PNG, unused panels hidden, the figure always closed."""

import matplotlib.pyplot as plt
import pytest

from lapheads.plots import panel_grid


def test_panel_grid_writes_the_png_and_closes_the_figure(tmp_path):
    with panel_grid(tmp_path / "sub" / "grid.png", 4, cols=3, title="four") as axes:
        assert len(axes) == 4
        fig = axes[0].figure
        for i, ax in enumerate(axes):
            ax.plot([0, 1], [i, i + 1])
    assert (tmp_path / "sub" / "grid.png").read_bytes()[:4] == b"\x89PNG"
    assert len(fig.axes) == 6 and [ax.axison for ax in fig.axes][4:] == [False, False]  # 2 x 3, two hidden
    assert fig._suptitle.get_text() == "four"
    assert not plt.get_fignums()


def test_a_failed_drawing_writes_nothing_and_still_closes(tmp_path):
    with pytest.raises(ZeroDivisionError):
        with panel_grid(tmp_path / "grid.png", 1):
            1 / 0
    assert not (tmp_path / "grid.png").exists() and not plt.get_fignums()
