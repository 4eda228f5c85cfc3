import os

import pytest
from hydra import compose, initialize_config_dir

from rltrain.config import register_configs, validate_config
from rltrain.main import CONFIG_DIR

register_configs()

# Small and fast: a few steps of the tiny default through Ray.
FAST = [
    "trainer.logger=[jsonl,wandb]", "trainer.progress_bar=false", "trainer.plots=true",
    "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=2", "data.val_batch_size=32",
    "data.synthetic.val_size=32", "trainer.test_freq=2", "trainer.num_cpus=2",
]


def compose_cfg(*overrides, name="grpo_tiny"):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        cfg = compose(config_name=name, overrides=[*FAST, *overrides])
    validate_config(cfg)
    return cfg


@pytest.fixture
def fast_overrides():
    return list(FAST)


@pytest.fixture
def cfg_for():
    return compose_cfg


@pytest.fixture(scope="session")
def ray_session():
    import ray

    from rltrain.workers.group import init_ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    init_ray(None, 2)
    yield
    ray.shutdown()
