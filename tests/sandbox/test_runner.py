"""Sandbox tests with ordinary and hostile programs: each must end with a clear result and leak nothing.
Keep every limit small (2 shared cores): fork bombs run with max_processes=8 and short timeouts."""

import os
import random
import secrets
import socket

import psutil
import pytest

from rltrain.sandbox import SandboxPool, SandboxResult, kill_sandbox_processes, run_code
from rltrain.sandbox.runner import _run

pytestmark = pytest.mark.sandbox


def _layers(audit=True, os_isolation=True, **kw):
    """run_code with one layer switched off; without the kernel layer the run must be let through."""
    args = dict(timeout_s=5.0, memory_mb=256, cpu_s=None, max_output_bytes=8192, max_processes=8,
                allow_network=False, stdin=None, max_file_bytes=2**20, allow_unisolated=not os_isolation)
    args.update(kw)
    return lambda code: _run(code, audit=audit, os_isolation=os_isolation, **args)


def _assert_nothing_left(result: SandboxResult):
    assert kill_sandbox_processes(result.sandbox_id) == [], "sandbox processes survived the run"
    # Other test modules may leave long-lived helpers (e.g. the reward runner's worker pool); any child
    # running the sandbox's interpreter (`python -I -S ...`) would be ours.
    kids = [p for p in psutil.Process().children(recursive=True) if _is_sandbox_child(p)]
    assert kids == [], f"the test process still has sandbox children: {kids}"


def _is_sandbox_child(proc) -> bool:
    try:
        cmd = proc.cmdline()
    except psutil.ZombieProcess:
        return True  # an unreaped child is a leak whoever started it
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
    return "-I" in cmd and "-S" in cmd


def _workdir_of(code_prefix=""):
    """A program that reports its working directory first (to check it is deleted afterwards)."""
    return "import os; print(os.getcwd(), flush=True)\n" + code_prefix


def _has_net_namespace():
    return "net" in run_code("pass").isolation


# --- ordinary programs -----------------------------------------------------------------------


def test_normal_program_prints_the_value_python_computes():
    a, b = random.randint(-10**12, 10**12), random.randint(-10**12, 10**12)
    r = run_code(f"print({a} * {b})\nprint(2 + 3)")
    assert r.status == "ok" and r.ok() and r.exit_code == 0
    assert r.stdout == f"{a * b}\n5\n"
    assert r.to_tool_output() == f"{a * b}\n5\n"
    assert r.stderr == "" and r.message == ""
    _assert_nothing_left(r)


def test_exception_is_an_error_with_traceback_and_short_tool_line():
    token = secrets.token_hex(4)
    r = run_code(f"print('before')\nraise ValueError('boom {token}')")
    assert r.status == "error" and not r.ok() and r.exit_code == 1
    assert r.stdout == "before\n"
    assert "Traceback (most recent call last)" in r.stderr and "main.py\", line 2" in r.stderr
    assert r.to_tool_output() == f"before\nError: ValueError: boom {token}"


def test_sys_exit_code_and_stdin_are_passed_through():
    r = run_code("import sys\nsys.exit(3)")
    assert (r.status, r.exit_code) == ("error", 3)
    assert run_code("import sys\nsys.exit(0)").status == "ok"
    words = [secrets.token_hex(3) for _ in range(5)]
    r = run_code("import sys\nprint(sys.stdin.read().split()[::-1])", stdin=" ".join(words))
    assert r.status == "ok" and r.stdout == f"{words[::-1]}\n"


def test_program_can_write_and_read_files_in_its_own_temp_dir_which_is_removed():
    data = secrets.token_hex(16)
    r = run_code(_workdir_of(f"open('note.txt', 'w').write('{data}')\nprint(open('note.txt').read())"))
    assert r.status == "ok", r.stderr
    workdir, echoed = r.stdout.split()
    assert echoed == data
    assert not os.path.exists(workdir)


def test_signal_death_is_reported_as_killed():
    r = run_code("import faulthandler\nfaulthandler._sigsegv()")
    assert r.status == "killed" and r.exit_code is None
    assert "SIGSEGV" in r.message and "SIGSEGV" in r.to_tool_output()


# --- hostile programs ------------------------------------------------------------------------


def test_infinite_loop_is_killed_at_the_wall_clock_timeout():
    r = run_code(_workdir_of("while True:\n    pass"), timeout_s=1.0)
    assert r.status == "timeout" and r.exit_code is None
    assert r.duration_s >= 1.0
    assert r.to_tool_output().endswith("Error: timed out after 1 s (wall clock)")
    assert not os.path.exists(r.stdout.split()[0])
    _assert_nothing_left(r)


def test_sleeping_program_is_killed_at_timeout_and_cpu_burner_at_cpu_limit():
    r = run_code("import time\ntime.sleep(60)", timeout_s=0.5)
    assert r.status == "timeout" and "wall clock" in r.message
    r = run_code("while True:\n    pass", timeout_s=20.0, cpu_s=1)
    assert r.status == "timeout" and "CPU time limit" in r.message
    _assert_nothing_left(r)


def test_memory_bomb_is_stopped_at_the_limit():
    code = _workdir_of("hog = []\nwhile True:\n    hog.append(bytearray(8 * 2**20))")
    r = run_code(code, memory_mb=128, timeout_s=10)
    assert r.status == "memory", (r.status, r.stderr[-500:])
    assert "MemoryError" in r.stderr and "128 MiB" in r.to_tool_output()
    assert not os.path.exists(r.stdout.split()[0])
    _assert_nothing_left(r)


# Every process forks as fast as it can; a refused fork backs off 20 ms so that the bomb, once
# bounded, does not burn the shared cores until the timeout.
FORK_BOMB = """
import os, time
while True:
    try:
        if os.fork() > 0:
            print("+", flush=True)
    except BaseException:
        time.sleep(0.02)
"""


@pytest.mark.parametrize("layers", ["both", "kernel_only", "audit_only"])
def test_fork_bomb_is_bounded_and_cleaned_up(layers):
    run = _layers(audit=layers != "kernel_only", os_isolation=layers != "audit_only", timeout_s=1.5,
                  max_processes=8)
    r = run(FORK_BOMB)
    if layers == "kernel_only" and not r.isolation.startswith("namespaces"):
        pytest.skip(f"no user namespaces here ({r.isolation}); the audit layer bounds forks")
    assert r.status == "timeout"
    forks = r.stdout.count("+")
    # Processes never exit, so successful forks = processes beyond the first: at most 7.
    assert 1 <= forks <= 7, forks
    _assert_nothing_left(r)
    assert run_code("print('alive')").stdout == "alive\n"


def test_detached_children_do_not_outlive_the_run():
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n"
            "print('parent done')")
    for run in (_layers(), _layers(os_isolation=False)):
        r = run(code)
        assert r.status == "ok" and r.stdout == "parent done\n"
        _assert_nothing_left(r)


def test_reading_etc_passwd_fails_directly_via_symlink_and_via_subprocess():
    attempts = [
        "print(open('/etc/passwd').read())",
        "import os\nos.symlink('/etc/passwd', 'p')\nprint(open('p').read())",
        "import subprocess\nprint(subprocess.run(['cat', '/etc/passwd'], capture_output=True).stdout)",
        "import os\nprint(os.listdir('/etc'))",
    ]
    for code in attempts:
        r = run_code(code)
        assert r.status == "error", (code, r.stdout)
        assert "root:" not in r.stdout and "passwd" not in r.stdout
        assert "PermissionError: sandbox:" in r.to_tool_output()


def test_parent_environment_secrets_are_not_visible():
    secret = secrets.token_hex(16)
    os.environ["RLTRAIN_TEST_SECRET"] = secret
    try:
        r = run_code("import os\nprint(sorted(os.environ.items()))")
        assert r.status == "ok"
        assert secret not in r.stdout and "RLTRAIN_TEST_SECRET" not in r.stdout
        env = dict(eval(r.stdout))
        assert set(env) <= {"PATH", "LANG", "LC_ALL", "HOME", "TMPDIR", "RLTRAIN_SANDBOX_ID",
                            "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"}
        assert env["HOME"] == env["TMPDIR"] != os.environ.get("HOME")
        r = run_code(f"print(open('/proc/{os.getpid()}/environ', 'rb').read())")
        assert r.status == "error" and secret not in r.stdout
    finally:
        del os.environ["RLTRAIN_TEST_SECRET"]


def test_writing_outside_the_temp_dir_fails_and_creates_nothing():
    target = f"/tmp/rltrain-sandbox-escape-{secrets.token_hex(6)}"
    attempts = [
        f"open('{target}', 'w').write('x')",
        f"import os\nos.mkdir('{target}')",
        f"import shutil\nopen('a', 'w').write('x')\nshutil.copy('a', '{target}')",
        f"import os\nos.symlink('{target}', 'link')\nopen('link', 'w').write('x')",
        f"import os\nos.open('../{os.path.basename(target)}', os.O_CREAT | os.O_WRONLY)",
    ]
    for code in attempts:
        r = run_code(code)
        assert r.status == "error", code
        assert "writing outside the sandbox directory is not allowed" in r.to_tool_output(), r.stderr
        assert not os.path.exists(target)


def test_file_size_limit_applies_inside_the_temp_dir():
    r = run_code("open('big', 'wb').write(b'x' * (4 * 2**20))", max_file_bytes=2**20)
    assert r.status == "error" and "File too large" in r.to_tool_output()


def test_socket_to_localhost_is_refused_and_never_connects():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')"
    try:
        r = run_code(code)
        assert r.status == "error" and "network access is disabled" in r.to_tool_output()
        if _has_net_namespace():  # the kernel layer alone also stops it: Landlock's TCP rule, loopback down
            r = _layers(audit=False)(code)
            assert r.status == "error" and "connected" not in r.stdout
            assert any(e in r.stderr for e in ("Permission denied", "Network is unreachable", "Connection refused"))
        with pytest.raises(socket.timeout):
            server.accept()
        r = run_code(f"import socket\ns = socket.create_connection(('127.0.0.1', {port}))\nprint('connected')",
                     allow_network=True)
        if "net" not in r.isolation:
            assert r.status == "ok" and r.stdout == "connected\n"
            server.accept()[0].close()
    finally:
        server.close()


def test_huge_stdout_is_cut_at_the_limit_and_the_run_killed():
    for code in ("while True:\n    print('x' * 1000)", "import sys\nsys.stdout.write('y' * 10**8)",
                 "import sys\nwhile True:\n    sys.stderr.write('z' * 4096)"):
        r = run_code(code, max_output_bytes=4096, timeout_s=10)
        assert r.status == "output_limit", (code, r.status)
        for text in (r.stdout, r.stderr):
            assert len(text.encode()) <= 4096 + 100
        assert "[output truncated: more than 4096 bytes]" in (r.stdout + r.stderr)
        assert r.to_tool_output().endswith("Error: output exceeded 4096 bytes")
        _assert_nothing_left(r)


def test_escape_hatches_of_the_audit_layer_are_closed():
    attempts = {
        "import ctypes\nctypes.CDLL(None).system(b'id')": "ctypes",
        "import os, signal\nos.kill(1, signal.SIGKILL)": "sending signals",
        "import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))": "resource.setrlimit",
        "import gc\nprint(len(gc.get_objects()))": "gc.get_objects",
        "import os\nos.system('id')": "os.system",
    }
    for code, needle in attempts.items():
        r = run_code(code)
        assert r.status == "error", code
        assert needle in r.to_tool_output(), (code, r.to_tool_output())


def test_bad_arguments_raise_value_errors_naming_the_argument():
    for kwargs, name in [({"timeout_s": 0}, "timeout_s"), ({"memory_mb": 8}, "memory_mb"),
                         ({"max_output_bytes": 0}, "max_output_bytes"), ({"max_processes": 0}, "max_processes"),
                         ({"cpu_s": -1}, "cpu_s"), ({"max_disk_bytes": 4096}, "max_disk_bytes")]:
        with pytest.raises(ValueError, match=name):
            run_code("pass", **kwargs)
    with pytest.raises(ValueError, match="max_workers"):
        SandboxPool(max_workers=0)
    with pytest.raises(ValueError, match="unknown run_code arguments"):
        SandboxPool(timeout=3)


# --- the pool --------------------------------------------------------------------------------


def test_pool_runs_many_in_parallel_in_order_and_keeps_serving_after_hostile_code():
    rng = random.Random()
    pairs = [(rng.randint(0, 10**9), rng.randint(0, 10**9)) for _ in range(10)]
    codes = [f"import time\ntime.sleep({rng.random() * 0.05:.3f})\nprint({a} + {b})" for a, b in pairs]
    hostile = ["while True:\n    pass", FORK_BOMB, "x = []\nwhile True:\n    x.append(bytearray(2**23))",
               "while True:\n    print('x' * 1000)", "raise SystemExit('bye')"]
    with SandboxPool(max_workers=2, timeout_s=1.5, memory_mb=128, max_processes=8,
                     max_output_bytes=2048) as pool:
        results = pool.run_many(codes)
        assert [r.stdout for r in results] == [f"{a + b}\n" for a, b in pairs]
        bad = pool.run_many(hostile)
        assert [r.status for r in bad] == ["timeout", "timeout", "memory", "output_limit", "error"]
        assert bad[-1].stderr.strip() == "bye"
        for r in bad:
            _assert_nothing_left(r)
        after = pool.run_many(codes[:4])
        assert [r.stdout for r in after] == [f"{a + b}\n" for a, b in pairs[:4]]
        assert pool.run("print(2 + 3)").stdout == "5\n"
    with pytest.raises(RuntimeError, match="closed"):
        pool.run("print(1)")
