import os

import pytest
from hydra import compose, initialize_config_dir

from rltrain.config import as_config, register_configs, validate_config
from rltrain.main import CONFIG_DIR

register_configs()

# Small and fast: a few steps of the tiny default through Ray.
FAST = [
    "trainer.logger=[jsonl,wandb]", "trainer.progress_bar=false", "trainer.plots=true",
    "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=2", "data.val_batch_size=32",
    "data.synthetic.val_size=32", "trainer.test_freq=2", "trainer.num_cpus=2",
]


def compose_cfg(*overrides, name="grpo_tiny"):
    """The typed RLConfig of recipe `name` with FAST and `overrides`, validated (as rltrain.main converts it)."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        cfg = as_config(compose(config_name=name, overrides=[*FAST, *overrides]))
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


def _train_retool_sft(d, *overrides: str, timeout: float = 300):
    """The tiny ReTool SFT model (stage 1 of the pipeline) trained by the CLI under directory `d`:
    -> (data file paths, HF model directory, SFT run directory). `overrides` go to the SFT command."""
    import subprocess
    import sys

    from rltrain.data.retool_synthetic import write_splits

    paths = write_splits(str(d / "data"), sft_size=512, train_size=64, val_size=16, max_operand=20, seed=0)
    out, run_dir = d / "sft_hf", d / "sft_run"
    cmd = [sys.executable, "-m", "rltrain.sft", "--config-name", "retool_tiny_sft", f"data.train_files=[{paths['sft']}]",
           "trainer.total_steps=120", f"trainer.output_dir={out}", "trainer.progress_bar=false",
           "trainer.logger=[jsonl]", f"hydra.run.dir={run_dir}", *overrides]
    res = subprocess.run(cmd, cwd=os.path.dirname(CONFIG_DIR), env={**os.environ, "RLTRAIN_TORCH_THREADS": "1"},
                         capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return paths, str(out), str(run_dir)


@pytest.fixture(scope="session")
def retool_sft_model(tmp_path_factory):
    """The tiny ReTool SFT model, trained once for every test that needs it (the hf ReTool tests and the vLLM
    ones): head_dim 32, which vLLM's CPU kernels take (the hf engine takes any) -> _train_retool_sft's triple."""
    return _train_retool_sft(tmp_path_factory.mktemp("retool_sft"), "+model.overrides.head_dim=32", timeout=600)
