"""The measured runs the planner is calibrated on and scored against: the rows of the results tables (update,
placements, moe and rollout under tools/results/, tools/harness/results.py) as Cases, each with the config overrides
that reproduce it and the quantities the planner predicts, computed from the row's metrics; and FITTED, every run a
constant is solved from (fit.py may read no other). Must not compute predictions (fit.py does).
"""

from __future__ import annotations

import copy
import functools
import os
from dataclasses import dataclass, field

from harness import results as tables

from planlab import REPO

DEFAULT_RESULTS = os.path.join(REPO, "tools", "results")
AREAS = ("update", "placements", "moe", "rollout")  # the tables that hold runs the planner can be compared with

# Every run a fitted constant is solved from, by (variant, device), with the quantities fit.py reads off it (None:
# all it measured). A run here is never scored as held out for those quantities, and a run here with any quantity is
# not among the "genuinely held-out" runs whose step time scores the planner (report.py).
FITTED: dict[tuple[str, str], tuple[str, ...] | None] = {
    # memory: activation bytes (one row each); the update's rates (the two 8k rows, all they measured)
    ("06b-8k-norms+optim", "h100"): None,
    ("06b-8k-all", "h100"): None,
    ("06b-32k-all-rc_selective", "h100"): ("peak_gib", "step_s"),  # act_selective; attention_tflops
    ("06b-64k-all-rc_full", "h100"): ("peak_gib",),
    ("06b-8k-mcore-tp2", "h200x2"): ("peak_gib",),
    ("4b-8k-all", "h200"): ("step_s",),  # update_rate_width_exponent
    ("4b-8k-all-tp2", "h200x2"): ("step_s",),  # tp_allreduce_s
    # recompute_selective_time_factor: the 4B's 32k selective / full pair
    ("4b-32k-all-rc_selective", "h200"): ("step_s",),
    ("4b-32k-all-rc_full", "h200"): ("step_s",),
    # the engine before the 2026-11-23 levers (legacy): logits_bytes_per_element, recompute_full_time_factor
    ("smoke-32k-unfused-rc1", "h100"): ("peak_gib",),
    ("smoke-32k-fused-rc1", "h100"): ("peak_gib",),
    ("smoke-8k-fused-rc1", "h100"): ("step_s",),
    ("smoke-8k-fused-rc0", "h100"): ("step_s",),
    # whole GRPO steps
    ("grpo hf", "h100"): ("generation_s", "ref_s", "update_s"),
    ("grpo vllm", "h100"): ("weight_sync_s",),
    ("grpo vllm k4", "h100"): ("weight_sync_s",),
    ("grpo vllm, Qwen3-4B shape, one GPU", "h200"): ("weight_sync_s",),
    ("placement split 1+1", "h200"): ("weight_sync_s", "generation_s"),
    ("MoE slice EP=2, vLLM", "h200x2"): ("update_s", "weight_sync_s"),
    ("MoE slice EP=2, vLLM, grouped GEMM", "h200x2"): ("update_s",),
    ("0.6B single, 2,048-token responses, forward micro-batches of 4,096", "h200"): ("ref_s", "old_log_prob_s"),
    ("4B single, 2,048-token responses, forward micro-batches of 32,768", "h200"): ("update_s",),
    ("0.6B colocated DP=2, one vLLM engine per GPU, 64 x 8", "h200x2"): ("update_s", "weight_sync_s"),
    ("hf engine, pinned sleep, 0.6B single", "h200"): ("weight_sync_s",),
    ("0.6B single, 4 x 8 at 8,192-token responses", "h200"): ("generation_s",),
    ("0.6B colocated DP=2, one vLLM engine per GPU (2026-11-27)", "h200x2"): ("update_s",),
    ("0.6B colocated DP=2, one vLLM engine per GPU (a second four-H200 host)", "h200x2"): ("generation_s",),
    ("0.6B colocated DP=4, one vLLM engine per GPU (a second four-H200 host)", "h200x4"): ("generation_s",),
    ("vLLM alone, 256 x (64 + 64)", "h200"): ("vllm_freed_gib",),
    # tp_dp_layout_factor: every colocated TP x DP run's step (fit.py refuses a layout run left out of here)
    ("4B colocated TP=2 x DP=2 + vLLM TP=4 (four GPUs)", "h200x4"): ("step_s",),
    ("4B colocated TP=2 x DP=2, two vLLM TP=2 engines (four H100s)", "h100x4"): ("step_s",),
    ("4B colocated TP=2 x DP=2, two vLLM TP=2 engines (four H200s)", "h200x4"): ("step_s",),
    ("4B colocated TP=2 x DP=2, two vLLM TP=2 engines (the profiled four-H200 host)", "h200x4"): ("step_s",),
    ("4B colocated TP=2 x DP=2 + vLLM TP=4 (the profiled four-H200 host)", "h200x4"): ("step_s",),
    ("0.6B colocated TP=2 x DP=2, two vLLM TP=2 engines (four H200s, profiled)", "h200x4"): ("step_s",),
    ("0.6B colocated TP=2 x DP=2, two vLLM TP=2 engines (the same host, profiled)", "h200x4"): ("step_s",),
    ("0.6B colocated TP=2 x DP=2, two vLLM TP=2 engines (the same four-H200 host)", "h200x4"): ("step_s",),
    ("0.6B colocated TP=2 x DP=2, two vLLM TP=2 engines (the same host, the driver at one torch thread)",
     "h200x4"): ("step_s",),
}

# The one config measured on the most machines (the 0.6B one-GPU GRPO step, 32 x 8, vLLM, KL loss), H100 and H200
# machines, 2026-11-22..27: fit.py solves host_speed_low / host_speed_high (the plan's range across machines, not its
# step) from their steps, which stay held out as predictions of the step.
HOST_SPREAD_RUNS = [
    ("grpo vllm", "h100"), ("grpo vllm", "h200"), ("grpo vllm k1", "h100"), ("0.6B single, 32 x 8", "h200"),
    ("0.6B single, 32 x 8 (H100)", "h100"), ("0.6B single, 32 x 8 (beside another run)", "h200"),
    ("0.6B single, 32 x 8 (evening)", "h200"), ("0.6B single, vLLM (2026-11-27)", "h200"),
    ("0.6B single, 32 x 8 (the four-H200 host)", "h200"), ("0.6B single, 32 x 8 (the profiled four-H200 host)", "h200"),
    ("0.6B single, 32 x 8 (the profiled one-H200 host)", "h200"), ("0.6B single, 32 x 8 (probed H200 host 1)", "h200"),
    ("0.6B single, 32 x 8 (probed H100 host 2)", "h100"), ("0.6B single, 32 x 8 (probed H200 host 3)", "h200"),
    ("0.6B single, 32 x 8 (a two-H200 host, phases split)", "h200"),
    ("0.6B single, 32 x 8 (a one-H200 host, probed three times)", "h200"),
    ("0.6B single, 32 x 8 (another one-H200 host, probed three times)", "h200"),
    ("0.6B single, 32 x 8 (a four-H200 host, four ranks split)", "h200"),
    ("0.6B single, 32 x 8 (a two-H200 host, the driver at one torch thread)", "h200"),
    ("0.6B single, 32 x 8 (a one-H100 host, the driver at one torch thread)", "h100")]


@dataclass
class Case:
    """One measured run: a results row with the planner's quantities. scope: "update" (tools/bench_update.py: the
    update phase alone, one micro-batch), "step" (a whole GRPO step) or "rollout" (the engine alone)."""
    name: str  # the row's variant
    device: str  # the row's machine kind, e.g. h200x2
    shape: str  # the row's model shape, e.g. qwen3-0.6b
    date: str
    overrides: list[str]
    scope: str
    measured: dict[str, float]  # quantity -> value (GiB or s); "fits": 1/0
    metrics: dict[str, float] = field(default_factory=dict)  # the row's raw metrics
    lengths: dict | None = None  # whole steps: the run's mean prompt and response tokens
    legacy_q: tuple[str, ...] = ()  # measured through an engine path the model no longer describes ("all": every one)
    unfitted: bool = False  # True: scored as held out although FITTED names it (a test of fit.py's refusal)

    @property
    def gpu(self) -> str:
        """The calibration.DEVICES key of its GPUs: h100 | h200."""
        return self.device.split("x")[0]

    @property
    def key(self) -> tuple[str, str]:
        return self.name, self.device

    @property
    def source(self) -> str:
        return f"{self.device}, {self.date}"

    def role_of(self, quantity: str) -> str:
        """legacy | fit | held out."""
        if quantity in self.legacy_q or "all" in self.legacy_q:
            return "legacy"
        if self.key in FITTED and not self.unfitted:
            fitted = FITTED[self.key]
            if fitted is None or quantity in fitted:
                return "fit"
        return "held out"

    @property
    def fitted_any(self) -> bool:
        """Whether any quantity of this run fitted a constant (then its step is no held-out score)."""
        return self.key in FITTED and not self.unfitted


def measured(scope: str, m: dict[str, float]) -> dict[str, float]:
    """The planner's quantities from a row's metrics: the update benchmark's own, the engine's generation time and
    what its sleep freed, or a trainer run's steady-step means (the update both models', the weight sync with the
    engine's sleep, the training GPUs' max_memory_allocated / _reserved and the rollout GPUs')."""
    if scope == "update":
        return {k: m[k] for k in ("peak_gib", "step_s", "reserved_gib", "fits") if k in m}
    if scope == "rollout":
        return {"generation_s": m["gen_s"], "vllm_freed_gib": m["sleep_freed_gib"]}
    out = {"allocator_peak_gib": m["perf/max_memory_allocated_gb"], "generation_s": m["timing_s/gen"],
           "old_log_prob_s": m["timing_s/old_log_prob"],
           "update_s": m["timing_s/update_actor"] + m.get("timing_s/update_critic", 0.0),
           "weight_sync_s": m["timing_s/update_weights"] + m.get("timing_s/rollout_sleep", 0.0)}
    for q, k in (("allocator_reserved_gib", "perf/max_memory_reserved_gb"), ("ref_s", "timing_s/ref"),
                 ("step_s", "timing_s/step"), ("values_s", "timing_s/values"),
                 ("rollout_allocator_peak_gib", "perf/max_memory_allocated_gb/rollout")):
        if k in m:
            out[q] = m[k]
    return out


def case_of(row: dict) -> Case:
    m = row["metrics"]
    scope = row.get("scope", "step")
    lengths = None
    if scope == "step":
        lengths = {"prompt_tokens": round(m["prompt_length/mean"]), "response_tokens": round(m["response_length/mean"])}
    return Case(row["variant"], row["device"], row["shape"], row["date"], list(row.get("config", [])), scope, measured(scope, m), m,
                lengths, tuple(row.get("legacy", ())))


@functools.lru_cache(maxsize=None)
def _cases(results_dir: str) -> tuple[Case, ...]:
    rows = [r for area in AREAS for r in tables.read(area, results_dir) if "scope" in r and "config" in r]
    return tuple(case_of(r) for r in rows)


def cases(results_dir: str | None = None) -> list[Case]:
    """Every run of the tables under results_dir (default tools/results/) the planner can be compared with."""
    path = results_dir or DEFAULT_RESULTS
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no {path} directory with the results tables")
    return [copy.deepcopy(c) for c in _cases(os.path.abspath(path))]


def by_key(all_cases: list[Case]) -> dict[tuple[str, str], Case]:
    return {c.key: c for c in all_cases}


def compose(overrides: list[str]):
    """grpo_tiny with `overrides`, as the typed RLConfig the planner reads (a fresh copy each call)."""
    return copy.deepcopy(_compose(tuple(overrides)))


@functools.lru_cache(maxsize=None)
def _compose(overrides: tuple[str, ...]):
    from rltrain.config.entry import compose_config

    return compose_config("grpo_tiny", list(overrides))
