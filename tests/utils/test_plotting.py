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


def test_plot_runs_puts_each_runs_curve_by_step_and_by_summed_step_seconds(tmp_path, monkeypatch):
    import json

    runs = {}
    for name, steps in (("grpo", [(0, None, 0.1), (1, 2.0, None), (2, 3.0, 0.4)]),
                        ("distill", [(0, None, 0.1), (1, 0.5, 0.3), (2, 1.5, 0.7)])):
        os.makedirs(tmp_path / name)
        with open(tmp_path / name / "metrics.jsonl", "w") as f:
            for step, seconds, acc in steps:
                row = {"step": step, **({"timing_s/step": seconds} if seconds else {}),
                       **({"val/accuracy": acc} if acc is not None else {})}
                f.write(json.dumps(row) + "\n")
        runs[name] = str(tmp_path / name)
    monkeypatch.setattr(plotting, "pyplot", lambda: None)  # the points as CSV
    csv = plotting.plot_runs(runs, str(tmp_path / "cmp.png"))
    lines = open(csv).read().splitlines()
    step, clock = "val/accuracy by step", "val/accuracy by wall clock"
    assert lines == ["series,x,y", f"{step}:grpo,0,0.1", f"{step}:grpo,2,0.4", f"{step}:distill,0,0.1",
                     f"{step}:distill,1,0.3", f"{step}:distill,2,0.7", f"{clock}:grpo,0.0,0.1",
                     f"{clock}:grpo,5.0,0.4", f"{clock}:distill,0.0,0.1", f"{clock}:distill,0.5,0.3",
                     f"{clock}:distill,2.0,0.7"]
    # the command line: several runs need --out (exit 2 otherwise), the labels default to the directory names
    assert plotting.main([runs["grpo"], runs["distill"]]) == 2
    assert plotting.main([runs["grpo"], runs["distill"], "--out", str(tmp_path / "cli.png"), "--labels", "a"]) == 2
    assert plotting.main([runs["grpo"], runs["distill"], "--out", str(tmp_path / "cli.png")]) == 0
    assert open(tmp_path / "cli.csv").read().splitlines()[1] == f"{step}:grpo,0,0.1"
