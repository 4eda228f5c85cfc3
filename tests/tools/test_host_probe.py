"""tools/host_probe.py and harness/probes.py: the timing rule against a workload of known length, the per-CPU pass
(which CPUs it calls slow, the affinity put back), the JSON it writes, and the refusal of a bad argument."""

import json
import os
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

import host_probe  # noqa: E402
from harness import probes  # noqa: E402


def test_best_is_seconds_per_iteration_of_the_fastest_repeat():
    sleeps = iter([0.03, 0.01, 0.02])  # the fastest repeat sleeps 10 ms for its 50 iterations

    def fn(n):
        assert n == 50
        time.sleep(next(sleeps))

    per_iter = probes._best(fn, 50, 3)
    assert 0.01 / 50 <= per_iter < 0.02 / 50


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")
def test_per_cpu_names_the_slow_cpus_and_restores_the_affinity(monkeypatch):
    cpus = sorted(os.sched_getaffinity(0))
    slow = {cpus[-1]} if len(cpus) > 1 else set()

    def fake_best(fn, n, repeats):  # 30 ns on every CPU but the last, which takes 60 ns (a slow vCPU)
        (cpu,) = os.sched_getaffinity(0)  # pinned to exactly one
        return (60e-9 if cpu in slow else 30e-9)

    monkeypatch.setattr(probes, "_best", fake_best)
    out = probes.per_cpu_probes(passes=2)
    assert os.sched_getaffinity(0) == set(cpus)
    assert set(out["python_call_ns_by_cpu"]) == {str(c) for c in cpus}
    assert all(len(v) == 2 for v in out["python_call_ns_by_cpu"].values())
    assert out["fastest_ns"] == 30.0
    assert out["slow_cpus"] == sorted(slow)


def test_main_writes_the_probes_as_json(tmp_path, capsys):
    path = tmp_path / "probe.json"
    assert host_probe.main(["--repeats", "1", "--json", str(path)]) == 0
    res = json.loads(path.read_text())
    assert json.loads(capsys.readouterr().out) == res
    assert res["host"]["logical_cpus"] == os.cpu_count()
    for key in ("python_call_ns", "python_mix_ns", "torch_cpu_op_us"):
        assert res["cpu"][key] > 0
    assert "cuda" not in res and "per_cpu" not in res  # neither asked for


def test_bad_repeats_exit_2(capsys):
    assert host_probe.main(["--repeats", "0"]) == 2
    assert "--repeats" in capsys.readouterr().err
