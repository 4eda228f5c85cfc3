"""PNG plots of a run's curves (reward, entropy, grad norm, response length, validation accuracy).

Reads metrics.jsonl only; for people without a wandb account. Never imports torch or the trainer.
"""

from __future__ import annotations

import os

from rltrain.utils.tracking import read_metrics

PLOTS = {
    "reward.png": ("critic/score/mean", "reward (mean score)"),
    "entropy.png": ("actor/entropy", "policy entropy"),
    "grad_norm.png": ("actor/grad_norm", "actor grad norm"),
    "response_length.png": ("response_length/mean", "response length (mean)"),
    "val_accuracy.png": ("val/accuracy", "validation accuracy"),
}


def plot_run(run_dir: str) -> list[str]:
    """Write one PNG per known curve into run_dir; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written
