"""Stop + resume: a run stopped by Ctrl-C, rerun with the command its stop line prints, continues in the same run
directory from its last intact checkpoint and reproduces an uninterrupted run (one metrics.jsonl, each step once); a
truncated checkpoint is detected and skipped.

In process (trainer.use_ray=false): the checkpoint/resume code is the same with Ray, and Ray's start-up would
double this test's time; resuming through Ray after a killed worker is tests/trainer/test_multinode.py's, after a
SIGKILL tests/trainer/test_async_e2e.py's."""

import json
import math
import os
import shlex
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


def _start(run_dir, overrides, *, stop=None, cwd=REPO) -> tuple[subprocess.Popen, str]:
    """The run in the background, its output in a file in `cwd` (a pipe nobody reads could stall it). stop: the
    test hook's `N` (SIGKILL after step N) or `N:SIGINT` (Ctrl-C after step N). run_dir None: Hydra's own
    outputs/<experiment>/<time> under `cwd`."""
    entry = ["-m", "rltrain.main"] if stop is None else [KILL_AFTER_STEP, stop]
    where = [] if run_dir is None else [f"hydra.run.dir={run_dir}"]
    return _popen([sys.executable, *entry, "--config-name", "grpo_tiny", *overrides, *where], cwd)


def _popen(cmd, cwd) -> tuple[subprocess.Popen, str]:
    """`cmd` in the background from `cwd`, the repo's rltrain importable from anywhere."""
    env = dict(os.environ, WANDB_MODE="offline", RAY_USAGE_STATS_ENABLED="0",
               PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    fd, log = tempfile.mkstemp(suffix=".stderr", dir=None if cwd == REPO else cwd)
    with os.fdopen(fd, "w") as err:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=err,
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


def _raw_steps(run_dir) -> list[int]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["step"] for line in f if line.strip()]


def test_ctrl_c_then_the_printed_command_continues_in_place_as_an_uninterrupted_run(tmp_path, fast_overrides):
    base = [*fast_overrides, "trainer.test_freq=-1", "trainer.logger=[jsonl]", "trainer.save_freq=2",
            "trainer.total_steps=4", "trainer.use_ray=false", "trainer.plots=false",
            "reward.timeout_s=300"]  # a reward call late on a loaded machine would score 0 in one run only
    # the uninterrupted run and the run stopped by Ctrl-C after step 3 (in Hydra's outputs/grpo_tiny/<time> under
    # tmp_path) are independent processes (one thread each): at once
    full, first = _start(tmp_path / "full", base), _start(None, base, stop="3:SIGINT", cwd=tmp_path)
    full, first = _wait(full), _wait(first)
    assert full.returncode == 0, full.stderr[-3000:]
    assert first.returncode == 130, first.stderr[-3000:]  # Ctrl-C after step 3: step_2 saved
    (stopped,) = (tmp_path / "outputs" / "grpo_tiny").iterdir()
    assert sorted(n for n in os.listdir(stopped / "checkpoints") if n != ".rltrain.lock") == ["step_2"]
    assert _raw_steps(stopped) == [1, 2, 3]
    assert "Traceback" not in first.stderr and "KeyboardInterrupt" not in first.stderr  # nor from reward workers
    (line,) = [ln for ln in first.stderr.splitlines() if "interrupted at step 3" in ln]
    command = line.split("resume with: ", 1)[1]
    assert command.split()[1:3] == ["-m", "rltrain.main"] and "trainer.resume=auto" in command

    resumed = _wait(_popen(shlex.split(command), tmp_path))  # as printed, from tmp_path
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {stopped}/checkpoints/step_2 (step 2)" in resumed.stderr
    assert os.listdir(tmp_path / "outputs" / "grpo_tiny") == [stopped.name]  # one run directory
    assert _raw_steps(stopped) == [1, 2, 3, 4]  # step 3 run again replaced its row: each step once
    ref = {r["step"]: r for r in read_metrics(str(tmp_path / "full"))}
    got = {r["step"]: r for r in read_metrics(str(stopped))}
    for step in (1, 2, 3, 4):  # 1-2 from the stopped run, 3-4 from the resumed one
        for key in COMPARED:
            a, b = ref[step][key], got[step][key]
            assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6), (step, key, a, b)
    assert (stopped / "main.log").read_text().count("interrupted at step 3") == 1  # the record goes on

    # Truncate the newest checkpoint: the next start reports it and falls back to step_2.
    ckpts = stopped / "checkpoints"
    assert sorted(n for n in os.listdir(ckpts) if n != ".rltrain.lock") == ["step_2", "step_4"]
    victim = ckpts / "step_4" / "worker_rank0.pt"
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    # (in process as the runs above: base[:-1] once dropped trainer.use_ray=false, and this run started Ray)
    again = _wait(_start(stopped, [o for o in base if o != "trainer.total_steps=4"] + ["trainer.total_steps=5"]))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "skipping checkpoint" in again.stderr and "truncated" in again.stderr
    assert "step_2" in again.stderr.split("resumed from", 1)[1].splitlines()[0]
    assert _raw_steps(stopped) == [1, 2, 3, 4, 5]
