"""PNG plots of a run's curves (reward, entropy, grad norm, response length, validation accuracy), and the one
panel-of-curves plotter the tools draw with (plot_lines; CSV where matplotlib is missing).

Reads metrics.jsonl only; for people without a wandb account. Never imports torch or the trainer.

    python -m rltrain.utils.plotting RUN_DIR    # redraw RUN_DIR/*.png from RUN_DIR/metrics.jsonl
    python -m rltrain.utils.plotting GRPO_DIR DISTILL_DIR --labels grpo distill --out curves.png [--key val/accuracy]
                                                # runs side by side, by step and by wall clock (plot_runs)
"""

from __future__ import annotations

import os
from typing import Sequence

from rltrain.utils.safefs import open_nofollow
from rltrain.utils.tracking import read_metrics

PLOTS = {
    "reward.png": ("critic/score/mean", "reward (mean score)"),
    "entropy.png": ("actor/entropy", "policy entropy"),
    "grad_norm.png": ("actor/grad_norm", "actor grad norm"),
    "response_length.png": ("response_length/mean", "response length (mean)"),
    "val_accuracy.png": ("val/accuracy", "validation accuracy"),
}


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None where matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run(run_dir: str) -> list[str]:
    """Write one PNG per known curve into run_dir; returns the paths written."""
    plt = pyplot()
    if plt is None:
        raise ImportError("plot_run needs matplotlib (pip install matplotlib)")
    rows = read_metrics(run_dir)
    written = []
    for fname, (key, title) in PLOTS.items():
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        if not pts:
            continue
        fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o" if len(pts) < 30 else None, lw=1.5)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = os.path.join(run_dir, fname)
        with open_nofollow(path, "wb") as f:  # a link planted in its place is refused, not written through
            fig.savefig(f, format="png")
        plt.close(fig)
        written.append(path)
    return written


def plot_runs(runs: dict[str, str], path: str, *, key: str = "val/accuracy") -> str:
    """`key` of each run ({label: run dir}) side by side, by step and by wall clock (seconds of the training steps
    before it, summed `timing_s/step`: start-up and validation left out); plot_lines writes the PNG (or CSV)."""
    by_step, by_time = {}, {}
    for label, run_dir in runs.items():
        rows, seconds, clock = read_metrics(run_dir), 0.0, {}
        for r in rows:
            seconds += r.get("timing_s/step", 0.0)
            clock[r["step"]] = seconds
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        by_step[label], by_time[label] = pts, [(clock[s], v) for s, v in pts]
    return plot_lines(path, [{"title": f"{key} by step", "xlabel": "step", "series": by_step},
                             {"title": f"{key} by wall clock", "xlabel": "training seconds", "series": by_time}])


def plot_lines(path: str, panels: Sequence[dict], *, suptitle: str | None = None) -> str:
    """Side-by-side panels of curves as a PNG at `path`; where matplotlib is missing, the points as CSV
    (series,x,y with series "<panel title>:<label>") at `path` with .csv for .png. Returns the file written.
    A panel: {"title", "xlabel", "series": {label: [(x, y), ...]}} and optionally "ylabel", "ylim", "logy"."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    plt = pyplot()
    if plt is None:
        path = os.path.splitext(path)[0] + ".csv"
        with open(path, "w") as f:
            f.write("series,x,y\n")
            for p in panels:
                for label, pts in p["series"].items():
                    f.writelines(f"{p['title']}:{label},{x},{y}\n" for x, y in pts)
        return path
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.4), dpi=100, squeeze=False)
    for ax, p in zip(axes[0], panels):
        for label, pts in p["series"].items():
            if pts:
                ax.plot([q[0] for q in pts], [q[1] for q in pts], lw=1.4, marker="o" if len(pts) < 30 else None, ms=3,
                        label=label)
        ax.set(title=p["title"], xlabel=p["xlabel"], ylabel=p.get("ylabel"))
        if p.get("logy"):
            ax.set_yscale("log")
        if p.get("ylim"):
            ax.set_ylim(*p["ylim"])
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    if suptitle:
        fig.suptitle(suptitle, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m rltrain.utils.plotting",
                                 description="Redraw the PNG plots of a run, or draw runs side by side (--out).")
    ap.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories of rltrain.main (metrics.jsonl)")
    ap.add_argument("--out", help="draw the runs' --key side by side into this PNG (by step and by wall clock)")
    ap.add_argument("--labels", nargs="+", help="one label per run with --out (default: the directory names)")
    ap.add_argument("--key", default="val/accuracy", help="the metric drawn with --out (default: val/accuracy)")
    args = ap.parse_args(argv)
    missing = [d for d in args.run_dirs if not os.path.isfile(os.path.join(d, "metrics.jsonl"))]
    if missing or (len(args.run_dirs) > 1 and not args.out) or (args.labels and len(args.labels) != len(args.run_dirs)):
        why = (f"{missing[0]}/metrics.jsonl not found; give a run directory of rltrain.main" if missing else
               "several runs are drawn side by side with --out PNG, one --labels entry per run")
        print(f"plotting: {why}", file=sys.stderr)
        return 2
    if args.out:
        labels = args.labels or [os.path.basename(os.path.normpath(d)) for d in args.run_dirs]
        print(plot_runs(dict(zip(labels, args.run_dirs)), args.out, key=args.key))
        return 0
    for path in plot_run(args.run_dirs[0]):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
