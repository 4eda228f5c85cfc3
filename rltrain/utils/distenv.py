"""The environment every process of a run carries: NVLink multicast off, vLLM's all-reduce on plain NCCL, no secret
handed to Ray (`forwarded_env`); and where a torch.distributed group meets (`rendezvous_host`, `free_port`,
`loopback_sockets`): on one node at 127.0.0.1, where every listener of the run stays.
One rule in one place: the driver applies it, Ray workers inherit it (workers/group.py), vLLM's own
workers inherit it from theirs. It must not import torch, Ray or vLLM.

Why: the lent multi-GPU hosts are shared, and a program using NVLink multicast (NCCL NVLS, torch
symmetric memory, NVSHMEM, vLLM's FlashInfer `mnnvl` all-reduce fusion) can take the host's GPUs out of
service for everyone. On a cluster of your own, `RLTRAIN_ALLOW_MULTICAST=1` leaves the variables alone.
"""

from __future__ import annotations

import os
import random
import socket
from collections.abc import MutableMapping

NO_MULTICAST_ENV: dict[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    # vLLM (TP > 1): no FlashInfer multicast all-reduce, no symmetric-memory all-reduce
    "VLLM_FLASHINFER_ALLREDUCE_BACKEND": "trtllm",
    "VLLM_ALLREDUCE_USE_SYMM_MEM": "0",
}

# Variables a Ray worker must see as the driver does (prefixes): ours, threads, NCCL/torch/vLLM, Hugging Face's
# caches. Not wandb's (only the driver logs), and never a secret (SECRET_WORDS): Ray writes runtime_env's variables
# into its logs and onto worker command lines (setup_worker.py --serialized-runtime-env-context), readable by every
# local user. A local cluster's workers inherit the driver's own environment, secrets included, from the raylet the
# driver starts; on a cluster started with `ray start`, set them in that shell (or use `huggingface-cli login`'s
# 0600 token file).
FORWARDED_PREFIXES = ("RLTRAIN_", "TOKENIZERS_", "OMP_", "NCCL_", "TORCH_", "NVSHMEM_", "VLLM_", "HF_",
                      "TRANSFORMERS_", "TRITON_")
# a variable whose name has one of these words (split at "_") holds a secret: HF_TOKEN, WANDB_API_KEY, ...
SECRET_WORDS = frozenset({"TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "CREDENTIALS", "AUTH",
                          "APIKEY", "COOKIE"})
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def apply_no_multicast(env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set NO_MULTICAST_ENV in `env` (default: this process's environment), overriding what is there
    unless RLTRAIN_ALLOW_MULTICAST=1; returns the variables set."""
    env = os.environ if env is None else env
    if env.get("RLTRAIN_ALLOW_MULTICAST") == "1":
        return {}
    env.update(NO_MULTICAST_ENV)
    return dict(NO_MULTICAST_ENV)


def is_secret(name: str) -> bool:
    """Whether the variable `name` holds a secret (a word of SECRET_WORDS in it)."""
    return not SECRET_WORDS.isdisjoint(name.upper().split("_"))


def forwarded_env(env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """The variables to hand to worker processes through Ray's runtime_env: the forwarded prefixes of `env`, with
    multicast off, without secrets."""
    env = dict(os.environ if env is None else env)
    apply_no_multicast(env)
    return {k: v for k, v in env.items() if k.startswith(FORWARDED_PREFIXES) and not is_secret(k)}


def rendezvous_host(single_node: bool, node_ip: str) -> str:
    """Where a torch.distributed group meets, and so the one address its store listens on (compat/torch.
    bind_rendezvous_to_host): 127.0.0.1 when all its ranks are on one node, else rank 0's node address as Ray knows
    it (`ray start --node-ip-address=<address>` sets it; docs/multinode.md)."""
    return "127.0.0.1" if single_node else node_ip


def loopback_sockets(master_addr: str, env: MutableMapping[str, str] | None = None) -> None:
    """For a group meeting at a loopback `master_addr`: gloo's and NCCL's own listening sockets on the loopback
    interface too (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME=lo, unless set). Several nodes: their interfaces are the
    user's to choose with the same variables (each library binds one interface, never all)."""
    env = os.environ if env is None else env
    if master_addr in LOOPBACK:
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")


# A rendezvous port (a torch.distributed store's) is picked free, then bound by another process moments later. Ports
# bound to 0 and outgoing connections take theirs from the kernel's ephemeral range, so a pick there can be taken in
# between (EADDRINUSE at the store, seen in CI beside Ray and two vLLM engines). Picks come from above Ray's worker
# ports (10002-19999 by default) and below the ephemeral range; only where that leaves no room, from the kernel.
RENDEZVOUS_PORT_LOW = 20000
_EPHEMERAL_DEFAULT = (32768, 60999)  # Linux's default ip_local_port_range


def ephemeral_ports(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default where it cannot be read)."""
    try:
        with open(path) as f:
            lo, hi = (int(v) for v in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return _EPHEMERAL_DEFAULT


def free_port(host: str = "", *, ephemeral: tuple[int, int] | None = None, tries: int = 64) -> int:
    """A TCP port free on `host` now, for a rendezvous to bind soon: drawn at random from RENDEZVOUS_PORT_LOW up to
    the ephemeral range (`ephemeral`, default the kernel's), else one the kernel hands out."""
    lo, _ = ephemeral or ephemeral_ports()
    rng = random.SystemRandom()
    for _ in range(tries if lo - 1 > RENDEZVOUS_PORT_LOW else 0):
        port = rng.randint(RENDEZVOUS_PORT_LOW, lo - 1)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
