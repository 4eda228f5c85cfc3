"""The host probes of tools/host_probe.py, for any tool to take beside a run (tools/gpu_placements.py records the CPU
ones with every GPU run): the host's facts, best-of-N timings of an empty Python call, a dict/list loop and a torch
CPU op; on a GPU, a kernel launch, launch + sync and a bf16 GEMM; per vCPU, the call probe pinned to each.
"""

from __future__ import annotations

import os
import platform
import subprocess
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
    """mix_series and its slow_share, as tools/host_probe.py --series and tools/gpu_placements.py record them."""
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


def cuda_probes(repeats: int) -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"cuda": "not available"}
    dev = torch.device("cuda")
    a = torch.zeros(1, device=dev)
    torch.cuda.synchronize()

    def launches(n):
        for _ in range(n):
            torch.add(a, 1.0)
        torch.cuda.synchronize()

    def syncs(n):
        for _ in range(n):
            torch.add(a, 1.0)
            torch.cuda.synchronize()

    x = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    x @ x
    torch.cuda.synchronize()

    def gemms(n):
        for _ in range(n):
            x @ x
        torch.cuda.synchronize()

    out = {
        "gpu": torch.cuda.get_device_name(0),
        "cuda_launch_us": round(_best(launches, 20_000, repeats) * 1e6, 3),
        "cuda_sync_us": round(_best(syncs, 2_000, repeats) * 1e6, 3),
        "gemm_tflops": round(2 * 8192**3 / _best(gemms, 20, repeats) / 1e12, 1),
    }
    fields = ("clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,temperature.gpu,pstate,"
              "clocks_event_reasons.active")
    try:
        smi = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        out["nvidia_smi"] = {"fields": fields, "rows": smi.stdout.strip().splitlines() or smi.stderr.strip()}
    except (OSError, subprocess.TimeoutExpired) as e:
        out["nvidia_smi"] = f"unavailable: {e}"
    return out


def per_cpu_probes(passes: int) -> dict:
    """The Python call probe pinned to each usable CPU in turn, `passes` times over: whether some CPUs of this host
    (a VM's vCPUs sharing a core with a busy neighbour) are slower than others, and whether that holds from one
    pass to the next. Restores the affinity it found."""
    if not hasattr(os, "sched_setaffinity"):
        return {"per_cpu": "not supported here (no sched_setaffinity)"}

    cpus = sorted(os.sched_getaffinity(0))
    rows = {c: [] for c in cpus}
    try:
        for _ in range(passes):
            for c in cpus:
                os.sched_setaffinity(0, {c})
                rows[c].append(round(_best(_calls, 100_000, 5) * 1e9, 1))
    finally:
        os.sched_setaffinity(0, set(cpus))
    best = {c: min(v) for c, v in rows.items()}
    fastest = min(best.values())
    return {"python_call_ns_by_cpu": {str(c): v for c, v in rows.items()},
            "slow_cpus": [c for c, v in best.items() if v > 1.5 * fastest],
            "fastest_ns": fastest}
