"""Asynchronous rollout end to end through Ray, split placement on CPU: async grpo_tiny learns like the synchronous
run, never trains on a batch staler than trainer.max_staleness (read back from metrics.jsonl), logs the mismatch and
TIS metrics, and a run SIGKILLed with a batch in flight resumes from its checkpoint and continues exactly. Errors of
an in-flight call (a dead worker) reach the driver."""

import json
import math
import os
import subprocess
import sys
import time

import pytest

from rltrain.main import CONFIG_DIR
from rltrain.trainer.ppo import run_from_config
from rltrain.utils.tracking import read_metrics

pytestmark = pytest.mark.timeout(600)
REPO = os.path.dirname(CONFIG_DIR)
KILL_AFTER_STEP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kill_after_step.py")

STEPS, SAVE_AT, KILL_AFTER = 24, 4, 5
# grpo_tiny shaped to learn in tens of steps (tools/bench_async.py uses the same); split placement, 1 CPU per group.
# Held-out accuracy is measured with sampling (4 samples per prompt at temperature 1): the expected success rate
# is a smooth curve, where greedy accuracy jumps by whole digits learned and makes step counts noisy.
LEARN = ["trainer.colocate=false", "trainer.num_cpus=2", "data.train_batch_size=32", "rollout.n=16",
         "actor.ppo_mini_batch_size=16", "actor.lr=3e-3", "data.synthetic.val_size=64", "trainer.test_freq=3",
         "rollout.val_temperature=1.0", "rollout.val_n=4", "trainer.val_before_train=false", "reward.max_workers=0",
         f"trainer.total_steps={STEPS}", "trainer.logger=[jsonl]", "trainer.plots=false", "trainer.seed=2"]
ASYNC = ["trainer.async_rollout=true", "actor.tis.enable=true", f"trainer.save_freq={SAVE_AT}"]
COMPARED = ["critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "rollout/mismatch_abs_mean",
            "rollout/is_weight_mean", "rollout/staleness_max"]


def _run(run_dir, overrides, *, kill_after=None):
    env = dict(os.environ, WANDB_MODE="offline", RAY_USAGE_STATS_ENABLED="0", RAY_ADDRESS="local")
    # a crash run: rltrain.main with the test's hook that SIGKILLs the process after step `kill_after`
    entry = ["-m", "rltrain.main"] if kill_after is None else [KILL_AFTER_STEP, str(kill_after)]
    cmd = [sys.executable, *entry, "--config-name", "grpo_tiny", *overrides, f"hydra.run.dir={run_dir}"]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400, start_new_session=True)


def _raw_rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _first_step_reaching(rows, accuracy):
    return next((r["step"] for r in rows if r.get("val/accuracy", -1) >= accuracy), None)


def test_async_learns_like_sync_bounded_staleness_and_exact_resume_after_sigkill(tmp_path, ray_session, cfg_for,
                                                                                 fast_overrides):
    sync_dir = str(tmp_path / "sync")
    run_from_config(cfg_for(*LEARN), sync_dir)

    async_dir = tmp_path / "async"
    crashed = _run(async_dir, [*fast_overrides, *LEARN, *ASYNC], kill_after=KILL_AFTER)
    assert crashed.returncode == -9, crashed.stderr[-3000:]  # killed after step 5 with batch 6 in flight
    assert sorted(os.listdir(async_dir / "checkpoints")) == [f"step_{SAVE_AT}"]
    run_from_config(cfg_for(*LEARN, *ASYNC), str(async_dir))  # trainer.resume=auto: continues from step_4

    # Step 5 ran twice: in the killed run, and after the resume from step 4's checkpoint, which saved the batch
    # in flight (generated with the weights of step 3). Same batch, same update: nothing lost or repeated.
    raw = [r for r in _raw_rows(str(async_dir)) if "timing_s/step" in r]
    assert [r["step"] for r in raw] == [*range(1, KILL_AFTER + 1), *range(SAVE_AT + 1, STEPS + 1)]
    before, after = raw[SAVE_AT], raw[KILL_AFTER]
    assert before["step"] == after["step"] == SAVE_AT + 1
    for key in COMPARED:
        assert math.isclose(before[key], after[key], rel_tol=1e-4, abs_tol=1e-6), (key, before[key], after[key])

    sync_rows, async_rows = read_metrics(sync_dir), read_metrics(str(async_dir))
    steps = [r for r in async_rows if "timing_s/step" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    # staleness never exceeds the bound; in steady state every batch is one policy version old
    assert max(r["rollout/staleness_max"] for r in steps) <= 1
    assert [r["rollout/staleness_max"] for r in steps[1:]] == [1] * (STEPS - 1)
    assert all(r["rollout/dropped_samples"] == 0 for r in steps)
    # the mismatch: exact weight sync gives ~0 in the synchronous run; the stale sampler differs in async
    assert max(r["rollout/mismatch_abs_mean"] for r in sync_rows if "timing_s/step" in r) < 1e-3
    assert min(r["rollout/mismatch_abs_mean"] for r in steps[1:]) > 1e-3
    for r in steps:
        assert 0 < r["rollout/is_weight_mean"] <= 2.0 and 0 <= r["rollout/is_clipfrac"] <= 1
        assert r["rollout/is_ratio_max"] >= r["rollout/is_weight_mean"] and r["rollout/mismatch_kl"] >= 0

    # learning: async reaches the sync run's held-out accuracy within 20% more steps (seeds 1-3 checked locally
    # with validation every 2 steps: sync reaches 0.25 at steps 26/20/22, async at 24/22/24; seed 2 runs here,
    # validated every 3 steps to fit the CI budget)
    target = 0.25
    s_sync, s_async = _first_step_reaching(sync_rows, target), _first_step_reaching(async_rows, target)
    assert s_sync is not None, [(r["step"], r.get("val/accuracy")) for r in sync_rows]
    assert s_async is not None and s_async <= math.ceil(1.2 * s_sync), (s_sync, s_async)


def test_dead_rollout_worker_with_a_call_in_flight_raises_worker_lost(ray_session):
    import ray

    from rltrain.workers.group import WorkerGroup, WorkerLost
    from rltrain.workers.placement import GroupPlan

    class Sleeper:  # local: Ray ships it by value (workers cannot import test modules)
        def __init__(self, rank=0, world_size=1):
            self.rank = rank

        def nap(self, seconds):
            time.sleep(seconds)
            return self.rank

    group = WorkerGroup(Sleeper, GroupPlan("rollout", ("rollout",), (1,), 0, "PACK"), cpus_per_worker=0.1)
    try:
        assert group.wait(group.submit_per_replica("nap", [(0.0,)])) == [0]
        pending = group.submit_per_replica("nap", [(30.0,)])  # in flight (the next batch) when the worker dies
        ray.kill(group.workers[0])
        t0 = time.monotonic()
        with pytest.raises(WorkerLost, match=r"worker rollout rank 0 \(roles rollout; node .*\) died: in nap"):
            group.wait(pending)
        assert time.monotonic() - t0 < 20  # fails fast, does not wait for the nap
    finally:
        group.shutdown()
