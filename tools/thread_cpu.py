"""Where a command's CPU time goes, on the whole machine: every process and thread that ran while it ran, sampled
from Linux's /proc, with the machine's busy, idle and stolen cores beside them. Not a test; it changes no code.

    python tools/thread_cpu.py --out DIR [--name NAME] [--interval 1.0] -- <command ...>

Writes DIR/NAME.json and DIR/NAME.md (NAME: threads): per process (a Ray actor by its class, `ray::HybridWorker`; a
Python program by its module or script), its CPU seconds over the command's wall time, its busy cores per sample,
and its threads grouped by name (vLLM's, NCCL's, torch's OpenMP pool: the unnamed `python` threads beside the main
one); the machine's CPU per sample from /proc/stat, stolen time included (a hypervisor that gives the vCPU to
another guest). CPU that a thread used after the last sample before it ended is not seen: at most --interval of it.

Why: on 2026-11-27 the same 0.6B data-parallel rollout generated 128 sequences an engine in 0.34 s on a two-GPU
machine and 0.58 s on a four-GPU one (docs/plan.md, Limits). A rank's threads' CPU time for the same work tells
a slower CPU (more CPU seconds) from waiting (the same CPU seconds, more wall time), and which threads hold it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/, for the harness (which puts the repo first)
from harness import log, md_table, run_child, write_report  # noqa: E402
from harness.procs import TICK_S, label, pids, thread_ticks  # noqa: E402

from rltrain.utils.errors import UserError  # noqa: E402

TOOL = "thread_cpu"
STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
TOP_THREADS = 8  # thread names per process in the markdown


def machine_ticks() -> dict[str, int]:
    """The first line of /proc/stat (all CPUs together), in clock ticks, by STAT_FIELDS ({} when not Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:1 + len(STAT_FIELDS)]
    except OSError:
        return {}
    return dict(zip(STAT_FIELDS, (int(x) for x in fields)))


class Sampler:
    """Every process's threads' CPU ticks, sample by sample. A process or thread seen at the first sample counts
    from there; one that starts later counts from its birth (all its ticks)."""

    def __init__(self, skip: set[int]):
        self.skip = skip  # this tool's own process
        self.t0 = time.time()
        self.first: dict[tuple[int, int], int] = {}  # (pid, tid) -> ticks when first seen at the baseline
        self.last: dict[tuple[int, int], tuple[str, int]] = {}  # (pid, tid) -> (comm, ticks) at its last sample
        self.labels: dict[int, str] = {}
        self.series: dict[int, list[tuple[float, int]]] = {}  # pid -> [(t, total ticks of its threads seen)]
        self.machine: list[tuple[float, dict[str, int]]] = []  # one entry a sample
        self.sample(baseline=True)

    def sample(self, baseline: bool = False) -> None:
        now = time.time() - self.t0
        self.machine.append((now, machine_ticks()))
        for pid in pids():
            if pid in self.skip:
                continue
            threads = thread_ticks(pid)
            if not threads:
                continue
            name = label(pid)  # read every sample: a Ray worker starts as `python setup_worker.py`, then takes its
            # actor's title (`ray::HybridWorker`)
            if name != "?":
                self.labels[pid] = name
            for tid, (comm, ticks) in threads.items():
                if baseline:
                    self.first[(pid, tid)] = ticks
                self.last[(pid, tid)] = (comm, ticks)
            used = sum(t - self.first.get((pid, tid), 0) for tid, (_, t) in threads.items())
            self.series.setdefault(pid, []).append((now, used))

    def report(self, wall_s: float) -> dict:
        """{"wall_s", "samples", "machine": {...}, "processes": [...]} with CPU seconds since the baseline."""
        procs: dict[int, dict] = {}
        for (pid, tid), (comm, ticks) in self.last.items():
            cpu = (ticks - self.first.get((pid, tid), 0)) * TICK_S
            p = procs.setdefault(pid, {"pid": pid, "label": self.labels.get(pid, "?"), "cpu_s": 0.0, "threads": {}})
            p["cpu_s"] += cpu
            g = p["threads"].setdefault(comm, {"comm": comm, "n": 0, "cpu_s": 0.0, "max_s": 0.0})
            g["n"] += 1
            g["cpu_s"] += cpu
            g["max_s"] = max(g["max_s"], cpu)
        rows = []
        for pid, p in procs.items():
            if p["cpu_s"] <= 0:
                continue
            s = self.series.get(pid, [])
            # a thread that ended between two samples takes its ticks out of the later one: that second reads 0
            busy = [round(max(0, b - a) * TICK_S / (tb - ta), 2) for (ta, a), (tb, b) in zip(s, s[1:]) if tb > ta]
            threads = sorted(p["threads"].values(), key=lambda g: -g["cpu_s"])
            rows.append({**p, "cpu_s": round(p["cpu_s"], 2), "busy_cores": round(p["cpu_s"] / max(wall_s, 1e-9), 3),
                         "busy_series": busy,
                         "threads": [{**g, "cpu_s": round(g["cpu_s"], 2), "max_s": round(g["max_s"], 2)}
                                     for g in threads]})
        rows.sort(key=lambda r: -r["cpu_s"])
        return {"wall_s": round(wall_s, 2), "samples": len(self.machine), "machine": self.machine_report(),
                "processes": rows}

    def machine_report(self) -> dict:
        """Busy, idle and stolen cores over the whole run and per sample ({} without /proc/stat)."""
        ok = [(t, m) for t, m in self.machine if m]
        if len(ok) < 2:
            return {}

        def cores(a: dict, b: dict, dt: float) -> dict[str, float]:
            d = {k: (b[k] - a[k]) * TICK_S / dt for k in STAT_FIELDS if k in a and k in b}
            busy = sum(v for k, v in d.items() if k not in ("idle", "iowait", "steal"))
            return {"busy": round(busy, 2), "idle": round(d.get("idle", 0.0), 2),
                    "steal": round(d.get("steal", 0.0), 3)}

        (t0, m0), (t1, m1) = ok[0], ok[-1]
        per = [cores(a, b, tb - ta) for (ta, a), (tb, b) in zip(ok, ok[1:]) if tb > ta]
        return {"cpus": os.cpu_count(), **cores(m0, m1, max(t1 - t0, 1e-9)),
                "steal_max": max((p["steal"] for p in per), default=0.0), "series": per}


def markdown(rep: dict, command: str) -> str:
    m = rep["machine"]
    command = " ".join(command.split())
    lines = [f"# CPU by process and thread: `{command[:200]}{' ...' if len(command) > 200 else ''}`", "",
             f"{rep['wall_s']} s wall, {rep['samples']} samples."]
    if m:
        lines.append(f"Machine: {m['cpus']} CPUs; {m['busy']} busy, {m['idle']} idle, {m['steal']} stolen on average; "
                     f"at most {m['steal_max']} stolen in one sample.")
    lines += ["", md_table(("process", "pid", "CPU s", "busy cores", "threads (name x count: CPU s)"),
                           [(p["label"], p["pid"], p["cpu_s"], p["busy_cores"],
                             "; ".join(f"{g['comm']} x{g['n']}: {g['cpu_s']}" for g in p["threads"][:TOP_THREADS]))
                            for p in rep["processes"]], ("---", "---:", "---:", "---:", "---"))]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cmd: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, cmd = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", default="threads")
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    args = ap.parse_args(argv)
    try:
        if not cmd:
            raise UserError("thread_cpu: give the command to run after `--`, e.g. "
                            "`-- python tools/gpu_placements.py ...`")
        if not args.interval > 0:
            raise UserError(f"thread_cpu: --interval must be > 0 seconds (got {args.interval})")
        if not os.path.isdir("/proc/self/task"):
            raise UserError("thread_cpu: needs Linux's /proc (per-thread CPU times)")
    except UserError as e:
        print(e, file=sys.stderr)
        return 2
    sampler = Sampler(skip={os.getpid()})
    log(TOOL, f"running {' '.join(cmd)} (samples every {args.interval} s)")
    run = run_child(cmd, None, poll_s=args.interval, poll_every_s=0.0, on_poll=lambda _name: sampler.sample(),
                    on_exit=lambda _name, _res: sampler.sample())
    rep = {"command": cmd, "rc": run["rc"], **sampler.report(run["wall_s"])}
    write_report(args.out, args.name, rep, markdown(rep, " ".join(cmd)))
    top = ", ".join(f"{p['label']} {p['cpu_s']} s" for p in rep["processes"][:4])
    log(TOOL, f"rc {run['rc']}, {rep['wall_s']} s wall; busiest: {top}; {args.out}/{args.name}.md")
    return run["rc"] if run["rc"] is not None else 1


if __name__ == "__main__":
    sys.exit(main())
