"""The temp dirs of sandbox calls a SIGKILLed trainer left behind (issue #66): the next process's first call sweeps
those of this user whose process is gone (no such pid, or the pid now names a process started at another time), and
leaves live processes', other users' and foreign names alone. No kernel isolation needed: naming and sweeping only."""

import os
import subprocess
import sys

import pytest

from rltrain.sandbox._cleanup import _WORKDIR_NAME, _start_time, sweep_stale_workdirs, workdir_prefix


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_dead_processes_call_dirs_of_this_user_are_swept_and_nothing_else(tmp_path):
    me, now = os.getpid(), _start_time(os.getpid())
    dead = _dead_pid()
    names = {
        "dead": f"rltrain-sandbox-{dead}.{now}-abc",  # its process is gone (SIGKILLed trainer)
        "reused": f"rltrain-sandbox-{me}.{int(now) - 1}-abc",  # this pid, but another process started then
        "live": f"{workdir_prefix()}abc",  # this process's own call in progress
        "foreign": "rltrain-sandbox-0a1b2c3d",  # an older rltrain's name (no owner to check): kept
        "other": "some-dir",
    }
    for key, name in names.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "main.py").write_text("print(1)")
    (tmp_path / names["dead"] / "sub").mkdir()
    os.symlink("/etc", tmp_path / names["dead"] / "sub" / "link")  # removed as a link, never followed
    if os.geteuid() == 0:
        theirs = tmp_path / f"rltrain-sandbox-{dead}.{now}-theirs"
        theirs.mkdir()
        os.chown(theirs, 65534, 65534)
    assert _WORKDIR_NAME.match(workdir_prefix()) and workdir_prefix().startswith(f"rltrain-sandbox-{me}.")
    removed = sweep_stale_workdirs(str(tmp_path))
    assert sorted(removed) == sorted(str(tmp_path / names[k]) for k in ("dead", "reused"))
    left = set(os.listdir(tmp_path))
    assert left >= {names["live"], names["foreign"], names["other"]} and not left & {names["dead"], names["reused"]}
    assert os.path.isdir("/etc")
    if os.geteuid() == 0:
        assert theirs.name in left


@pytest.mark.sandbox
def test_a_call_sweeps_what_a_killed_run_left(tmp_path, monkeypatch):
    from rltrain.sandbox import _cleanup, run_code

    stale = tmp_path / f"rltrain-sandbox-{_dead_pid()}.1-left"
    stale.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    monkeypatch.setattr(_cleanup, "_swept", type(_cleanup._swept)())  # this process has not swept yet
    assert run_code("print(6 * 7)", timeout_s=20).stdout.strip() == "42"
    assert not stale.exists()
