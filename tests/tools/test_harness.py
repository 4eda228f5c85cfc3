"""tools/harness: the timer, the child-process runner with its deadline, the reports, and the peak FLOP/s table
of rltrain/utils/flops.py the tools' MFU numbers divide by."""

import json
import os
import signal
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))

import harness  # noqa: E402

from rltrain.utils.flops import peak_flops  # noqa: E402


def test_md_table_and_report_files(tmp_path):
    md = harness.md_table(["row", "ms"], [("a", 1.5), ("b", "-")])
    assert md == "| row | ms |\n|---|---|\n| a | 1.5 |\n| b | - |"
    harness.write_report(str(tmp_path), "bench", {"rows": [1, 2], "when": object}, md)
    assert json.loads((tmp_path / "bench.json").read_text())["rows"] == [1, 2]  # non-JSON values as str()
    assert (tmp_path / "bench.md").read_text() == md + "\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json", "bench.md"]  # no .tmp left behind


def test_time_ms_is_the_median_after_the_warmup_calls():
    calls, delays = [], iter([0.2, 0.0, 0.03, 0.01, 0.02])  # the 0.2 s call is the warm-up: not counted

    def fn():
        calls.append(1)
        time.sleep(next(delays))

    ms = harness.time_ms(fn, reps=4, warmup=1, cuda=False)
    assert len(calls) == 5
    assert 15 <= ms < 60  # median of ~0, 30, 10, 20 ms: ~15 ms (sleep only ever runs long)


def test_deadline():
    assert harness.Deadline(None).left() == float("inf")
    assert 9 < harness.Deadline(10).left() <= 10


def test_children_run_at_once_and_the_one_past_the_timeout_is_stopped(tmp_path):
    py = sys.executable
    jobs = {"quick": ([py, "-c", "print('hello'); raise SystemExit(3)"], str(tmp_path / "quick.log")),
            "slow": ([py, "-c", "import time; print('start', flush=True); time.sleep(60)"], str(tmp_path / "slow.log"))}
    exited, stopped, polled = [], [], []
    t0 = time.time()
    res = harness.run_children(jobs, timeout_s=3, poll_s=0.2, on_exit=lambda n, r: exited.append((n, r["rc"])),
                               on_timeout=lambda n, p: stopped.append(n), on_poll=polled.append, poll_every_s=1.0)
    assert time.time() - t0 < 30
    assert res["quick"] == {"rc": 3, "wall_s": res["quick"]["wall_s"], "timed_out": False}
    assert res["slow"]["timed_out"] and res["slow"]["rc"] != 0
    assert exited == [("quick", 3)] and stopped == ["slow"]
    assert 1 <= len(polled) <= 3 and set(polled) == {"slow"}  # about once a second, only while running
    assert (tmp_path / "quick.log").read_text() == "hello\n" and "start" in (tmp_path / "slow.log").read_text()
    one = harness.run_child([py, "-c", "print('x' * 3000)"], str(tmp_path / "one.log"), poll_s=0.1)
    assert one["rc"] == 0 and not one["timed_out"] and one["tail"] == ("x" * 3000 + "\n")[-2000:]


def test_a_child_that_ignores_sigint_is_stopped_without_waiting_for_it(tmp_path):
    """A tool started with `&` by a non-interactive shell hands its children SIGINT ignored: the stop goes on to
    SIGTERM at once instead of waiting out SIGINT's 20 s."""
    py = sys.executable
    code = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    t0 = time.time()
    res = harness.run_children({"deaf": ([py, "-c", code], str(tmp_path / "deaf.log"))}, timeout_s=2, poll_s=0.2)
    assert res["deaf"]["timed_out"] and time.time() - t0 < 12  # not 2 s + 20 s of SIGINT
    assert "up" in (tmp_path / "deaf.log").read_text()
    assert harness._ignores(os.getpid(), signal.SIGINT) == (signal.getsignal(signal.SIGINT) == signal.SIG_IGN)


def test_peak_flops_by_device_name_and_the_device_name():
    assert peak_flops("NVIDIA H100 80GB HBM3") == peak_flops("NVIDIA H200") == 989e12
    assert peak_flops(None) == peak_flops("CPU (AMD EPYC, 2 cores)") == 989e12  # unknown: the H100's
    name = harness.device_name()
    assert name.startswith("CPU (") or "NVIDIA" in name


TOOLS = os.path.dirname(os.path.dirname(harness.__file__))


@pytest.mark.parametrize("tool", sorted(f[:-3] for f in os.listdir(TOOLS) if f.endswith(".py")))
def test_no_tool_imports_another_tool(tool):
    """Tools import the harness and rltrain only: no import circle, no tool as a library."""
    import ast

    tools = TOOLS
    names = {f[:-3] for f in os.listdir(tools) if f.endswith(".py")}
    tree = ast.parse(open(os.path.join(tools, f"{tool}.py")).read())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & names, imported & names


def test_an_interrupted_runner_stops_its_children_and_a_child_without_log_streams(tmp_path, capfd):
    py = sys.executable
    pid_file = tmp_path / "pid"
    cmd = [py, "-c", f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"]

    def interrupt(_name):
        if pid_file.exists() and pid_file.read_text():  # the child is up
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        harness.run_children({"slow": (cmd, str(tmp_path / "slow.log"))}, poll_s=0.2, on_poll=interrupt,
                             poll_every_s=0.5, timeout_s=50)
    pid = int(pid_file.read_text())
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    res = harness.run_child([py, "-c", "print('to the console')"], None, poll_s=0.1)
    assert res["rc"] == 0 and res["tail"] == "" and "to the console" in capfd.readouterr().out


def test_report_header(monkeypatch):
    import datetime

    import torch

    monkeypatch.setattr(sys, "argv", ["tools/bench_x.py", "--out", "o"])
    assert harness.report_header("bench_x", "2 x GPU") == {
        "date": datetime.date.today().isoformat(), "device": "2 x GPU", "torch": torch.__version__,
        "command": "python tools/bench_x.py --out o"}
    assert harness.report_header("bench_x")["device"] == harness.device_name()


@pytest.mark.parametrize("argv, want", [
    (["ray::HybridWorker.generate"], "ray::HybridWorker"),
    (["/usr/bin/python3", "-u", "-m", "rltrain.main", "--config-name", "x"], "python -m rltrain.main"),
    (["python", "-X", "dev", "tools/gpu_placements.py", "--out", "o"], "python gpu_placements.py"),
    (["python", "-c", "print(1)"], "python -c"),
    (["/opt/ray/core/src/ray/gcs/gcs_server", "--port=1"], "gcs_server"),
    ([], "?"),
])
def test_process_labels(argv, want):  # harness/procs.py, which names the processes of tests/trainer/exposure.py
    from harness import procs

    assert procs.label_of(argv) == want
