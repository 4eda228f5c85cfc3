"""The driver's torch threads, A/B on one host: a trainer run under Ray made twice with the same overrides, arm `one`
as the trainer sets its driver (workers/group.py DRIVER_TORCH_THREADS) and arm `per-core` with torch's default of a
thread per core (the driver before 2026-11-27's seventh session). Per arm: the phase split (tools/phase_split.py:
the slicing of the batch over the data-parallel ranks and its thread's CPU, the ranks' work, Ray's dispatch and
return), every Batch.select the driver made (wall, its thread's CPU, its voluntary and involuntary context switches),
each OS thread's CPU in the driver process (torch's OpenMP threads are the unnamed "python" ones), and every 20 ms
the top frame of each of the driver's other Python threads (what they sat in). Not a test; it changes no code.

    python tools/driver_threads.py --out DIR [--arms one per-core] [--config-name NAME] [--skip 1] -- <overrides>

The overrides are the run's (trainer.use_ray=true and trainer.n_gpus_per_node >= 2 for a slicing to time). Why: on
2026-11-27 a Batch.select at DP=2 took 9.6 ms on a 32-core GPU host, all of it the driver thread's CPU, 0.25 ms with
one thread: torch ran each indexing op on a thread per core, and the ranks' and vLLM's processes held the cores.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import json
import os
import runpy
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/, for the harness (which puts the repo first)
from harness import (device_name, log, md_table, report_header, run_child, run_rows, trainer_command,  # noqa: E402
                     write_report)
from harness.procs import TICK_S, thread_ticks  # noqa: E402
from harness.runs import SPLIT_PHASES, split_phases  # noqa: E402

from rltrain.utils.errors import UserError  # noqa: E402

TOOL = "driver_threads"
ARMS = ("one", "per-core")
SAMPLE_S = 0.02  # the other threads' frames, this often
SELECT_FIELDS = ("wall_s", "cpu_s", "vcsw", "ivcsw")


# ---------------------------------------------------------------------------- the child: one instrumented run
def thread_cpu() -> list[dict]:
    """Every OS thread of this process: {"tid", "comm", "py" (the Python thread's name, or None), "cpu_s"}, the
    busiest first (Linux /proc; [] elsewhere)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    rows = [{"tid": tid, "comm": comm, "py": names.get(tid), "cpu_s": ticks * TICK_S}
            for tid, (comm, ticks) in thread_ticks("self").items()]
    return sorted(rows, key=lambda r: -r["cpu_s"])


def _switches() -> tuple[int, int]:
    import resource

    r = resource.getrusage(resource.RUSAGE_THREAD)
    return r.ru_nvcsw, r.ru_nivcsw


def child(arm: str, record: str, argv: list[str]) -> None:
    """Run rltrain.main with argv in this process, the driver set as `arm`; write the record at exit."""
    from rltrain.data import batch
    from rltrain.workers import group

    if arm == "per-core":
        group.DRIVER_TORCH_THREADS = 1 << 20  # init_ray keeps the fewer: torch's default stays
    selects: list[tuple[float, float, int, int]] = []
    frames: collections.Counter = collections.Counter()
    select = batch.Batch.select

    def timed_select(self, index):
        wall, cpu, (v, i) = time.perf_counter(), time.thread_time(), _switches()
        try:
            return select(self, index)
        finally:
            v2, i2 = _switches()
            selects.append((time.perf_counter() - wall, time.thread_time() - cpu, v2 - v, i2 - i))

    def sample() -> None:
        me = threading.get_ident()
        while True:
            time.sleep(SAMPLE_S)
            for tid, f in sys._current_frames().items():
                if tid != me:
                    frames[f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}:{f.f_code.co_name}"] += 1

    def write() -> None:
        import torch

        # at exit: the driver itself starts no CUDA while the run goes (its ranks hold the GPUs)
        out = {"arm": arm, "device": device_name(), "torch_threads": torch.get_num_threads(), "selects": selects,
               "threads": thread_cpu(), "frames": frames.most_common(40)}
        with open(record + ".tmp", "w") as f:
            json.dump(out, f)
        os.replace(record + ".tmp", record)

    batch.Batch.select = timed_select
    threading.Thread(target=sample, daemon=True, name="driver-threads-sampler").start()
    atexit.register(write)
    sys.argv = ["rltrain.main", *argv]
    runpy.run_module("rltrain.main", run_name="__main__")


# ---------------------------------------------------------------------------- the parent: arms and report
def summarize(record: dict, rows: list[dict], skip: int) -> dict:
    """One arm: its selects' means, the driver's threads (the unnamed "python" ones, torch's OpenMP pool, counted and
    summed), the other threads' commonest frames, the phase split and the mean step of the steps kept."""
    sel = record["selects"]
    n = len(sel)
    means = {k: (sum(s[i] for s in sel) / n if n else 0.0) for i, k in enumerate(SELECT_FIELDS)}
    threads = record["threads"]
    pool = [t for t in threads if t["comm"] == "python" and t["py"] is None]
    steps = [r["timing_s/step"] for r in rows if "timing_s/step" in r][skip:]
    return {"torch_threads": record["torch_threads"], "selects": n,
            "select_wall_ms": 1e3 * means["wall_s"], "select_cpu_ms": 1e3 * means["cpu_s"],
            "select_vcsw": means["vcsw"], "select_ivcsw": means["ivcsw"],
            "select_wall_ms_max": 1e3 * max((s[0] for s in sel), default=0.0),
            "main_cpu_s": next((t["cpu_s"] for t in threads if t["py"] == "MainThread"), None),
            "pool_threads": len(pool), "pool_cpu_s": sum(t["cpu_s"] for t in pool),
            "frames": record["frames"][:8], "split": split_phases(rows, skip),
            "step_s": sum(steps) / len(steps) if steps else None, "steps": len(steps)}


def _f(x, fmt: str = ".3f") -> str:
    return "n/a" if x is None else format(x, fmt)


def markdown(res: dict) -> str:
    arms = res["arms"]
    head = ["arm", "torch threads", "selects", "select wall (ms)", "its CPU (ms)", "invol. switches", "vol. switches",
            "slowest (ms)", "unnamed python threads (OpenMP's): n, CPU (s)", "step (s)"]
    rows = [[a, s["torch_threads"], s["selects"], _f(s["select_wall_ms"], ".2f"), _f(s["select_cpu_ms"], ".2f"),
             _f(s["select_ivcsw"], ".2f"), _f(s["select_vcsw"], ".2f"), _f(s["select_wall_ms_max"], ".1f"),
             f"{s['pool_threads']}, {s['pool_cpu_s']:.1f}", _f(s["step_s"])] for a, s in arms.items()]
    out = [f"# {TOOL}: {res['device']}, {res['date']}", "", f"`{res['command']}`", "", md_table(head, rows, "---:"), ""]
    phases = [p for p in SPLIT_PHASES if any(p in s["split"] for s in arms.values())]  # the split's own order
    head = ["phase"] + [f"{a}: {c}" for a in arms for c in ("driver", "slicing", "its CPU", "ranks")]
    rows = []
    for p in phases:
        row = [p]
        for s in arms.values():
            t = s["split"].get(p, {})
            row += [_f(t.get("driver")), _f(t.get("slice")), _f(t.get("slice_cpu")), _f(t.get("worker"))]
        rows.append(row)
    out += ["Seconds a step (tools/phase_split.py's parts):", "", md_table(head, rows, "---:"), ""]
    for a, s in arms.items():
        out.append(f"{a}: the other Python threads' commonest frames: "
                   + ", ".join(f"{f} ({k})" for f, k in s["frames"][:4]))
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:  # the instrumented run (this file, run by the parent)
        if len(argv) < 4 or argv[3] != "--":
            print(f"{TOOL}: --child ARM RECORD -- <rltrain.main argv>", file=sys.stderr)
            return 2
        child(argv[1], argv[2], argv[4:])
        return 0
    own, overrides = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the report (driver_threads.json / .md) and the runs go here")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), help=f"in this order, from {ARMS}")
    ap.add_argument("--config-name", default="grpo_tiny")
    ap.add_argument("--skip", type=int, default=1, help="leading training steps left out (default 1: compilation)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds each arm's run may take")
    args = ap.parse_args(own)
    try:
        bad = [a for a in args.arms if a not in ARMS]
        if bad or not args.arms:
            raise UserError(f"{TOOL}: --arms takes {' and/or '.join(ARMS)}, got {' '.join(args.arms) or 'none'}")
        if args.skip < 0:
            raise UserError(f"{TOOL}: --skip must be >= 0, got {args.skip}")
        # the device as the runs saw it (the parent starts no CUDA: its context would sit on the runs' GPU 0)
        res = {**report_header(TOOL, device="?"), "overrides": overrides, "arms": {}}
        for arm in args.arms:
            run_dir = os.path.abspath(os.path.join(args.out, arm))
            record = os.path.join(run_dir, "driver_record.json")
            os.makedirs(run_dir, exist_ok=True)
            for stale in (record, os.path.join(run_dir, "metrics.jsonl")):
                if os.path.exists(stale):
                    os.remove(stale)
            cmd = trainer_command(args.config_name, overrides, run_dir)
            cmd = [sys.executable, os.path.abspath(__file__), "--child", arm, record, "--", *cmd[3:]]
            log(TOOL, f"arm {arm}: running ({run_dir}/run.log)")
            run = run_child(cmd, os.path.join(run_dir, "run.log"), timeout_s=args.timeout)
            if run["rc"] != 0 or not os.path.exists(record):
                raise UserError(f"{TOOL}: arm {arm}'s run failed (rc {run['rc']}"
                                f"{', timed out' if run['timed_out'] else ''}); its log ends:\n{run['tail']}")
            with open(record) as f:
                rec = json.load(f)
            res["device"] = rec["device"]
            s = summarize(rec, run_rows(run_dir), args.skip)
            res["arms"][arm] = s
            log(TOOL, f"arm {arm}: {s['selects']} selects, {s['select_wall_ms']:.2f} ms each (CPU "
                      f"{s['select_cpu_ms']:.2f}), step {_f(s['step_s'])} s")
            write_report(args.out, TOOL, res, markdown(res))
    except UserError as err:
        print(err, file=sys.stderr)
        return 2
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
