"""megatron-core shims: what it needs to run on CPU (tests, the tiny default) and one per-call warning it emits.
Nothing here changes anything when CUDA is available, except `quiet_tp_group_default` (same value, no warning).

megatron-core assumes CUDA in places we hit: the model-parallel RNG tracker (it saves and restores
`torch.cuda` generator states), activation recomputation (it saves the CUDA RNG state), the default device of
new tensors, RoPE (moves `inv_freq` to the current CUDA device) and the pipeline schedule (p2p buffers on
`"cuda"`, `.cuda()` of a tied last-stage embedding). On a CPU-only machine `seed_cpu` installs
`CpuRNGStatesTracker` (same interface, CPU generator states), `patch_model_for_cpu` keeps RoPE on the CPU and
`cpu_schedule_shim` redirects CUDA devices to the CPU for the duration of a schedule call or model build.

`import_megatron_without_jit_on_cpu` (run when this module is imported, which rltrain.models.megatron does first)
keeps megatron's jit fuser from compiling its fused elementwise functions on a CPU-only machine.

`quiet_tp_group_default` applies on every device, and only when layers are compiled: megatron's
RowParallelLinear passes `tp_group=None` on every forward and gets a deprecation warning each time, which
torch.compile cannot trace (a graph break inside each layer).
"""

from __future__ import annotations

import contextlib
import importlib
import sys

import torch


def _eager(fn=None, **_kw):
    """torch.compile's signature, compiling nothing: `@_eager` and `@_eager(...)` both return the function."""
    return fn if fn is not None else (lambda f: f)


def import_megatron_without_jit_on_cpu() -> None:
    """Import megatron.core with its jit fuser off on a CPU-only machine. megatron applies torch.compile to ~40 fused
    elementwise functions while its modules import (megatron.core.jit takes torch.compile as `jit_fuser` then): on
    a CPU that costs every process importing megatron ~1.5 s of torch._dynamo / inductor set-up (each Ray worker,
    each test child), and a call would build C++ with inductor. Here they stay plain functions (megatron's own
    `disable_jit_fuser` comes too late: the decorators run during the import). No effect with CUDA or once
    megatron.core is imported."""
    if torch.cuda.is_available() or "megatron.core" in sys.modules:
        return
    compile_ = torch.compile
    torch.compile = _eager
    try:
        importlib.import_module("megatron.core")  # megatron.core.jit keeps _eager as its jit_fuser
    finally:
        torch.compile = compile_


import_megatron_without_jit_on_cpu()

import torch.distributed as dist  # noqa: E402  (megatron is imported after the shim above)
from megatron.core import parallel_state  # noqa: E402
from megatron.core.tensor_parallel import random as mcore_random  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402


def cuda_enabled() -> bool:
    """True when megatron should run on CUDA (the CPU shims below are then inactive)."""
    return torch.cuda.is_available()


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


def seed_cpu(seed: int, tp_rank: int) -> None:
    """megatron's model_parallel_cuda_manual_seed for a CPU-only process: its RNG tracker and the recomputation's
    RNG save/restore on the CPU generator."""
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


def _router_gating_on_cpu(self, input: torch.Tensor) -> torch.Tensor:
    """Router.gating without its move of the router weight to the current CUDA device."""
    from megatron.core.transformer.moe.moe_utils import router_gating_linear

    dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
    return router_gating_linear(input, self.weight, self.bias, dtype)


def define_te_gemm_when_absent() -> None:
    """megatron-core 0.16.1's MoE router GEMM (moe_utils.RouterGatingLinearFunction) tests `te_general_gemm is not
    None`, a name its module defines only when Transformer Engine imports: without TE (CPU, our GPU images) every
    MoE forward raised NameError. Define it as None there (torch's matmul path, the one megatron meant). Idempotent;
    applies on every device."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _alltoall_splits_on_cpu(self, point: str, tokens_per_expert=None):
    """MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize for CPU tensors: no side stream, no event; the
    all-to-all split sizes become host arrays at the same point, as the CUDA path makes them."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name)
            if torch.is_tensor(value):
                setattr(self, name, value.numpy())
    return tokens_per_expert


def patch_moe_dispatch_for_cpu() -> None:
    """Let megatron's all-to-all MoE token dispatcher (expert parallelism) run on CPU over gloo: it creates a
    CUDA stream for its device-to-host copies of the split sizes and synchronizes on a CUDA event. No-op with
    CUDA; idempotent."""
    if cuda_enabled():
        return
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    if MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None:
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = "cpu: no side stream"  # the constructor makes none then
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _alltoall_splits_on_cpu


def patch_model_for_cpu(model: torch.nn.Module) -> torch.nn.Module:
    """Make a freshly built megatron model runnable on CPU (no-op with CUDA): RoPE modules keep
    their frequencies on the CPU instead of moving them to `torch.cuda.current_device()`, and MoE routers
    their weights."""
    if cuda_enabled():
        return model
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.moe.router import Router

    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.get_emb = _rope_emb_on_cpu.__get__(module)
        elif isinstance(module, Router):
            module.gating = _router_gating_on_cpu.__get__(module)
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


class _CudaToCpu(TorchFunctionMode):
    """Rewrites `device=` arguments that name CUDA to the CPU (factory functions in megatron)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:  # LanguageModule moves the tied last-stage embedding copy
            return args[0]
        dev = kwargs.get("device")
        if dev is not None and (isinstance(dev, int) or torch.device(dev).type == "cuda"):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_schedule_shim():
    """Run megatron's pipeline schedule on CPU (see module doc); a no-op when CUDA is available."""
    if cuda_enabled():
        yield
        return
    orig = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        with _CudaToCpu():
            yield
    finally:
        torch.cuda.current_device = orig
