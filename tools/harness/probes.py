"""The host probes tools/gpu_placements.py records beside every GPU run: the host's facts, best-of-N timings of an
empty Python call, a dict/list loop and a torch CPU op, and the loop sampled over seconds (the share of samples at
half speed: the lent KVM guests' vCPUs run at half speed in spells of about a second, docs/benchmarks/planner.md).
"""

from __future__ import annotations

import os
import platform
import time


def _best(fn, n: int, repeats: int) -> float:
    """Seconds per call of fn's inner loop (fn runs n iterations), the best of repeats."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn(n)
        best = min(best, time.perf_counter() - t)
    return best / n


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _noop():
    return None


def _calls(n: int) -> None:
    """n calls of an empty Python function (the call probe's loop)."""
    f = _noop
    for _ in range(n):
        f()


def host_facts() -> dict:
    cpuinfo = _read("/proc/cpuinfo")
    models = [ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")]
    mhz = [float(ln.split(":", 1)[1]) for ln in cpuinfo.splitlines() if ln.startswith("cpu MHz")]
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        affinity = os.cpu_count()
    return {
        "cpu_model": models[0] if models else platform.processor(),
        "logical_cpus": os.cpu_count(),
        "cpus_usable": affinity,
        "cgroup_cpu_max": _read("/sys/fs/cgroup/cpu.max").strip() or None,
        "cpu_mhz_mean": round(sum(mhz) / len(mhz), 1) if mhz else None,
        "loadavg": _read("/proc/loadavg").split()[:3],
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


class _Obj:
    def __init__(self):
        self.x = 0


def _mix(n: int) -> None:
    """n iterations of dict, list and attribute work (the python_mix_ns probe's loop)."""
    d, lst, o = {}, [], _Obj()
    for i in range(n):
        d[i & 255] = i
        lst.append(d.get(i & 127, 0))
        o.x += len(lst) & 7
        if len(lst) > 512:
            lst.clear()


def mix_series(samples: int, interval_s: float, n: int = 100_000) -> list[float]:
    """python_mix_ns taken `samples` times, `interval_s` apart (one pass of n iterations each, ~15 ms on these hosts):
    a vCPU's half-speed spells come and go within a second, so one best-of-N says little; the series shows how much
    of the time the probe met them (`slow_share`)."""
    out = []
    for k in range(samples):
        if k and interval_s > 0:
            time.sleep(interval_s)
        out.append(round(_best(_mix, n, 1) * 1e9, 2))
    return out


def slow_share(series: list[float], factor: float = 1.5) -> float:
    """The share of a series' samples at least `factor` x its fastest (the half-speed spells read ~2x)."""
    if not series:
        raise ValueError("slow_share needs at least one sample")
    fastest = min(series)
    return sum(1 for v in series if v >= factor * fastest) / len(series)


def series_probe(samples: int, interval_s: float) -> dict:
    """mix_series and its slow_share, as tools/gpu_placements.py records them."""
    series = mix_series(samples, interval_s)
    return {"python_mix_ns": series, "interval_s": interval_s, "slow_share": slow_share(series)}


def cpu_probes(repeats: int) -> dict:
    out = {
        "python_call_ns": round(_best(_calls, 1_000_000, repeats) * 1e9, 2),
        "python_mix_ns": round(_best(_mix, 300_000, repeats) * 1e9, 2),
    }
    try:
        import torch
    except ImportError:
        return out
    a = torch.zeros(1)

    def cpu_ops(n):
        for _ in range(n):
            torch.add(a, 1.0)

    out["torch_cpu_op_us"] = round(_best(cpu_ops, 20_000, repeats) * 1e6, 3)
    out["torch_threads"] = torch.get_num_threads()
    return out
