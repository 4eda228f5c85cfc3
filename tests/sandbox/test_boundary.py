"""The classes of issue #38, each as hostile programs through `run_code`: host unix sockets, cleanup that
raised, the audit hook left behind by a sub-interpreter, socket families beyond the empty network
namespace, capabilities in the user namespace, new namespaces through clone(), stat() of host paths, and
limits per call (memory of all processes together, the temp dir's size) instead of per process.

Most cases run with the audit hook off too (`_kernel_only`): the kernel layer must hold by itself.
"""

import os
import secrets
import shutil
import signal
import socket
import tempfile
import threading

import pytest

import rltrain.sandbox.runner as runner_module
from rltrain.sandbox import _cgroup, run_code
from rltrain.sandbox._cleanup import rmtree
from rltrain.sandbox.runner import _run

pytestmark = pytest.mark.sandbox

TMP = tempfile.gettempdir()
PROJECT_FILE = os.path.realpath(runner_module.__file__)


def _args(**kw):
    args = dict(timeout_s=15.0, memory_mb=256, cpu_s=None, max_output_bytes=8192, max_processes=8,
                allow_network=False, stdin=None, max_file_bytes=2**20)
    args.update(kw)
    return args


def _kernel_only(code, **kw):
    return _run(code, audit=False, **_args(**kw))


def _both(code, **kw):
    """The full stack and the kernel layer alone."""
    return [("full", _run(code, **_args(**kw))), ("kernel", _kernel_only(code, **kw))]


# --- 1. host services on pathname unix sockets ----------------------------------------------------


class _Listener:
    """A host service on a pathname unix socket (as a Ray raylet): records every connection it accepts."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="rltrain-sock-")
        os.chmod(self.dir, 0o755)
        self.path = os.path.join(self.dir, "raylet")
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(self.path)
        os.chmod(self.path, 0o777)
        self.sock.listen(8)
        self.sock.settimeout(0.1)
        self.accepted, self._stop = [], False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except (socket.timeout, OSError):
                continue
            self.accepted.append(conn.recv(100))
            conn.sendall(b"hello from the host")
            conn.close()

    def close(self):
        self._stop = True
        self._thread.join(timeout=5)
        self.sock.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def listener():
    lst = _Listener()
    yield lst
    lst.close()


CONNECT = """
import os, socket
print("visible", os.path.exists({path!r}), flush=True)
s = socket.socket(socket.AF_UNIX)
try:
    s.connect({path!r})
    s.sendall(b"ping")
    print("CONNECTED", s.recv(100), flush=True)
except OSError as e:
    print("refused", e.strerror, flush=True)
"""


def test_host_unix_socket_is_invisible_and_unreachable(listener):
    code = CONNECT.format(path=listener.path)
    for layer, r in _both(code) + [("network", _kernel_only(code, allow_network=True))]:
        assert r.isolated, r.isolation
        assert "CONNECTED" not in r.stdout, (layer, r.stdout)
        assert "visible False" in r.stdout, (layer, r.stdout, r.stderr)
    assert listener.accepted == []


SUBINTERPRETER_CONNECT = """
import _xxsubinterpreters as si
si.run_string(si.create(), {inner!r})
"""


def test_issue_program_through_a_sub_interpreter_does_not_connect(listener):
    """The issue's program: the sub-interpreter drops the audit hook; the kernel layer must still hold."""
    code = SUBINTERPRETER_CONNECT.format(inner=CONNECT.format(path=listener.path))
    full, kernel = _both(code)
    assert full[1].status == "error" and "sub-interpreters" in full[1].to_tool_output()
    r = kernel[1]
    assert "CONNECTED" not in r.stdout and "visible False" in r.stdout, (r.stdout, r.stderr)
    assert listener.accepted == []


# --- 2. cleanup never raises --------------------------------------------------------------------

DEEP_TREE = """
import os
for _ in range(1100):
    os.mkdir("d")
    os.chdir("d")
open("leaf.txt", "w").write("x")
print("depth", os.getcwd().count("/d"))
"""


def _record_call_dirs(monkeypatch) -> list[str]:
    """The temp trees this process's sandbox calls make (runner.py's tempfile.mkdtemp), as they are made: the host's
    temp dir as a whole is no measure, since another process using the sandbox meanwhile (a parallel test worker, a Ray
    worker scoring rewards) has its own call's tree there while its call runs."""
    made: list[str] = []
    mkdtemp = runner_module.tempfile.mkdtemp

    def recording(*args, **kwargs):
        path = mkdtemp(*args, **kwargs)
        name = os.path.basename(path)
        if name.startswith("rltrain-sandbox-") and not name.startswith("rltrain-sandbox-code-"):
            made.append(path)  # not the per-process directory of the child's code, kept until this process exits
        return path

    monkeypatch.setattr(runner_module.tempfile, "mkdtemp", recording)
    return made


@pytest.mark.parametrize("where", ["private_tmpfs", "host_temp_dir"])
def test_a_very_deep_tree_neither_raises_nor_stays_behind(where, monkeypatch):
    made = _record_call_dirs(monkeypatch)
    if where == "private_tmpfs":
        r = run_code(DEEP_TREE, timeout_s=60)
        assert r.isolated
    else:  # no kernel layer: the tree is in the host's temp dir, and the parent removes it
        r = _run(DEEP_TREE, os_isolation=False, allow_unisolated=True, audit=False, **_args(timeout_s=60))
    assert r.status == "ok", (r.status, r.message, r.stderr[-500:])
    assert r.stdout == "depth 1100\n"
    assert len(made) == 1, made  # the call made its tree where this test sees it
    assert not os.path.exists(made[0]), "the call's temp tree stayed behind"


def test_rmtree_removes_deep_and_unreadable_trees_and_never_raises(tmp_path):
    root = tmp_path / "t"
    root.mkdir()
    fd = os.open(root, os.O_RDONLY)
    for _ in range(1500):  # deeper than the recursion limit, longer than PATH_MAX as one path
        os.mkdir("d" * 20, dir_fd=fd)
        fd, old = os.open("d" * 20, os.O_RDONLY, dir_fd=fd), fd
        os.close(old)
    os.close(os.open("f", os.O_WRONLY | os.O_CREAT, dir_fd=fd))
    os.close(fd)
    os.symlink("/etc", root / "link")  # removed, never followed
    locked = root / "locked"
    locked.mkdir()
    (locked / "inner").mkdir()
    os.chmod(locked, 0)
    rmtree(str(root))
    assert not root.exists()
    rmtree(str(tmp_path / "missing"))  # nothing there: no error either
    assert os.path.isdir("/etc")


def test_an_unknown_signal_is_reported_not_raised():
    r = run_code("import os\nos.kill(os.getpid(), 40)")  # a real-time signal: no name in signal.Signals
    assert r.status == "killed" and "signal 40" in r.message
    r = run_code("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)")
    assert r.status == "killed" and r.message == "killed by signal SIGTERM"
    assert signal.SIGTERM  # the parent is untouched


# --- 3. the audit hook cannot be left behind: tests/sandbox/test_isolation_required.py (runs everywhere) ----


# --- 4. socket families and capabilities -------------------------------------------------------------

SOCKETS = """
import socket
def attempt(name, *args):
    try:
        s = socket.socket(*args)
        if args[0] == 40:  # AF_VSOCK: bind in the machine's vsock port space
            s.bind((0xFFFFFFFF, 45678))
        print("OPENED", name, flush=True)
    except OSError as e:
        print("refused", name, e.errno, flush=True)
attempt("vsock", 40, socket.SOCK_STREAM)
attempt("netlink-route", socket.AF_NETLINK, socket.SOCK_DGRAM, 0)
attempt("netlink-netfilter", socket.AF_NETLINK, socket.SOCK_RAW, 12)
attempt("packet", socket.AF_PACKET, socket.SOCK_RAW, 0)
attempt("raw-icmp", socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
attempt("raw-nonblock", socket.AF_INET6, socket.SOCK_RAW | socket.SOCK_NONBLOCK, socket.IPPROTO_ICMPV6)
attempt("alg", 38, socket.SOCK_SEQPACKET, 0)
attempt("bluetooth", 31, socket.SOCK_STREAM, 0)
a, b = socket.socketpair()
a.sendall(b"ok")
print("socketpair", b.recv(2), flush=True)
socket.socket(socket.AF_INET, socket.SOCK_DGRAM).close()
print("udp ok", flush=True)
"""


def test_only_unix_and_inet_sockets_open():
    for allow_network in (False, True):
        r = _kernel_only(SOCKETS, allow_network=allow_network)
        assert r.isolated and "seccomp(sockets:unix,inet,inet6)" in r.isolation
        assert "OPENED" not in r.stdout, r.stdout
        assert r.stdout.count("refused") == 8, (r.stdout, r.stderr[-500:])
        assert "socketpair b'ok'" in r.stdout and "udp ok" in r.stdout


CAPABILITIES = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
class Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
class Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]
h, d = Header(0x20080522, 0), (Data * 2)()
print("capget", libc.capget(ctypes.byref(h), d), [(x.effective, x.permitted, x.inheritable) for x in d])
print("bounding", [c for c in range(41) if libc.prctl(23, c, 0, 0, 0) == 1])  # PR_CAPBSET_READ
print("inotify", libc.inotify_init1(0), os.strerror(ctypes.get_errno()))  # a per-uid quota shared with the host
limit = (ctypes.c_uint64 * 2)(1, 1)
print("prlimit of the reaper", libc.prlimit64(1, 0, limit, None), os.strerror(ctypes.get_errno()))  # RLIMIT_CPU
CLONE = {"ns": 0x20000, "net": 0x40000000, "uts": 0x04000000, "user": 0x10000000, "pid": 0x20000000}
for name, flag in CLONE.items():
    pid = libc.syscall(56, flag | 17, 0, 0, 0, 0)  # clone(flags | SIGCHLD) on x86_64
    if pid == 0:
        os._exit(0)
    print("clone", name, pid, os.strerror(ctypes.get_errno()) if pid < 0 else "CREATED", flush=True)
    if pid > 0:
        os.waitpid(pid, 0)
"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the program calls clone(2) by its x86_64 number")
def test_no_capabilities_and_no_new_namespaces():
    r = _kernel_only(CAPABILITIES)
    assert r.status == "ok", r.stderr[-800:]
    assert "capget 0 [(0, 0, 0), (0, 0, 0)]" in r.stdout and "bounding []" in r.stdout, r.stdout
    assert "inotify -1 Operation not permitted" in r.stdout
    assert "prlimit of the reaper -1 Operation not permitted" in r.stdout
    assert "CREATED" not in r.stdout and r.stdout.count("Operation not permitted") == 7, r.stdout


# --- 5. stat of host paths, per-call limits ----------------------------------------------------------

STAT = """
import os
for p in {paths!r}:
    try:
        os.stat(p)
        print("EXISTS", p)
    except OSError as e:
        print("absent", p, e.strerror)
"""


def test_host_paths_cannot_even_be_stat_ed(listener):
    paths = ["/etc/passwd", PROJECT_FILE, os.path.dirname(PROJECT_FILE), listener.path, listener.dir,
             "/tmp/ray", "/proc/1", "/sys/fs/cgroup", "/run", "/var",
             os.path.dirname(os.path.dirname(PROJECT_FILE))]
    for layer, r in _both(STAT.format(paths=paths)):
        assert "EXISTS" not in r.stdout, (layer, r.stdout)
        assert r.stdout.count("absent") == len(paths), (layer, r.stdout, r.stderr[-500:])


MANY_PROCESSES_EACH_100_MIB = """
import os, time
kids = []
for _ in range(7):
    pid = os.fork()
    if pid == 0:
        hog = bytearray(100 * 2**20)
        for i in range(0, len(hog), 4096):
            hog[i] = 1
        time.sleep(2)
        os._exit(0)
    kids.append(pid)
hog = bytearray(100 * 2**20)
for i in range(0, len(hog), 4096):
    hog[i] = 1
print("children", [os.waitpid(k, 0)[1] for k in kids])
"""


def test_memory_limit_holds_for_all_processes_of_a_call_together():
    kind, _, why_not = _cgroup.detect()
    if not kind:
        pytest.skip(f"no cgroup for per-call memory here ({why_not}): the limit is per process, documented")
    r = run_code(MANY_PROCESSES_EACH_100_MIB, memory_mb=128, max_processes=16, timeout_s=30)
    assert r.status == "memory", (r.status, r.message, r.stdout, r.stderr[-500:])
    assert "128 MiB" in r.message and f"limits:cgroup-{kind}(memory 128 MiB" in r.isolation


WRITE_64_FILES = """
import os
written = 0
try:
    for i in range(64):
        with open("f%d" % i, "wb") as f:
            for _ in range(16):
                f.write(b"x" * 2**20)
                written += 1
except OSError as e:
    print("stopped:", e.strerror)
st = os.statvfs(".")
print("written MiB", written, "size MiB", st.f_blocks * st.f_frsize // 2**20)
"""


def test_temp_dir_is_a_private_size_limited_tmpfs_not_the_hosts_tmp():
    before = shutil.disk_usage(TMP).used
    r = run_code(WRITE_64_FILES, memory_mb=512, max_file_bytes=16 * 2**20, max_disk_bytes=32 * 2**20,
                 timeout_s=30)
    assert r.status == "ok", (r.status, r.message, r.stderr[-500:])
    assert "stopped: No space left on device" in r.stdout and "size MiB 32" in r.stdout, r.stdout
    written = int(r.stdout.split("written MiB ")[1].split()[0])
    assert 16 <= written <= 32
    assert shutil.disk_usage(TMP).used - before < 16 * 2**20  # nothing of it reached the host's disk


def test_the_run_log_line_says_what_is_in_force():
    r = run_code("pass")
    parts = r.isolation.split(" + ")
    assert parts[0] == "namespaces:user,mnt,pid,ipc,net" and parts[1].startswith("root:private(tmpfs 64 MiB)")
    assert "caps:none" in parts and "seccomp(sockets:unix,inet,inet6)" in parts
    assert parts[-1].startswith("limits:cgroup-") or parts[-1].startswith("limits:per-process"), parts[-1]


def test_private_root_is_read_only_and_only_the_temp_dir_is_writable():
    code = ("import os\n"
            "for p in ['/x', '/usr/x', '/dev/x', os.path.dirname(os.getcwd()) + '/x']:\n"
            "    try:\n        open(p, 'w')\n        print('WROTE', p)\n"
            "    except OSError as e:\n        print('refused', p, e.strerror)\n"
            "open('mine', 'w').write('ok')\nprint(open('mine').read())")
    token = secrets.token_hex(4)
    for layer, r in _both(code + f"\nprint('{token}')"):
        assert "WROTE" not in r.stdout and r.stdout.count("refused") == 4, (layer, r.stdout)
        assert r.stdout.endswith(f"ok\n{token}\n")


# --- the multi-turn path: the same programs through the rollout's tool executor ------------------------


def test_multi_turn_tool_executor_contains_the_issue_programs(listener):
    from rltrain.rollout.multiturn import SandboxToolExecutor

    executor = SandboxToolExecutor(max_workers=2, timeout_s=60.0, memory_mb=128)
    try:
        assert "root:private(" in executor.isolation and "caps:none" in executor.isolation
        unix, issue, deep, stat, memory = executor([
            CONNECT.format(path=listener.path),
            SUBINTERPRETER_CONNECT.format(inner=CONNECT.format(path=listener.path)),
            DEEP_TREE,
            STAT.format(paths=["/etc/passwd", PROJECT_FILE, listener.path]),
            MANY_PROCESSES_EACH_100_MIB])
    finally:
        executor.close()
    assert "visible False" in unix and "CONNECTED" not in unix, unix
    assert "sub-interpreters" in issue and "CONNECTED" not in issue, issue
    assert deep == "depth 1100\n", deep
    assert "EXISTS" not in stat and stat.count("absent") == 3, stat
    if _cgroup.detect()[0]:
        assert "Error: memory limit of 128 MiB exceeded" in memory, memory
    assert listener.accepted == []
