"""Checkpoint files hold data only: tensors and plain values, written with torch.save and read back with torch's
weights-only unpickler, which builds nothing but tensors, dicts, lists, tuples, sets, numbers, strings, bytes and
torch's dtypes, sizes and devices; a file that names any other class or function is refused before anything in it
runs (a planted pickle whose `__reduce__` would run a command is only ever read as data, or refused).

`save_plain`/`load_plain` are the one writer and reader of every checkpoint file (the trainer's state, each worker's
shard, SFT's). What is not plain gets a plain form here: a numpy array or scalar (RNG states, per-row values) is a
tagged dict of its dtype, shape and bytes; a dataclass is converted by its owner (Batch.to_state). Anything else is
our bug and fails the save, naming where it sits. A checkpoint of an older rltrain, which pickled numpy arrays and the
asynchronous rollout's Batch as objects, is read with an allowlist of data-only rebuilders (numpy's array, scalar and
dtype; the Batch as a bare record of its fields) and converted on load; a file naming anything else is refused.
Must not know what the files mean (utils/checkpoint.py and the owners of each state do).
"""

from __future__ import annotations

import pickle
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from rltrain.utils.errors import UserError

TAG = "__rltrain_plain__"
_ATOMS = (type(None), bool, int, float, complex, str, bytes, torch.Tensor, torch.dtype, torch.Size, torch.device)
# classes of older checkpoints read as records of their fields (pickled dataclasses): module.name -> stand-in
_LEGACY_RECORDS = ("rltrain.data.batch.Batch",)


class NotPlainData(UserError, ValueError):
    """A checkpoint file that holds objects other than data (code, or classes rltrain never writes)."""


class LegacyRecord:
    """Stand-in an older checkpoint's pickled dataclass is read into: its fields only, no method of the class runs."""


def to_plain(obj: Any, where: str = "state") -> Any:
    """`obj` with numpy arrays and scalars as tagged dicts; TypeError naming the path for anything not plain."""
    if isinstance(obj, (np.ndarray, np.generic)):  # first: np.float64 and np.str_ subclass float and str
        return _array(obj, where)
    if isinstance(obj, _ATOMS):
        return obj
    if type(obj) in (dict, OrderedDict):
        out = type(obj)((k, to_plain(v, f"{where}[{k!r}]")) for k, v in obj.items())
        if hasattr(obj, "_metadata"):  # a module's state_dict: load_state_dict's version hooks read it
            out._metadata = to_plain(obj._metadata, f"{where}._metadata")
        return out
    if type(obj) in (list, tuple, set):
        return type(obj)(to_plain(v, f"{where}[{i}]") for i, v in enumerate(obj))
    raise TypeError(f"{where}: a {type(obj).__module__}.{type(obj).__qualname__} is not plain data; checkpoints hold "
                    "tensors and plain values only (give it a plain form where it is saved)")


def _array(a: np.ndarray | np.generic, where: str) -> dict:
    arr = np.asarray(a)
    if arr.dtype.fields is not None:
        raise TypeError(f"{where}: a structured numpy array is not plain data")
    out = {TAG: "numpy", "dtype": arr.dtype.str, "shape": list(arr.shape), "scalar": isinstance(a, np.generic)}
    if arr.dtype.hasobject:
        out["dtype"], out["items"] = "object", to_plain(arr.ravel().tolist(), where)
    else:
        out["bytes"] = torch.from_numpy(np.frombuffer(arr.tobytes(), dtype=np.uint8).copy())
    return out


def from_plain(obj: Any) -> Any:
    """Inverse of to_plain (numpy arrays and scalars rebuilt); LegacyRecords of older files become dicts."""
    if isinstance(obj, dict):
        if obj.get(TAG) == "numpy":
            return _rebuild_array(obj)
        out = type(obj)((k, from_plain(v)) for k, v in obj.items())
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata
        return out
    if type(obj) in (list, tuple, set):
        return type(obj)(from_plain(v) for v in obj)
    if isinstance(obj, LegacyRecord):
        return {k: from_plain(v) for k, v in vars(obj).items()}
    return obj


def _rebuild_array(d: dict) -> np.ndarray | np.generic:
    shape = tuple(int(n) for n in d["shape"])
    if d["dtype"] == "object":
        arr = np.empty(len(d["items"]), dtype=object)
        arr[:] = [from_plain(v) for v in d["items"]]
        arr = arr.reshape(shape)
    else:
        dtype = np.dtype(str(d["dtype"]))
        if dtype.hasobject or dtype.fields is not None:
            raise NotPlainData(f"a numpy entry of dtype {dtype} cannot be read from raw bytes")
        arr = np.frombuffer(d["bytes"].numpy().tobytes(), dtype=dtype).reshape(shape).copy()
    return arr[()] if d.get("scalar") else arr


def save_plain(obj: Any, path: str) -> None:
    """torch.save of `obj`'s plain form (to_plain) at `path`."""
    torch.save(to_plain(obj), path)


def load_plain(path: str, *, mmap: bool = False) -> Any:
    """What save_plain wrote at `path`, read by torch's weights-only unpickler (an older rltrain's file through the
    legacy allowlist). NotPlainData, naming the file and what it holds, for anything else. mmap: the tensors mapped
    from the file, read as they are touched (a resume that takes a few ranges of many ranks' files)."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError:
        try:
            with torch.serialization.safe_globals(_legacy_allowlist()):
                data = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except pickle.UnpicklingError:
            named = _globals_named(path)
            if named is None:
                raise ValueError(f"{path} is not a readable torch file (truncated or corrupt)") from None
            raise NotPlainData(f"{path} holds objects other than data ({named}); it was not written by rltrain, or "
                               "was changed since, and is not loaded (nothing in it ran). Resume from a checkpoint "
                               "you wrote, or start fresh (trainer.resume=never)") from None
    return from_plain(data)


def _legacy_allowlist() -> list:
    """numpy's data-only rebuilders (arrays, scalars, dtypes; numpy 1 and 2 names) and LegacyRecord for rltrain's
    dataclasses. An object array's items are unpickled by the same restricted unpickler."""
    core = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray
    allowed: list = [np.ndarray, np.dtype, core._reconstruct, core.scalar]
    allowed += [(core._reconstruct, "numpy.core.multiarray._reconstruct"),
                (core.scalar, "numpy.core.multiarray.scalar")]
    allowed += [type(np.dtype(c)) for c in "?bBhHiIlLqQefdgFDGSUO"]  # each dtype's class (its BUILD step)
    allowed += [(LegacyRecord, name) for name in _LEGACY_RECORDS]
    return allowed


def _globals_named(path: str) -> str | None:
    """The classes and functions a pickle names, read without running it; None when it is no readable torch file."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # noqa: BLE001 (not even a readable archive)
        return None
    return ", ".join(names[:5]) + (", ..." if len(names) > 5 else "") if names else "unknown objects"
