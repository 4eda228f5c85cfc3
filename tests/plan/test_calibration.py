"""rltrain/plan/calibration.py: every constant names where it comes from and what kind it is; override() plans with
one constant at another value inside its block only. (The fitted values against their refit: tests/tools/
test_planlab_fit.py.)"""

from __future__ import annotations

import math

from rltrain.plan import calibration as cal


def test_every_constant_has_a_source_and_a_kind():
    for name, c in cal.all_constants().items():
        assert c.source and c.kind in ("fitted", "measured", "assumed"), name
        assert math.isfinite(c.value), name
    for d in cal.DEVICES.values():
        assert d.total_gib > 0 and d.hbm_bytes_per_s > 0 and d.source


def test_override_holds_the_value_inside_its_block_only():
    before = cal.value("tp_dp_layout_factor")
    try:
        with cal.override("tp_dp_layout_factor", 1.0):
            assert cal.value("tp_dp_layout_factor") == 1.0
            assert cal.TIME["tp_dp_layout_factor"].source  # the rest of the constant is kept
            raise KeyError("leaves the block")
    except KeyError:
        pass
    assert cal.value("tp_dp_layout_factor") == before
