"""Multi-GPU placements under Ray on 2 GPUs (skipped without them): every placement of the 2-GPU matrix runs a
few tiny PPO steps with every role (actor, reference, critic, rollout); each worker uses its own GPU, whose
ordinal inside the worker is 0 (Ray shows a worker only its GPU). tools/gpu_placements.py runs the full
matrix (learning, Qwen3-0.6B shapes, NCCL bandwidth)."""

from __future__ import annotations

import math

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

PLACEMENTS = {
    "colocated_dp2": ["trainer.n_gpus_per_node=2"],
    "colocated_tp2": ["trainer.n_gpus_per_node=2", "actor.tensor_parallel_size=2"],
    "split_1p1": ["trainer.n_gpus_per_node=1", "trainer.colocate=false"],
    "pp2": ["trainer.n_gpus_per_node=2", "actor.pipeline_parallel_size=2"],
}


@pytest.fixture(scope="module")
def two_gpus():
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")


@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_placement_runs_every_role_on_its_own_gpu(name, two_gpus, tmp_path, ray_session, cfg_for):
    from rltrain.trainer.ppo import PPOTrainer
    from rltrain.utils.tracking import read_metrics

    cfg = cfg_for(*PLACEMENTS[name], "trainer.device=cuda", "algorithm=gae", "actor.use_kl_loss=true",
                  "trainer.total_steps=2", "trainer.test_freq=-1", "trainer.logger=[jsonl]", "rollout.n=2",
                  "critic.lr=1e-3", "trainer.fused_linear_logprob_backend=auto")
    trainer = PPOTrainer(cfg, str(tmp_path))
    groups = {id(g): g for g in (trainer.train_group, trainer.rollout_group)}.values()
    table = [row for g in groups for row in g.placement_table()]
    gpus = [row["gpu_ids"] for row in table]
    assert all(len(g) == 1 for g in gpus) and len({g[0] for g in gpus}) == len(gpus) == 2, table
    for g in groups:  # inside each worker: only its GPU visible, used as ordinal 0 (the crash)
        for facts in g.run("ray_facts"):
            assert facts["device_count"] == 1 and facts["cuda_device"] == 0, facts
            assert facts["env"]["CUDA_VISIBLE_DEVICES"] == facts["gpu_ids"][0], facts
    trainer.fit()
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), r
        assert r["rollout/logprob_diff_max"] < 5e-3  # fp32 tiny model: the rollout holds the actor's weights
        per_gpu = [k for k in r if k.startswith("perf/max_memory_allocated_gb/")]
        assert len(per_gpu) == 2 and all(r[k] > 0 for k in per_gpu), per_gpu
