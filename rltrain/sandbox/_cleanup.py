"""Removing a call's temp dir: without recursion (any depth), without following links, never raising."""

from __future__ import annotations

import os
import stat

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
