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


def test_a_report_panel_or_spec_without_points_draws_no_empty_axes_or_legend(tmp_path, monkeypatch):
    """Issue 76: the mechanism figure had axis ticks with no data and a legend for lines that were absent. A spec
    with no points gets no legend entry; a panel with none says "not measured", without ticks."""
    import contextlib

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lapheads.study.report import figures

    drawn = []

    @contextlib.contextmanager
    def grid(path, panels, **kwargs):
        fig, axes = plt.subplots(1, panels, squeeze=False)
        drawn.extend(axes.flat)
        yield list(axes.flat)
        plt.close(fig)

    monkeypatch.setattr(figures, "panel_grid", grid)
    row = {"step": 10, "mean_difference": 0.1, "ci_low": 0.0, "ci_high": 0.2}
    figures.plot_steps({"a": {"1": [row], "2": []}, "b": {"1": [], "2": []}}, tmp_path / "x.png", "y", str)
    assert [t.get_text() for t in drawn[0].get_legend().get_texts()] == ["1"]
    assert drawn[1].get_legend() is None and drawn[1].texts[0].get_text() == "not measured"
    assert len(drawn[1].get_xticks()) == 0 and not drawn[1].lines
