"""Atomic checkpoints: write into a temp dir, seal it with a manifest (sizes + CRC32), rename into place.

A crash mid-write leaves only a `.tmp_*` dir that is ignored (and removed by `clean_stale_tmp` once the run
directory's lock says no live run writes there); a sealed checkpoint whose files no longer match their manifest
(truncated, edited) is reported and skipped. A full disk or an unwritable directory is a `CheckpointError`
naming the directory. Checkpoints are written writable by their owner only, and a resume refuses one that another
local user owns or can write (`check_checkpoint_owner`); their files hold data only (utils/plain.py). This module
never knows what the files contain (except `read_trainer_state`'s look at the driver's trainer_state.pt).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import stat
import sys
import zlib
from contextlib import contextmanager
from typing import Callable

from rltrain.utils.errors import UserError
from rltrain.utils.safefs import (UnsafePathError, check_private_dir, describe, make_dirs, open_nofollow,
                                  unwritable_reason)

MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_DIR = re.compile(r"^\.tmp_step_(\d+)_(\d+)$")
# a failed write: the errnos of a full disk, a quota, a size limit, an I/O error, and what torch.save (its zip
# stream writer) or a Ray worker leaves of them in text
_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO)
_WRITE_FAILED_TEXT = ("No space left on device", "Disk quota exceeded", "File too large", "file write failed",
                      "unexpected pos", "PytorchStreamWriter failed", "Input/output error")
_LOW_FREE_BYTES = 256 << 20  # less than this left: call it a full disk
_VERIFY_NOTICE_BYTES = 4 << 30  # checksumming more than this says so first
TRAINER_STATE = "trainer_state.pt"
_TRAINER_STATE_KEYS = ("step", "sampler", "rng")
# fields newer than the oldest trainer states this version resumes, and the value a state written before them takes:
# group ids need only be distinct within a step (next_group_id only grows), so 0 is as good as the saved one
TRAINER_STATE_DEFAULTS = {"next_group_id": 0}


class CheckpointError(UserError, OSError):
    """A checkpoint directory that cannot be written (read-only, a file, disk full) or a checkpoint given to
    trainer.resume that cannot be used; the message names the directory and the fix."""


def _free_bytes(path: str) -> int | None:
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path or ".").free
    except OSError:
        return None


def _free_space(path: str) -> str:
    free = _free_bytes(path)
    if free is None:
        return "free space unknown"
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    total = shutil.disk_usage(path or ".").total
    return f"{free / 2**30:.2f} GiB free of {total / 2**30:.1f} GiB"


def check_writable(root: str, key: str = "trainer.ckpt_dir") -> None:
    """Raise CheckpointError unless checkpoints can be written under `root` (created if missing): called at
    the start of a run, so a read-only directory or a file in its place is found before any training step."""
    fix = f"set {key} to a writable directory (or fix its permissions)"
    if os.path.exists(root) and not os.path.isdir(root):
        raise CheckpointError(f"checkpoint directory {root} is a file, not a directory; remove it or {fix}")
    try:
        make_dirs(root)
    except OSError as err:
        raise CheckpointError(f"checkpoint directory {root} is not writable ({err.strerror or err}); {fix}") from None
    why = unwritable_reason(root)
    if why is not None:
        raise CheckpointError(f"checkpoint directory {root} is not writable ({why}); {fix}")


def _write_failure(err: BaseException) -> str | None:
    """'disk full' / 'write failed' when `err` (or what it wraps) is a failed file write, else None (a bug)."""
    for _ in range(8):
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return "disk full"
        if (isinstance(err, OSError) and err.errno in _WRITE_ERRNOS) or any(t in str(err) for t in _WRITE_FAILED_TEXT):
            return "write failed"
        nxt = getattr(err, "cause", None) or err.__cause__ or err.__context__
        if not isinstance(nxt, BaseException) or nxt is err:
            return None
        err = nxt
    return None


def _is_not_writable(err: BaseException) -> bool:
    return isinstance(err, OSError) and err.errno in (errno.EACCES, errno.EPERM, errno.EROFS)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, owned by someone else
        return True
    return True


def clean_stale_tmp(root: str, log=None) -> list[str]:
    """Remove `.tmp_step_*` dirs of crashed runs under `root` and return them. Call it only while holding the
    run's lock (utils/rundir.py): no other live rltrain run writes under `root` then. A temp dir whose writer's
    pid is still alive on this machine is kept all the same."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    removed = []
    if not os.path.isdir(root):
        return removed
    for name in sorted(os.listdir(root)):
        m = _TMP_DIR.match(name)
        if not m or _pid_alive(int(m.group(2))):
            continue
        path = os.path.join(root, name)
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            removed.append(path)
    if removed:
        log(f"rltrain: removed {len(removed)} unfinished checkpoint dir(s) of crashed runs under {root}: "
            + ", ".join(os.path.basename(p) for p in removed))
    return removed


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
    """Call `write(tmp_dir)` to fill a temp dir, seal it with a manifest and rename it to root/step_<step>.
    A full disk or an unwritable directory raises CheckpointError naming `root` (and the free space); the temp
    dir is removed and the checkpoints already there are kept."""
    tmp = os.path.join(root, f".tmp_step_{step}_{os.getpid()}")
    try:
        return _save(root, tmp, step, write, max_to_keep)
    except Exception as err:
        failure = _write_failure(err)
        free_at_failure = _free_bytes(root) if failure else None
        shutil.rmtree(tmp, ignore_errors=True)
        if failure == "disk full" or (failure and free_at_failure is not None and free_at_failure < _LOW_FREE_BYTES):
            raise CheckpointError(
                f"saving the checkpoint of step {step} under {root} failed: the disk is full ({_free_space(root)} "
                f"after removing the partial write; {_first_line(err)}). Nothing of step {step} was kept; earlier "
                "checkpoints are intact. Free space there, lower trainer.max_ckpt_to_keep, or set trainer.ckpt_dir "
                "to a disk with room, then rerun with trainer.resume=auto") from None
        if failure:
            raise CheckpointError(
                f"saving the checkpoint of step {step} under {root} failed: a file could not be written "
                f"({_first_line(err)}; {_free_space(root)}). Nothing of step {step} was kept; earlier checkpoints "
                "are intact. Check the disk (space, quota, file size limit) or set trainer.ckpt_dir to another "
                "one, then rerun with trainer.resume=auto") from None
        if _is_not_writable(err) or (isinstance(err, OSError) and os.path.exists(root) and not os.path.isdir(root)):
            raise CheckpointError(f"saving the checkpoint of step {step} under {root} failed ({_first_line(err)}); "
                                  "set trainer.ckpt_dir to a writable directory") from None
        raise


def _first_line(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else type(err).__name__)[:300]


def _save(root: str, tmp: str, step: int, write: Callable[[str], None], max_to_keep: int) -> str:
    make_dirs(root)
    shutil.rmtree(tmp, ignore_errors=True)
    os.mkdir(tmp, 0o755)
    write(tmp)
    files = {}
    for dirpath, subdirs, names in os.walk(tmp):
        for name in subdirs:
            _drop_write_by_others(os.path.join(dirpath, name))
        for name in names:
            full = os.path.join(dirpath, name)
            _drop_write_by_others(full)  # whatever the writers' umask: a resume refuses files others can write
            with open(full, "rb+") as f:
                os.fsync(f.fileno())
            files[os.path.relpath(full, tmp)] = {"size": os.path.getsize(full), "crc32": _crc32(full)}
    with open_nofollow(os.path.join(tmp, MANIFEST), "w") as f:
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


def _drop_write_by_others(path: str) -> None:
    mode = os.lstat(path).st_mode
    if mode & 0o022 and not os.path.islink(path):
        os.chmod(path, stat.S_IMODE(mode) & ~0o022)


def verify_checkpoint(path: str) -> str | None:
    """None when `path` is a sealed, intact checkpoint; else a short reason."""
    man = os.path.join(path, MANIFEST)
    if not os.path.isfile(man):
        return "no manifest (the write never finished, or not a checkpoint of this format)"
    try:
        with open(man, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError, RecursionError) as err:
        return f"unreadable manifest ({err})"
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not files:
        return "the manifest lists no files (not a checkpoint of this format)"
    sizes = [i.get("size") if isinstance(i, dict) else i for i in files.values()]
    total = sum(n for n in sizes if isinstance(n, int))
    if total > _VERIFY_NOTICE_BYTES:  # long work shows progress
        print(f"rltrain: verifying checkpoint {path} ({total / 2**30:.1f} GiB)", file=sys.stderr, flush=True)
    for rel, info in files.items():
        # an older manifest holds sizes only (no crc32), or a bare size: its sizes are checked
        size_want, crc_want = (info, None) if isinstance(info, int) else \
            (info.get("size"), info.get("crc32")) if isinstance(info, dict) else (None, None)
        if not isinstance(size_want, int):
            return f"the manifest's entry for {rel} has no size (not a checkpoint of this format)"
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            return f"missing file {rel}"
        size = os.path.getsize(full)
        if size != size_want:
            return f"file {rel} has {size} bytes, the manifest says {size_want} (truncated?)"
        if crc_want is not None and _crc32(full) != crc_want:
            return f"file {rel} does not match its checksum (corrupted)"
    return None


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    if not os.path.isdir(root):
        return []
    try:
        names = os.listdir(root)
    except OSError:
        return []
    out = []
    for name in names:
        m = _STEP_DIR.match(name)
        if m and os.path.isdir(os.path.join(root, name)):
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


def resume_path(mode: str, root: str, upto: str | None = None) -> str | None:
    """The checkpoint `trainer.resume=mode` continues from: None for `never`, and for `auto` when `root` holds no
    intact checkpoint (broken ones are reported and skipped); a PATH is verified first (CheckpointError naming
    why it cannot be resumed). Either is refused (UnsafePathError) when another local user owns or can write it or a
    directory above it up to `upto` (the run directory; `check_checkpoint_owner`). One rule for the RL trainer and
    SFT."""
    if mode == "never":
        return None
    if mode == "auto":
        if not list_checkpoints(root):
            return None
        check_private_dir(root, what="checkpoint directory", key="trainer.ckpt_dir", upto=upto)
        found = find_latest_valid(root)
        if found is not None:
            check_checkpoint_owner(found[1], upto=root)
        return None if found is None else found[1]
    if os.path.isdir(mode):
        check_checkpoint_owner(mode)
    reason = verify_checkpoint(mode) if os.path.isdir(mode) else "not a directory"
    if reason is not None:
        raise CheckpointError(f"trainer.resume={mode!r} is not a usable checkpoint: {reason}; give a step_N "
                              "directory written by rltrain, or trainer.resume=auto / never")
    return mode


def check_checkpoint_owner(path: str, upto: str | None = None) -> None:
    """UnsafePathError unless the checkpoint `path` (a step_N dir), everything in it and the directories above it up
    to `upto` (default: the run directory of the <run>/checkpoints/step_N layout, else its parent) are this user's
    and writable by no one else: another user who could write there could plant or change what a resume reads."""
    if upto is None:
        root = os.path.dirname(os.path.abspath(path))
        upto = os.path.dirname(root) if os.path.basename(root) == "checkpoints" else root
    real = check_private_dir(path, what="checkpoint", key="trainer.resume", upto=upto)
    me = os.geteuid()
    for dirpath, subdirs, names in os.walk(real):
        for name in subdirs + names:
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode) or st.st_uid != me or st.st_mode & 0o022:
                link = " (a symbolic link)" if stat.S_ISLNK(st.st_mode) else ""
                fix = f"run `chmod -R go-w {real}` if only you wrote it, else start fresh" if not link and \
                    st.st_uid == me else "start fresh"
                raise UnsafePathError(f"the checkpoint {path} holds {full}, {describe(st)}{link}: rltrain resumes "
                                      f"only from files that are yours and that no one else can write; {fix} "
                                      "(trainer.resume=never)")


def _prune(root: str, max_to_keep: int) -> None:
    ckpts = list_checkpoints(root)
    for _, path in ckpts[:-max_to_keep] if max_to_keep > 0 else []:
        shutil.rmtree(path, ignore_errors=True)


def check_resume_checkpoint(path: str) -> int:
    """The step of the checkpoint at `path` (trainer.resume=PATH), or CheckpointError saying why it cannot be
    resumed: not a directory, broken (manifest, sizes, CRC32), or a trainer_state.pt this version cannot read;
    UnsafePathError when another local user owns or can write it (check_checkpoint_owner)."""
    key = f"trainer.resume={path!r}"
    fix = "give a step_N directory written by rltrain, or trainer.resume=auto / never"
    if not os.path.isdir(path):
        raise CheckpointError(f"{key} is not a directory; {fix}")
    if not os.path.isfile(os.path.join(path, MANIFEST)) and list_checkpoints(path):
        newest = list_checkpoints(path)[-1][1]
        raise CheckpointError(f"{key} is a checkpoint root, not a checkpoint; give one of its step_N directories "
                              f"(e.g. {newest}) or trainer.ckpt_dir={path} with trainer.resume=auto")
    check_checkpoint_owner(path)
    reason = verify_checkpoint(path)
    if reason is not None:
        raise CheckpointError(f"{key} is not a usable checkpoint: {reason}; {fix}")
    return int(read_trainer_state(path, key)["step"])


def read_trainer_state(path: str, key: str | None = None) -> dict:
    """The driver's state in checkpoint `path` (read as data only: utils/plain.py), with the value of each field newer
    than it (TRAINER_STATE_DEFAULTS); CheckpointError, one line, when it is missing, unreadable, holds objects other
    than data or lacks a field this version needs. `key` names the checkpoint in the message."""
    from rltrain.utils.plain import load_plain

    key = key or f"the checkpoint {path}"
    fix = "give a step_N directory written by rltrain, or trainer.resume=auto / never"
    state_file = os.path.join(path, TRAINER_STATE)
    if not os.path.isfile(state_file):
        raise CheckpointError(f"{key} has no {TRAINER_STATE} (not a checkpoint of the RL trainer); {fix}")
    try:
        state = load_plain(state_file)
    except UserError as err:  # utils/plain.NotPlainData: the message says what it holds
        raise CheckpointError(f"{key}: {err}") from None
    except Exception as err:  # truncated zip, garbage
        raise CheckpointError(f"{key}: {state_file} cannot be read ({_first_line(err)}); {fix}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{key}: {state_file} holds a {type(state).__name__}, not the trainer's state; {fix}")
    missing = [k for k in _TRAINER_STATE_KEYS if k not in state]
    if missing:
        raise CheckpointError(f"{key}: its {TRAINER_STATE} lacks {missing} (written by an older rltrain, a format "
                              f"this version cannot resume); {fix}")
    if isinstance(state["step"], bool) or not isinstance(state["step"], int):
        raise CheckpointError(f"{key}: its {TRAINER_STATE} holds step={state['step']!r}, not a number; {fix}")
    return {**TRAINER_STATE_DEFAULTS, **state}


@contextmanager
def loading_checkpoint(path: str):
    """Around loading a checkpoint into the workers: a failure (a model of another shape, another parallel
    layout, a file this version cannot read) becomes a CheckpointError naming `path` instead of a traceback."""
    try:
        yield
    except UserError:
        raise
    except Exception as err:
        text = str(err)
        if "worker_rank" in text and ("No such file" in text or "FileNotFoundError" in text):
            why = "it was saved by another number of workers (parallel layout: trainer.n_gpus_per_node, nnodes, " \
                  "actor.*_parallel_size)"
            fix = "resume with the layout it was saved with, or start fresh (trainer.resume=never, or another " \
                  "run directory)"
        elif "size mismatch" in text or "Missing key" in text or "Unexpected key" in text:
            why = "it holds a model of another shape or parallel layout than this config builds"
            fix = "resume with the model.* and parallelism settings it was saved with, or start fresh " \
                  "(trainer.resume=never, or another run directory)"
        else:
            why = "this version cannot load it"
            fix = "give a checkpoint written by this rltrain version, or start fresh with trainer.resume=never"
        detail = next((ln.strip() for ln in text.splitlines() if "size mismatch" in ln), None) or _first_line(err)
        raise CheckpointError(f"cannot resume from checkpoint {path}: {why} ({detail[:300]}); {fix}") from None
