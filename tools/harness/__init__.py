"""The small harness the scripts in tools/ run on: a median timer, child processes stopped at a deadline, a
deadline, JSON + markdown reports, the device's name. Must not know any one benchmark or import a tool.

A tool puts its own folder (tools/) on sys.path, so it also loads by file path (tests), then imports
`harness`, which puts the repository root on sys.path, so `rltrain` imports next. Peak FLOP/s per device lives
in rltrain/utils/flops.py (`peak_flops`). Beside this core: harness/cases.py (cases several tools run),
harness/host_profile.py (cProfile summaries), harness/update_profile.py (torch-profiler summary of an update step),
harness/probes.py (the host's facts and speed probes).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from typing import Callable, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def log(tool: str, msg: str) -> None:
    """`[tool HH:MM:SS] msg` on stdout, flushed (progress lines a device command's log shows as they come)."""
    print(f"[{tool} {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------- device and timing
def device_name() -> str:
    """The GPU's name (`NVIDIA H100 80GB HBM3`), else `CPU (<model>, <n> cores)`."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return f"CPU ({cpu}, {os.cpu_count()} cores)"


def times_ms(fn: Callable[[], object], reps: int = 5, warmup: int = 1, cuda: bool | None = None) -> list[float]:
    """Milliseconds of each of `reps` calls of fn after `warmup` untimed ones. On CUDA (default: when available)
    each call is timed by CUDA events around it, after a synchronize, so only that call's device time counts."""
    import torch

    cuda = torch.cuda.is_available() if cuda is None else cuda
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if cuda:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def time_ms(fn: Callable[[], object], reps: int = 5, warmup: int = 1, cuda: bool | None = None) -> float:
    """The median of times_ms."""
    return statistics.median(times_ms(fn, reps, warmup, cuda))


def gemm_tflops(n: int = 8192, reps: int = 10) -> float:
    """Measured bf16 n^3 GEMM rate of this GPU (the practical ceiling), TFLOP/s."""
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n**3 / time_ms(lambda: a @ b, reps=reps, warmup=3, cuda=True) / 1e9


# ---------------------------------------------------------------------------- deadline
class Deadline:
    """`seconds` from now (None: never). left() is inf without one."""

    def __init__(self, seconds: float | None):
        self.end = None if seconds is None else time.time() + seconds

    def left(self) -> float:
        return float("inf") if self.end is None else self.end - time.time()


# ---------------------------------------------------------------------------- child processes
STOP = ((signal.SIGINT, 20), (signal.SIGTERM, 10), (signal.SIGKILL, 5))  # ask, then insist


def _ignores(pid: int, sig: int) -> bool:
    """Whether process `pid` ignores `sig` (Linux /proc/<pid>/status SigIgn; False where unreadable): a child of a
    tool started with `&` by a non-interactive shell inherits SIGINT ignored."""
    try:
        with open(f"/proc/{pid}/status") as status:
            mask = next(int(line.split()[1], 16) for line in status if line.startswith("SigIgn:"))
    except (OSError, StopIteration, ValueError):
        return False
    return bool(mask >> (sig - 1) & 1)


def stop_group(p: subprocess.Popen, steps: Sequence[tuple[int, float]] = STOP) -> None:
    """Signal the child's process group (its own session) step by step until it exits; a signal the child ignores
    is skipped (no wait for nothing)."""
    for sig, wait in steps:
        if _ignores(p.pid, sig):
            continue
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_children(jobs: dict[str, tuple[list[str], str | None]], *, timeout_s: float | None = None,
                 env: dict | None = None, cwd: str = REPO, poll_s: float = 2.0,
                 on_poll: Callable[[str], None] | None = None, poll_every_s: float = 30.0,
                 on_exit: Callable[[str, dict], None] | None = None,
                 on_timeout: Callable[[str, subprocess.Popen], None] | None = None,
                 stop: Sequence[tuple[int, float]] = STOP) -> dict[str, dict]:
    """Run the commands of jobs {name: (argv, log_path)} at once, each in its own session (so a stop reaches
    what it started), stdout and stderr appended to its log (log_path None: to this process's, i.e. the console).
    on_poll(name) every poll_every_s for each running child; on_exit(name, result) as each ends. Children still
    running at timeout_s get on_timeout(name, proc), then the `stop` signals to their group; so do all of them
    when this process is interrupted (Ctrl-C). Returns {name: {"rc", "wall_s", "timed_out"}}."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    running, results = {}, {}

    def finish(name: str, timed_out: bool) -> None:
        p, logf, t0 = running.pop(name)
        if logf:
            logf.close()
        results[name] = {"rc": p.returncode, "wall_s": round(time.time() - t0, 1), "timed_out": timed_out}

    try:
        for name, (cmd, log_path) in jobs.items():
            logf = None
            if log_path is not None:
                os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
                logf = open(log_path, "a")
            running[name] = (subprocess.Popen(cmd, cwd=cwd, env=env, stdout=logf, stderr=logf and subprocess.STDOUT,
                                              start_new_session=True), logf, time.time())
        end = None if timeout_s is None else time.time() + timeout_s
        last_poll = time.time()
        while running:
            time.sleep(poll_s)
            for name in [n for n, (p, _, _) in running.items() if p.poll() is not None]:
                finish(name, False)
                if on_exit:
                    on_exit(name, results[name])
            if on_poll and running and time.time() - last_poll >= poll_every_s:
                last_poll = time.time()
                for name in running:
                    on_poll(name)
            if end is not None and time.time() > end:
                for name in list(running):
                    if on_timeout:
                        on_timeout(name, running[name][0])
                    stop_group(running[name][0], stop)
                    finish(name, True)
    finally:  # interrupted (or a callback raised): no child outlives this call
        for name in list(running):
            stop_group(running[name][0], stop)
            finish(name, True)
    return results


def run_child(cmd: list[str], log_path: str | None, **kw) -> dict:
    """One command as run_children runs it; the result also holds the log's last 2,000 characters ("tail", empty
    without a log)."""
    res = run_children({"child": (cmd, log_path)}, **kw)["child"]
    res["tail"] = ""
    if log_path is not None:
        with open(log_path, errors="replace") as f:
            res["tail"] = f.read()[-2000:]
    return res


def run_json_child(cmd: list[str], path: str, **kw) -> tuple[object | None, dict]:
    """cmd, which writes its result as JSON at `path`, run as run_child runs it with its output on the console (an
    earlier file at `path` removed first) -> (what it wrote, None where it wrote nothing; run_child's result)."""
    if os.path.exists(path):
        os.remove(path)
    run = run_child(cmd, None, **kw)
    if not os.path.exists(path):
        return None, run
    with open(path) as f:
        return json.load(f), run


def trainer_command(config: str, overrides: Sequence[str], run_dir: str, module: str = "rltrain.main") -> list[str]:
    """`python -m <module> --config-name <config> <overrides> hydra.run.dir=<run_dir>`: one trainer run."""
    return [sys.executable, "-m", module, "--config-name", config, *overrides, f"hydra.run.dir={run_dir}"]


def run_trainer(config: str, overrides: Sequence[str], run_dir: str, log_name: str = "run.log", **kw) -> dict:
    """trainer_command's run as run_child runs it (kw), its log at <run_dir>/<log_name> started afresh -> run_child's
    result with "rows" (its metrics.jsonl, run_rows) and "command" (the argv)."""
    os.makedirs(run_dir, exist_ok=True)
    cmd = trainer_command(config, overrides, run_dir)
    log_path = os.path.join(run_dir, log_name)
    if os.path.exists(log_path):
        os.remove(log_path)
    return {**run_child(cmd, log_path, **kw), "rows": run_rows(run_dir), "command": cmd}


# ---------------------------------------------------------------------------- reports
def run_rows(run_dir: str) -> list[dict]:
    """A trainer run's metrics.jsonl rows, one per step (rltrain.utils.tracking.read_metrics); [] before it logged."""
    from rltrain.utils.tracking import read_metrics

    return read_metrics(run_dir) if os.path.exists(os.path.join(run_dir, "metrics.jsonl")) else []


def report_header(tool: str, device: str | None = None) -> dict:
    """The first keys of every tool's report: date, device (default: device_name(), which starts CUDA: a tool
    that keeps CUDA out of its parent process passes the name its child measured), torch version, command line."""
    import torch

    return {"date": datetime.date.today().isoformat(), "device": device or device_name(), "torch": torch.__version__,
            "command": f"python tools/{tool}.py " + " ".join(sys.argv[1:])}


def md_table(header: Sequence[str], rows: Sequence[Sequence], align: str | Sequence[str] = "---") -> str:
    """A markdown table: one header row, a separator (`align` for every column, or one per column, e.g. "---:"
    right-aligns), one line per row (cells str()-ed)."""
    aligns = [align] * len(header) if isinstance(align, str) else list(align)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(aligns) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: str, obj) -> None:
    """Atomically (a reader never sees half a file), with non-JSON values as their str()."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(path + ".tmp", path)


def write_report(out_dir: str, name: str, obj, markdown: str) -> None:
    """<out_dir>/<name>.json and <out_dir>/<name>.md, rewritten whole (call after every case: a run stopped
    half-way still leaves the cases done)."""
    write_json(os.path.join(out_dir, f"{name}.json"), obj)
    with open(os.path.join(out_dir, f"{name}.md.tmp"), "w") as f:
        f.write(markdown if markdown.endswith("\n") else markdown + "\n")
    os.replace(os.path.join(out_dir, f"{name}.md.tmp"), os.path.join(out_dir, f"{name}.md"))
