import random

import numpy as np
import torch

from rltrain.utils.plain import load_plain, save_plain
from rltrain.utils.seeding import rng_state, seed_all, set_rng_state


def draws():
    return random.random(), float(np.random.rand()), float(torch.rand(()))


def test_seed_all_makes_all_three_generators_repeat():
    seed_all(123)
    first = draws()
    seed_all(123)
    assert draws() == first
    seed_all(124)
    assert draws() != first


def test_set_rng_state_replays_the_draws_after_rng_state():
    seed_all(5)
    draws()
    saved = rng_state()
    expected = draws()
    seed_all(99)
    set_rng_state(saved)
    assert draws() == expected


def test_rng_state_survives_a_checkpoint_file(tmp_path):
    seed_all(7)
    saved = rng_state()
    expected = draws()
    save_plain({"rng": saved}, str(tmp_path / "s.pt"))  # as checkpoints write it: data only (utils/plain.py)
    set_rng_state(load_plain(str(tmp_path / "s.pt"))["rng"])
    assert draws() == expected
