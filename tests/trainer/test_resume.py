"""Crash + resume: a killed run continues from its last intact checkpoint and reproduces an uninterrupted run;
a truncated checkpoint is detected and skipped.

In process (trainer.use_ray=false): the checkpoint/resume code is the same with Ray, and Ray's start-up would
double this test's time; resuming through Ray after a killed worker is tests/trainer/test_multinode.py's."""

import math
import os
import subprocess
import sys
import tempfile

import pytest

from rltrain.main import CONFIG_DIR
from rltrain.utils.tracking import read_metrics

pytestmark = pytest.mark.timeout(900)
REPO = os.path.dirname(CONFIG_DIR)
KILL_AFTER_STEP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kill_after_step.py")
COMPARED = ["critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "response_length/mean"]


def _start(run_dir, overrides, *, kill_after=None) -> tuple[subprocess.Popen, str]:
    """The run in the background, its output in a file beside run_dir (a pipe nobody reads could stall it)."""
    env = dict(os.environ, WANDB_MODE="offline", RAY_USAGE_STATS_ENABLED="0")
    # a crash run: rltrain.main with the test's hook that SIGKILLs the process after step `kill_after`
    entry = ["-m", "rltrain.main"] if kill_after is None else [KILL_AFTER_STEP, str(kill_after)]
    cmd = [sys.executable, *entry, "--config-name", "grpo_tiny", *overrides, f"hydra.run.dir={run_dir}"]
    fd, log = tempfile.mkstemp(suffix=".stderr", dir=os.path.dirname(run_dir))
    with os.fdopen(fd, "w") as err:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True), log


def _wait(started: tuple[subprocess.Popen, str]) -> subprocess.CompletedProcess:
    proc, log = started
    try:
        proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    with open(log) as f:
        return subprocess.CompletedProcess(proc.args, proc.returncode, None, f.read())


def _run(run_dir, overrides, *, kill_after=None) -> subprocess.CompletedProcess:
    return _wait(_start(run_dir, overrides, kill_after=kill_after))


def test_kill_resume_reproduces_uninterrupted_run_and_skips_truncated_checkpoint(tmp_path, fast_overrides):
    base = [*fast_overrides, "trainer.test_freq=-1", "trainer.logger=[jsonl]", "trainer.save_freq=2",
            "trainer.total_steps=4", "trainer.use_ray=false"]
    crashed = tmp_path / "crashed"
    # the uninterrupted run and the run that crashes are independent processes (one thread each): at once
    full, first = _start(tmp_path / "full", base), _start(crashed, base, kill_after=3)
    full, first = _wait(full), _wait(first)
    assert full.returncode == 0, full.stderr[-3000:]
    assert first.returncode == -9, first.stderr[-3000:]  # SIGKILL after step 3: no step 4, step_2 saved
    assert sorted(n for n in os.listdir(crashed / "checkpoints") if n != ".rltrain.lock") == ["step_2"]
    assert max(r["step"] for r in read_metrics(str(crashed))) == 3

    resumed = _run(crashed, base)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "step_2" in resumed.stderr
    ref = {r["step"]: r for r in read_metrics(str(tmp_path / "full"))}
    got = {r["step"]: r for r in read_metrics(str(crashed))}  # rows of steps 3-4 come from the resumed run
    for step in (3, 4):
        for key in COMPARED:
            a, b = ref[step][key], got[step][key]
            assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6), (step, key, a, b)

    # Truncate the newest checkpoint: the next start reports it and falls back to step_2.
    ckpts = crashed / "checkpoints"
    assert sorted(n for n in os.listdir(ckpts) if n != ".rltrain.lock") == ["step_2", "step_4"]
    victim = ckpts / "step_4" / "worker_rank0.pt"
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    # (in process as the runs above: base[:-1] once dropped trainer.use_ray=false, and this run started Ray)
    again = _run(crashed, [o for o in base if o != "trainer.total_steps=4"] + ["trainer.total_steps=5"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert "skipping checkpoint" in again.stderr and "truncated" in again.stderr
    assert "step_2" in again.stderr.split("resumed from", 1)[1].splitlines()[0]
