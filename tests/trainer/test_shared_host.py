"""A run on a shared host (issue #66), through the command line, watched by exposure.py (here): while a short run
trains, no process of the run (the trainer; with Ray also its services and HybridWorkers) listens on an address other
than loopback; fake secrets in the driver's environment (WANDB_API_KEY, HF_TOKEN) appear on no process's command line
and nowhere in Ray's session files, nor does Ray's token, whose file only its owner can read. The two runs
(trainer.use_ray=false and Ray) go at once on the 2-core box. The rendezvous store alone: tests/workers/
test_rendezvous.py."""

import os
import sys

import pytest

import exposure
from rltrain.main import CONFIG_DIR

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(not os.path.isfile("/proc/net/tcp"), reason="needs Linux /proc/net")]
REPO = os.path.dirname(CONFIG_DIR)
QUICK = ["trainer.progress_bar=false", "trainer.test_freq=-1", "trainer.logger=[jsonl]", "trainer.plots=false",
         "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=2", "trainer.total_steps=2",
         "trainer.num_cpus=2"]


def test_a_run_listens_on_loopback_only_and_shows_no_secret(tmp_path):
    cmd = [sys.executable, "-m", "rltrain.main", "--config-name", "grpo_tiny", *QUICK]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "RLTRAIN_TORCH_THREADS": "1", "WANDB_MODE": "offline",
           "RAY_USAGE_STATS_ENABLED": "0"}
    report = exposure.watch({"local": [*cmd, "trainer.use_ray=false", f"hydra.run.dir={tmp_path / 'local'}"],
                                 "ray": [*cmd, "trainer.use_ray=true", f"hydra.run.dir={tmp_path / 'ray'}"]},
                                cwd=REPO, env=env, poll_s=0.5)
    runs = report["runs"]
    for name, run in runs.items():
        assert run["returncode"] == 0, run["stderr_tail"]
        assert run["listeners"], f"no listener of the {name} run was seen"  # its store (and Ray's services) listen
    # the in-process trainer's own torch.distributed store, and the Ray worker's
    assert any("python -m rltrain.main" in who for who in runs["local"]["listeners"]), runs["local"]["listeners"]
    assert any("ray::HybridWorker" in who for who in runs["ray"]["listeners"]), runs["ray"]["listeners"]
    assert report["ray_sessions"], "no Ray session of this run found"
    assert exposure.problems(report) == []
