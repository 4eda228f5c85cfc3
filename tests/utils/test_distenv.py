"""The no-multicast environment: set in the driver, handed to workers, overridable only on purpose; the rendezvous
port, picked outside the kernel's ephemeral range."""

import socket

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


def test_free_port_avoids_the_ephemeral_range_and_is_bindable(tmp_path):
    from rltrain.utils.distenv import RENDEZVOUS_PORT_LOW, ephemeral_ports, free_port

    for _ in range(20):
        port = free_port("127.0.0.1", ephemeral=(32768, 60999))
        assert RENDEZVOUS_PORT_LOW <= port < 32768
        with socket.socket() as s:  # free when handed out
            s.bind(("127.0.0.1", port))
    # a range that leaves nothing below it: the kernel's pick, anywhere
    assert 0 < free_port("127.0.0.1", ephemeral=(1024, 65535)) < 65536
    # a port in use is never handed out: a two-port window with one held gives the other (or the kernel's pick)
    with socket.socket() as held:
        held.bind(("127.0.0.1", RENDEZVOUS_PORT_LOW))
        assert free_port("127.0.0.1", ephemeral=(RENDEZVOUS_PORT_LOW + 2, 60999)) != RENDEZVOUS_PORT_LOW
    # the kernel's range, read from its file; the default where it cannot be read or parsed
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert ephemeral_ports(str(f)) == (40000, 50000)
    f.write_text("garbage")
    assert ephemeral_ports(str(f)) == (32768, 60999)
    assert ephemeral_ports(str(tmp_path / "missing")) == (32768, 60999)
