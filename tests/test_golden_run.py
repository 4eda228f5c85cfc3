"""The refactor guard: grpo_tiny's 40 steps at the default seed reproduce a golden metrics.jsonl exactly.

tests/golden/grpo_tiny_40_<ISA>.jsonl was written by `python -m rltrain.main --config-name grpo_tiny
trainer.total_steps=40` (two runs agreed to the last bit on every non-timing metric), one file per CPU kernel set
that ATen dispatches to (`torch.backends.cpu.get_cpu_capability()`): the AVX512 file at main eabe934, before any
commit of the first "one shape" refactor; the AVX2 file at main a444f0f on an AVX2-only machine, where the same code
differs from the AVX512 file at about 1e-7 (vectorized reductions of another width), before the second. Every metric but the timings (`timing_s/*`) and the machine's own (`perf/*`) must match
exactly: a change of structure changes no number; a difference nobody can explain is a bug.
"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN_DIR = os.path.join(ROOT, "tests", "golden")
CAPABILITY = torch.backends.cpu.get_cpu_capability()
GOLDEN = os.path.join(GOLDEN_DIR, f"grpo_tiny_40_{CAPABILITY}.jsonl")
VOLATILE = ("timing_s/", "perf/")
# metrics added after a golden file was written, compared where the file has them: the AVX512 file has not been
# rewritten on an AVX512 machine since (issue 60 added rollout/logprob_diff_nonzero_frac at main 724b15f; the AVX2
# file has it, written with every older metric unchanged)
ADDED_SINCE = ("rollout/logprob_diff_nonzero_frac",)


def _rows(path):
    with open(path) as f:
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(VOLATILE)} for line in f if line.strip()]


def _differences(golden, got):
    out = []
    if len(golden) != len(got):
        out.append(f"{len(got)} rows, golden has {len(golden)}")
    for g, r in zip(golden, got):
        for key in sorted(set(g) | (set(r) - {k for k in ADDED_SINCE if k not in g})):
            a, b = g.get(key, "<missing>"), r.get(key, "<missing>")
            same = a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))
            if not same:
                out.append(f"step {g.get('step')}: {key}: golden {a!r}, now {b!r}")
    return out


def test_differences_finds_a_changed_metric():
    golden = _rows(os.path.join(GOLDEN_DIR, "grpo_tiny_40_AVX2.jsonl"))
    changed = [dict(r) for r in golden]
    changed[3]["actor/grad_norm"] = changed[3].get("actor/grad_norm", 0.0) + 1e-12
    del changed[5]["step"]
    diffs = _differences(golden, changed)
    assert len(diffs) == 2 and "actor/grad_norm" in diffs[0] and "<missing>" in diffs[1]
    assert _differences(golden, golden) == []
    older = [{k: v for k, v in r.items() if k not in ADDED_SINCE} for r in golden]  # a file from before the metric
    assert _differences(older, golden) == [] and len(_differences(golden, older)) == 40


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(GOLDEN), reason=f"no golden run for this CPU's kernels ({CAPABILITY}): "
                    "write one with the command in this file's docstring at a commit that reproduces another ISA's")
def test_grpo_tiny_40_steps_reproduce_the_golden_metrics(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "rltrain.main", "--config-name", "grpo_tiny", "trainer.total_steps=40",
         "trainer.logger=[jsonl]", f"hydra.run.dir={run_dir}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    golden, got = _rows(GOLDEN), _rows(run_dir / "metrics.jsonl")
    assert len(golden) == 41 and any("actor/grad_norm" in r for r in golden)
    diffs = _differences(golden, got)
    assert not diffs, f"{len(diffs)} metric(s) differ from the golden run:\n" + "\n".join(diffs[:40])


# grpo_tiny for 3 steps in one process, no validation
SHORT = ["trainer.total_steps=3", "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.use_ray=false",
         "trainer.logger=[jsonl]"]


def _short_run(tmp_path, *overrides: str) -> list[dict]:
    """grpo_tiny's SHORT run with `overrides` in a child process (this process's state cannot touch its numbers):
    its metric rows."""
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "rltrain.main", "--config-name", "grpo_tiny", *SHORT, f"hydra.run.dir={run_dir}",
         *overrides],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _rows(run_dir / "metrics.jsonl")


@pytest.mark.skipif(not os.path.exists(GOLDEN), reason=f"no golden run for this CPU's kernels ({CAPABILITY})")
def test_offloaded_state_and_validation_between_steps_change_no_number(tmp_path):
    """actor.offload_while_rollout (params and optimizer state to other tensors while the engine generates),
    actor.optimizer_offload_fraction=0.5 (half the AdamW state stepped by a second, host AdamW) and a validation
    after every step (trainer.test_freq=1; the golden run validated before step 1 only): grpo_tiny's first steps are
    the golden run's, metric for metric. Validation samples with its own seeded generator and touches no random
    stream of training (sampler order, rollout seeds, minibatch shuffles)."""
    got = _short_run(tmp_path, "actor.offload_while_rollout=true", "actor.optimizer_offload_fraction=0.5",
                     "trainer.test_freq=1")
    assert len(got) == 3 and all("val/accuracy" in r for r in got), got
    got = [{k: v for k, v in r.items() if not k.startswith("val/")} for r in got]
    golden = [r for r in _rows(GOLDEN) if 1 <= r.get("step", 0) <= 3]
    assert not _differences(golden, got), _differences(golden, got)[:20]


def test_engine_init_pushes_the_actors_weights_before_the_first_generation(tmp_path):
    """model.init=engine: the actor makes its own random weights and the rollout engine (started from others) takes
    them before generating: the sampler's log-probs are the actor's from the first step on (rounding apart). In this
    process (no number here is compared bit for bit; a child would only add its imports)."""
    from rltrain.config.entry import compose_config
    from rltrain.trainer.ppo import run_from_config

    run_dir = tmp_path / "run"
    run_from_config(compose_config("grpo_tiny", [*SHORT, "model.init=engine", "actor.use_kl_loss=false"]), str(run_dir))
    got = _rows(run_dir / "metrics.jsonl")
    assert len(got) == 3 and all(r["rollout/mismatch_abs_mean"] < 1e-5 for r in got), got[0]
