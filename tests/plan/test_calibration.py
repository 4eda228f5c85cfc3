"""calibration.py's fitted constants are what rltrain.plan.fit solves from the measured runs in tools/results, and the
planner's held-out memory predictions stay within the error docs/plan.md reports."""

from __future__ import annotations

import math

import pytest

from rltrain.plan import calibration as cal
from rltrain.plan import fit


@pytest.fixture(scope="module")
def rows():
    try:
        fit.results_dir()
    except FileNotFoundError:
        pytest.skip("no measured GPU results in this checkout")
    return fit.compare()


def test_every_constant_has_a_source_and_a_kind():
    for name, c in cal.all_constants().items():
        assert c.source and c.kind in ("fitted", "measured", "assumed"), name
        assert math.isfinite(c.value), name
    for d in cal.DEVICES.values():
        assert d.total_gib > 0 and d.hbm_bytes_per_s > 0 and d.source


def test_fitted_constants_equal_the_refit():
    try:
        fit.results_dir()
    except FileNotFoundError:
        pytest.skip("no measured GPU results in this checkout")
    fitted = fit.fit(verbose=False)
    assert set(fitted) == {k for k, c in cal.all_constants().items() if c.kind == "fitted"}
    for k, v in fitted.items():
        assert cal.value(k) == pytest.approx(v, rel=2e-3, abs=2e-4), k


def test_held_out_memory_error(rows):
    mem = [r for r in rows if r["role"] == "held out" and r["quantity"].endswith("gib")]
    assert len(mem) >= 15
    worst = max(abs(r["error_pct"]) for r in mem)
    assert worst < 6.0, [(r["case"], r["quantity"], round(r["error_pct"], 1)) for r in mem]


def test_every_run_is_planned(rows):
    assert not [r for r in rows if r.get("note")], [r for r in rows if r.get("note")]
