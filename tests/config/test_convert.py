"""config/convert.py: the one conversion to the typed schema objects every component reads."""

import pickle

import pytest
from hydra import compose, initialize_config_dir

from rltrain.config import ConfigError, as_config, register_configs
from rltrain.config.convert import as_dict
from rltrain.config.schema import (
    ActorConfig,
    LogprobHeadConfig,
    OptimizerConfig,
    RLConfig,
    RolloutConfig,
    SFTConfig,
)
from rltrain.main import CONFIG_DIR

register_configs()


def _compose(name, overrides=()):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name=name, overrides=list(overrides))


def test_a_composed_config_becomes_dataclasses_to_the_leaves_and_pickles():
    cfg = as_config(_compose("grpo_tiny", ["actor.lr=2e-5", "trainer.fused_linear_logprob_backend=torch"]))
    assert type(cfg) is RLConfig and type(cfg.actor) is ActorConfig and type(cfg.rollout.multi_turn).__name__ == \
        "MultiTurnConfig"
    assert cfg.actor.lr == 2e-5 and cfg.trainer.fused_linear_logprob_backend == "torch"
    assert pickle.loads(pickle.dumps(cfg)) == cfg  # Ray sends it to the workers
    assert as_config(cfg) is cfg
    assert as_config(as_dict(cfg)) == cfg  # config.json round trip


def test_a_partial_dict_takes_the_schemas_defaults():
    r = as_config({"n": 3, "multi_turn": {"enable": True}}, RolloutConfig)
    assert r.n == 3 and r.multi_turn.enable and r.temperature == RolloutConfig().temperature
    assert as_config({}, SFTConfig).optim.lr == 1e-5


def test_groups_are_declared_once_and_read_alone():
    cfg = as_config(_compose("grpo_tiny", ["trainer.logprobs_chunk_size=128", "actor.weight_decay=0.1"]))
    head = cfg.trainer.group(LogprobHeadConfig)
    assert head == LogprobHeadConfig(cfg.trainer.fused_linear_logprob, cfg.trainer.fused_linear_logprob_backend, 128)
    assert cfg.actor.group(OptimizerConfig).weight_decay == 0.1
    sft = as_config(_compose("retool_tiny_sft"), SFTConfig)
    assert isinstance(sft.trainer, LogprobHeadConfig) and isinstance(sft.optim, OptimizerConfig)


@pytest.mark.parametrize("bad", [{"actor": {"foo": 1}}, {"trainer": {"seeed": 3}}])
def test_unknown_keys_raise_naming_them(bad):
    with pytest.raises(ConfigError, match=next(iter(bad)) + "." + next(iter(next(iter(bad.values()))))):
        as_config(bad)
