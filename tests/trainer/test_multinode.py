"""Multi-node on one machine: a 2-node Ray cluster (Ray's own `ray.cluster_utils.Cluster`, CPU, 127.0.0.1), the
trainer joins it (`trainer.ray_address`, `trainer.nnodes=2`) with actor, reference and critic (PPO with
KL-in-reward) in pipeline parallel, one stage per node (colocated: each worker also holds a rollout replica,
fed the whole model merged from both stages after every update), checkpoints in a `trainer.ckpt_dir` both
nodes see. The worker on the second node is SIGKILLed mid-run: the driver stops naming the worker, its node
and the last good checkpoint; `trainer.resume=auto` restores both stages and runs to the end. Also: a
checkpoint dir some node cannot see is refused, naming that node."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from rltrain.main import CONFIG_DIR
from rltrain.utils.tracking import read_metrics
from rltrain.workers.base import Worker
from rltrain.workers.group import check_shared_dir
from rltrain.workers.placement import PlacementError

pytestmark = pytest.mark.timeout(600)
REPO = os.path.dirname(CONFIG_DIR)


def _trainer(run_dir, overrides):
    env = dict(os.environ, WANDB_MODE="offline", RAY_USAGE_STATS_ENABLED="0", RLTRAIN_TORCH_THREADS="1")
    cmd = [sys.executable, "-m", "rltrain.main", "--config-name", "grpo_tiny", *overrides, f"hydra.run.dir={run_dir}"]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _workers_of(node) -> list[psutil.Process]:
    """The rltrain worker processes a node's raylet started (their title is ray::HybridWorker...)."""
    from ray._private import ray_constants

    raylet = psutil.Process(node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid)
    return [p for p in raylet.children(recursive=True) if " ".join(p.cmdline()).startswith("ray::HybridWorker")]


VARIED_REWARD = ("import zlib\n"
                 "def reward(response, ground_truth, **kw):  # deterministic, varies within a group: every step learns\n"
                 "    return float(zlib.crc32(response.encode()) % 3)\n")


@pytest.mark.heavy
def test_two_node_pp2_run_survives_a_killed_worker_by_resuming(tmp_path, fast_overrides):
    from rltrain.workers.group import loopback_ray

    loopback_ray()
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    second = cluster.add_node(num_cpus=1)
    run_dir, ckpt = tmp_path / "run", tmp_path / "shared_ckpt"
    (tmp_path / "varied.py").write_text(VARIED_REWARD)
    base = [*fast_overrides, f"trainer.ray_address={cluster.address}", "trainer.nnodes=2", "trainer.n_gpus_per_node=1",
            "actor.pipeline_parallel_size=2", f"reward.fn={tmp_path / 'varied.py'}:reward", "algorithm=gae",
            "critic.lr=1e-3",
            f"trainer.ckpt_dir={ckpt}", "trainer.save_freq=1", "trainer.test_freq=-1", "trainer.logger=[jsonl]",
            "trainer.plots=false", "trainer.total_steps=4"]
    try:
        proc = _trainer(run_dir, base)
        deadline = time.time() + 300
        while not (ckpt / "step_1" / "manifest.json").exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.time() < deadline, "no checkpoint after 300 s"
            time.sleep(0.05)
        victims = _workers_of(second)
        assert len(victims) == 1, victims  # one rank (pipeline stage) per node: the bundle on the second node
        victim_pid = victims[0].pid
        os.kill(victim_pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=200)
        assert proc.returncode == 4, err[-3000:]
        msg = err[err.index("rltrain: worker"):]
        print(msg)  # shown with pytest -rP
        assert f"pid {victim_pid}" in msg and second.node_id[:12] in msg and "roles actor+ref+critic+rollout" in msg, msg
        last = msg.split("the last good checkpoint is ", 1)[1].split(" ", 1)[0]
        assert last.startswith(str(ckpt / "step_")) and "trainer.resume=auto" in msg, msg

        resumed = _trainer(run_dir, [*base, "trainer.resume=auto"])
        out, err = resumed.communicate(timeout=300)
        assert resumed.returncode == 0, err[-3000:]
        assert f"resumed from {last}" in err
        rows = read_metrics(str(run_dir))
        assert max(r["step"] for r in rows) == 4 and sorted(os.listdir(ckpt))[-1] == "step_4"
        assert sorted(f for f in os.listdir(ckpt / "step_4") if f.endswith(".pt")) == [
            "trainer_state.pt", "worker_rank0.pt", "worker_rank1.pt"]  # both stages saved
        for r in rows:  # every step updates, and both rollout replicas sample with the merged model
            assert r["actor/grad_norm"] > 0 and r["critic/grad_norm"] > 0 and r["rollout/logprob_diff_max"] < 1e-3, r
    finally:
        cluster.shutdown()


class _FakeGroup:
    """Stands in for a WorkerGroup: rank 1 sits on a node that mounts another disk at `path`."""

    def __init__(self, path, other_disk):
        self.name, self.path, self.other = "train", str(path), str(other_disk)
        self.workers = [Worker(rank=0), Worker(rank=1)]
        self.facts = [{"ip": "10.0.0.1"}, {"ip": "10.0.0.2"}]

    def run(self, method, path, probe, token):
        assert method == "check_shared_dir" and path == self.path
        return [self.workers[0].check_shared_dir(path, probe, token),
                self.workers[1].check_shared_dir(self.other, probe, token)]


def test_checkpoint_dir_not_shared_by_a_node_is_refused(tmp_path):
    shared, elsewhere = tmp_path / "ckpt", tmp_path / "node2_local_disk"
    elsewhere.mkdir()
    with pytest.raises(PlacementError) as info:
        check_shared_dir(str(shared), [_FakeGroup(shared, elsewhere)])
    msg = str(info.value)
    assert f"trainer.ckpt_dir={shared} is not shared" in msg and "rank 1 on node 10.0.0.2 cannot read" in msg
    assert os.listdir(shared) == []  # the probe files are cleaned up
