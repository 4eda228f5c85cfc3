"""The environment every process of a run carries: NVLink multicast off, vLLM's all-reduce on plain NCCL.
One rule in one place: the driver applies it, Ray workers inherit it (workers/group.py), vLLM's own
workers inherit it from theirs. It must not import torch, Ray or vLLM.

Why: the lent multi-GPU hosts are shared, and a program using NVLink multicast (NCCL NVLS, torch
symmetric memory, NVSHMEM, vLLM's FlashInfer `mnnvl` all-reduce fusion) can take the host's GPUs out of
service for everyone. On a cluster of your own, `RLTRAIN_ALLOW_MULTICAST=1` leaves the variables alone.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

NO_MULTICAST_ENV: dict[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    # vLLM (TP > 1): no FlashInfer multicast all-reduce, no symmetric-memory all-reduce
    "VLLM_FLASHINFER_ALLREDUCE_BACKEND": "trtllm",
    "VLLM_ALLREDUCE_USE_SYMM_MEM": "0",
}

# Variables a Ray worker must see as the driver does (prefixes): ours, logging, threads, NCCL/torch/vLLM.
FORWARDED_PREFIXES = ("WANDB_", "RLTRAIN_", "TOKENIZERS_", "OMP_", "NCCL_", "TORCH_", "NVSHMEM_", "VLLM_",
                      "HF_", "TRANSFORMERS_", "TRITON_")


def apply_no_multicast(env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set NO_MULTICAST_ENV in `env` (default: this process's environment), overriding what is there
    unless RLTRAIN_ALLOW_MULTICAST=1; returns the variables set."""
    env = os.environ if env is None else env
    if env.get("RLTRAIN_ALLOW_MULTICAST") == "1":
        return {}
    env.update(NO_MULTICAST_ENV)
    return dict(NO_MULTICAST_ENV)


def forwarded_env(env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """The variables to hand to worker processes: the forwarded prefixes of `env`, with multicast off."""
    env = dict(os.environ if env is None else env)
    apply_no_multicast(env)
    return {k: v for k, v in env.items() if k.startswith(FORWARDED_PREFIXES)}
