"""End-to-end runs of the tiny config through Ray: GRPO and PPO (GAE + critic) steps, metrics, plots."""

import glob
import math
import os

import pytest

from rltrain.trainer.ppo import run_from_config
from rltrain.utils.tracking import read_metrics

pytestmark = pytest.mark.timeout(600)

COMMON_KEYS = [
    "actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac", "actor/ppo_kl", "actor/lr",
    "critic/score/mean", "critic/score/max", "critic/score/min", "critic/rewards/mean", "critic/advantages/mean",
    "response_length/mean", "response_length/max", "response_length/clip_ratio", "prompt_length/mean",
    "timing_s/gen", "timing_s/gen_engine", "timing_s/old_log_prob", "timing_s/adv", "timing_s/update_actor",
    "timing_s/update_weights",
    "timing_s/step", "perf/throughput", "perf/max_rss_gb", "training/global_step",
]


def _finite_keys(row, keys):
    missing = [k for k in keys if k not in row]
    assert not missing, f"missing metrics {missing}"
    bad = {k: row[k] for k in keys if not (isinstance(row[k], (int, float)) and math.isfinite(row[k]))}
    assert not bad, f"non-finite metrics {bad}"


def test_grpo_steps_with_kl_loss_log_all_metrics(tmp_path, ray_session, cfg_for):
    run_dir = str(tmp_path / "grpo")
    cfg = cfg_for("trainer.total_steps=3", "actor.use_kl_loss=true", "actor.entropy_coef=0.001")
    run_from_config(cfg, run_dir)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for row in rows[1:]:
        _finite_keys(row, COMMON_KEYS + ["actor/kl_loss", "timing_s/ref"])
        # each phase's driver time split into the driver's slicing, the ranks' work, Ray's dispatch and the return
        for ph in ("old_log_prob", "ref", "update_actor"):
            parts = [row[f"timing_s/{part}/{ph}"] for part in ("slice", "worker", "dispatch", "return")]
            assert all(0 <= p <= row[f"timing_s/{ph}"] + 1e-3 for p in parts), (ph, parts, row[f"timing_s/{ph}"])
            assert row[f"timing_s/worker/{ph}"] > 0
    assert rows[0]["val/accuracy"] >= 0.0 and "val/synthetic/copy_last/accuracy" in rows[2]
    # the rollout's sampler log-probs equal the actor's recomputed ones (weights synced exactly)
    assert max(r["rollout/logprob_diff_max"] for r in rows[1:]) < 1e-3
    assert glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "*.wandb"))
    for png in ("reward.png", "entropy.png", "grad_norm.png", "response_length.png"):
        assert os.path.getsize(os.path.join(run_dir, png)) > 1000


def test_ppo_gae_with_critic_steps(tmp_path, ray_session, cfg_for):
    run_dir = str(tmp_path / "ppo")
    cfg = cfg_for("trainer.total_steps=2", "algorithm=gae", "trainer.test_freq=-1", "rollout.n=1",
                      "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "critic.lr=1e-3")
    run_from_config(cfg, run_dir)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        _finite_keys(row, COMMON_KEYS + ["critic/vf_loss", "critic/vf_clipfrac", "critic/values/mean",
                                         "timing_s/values", "timing_s/update_critic", "timing_s/ref", "critic/kl"])


def test_in_process_run_without_ray_and_hf_exports(tmp_path, cfg_for):
    import subprocess
    import sys

    import torch
    from transformers import AutoModelForCausalLM

    from rltrain.data.tokenizer import load_tokenizer

    run_dir = str(tmp_path / "local")
    cfg = cfg_for("trainer.use_ray=false", "trainer.total_steps=2", "trainer.test_freq=-1", "trainer.logger=[jsonl]",
                  "trainer.save_freq=2", "trainer.export_hf_on_end=true")
    run_from_config(cfg, run_dir)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        _finite_keys(row, COMMON_KEYS)
    assert max(r["rollout/logprob_diff_max"] for r in rows) < 1e-3
    # the end-of-run export and the offline tool give the same transformers model
    tool = subprocess.run([sys.executable, "-m", "rltrain.export", os.path.join(run_dir, "checkpoints", "step_2"),
                           str(tmp_path / "tool_export")], capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert tool.returncode == 0, tool.stderr[-2000:]
    a = AutoModelForCausalLM.from_pretrained(os.path.join(run_dir, "hf"))
    b = AutoModelForCausalLM.from_pretrained(str(tmp_path / "tool_export"))
    tok = load_tokenizer(os.path.join(run_dir, "hf"))
    ids = torch.tensor([tok.encode("482=")])
    with torch.no_grad():
        la, lb = a(ids).logits, b(ids).logits
    assert torch.isfinite(la).all()
    torch.testing.assert_close(la, lb)


def test_in_process_run_refuses_tensor_parallel(tmp_path, cfg_for):
    with pytest.raises(ValueError, match="use_ray"):  # the config check (workers/placement.py) refuses it
        run_from_config(cfg_for("trainer.use_ray=false", "actor.tensor_parallel_size=2"), str(tmp_path / "tp"))


def test_dapo_dynamic_sampling_and_overlong_shaping(tmp_path, cfg_for):
    fn = tmp_path / "varied.py"
    fn.write_text("import zlib\n"
                  "def reward(response, ground_truth, **kw):  # deterministic, varies within a group\n"
                  "    return float(zlib.crc32(response.encode()) % 3)\n")
    run_dir = str(tmp_path / "dapo")
    cfg = cfg_for(f"reward.fn={fn}:reward", "trainer.total_steps=2", "trainer.test_freq=-1", "trainer.logger=[jsonl]",
                  "algorithm.dynamic_sampling.enable=true", "algorithm.dynamic_sampling.max_tries=3",
                  "algorithm.overlong.enable=true", "algorithm.overlong.buffer_len=2",
                  "algorithm.mask_truncated_responses=true", "actor.clip_high=0.28", "actor.loss_agg_mode=seq-mean-token-mean",
                  # in process: dynamic sampling and overlong shaping are the driver's (trainer/ppo.py,
                  # rollout_source.py) either way; the Ray path is the other tests' here
                  "trainer.use_ray=false")
    run_from_config(cfg, run_dir)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        _finite_keys(r, COMMON_KEYS + ["dynamic_sampling/dropped_groups", "dynamic_sampling/tries",
                                       "reward/overlong_penalty_mean"])
        assert 1 <= r["dynamic_sampling/tries"] <= 3
        assert r["reward/overlong_penalty_mean"] <= 0.0


def test_split_mode_syncs_weights_through_the_driver(tmp_path, ray_session, cfg_for):
    run_dir = str(tmp_path / "split")
    cfg = cfg_for("trainer.colocate=false", "trainer.total_steps=2", "trainer.test_freq=-1", "trainer.logger=[jsonl]",
                  "trainer.num_cpus=1")
    run_from_config(cfg, run_dir)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    # step 2 samples from the rollout group after the sync: its log-probs match the updated actor's
    assert rows[1]["rollout/logprob_diff_max"] < 1e-3
    for row in rows:
        _finite_keys(row, COMMON_KEYS)
