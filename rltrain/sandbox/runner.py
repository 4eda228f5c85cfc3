"""Runs model-written Python in a separate, limited process and returns a `SandboxResult`.
Must not trust the code it runs, share the parent's environment, or let a call leak processes/files.

Layers, outermost first:

1. A fresh `python -I -S -B -u` in a new session with a scrubbed environment (PATH, LANG,
   HOME=TMPDIR=its own temp dir, one-thread BLAS) and that temp dir as cwd; the temp dir is deleted
   afterwards (a killed trainer's are swept at the next process's first call: _cleanup.py). A wall-clock deadline kills the whole tree; stdout/stderr are read incrementally and
   the tree is killed as soon as either exceeds `max_output_bytes`.
2. The kernel boundary (`_kernel.py`), inherited by everything the code starts or execs: new user,
   mount, PID, IPC (+ network) namespaces (no network interfaces but a down loopback; the namespace's
   init dies -> everything in it dies); a private read-only root with only the stdlib, the shared
   libraries and four /dev nodes, and at the temp dir's path a private tmpfs of `max_disk_bytes`, the
   only writable place (no host /tmp, sockets, /proc or /sys); no capabilities; Landlock (landlockpy):
   the same paths again, no TCP unless allowed, no signals or abstract sockets out of its domain;
   seccomp (pyseccomp over libseccomp): no execve unless `allow_exec`, no ptrace, namespaces
   (clone with CLONE_NEW* included), mounts or open-by-handle, socket families other than
   unix/inet/inet6, no raw sockets. Where any of these is unavailable the child refuses to run the
   code (status "refused", saying why) unless `allow_unisolated=True` (config `sandbox.allow_unisolated`).
   Limits: rlimits per process (address space, CPU seconds, file size, processes, no cores) and, where
   the machine offers cgroups, a per-call cgroup bounding the memory and processes of the whole call
   (`_cgroup.py`; `SandboxResult.isolation` says which holds).
3. Always: an audit hook (`_audit.py`) in the child that refuses sockets, running other programs,
   ctypes, sub-interpreters, reads outside the stdlib and its temp dir (e.g. `/etc/passwd`), writes
   outside its temp dir, signals to other processes and forks beyond `max_processes`. It gives the
   code clear messages; it is not the boundary (Python documents audit hooks as no security measure).

See `_bootstrap.py` for the child's process tree. `SandboxPool` runs many calls on a thread pool;
each call is its own process tree, so hostile code cannot break the pool.
"""

from __future__ import annotations

import functools
import json
import math
import os
import secrets
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from rltrain.sandbox import _cgroup, _childcode
from rltrain.sandbox._cleanup import rmtree as _rmtree
from rltrain.sandbox._cleanup import sweep_once, workdir_prefix
from rltrain.sandbox._bootstrap import EXIT_MEMORY, EXIT_REFUSED

_MARKER = "RLTRAIN_SANDBOX_ID"
_READ_CHUNK = 65536
_DRAIN_GRACE_S = 1.0  # after a kill, how long to wait for the pipes to close

STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "killed", "refused")
ALLOW_UNISOLATED_HINT = ("set sandbox.allow_unisolated=true to run tool code anyway, guarded only by an audit hook "
                         "(not a security boundary: the code could read and change your files)")


@dataclass
class SandboxResult:
    """The end of one sandboxed run. stdout/stderr are truncated to max_output_bytes (with a marker)."""

    status: str  # one of STATUSES
    stdout: str
    stderr: str
    exit_code: int | None  # None when the process ended by a signal or was killed by us
    duration_s: float
    message: str = ""  # one line saying why a non-ok run ended (empty when ok)
    # kernel isolation the child got, e.g. "namespaces:user,mnt,pid,ipc,net + root:private(tmpfs 64 MiB) +
    # caps:none + landlock:7 + seccomp(sockets:unix,inet,inet6) + limits:...", or "none"
    isolation: str = ""
    # namespaces, private root, capability drop, Landlock and seccomp held (the code ran behind the kernel boundary)
    isolated: bool = False
    sandbox_id: str = ""  # marker in the child's environment, for finding its processes

    def ok(self) -> bool:
        return self.status == "ok"

    def to_tool_output(self) -> str:
        """What the model sees as the tool turn: stdout, then a short error line when not ok."""
        if self.ok():
            return self.stdout
        lines = [self.stdout.rstrip("\n")] if self.stdout.strip() else []
        if self.status == "error":
            err = [ln for ln in self.stderr.strip().splitlines() if ln.strip()]
            lines.append("Error: " + (err[-1].strip() if err else self.message))
        else:
            lines.append("Error: " + self.message)
        return "\n".join(lines)


def _validate(timeout_s, memory_mb, cpu_s, max_output_bytes, max_processes, max_file_bytes,
              max_disk_bytes=64 * 2**20):
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    if not (isinstance(memory_mb, int) and memory_mb >= 64):
        raise ValueError(f"memory_mb must be an int >= 64 (the interpreter needs ~30 MiB), got {memory_mb!r}")
    if cpu_s is not None and not (isinstance(cpu_s, (int, float)) and cpu_s > 0):
        raise ValueError(f"cpu_s must be None (use timeout_s) or a positive number, got {cpu_s!r}")
    if not (isinstance(max_output_bytes, int) and max_output_bytes > 0):
        raise ValueError(f"max_output_bytes must be a positive int, got {max_output_bytes!r}")
    if not (isinstance(max_processes, int) and 1 <= max_processes <= 4096):
        raise ValueError(f"max_processes must be an int in [1, 4096], got {max_processes!r}")
    if not (isinstance(max_file_bytes, int) and max_file_bytes > 0):
        raise ValueError(f"max_file_bytes must be a positive int, got {max_file_bytes!r}")
    if not (isinstance(max_disk_bytes, int) and max_disk_bytes >= 2**20):
        raise ValueError(f"max_disk_bytes must be an int >= 1 MiB, got {max_disk_bytes!r}")


def run_code(
    code: str,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    cpu_s: float | None = None,
    max_output_bytes: int = 8192,
    max_processes: int = 32,
    allow_network: bool = False,
    stdin: str | None = None,
    max_file_bytes: int = 16 * 2**20,
    allow_exec: bool = False,
    allow_unisolated: bool = False,
    max_disk_bytes: int = 64 * 2**20,
) -> SandboxResult:
    """Run `code` as a Python program (like `python main.py`) in a fresh, limited process.

    timeout_s: wall clock for the whole run. memory_mb: memory of the whole call where a cgroup is
    available (its processes and its temp files together), and the address space of each process.
    cpu_s: CPU-seconds limit (None: ceil(timeout_s) + 1, a backstop). max_output_bytes: per stream;
    exceeding it kills the run (status "output_limit"). max_processes: processes the program may have
    at once, itself included. max_file_bytes: largest file it may write (in its temp dir).
    max_disk_bytes: size of its temp dir (a private tmpfs). allow_exec: let it run
    the system's programs (still confined to its temp dir). allow_unisolated: run it even where the
    kernel cannot isolate it (else status "refused"). Never raises for anything the code does;
    raises ValueError for bad arguments.
    """
    return _run(code, timeout_s=timeout_s, memory_mb=memory_mb, cpu_s=cpu_s,
                max_output_bytes=max_output_bytes, max_processes=max_processes,
                allow_network=allow_network, stdin=stdin, max_file_bytes=max_file_bytes,
                allow_exec=allow_exec, allow_unisolated=allow_unisolated, max_disk_bytes=max_disk_bytes)


def probe_isolation(*, allow_network: bool = False, allow_exec: bool = False) -> SandboxResult:
    """Run an empty program to learn what isolation this machine gives: `.isolated`, `.isolation`
    (what held, and what is missing and why). Runs even when unisolated; takes ~0.1 s."""
    return run_code("pass", allow_network=allow_network, allow_exec=allow_exec, allow_unisolated=True)


@functools.lru_cache(maxsize=1)
def _libraries() -> dict[str, str]:
    """The sonames pyseccomp asks ctypes.util.find_library for, looked up once here (each lookup runs
    ldconfig; the child would otherwise run it twice per call)."""
    import ctypes.util

    return {name: found for name in ("c", "seccomp") if (found := ctypes.util.find_library(name))}


@functools.lru_cache(maxsize=1)
def _binding_paths() -> tuple[str, ...]:
    """Where landlockpy and pyseccomp are installed (the child's -I -S interpreter imports them from there)."""
    import importlib.util

    paths = []
    for name in ("landlockpy", "pyseccomp"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            top = os.path.dirname(spec.origin)
            paths.append(os.path.dirname(top) if spec.submodule_search_locations else top)
    return tuple(sorted(set(paths)))


def _run(code, *, timeout_s, memory_mb, cpu_s, max_output_bytes, max_processes, allow_network,
         stdin, max_file_bytes, allow_exec=False, allow_unisolated=False, os_isolation=True,
         audit=True, max_disk_bytes=64 * 2**20) -> SandboxResult:
    """run_code with the two inner layers switchable (tests check each layer on its own)."""
    if not isinstance(code, str):
        raise ValueError(f"code must be a str, got {type(code).__name__}")
    _validate(timeout_s, memory_mb, cpu_s, max_output_bytes, max_processes, max_file_bytes, max_disk_bytes)
    cpu_limit = int(math.ceil(cpu_s if cpu_s is not None else timeout_s + 1))
    sandbox_id = secrets.token_hex(8)
    start = time.monotonic()
    workdir, cgroups = None, []
    try:
        sweep_once()  # the call dirs a killed process left behind (this user's, their process gone)
        workdir = tempfile.mkdtemp(prefix=workdir_prefix())
        os.chmod(workdir, 0o700)
        cgroups, limits = _cgroup.create(sandbox_id, memory_mb, max_processes)
        cfg = {
            "workdir": workdir, "parent_pid": os.getpid(), "sandbox_dir": _childcode.SANDBOX_DIR,
            "code_file": _childcode.code_file(),
            "memory_mb": memory_mb, "cpu_s": cpu_limit, "max_processes": max_processes,
            "max_file_bytes": max_file_bytes, "max_disk_bytes": max_disk_bytes,
            "allow_network": bool(allow_network), "allow_exec": bool(allow_exec),
            "allow_unisolated": bool(allow_unisolated), "os_isolation": bool(os_isolation), "audit": bool(audit),
            "binding_paths": _binding_paths(), "libraries": _libraries(), "cgroups": cgroups, "limits": limits,
        }
        out = _spawn_and_collect(code, cfg, stdin, sandbox_id, deadline=start + timeout_s,
                                 max_output_bytes=max_output_bytes)
        oom = _cgroup.oom_killed(cgroups)
        return _classify(out, time.monotonic() - start, timeout_s=timeout_s, memory_mb=memory_mb,
                         cpu_limit=cpu_limit, max_output_bytes=max_output_bytes, sandbox_id=sandbox_id, oom=oom)
    except Exception as e:  # the machine's fault (e.g. no fds, a full /tmp), never the code's: say so
        return SandboxResult(status="error", stdout="", stderr="", exit_code=None,
                             duration_s=time.monotonic() - start, sandbox_id=sandbox_id,
                             message=f"sandbox failure: {type(e).__name__}: {e}")
    finally:
        _quietly(kill_sandbox_processes, sandbox_id)
        _quietly(_cgroup.remove, cgroups)
        if workdir is not None:
            _quietly(_rmtree, workdir)


def _quietly(fn, *args):
    """Cleanup must not raise: a failure here leaves a stray, never kills the caller."""
    try:
        fn(*args)
    except Exception:
        pass


def _spawn_and_collect(code, cfg, stdin, sandbox_id, *, deadline, max_output_bytes):
    workdir = cfg["workdir"]
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
        "HOME": workdir, "TMPDIR": workdir, _MARKER: sandbox_id,
        "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
    }
    Path(workdir, "main.py").write_text(code, encoding="utf-8")
    status_r, status_w = os.pipe()
    proc = stdin_file = None
    try:
        if stdin is not None:
            stdin_path = Path(workdir, ".stdin")
            stdin_path.write_text(stdin, encoding="utf-8")
            stdin_file = open(stdin_path, "rb")
            stdin_path.unlink()
        cfg = dict(cfg, status_fd=status_w)
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-B", "-u", "-X", "utf8", "-c", _childcode.STUB, json.dumps(cfg)],
            stdin=stdin_file if stdin_file is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=workdir, env=env,
            pass_fds=(status_w,), start_new_session=True,
        )
        os.close(status_w)
        status_w = -1
        return _collect(proc, status_r, deadline=deadline, max_output_bytes=max_output_bytes)
    finally:
        for fd in (status_w, status_r):
            if fd >= 0:
                _quietly(os.close, fd)
        if stdin_file is not None:
            _quietly(stdin_file.close)
        if proc is not None:
            _quietly(_kill_tree, proc, None)
            _quietly(proc.stdout.close)
            _quietly(proc.stderr.close)


@dataclass
class _Collected:
    stdout: bytes
    stderr: bytes
    stdout_dropped: bool
    stderr_dropped: bool
    status: dict
    killed_for: str | None  # "timeout" | "output_limit" | None


def _collect(proc, status_r, *, deadline, max_output_bytes) -> _Collected:
    """Read stdout/stderr/status until they close, killing the tree at the deadline or output limit."""
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    bufs = {out_fd: bytearray(), err_fd: bytearray(), status_r: bytearray()}
    dropped = {out_fd: False, err_fd: False}
    status: dict = {}
    killed_for = None
    sel = selectors.DefaultSelector()
    for fd in bufs:
        sel.register(fd, selectors.EVENT_READ)
    finished_at = None  # when the reaper reported the end while pipes were still open
    try:
        while sel.get_map():
            now = time.monotonic()
            if finished_at is None and ("exit" in status or "signal" in status) and proc.poll() is not None:
                finished_at = now  # the tree is gone; whatever still holds a pipe is a stray
            if finished_at is not None and now - finished_at > _DRAIN_GRACE_S:
                break
            wait = deadline - now
            if wait <= 0:
                if killed_for is not None or finished_at is not None:
                    break  # pipes still held open after the kill + grace: give up on them
                killed_for = "timeout"
                _kill_tree(proc, status.get("reaper"))
                deadline = time.monotonic() + _DRAIN_GRACE_S
                continue
            for key, _ in sel.select(timeout=min(wait, 0.1)):
                fd = key.fd
                data = os.read(fd, _READ_CHUNK)
                if not data:
                    sel.unregister(fd)
                    continue
                if fd == status_r:
                    bufs[fd] += data
                    *lines, rest = bufs[fd].split(b"\n")
                    bufs[fd] = bytearray(rest)
                    for line in lines:
                        try:
                            status.update(json.loads(line))
                        except ValueError:
                            pass
                    continue
                if killed_for is not None:
                    continue  # draining after a kill: keep nothing more
                room = max_output_bytes - len(bufs[fd])
                bufs[fd] += data[:room]
                if len(data) > room:
                    dropped[fd] = True
                    killed_for = "output_limit"
                    _kill_tree(proc, status.get("reaper"))
                    deadline = time.monotonic() + _DRAIN_GRACE_S
    finally:
        sel.close()
    return _Collected(bytes(bufs[out_fd]), bytes(bufs[err_fd]), dropped[out_fd], dropped[err_fd],
                      status, killed_for)


def _kill_tree(proc, reaper_pid):
    """SIGKILL the reaper's group (the namespace dies with it), then the bootstrap's; reap it."""
    for pgid in (reaper_pid, proc.pid):
        if pgid:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:  # cannot happen for SIGKILL short of a kernel hang
        pass


def kill_sandbox_processes(sandbox_id: str) -> list[int]:
    """SIGKILL every process whose environment carries this sandbox id; returns their pids.

    A last sweep for what escaped the process groups where no PID namespace was available.
    """
    needle = f"{_MARKER}={sandbox_id}".encode() + b"\0"
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if needle in env:
            pid = int(entry.name)
            found.append(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    return found


def _decode(data: bytes, dropped: bool, limit: int) -> str:
    text = data.decode("utf-8", errors="replace")
    if dropped:
        text += f"\n... [output truncated: more than {limit} bytes]"
    return text


def _signal_name(sig) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:  # e.g. a real-time signal
        return str(sig)


def _classify(out: _Collected, duration, *, timeout_s, memory_mb, cpu_limit, max_output_bytes,
              sandbox_id, oom=False) -> SandboxResult:
    stdout = _decode(out.stdout, out.stdout_dropped, max_output_bytes)
    stderr = _decode(out.stderr, out.stderr_dropped, max_output_bytes)
    exit_code = out.status.get("exit")
    sig = out.status.get("signal")
    if out.killed_for == "timeout":
        status, message, exit_code = "timeout", f"timed out after {timeout_s:g} s (wall clock)", None
    elif out.killed_for == "output_limit":
        status, message, exit_code = "output_limit", f"output exceeded {max_output_bytes} bytes", None
    elif sig is not None and oom and sig == signal.SIGKILL:
        status, message = "memory", f"memory limit of {memory_mb} MiB exceeded (the kernel killed the program)"
    elif sig is not None:
        if sig == signal.SIGXCPU:
            status, message = "timeout", f"CPU time limit of {cpu_limit} s exceeded"
        else:
            status, message = "killed", f"killed by signal {_signal_name(sig)}"
    elif exit_code is None and oom:
        status, message = "memory", f"memory limit of {memory_mb} MiB exceeded (the kernel killed the sandbox)"
    elif exit_code is None:
        status, message = "killed", "the sandbox process ended without reporting a status"
    elif exit_code == EXIT_REFUSED and out.status.get("isolated") is False:
        problems = "; ".join(out.status.get("problems") or ["unknown"])
        status, exit_code = "refused", None  # the code never ran
        message = (f"sandbox refused to run the code: no kernel isolation here ({problems}); fix that, or "
                   f"{ALLOW_UNISOLATED_HINT}")
    elif exit_code == EXIT_MEMORY:
        status, message = "memory", f"memory limit of {memory_mb} MiB exceeded (MemoryError)"
    elif oom:
        status, message = "memory", (f"memory limit of {memory_mb} MiB exceeded by the call's processes together "
                                     "(the kernel killed one)")
    elif exit_code == 0:
        status, message = "ok", ""
    else:
        status, message = "error", f"exited with status {exit_code}"
    isolation = out.status.get("isolation", "")
    if out.status.get("problems"):
        isolation += " (not isolated: " + "; ".join(out.status["problems"]) + ")"
    return SandboxResult(status=status, stdout=stdout, stderr=stderr, exit_code=exit_code,
                         duration_s=duration, message=message, isolation=isolation,
                         isolated=bool(out.status.get("isolated")), sandbox_id=sandbox_id)


class SandboxPool:
    """A bounded pool: at most `max_workers` sandboxes at once; each call is its own process tree.

    `run_code_kwargs` are passed to every `run_code` call (validated here, at construction).
    """

    def __init__(self, max_workers: int = 4, **run_code_kwargs):
        if not (isinstance(max_workers, int) and max_workers >= 1):
            raise ValueError(f"max_workers must be an int >= 1, got {max_workers!r}")
        allowed = {"timeout_s", "memory_mb", "cpu_s", "max_output_bytes", "max_processes",
                   "allow_network", "stdin", "max_file_bytes", "allow_exec", "allow_unisolated", "max_disk_bytes"}
        unknown = set(run_code_kwargs) - allowed
        if unknown:
            raise ValueError(f"unknown run_code arguments {sorted(unknown)}; allowed: {sorted(allowed)}")
        defaults = dict(timeout_s=5.0, memory_mb=512, cpu_s=None, max_output_bytes=8192,
                        max_processes=32, max_file_bytes=16 * 2**20, max_disk_bytes=64 * 2**20)
        defaults.update({k: v for k, v in run_code_kwargs.items() if k in defaults})
        _validate(**defaults)
        self._kwargs = dict(run_code_kwargs)
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="sandbox")
        self._closed = False

    def run(self, code: str) -> SandboxResult:
        return self._submit(code).result()

    def run_many(self, codes: list[str]) -> list[SandboxResult]:
        """Run all codes (at most max_workers at once); results in the order of `codes`."""
        futures = [self._submit(c) for c in codes]
        return [f.result() for f in futures]

    def _submit(self, code):
        if self._closed:
            raise RuntimeError("SandboxPool is closed")
        return self._executor.submit(run_code, code, **self._kwargs)

    def close(self):
        self._closed = True
        self._executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
