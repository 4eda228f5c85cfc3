"""A call's temp dir: named after the process that made it, removed without recursion (any depth), without following
links, never raising; and the temp dirs of dead processes (a SIGKILLed trainer leaves its calls' behind) swept.
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
import threading

WORKDIR_PREFIX = "rltrain-sandbox-"
# rltrain-sandbox-<pid>.<its start time in clock ticks since boot>-<random>: the pid alone could be reused
_WORKDIR_NAME = re.compile(r"^rltrain-sandbox-(\d+)\.(\d+)-")
_swept = threading.Event()
_sweep_lock = threading.Lock()

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def rmtree(path: str, max_steps: int = 10**6) -> None:
    """Remove the tree at `path`, making directories writable where needed. It holds one directory fd at a
    time and walks back up through "..", so neither the depth nor the length of paths matters. What it
    cannot remove it leaves (a stray, never an exception); it gives up after `max_steps` directory visits."""
    chain = []  # names of the directories from path down to the current one
    fd = _open_dir(path, None)
    try:
        for _ in range(max_steps):
            if fd is None:
                break
            sub = _empty_files_and_find_subdir(fd)
            if sub is not None:
                child = _open_dir(sub, fd)
                if child is None:
                    _make_writable(fd, sub)
                    child = _open_dir(sub, fd)
                if child is None:
                    break  # cannot enter it: leave the rest
                os.close(fd)
                fd = child
                chain.append(sub)
                continue
            if not chain:
                break
            parent = _open_dir("..", fd)
            os.close(fd)
            fd = parent
            if fd is None:
                break
            try:
                os.rmdir(chain.pop(), dir_fd=fd)
            except OSError:
                break  # something in it could not be removed: leave the rest
    finally:
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
    try:
        os.rmdir(path)
    except OSError:
        pass


def _empty_files_and_find_subdir(fd: int) -> str | None:
    """Unlink every non-directory in the directory `fd`; return the name of one subdirectory, if any."""
    try:
        with os.scandir(fd) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    return entry.name
                try:
                    os.unlink(entry.name, dir_fd=fd)
                except PermissionError:
                    _make_writable(fd, None)
                    try:
                        os.unlink(entry.name, dir_fd=fd)
                    except OSError:
                        pass
                except OSError:
                    pass
    except OSError:
        pass
    return None


def _open_dir(name: str, dir_fd: int | None) -> int | None:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError:
        return None


def _make_writable(dir_fd: int, name: str | None) -> None:
    """chmod u+rwx the directory `dir_fd` itself (name None) or its subdirectory `name`."""
    try:
        if name is None:
            os.chmod(dir_fd, stat.S_IRWXU)
        else:
            os.chmod(name, stat.S_IRWXU, dir_fd=dir_fd, follow_symlinks=False)
    except (OSError, NotImplementedError):
        pass


def _start_time(pid: int) -> str | None:
    """The start time of process `pid` (field 22 of /proc/<pid>/stat), or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[19].decode() if len(fields) > 19 else None


def workdir_prefix() -> str:
    """The tempfile prefix of this process's call dirs: rltrain-sandbox-<pid>.<start time>-."""
    pid = os.getpid()
    return f"{WORKDIR_PREFIX}{pid}.{_start_time(pid) or 0}-"


def sweep_stale_workdirs(parent: str | None = None) -> list[str]:
    """Remove the call dirs under `parent` (default: the temp dir) that belong to this user and whose process is gone
    (no process with that pid, or one started at another time); returns them. Others' dirs, live processes' dirs and
    anything not named by workdir_prefix are left alone. Never raises."""
    parent = parent or tempfile.gettempdir()
    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    if not os.path.isdir("/proc/self"):
        return removed  # cannot tell live processes from dead ones
    for entry in entries:
        m = _WORKDIR_NAME.match(entry.name)
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not m or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            continue
        if _start_time(int(m.group(1))) == m.group(2):
            continue  # its process lives
        rmtree(entry.path)
        if not os.path.lexists(entry.path):
            removed.append(entry.path)
    return removed


def sweep_once() -> list[str]:
    """sweep_stale_workdirs at this process's first sandbox call (later calls: nothing)."""
    if _swept.is_set():
        return []
    with _sweep_lock:
        if _swept.is_set():
            return []
        try:
            return sweep_stale_workdirs()
        finally:
            _swept.set()
