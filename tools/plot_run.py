"""Redraw the PNG plots of a run (reward, entropy, grad norm, response length, validation accuracy).

  python tools/plot_run.py RUN_DIR      # reads RUN_DIR/metrics.jsonl, writes RUN_DIR/*.png
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rltrain.utils.plotting import plot_run  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir")
    args = ap.parse_args()
    if not os.path.isfile(os.path.join(args.run_dir, "metrics.jsonl")):
        sys.exit(f"plot_run: {args.run_dir}/metrics.jsonl not found; give a run directory of rltrain.main")
    for path in plot_run(args.run_dir):
        print(path)


if __name__ == "__main__":
    main()
