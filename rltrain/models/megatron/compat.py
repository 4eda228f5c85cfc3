"""Device choice and megatron-core's process groups for one process: torch.distributed (nccl on CUDA, gloo on
CPU), the model-parallel groups, seeding, teardown. It must not patch megatron itself: the CPU and version shims it
relies on live in rltrain/compat/megatron.py.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import random as mcore_random

from rltrain.compat.megatron import cuda_enabled, seed_cpu
from rltrain.compat.torch import bind_rendezvous_to_host
from rltrain.config.parallel import ORDER, ParallelDims
from rltrain.config.schema import ParallelConfig
from rltrain.utils.distenv import loopback_sockets


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`. To a GPU through pinned memory, queued on the stream without waiting for it
    (a copy from pageable memory may synchronize the stream: a host sync per tensor and micro-batch; the
    caching host allocator keeps the pinned buffer until the copy has run)."""
    if t.device.type == "cpu" and torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def torch_device(device: str | torch.device | None) -> torch.device:
    """The engine's torch.device: "auto"/None -> cuda:<current device> when CUDA is available else cpu; "cuda" gets
    the current device's index; raises for cuda without CUDA. (workers/hybrid.resolve_device resolves
    trainer.device to the name "cpu" | "cuda" the workers are placed by.)"""
    if device in (None, "auto"):
        device = "cuda" if cuda_enabled() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        if not cuda_enabled():
            raise ValueError("device='cuda' was requested but CUDA is not available; use device='cpu'")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        raise ValueError(f"device must be 'cpu', 'cuda' or 'auto', got {device!r}")
    return device


def setup_parallel(parallel: ParallelConfig | None = None, *, seed: int = 0) -> ParallelDims:
    """Initialize torch.distributed (if needed) and megatron's model-parallel groups of the degrees `parallel` asks
    for (None: one rank of everything), then seed. Returns the ParallelDims over the world (config/parallel.py: every
    rule of the degrees, EP's included, and the rank layout megatron is given here); an impossible layout raises
    its ParallelDimsError.

    Without an existing process group: uses RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT from the
    environment when set (torchrun, Ray workers), else a single-process group with an in-memory store.
    Backend: nccl with CUDA, gloo without. Idempotent for the same degrees.
    """
    if parallel_state.model_parallel_is_initialized() and not _megatron_groups_alive():
        parallel_state.destroy_model_parallel()  # its world was destroyed (e.g. by a vLLM engine that owned it)
    if not dist.is_initialized():
        bind_rendezvous_to_host()  # rank 0's store listens on MASTER_ADDR only (torch's listens on every interface)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group("nccl" if cuda_enabled() else "gloo")
        else:  # one process: an in-memory store, no listener at all; gloo's and NCCL's sockets on loopback
            loopback_sockets("127.0.0.1")
            dist.init_process_group("nccl" if cuda_enabled() else "gloo", store=dist.HashStore(), rank=0,
                                    world_size=1)
    dims = ParallelDims.of(parallel or ParallelConfig(), world_size=dist.get_world_size())
    if parallel_state.model_parallel_is_initialized():
        have = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_expert_model_parallel_world_size(),
        )
        if have != (dims.tp, dims.pp, dims.ep):
            raise ValueError(
                f"megatron model parallelism is already initialized with (tp, pp, ep)={have}, "
                f"cannot switch to {(dims.tp, dims.pp, dims.ep)} in the same process"
            )
    else:
        if cuda_enabled():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count())))
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=dims.tp, pipeline_model_parallel_size=dims.pp, context_parallel_size=dims.cp,
            expert_model_parallel_size=dims.ep, expert_tensor_parallel_size=dims.etp, order=ORDER,
        )
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    if cuda_enabled():
        mcore_random.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
        torch.manual_seed(seed)
    else:
        seed_cpu(seed, tp_rank)
    return dims


def _megatron_groups_alive() -> bool:
    """Whether megatron's model-parallel groups still belong to the current torch.distributed world. A
    process that ran one job and then lost its world (destroyed by whoever owned it) keeps megatron's
    module-level groups; they must be rebuilt, not reused."""
    if not dist.is_initialized():
        return False
    try:
        dist.get_rank(group=parallel_state.get_tensor_model_parallel_group())
        dist.get_rank(group=parallel_state.get_pipeline_model_parallel_group())
    except (ValueError, RuntimeError):
        return False
    return True


def parallel_coordinates() -> dict[str, int]:
    """This rank's place in megatron's mesh, as parallel_state reports it: {"tp", "pp", "dp"} ranks."""
    return {"tp": parallel_state.get_tensor_model_parallel_rank(),
            "pp": parallel_state.get_pipeline_model_parallel_rank(),
            "dp": parallel_state.get_data_parallel_rank(),
            "ep": parallel_state.get_expert_model_parallel_rank()}


def parallel_layout() -> dict[str, int]:
    """parallel_coordinates() and the sizes of the mesh (tp_size, pp_size, dp_size, ep_size): what a checkpoint
    records so that a resume can tell whether its files fit the new run's layout."""
    return {**parallel_coordinates(),
            "tp_size": parallel_state.get_tensor_model_parallel_world_size(),
            "pp_size": parallel_state.get_pipeline_model_parallel_world_size(),
            "dp_size": parallel_state.get_data_parallel_world_size(),
            "ep_size": parallel_state.get_expert_model_parallel_world_size()}


def teardown_parallel() -> None:
    """Destroy megatron's groups and the default process group (tests that re-initialize)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
