import json
import os
import re
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from rltrain.config import ConfigError, as_config, register_configs, validate_config
from rltrain.config.convert import as_dict
from rltrain.config.validate import config_errors
from rltrain.main import CONFIG_DIR
from rltrain.trainer.setup import check_config, room_errors

REPO = os.path.dirname(CONFIG_DIR)
register_configs()


def _compose_raw(name, overrides=()):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name=name, overrides=list(overrides))


def _compose(name, overrides=()):
    """The typed RLConfig rltrain.main converts the composed config to (an unknown key raises here)."""
    return as_config(_compose_raw(name, overrides))


@pytest.mark.parametrize("name", ["grpo_tiny", "grpo_qwen3", "ppo_qwen3"])
def test_shipped_recipes_compose_and_validate(name):
    cfg = _compose(name)
    assert config_errors(cfg) == []  # what validate_config raises on: nothing
    validate_config(cfg)
    assert as_config(json.loads(json.dumps(as_dict(cfg)))) == cfg  # the config.json a run writes reads back whole


def test_required_keys_exist_with_their_defaults():
    cfg = _compose_raw("grpo_qwen3")
    t = cfg.trainer
    assert t.fused_linear_logprob is True
    assert t.fused_linear_logprob_backend == "auto"
    assert t.logprobs_chunk_size is None
    assert t.logprobs_response_only is True
    assert t.logprobs_loss_mask_only is False
    for key in ("entropy_coef", "clip_low", "clip_high", "loss_agg_mode", "kl_loss_coef", "kl_loss_type"):
        assert key in cfg.actor
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.rollout.n == 8 and cfg.rollout.engine == "vllm"
    assert cfg.model.path == "Qwen/Qwen3-0.6B"
    for key in ("logger", "total_steps", "save_freq", "seed"):
        assert key in t


@pytest.mark.parametrize(
    "override,key",
    [
        ("rollout.n=0", "rollout.n"),
        ("trainer.fused_linear_logprob_backend=cuda", "trainer.fused_linear_logprob_backend"),
        ("actor.ppo_mini_batch_size=64", "actor.ppo_mini_batch_size"),
        ("rollout.engine=sglang", "rollout.engine"),
        ("algorithm.adv_estimator=ppo2", "algorithm.adv_estimator"),
        ("actor.kl_loss_type=k7", "actor.kl_loss_type"),
        ("actor.loss_agg_mode=mean", "actor.loss_agg_mode"),
        ("trainer.logger=[console,tensorboard]", "trainer.logger"),
        ("actor.dual_clip=0.5", "actor.dual_clip"),
        ("rollout.top_p=0", "rollout.top_p"),
        ("rollout.kv_cache_memory_gb=0", "rollout.kv_cache_memory_gb"),
        ("rollout.engines_per_gpu=0", "rollout.engines_per_gpu"),
        ("rollout.engines_per_gpu=2", "rollout.engines_per_gpu"),  # hf engine (and CPU): not for it
        ("trainer.logprobs_chunk_size=0", "trainer.logprobs_chunk_size"),
        ("reward.fn=nope", "reward.fn"),
        ("data.source=file", "data.train_files"),
        ("actor.pipeline_parallel_size=2", "actor.pipeline_parallel_size"),
        ("actor.recompute_granularity=partial", "actor.recompute_granularity"),
        ("actor.recompute_modules=[layernorm]", "actor.recompute_modules"),
        ("actor.elementwise_fusion=fast", "actor.elementwise_fusion"),
        ("actor.expert_parallel_size=0", "actor.expert_parallel_size"),
        ("actor.expert_parallel_size=2", "actor.expert_parallel_size"),  # one in-process worker: no ranks to split
        ("actor.moe_aux_loss_coeff=-0.1", "actor.moe_aux_loss_coeff"),
        ("actor.moe_z_loss_coeff=inf", "actor.moe_z_loss_coeff"),
        ("actor.log_prob_max_tokens_per_micro_batch=0", "actor.log_prob_max_tokens_per_micro_batch"),
        ("actor.optimizer_offload_fraction=1.5", "actor.optimizer_offload_fraction"),
        ("critic.optimizer_offload_fraction=-0.1", "critic.optimizer_offload_fraction"),
        ("model.init=meta", "model.init"),
    ],
)
def test_impossible_values_fail_naming_the_key(override, key):
    cfg = _compose("grpo_tiny", [override])
    with pytest.raises(ConfigError) as info:
        check_config(cfg)  # config/'s rules, then the rooms' (engine names, placement, engines_per_gpu)
    assert key in str(info.value)


@pytest.mark.parametrize("overrides,why", [
    (["rollout.multi_turn.enable=true"], "rollout.multi_turn.enable"),
    (["actor.tensor_parallel_size=2"], "tensor_parallel_size"),
    (["rollout.engine=vllm", "trainer.device=cpu"], "vLLM's CPU build"),
])
def test_routing_replay_is_refused_where_it_cannot_apply(overrides, why):
    with pytest.raises(ConfigError, match="actor.moe_routing_replay=true is not supported") as info:
        validate_config(_compose("grpo_tiny", ["actor.moe_routing_replay=true", *overrides]))
    assert why in str(info.value)
    validate_config(_compose("grpo_tiny", ["actor.moe_routing_replay=false", *overrides[1:]]))


@pytest.mark.parametrize("overrides,why", [
    (["rollout.engine=vllm", "trainer.device=cpu"], "vLLM's batch-invariant kernels are CUDA ones"),
    (["actor.tensor_parallel_size=2"], "set actor.tensor_parallel_size"),
    (["actor.expert_parallel_size=2"], "set actor.tensor_parallel_size, actor.expert_parallel_size"),
    (["actor.elementwise_fusion=compile"], "actor.elementwise_fusion=compile"),
    (["trainer.fused_linear_logprob_backend=triton"], "fused_linear_logprob_backend=triton with rollout.engine=hf"),
    (["trainer.fused_linear_logprob=false"], "trainer.fused_linear_logprob=False"),
    (["rollout.engine=vllm", "trainer.device=cuda", "rollout.top_p=0.9"], "its batch size picks"),
    (["actor.lora.rank=8"], "actor.lora.rank=8"),
    (["rollout.engine=vllm", "trainer.device=cuda", "actor.moe_routing_replay=true"], "does not capture routed experts"),
])
def test_true_on_policy_is_refused_where_it_cannot_be_exact(overrides, why):
    with pytest.raises(ConfigError, match="rollout.true_on_policy=true cannot make") as info:
        validate_config(_compose("grpo_tiny", ["rollout.true_on_policy=true", *overrides]))
    assert why in str(info.value)
    validate_config(_compose("grpo_tiny", ["rollout.true_on_policy=true", "rollout.top_p=0.9", "rollout.top_k=20"]))
    # an engine pool: its engines' processes route their norms too (the worker extension, compat/vllm_worker_ext.py)
    assert not [m for m in config_errors(_compose("grpo_tiny", [
        "rollout.true_on_policy=true", "rollout=vllm", "trainer.device=cuda", "rollout.engines_per_gpu=2"]))
        if "true_on_policy" in m]
    # with vLLM any fused head: its kernels give the value, the head the gradient
    validate_config(_compose("grpo_tiny", ["rollout.true_on_policy=true", "rollout.engine=vllm", "trainer.device=cuda",
                                           "trainer.fused_linear_logprob_backend=triton"]))


@pytest.mark.parametrize("overrides,why", [
    (["actor.offload_while_rollout=true", "trainer.colocate=false"], "trainer.colocate=false"),
    (["actor.offload_while_rollout=true", "rollout.free_cache_engine=false"], "rollout.free_cache_engine=false"),
    (["model.init=engine", "actor.use_kl_loss=true"], "actor.use_kl_loss"),
    (["model.init=engine", "model.builtin=null", "model.path=/x"], "model.builtin"),
    (["model.init=engine", "algorithm.adv_estimator=gae"], "critic"),
])
def test_offload_and_engine_init_are_refused_where_they_cannot_apply(overrides, why):
    with pytest.raises(ConfigError, match=why.replace(".", r"\.")):
        validate_config(_compose("grpo_tiny", overrides))


def test_error_lists_allowed_values():
    cfg = _compose("grpo_tiny", ["trainer.fused_linear_logprob_backend=cuda"])
    with pytest.raises(ConfigError, match="auto, torch, triton"):
        validate_config(cfg)


def test_unknown_key_and_wrong_type_fail_at_composition():
    with pytest.raises((ConfigCompositionException, ConfigKeyError)) as info:
        _compose_raw("grpo_tiny", ["rollout.temprature=0.5"])
    assert "temprature" in str(info.value) + str(info.value.__cause__)
    with pytest.raises((ConfigCompositionException, ValidationError)):
        _compose_raw("grpo_tiny", ["rollout.n=many"])


def test_dotted_path_estimator_is_imported_at_validation(tmp_path):
    est = tmp_path / "my_adv.py"
    est.write_text("def compute(token_rewards, response_mask, **kw):\n    return token_rewards, token_rewards\n")
    validate_config(_compose("grpo_tiny", [f"algorithm.adv_estimator={est}:compute"]))
    for missing in ("my_pkg.adv:compute", f"{est}:nope"):
        with pytest.raises(ConfigError, match="algorithm.adv_estimator"):
            validate_config(_compose("grpo_tiny", [f"algorithm.adv_estimator={missing}"]))


def _run_main(*args):
    return subprocess.run([sys.executable, "-m", "rltrain.main", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def test_cli_rejects_bad_value_before_starting_and_leaves_no_run_directory(tmp_path):
    """Run from a fresh directory, as a user would: the recipe's run directory (outputs/grpo_tiny/<time>), made
    before the config check, goes again when the check refuses the config."""
    res = subprocess.run([sys.executable, "-m", "rltrain.main", "--config-name", "grpo_tiny", "rollout.n=0"],
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 2, res.stderr
    assert "rollout.n" in res.stderr and "Traceback" not in res.stderr
    assert list((tmp_path / "outputs" / "grpo_tiny").iterdir()) == []


def test_cli_cfg_job_prints_the_keys():
    res = _run_main("--config-name", "grpo_qwen3", "--cfg", "job")
    assert res.returncode == 0, res.stderr
    for key in ("fused_linear_logprob:", "fused_linear_logprob_backend:", "logprobs_chunk_size:",
                "logprobs_response_only:", "logprobs_loss_mask_only:", "adv_estimator:", "entropy_coef:"):
        assert key in res.stdout
    assert _run_main("--help").returncode == 0


def test_engines_per_gpu_is_accepted_for_colocated_vllm_on_cuda_only():
    def engines_rule(overrides):  # the rule is workers/placement.py's, asked by trainer/setup.py
        cfg = _compose("grpo_tiny", ["rollout=vllm", "rollout.engines_per_gpu=2", "trainer.device=cuda", *overrides])
        return [m for m in room_errors(cfg) if "rollout.engines_per_gpu=2" in m]

    assert engines_rule([]) == []
    for bad in (["trainer.colocate=false"], ["rollout.tensor_parallel_size=2"], ["trainer.device=cpu"]):
        assert engines_rule(bad), bad


def test_vllm_tensor_parallel_on_gpus_refuses_the_head_dim_it_hangs_on():
    """vLLM TP > 1 on GPUs hung in its start at head_dim 16 (the tiny preset; rollout/vllm.py says what was
    measured): the config says how to fix it before anything starts; CPU runs (vLLM's CPU build) are not affected."""
    tp2 = ["rollout=vllm", "rollout.tensor_parallel_size=2", "actor.tensor_parallel_size=2", "trainer.n_gpus_per_node=2",
           "trainer.use_ray=true"]
    def head_dim_rule(overrides):  # rollout/vllm.py's rule, asked by trainer/setup.py
        return [m for m in room_errors(_compose("grpo_tiny", overrides)) if "has head_dim" in m]

    [why] = head_dim_rule([*tp2, "trainer.device=cuda"])
    assert re.search(r"model.builtin=tiny has head_dim 16: .*\+model.overrides.head_dim=64", why)
    assert head_dim_rule([*tp2, "trainer.device=cuda", "+model.overrides.head_dim=64"]) == []
    assert head_dim_rule([*tp2, "trainer.device=cpu", "+model.overrides.head_dim=32"]) == []
    assert head_dim_rule(["rollout=vllm", "trainer.device=cuda"]) == []  # TP=1 runs at 16


# ------------------------------------------------------------------ #38 item 10: refused before anything starts

@pytest.mark.parametrize("override,key", [
    ("actor.lr=inf", "actor.lr"), ("actor.lr=nan", "actor.lr"), ("actor.lr=-1e-6", "actor.lr"),
    ("critic.lr=inf", "critic.lr"), ("reward.timeout_s=inf", "reward.timeout_s"),
    ("trainer.seed=-1", "trainer.seed"), ("trainer.seed=4294967296", "trainer.seed"),
    ("data.synthetic.seed=4294967296", "data.synthetic.seed"),
    ("+model.overrides.num_attention_heads=3", "model.overrides.num_attention_heads"),
    ("+model.overrides.hidden_size=66", "model.overrides.hidden_size"),
    ("+model.overrides.head_dim=15", "model.overrides.head_dim"),
])
def test_values_that_would_crash_later_are_refused_at_validation(override, key):
    with pytest.raises(ConfigError) as info:
        validate_config(_compose("grpo_tiny", [override]))
    assert key in str(info.value)


def test_infinite_tool_timeout_is_refused():
    cfg = _compose("grpo_tiny", ["rollout.multi_turn.enable=true", "rollout.multi_turn.tool_timeout_s=inf"])
    with pytest.raises(ConfigError, match="rollout.multi_turn.tool_timeout_s=inf is not a finite number"):
        validate_config(cfg)


def test_seed_bounds_are_numpys():
    for seed in (0, 2**32 - 1):  # numpy's range, both ends included
        cfg = _compose("grpo_tiny", [f"trainer.seed={seed}"])
        assert cfg.trainer.seed == seed and config_errors(cfg) == []
    for seed in (-1, 2**32):
        [why] = config_errors(_compose("grpo_tiny", [f"trainer.seed={seed}"]))
        assert why.startswith(f"trainer.seed={seed} is out of range")


def test_a_key_the_schema_lacks_is_refused_even_when_hydra_adds_it():
    cfg = _compose_raw("grpo_tiny", ["+actor.foo=1"])  # Hydra's `+` adds it; the run would never read it
    with pytest.raises(ConfigError, match="actor.foo: not a configuration key"):
        as_config(cfg)  # the entry points' one conversion


@pytest.mark.parametrize("override, message", [
    ("trainer.total_step=10", "trainer.total_step: not a configuration key (did you mean trainer.total_steps?)"),
    ("+trainer.total_step=10", "trainer.total_step: not a configuration key (did you mean trainer.total_steps?)"),
    ("trainr.total_steps=10", "trainr: not a configuration key (did you mean trainer?)"),
    ("rollout.multi_turn.enabel=true",
     "rollout.multi_turn.enabel: not a configuration key (did you mean rollout.multi_turn.enable?)"),
    ("+actor.zzz=1", "actor.zzz: not a configuration key (unknown key; check its spelling and section: "
                     "docs/guide/keys.md lists every key)"),
])
def test_a_misspelled_key_names_the_nearest_one(override, message):
    """Hydra refuses a key the schema lacks (no `+`), the schema one Hydra added (`+`): the same line either way."""
    from rltrain.config.entry import CONFIG_DIR, composition_error

    assert composition_error(CONFIG_DIR, "grpo_tiny", ["--config-name", "grpo_tiny", override]) == message


def test_a_misspelled_value_names_the_nearest_allowed_one():
    with pytest.raises(ConfigError, match="actor.loss_mode='gpso' is not allowed; did you mean gspo[?] choose one of"):
        validate_config(_compose("grpo_tiny", ["actor.loss_mode=gpso"]))
    from rltrain.config.convert import unknown_key_message
    from rltrain.config.schema import SFTConfig

    assert unknown_key_message("optim.lrr", SFTConfig) == "optim.lrr: not a configuration key (did you mean optim.lr?)"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_device_without_a_gpu_is_refused_at_setup():
    with pytest.raises(ConfigError, match="trainer.device=cuda but no CUDA device"):
        check_config(_compose("grpo_tiny", ["trainer.device=cuda"]))


def test_vllm_on_cpu_refuses_the_tiny_head_dim_naming_the_override():
    pytest.importorskip("vllm")
    with pytest.raises(ConfigError, match=r"head_dim 16.*\+model.overrides.head_dim=32"):
        check_config(_compose("grpo_tiny", ["rollout.engine=vllm", "trainer.device=cpu"]))
    assert not [m for m in room_errors(_compose(
        "grpo_tiny", ["rollout.engine=vllm", "trainer.device=cpu", "+model.overrides.head_dim=32"])) if "head_dim" in m]


@pytest.mark.parametrize("override,key", [("actor.lr=abc", "actor.lr"), ("+actor.foo=1", "actor.foo"),
                                          ("rollout.temprature=0.5", "rollout.temprature")])
def test_cli_wrong_type_or_unknown_key_exits_2_naming_the_key(override, key, tmp_path):
    res = _run_main("--config-name", "grpo_tiny", override, f"hydra.run.dir={tmp_path}")
    assert res.returncode == 2, res.stderr
    assert key in res.stderr and "Traceback" not in res.stderr


def test_lora_keys_are_checked_naming_the_key():
    import copy
    import functools

    base = _compose("grpo_tiny", ["actor.lora.rank=8"])
    assert config_errors(base) == []
    cases = [({"actor.lora.rank": -1}, "actor.lora.rank=-1"), ({"actor.lora.alpha": 0.0}, "actor.lora.alpha=0.0"),
             ({"actor.lora.dropout": 1.0}, "actor.lora.dropout=1.0"),
             ({"actor.lora.target_modules": ["qkv"]}, "actor.lora.target_modules=['qkv']"),
             ({"rollout.engine": "vllm", "rollout.engines_per_gpu": 2}, "rollout.engines_per_gpu=2"),
             ({"rollout.engine": "vllm", "actor.lora.rank": 1024}, "largest LoRA rank (512)")]
    for changes, message in cases:
        cfg = copy.deepcopy(base)
        for key, value in changes.items():  # a typed field set by its dotted key
            *path, last = key.split(".")
            setattr(functools.reduce(getattr, path, cfg), last, value)
        assert any(message in err for err in config_errors(cfg)), (changes, config_errors(cfg))
