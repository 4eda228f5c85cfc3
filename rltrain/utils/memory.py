"""Memory statistics for metrics: peak GPU memory when CUDA is in use, else the process's peak RSS.

Read-only probes; never frees or allocates.
"""

from __future__ import annotations

import resource
import sys


def peak_rss_gb() -> float:
    """Peak resident set size of this process in GiB (Linux reports KiB, macOS bytes)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024**3 if sys.platform == "darwin" else 1024**2)


def memory_metrics() -> dict[str, float]:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return {
            "perf/max_memory_allocated_gb": torch.cuda.max_memory_allocated() / 1024**3,
            "perf/max_memory_reserved_gb": torch.cuda.max_memory_reserved() / 1024**3,
        }
    return {"perf/max_rss_gb": peak_rss_gb()}
