"""teacher.* and algorithm.distill_coef (on-policy distillation): off by default, the rules that refuse a config before
anything starts (each naming the key), and the placement of the teacher's role or group."""

import pytest
from hydra import compose, initialize_config_dir

from rltrain.config import ConfigError, as_config, register_configs, validate_config
from rltrain.config.schema import TeacherConfig
from rltrain.main import CONFIG_DIR
from rltrain.trainer.setup import check_config
from rltrain.workers.placement import PlacementError, plan_groups

register_configs()


def _compose(name, *overrides):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name=name, overrides=list(overrides))


def test_distillation_is_off_by_default_and_the_recipe_composes_with_a_teacher(tmp_path):
    cfg = as_config(_compose("grpo_tiny"))
    assert not TeacherConfig.enabled(cfg.teacher) and cfg.teacher.path is None and cfg.teacher.colocate
    [hybrid] = plan_groups(cfg, device="cpu", use_ref=False, use_critic=False)
    assert "teacher" not in hybrid.roles
    distill = _compose("distill_tiny", f"teacher.path={tmp_path}")
    validate_config(distill)
    assert distill.algorithm.adv_estimator == "distill" and distill.algorithm.distill_coef == 1.0


@pytest.mark.parametrize("overrides,key", [
    ([], "algorithm.adv_estimator=distill"),  # distill_tiny without teacher.path
    (["teacher.path=/x", "algorithm.distill_coef=0"], "algorithm.distill_coef"),
    (["teacher.path=/x", "algorithm.distill_coef=-1"], "algorithm.distill_coef"),
    (["teacher.path=/x", "actor.recompute_old_logprobs=false", "actor.ppo_mini_batch_size=16"],
     "actor.recompute_old_logprobs=true"),
    (["teacher.path=/x", "teacher.builtin=tiny"], "teacher.path and teacher.builtin"),
    (["teacher.builtin=huge"], "teacher.builtin"),
    (["teacher.path=/x", "teacher.dtype=float8"], "teacher.dtype"),
    (["teacher.path=/x", "teacher.n_gpus_per_node=0"], "teacher.n_gpus_per_node"),
    (["teacher.path=/x", "teacher.tensor_parallel_size=0"], "teacher.tensor_parallel_size"),
    (["teacher.path=/x", "teacher.log_prob_max_tokens_per_micro_batch=-4"],
     "teacher.log_prob_max_tokens_per_micro_batch"),
])
def test_impossible_teacher_settings_are_refused_naming_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate_config(_compose("distill_tiny", *overrides))


@pytest.mark.parametrize("overrides,why", [
    (["teacher.tensor_parallel_size=2"], "a colocated teacher shares"),
    (["teacher.colocate=false", "trainer.use_ray=false"], "needs Ray"),
    (["teacher.colocate=false", "teacher.n_gpus_per_node=3", "teacher.tensor_parallel_size=2"],
     "teacher.n_gpus_per_node to a multiple of 2"),
])
def test_a_teacher_that_cannot_be_placed_is_refused_before_anything_starts(overrides, why):
    with pytest.raises(ConfigError, match=why):
        check_config(_compose("grpo_tiny", "teacher.path=/x", *overrides))
    with pytest.raises(PlacementError, match=why):
        plan_groups(_compose("grpo_tiny", "teacher.path=/x", *overrides), device="cpu", use_ref=False,
                    use_critic=False)


def test_the_teacher_is_a_role_of_the_training_workers_or_a_group_of_its_own():
    [hybrid] = plan_groups(_compose("grpo_tiny", "teacher.path=/x"), device="cpu", use_ref=True, use_critic=False)
    assert hybrid.roles == ("actor", "ref", "teacher", "rollout") and hybrid.has_training_roles()
    split = _compose("grpo_tiny", "teacher.path=/x", "trainer.colocate=false", "trainer.n_gpus_per_node=2",
                     "actor.tensor_parallel_size=2", "teacher.colocate=false", "teacher.n_gpus_per_node=4",
                     "teacher.tensor_parallel_size=4")
    train, rollout, teacher = plan_groups(split, device="cuda", use_ref=False, use_critic=False)
    assert train.roles == ("actor",) and rollout.roles == ("rollout",)
    assert teacher.name == "teacher" and teacher.roles == ("teacher",) and teacher.world_size == 4
    assert teacher.gpus_per_worker == 1 and teacher.has_training_roles()
    hybrid, own = plan_groups(_compose("grpo_tiny", "teacher.path=/x", "teacher.colocate=false"), device="cpu",
                              use_ref=False, use_critic=False)
    assert "teacher" not in hybrid.roles and own.roles == ("teacher",) and own.gpus_per_worker == 0
