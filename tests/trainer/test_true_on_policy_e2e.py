"""rollout.true_on_policy end to end on CPU: grpo_tiny (hf engine, Megatron actor with the fused torch head) logs a
training/inference log-prob difference of exactly 0 on every step, over every sampled token; and asynchronous with
partial rollouts (split under Ray, k = 2; `heavy`), 0 over the tokens the trained weights sampled themselves, and in
the synchronous split placement over every token."""

import pytest

from rltrain.config.entry import compose_config
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


@pytest.mark.heavy
def test_split_placement_is_exact_and_async_is_exact_where_the_weights_are_the_samplers(tmp_path, ray_session):
    """Split placement under Ray (the rollout worker's engine gets the weights pushed after each update), key on:
    synchronous, 0 over every sampled token on every step; asynchronous with partial rollouts (k = 2, a chunk a
    token), 0 over the tokens the trained weights sampled themselves (rollout/logprob_diff_*_current: all of step 1's,
    any later push's that lands in a batch in flight), while older tokens differ by the policy's change (what the
    off-policy correction is for)."""
    split = ["rollout.true_on_policy=true", "trainer.colocate=false", "trainer.num_cpus=2", "actor.lr=3e-3",
             "trainer.total_steps=6", "trainer.test_freq=-1", "trainer.logger=[jsonl]", "trainer.plots=false",
             "trainer.progress_bar=false", "reward.max_workers=0", "trainer.save_freq=-1"]
    run_from_config(compose_config("grpo_tiny", split), str(tmp_path / "sync"))
    rows = [r for r in read_metrics(str(tmp_path / "sync")) if "rollout/logprob_diff_max" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(r["rollout/logprob_diff_max"] == 0.0 and r["rollout/logprob_diff_nonzero_frac"] == 0.0 for r in rows)
    asynchronous = [*split, "trainer.async_rollout=true", "actor.tis.enable=true", "trainer.max_staleness=2",
                    "rollout.partial=true", "rollout.partial_chunk_tokens=1"]
    run_from_config(compose_config("grpo_tiny", asynchronous), str(tmp_path / "async"))
    rows = [r for r in read_metrics(str(tmp_path / "async")) if "rollout/logprob_diff_max_current" in r]
    seen = [(r["step"], r["rollout/tokens_staleness_0"], r["rollout/partial_samples_frac"],
             r["rollout/logprob_diff_max_current"], r["rollout/logprob_diff_max"]) for r in rows]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6], seen
    assert all(r["rollout/logprob_diff_max_current"] == 0.0 and r["rollout/logprob_diff_nonzero_frac_current"] == 0.0
               for r in rows), seen
    assert rows[0]["rollout/tokens_staleness_0"] == 1.0 and rows[0]["rollout/logprob_diff_max"] == 0.0, seen
    assert any(r["rollout/partial_samples_frac"] > 0 for r in rows), seen  # pushes landed in batches in flight
    assert all(r["rollout/logprob_diff_max"] > 0 for r in rows[1:] if r["rollout/tokens_staleness_0"] < 1), seen
