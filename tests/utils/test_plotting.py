"""rltrain/utils/plotting.plot_lines: the panels of curves the tools draw, as a PNG or, without matplotlib, a CSV."""

import os

from rltrain.utils import plotting


def test_plot_lines_draws_panels_and_falls_back_to_csv(tmp_path, monkeypatch):
    panels = [{"title": "acc", "xlabel": "step", "ylim": (0, 1), "series": {"a": [(0, 0.1), (10, 0.5)], "b": []}},
              {"title": "loss", "xlabel": "step", "logy": True, "series": {"a": [(1, 2.0), (2, 1.0)]}}]
    png = plotting.plot_lines(str(tmp_path / "p" / "curves.png"), panels, suptitle="t")
    assert png.endswith("curves.png") and os.path.getsize(png) > 5_000
    monkeypatch.setattr(plotting, "pyplot", lambda: None)  # no matplotlib: the points as CSV
    csv = plotting.plot_lines(str(tmp_path / "p" / "curves.png"), panels)
    assert csv == str(tmp_path / "p" / "curves.csv")
    assert open(csv).read() == "series,x,y\nacc:a,0,0.1\nacc:a,10,0.5\nloss:a,1,2.0\nloss:a,2,1.0\n"
