"""Checks of a local model directory's files (model.path) before any worker loads them: config.json, the
safetensors shards and their index, each shard's header against its size (a truncated download).

Must not load tensors or build a model: it reads JSON headers and file sizes only, so it runs in milliseconds.
"""

from __future__ import annotations

import json
import os
import struct

from rltrain.utils.errors import UserError

_MAX_HEADER = 100 << 20  # safetensors caps its JSON header at 100 MB


class ModelFilesError(UserError, ValueError):
    """The files of the directory at model.path are missing, truncated or corrupt."""


def _fail(path: str, what: str) -> ModelFilesError:
    return ModelFilesError(f"model.path={path!r}: {what}; fix model.path (a directory with config.json and "
                           "*.safetensors weights) or download the model again")


def safetensors_problem(file: str) -> str | None:
    """None when `file`'s safetensors header is readable and its tensors fit in the file; else why not."""
    try:
        _names(file)
    except ValueError as err:
        return str(err)
    return None


def _names(file: str) -> set[str]:
    size = os.path.getsize(file)
    name = os.path.basename(file)
    if size < 8:
        raise ValueError(f"{name} has {size} bytes, too short for a safetensors file (truncated or empty)")
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > _MAX_HEADER or 8 + n > size:
            raise ValueError(f"{name} is not a complete safetensors file (header of {n} bytes in a file of {size}; "
                             "truncated or not safetensors)")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):
        raise ValueError(f"{name} has an unreadable safetensors header (corrupt)") from None
    if not isinstance(header, dict):
        raise ValueError(f"{name} has an unreadable safetensors header (corrupt)")
    end = 0
    for key, info in header.items():
        if key == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise ValueError(f"{name}: tensor {key!r} has no valid data_offsets (corrupt header)")
        end = max(end, offsets[1])
    if 8 + n + end > size:
        raise ValueError(f"{name} is truncated: its header needs {8 + n + end} bytes, the file has {size} "
                         "(an interrupted download or copy?)")
    return {k for k in header if k != "__metadata__"}


def check_model_dir(path: str) -> None:
    """ModelFilesError unless the local directory `path` holds a readable config.json and complete safetensors
    weights (every shard its index names, each as long as its header says). Not a directory: a Hugging Face id that
    can be fetched (or is cached, offline), else HubModelError with the fix, before any hub client retries
    (utils/hub.py)."""
    if not os.path.isdir(os.path.expanduser(path)):
        from rltrain.utils.hub import check_model_source

        check_model_source(path, "model.path")
        return
    path = os.path.expanduser(path)
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise _fail(path, "no config.json in the directory")
    try:
        with open(cfg_file, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError, RecursionError) as err:
        raise _fail(path, f"config.json is not readable JSON ({err})") from None
    if not isinstance(cfg, dict):
        raise _fail(path, "config.json does not hold a JSON object")
    index_file = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_file):
        try:
            with open(index_file, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            assert isinstance(weight_map, dict)
        except (OSError, ValueError, KeyError, TypeError, AssertionError, RecursionError):
            raise _fail(path, "model.safetensors.index.json is not a readable index (no weight_map)") from None
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(path, s))]
        if missing:
            raise _fail(path, f"{len(missing)} of the {len(shards)} weight files its index names are missing "
                              f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})")
    else:
        shards = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        weight_map = None
    if not shards:
        others = sorted(f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth", ".ckpt")))
        hint = f" (it has {', '.join(others[:3])}: convert them to safetensors)" if others else ""
        raise _fail(path, f"no *.safetensors weight files in the directory{hint}")
    names: set[str] = set()
    for shard in shards:
        try:
            names |= _names(os.path.join(path, shard))
        except (ValueError, OSError) as err:
            raise _fail(path, str(err)) from None
    if weight_map is not None:
        absent = [k for k in weight_map if k not in names]
        if absent:
            raise _fail(path, f"{len(absent)} tensors its index names are in no weight file (e.g. {absent[0]!r})")
