"""tests/trainer/exposure.py on programs that do expose something: a socket listening on every interface and a secret
put on a command line are both reported (so a clean report of a real run, tests/trainer/test_shared_host.py, means
something); a loopback listener is not."""

import os
import sys

import pytest

import exposure

pytestmark = pytest.mark.skipif(not os.path.isfile("/proc/net/tcp"), reason="needs Linux /proc/net")

LISTEN = "import socket, time; s = socket.socket(); s.bind(({host!r}, 0)); s.listen(); time.sleep(2.5)"
SHOW = ("import os, subprocess, sys; subprocess.run([sys.executable, '-c', 'import time; time.sleep(2.5)', "
        "os.environ['HF_TOKEN']])")


def test_a_wide_listener_and_a_secret_on_a_command_line_are_reported():
    report = exposure.watch({"wide": [sys.executable, "-c", LISTEN.format(host="0.0.0.0")],
                                 "loop": [sys.executable, "-c", LISTEN.format(host="127.0.0.1")],
                                 "show": [sys.executable, "-c", SHOW]}, poll_s=0.2)
    runs = report["runs"]
    assert all(r["returncode"] == 0 for r in runs.values()), runs
    (wide,) = [a for addrs in runs["wide"]["listeners"].values() for a in addrs]
    (loop,) = [a for addrs in runs["loop"]["listeners"].values() for a in addrs]
    assert wide.startswith("0.0.0.0:") and loop.startswith("127.0.0.1:")
    assert report["secrets_on_command_lines"] == ["HF_TOKEN"]
    found = exposure.problems(report)
    assert [p for p in found if "listens on" in p] == [f"wide: {who} listens on {wide}" for who in
                                                       runs["wide"]["listeners"]]
    assert "HF_TOKEN on a command line" in found
