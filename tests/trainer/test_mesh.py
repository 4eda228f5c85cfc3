"""The full mesh on simulated ranks (issue #22's CPU part): actor TP=2 x PP=2 x DP=2 (8 gloo ranks) with two
rollout replicas of their own (split placement), to the end of a short grpo_tiny run with a checkpoint, then a
resume that continues it. The smallest run that is still the real thing: the tiny model (2 layers: one per
stage, 4 heads: two per TP rank), 4 prompts x 4 samples, a reward that varies within groups so every step
updates, 2 steps + 1 resumed step. Most of its time is 2 x 10 worker processes importing torch/megatron."""

from __future__ import annotations

import math
import os

import pytest

from rltrain.trainer.ppo import PPOTrainer
from rltrain.utils.tracking import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.heavy, pytest.mark.timeout(900)]
VARIED_REWARD = ("import zlib\n"
                 "def reward(response, ground_truth, **kw):\n"
                 "    return float(zlib.crc32(response.encode()) % 3)\n")


def test_tp2_pp2_dp2_with_two_rollout_replicas_runs_saves_and_resumes(tmp_path, ray_session, cfg_for):
    run_dir = str(tmp_path / "mesh")
    (tmp_path / "varied.py").write_text(VARIED_REWARD)
    mesh = ["trainer.n_gpus_per_node=8", "actor.tensor_parallel_size=2", "actor.pipeline_parallel_size=2",
            "trainer.colocate=false", "rollout.num_replicas=2", "trainer.test_freq=-1", "trainer.logger=[jsonl]",
            "trainer.plots=false", "trainer.save_freq=2", f"reward.fn={tmp_path / 'varied.py'}:reward",
            "actor.use_kl_loss=true"]  # the reference role on the same 8-rank mesh
    trainer = PPOTrainer(cfg_for(*mesh, "trainer.total_steps=2"), run_dir)
    # data-parallel ranks as megatron's parallel_state numbers them (tp fastest, then dp, then pp)
    assert trainer.train_group.train.members == ((0, 1, 4, 5), (2, 3, 6, 7))
    assert trainer.rollout_group.num_replicas == 2
    trainer.fit()
    ckpt = os.path.join(run_dir, "checkpoints", "step_2")
    assert sorted(f for f in os.listdir(ckpt) if f.startswith("worker_rank")) == [f"worker_rank{r}.pt" for r in range(8)]

    trainer = PPOTrainer(cfg_for(*mesh, "trainer.total_steps=3"), run_dir)
    trainer.fit()  # trainer.resume=auto: every rank restores its shard of its stage, then step 3
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert all(math.isfinite(r[k]) for k in ("actor/pg_loss", "actor/kl_loss", "critic/score/mean"))
        assert r["actor/grad_norm"] > 0
        # both replicas sample with the weights exported from the 8 ranks (TP-gathered, stages merged)
        assert r["rollout/logprob_diff_max"] < 1e-3, r
