"""Checkpoint files hold data only (utils/plain.py, issue #66): what the trainer saves round-trips exactly through a
file torch's weights-only unpickler reads with no allowlist; a planted pickle whose `__reduce__` would create a marker
file is refused at every reader (the marker never appears); an older rltrain's checkpoint (numpy RNG states, a pickled
Batch) is read through the legacy allowlist and converted; every torch.load of rltrain/ and tools/ is weights-only and nothing there unpickles."""

import ast
import os
import pathlib
import pickle
import random
from collections import OrderedDict

import numpy as np
import pytest
import torch

from rltrain.data.batch import Batch
from rltrain.utils.checkpoint import (CheckpointError, check_resume_checkpoint, read_trainer_state, resume_path,
                                      save_checkpoint)
from rltrain.utils.plain import NotPlainData, from_plain, load_plain, save_plain, to_plain
from rltrain.utils.seeding import rng_state, seed_all, set_rng_state

REPO = pathlib.Path(__file__).resolve().parents[2]


class Planted:
    """What an attacker plants: unpickling it would run a shell command that creates `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _plant(path, marker, **state):
    torch.save({**state, "payload": Planted(marker)}, path)


def _same(a, b):
    """Deep equality that also compares types, numpy dtypes and tensor dtypes (a reference built another way)."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, (np.ndarray, np.generic)):
        assert a.dtype == b.dtype and np.shape(a) == np.shape(b)
        assert np.array_equal(a, b) if a.dtype != object else list(np.ravel(a)) == list(np.ravel(b))
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


def test_a_trainer_state_round_trips_through_a_file_that_weights_only_reads(tmp_path):
    g = np.random.default_rng()
    seed_all(int(g.integers(1 << 30)))
    sd = OrderedDict(w=torch.randn(3, 5), b=torch.randint(0, 9, (7,), dtype=torch.int16))
    sd._metadata = {"": {"version": 1}}  # a module state_dict's version hooks read it
    state = {
        "step": 3, "rng": rng_state(), "model": sd, "frac": 0.25, "name": "x", "none": None, "ids": {1, 5},
        "arrays": [np.array(g.standard_normal((2, 3)), dtype=np.float32), np.arange(5, dtype=np.uint32),
                   np.zeros((0, 4), dtype=np.int8), np.array(["ab", "c"]), np.array([{"k": 1}, None], dtype=object)],
        "scalars": (np.float64(1.5), np.int64(-3), np.bool_(True), np.str_("ok")),
    }
    path = tmp_path / "state.pt"
    save_plain(state, str(path))
    torch.load(path, weights_only=True)  # no allowlist needed: only tensors and plain values in the file
    back = load_plain(str(path))
    _same(back, state)
    assert back["model"]._metadata == {"": {"version": 1}}
    # the RNG state restores the very same draws
    expected = (random.random(), float(np.random.rand()), float(torch.rand(())))
    seed_all(0)
    set_rng_state(back["rng"])
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == expected


def test_what_is_not_plain_data_fails_the_save_naming_where_it_is():
    with pytest.raises(TypeError, match=r"state\['a'\]\[1\]: a .*Planted is not plain data"):
        to_plain({"a": [1, Planted("/nonexistent")]})


def test_a_planted_pickle_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "MARKER"
    path = tmp_path / "worker_rank0.pt"
    _plant(path, marker, step=1)
    with pytest.raises(NotPlainData, match=r"worker_rank0.pt holds objects other than data \(posix.system\).*nothing "
                                           r"in it ran"):
        load_plain(str(path))
    # torch's legacy (non-zip) format and a bare pickle: refused as unreadable, nothing run either
    torch.save({"payload": Planted(marker)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    (tmp_path / "bare.pt").write_bytes(pickle.dumps({"payload": Planted(marker)}))
    for name in ("legacy.pt", "bare.pt"):
        with pytest.raises((NotPlainData, ValueError)):
            load_plain(str(tmp_path / name))
    assert not marker.exists()


def test_a_planted_trainer_state_in_a_sealed_checkpoint_is_refused_at_resume(tmp_path):
    """The manifest's sizes and CRCs are computable by anyone: the checkpoint passes its integrity check, and the
    resume still refuses it, as one line, before anything in it runs."""
    marker = tmp_path / "MARKER"
    path = save_checkpoint(str(tmp_path / "run" / "checkpoints"), 99, lambda tmp: _plant(
        os.path.join(tmp, "trainer_state.pt"), marker, step=99, sampler={}, rng={}))
    for read in (check_resume_checkpoint, read_trainer_state):
        with pytest.raises(CheckpointError, match="holds objects other than data") as info:
            read(path)
        assert "\n" not in str(info.value)
    assert resume_path("auto", str(tmp_path / "run" / "checkpoints")) == path  # found; reading it is refused above
    assert not marker.exists()


def test_a_trainer_state_without_a_newer_field_resumes_with_its_default(tmp_path):
    path = save_checkpoint(str(tmp_path / "c"), 2, lambda tmp: save_plain(
        {"step": 2, "sampler": {"epoch": 0, "position": 8}, "rng": rng_state()}, os.path.join(tmp, "trainer_state.pt")))
    state = read_trainer_state(path)
    assert state["next_group_id"] == 0 and state["step"] == 2 and check_resume_checkpoint(path) == 2
    path = save_checkpoint(str(tmp_path / "d"), 2, lambda tmp: save_plain(
        {"step": 2, "rng": rng_state()}, os.path.join(tmp, "trainer_state.pt")))
    with pytest.raises(CheckpointError, match=r"lacks \['sampler'\] \(written by an older rltrain"):
        read_trainer_state(path)


def _old_batch(n=3):
    g = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    return Batch(prompt_ids=torch.randint(0, 50, (n, 4), generator=g), prompt_mask=torch.ones(n, 4, dtype=torch.long),
                 response_ids=torch.randint(0, 50, (n, 2), generator=g), response_mask=torch.ones(n, 2, dtype=torch.long),
                 loss_mask=torch.ones(n, 2, dtype=torch.long), scores=torch.rand(n, generator=g),
                 non_tensor={"ground_truth": [np.array([i, 2 * i]) for i in range(n)], "data_source": ["a"] * n})


def test_an_older_checkpoint_with_numpy_and_a_pickled_batch_is_read_and_converted(tmp_path):
    """What rltrain wrote before #66: torch.save of numpy RNG states and the asynchronous rollout's Batch objects."""
    seed_all(11)
    batch = _old_batch()
    old = {"step": 4, "next_group_id": 12, "sampler": {"epoch": 0, "position": 4}, "rng": rng_state(),
           "async_rollout": {"batches": [{"step": 5, "batch": batch, "prompts": [{"id": np.int64(3)}]}]}}
    path = tmp_path / "trainer_state.pt"
    torch.save(old, path)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)  # the old format is not plain
    back = load_plain(str(path))
    saved = back["async_rollout"]["batches"][0]
    assert isinstance(saved["batch"], dict)  # the Batch's fields; no method of the class ran
    _same(Batch.from_state(saved["batch"]).to_state(), batch.to_state())
    _same(back["rng"], old["rng"])
    assert saved["prompts"] == [{"id": np.int64(3)}]
    # and the new format writes the Batch as its fields
    save_plain({"b": batch.to_state()}, str(tmp_path / "new.pt"))
    _same(Batch.from_state(load_plain(str(tmp_path / "new.pt"))["b"]).to_state(), batch.to_state())


def test_garbage_numpy_entries_are_refused():
    bad = {"__rltrain_plain__": "numpy", "dtype": "|O", "shape": [1], "bytes": torch.zeros(8, dtype=torch.uint8)}
    with pytest.raises(NotPlainData, match="cannot be read from raw bytes"):
        from_plain(bad)


def _calls(tree, names):
    """(call node, its receiver's source, its name) of the calls named one of `names`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name in names:
                yield node, ast.unparse(f.value) if isinstance(f, ast.Attribute) else "", name


def test_every_torch_load_in_rltrain_and_tools_is_weights_only_and_nothing_unpickles():
    """The class, not the examples: every torch.load of rltrain/ and tools/ passes weights_only=True (checkpoints go
    through load_plain), and no pickle.load(s) reads anything."""
    found = []
    for path in sorted([*REPO.glob("rltrain/**/*.py"), *REPO.glob("tools/**/*.py")]):
        rel, text = path.relative_to(REPO).as_posix(), path.read_text()
        if "load" not in text:
            continue
        for node, owner, name in _calls(ast.parse(text, rel), ("load", "loads")):
            weights_only = next((k.value for k in node.keywords if k.arg == "weights_only"), None)
            safe = isinstance(weights_only, ast.Constant) and weights_only.value is True
            if ((owner, name) == ("torch", "load") and not safe) or \
                    (owner in ("pickle", "cloudpickle", "dill", "joblib") and name in ("load", "loads")):
                found.append(f"{rel}:{node.lineno} {owner}.{name}")
    assert found == []
