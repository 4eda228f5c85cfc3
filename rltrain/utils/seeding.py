"""Process-wide RNG seeding and the RNG state a checkpoint carries (python `random`, numpy, torch CPU).

One place for the three generators so the trainer, SFT and the engine seed and restore them alike;
it never touches per-call generators (`torch.Generator`) that callers own.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_all(seed: int) -> None:
    """Seed python's `random`, numpy's global generator and torch's default generator with `seed`."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """The three global generators' states, as stored under "rng" in a checkpoint's trainer_state.pt:
    {"torch": ByteTensor, "numpy": tuple, "python": tuple}."""
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    """Restore the generators from a dict written by `rng_state`."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
