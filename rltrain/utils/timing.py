"""Phase timers: `with timer("gen", metrics):` records metrics["timing_s/gen"] in seconds.

Wall-clock only; callers synchronize devices themselves when that matters.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator, MutableMapping


@contextmanager
def timer(name: str, metrics: MutableMapping[str, float]) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        key = f"timing_s/{name}"
        metrics[key] = metrics.get(key, 0.0) + time.perf_counter() - start
