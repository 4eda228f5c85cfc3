"""rollout.true_on_policy end to end on CPU: grpo_tiny (hf engine, Megatron actor with the fused torch head) logs a
training/inference log-prob difference of exactly 0 on every step, over every sampled token."""

import pytest

from rltrain.trainer.ppo import run_from_config
from rltrain.utils.tracking import read_metrics

pytestmark = pytest.mark.timeout(300)


def test_grpo_tiny_logs_a_zero_logprob_difference_every_step(tmp_path, cfg_for):
    run_dir = str(tmp_path / "run")
    cfg = cfg_for("rollout.true_on_policy=true", "trainer.use_ray=false", "trainer.total_steps=6",
                  "trainer.test_freq=-1", "trainer.logger=[jsonl]", "trainer.plots=false")
    run_from_config(cfg, run_dir)
    rows = [r for r in read_metrics(run_dir) if "rollout/logprob_diff_max" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(r["rollout/logprob_diff_max"] == 0.0 for r in rows), [r["rollout/logprob_diff_max"] for r in rows]
    assert all(r["rollout/logprob_diff_nonzero_frac"] == 0.0 and r["rollout/mismatch_kl"] == 0.0 for r in rows)
    assert all(r["rollout/model_tokens/mean"] > 0 for r in rows)
