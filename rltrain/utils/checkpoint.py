"""Atomic checkpoints: write into a temp dir, seal it with a manifest (sizes + CRC32), rename into place.

A crash mid-write leaves only a `.tmp_*` dir that is ignored; a sealed checkpoint whose files no longer match
their manifest (truncated, edited) is reported and skipped. This module never knows what the files contain.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import zlib
from typing import Callable

MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_checkpoint(root: str, step: int, write: Callable[[str], None], *, max_to_keep: int = 2) -> str:
    """Call `write(tmp_dir)` to fill a temp dir, seal it with a manifest and rename it to root/step_<step>."""
    os.makedirs(root, exist_ok=True)
    tmp = os.path.join(root, f".tmp_step_{step}_{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    write(tmp)
    files = {}
    for dirpath, _, names in os.walk(tmp):
        for name in names:
            full = os.path.join(dirpath, name)
            with open(full, "rb+") as f:
                os.fsync(f.fileno())
            files[os.path.relpath(full, tmp)] = {"size": os.path.getsize(full), "crc32": _crc32(full)}
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump({"step": step, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    final = os.path.join(root, f"step_{step}")
    if os.path.exists(final):
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    _prune(root, max_to_keep)
    return final


def verify_checkpoint(path: str) -> str | None:
    """None when `path` is a sealed, intact checkpoint; else a short reason."""
    man = os.path.join(path, MANIFEST)
    if not os.path.isfile(man):
        return "no manifest (the write never finished)"
    try:
        with open(man) as f:
            manifest = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        return f"unreadable manifest ({err})"
    for rel, info in manifest.get("files", {}).items():
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            return f"missing file {rel}"
        size = os.path.getsize(full)
        if size != info["size"]:
            return f"file {rel} has {size} bytes, the manifest says {info['size']} (truncated?)"
        if _crc32(full) != info["crc32"]:
            return f"file {rel} does not match its checksum (corrupted)"
    return None


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        if m:
            out.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(out)


def find_latest_valid(root: str, log=None) -> tuple[int, str] | None:
    """The newest intact checkpoint under root; broken ones are reported (and skipped)."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    for step, path in reversed(list_checkpoints(root)):
        reason = verify_checkpoint(path)
        if reason is None:
            return step, path
        log(f"rltrain: skipping checkpoint {path}: {reason}")
    return None


def _prune(root: str, max_to_keep: int) -> None:
    ckpts = list_checkpoints(root)
    for _, path in ckpts[:-max_to_keep] if max_to_keep > 0 else []:
        shutil.rmtree(path, ignore_errors=True)
