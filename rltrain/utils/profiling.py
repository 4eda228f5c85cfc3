"""torch-profiler traces of chosen training steps (trainer.profile_steps), taken inside each worker process.

A worker starts its profiler before the step (`WorkerProfiler.start`) and writes it after (`stop`): a gzipped chrome
trace per worker, CPU ops and CUDA kernels, each phase the worker ran inside a `rltrain::phase/<name>` range
(`phase`: old log-probs, reference, update, generation, sleep, wake-up, weight sync). tools/profile_step.py sums a
trace per phase: wall time, GPU busy time, idle, the top kernels. `phase` costs one range enter/exit per call when
no profiler runs.
"""

from __future__ import annotations

import functools
import gzip
import os
import shutil
from collections.abc import Callable
from typing import Any

import torch

PHASE_PREFIX = "rltrain::phase/"


def phase(name: str):
    """A decorator: the call runs inside the `rltrain::phase/<name>` profiler range."""
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def ranged(*args: Any, **kwargs: Any):
            with torch.profiler.record_function(PHASE_PREFIX + name):
                return fn(*args, **kwargs)
        return ranged
    return wrap


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
