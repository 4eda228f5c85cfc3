"""Directories no other local user can tamper with: who owns a run or checkpoint directory and who can write it,
files opened without following links, directories made without group or other write.

The rule (docs/security.md): a directory rltrain writes into or resumes from is owned by this process's user and
writable by no one else, and so is every directory above it up to where the check stops (a directory above it may
also be root's, or group/world-writable with the sticky bit, as /tmp is); a symbolic link on the way is this user's
or root's. Inside such a directory only this user can plant a link; files are opened with O_NOFOLLOW all the same,
so a link in place of one is refused, never followed. Must not know what the files hold.
"""

from __future__ import annotations

import errno
import os
import stat

from rltrain.utils.errors import UserError

_WRITE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH
_OPEN_FLAGS = {"r": os.O_RDONLY, "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
               "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND}


class UnsafePathError(UserError, PermissionError):
    """A run or checkpoint directory (or a file in one) that another local user owns or can write, or a symbolic
    link where rltrain reads or writes a file; the message names the path, its owner and mode, and the fix."""


def _user(uid: int) -> str:
    import pwd

    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def describe(st: os.stat_result) -> str:
    """'owned by alice (uid 1001), mode 0775' for an lstat/stat result."""
    return f"owned by {_user(st.st_uid)}, mode {stat.S_IMODE(st.st_mode):04o}"


def _others_can_write(st: os.stat_result) -> bool:
    return bool(st.st_mode & _WRITE_BY_OTHERS)


def _ancestors(real: str, upto: str | None) -> list[str]:
    """The directories above `real` to check: up to `upto` (inclusive) when it is above `real`, else the parent."""
    parent = os.path.dirname(real)
    stop = os.path.realpath(upto) if upto is not None else None
    if stop is None or not (real + os.sep).startswith(stop.rstrip(os.sep) + os.sep) or stop == real:
        return [parent] if parent != real else []
    out = []
    while True:
        out.append(parent)
        if parent == stop or os.path.dirname(parent) == parent:
            return out
        parent = os.path.dirname(parent)


def _check_links(path: str, what: str, key: str) -> None:
    """Every symbolic link along `path` (absolute) is this user's or root's: a link another user planted in a
    shared directory (/tmp) would send rltrain's files somewhere of their choosing."""
    me = os.geteuid()
    prefix = os.sep
    for part in path.strip(os.sep).split(os.sep):
        prefix = os.path.join(prefix, part)
        try:
            st = os.lstat(prefix)
        except OSError:
            return  # not there (yet): nothing further down exists either
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in (me, 0):
            raise UnsafePathError(f"the {what} {path} goes through the symbolic link {prefix}, {describe(st)}: another "
                                  f"local user may have planted it; give a path without it ({key}=...)")


def check_private_dir(path: str, *, what: str, key: str, upto: str | None = None, names: tuple[str, ...] = ()) -> str:
    """The real path of the directory `path` after checking that no other local user can change what is in it:
    it is owned by this process's user and writable by no one else; every directory above it up to `upto`
    (default: its parent) is this user's or root's and writable by no one else unless sticky (/tmp); links along
    the path are this user's or root's; and each of `names` that exists in it is no symbolic link and is this
    user's. `what` and `key` name the directory and its config key in the message (UnsafePathError)."""
    me = os.geteuid()
    absolute = os.path.abspath(path)
    _check_links(absolute, what, key)
    real = os.path.realpath(absolute)
    st = os.stat(real)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError(f"the {what} {path} is not a directory; {key}=... must name a directory")
    if st.st_uid != me:
        raise UnsafePathError(f"the {what} {path} is {describe(st)}: another local user owns it and could plant "
                              f"files or links there; use a directory of your own ({key}=...)")
    if _others_can_write(st):
        raise UnsafePathError(f"the {what} {path} is {describe(st)}: other local users can write it and could plant "
                              f"files or links there; run `chmod go-w {real}` if only you wrote in it, else use a new "
                              f"directory of your own ({key}=...)")
    for parent in _ancestors(real, upto):
        pst = os.stat(parent)
        if pst.st_uid not in (me, 0) or (_others_can_write(pst) and not pst.st_mode & stat.S_ISVTX):
            raise UnsafePathError(f"the {what} {path} lies in {parent}, {describe(pst)}: another local user could "
                                  f"replace what is in it; use a directory whose parents only you (or root) can write "
                                  f"({key}=...)")
    for name in names:
        check_not_link(os.path.join(real, name))
    return real


def check_not_link(path: str) -> None:
    """UnsafePathError when `path` is a symbolic link or another user's file (nothing when it does not exist)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePathError(f"{path} is a symbolic link, {describe(st)}: rltrain does not read or write through "
                              "links in its run and checkpoint directories (one planted there would send the write to "
                              "another file); remove it")
    if st.st_uid != os.geteuid():
        raise UnsafePathError(f"{path} is {describe(st)}, not yours: another local user put it there; remove it")


def open_nofollow(path: str, mode: str = "r", *, encoding: str | None = "utf-8"):
    """open(path, mode) (mode r/w/a, with b for bytes) that refuses a symbolic link as the last component instead of
    following it; new files get mode 0644 (no group or other write, whatever the umask)."""
    flags = _OPEN_FLAGS[mode.replace("b", "")] | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as err:
        if err.errno == errno.ELOOP:
            check_not_link(path)  # raises UnsafePathError naming the link and its owner
        raise
    return os.fdopen(fd, mode, encoding=None if "b" in mode else encoding)


def write_text(path: str, text: str) -> None:
    """Replace the file at `path` with `text` (utf-8), never through a link (open_nofollow)."""
    with open_nofollow(path, "w") as f:
        f.write(text)


def make_dirs(path: str) -> None:
    """os.makedirs(path, exist_ok=True) whose new directories get mode 0755 whatever the umask (os.makedirs gives
    intermediate ones 0777 minus the umask: group-writable under the common umask 002)."""
    path = os.path.abspath(path)
    missing = []
    while not os.path.lexists(path):
        missing.append(path)
        path = os.path.dirname(path)
    for p in reversed(missing):
        try:
            os.mkdir(p, 0o755)
        except FileExistsError:
            pass


def unwritable_reason(path: str) -> str | None:
    """None when a file can be created in the directory `path`; else why not (the OS's words)."""
    probe = os.path.join(path, f".write_probe_{os.getpid()}")
    try:
        with open_nofollow(probe, "w") as f:
            f.write("rltrain")
        os.remove(probe)
    except OSError as err:
        return err.strerror or str(err)
    return None
