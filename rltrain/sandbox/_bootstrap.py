"""Child side of the sandbox: isolates itself, forks a reaper and the user process, runs the code.
Runs as `python -I -S -B -u -c <this file's text> <config json>`; it must import nothing but the stdlib
(and the two kernel bindings, landlockpy and pyseccomp, from the paths the parent names).

Process tree (pids as the parent sees them):

    B  bootstrap, started by the parent in a new session. Imports the kernel bindings, then tries
       unshare(USER|NET|PID); when root, first sets only its *real* uid to nobody so that
       RLIMIT_NPROC is enforced per sandbox (root's real uid bypasses it; ucounts are per user
       namespace).
    R  reaper, in its own process group; PID 1 of the new PID namespace when there is one, else a
       child subreaper. Waits for U, then kills whatever U left behind (the kernel does this for a
       namespace init when it exits), and reports U's end on the status pipe.
    U  user process: rlimits (address space, CPU, file size, processes, core); then the kernel
       boundary, inherited by everything U starts or execs: Landlock (read-only: the stdlib and the
       system's shared libraries; read-write: its temp dir; nothing else; no TCP unless allowed;
       no signals out of its domain) and a seccomp filter (no execve/execveat unless allowed, no
       chmod/chown/utime/xattr, which Landlock does not cover, no ptrace, namespaces, mounts,
       open-by-handle, io_uring, bpf, keyrings, modules). Without
       any of the three, U refuses to run the code unless `allow_unisolated`. Last an audit
       hook (always on: friendly messages for sockets, running programs, reads outside an
       allow-list, writes outside its temp dir, forks beyond the limit), then exec of main.py.

The status pipe (fd cfg["status_fd"]) carries JSON lines: {"isolation": ..., "isolated": ...} (from U),
{"reaper": pid}, {"exit": code} or {"signal": signum}. U closes it before running user code.
"""

import errno
import json
import os
import signal
import sys

EXIT_MEMORY = 251  # U exits with this when the user code died of MemoryError
EXIT_REFUSED = 250  # U exits with this, before running anything, when isolation is missing and required
NOBODY = 65534
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def _status(fd, **msg):
    os.write(fd, (json.dumps(msg) + "\n").encode())


def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _load_bindings(paths):
    """landlockpy and pyseccomp from the parent's site-packages (this interpreter runs -I -S); each
    name maps to the module or to the reason it is unavailable. Imported before any namespace exists
    (pyseccomp runs ldconfig while importing, which must not become PID 1 of the new namespace)."""
    saved = list(sys.path)
    sys.path.extend(paths)  # after the stdlib, so nothing in site-packages can shadow it
    found = {}
    try:
        for name in ("landlockpy", "pyseccomp"):
            try:
                found[name] = __import__(name)
            except Exception as e:  # a missing package, or pyseccomp without libseccomp.so.2
                found[name] = "%s is unavailable (%s: %s)" % (name, type(e).__name__, e)
    finally:
        sys.path[:] = saved
    return found


def _isolate(libc, allow_network):
    """Layer 1a: new user, pid, ipc (+ net) namespaces. Returns (names joined by ',' or None, problem)."""
    import ctypes

    was_root = os.getuid() == 0 and os.geteuid() == 0
    if was_root:  # keep euid 0 for file access, make the real uid count against RLIMIT_NPROC
        os.setresuid(NOBODY, 0, 0)
    flags = CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWIPC | (0 if allow_network else CLONE_NEWNET)
    names = "user,pid,ipc" + ("" if allow_network else ",net")
    if libc.unshare(ctypes.c_int(flags)) == 0:
        return names, ""
    err = ctypes.get_errno()
    if was_root:
        os.setresuid(0, 0, 0)
    return None, "no %s namespaces (unshare: %s; unprivileged user namespaces are off?)" % (names, os.strerror(err))


# Syscalls the user process never needs: reaching into other processes, new namespaces and mounts,
# opening files by handle (bypasses paths), kernel interfaces that are mostly attack surface, and file
# metadata changes, which Landlock does not cover (chmod/chown/utime/xattr work on any file the uid owns,
# even one opened read-only or not at all).
DENIED_SYSCALLS = (
    "ptrace", "process_vm_readv", "process_vm_writev",
    "chmod", "fchmod", "fchmodat", "fchmodat2", "chown", "fchown", "lchown", "fchownat",
    "utime", "utimes", "futimesat", "utimensat",
    "setxattr", "lsetxattr", "fsetxattr", "removexattr", "lremovexattr", "fremovexattr",
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "fsopen", "fsmount", "move_mount", "open_tree",
    "open_by_handle_at", "name_to_handle_at",
    "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
)
LIBRARY_DIRS = ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib")  # what extension modules link
PROGRAM_DIRS = ("/bin", "/usr/bin", "/usr/local/bin")  # only with allow_exec
DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")
IOCTL_FILE_ATTRS = (0x40086602, 0x401C5820)  # FS_IOC_SETFLAGS (chattr), FS_IOC_FSSETXATTR


def _landlock_rules(ll, cfg):
    """(path, rights): read-only for the stdlib (this -I -S interpreter's sys.path) and the shared
    libraries it loads, read-write for the temp dir. EXECUTE only with allow_exec, never in the temp dir."""
    A = ll.AccessFS
    read = A.READ_FILE | A.READ_DIR | (A.EXECUTE if cfg["allow_exec"] else A.NONE)
    write = (A.WRITE_FILE | A.TRUNCATE | A.MAKE_REG | A.MAKE_DIR | A.MAKE_SYM | A.MAKE_FIFO | A.MAKE_SOCK
             | A.REMOVE_FILE | A.REMOVE_DIR | A.REFER)
    ro = list(sys.path) + list(LIBRARY_DIRS) + ["/etc/ld.so.cache"]
    if cfg["allow_exec"]:
        ro += list(PROGRAM_DIRS) + [os.path.dirname(os.path.realpath(sys.executable))]
    rules = [(p, read) for p in ro]
    rules += [(d, A.READ_FILE | (A.WRITE_FILE if d == "/dev/null" else A.NONE)) for d in DEVICES]
    rules.append((cfg["workdir"], A.READ_FILE | A.READ_DIR | write))
    return rules


def _apply_landlock(ll, cfg):
    """Returns the Landlock ABI enforced (0: the kernel has none)."""
    if ll.abi_version() < 1:
        return 0
    A = ll.AccessFS
    file_rights = A.READ_FILE | A.WRITE_FILE | A.TRUNCATE | A.EXECUTE | A.IOCTL_DEV
    handled_net = ll.AccessNet.NONE if cfg["allow_network"] else None  # None: every right the kernel knows
    with ll.Ruleset(handled_net=handled_net, scoped=ll.Scope.SIGNAL | ll.Scope.ABSTRACT_UNIX_SOCKET) as rules:
        for path, rights in _landlock_rules(ll, cfg):
            if not os.path.exists(path):
                continue
            rules.allow_path(path, rights if os.path.isdir(path) else rights & file_rights)
        rules.restrict()  # also sets no_new_privs
        return rules.abi_version


def _apply_seccomp(sc, cfg, landlock_abi):
    flt = sc.SyscallFilter(sc.ALLOW)
    names = DENIED_SYSCALLS + (() if cfg["allow_exec"] else ("execve", "execveat"))
    if landlock_abi < 3:  # Landlock handles truncate(2) from ABI 3 on
        names += ("truncate",)
    for name in names:
        try:
            flt.add_rule(sc.ERRNO(errno.EPERM), name)
        except OSError:  # not a syscall on this architecture (or unknown to this libseccomp)
            pass
    for cmd in IOCTL_FILE_ATTRS:  # ioctl needs no write access for these: refuse by command
        flt.add_rule(sc.ERRNO(errno.EPERM), "ioctl", sc.Arg(1, sc.EQ, cmd))
    flt.load()


def _confine(cfg, bindings, namespaces, ns_problem):
    """Layer 1b on U: Landlock, then seccomp. Returns (description, problems); no problems = isolated:
    the namespaces, Landlock and seccomp all hold (seccomp closes what Landlock leaves open: metadata
    changes, and exec with a clear EPERM)."""
    done, problems = [], []
    if namespaces:
        done.append("namespaces:" + namespaces)
    else:
        problems.append(ns_problem)
    abi = 0
    ll = bindings["landlockpy"]
    if isinstance(ll, str):
        problems.append(ll + "; install rltrain's dependencies")
    else:
        try:
            abi = _apply_landlock(ll, cfg)
        except Exception as e:
            problems.append("Landlock failed (%s: %s)" % (type(e).__name__, e))
        else:
            if abi:
                done.append("landlock:%d" % abi)
            else:
                problems.append("no Landlock in this kernel (needs Linux >= 5.13 with landlock in its LSM list)")
    sc = bindings["pyseccomp"]
    if isinstance(sc, str):
        problems.append(sc + "; install rltrain's dependencies and the system's libseccomp2")
    else:
        try:
            _apply_seccomp(sc, cfg, abi)
        except Exception as e:
            problems.append("seccomp failed (%s: %s)" % (type(e).__name__, e))
        else:
            done.append("seccomp")
    return " + ".join(done) or "none", problems


def _children(pid):
    try:
        with open("/proc/%d/task/%d/children" % (pid, pid)) as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _reap_all_descendants(me):
    """Kill and reap every process reparented to this subreaper until none is left."""
    while True:
        kids = _children(me)
        if not kids:
            return
        for k in kids:
            try:
                os.kill(k, signal.SIGKILL)
            except OSError:
                pass
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break


def _set_limits(cfg, in_user_namespace):
    import resource

    def both(name, value):
        resource.setrlimit(getattr(resource, name), (value, value))

    mem = cfg["memory_mb"] * 2**20
    both("RLIMIT_AS", mem)
    both("RLIMIT_DATA", mem)
    cpu = cfg["cpu_s"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU, then SIGKILL a second later
    both("RLIMIT_FSIZE", cfg["max_file_bytes"])
    both("RLIMIT_CORE", 0)
    both("RLIMIT_NOFILE", 256)
    if in_user_namespace:  # counted per user namespace: B, R, U and U's own children/threads
        both("RLIMIT_NPROC", cfg["max_processes"] + 2)


def _install_audit_hook(cfg):
    """Layer 2: an in-process guard that runs whatever the OS allowed. A guard, not a wall."""
    import posix
    import stat as stat_mod

    tmp = os.path.realpath(cfg["workdir"])
    read_roots = [tmp] + [os.path.realpath(p) for p in sys.path if p]  # -I -S: the stdlib only
    read_roots = tuple(sorted(set(read_roots)))
    read_files = frozenset(("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random"))
    allow_network = bool(cfg["allow_network"])
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    # Bound total forks with a token pipe shared by all descendants (the kernel NPROC limit is
    # the real bound where user namespaces exist; this one also holds where they do not).
    tok_r, tok_w = os.pipe()
    os.write(tok_w, b"x" * max(cfg["max_processes"] - 1, 0))
    os.close(tok_w)
    os.set_blocking(tok_r, False)
    # Functions the hook calls are bound now so that monkeypatching os/posixpath cannot blind it.
    lstat, readlink, getcwd, fsdecode, read = posix.lstat, posix.readlink, posix.getcwd, os.fsdecode, posix.read
    s_islnk = stat_mod.S_ISLNK
    running_programs = ("subprocess.", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "os.forkpty", "pty.")
    blocked_prefixes = (() if cfg["allow_exec"] else running_programs) + (
        "ctypes.", "resource.", "gc.get_", "sys.remote_exec")
    write_events = frozenset(("os.remove", "os.rmdir", "os.mkdir", "os.truncate", "os.mkfifo",
                              "os.mknod", "shutil.rmtree"))
    # refused by the kernel layer's seccomp filter everywhere, its own temp dir included: say so here
    metadata_events = frozenset(("os.chmod", "os.chown", "os.utime", "os.chflags", "os.lchflags",
                                 "os.setxattr", "os.removexattr"))
    two_path_events = frozenset(("os.rename", "os.link", "shutil.move", "shutil.copytree"))

    def resolve(path):
        path = fsdecode(path)
        if not path.startswith("/"):
            path = getcwd() + "/" + path
        parts, seen = [], 0
        todo = path.split("/")[::-1]
        while todo:
            part = todo.pop()
            if part in ("", "."):
                continue
            if part == "..":
                if parts:
                    parts.pop()
                continue
            parts.append(part)
            cur = "/" + "/".join(parts)
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
                    parts = []
                todo.extend(target.split("/")[::-1])
        return "/" + "/".join(parts)

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
        if not (p in read_files or under(p, read_roots)):
            raise PermissionError("sandbox: reading %r is not allowed (outside the sandbox directory)" % p)

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            is_write = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & write_flags)
            (check_write if is_write else check_read)(path)
        elif event.startswith("socket."):
            if not allow_network:
                raise PermissionError("sandbox: network access is disabled (%s)" % event)
        elif event == "os.fork":
            try:
                got = read(tok_r, 1)
            except OSError:
                got = b""
            if not got:
                raise PermissionError("sandbox: process limit reached (max_processes)")
        elif event in ("os.kill", "os.killpg"):
            if event == "os.killpg" or args[0] != posix.getpid():
                raise PermissionError("sandbox: sending signals to other processes is not allowed")
        elif event in ("os.listdir", "os.scandir", "os.chdir"):
            check_read(args[0] if args else None)
        elif event in write_events:
            check_write(args[0])
        elif event in metadata_events:
            raise PermissionError("sandbox: changing file modes, owners, times or attributes is not allowed (%s)"
                                  % event)
        elif event in two_path_events or event in ("os.symlink",):
            check_write(args[1])
            if event != "os.symlink":
                check_write(args[0])
        elif event.startswith(blocked_prefixes):
            raise PermissionError("sandbox: %s is not allowed" % event)

    sys.addaudithook(hook)


def _run_user_code(cfg):
    import traceback

    main_path = os.path.join(cfg["workdir"], "main.py")
    with open(main_path, encoding="utf-8") as f:
        source = f.read()
    sys.argv = [main_path]
    code_globals = {"__name__": "__main__", "__file__": main_path, "__builtins__": __builtins__}
    exit_code = 0
    try:
        compiled = compile(source, main_path, "exec")
        if cfg["audit"]:
            _install_audit_hook(cfg)
        exec(compiled, code_globals)
    except SystemExit as e:
        if e.code is None:
            exit_code = 0
        elif isinstance(e.code, int):
            exit_code = e.code & 0xFF
        else:
            print(e.code, file=sys.stderr)
            exit_code = 1
    except MemoryError:
        try:
            traceback.print_exc()
        except BaseException:
            pass
        exit_code = EXIT_MEMORY
    except BaseException as e:
        tb = e.__traceback__
        if tb is not None and tb.tb_frame.f_code is _run_user_code.__code__:
            tb = tb.tb_next  # hide this frame: the model should see only its own code
        try:
            traceback.print_exception(type(e), e, tb)
        except BaseException:
            pass
        exit_code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(exit_code)


def main():
    cfg = json.loads(sys.argv[1])
    status_fd = cfg["status_fd"]
    libc = _libc()
    libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != cfg["parent_pid"]:
        os._exit(1)  # the parent died before the death signal was armed
    bindings, namespaces, ns_problem = {}, None, "kernel isolation disabled"
    if cfg["os_isolation"]:
        bindings = _load_bindings(cfg["binding_paths"])
        namespaces, ns_problem = _isolate(libc, cfg["allow_network"])
    in_ns = namespaces is not None

    reaper = os.fork()
    if reaper == 0:  # R
        os.setpgid(0, 0)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if not in_ns:
            libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        user = os.fork()
        if user == 0:  # U
            libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            _set_limits(cfg, in_ns)
            if cfg["os_isolation"]:
                isolation, problems = _confine(cfg, bindings, namespaces, ns_problem)
            else:
                isolation, problems = "none", [ns_problem]
            _status(status_fd, isolation=isolation, isolated=not problems, problems=problems)
            if problems and not cfg["allow_unisolated"]:
                os._exit(EXIT_REFUSED)
            os.close(status_fd)
            os.closerange(3, 256)  # nothing opened before the kernel layer stays reachable (RLIMIT_NOFILE)
            _run_user_code(cfg)
        _, wstatus = os.waitpid(user, 0)
        if not in_ns:
            _reap_all_descendants(os.getpid())
        if os.WIFSIGNALED(wstatus):
            _status(status_fd, signal=os.WTERMSIG(wstatus))
        else:
            _status(status_fd, exit=os.WEXITSTATUS(wstatus))
        os._exit(0)  # as PID 1 of a namespace, the kernel now kills everything left in it
    _status(status_fd, reaper=reaper)
    os.waitpid(reaper, 0)
    os._exit(0)


if __name__ == "__main__":
    main()
