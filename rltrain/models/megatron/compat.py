"""Everything megatron-core needs to run on CPU (tests, the tiny default): process groups over gloo,
a CPU RNG tracker, device choice. It must not change anything when CUDA is available.

megatron-core assumes CUDA in three places we hit: the model-parallel RNG tracker (it saves and
restores `torch.cuda` generator states), activation recomputation (it saves the CUDA RNG state) and the
default device of new tensors. On a CPU-only
machine `setup_parallel` installs `CpuRNGStatesTracker` (same interface, CPU generator states) in
place of megatron's tracker, and models are built with `use_cpu_initialization=True`. On a CUDA
machine it calls megatron's own `model_parallel_cuda_manual_seed` and touches nothing else.

One shim applies on every device, and only when layers are compiled (`quiet_tp_group_default`): megatron's
RowParallelLinear passes `tp_group=None` on every forward and gets a deprecation warning each time, which
torch.compile cannot trace (a graph break inside each layer).
"""

from __future__ import annotations

import contextlib
import os
import socket

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import random as mcore_random


def cuda_enabled() -> bool:
    """True when megatron should run on CUDA (the compat shims below are then inactive)."""
    return torch.cuda.is_available()


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`. To a GPU through pinned memory, queued on the stream without waiting for it
    (a copy from pageable memory may synchronize the stream: a host sync per tensor and micro-batch; the
    caching host allocator keeps the pinned buffer until the copy has run)."""
    if t.device.type == "cpu" and torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def resolve_device(device: str | torch.device | None) -> torch.device:
    """"auto"/None -> cuda:<local rank> when CUDA is available else cpu; raises for cuda without CUDA."""
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


class CpuRNGStatesTracker(mcore_random.CudaRNGStatesTracker):
    """megatron's named RNG-state tracker, holding CPU generator states instead of CUDA ones."""

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name: str = mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise ValueError(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def _cpu_get_rng_state(device=None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _cpu_set_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _seed_cpu(seed: int, tp_rank: int) -> None:
    # activation recomputation (CheckpointFunction) saves/restores the "CUDA" RNG state: use the CPU one
    mcore_random._get_cuda_rng_state = _cpu_get_rng_state
    mcore_random._set_cuda_rng_state = _cpu_set_rng_state
    tracker = CpuRNGStatesTracker()
    mcore_random._CUDA_RNG_STATE_TRACKER = tracker
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    torch.manual_seed(seed)
    # Same seed offsets as megatron's model_parallel_cuda_manual_seed.
    tracker.add(mcore_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mcore_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024)


def _rope_emb_on_cpu(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    """RotaryEmbedding.get_emb without its move of `inv_freq` to the current CUDA device."""
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)  # [s, dim/2]
    if self.rotary_interleaved:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
    return emb[:, None, None, :]  # [s, 1, 1, dim]


def patch_model_for_cpu(model: torch.nn.Module) -> torch.nn.Module:
    """Make a freshly built megatron model runnable on CPU (no-op with CUDA): RoPE modules keep
    their frequencies on the CPU instead of moving them to `torch.cuda.current_device()`."""
    if cuda_enabled():
        return model
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.get_emb = _rope_emb_on_cpu.__get__(module)
    return model


def quiet_tp_group_default() -> None:
    """Resolve megatron-core 0.16's `tp_group=None` to the TP group without its per-call warning (the value is
    the same; torch.compile graph-breaks on `warnings.warn`). Idempotent."""
    from megatron.core.tensor_parallel import layers

    orig = layers.get_tensor_model_parallel_group_if_none
    if getattr(orig, "_rltrain_quiet", False):
        return

    def resolve(tp_group=None, is_expert=False, check_initialized=True):
        if tp_group is None and not is_expert and dist.is_initialized() and parallel_state.is_initialized():
            return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)
        return orig(tp_group, is_expert=is_expert, check_initialized=check_initialized)

    resolve._rltrain_quiet = True
    layers.get_tensor_model_parallel_group_if_none = resolve


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_parallel(tp_size: int = 1, pp_size: int = 1, seed: int = 0) -> None:
    """Initialize torch.distributed (if needed) and megatron's model-parallel groups, then seed.

    Without an existing process group: uses RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT from the
    environment when set (torchrun, Ray workers), else a single-process group on a free local port.
    Backend: nccl with CUDA, gloo without. Idempotent for the same (tp_size, pp_size).
    """
    if tp_size < 1 or pp_size < 1:
        raise ValueError(f"tp_size and pp_size must be >= 1, got tp_size={tp_size}, pp_size={pp_size}")
    if parallel_state.model_parallel_is_initialized() and not _megatron_groups_alive():
        parallel_state.destroy_model_parallel()  # its world was destroyed (e.g. by a vLLM engine that owned it)
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group("nccl" if cuda_enabled() else "gloo")
        else:
            dist.init_process_group(
                "nccl" if cuda_enabled() else "gloo",
                init_method=f"tcp://127.0.0.1:{_free_port()}",
                rank=0,
                world_size=1,
            )
    world = dist.get_world_size()
    if world % (tp_size * pp_size) != 0:
        raise ValueError(
            f"world size {world} is not divisible by tp_size*pp_size = {tp_size}*{pp_size}"
        )
    if parallel_state.model_parallel_is_initialized():
        have = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
        )
        if have != (tp_size, pp_size):
            raise ValueError(
                f"megatron model parallelism is already initialized with (tp, pp)={have}, "
                f"cannot switch to {(tp_size, pp_size)} in the same process"
            )
    else:
        if cuda_enabled():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count())))
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=pp_size
        )
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    if cuda_enabled():
        mcore_random.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
        torch.manual_seed(seed)
    else:
        _seed_cpu(seed, tp_rank)


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
            "dp": parallel_state.get_data_parallel_rank()}


def teardown_parallel() -> None:
    """Destroy megatron's groups and the default process group (tests that re-initialize)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
