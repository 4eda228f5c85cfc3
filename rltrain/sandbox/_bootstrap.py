"""Child side of the sandbox: isolates itself, forks a reaper and the user process, runs the code.
Runs as `python -I -S -B -u -c <stub> <config json>` (`_childcode.py`: the stub runs this file's code as
__main__, compiled once by the parent); it imports nothing but the stdlib, its two helper modules
(`_kernel.py`, `_audit.py`, same way) and the two kernel bindings, landlockpy and pyseccomp (from the paths
the parent names), all before it isolates itself.

Process tree (pids as the parent sees them):

    B  bootstrap, started by the parent in a new session. Joins the call's cgroups (memory, pids) when
       the parent made them, imports the helpers and bindings, then unshares user, mount, PID, IPC
       (+ net) namespaces (`_kernel.isolate`); when root, first sets only its *real* uid to nobody so that
       RLIMIT_NPROC is enforced per sandbox (root's real uid bypasses it; ucounts are per user
       namespace). Then builds the private root and pivots into it (`_kernel.private_root`): the code
       sees the stdlib and shared libraries read-only and its temp dir as a size-limited private tmpfs.
    R  reaper, in its own process group; PID 1 of the new PID namespace when there is one, else a
       child subreaper. Waits for U, then kills whatever U left behind (the kernel does this for a
       namespace init when it exits), and reports U's end on the status pipe.
    U  user process: rlimits (address space, CPU, file size, processes, core); then the kernel
       boundary, inherited by everything U starts or execs (`_kernel.confine`): no capabilities,
       Landlock and a seccomp filter. Without any of namespaces, private root, Landlock and seccomp,
       U refuses to run the code unless `allow_unisolated`. Last the audit hook (`_audit.install`,
       always on: friendly messages), then exec of main.py.

The status pipe (fd cfg["status_fd"]) carries JSON lines: {"isolation": ..., "isolated": ...} (from U),
{"reaper": pid}, {"exit": code} or {"signal": signum}. U closes it before running user code.
"""

import json
import os
import signal
import sys

EXIT_MEMORY = 251  # U exits with this when the user code died of MemoryError
EXIT_REFUSED = 250  # U exits with this, before running anything, when isolation is missing and required
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
kernel = audit = None  # the helper modules, imported by main() from cfg["sandbox_dir"]


def _status(fd, **msg):
    os.write(fd, (json.dumps(msg) + "\n").encode())


def _import_helpers(sandbox_dir):
    """The helper modules: from the code the parent compiled (HELPER_CODES, set by its stub), else
    imported from the sources."""
    global kernel, audit
    codes = globals().get("HELPER_CODES") or {}
    if "_kernel" in codes and "_audit" in codes:
        import types

        modules = []
        for name in ("_kernel", "_audit"):
            module = types.ModuleType(name)
            module.__file__ = os.path.join(sandbox_dir, name + ".py")
            exec(codes[name], module.__dict__)
            modules.append(module)
        kernel, audit = modules
        return
    saved = list(sys.path)
    sys.path.insert(0, sandbox_dir)
    try:
        import _audit
        import _kernel
    finally:
        sys.path[:] = saved
    kernel, audit = _kernel, _audit


def _join_cgroups(dirs):
    """Move B (and so everything it starts) into the call's cgroups; '' or why not. In v1, B (one thread)
    writes "0" to `tasks`: moving only the calling thread skips the global threadgroup lock, whose RCU
    grace period made each move cost ~15 ms under load; v2 has only cgroup.procs."""
    try:
        for d in dirs:
            tasks = os.path.join(d, "tasks")
            with open(tasks if os.path.exists(tasks) else os.path.join(d, "cgroup.procs"), "w") as f:
                f.write("0")
    except OSError as e:
        return "could not join the call's cgroup (%s)" % e
    return ""


def _load_bindings(paths, libraries):
    """landlockpy and pyseccomp from the parent's site-packages (this interpreter runs -I -S); each
    name maps to the module or to the reason it is unavailable. Imported before any namespace exists
    (pyseccomp looks its libraries up while importing). `libraries`: what ctypes.util.find_library
    answered the parent (name -> soname), so that the lookup (a run of ldconfig each) is not repeated
    per call; names not in it are looked up as usual."""
    import ctypes.util

    saved, find_library = list(sys.path), ctypes.util.find_library
    sys.path.extend(paths)  # after the stdlib, so nothing in site-packages can shadow it
    ctypes.util.find_library = lambda name: libraries.get(name) or find_library(name)
    found = {}
    try:
        for name in ("landlockpy", "pyseccomp"):
            try:
                found[name] = __import__(name)
            except Exception as e:  # a missing package, or pyseccomp without libseccomp.so.2
                found[name] = "%s is unavailable (%s: %s)" % (name, type(e).__name__, e)
    finally:
        sys.path[:] = saved
        ctypes.util.find_library = find_library
    return found


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
            audit.install(cfg)
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


def _isolate_b(cfg, libc):
    """B's part of the kernel layer: (bindings, namespaces or None, problem, root description or problem)."""
    if not cfg["os_isolation"]:
        return {}, None, "kernel isolation disabled", ""
    bindings = _load_bindings(cfg["binding_paths"], cfg["libraries"])
    namespaces, problem = kernel.isolate(libc, cfg["allow_network"])
    root = ""
    if namespaces is not None:
        try:
            root = kernel.private_root(libc, cfg)
        except OSError as e:
            root = "no private root (%s)" % e
    return bindings, namespaces, problem, root


def _user_process(cfg, libc, status_fd, isolated_b, limits_note):
    bindings, namespaces, ns_problem, root = isolated_b
    libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    _set_limits(cfg, namespaces is not None)
    if cfg["os_isolation"]:
        isolation, problems = kernel.confine(cfg, bindings, namespaces, ns_problem, root)
    else:
        isolation, problems = "none", [ns_problem]
    isolation += " + limits:" + cfg["limits"] + limits_note
    _status(status_fd, isolation=isolation, isolated=not problems, problems=problems)
    if problems and not cfg["allow_unisolated"]:
        os._exit(EXIT_REFUSED)
    os.close(status_fd)
    os.closerange(3, 256)  # nothing opened before the kernel layer stays reachable (RLIMIT_NOFILE)
    _run_user_code(cfg)


def main():
    cfg = json.loads(sys.argv[1])
    status_fd = cfg["status_fd"]
    _import_helpers(cfg["sandbox_dir"])
    libc = kernel.libc()
    libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != cfg["parent_pid"]:
        os._exit(1)  # the parent died before the death signal was armed
    cgroup_problem = _join_cgroups(cfg["cgroups"])
    limits_note = " (%s: per-process limits only)" % cgroup_problem if cgroup_problem else ""
    isolated_b = _isolate_b(cfg, libc)
    in_ns = isolated_b[1] is not None

    reaper = os.fork()
    if reaper == 0:  # R
        os.setpgid(0, 0)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if not in_ns:
            libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        user = os.fork()
        if user == 0:  # U
            _user_process(cfg, libc, status_fd, isolated_b, limits_note)
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
