"""tools/thread_cpu.py and harness/procs.py: a child's CPU seconds as the tool samples them against what the child
reports of itself, the machine's cores on a worked example, process labels, and bad input exiting 2."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

import thread_cpu  # noqa: E402
from harness import procs  # noqa: E402

linux = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")

CHILD = """
import json, os, sys, threading, time
def spin(s, rest=0.0):
    t = time.thread_time()
    while time.thread_time() - t < s:
        pass
    time.sleep(rest)  # a thread's ticks after the last sample before it ends are not seen: let a sample come
th = threading.Thread(target=spin, args=({a}, 0.4))
th.start()
spin({b})
th.join()
json.dump({{"cpu_s": time.process_time(), "pid": os.getpid()}}, open(sys.argv[1], "w"))
time.sleep(0.6)  # past the last samples: every tick the child used is seen
"""


@linux
def test_a_childs_cpu_is_what_it_reports_of_itself(tmp_path):
    import random

    a, b = round(random.uniform(0.15, 0.3), 2), round(random.uniform(0.1, 0.25), 2)
    own = tmp_path / "own.json"
    rc = thread_cpu.main(["--out", str(tmp_path), "--interval", "0.1", "--", sys.executable, "-c",
                          CHILD.format(a=a, b=b), str(own)])
    assert rc == 0
    rep = json.loads((tmp_path / "threads.json").read_text())
    own = json.loads(own.read_text())
    child = [p for p in rep["processes"] if p["pid"] == own["pid"]]  # the machine's other processes are there too
    assert len(child) == 1 and child[0]["label"] == "python -c", rep["processes"]
    reported = own["cpu_s"]
    assert reported >= a + b - 0.02  # the GIL hands the spin loops back and forth: their sum is the child's CPU
    # clock ticks are 10 ms, and the interpreter's start-up is inside both
    assert child[0]["cpu_s"] == pytest.approx(reported, abs=0.05)
    assert sum(g["n"] for g in child[0]["threads"]) >= 2
    assert rep["samples"] >= 5 and rep["wall_s"] >= 0.6
    assert rep["machine"]["cpus"] == os.cpu_count()
    md = (tmp_path / "threads.md").read_text()
    assert "| python -c |" in md and "samples" in md


def test_machine_cores_on_a_worked_example(monkeypatch):
    monkeypatch.setattr(thread_cpu, "TICK_S", 0.01)
    s = thread_cpu.Sampler.__new__(thread_cpu.Sampler)
    zero = dict.fromkeys(thread_cpu.STAT_FIELDS, 0)
    # over 2 s: 300 ticks user + 100 system = 4 core-seconds busy (2 cores), 200 idle (1 core), 20 stolen (0.1)
    mid = {**zero, "user": 100, "system": 50, "idle": 100, "steal": 0}
    end = {**zero, "user": 300, "system": 100, "idle": 200, "steal": 20}
    s.machine = [(0.0, zero), (1.0, mid), (2.0, end)]
    m = s.machine_report()
    assert (m["busy"], m["idle"], m["steal"]) == (2.0, 1.0, 0.1)
    assert m["series"][0] == {"busy": 1.5, "idle": 1.0, "steal": 0.0}
    assert m["series"][1] == {"busy": 2.5, "idle": 1.0, "steal": 0.2} and m["steal_max"] == 0.2


@pytest.mark.parametrize("argv, want", [
    (["ray::HybridWorker.generate"], "ray::HybridWorker"),
    (["ray::IDLE"], "ray::IDLE"),
    (["/usr/bin/python3", "-u", "-m", "rltrain.main", "--config-name", "x"], "python -m rltrain.main"),
    (["python", "-X", "dev", "tools/gpu_placements.py", "--out", "o"], "python gpu_placements.py"),
    (["python3.12", "tools/gpu_placements.py"], "python gpu_placements.py"),
    (["python", "-c", "print(1)"], "python -c"),
    (["/opt/ray/core/src/ray/gcs/gcs_server", "--port=1"], "gcs_server"),
    ([], "?"),
])
def test_labels(argv, want):
    assert procs.label_of(argv) == want


@linux
def test_this_process_threads_are_read():
    mine = procs.thread_ticks("self")
    assert os.getpid() in mine  # the main thread's id is the process id
    assert procs.thread_ticks(2 ** 22 + 7) == {}  # no such process


@pytest.mark.parametrize("argv", [["--out", "o"], ["--out", "o", "--interval", "0", "--", "true"]])
def test_bad_input_exits_2(argv, capsys):
    assert thread_cpu.main(argv) == 2
    assert "thread_cpu:" in capsys.readouterr().err
