"""tools/bench_offpolicy.py without running a trainer: the variants it runs are valid configs that differ from the
base only where named, and its summary of a run's metrics rows is checked against numbers worked by hand."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import bench_offpolicy  # noqa: E402
from harness.cases import SPLIT  # noqa: E402

from rltrain.algorithms import OFF_POLICY_MODES  # noqa: E402


def test_variants_cover_the_k_sweep_partial_and_every_mode_at_the_deepest_k():
    v = bench_offpolicy.variants(4)
    assert list(v)[:7] == ["sync", "k1", "k1_partial", "k2", "k2_partial", "k4", "k4_partial"]
    assert v["sync"] == []
    assert "trainer.max_staleness=2" in v["k2"] and "rollout.partial=true" in v["k2_partial"]
    modes = {o.split("=")[1] for n, ov in v.items() if n.startswith("k4") and "partial" not in n for o in ov
             if o.startswith("actor.off_policy.mode=")}
    assert modes == set(OFF_POLICY_MODES)
    assert len(bench_offpolicy.variants(1)) == 1 + 4 + len(OFF_POLICY_MODES) - 1  # k = 1 and 2 always; modes at 1


@pytest.mark.parametrize("name", ["k2_partial", "k4_geo_mask"])
def test_a_variant_is_a_valid_split_async_config(name):
    from rltrain.config import as_config
    from rltrain.config.entry import compose_config
    from rltrain.config.validate import validate_config

    raw = compose_config("grpo_tiny", [*SPLIT, "trainer.n_gpus_per_node=1",
                                       *bench_offpolicy.variants(4)[name]])
    validate_config(raw)  # raises ConfigError naming the key where a variant is impossible
    cfg = as_config(raw)
    assert cfg.trainer.async_rollout and not cfg.trainer.colocate


def test_summary_of_rows_worked_by_hand():
    rows = [{"step": 0, "val/accuracy": 0.1, "timing_s/validation": 1.0}]
    for s in range(1, 5):
        rows.append({"step": s, "timing_s/step": 2.0, "perf/total_num_tokens": 100, "rollout/staleness_mean": s / 4,
                     "rollout/staleness_max": 1, "rollout/dropped_samples": s % 2, "rollout/is_ratio_max": float(s),
                     "rollout/is_weight_mean": 1.0 - s / 10, **({"val/accuracy": s / 4} if s % 2 == 0 else {})})
    out = bench_offpolicy.summarize(rows)
    assert out["steps"] == 4 and out["dropped_samples"] == 2
    assert out["staleness_mean"] == pytest.approx((0.25 + 0.5 + 0.75 + 1.0) / 4)
    assert out["rollout/is_ratio_max"] == 4.0  # a max stays a max
    assert out["rollout/is_weight_mean"] == pytest.approx(1.0 - 0.25)
    assert out["curve"]["by_step"] == [(0, 0.1), (2, 0.5), (4, 1.0)]
    assert out["curve"]["by_time_s"] == [(1.0, 0.1), (5.0, 0.5), (9.0, 1.0)]  # validation 1 s + 2 s per step
    assert (out["best"], out["final"], out["final3"]) == (1.0, 1.0, pytest.approx(1.6 / 3))
    md = bench_offpolicy.to_markdown({"date": "d", "device": "cpu", "command": "c", "total_s": 1.0,
                                      "runs": {"sync": {**out, "wave": 1}, "k2": {"wave": 1, "error": "rc=1"}}})
    assert "Target: 90% of the synchronous run's best held-out accuracy = 0.900" in md
    assert "| k2 | 1 | rc=1 |" in md
    # the offpolicy table: one row per finished run, keyed by its name and seed; a failed run has none
    rows = bench_offpolicy.table_rows({"date": "2026-11-28", "runs": {"sync": {**out, "wave": 1, "overrides": []},
                                                                      "k2": {"wave": 1, "error": "rc=1"}}},
                                      seed=3, cpu=True)
    assert [(r["variant"], r["device"]) for r in rows] == [("sync, seed 3", "cpu")]
    assert rows[0]["metrics"]["rollout/is_weight_mean"] == pytest.approx(0.75) and rows[0]["metrics"]["best"] == 1.0
