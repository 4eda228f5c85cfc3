"""Learning-rate schedules of the trained engines: name -> lr multiplier of (optimizer steps taken, warmup steps,
total steps, min lr ratio). The one list of `*.lr_schedule` names (config validation reads it); no torch here.
"""

from __future__ import annotations

import math
from typing import Callable


def _constant(step: int, warmup: int, total: int, min_ratio: float) -> float:
    return min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0


def _cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


# lr multiplier as a function of (optimizer steps taken, warmup_steps, total_steps, min_lr_ratio)
LR_SCHEDULES: dict[str, Callable[[int, int, int, float], float]] = {"constant": _constant, "cosine": _cosine}
