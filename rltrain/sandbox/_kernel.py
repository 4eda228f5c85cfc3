"""The kernel boundary of the sandbox child (stdlib only; `_bootstrap` imports it before isolating itself).

B (the bootstrap) calls `isolate` and `private_root`; U (the user process) calls `confine`:

* namespaces: new user, mount, PID, IPC (and network unless allowed) namespaces; B maps only its own uid/gid.
* a private root: a read-only tmpfs holding read-only binds of what Python needs (the stdlib, the system's
  shared libraries, four /dev nodes; the system's programs only with allow_exec) and, at the temp dir's
  path, a size-limited private tmpfs: the only writable place. No host /tmp, /run, /proc, /sys or socket.
* capabilities: bounding set, ambient set and the three sets cleared, securebits locked (no root magic
  on exec), so the code holds no capability in its user namespace either.
* Landlock: read-only access to the stdlib and shared libraries, read-write to the temp dir; no TCP unless
  allowed; no signals or abstract unix sockets out of its domain.
* seccomp: no exec unless allowed, no ptrace, namespaces (unshare, setns, clone with CLONE_NEW*), mounts,
  metadata changes (Landlock does not cover them), kernel interfaces that are mostly attack surface; socket
  families other than unix/inet/inet6 and raw/packet sockets fail with EAFNOSUPPORT / EPERM.
"""

import ctypes
import errno
import os
import sys

NOBODY = 65534
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
NEW_NAMESPACE_FLAGS = (CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID,
                       CLONE_NEWNET)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1, 2, 4, 8, 32, 4096, 16384, 1 << 18)
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
MNT_DETACH = 2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
ROOT_TMPFS = "size=1m,nr_inodes=4096,mode=755"
WORK_INODES = 8192  # files + directories the code may create in its temp dir

LIBRARY_DIRS = ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib")  # what extension modules link
PROGRAM_DIRS = ("/bin", "/usr/bin", "/usr/local/bin")  # only with allow_exec
DEV_NODES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")
IOCTL_FILE_ATTRS = (0x40086602, 0x401C5820)  # FS_IOC_SETFLAGS (chattr), FS_IOC_FSSETXATTR

# Syscalls the user process never needs: reaching into other processes, new namespaces and mounts,
# opening files by handle (bypasses paths), kernel interfaces that are mostly attack surface, and file
# metadata changes, which Landlock does not cover (chmod/chown/utime/xattr work on any file the uid owns).
DENIED_SYSCALLS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp", "process_madvise",
    "chmod", "fchmod", "fchmodat", "fchmodat2", "chown", "fchown", "lchown", "fchownat",
    "utime", "utimes", "futimesat", "utimensat",
    "setxattr", "lsetxattr", "fsetxattr", "removexattr", "lremovexattr", "fremovexattr",
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "fsopen", "fsmount", "fsconfig", "move_mount",
    "open_tree", "mount_setattr", "open_by_handle_at", "name_to_handle_at",
    "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "inotify_init", "inotify_init1", "fanotify_init",  # per-user kernel quotas shared with the host's uid
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
)
SOCKET_FAMILIES = {1: "unix", 2: "inet", 10: "inet6"}  # the only socket(2) domains allowed
SOCKET_TYPES_DENIED = (3, 10)  # SOCK_RAW, SOCK_PACKET (the low 4 bits of the type argument)

PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 28, 47, 4
# NOROOT, NO_SETUID_FIXUP, KEEP_CAPS (locked), NO_CAP_AMBIENT_RAISE: exec never grants capabilities
SECUREBITS = 0x01 | 0x02 | 0x04 | 0x08 | 0x20 | 0x40 | 0x80
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


def libc():
    return ctypes.CDLL(None, use_errno=True)


def _check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, "%s: %s" % (what, os.strerror(err)))


# --- namespaces -----------------------------------------------------------------------------


def isolate(lib, allow_network):
    """B: new user, mount, pid, ipc (+ net) namespaces, mapping only B's own uid and gid.
    Returns (names joined by ',' or None, problem)."""
    was_root = os.getuid() == 0 and os.geteuid() == 0
    if was_root:  # keep euid 0 for file access, make the real uid count against RLIMIT_NPROC
        os.setgroups([])
        os.setresuid(NOBODY, 0, 0)
    euid, egid = os.geteuid(), os.getegid()
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | (0 if allow_network else CLONE_NEWNET)
    names = "user,mnt,pid,ipc" + ("" if allow_network else ",net")
    if lib.unshare(ctypes.c_int(flags)) != 0:
        err = ctypes.get_errno()
        if was_root:
            os.setresuid(0, 0, 0)
        return None, "no %s namespaces (unshare: %s; unprivileged user namespaces are off?)" % (
            names, os.strerror(err))
    try:
        for name, text in (("setgroups", "deny"), ("uid_map", "%d %d 1" % (euid, euid)),
                           ("gid_map", "%d %d 1" % (egid, egid))):
            with open("/proc/self/" + name, "w") as f:
                f.write(text)
    except OSError as e:
        return None, "no uid map in the new user namespace (%s)" % e
    return names, ""


# --- the private root ---------------------------------------------------------------------------


def _mount(lib, src, dst, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(lib.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data)), "mount %s" % dst)


def _locked_flags(path):
    """The flags of the mount holding `path` that a bind of it in a user namespace must keep."""
    f = os.statvfs(path).f_flag
    flags = f & (MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME | MS_NODIRATIME)
    return flags | (MS_RELATIME if f & 4096 else 0)


def visible_paths(cfg):
    """(path, writable-device) pairs the code may see read-only: the stdlib (this -I -S interpreter's
    sys.path), the shared libraries it loads, the four devices; the system's programs only with allow_exec."""
    ro = [p for p in sys.path if p] + list(LIBRARY_DIRS) + ["/etc/ld.so.cache"]
    if cfg["allow_exec"]:
        ro += list(PROGRAM_DIRS) + [os.path.dirname(os.path.realpath(sys.executable))]
    return [(p, False) for p in ro] + [(d, True) for d in DEV_NODES]


def _bind_ro(lib, src, root, device):
    dst = root + src
    if os.path.islink(src):  # e.g. /lib -> usr/lib on merged-/usr systems: the same link
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.symlink(os.readlink(src), dst)
        return
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.close(os.open(dst, os.O_WRONLY | os.O_CREAT, 0o644))
    _mount(lib, src, dst, None, MS_BIND)
    flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | (0 if device else MS_NODEV) | _locked_flags(src)
    _mount(lib, None, dst, None, flags)


def private_root(lib, cfg):
    """B, in its new mount namespace: build the minimal root and pivot into it (see the module docstring).
    The code sees its temp dir at the same path (a fresh tmpfs of cfg["max_disk_bytes"]) holding main.py.
    Returns a description; raises OSError when it cannot."""
    work = cfg["workdir"]
    with open(os.path.join(work, "main.py"), "rb") as f:
        main_py = f.read()
    machine = os.uname().machine
    if machine not in SYS_PIVOT_ROOT:
        raise OSError(errno.ENOSYS, "pivot_root: unknown syscall number on %s" % machine)
    _mount(lib, None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here propagates to the host
    root = work  # the new root's tmpfs goes over the host temp dir (in this namespace only)
    _mount(lib, "tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, ROOT_TMPFS)
    bound = []
    for path, device in sorted(visible_paths(cfg), key=lambda pd: len(pd[0])):
        path = os.path.normpath(path)
        if not os.path.lexists(path) or any(path == b or path.startswith(b.rstrip("/") + "/") for b in bound):
            continue
        _bind_ro(lib, path, root, device)
        bound.append(path)
    os.makedirs(root + work)
    size = "size=%d,nr_inodes=%d,mode=700" % (cfg["max_disk_bytes"], WORK_INODES)
    _mount(lib, "tmpfs", root + work, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, size)
    fd = os.open(root + work + "/main.py", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, main_py)
    finally:
        os.close(fd)
    os.chdir(root)
    _check(lib.syscall(ctypes.c_long(SYS_PIVOT_ROOT[machine]), b".", b"."), "pivot_root")
    _check(lib.umount2(b".", MNT_DETACH), "umount old root")  # the host's tree is gone from this namespace
    os.chdir("/")
    _mount(lib, None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.chdir(work)
    return "root:private(tmpfs %d MiB)" % (cfg["max_disk_bytes"] // 2**20)


# --- capabilities, Landlock, seccomp (U) ------------------------------------------------------


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_capabilities(lib):
    """Clear the bounding and ambient sets, lock securebits (exec grants nothing, not even to uid 0), then
    clear effective/permitted/inheritable. Raises OSError unless every capability is gone."""
    for cap in range(64):
        if lib.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == errno.EINVAL:
            break  # past the last capability this kernel knows
    _check(lib.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient capabilities")
    _check(lib.prctl(PR_SET_SECUREBITS, SECUREBITS, 0, 0, 0), "securebits")
    header, data = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0), (_CapData * 2)()
    _check(lib.capset(ctypes.byref(header), data), "capset")
    _check(lib.capget(ctypes.byref(header), data), "capget")
    if any(d.effective or d.permitted or d.inheritable for d in data):
        raise OSError(errno.EPERM, "capabilities still held after capset")


def _landlock_rules(ll, cfg):
    """(path, rights): read-only for the stdlib and the shared libraries it loads, read-write for the temp
    dir. EXECUTE only with allow_exec, never in the temp dir."""
    A = ll.AccessFS
    read = A.READ_FILE | A.READ_DIR | (A.EXECUTE if cfg["allow_exec"] else A.NONE)
    write = (A.WRITE_FILE | A.TRUNCATE | A.MAKE_REG | A.MAKE_DIR | A.MAKE_SYM | A.MAKE_FIFO | A.MAKE_SOCK
             | A.REMOVE_FILE | A.REMOVE_DIR | A.REFER)
    rules = [(p, A.READ_FILE | (A.WRITE_FILE if p == "/dev/null" else A.NONE)) if dev else (p, read)
             for p, dev in visible_paths(cfg)]
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
    for flag in NEW_NAMESPACE_FLAGS:  # clone(2)'s first argument is its flags (x86_64, arm64, riscv)
        flt.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    flt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")  # flags in memory, not visible to seccomp: libc falls back
    flt.add_rule(sc.ERRNO(errno.EPERM), "prlimit64", sc.Arg(0, sc.NE, 0))  # its own limits only (pid 0)
    for name in ("socket", "socketpair"):
        for family in range(max(SOCKET_FAMILIES) + 1):
            if family not in SOCKET_FAMILIES:
                flt.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), name, sc.Arg(0, sc.EQ, family))
        flt.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), name, sc.Arg(0, sc.GT, max(SOCKET_FAMILIES)))
        for kind in SOCKET_TYPES_DENIED:
            flt.add_rule(sc.ERRNO(errno.EPERM), name, sc.Arg(1, sc.MASKED_EQ, 0xF, kind))
    flt.load()


def confine(cfg, bindings, namespaces, ns_problem, root):
    """U: capabilities, Landlock, seccomp. Returns (description, problems); no problems = isolated: the
    namespaces, the private root, Landlock and seccomp all hold, and no capability is left."""
    done, problems = [], []
    if namespaces:
        done.append("namespaces:" + namespaces)
    else:
        problems.append(ns_problem)
    if root.startswith("root:"):
        done.append(root)
    elif namespaces:
        problems.append(root)
    try:
        drop_capabilities(libc())
        done.append("caps:none")
    except OSError as e:
        problems.append("capabilities not dropped (%s)" % e)
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
            done.append("seccomp(sockets:%s)" % ",".join(SOCKET_FAMILIES[f] for f in sorted(SOCKET_FAMILIES)))
    return " + ".join(done) or "none", problems
