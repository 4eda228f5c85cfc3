"""The step's two opt-in levers (issue #35), on CPU.

actor.recompute_old_logprobs=false: one step of the tiny default, its update one mini-batch and one epoch, gives the
same parameter update and the same loss / mismatch / off-policy metrics as the default step, whose old log-probs come
from the separate no-grad pass (the reference computed another way); the pass is skipped. Both are refused, naming
the keys, where they would not be exact or not meaningful (config/validate.py).
"""

import math

import pytest
import torch

from rltrain.config import ConfigError
from rltrain.config.validate import config_errors
from rltrain.trainer.ppo import PPOTrainer

ON_POLICY = ("data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "trainer.use_ray=false",
             "trainer.test_freq=-1", "trainer.logger=[jsonl]", "trainer.plots=false", "trainer.total_steps=1")


def _one_step(cfg, run_dir):
    """(the step's metrics, the actor's weights after it) of one in-process step."""
    trainer = PPOTrainer(cfg, str(run_dir))
    try:
        metrics = trainer.train_step(1)
        actor = trainer.train_group.workers[0].actor
        weights = {k: v.detach().clone() for k, v in actor.export_weights(1 << 30)}
    finally:
        trainer._finish(export=False)
    return metrics, weights


@pytest.mark.parametrize("extra", [(), ("actor.off_policy.mode=token_tis", "actor.entropy_coef=0.01")],
                         ids=["plain", "token_tis+entropy"])
def test_old_logprobs_from_the_update_match_the_recomputed_ones(tmp_path, cfg_for, extra):
    ref_m, ref_w = _one_step(cfg_for(*ON_POLICY, *extra), tmp_path / "recompute")
    got_m, got_w = _one_step(cfg_for(*ON_POLICY, *extra, "actor.recompute_old_logprobs=false"), tmp_path / "update")
    assert "timing_s/old_log_prob" in ref_m and "timing_s/old_log_prob" not in got_m  # the pass is skipped
    # the same parameter update (and a real one: the weights moved), compared as the step's change of each tensor
    init = _initial(cfg_for(*ON_POLICY, *extra), tmp_path)
    assert ref_w.keys() == got_w.keys() == init.keys()
    moved = max(float((ref_w[k] - init[k]).abs().max()) for k in init)
    assert moved > 0
    worst = max(float(((got_w[k] - init[k]) - (ref_w[k] - init[k])).abs().max()) for k in init)
    print(f"largest change {moved:.3e}, largest difference of the changes {worst:.3e}")
    assert worst <= 1e-3 * moved
    keys = ["actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/entropy_rollout", "rollout/mismatch_abs_mean",
            "rollout/mismatch_kl", "rollout/logprob_diff_max"]
    keys += [k for k in ref_m if k.startswith("rollout/is_")]
    if extra:
        assert "rollout/is_weight_mean" in keys  # the off-policy statistics are logged on both paths
    for k in keys:
        assert k in got_m, k
        assert math.isfinite(ref_m[k]), k
        assert got_m[k] == pytest.approx(ref_m[k], rel=1e-4, abs=1e-6), k
    assert ref_m["rollout/mismatch_abs_mean"] > 0  # the hf sampler and the Megatron actor differ: a real comparison
    assert got_m["actor/ppo_kl"] == 0.0 and got_m["actor/pg_clipfrac"] == 0.0  # ratio 1 exactly


def _initial(cfg, tmp_path):
    """The actor's weights before any step (same seed: what both runs started from)."""
    trainer = PPOTrainer(cfg, str(tmp_path / "init"))
    try:
        return {k: v.detach().clone() for k, v in trainer.train_group.workers[0].actor.export_weights(1 << 30)}
    finally:
        trainer._finish(export=False)


@pytest.mark.parametrize("free", [True, False])
def test_free_cache_engine_false_keeps_the_engine_awake_and_still_reloads_the_weights(tmp_path, cfg_for, monkeypatch,
                                                                                      free):
    """Colocated in-process (the hf engine): with rollout.free_cache_engine=false no sleep and no wake-up in a step
    and their timings not logged (the default: one of each, timed); either way, after the push the engine holds the
    updated actor's weights."""
    from rltrain.workers.rollout import RolloutRole

    calls = []
    for name in ("sleep", "wake_up"):
        original = getattr(RolloutRole, name)
        monkeypatch.setattr(RolloutRole, name, lambda self, _o=original, _n=name: (calls.append(_n), _o(self))[1])
    trainer = PPOTrainer(cfg_for(*ON_POLICY, f"rollout.free_cache_engine={str(free).lower()}"), str(tmp_path / "run"))
    try:
        m = trainer.train_step(1)
        worker = trainer.train_group.workers[0]
        actor = dict(worker.actor.export_weights(1 << 30))
        engine = dict(worker.rollout.engine.model.named_parameters())
    finally:
        trainer._finish(export=False)
    assert calls == (["sleep", "wake_up"] if free else [])
    timed = [k in m for k in ("timing_s/rollout_sleep", "timing_s/rollout_wake")]
    assert timed == [free, free] and "timing_s/update_weights" in m
    assert actor.keys() <= engine.keys()
    for k, v in actor.items():
        torch.testing.assert_close(engine[k].detach().float(), v.float(), rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("overrides, names", [
    (("actor.ppo_mini_batch_size=2",), ["actor.ppo_mini_batch_size=2", "data.train_batch_size=4"]),
    (("actor.ppo_mini_batch_size=4", "actor.ppo_epochs=2"), ["actor.ppo_epochs=2"]),
    (("actor.ppo_mini_batch_size=4", "algorithm.use_kl_in_reward=true"), ["algorithm.use_kl_in_reward=true"]),
    (("actor.ppo_mini_batch_size=4", "actor.pipeline_parallel_size=2"), ["actor.pipeline_parallel_size=2"]),
])
def test_recompute_old_logprobs_false_is_refused_where_not_exact(cfg_for, overrides, names):
    with pytest.raises(ConfigError) as err:
        cfg_for("data.train_batch_size=4", *overrides, "actor.recompute_old_logprobs=false")
    msg = str(err.value)
    assert "actor.recompute_old_logprobs=false" in msg and all(n in msg for n in names), msg


def test_recompute_old_logprobs_false_is_accepted_on_policy(cfg_for):
    # one epoch of one mini-batch of the whole step: cfg_for's validation passes and keeps the lever off
    cfg = cfg_for("data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "actor.recompute_old_logprobs=false")
    assert cfg.actor.recompute_old_logprobs is False
    assert (cfg.actor.ppo_epochs, cfg.actor.ppo_mini_batch_size, cfg.data.train_batch_size) == (1, 4, 4)
    assert config_errors(cfg) == []


def test_free_cache_engine_false_is_refused_on_a_split_placement(cfg_for):
    with pytest.raises(ConfigError, match=r"rollout\.free_cache_engine=false .*trainer\.colocate=false"):
        cfg_for("trainer.colocate=false", "rollout.free_cache_engine=false")
    cfg_for("rollout.free_cache_engine=false")  # colocated: accepted


def test_forward_passes_take_their_own_micro_batch_budget(tmp_path, cfg_for):
    """actor.log_prob_max_tokens_per_micro_batch reaches the actor's and the reference's engines (their forward-only
    passes) and leaves the update's budget; the step's log-probs, KL, loss and gradient are those of the default
    grouping."""
    base = (*ON_POLICY, "actor.max_tokens_per_micro_batch=48", "actor.use_kl_loss=true")
    big = "actor.log_prob_max_tokens_per_micro_batch=100000"
    trainer = PPOTrainer(cfg_for(*base, big), str(tmp_path / "big"))
    try:
        worker = trainer.train_group.workers[0]
        for role in (worker.actor, worker.ref):
            assert role.engine.forward_max_tokens_per_micro_batch == 100000
            assert role.engine.max_tokens_per_micro_batch == 48
        got_m = trainer.train_step(1)
    finally:
        trainer._finish(export=False)
    ref_m, _ = _one_step(cfg_for(*base), tmp_path / "default")
    assert ref_m["perf/total_num_tokens"] > 2 * 48  # the default grouping is several micro-batches, the big one one
    for k in ("rollout/mismatch_abs_mean", "rollout/logprob_diff_max", "actor/kl_loss", "actor/pg_loss",
              "actor/grad_norm"):
        assert math.isfinite(ref_m[k]), k
        assert got_m[k] == pytest.approx(ref_m[k], rel=1e-4, abs=1e-6), k
    # (the weights are not compared: at step 1 the actor is the reference, so the KL term's gradient is rounding
    # noise, which another grouping changes and Adam's normalized step turns into updates of a full lr)
