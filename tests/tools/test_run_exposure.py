"""tools/run_exposure.py on programs that do expose something: a socket listening on every interface and a secret
put on a command line are both reported (so a clean report of a real run, tests/trainer/test_shared_host.py, means
something); a loopback listener is not."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

import run_exposure  # noqa: E402

pytestmark = pytest.mark.skipif(not os.path.isfile("/proc/net/tcp"), reason="needs Linux /proc/net")

LISTEN = "import socket, time; s = socket.socket(); s.bind(({host!r}, 0)); s.listen(); time.sleep(2.5)"
SHOW = ("import os, subprocess, sys; subprocess.run([sys.executable, '-c', 'import time; time.sleep(2.5)', "
        "os.environ['HF_TOKEN']])")


def test_a_wide_listener_and_a_secret_on_a_command_line_are_reported():
    report = run_exposure.watch({"wide": [sys.executable, "-c", LISTEN.format(host="0.0.0.0")],
                                 "loop": [sys.executable, "-c", LISTEN.format(host="127.0.0.1")],
                                 "show": [sys.executable, "-c", SHOW]}, poll_s=0.2)
    runs = report["runs"]
    assert all(r["returncode"] == 0 for r in runs.values()), runs
    (wide,) = [a for addrs in runs["wide"]["listeners"].values() for a in addrs]
    (loop,) = [a for addrs in runs["loop"]["listeners"].values() for a in addrs]
    assert wide.startswith("0.0.0.0:") and loop.startswith("127.0.0.1:")
    assert report["secrets_on_command_lines"] == ["HF_TOKEN"]
    found = run_exposure.problems(report)
    assert [p for p in found if "listens on" in p] == [f"wide: {who} listens on {wide}" for who in
                                                       runs["wide"]["listeners"]]
    assert "HF_TOKEN on a command line" in found


@pytest.mark.parametrize("argv, want", [
    (["ray::HybridWorker.generate"], "ray::HybridWorker"),
    (["/usr/bin/python3", "-u", "-m", "rltrain.main", "--config-name", "x"], "python -m rltrain.main"),
    (["python", "-X", "dev", "tools/gpu_placements.py", "--out", "o"], "python gpu_placements.py"),
    (["python", "-c", "print(1)"], "python -c"),
    (["/opt/ray/core/src/ray/gcs/gcs_server", "--port=1"], "gcs_server"),
    ([], "?"),
])
def test_process_labels(argv, want):  # harness/procs.py, which names the processes in the report
    from harness import procs

    assert procs.label_of(argv) == want
