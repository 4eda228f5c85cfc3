"""calibration.py's fitted constants are what rltrain.plan.fit solves from the measured runs in tools/results, and the
planner's held-out memory predictions stay within the error docs/plan.md reports."""

from __future__ import annotations

import math

import pytest

from rltrain.plan import calibration as cal
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))

from planlab import fit  # noqa: E402


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
    # max_memory_allocated (and vLLM's share); the reserved counter has its own test below
    mem = [r for r in rows if r["role"] == "held out" and r["quantity"].endswith("gib")
           and r["quantity"] != "allocator_reserved_gib"]
    assert len(mem) >= 15
    worst = max(abs(r["error_pct"]) for r in mem)
    assert worst < 6.0, [(r["case"], r["quantity"], round(r["error_pct"], 1)) for r in mem]


def test_reserved_counter_where_vllm_shares_the_card(rows):
    # colocated runs: vLLM's share + the training peak x (1 + allocator_slack). The split run's training GPU (no
    # engine) reserved 1.73x what it allocated, which the slack of the update benchmarks does not describe. Within
    # 2.6% on every run to 2026-11-26's night; the 4B at 4,096-token responses (late) -3.3% (142.7 GiB measured)
    res = [r for r in rows if r["quantity"] == "allocator_reserved_gib" and "split" not in r["case"]
           and "hf engine" not in r["case"]]
    assert len(res) >= 5
    assert max(abs(r["error_pct"]) for r in res) < 4.0, [(r["case"], round(r["error_pct"], 1)) for r in res]


def test_issue_36_runs_step_time(rows):
    # the runs of 2026-11-26 on 2 x H200 (one GPU, colocated DP=2 and the 4B at TP=2, split 1+1) and the one-H100
    # GRPO steps: the whole step within 25% on all but the one-GPU 32 x 8 run (its generation was the fastest ever
    # measured for that config: 28 us per sequence and decode step against 38-58 on every other run)
    steps = {r["case"] + "|" + r["source"]: r["error_pct"] for r in rows if r["quantity"] == "step_s"
             and ("scaling_vllm_h200x2" in r["source"] or "refactor_h200x2" in r["source"]
                  or r["source"].startswith(("vllm/gpu_smoke_grpo_hf.json", "vllm/gpu_smoke_grpo_vllm.json")))}
    assert len(steps) == 8
    outside = [k for k, e in steps.items() if abs(e) > 25]
    assert [k.split("|")[0] for k in outside] == ["0.6B single, 32 x 8"], steps


def test_every_run_is_planned(rows):
    assert not [r for r in rows if r.get("note")], [r for r in rows if r.get("note")]


def test_tp_dp_factor_centres_its_runs_and_refuses_an_unseen_one():
    """tp_dp_layout_factor plans the TP x DP runs at their measured steps in the geometric mean (their log errors sum to
    ~0), each run's error inside the spread of measured / planned-without-it, and a TP x DP run left held out is
    refused (it would be fitted on yet scored as unseen)."""
    import dataclasses

    from planlab.cases import cases

    try:
        fit.results_dir()
    except FileNotFoundError:
        pytest.skip("no measured GPU results in this checkout")
    runs = [c for c in cases() if c.kind == "step" and "step_s" in c.measured and fit.tp_dp_layout(c)]
    assert len(runs) >= 7
    with fit.constant("tp_dp_layout_factor", 1.0):
        ratios = [c.measured["step_s"] / fit.predict(c)["step_s"] for c in runs]
    assert min(ratios) > 1.0  # every run of the layout was slower than planned without the factor
    logs = [math.log(c.measured["step_s"] / fit.predict(c)["step_s"]) for c in runs]
    assert abs(sum(logs) / len(logs)) < 2e-3
    assert max(map(abs, logs)) < math.log(max(ratios) / min(ratios))
    unseen = [dataclasses.replace(runs[0], role="held out", fitted=())] + runs[1:]
    with pytest.raises(ValueError, match="every TP x DP run"):
        fit._solve_layout_factor(unseen)


def test_the_range_across_machines_holds_the_other_runs():
    """host_speed_low / _high come from one config's fourteen runs; the plan's range from them holds the whole steps
    of the other runs but a few (docs/plan.md: the GPU-bound long-context runs, whose misses are the model's own, and
    the 0.6B at DP=4 on its first host)."""
    try:
        fit.results_dir()
    except FileNotFoundError:
        pytest.skip("no measured GPU results in this checkout")
    rows = fit.range_rows()
    assert len(rows) >= 60
    inside = sum(r["inside"] for r in rows)
    assert inside >= 0.85 * len(rows), fit.range_summary(rows)
    assert all(r["low"] <= r["predicted"] <= r["high"] for r in rows)


def test_placement_table_groups_each_whole_step_once(rows):
    """fit.placement_table: every whole step (held out or fitted, not legacy) lands in one placement's row, its counts
    and error range those of the rows it groups; the labels read the runs' configs."""
    from planlab.cases import cases

    by = {(c.name, c.source): c for c in cases()}

    def whole(r):
        c = by[(r["case"], r["source"])]
        return c.kind == "step" and "allocator_peak_gib" in c.measured

    steps = [r for r in rows if r["quantity"] == "step_s" and r["role"] != "legacy" and whole(r)]
    table = fit.placement_table(rows).splitlines()[2:]
    cells = [[x.strip() for x in line.strip("|").split("|")] for line in table]
    assert sum(int(c[4].split()[0]) for c in cells) == len(steps)
    assert sum(int(c[5]) for c in cells) == sum(abs(r["error_pct"]) <= 25 for r in steps)
    labels = {fit.placement_label(by[(r["case"], r["source"])]) for r in steps}
    assert len(labels) == len(cells)
    one = next(r for r in steps if r["case"] == "0.6B single, 32 x 8 (a one-H100 host, the driver at one torch thread)")
    assert fit.placement_label(by[(one["case"], one["source"])]) == ("qwen3-0.6b", "vllm", "one GPU", "H100")
    dp2 = next(r for r in steps
               if r["case"].startswith("0.6B colocated DP=2, one vLLM engine per GPU, 64 x 8 (the same"))
    assert fit.placement_label(by[(dp2["case"], dp2["source"])])[2] == "colocated DP=2, an engine per GPU"
    tp = [c for c in cells if c[:4] == ["qwen3-4b", "vllm", "colocated TP=2, vLLM TP=2", "H200"]]
    assert len(tp) == 1 and int(tp[0][4]) >= 2
