"""The audit hook of the sandbox child (stdlib only; `_bootstrap` imports it before isolating itself).

An in-process guard that runs whatever the kernel allowed: it gives the code clear messages (sockets,
running programs, ctypes, reads outside the stdlib and its temp dir, writes outside its temp dir, signals to
other processes, forks beyond the limit, sub-interpreters). It is not the boundary: Python documents audit
hooks as no security measure. With `allow_unisolated` on a machine without the kernel layer it is the only
guard, so it also refuses what would leave it behind: sub-interpreters (a sub-interpreter has no hooks).
"""

import os
import posix
import stat as stat_mod
import sys

RUNNING_PROGRAMS = ("subprocess.", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "os.forkpty", "pty.")
BLOCKED_PREFIXES = ("ctypes.", "resource.", "gc.get_", "sys.remote_exec")
WRITE_EVENTS = frozenset(("os.remove", "os.rmdir", "os.mkdir", "os.truncate", "os.mkfifo", "os.mknod",
                          "shutil.rmtree"))
# refused by the kernel layer's seccomp filter everywhere, its own temp dir included: say so here
METADATA_EVENTS = frozenset(("os.chmod", "os.chown", "os.utime", "os.chflags", "os.lchflags", "os.setxattr",
                             "os.removexattr"))
TWO_PATH_EVENTS = frozenset(("os.rename", "os.link", "shutil.move", "shutil.copytree"))
# A sub-interpreter runs without this interpreter's audit hooks: refuse the modules that make one, and the
# creation itself (the event fires in the creating interpreter, whatever module asked for it).
SUBINTERPRETER_MODULES = ("_xxsubinterpreters", "_xxinterpchannels", "_xxinterpqueues", "_interpreters",
                          "_interpchannels", "_interpqueues", "concurrent.interpreters", "_testcapi",
                          "_testinternalcapi", "_testmultiphase", "_testsinglephase")
SUBINTERPRETER_EVENTS = frozenset(("cpython.PyInterpreterState_New",))
READ_FILES = frozenset(("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random"))


def _resolver():
    """A path -> real absolute path function (symlinks followed by hand). Everything it calls is bound
    now so that monkeypatching os/posixpath cannot blind it."""
    lstat, readlink, getcwd, fsdecode, s_islnk = posix.lstat, posix.readlink, posix.getcwd, os.fsdecode, \
        stat_mod.S_ISLNK

    def resolve(path):
        path = fsdecode(path)
        # A relative path starts from the cwd, which getcwd() returns resolved: only the relative part is
        # looked up, relative to the cwd (cheap at any depth), while it stays below the cwd.
        parts = [] if path.startswith("/") else [p for p in getcwd().split("/") if p]
        base = len(parts)
        below_cwd = base > 0
        seen = 0
        todo = path.split("/")[::-1]
        while todo:
            part = todo.pop()
            if part in ("", "."):
                continue
            if part == "..":
                if parts:
                    parts.pop()
                below_cwd = below_cwd and len(parts) >= base
                continue
            parts.append(part)
            cur = "/".join(parts[base:]) if below_cwd else "/" + "/".join(parts)
            try:
                is_link = s_islnk(lstat(cur).st_mode)
            except OSError:
                is_link = False
            if is_link:
                seen += 1
                if seen > 40:
                    raise PermissionError("sandbox: too many symlinks in %r" % path)
                target = readlink(cur)
                parts.pop()
                if target.startswith("/"):
                    parts, below_cwd = [], False
                todo.extend(target.split("/")[::-1])
        return "/" + "/".join(parts)

    return resolve


def _path_checks(cfg):
    """(check_read, check_write): raise PermissionError for paths outside what the code may read/write."""
    resolve = _resolver()
    tmp = os.path.realpath(cfg["workdir"])
    read_roots = tuple(sorted(set([tmp] + [os.path.realpath(p) for p in sys.path if p])))  # -I -S: the stdlib

    def under(p, roots):
        return any(p == r or p.startswith(r.rstrip("/") + "/") for r in roots)

    def check_write(path):
        if isinstance(path, int):
            return
        p = resolve(path)
        if not under(p, (tmp,)):
            raise PermissionError("sandbox: writing outside the sandbox directory is not allowed: %r" % p)

    def check_read(path):
        if path is None:
            path = "."
        if isinstance(path, int):
            return
        p = resolve(path)
        if not (p in READ_FILES or under(p, read_roots)):
            raise PermissionError("sandbox: reading %r is not allowed (outside the sandbox directory)" % p)

    return check_read, check_write


def _fork_tokens(max_processes):
    """A function that takes one fork token or raises. The tokens live in a pipe shared by all descendants
    (the kernel bounds processes where it can; this bound also holds where it cannot)."""
    tok_r, tok_w = os.pipe()
    os.write(tok_w, b"x" * max(max_processes - 1, 0))
    os.close(tok_w)
    os.set_blocking(tok_r, False)
    read = posix.read

    def take():
        try:
            got = read(tok_r, 1)
        except OSError:
            got = b""
        if not got:
            raise PermissionError("sandbox: process limit reached (max_processes)")

    return take


def install(cfg):
    """Add the hook to this interpreter (before the user's code runs)."""
    check_read, check_write = _path_checks(cfg)
    take_fork_token = _fork_tokens(cfg["max_processes"])
    allow_network = bool(cfg["allow_network"])
    blocked_prefixes = (() if cfg["allow_exec"] else RUNNING_PROGRAMS) + BLOCKED_PREFIXES
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    getpid = posix.getpid

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            is_write = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & write_flags)
            (check_write if is_write else check_read)(path)
        elif event == "import":
            if isinstance(args[0], str) and args[0].startswith(SUBINTERPRETER_MODULES):
                raise ImportError("sandbox: %s is not allowed (sub-interpreters run without this sandbox's "
                                  "checks)" % args[0])
        elif event in SUBINTERPRETER_EVENTS:
            raise PermissionError("sandbox: creating sub-interpreters is not allowed")
        elif event.startswith("socket."):
            if not allow_network:
                raise PermissionError("sandbox: network access is disabled (%s)" % event)
        elif event == "os.fork":
            take_fork_token()
        elif event in ("os.kill", "os.killpg"):
            if event == "os.killpg" or args[0] != getpid():
                raise PermissionError("sandbox: sending signals to other processes is not allowed")
        elif event in ("os.listdir", "os.scandir", "os.chdir"):
            check_read(args[0] if args else None)
        elif event in WRITE_EVENTS:
            check_write(args[0])
        elif event in METADATA_EVENTS:
            raise PermissionError("sandbox: changing file modes, owners, times or attributes is not allowed (%s)"
                                  % event)
        elif event in TWO_PATH_EVENTS or event == "os.symlink":
            check_write(args[1])
            if event != "os.symlink":
                check_write(args[0])
        elif event.startswith(blocked_prefixes):
            raise PermissionError("sandbox: %s is not allowed" % event)

    sys.addaudithook(hook)
