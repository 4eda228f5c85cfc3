"""Checkpoint failures a user causes end as a CheckpointError (a UserError: exit 2) naming the directory, never
a traceback: an unwritable or file-shaped directory (found at start), a failed write (disk full), a resume from a
broken, truncated, older-format or foreign checkpoint. Older manifests (sizes only) are accepted; temp dirs of
crashed runs are removed, those of live writers kept."""

import errno
import json
import os
import subprocess
import sys

import pytest
import torch

from rltrain.utils import checkpoint as ck
from rltrain.utils.checkpoint import (CheckpointError, check_resume_checkpoint, check_writable, clean_stale_tmp,
                                      find_latest_valid, loading_checkpoint, save_checkpoint, verify_checkpoint)
from rltrain.utils.errors import UserError


def _state(step=1):
    return {"step": step, "next_group_id": 0, "sampler": {"epoch": 0, "position": 0}, "rng": {}}


def _writer(step=1, payload=1000):
    def write(tmp):
        torch.save({"actor": {"model": {"w": torch.zeros(payload)}}}, os.path.join(tmp, "worker_rank0.pt"))
        torch.save(_state(step), os.path.join(tmp, "trainer_state.pt"))
    return write


def test_checkpoint_error_is_a_user_error():
    assert issubclass(CheckpointError, UserError)


def test_check_writable_refuses_a_file_in_place_of_the_directory(tmp_path):
    f = tmp_path / "ckpt"
    f.write_text("x")
    with pytest.raises(CheckpointError, match=f"checkpoint directory {f} is a file"):
        check_writable(str(f))


def test_check_writable_refuses_an_unwritable_directory(tmp_path, monkeypatch):
    # root ignores permission bits, so the refusal the OS gives is simulated where the probe file is written
    real_open = os.open

    def deny(path, *a, **kw):
        if ".write_probe_" in str(path):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *a, **kw)

    monkeypatch.setattr(os, "open", deny)
    with pytest.raises(CheckpointError, match=r"is not writable \(Permission denied\); set trainer.ckpt_dir"):
        check_writable(str(tmp_path / "ckpt"))


def test_check_writable_on_a_read_only_file_system():
    if os.access("/sys", os.W_OK) and not os.path.ismount("/sys"):
        pytest.skip("no read-only file system to try")
    with pytest.raises(CheckpointError, match="/sys/rltrain_ckpt_probe"):
        check_writable("/sys/rltrain_ckpt_probe")


def test_check_writable_passes_and_leaves_nothing(tmp_path):
    check_writable(str(tmp_path / "a" / "b"))
    assert os.listdir(tmp_path / "a" / "b") == []


def test_disk_full_during_save_is_a_clear_error_and_keeps_the_last_checkpoint(tmp_path):
    """torch.save onto a device that is always full (/dev/full) fails with torch's own words
    ('unexpected pos ...'): the error names the directory and the free space, the temp dir is gone and
    step_1 is intact."""
    root = str(tmp_path / "ckpt")
    save_checkpoint(root, 1, _writer(1))

    def write_full(tmp):
        os.symlink("/dev/full", os.path.join(tmp, "worker_rank0.pt"))
        torch.save({"w": torch.zeros(100_000)}, os.path.join(tmp, "worker_rank0.pt"))

    with pytest.raises(CheckpointError) as info:
        save_checkpoint(root, 2, write_full)
    msg = str(info.value)
    assert f"saving the checkpoint of step 2 under {root} failed" in msg and "GiB free of" in msg, msg
    assert "earlier checkpoints are intact" in msg
    assert sorted(os.listdir(root)) == ["step_1"]
    assert find_latest_valid(root)[0] == 1


def test_enospc_is_called_a_full_disk(tmp_path):
    root = str(tmp_path / "ckpt")

    def write(tmp):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(CheckpointError, match=f"under {root} failed: the disk is full"):
        save_checkpoint(root, 3, write)
    assert os.listdir(root) == []


def test_a_write_failure_with_little_space_left_is_called_a_full_disk(tmp_path, monkeypatch):
    """What a Ray worker hands back of torch.save on a full disk: a RuntimeError's text."""
    monkeypatch.setattr(ck, "_free_bytes", lambda path: 1 << 20)

    def write(tmp):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")

    with pytest.raises(CheckpointError, match="the disk is full"):
        save_checkpoint(str(tmp_path / "c"), 1, write)


def test_other_errors_in_the_write_still_propagate(tmp_path):
    def write(tmp):
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        save_checkpoint(str(tmp_path / "c"), 1, write)
    assert os.listdir(tmp_path / "c") == []  # and no temp dir is left


def test_manifest_without_crc32_is_checked_by_size(tmp_path):
    root = str(tmp_path / "ckpt")
    path = save_checkpoint(root, 4, _writer(4))
    man = os.path.join(path, "manifest.json")
    data = json.load(open(man))
    data["files"] = {k: {"size": v["size"]} for k, v in data["files"].items()}  # the older format
    json.dump(data, open(man, "w"))
    assert verify_checkpoint(path) is None
    assert find_latest_valid(root) == (4, path)
    victim = os.path.join(path, "worker_rank0.pt")
    open(victim, "r+b").truncate(100)
    assert "truncated" in verify_checkpoint(path)


def test_stale_tmp_dirs_of_dead_writers_are_removed_live_ones_kept(tmp_path):
    root = tmp_path / "ckpt"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    (root / f".tmp_step_3_{dead_pid}").mkdir(parents=True)
    (root / f".tmp_step_3_{dead_pid}" / "worker_rank0.pt").write_bytes(b"partial")
    (root / f".tmp_step_5_{os.getpid()}").mkdir()  # this process (a live writer)
    (root / "step_2").mkdir()
    logs = []
    removed = clean_stale_tmp(str(root), log=logs.append)
    assert removed == [str(root / f".tmp_step_3_{dead_pid}")]
    assert sorted(os.listdir(root)) == [f".tmp_step_5_{os.getpid()}", "step_2"]
    assert len(logs) == 1 and "removed 1 unfinished checkpoint dir" in logs[0]


def test_resume_path_problems_are_user_errors(tmp_path):
    root = str(tmp_path / "ckpt")
    path = save_checkpoint(root, 2, _writer(2))
    assert check_resume_checkpoint(path) == 2
    with pytest.raises(CheckpointError, match="is not a directory"):
        check_resume_checkpoint(str(tmp_path / "nope"))
    with pytest.raises(CheckpointError, match="is a checkpoint root, not a checkpoint"):
        check_resume_checkpoint(root)
    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(CheckpointError, match="no manifest"):
        check_resume_checkpoint(str(bare))
    # truncated
    victim = os.path.join(path, "worker_rank0.pt")
    data = open(victim, "rb").read()
    open(victim, "wb").write(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        check_resume_checkpoint(path)
    # corrupt, same size
    open(victim, "wb").write(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(CheckpointError, match="checksum"):
        check_resume_checkpoint(path)


def test_resume_from_an_older_format_trainer_state_is_a_user_error(tmp_path):
    def write(tmp):
        torch.save({"step": 1, "rng": {}}, os.path.join(tmp, "trainer_state.pt"))  # no sampler / next_group_id

    path = save_checkpoint(str(tmp_path / "c"), 1, write)
    # next_group_id has a default (TRAINER_STATE_DEFAULTS: tests/utils/test_plain.py); the sampler has none
    with pytest.raises(CheckpointError, match=r"lacks \['sampler'\].*older rltrain"):
        check_resume_checkpoint(path)

    def write_garbage(tmp):
        with open(os.path.join(tmp, "trainer_state.pt"), "wb") as f:
            f.write(b"not a torch file")

    path = save_checkpoint(str(tmp_path / "d"), 1, write_garbage)
    with pytest.raises(CheckpointError, match="trainer_state.pt cannot be read"):
        check_resume_checkpoint(path)


def test_loading_a_checkpoint_of_another_shape_is_a_user_error():
    a, b = torch.nn.Linear(4, 8), torch.nn.Linear(4, 16)
    with pytest.raises(CheckpointError, match=r"cannot resume from checkpoint /c/step_1: it holds a model of another "
                                              r"shape.*size mismatch for weight"):
        with loading_checkpoint("/c/step_1"):
            b.load_state_dict(a.state_dict())


def test_loading_a_checkpoint_of_another_worker_count_is_a_user_error(tmp_path):
    with pytest.raises(CheckpointError, match=r"saved by another number of workers \(parallel layout"):
        with loading_checkpoint(str(tmp_path)):
            torch.load(os.path.join(str(tmp_path), "worker_rank1.pt"))
