"""tools/harness/probes.py (the host probes tools/gpu_placements.py records): the timing rule against a workload of
known length, the CPU probes, the series of samples and its share of slow ones."""

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

from harness import probes  # noqa: E402


def test_best_is_seconds_per_iteration_of_the_fastest_repeat():
    sleeps = iter([0.03, 0.01, 0.02])  # the fastest repeat sleeps 10 ms for its 50 iterations

    def fn(n):
        assert n == 50
        time.sleep(next(sleeps))

    per_iter = probes._best(fn, 50, 3)
    assert 0.01 / 50 <= per_iter < 0.02 / 50


def test_cpu_probes_time_a_call_a_loop_and_a_torch_op():
    res = probes.cpu_probes(1)
    for key in ("python_call_ns", "python_mix_ns", "torch_cpu_op_us"):
        assert res[key] > 0
    assert probes.host_facts()["logical_cpus"] == os.cpu_count()


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


def test_series_probe_reports_its_samples_and_slow_share(monkeypatch):
    monkeypatch.setattr(probes.time, "sleep", lambda s: None)
    series = probes.series_probe(3, 0.1)
    assert len(series["python_mix_ns"]) == 3 and series["interval_s"] == 0.1
    assert series["slow_share"] == probes.slow_share(series["python_mix_ns"])
