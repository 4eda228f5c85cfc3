"""Where each phase of a run's steps went: the driver's time (timing_s/<phase>), the slowest rank's work inside the
phase's worker methods, the driver's slicing of the batch over the data-parallel ranks before the submit (and its
thread's CPU time in it: well under the slicing's time, the thread waited, for the GIL or a CPU), Ray's dispatch
(submit until the last rank started) and return (the last rank's end until the driver held every result), and the
rest: the driver's other work inside the phase (gathering the results, computing metrics), or its waiting on its own
threads. Reads the metrics.jsonl a run wrote under Ray (workers/group.py's call_metrics); steps with
trainer.profile_steps' profiler are left out. Not a test; it changes no code.

    python tools/phase_split.py outputs/<run>/metrics.jsonl [more.jsonl ...] [--skip 1] [--json OUT]

A row's parts are means over the steps kept (the first --skip steps, compilation and warm-up, are not). A phase of
several worker methods (the colocated weight sync: the engine's wake-up and the weights' send) sums them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/, for the harness (which puts the repo first)
from harness import md_table, write_json  # noqa: E402
from harness.runs import split_phases  # noqa: E402

from rltrain.utils.errors import UserError  # noqa: E402


def read_rows(path: str) -> list[dict]:
    """A metrics.jsonl file as rows; a missing file or a line that is not JSON raises UserError."""
    if not os.path.isfile(path):
        raise UserError(f"phase_split: no such metrics file: {path} (a run's metrics.jsonl: trainer.logger with jsonl)")
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise UserError(f"phase_split: {path} line {n} is not JSON ({err.msg})") from None
    return rows


def _cell(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def markdown(name: str, table: dict[str, dict[str, float]]) -> str:
    steps = int(max((t["steps"] for t in table.values()), default=0))
    header = ["phase", "driver", "slicing", "its CPU", "ranks' work", "dispatch", "return", "driver's rest"]
    rows = [[phase, _cell(t["driver"]), _cell(t["slice"]), _cell(t.get("slice_cpu")),
             *(_cell(t[k]) for k in ("worker", "dispatch", "return", "rest"))] for phase, t in table.items()]
    return f"{name}: seconds a step (mean of {steps} steps)\n\n" + md_table(header, rows, ["---"] + ["---:"] * 7)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("metrics", nargs="+", help="metrics.jsonl files of runs under Ray")
    ap.add_argument("--skip", type=int, default=1, help="leading training steps left out (default 1: compilation)")
    ap.add_argument("--json", help="also write {file: {phase: parts}} here")
    args = ap.parse_args(argv)
    try:
        if args.skip < 0:
            raise UserError(f"phase_split: --skip must be >= 0, got {args.skip}")
        res = {}
        for path in args.metrics:
            table = split_phases(read_rows(path), args.skip)
            if not table:
                raise UserError(f"phase_split: {path} has no step with the phase split (timing_s/worker/...): a run "
                                f"under Ray (trainer.use_ray=true) with more than --skip {args.skip} steps")
            res[path] = table
            print(markdown(path, table) + "\n")
    except UserError as err:
        print(err, file=sys.stderr)
        return 2
    if args.json:
        write_json(args.json, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
