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
    assert "cuda" not in res and "per_cpu" not in res and "series" not in res  # none asked for


def test_slow_share_counts_the_half_speed_samples():
    # the lent hosts' pure-Python probe reads ~140 ns or ~290 ns an iteration (a vCPU at half speed)
    assert probes.slow_share([140.0, 281.0, 150.0, 306.0]) == 0.5
    assert probes.slow_share([141.0, 143.0, 146.0]) == 0.0
    assert probes.slow_share([300.0]) == 0.0  # its own fastest
    assert probes.slow_share([100.0, 149.0, 150.0], factor=1.5) == pytest.approx(1 / 3)
    with pytest.raises(ValueError):
        probes.slow_share([])


def test_series_takes_its_samples_interval_apart(monkeypatch):
    slept = []
    monkeypatch.setattr(probes.time, "sleep", slept.append)
    series = probes.mix_series(4, 0.25, n=2_000)
    assert len(series) == 4 and all(v > 0 for v in series)
    assert slept == [0.25] * 3  # between samples, not before the first


def test_main_series_in_the_json(tmp_path, monkeypatch):
    monkeypatch.setattr(probes.time, "sleep", lambda s: None)
    path = tmp_path / "probe.json"
    assert host_probe.main(["--repeats", "1", "--series", "3", "--interval", "0.1", "--json", str(path)]) == 0
    series = json.loads(path.read_text())["series"]
    assert len(series["python_mix_ns"]) == 3 and series["interval_s"] == 0.1
    assert series["slow_share"] == probes.slow_share(series["python_mix_ns"])


def test_bad_repeats_exit_2(capsys):
    assert host_probe.main(["--repeats", "0"]) == 2
    assert "--repeats" in capsys.readouterr().err
    assert host_probe.main(["--series", "-1"]) == 2
    assert "--series" in capsys.readouterr().err
