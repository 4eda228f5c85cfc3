"""torch-profiler traces of chosen training steps (trainer.profile_steps), taken inside each worker process.

A worker starts its profiler before the step (`WorkerProfiler.start`) and writes it after (`stop`): a gzipped chrome
trace per worker, CPU ops and CUDA kernels, each phase the worker ran inside a `rltrain::phase/<name>` range
(`phase`: old log-probs, reference, update, generation, sleep, wake-up, weight sync). tools/profile_step.py sums a
trace per phase: wall time, GPU busy time, idle, the top kernels. `phase` costs one range enter/exit per call when
no profiler runs.

`phase` also notes each call's wall-clock start and end (`take_calls`): the driver (workers/group.py) sets them against
its own submit and receive times to split a phase's time into the ranks' work and Ray's dispatch and return.
"""

from __future__ import annotations

import functools
import gzip
import os
import shutil
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

PHASE_PREFIX = "rltrain::phase/"
# (method name, phase name, wall-clock start, end) of this process's last phase calls; bounded: a group nobody reads
# (an asynchronous rollout group) keeps its latest only
_CALLS: deque[tuple[str, str, float, float]] = deque(maxlen=512)


def phase(name: str):
    """A decorator: the call runs inside the `rltrain::phase/<name>` profiler range, and its wall-clock start and end
    are noted under the method's name (`take_calls`)."""
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def ranged(*args: Any, **kwargs: Any):
            start = time.time()
            try:
                with torch.profiler.record_function(PHASE_PREFIX + name):
                    return fn(*args, **kwargs)
            finally:
                _CALLS.append((fn.__name__, name, start, time.time()))
        return ranged
    return wrap


def take_calls() -> list[tuple[str, str, float, float]]:
    """The phase calls noted since the last take, oldest first: (method name, phase name, wall-clock start, end)."""
    out = list(_CALLS)
    _CALLS.clear()
    return out


class WorkerProfiler:
    """One profiled window in a worker: start() ... stop(path). CUDA kernels are recorded when CUDA is initialized
    in this process."""

    def __init__(self) -> None:
        self._prof: torch.profiler.profile | None = None

    def start(self) -> None:
        if self._prof is not None:
            raise RuntimeError("the profiler is already running in this worker (profile_start called twice)")
        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(activities=acts)
        prof.__enter__()
        self._prof = prof

    def stop(self, path: str) -> str:
        """Stop and write the chrome trace to `path` (.json.gz: gzipped). Returns the path written."""
        if self._prof is None:
            raise RuntimeError("the profiler is not running in this worker (profile_stop before profile_start)")
        prof, self._prof = self._prof, None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the step's last kernels end inside the window
        prof.__exit__(None, None, None)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        raw = path[:-3] if path.endswith(".gz") else path
        prof.export_chrome_trace(raw)
        if raw != path:  # gzipped under a temporary name, then renamed: a worker stopped mid-way leaves the raw trace
            with open(raw, "rb") as src, gzip.open(path + ".part", "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.replace(path + ".part", path)
            os.remove(raw)
        return path


def split_calls(driver: list[tuple], ranks: list[list[tuple[str, str, float, float]]],
                tolerance_s: float = 0.005) -> dict[str, float]:
    """A phase's driver time split by where it went, summed per phase over the calls of `driver` (method name,
    wall-clock submit, wall-clock results in hand, and optionally the driver's slicing of the batch for the call:
    (wall-clock start, the driver thread's CPU seconds in it), or None) that every rank noted (`ranks[r]`: that rank's
    `take_calls`; the clocks are one host's wall clock, or synchronized ones):

      timing_s/slice/<phase>     the driver's slicing of the batch over the data-parallel ranks, before the submit
                                 (only calls that note it);
      timing_s/slice_cpu/<phase> the driver thread's CPU time in that slicing: well under timing_s/slice, the thread
                                 waited (for the GIL, or for a CPU) rather than worked;
      timing_s/worker/<phase>    the slowest rank's time inside the method (its collectives' waits included);
      timing_s/dispatch/<phase>  submit until the last rank entered the method (Ray's scheduling and the arguments'
                                 transfer and unpickling);
      timing_s/return/<phase>    the last rank's exit until the driver holds every result (the results' transfer).

    A driver call that some rank did not note (a method without `phase`, a worker's record dropped) adds nothing; a
    rank's records from calls the driver did not time (asynchronous submits) are skipped."""
    pending = [list(calls) for calls in ranks]
    out: dict[str, float] = {}
    for method, submit, done, *slicing in driver:
        picked = []
        for calls in pending:
            i = next((i for i, c in enumerate(calls) if c[0] == method and c[2] >= submit - tolerance_s
                      and c[3] <= done + tolerance_s), None)
            if i is None:
                break
            picked.append(calls.pop(i))
        if len(picked) != len(pending) or not picked:
            continue
        name = picked[0][1]
        parts = {"worker": max(end - start for _, _, start, end in picked),
                 "dispatch": max(0.0, max(start for _, _, start, _ in picked) - submit),
                 "return": max(0.0, done - max(end for _, _, _, end in picked))}
        if slicing and slicing[0] is not None:
            began, cpu_s = slicing[0]
            parts["slice"], parts["slice_cpu"] = max(0.0, submit - began), cpu_s
        for part, seconds in parts.items():
            key = f"timing_s/{part}/{name}"
            out[key] = out.get(key, 0.0) + seconds
    return out
