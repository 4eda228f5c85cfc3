"""Summaries of a trainer run's metrics rows (metrics.jsonl, harness.run_rows) that several tools report: the speed of
its steady steps, the steady-step means a results row keeps (step_row), and its held-out accuracy curve by step and
by loop seconds. Must not run or report anything.
"""

from __future__ import annotations

# the phases of a GRPO step the speed summary averages (split placement; gen_wait is the asynchronous wait)
PHASES = ("timing_s/gen_wait", "timing_s/gen", "timing_s/old_log_prob", "timing_s/ref", "timing_s/update_actor",
          "timing_s/update_weights", "timing_s/step")


def speed_summary(rows: list[dict], skip: int = 2) -> dict:
    """Means of PHASES over the steps after the first `skip` (compiles; nothing to overlap yet), the median step,
    tokens/s (their tokens over their summed step time), the largest staleness and the mean mismatch."""
    steps = [r for r in rows if "timing_s/step" in r]
    steady = steps[skip:] or steps
    if not steady:
        return {}
    mean = {k: sum(r.get(k, 0.0) for r in steady) / len(steady) for k in PHASES}
    tokens = sum(r["perf/total_num_tokens"] for r in steady)
    times = sorted(r["timing_s/step"] for r in steady)
    return {"steps": len(steps), "steady_steps": len(steady), "mean": mean, "median_step_s": times[len(times) // 2],
            "tokens_per_s": tokens / max(sum(r["timing_s/step"] for r in steady), 1e-9),
            "max_staleness_seen": max((r.get("rollout/staleness_max", 0) for r in steps), default=0),
            "mismatch_abs_mean": sum(r.get("rollout/mismatch_abs_mean", 0.0) for r in steady) / len(steady),
            "mismatch_kl": sum(r.get("rollout/mismatch_kl", 0.0) for r in steady) / len(steady)}


def learning_curve(rows: list[dict]) -> dict:
    """val/accuracy by step and by cumulative loop seconds (step + validation wall-clock: in async mode validation
    first waits for the batch in flight, so generation time is never left out)."""
    clock, acc, by_time = 0.0, [], []
    for r in rows:
        clock += r.get("timing_s/step", 0.0) + r.get("timing_s/validation", 0.0)
        if "val/accuracy" in r:
            acc.append((r["step"], r["val/accuracy"]))
            by_time.append((round(clock, 2), r["val/accuracy"]))
    return {"by_step": acc, "by_time_s": by_time}


def steps_to(curve: list[tuple], target: float):
    """The first x of a learning curve [(x, accuracy), ...] (step or seconds) whose accuracy reaches target; None."""
    return next((x for x, a in curve if a >= target), None)


# the trainer metrics a GRPO step's results row keeps (tools/planlab/cases.py reads them): steady-step means, except
# the memory counters, whose maximum over the run's steps is kept
STEP_METRICS = ("timing_s/gen", "timing_s/old_log_prob", "timing_s/ref", "timing_s/values", "timing_s/update_actor",
                "timing_s/update_critic", "timing_s/update_weights", "timing_s/rollout_sleep", "timing_s/rollout_wake",
                "timing_s/step", "prompt_length/mean", "response_length/mean", "perf/throughput")


def step_row(rows: list[dict], skip: int) -> dict[str, float]:
    """A GRPO run's row metrics: STEP_METRICS averaged over its steps after the first `skip` (steps run under the
    profiler left out), and max_memory_allocated / _reserved over every step: of the training GPUs
    (perf/max_memory_allocated_gb, the largest per-GPU one when the run logs one per GPU) and, where the run logs
    them apart, of the rollout GPUs (perf/max_memory_allocated_gb/rollout)."""
    timed = [r for r in rows if "timing_s/step" in r and not r.get("perf/profiled")]
    steady = timed[skip:] or timed
    out = {k: sum(r[k] for r in steady if k in r) / sum(1 for r in steady if k in r)
           for k in STEP_METRICS if any(k in r for r in steady)}
    for counter in ("allocated", "reserved"):
        base = f"perf/max_memory_{counter}_gb"
        per_gpu = {k.rsplit("/", 1)[1]: max(r.get(k, 0.0) for r in rows) for k in {k for r in rows for k in r}
                   if k.startswith(base + "/")}
        train = [v for k, v in per_gpu.items() if not k.startswith("rollout")]
        roll = [v for k, v in per_gpu.items() if k.startswith("rollout")]
        if train or any(base in r for r in rows):
            out[base] = max(train) if train else max(r.get(base, 0.0) for r in rows)
        if roll and counter == "allocated":
            out[base + "/rollout"] = max(roll)
    return out
