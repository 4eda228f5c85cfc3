"""The no-multicast environment: set in the driver, handed to workers, overridable only on purpose."""

from rltrain.utils.distenv import NO_MULTICAST_ENV, apply_no_multicast, forwarded_env


def test_apply_overrides_a_multicast_setting_and_forwarding_keeps_it():
    env = {"NCCL_NVLS_ENABLE": "1", "PATH": "/bin", "VLLM_USE_V1": "1", "HOME": "/root"}
    assert apply_no_multicast(env) == NO_MULTICAST_ENV
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    fwd = forwarded_env(env)
    assert fwd["NVSHMEM_DISABLE_NVLS"] == "1" and fwd["VLLM_ALLREDUCE_USE_SYMM_MEM"] == "0"
    assert fwd["VLLM_USE_V1"] == "1" and "PATH" not in fwd and "HOME" not in fwd


def test_explicit_opt_out_leaves_the_environment_alone():
    env = {"RLTRAIN_ALLOW_MULTICAST": "1", "NCCL_NVLS_ENABLE": "1"}
    assert apply_no_multicast(env) == {} and env["NCCL_NVLS_ENABLE"] == "1"
