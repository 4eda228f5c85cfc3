"""How a vLLM rollout engine starts: the process environment, `vllm.LLM`'s keyword arguments (the one place they
are decided), the KV-cache size of a small model, the TP head-dim rule, the start error a user can act on, and the
one start-up warning of vLLM's that is dropped (quiet_tokenizer_warmup).
Plain functions of a checkpoint's config and our settings: it must not import vllm (rollout/vllm.py starts engines).

Every engine, whatever the GPU count, is built with `disable_custom_all_reduce=True` and
`compilation_config={"pass_config": {"fuse_allreduce_rms": False}}`, and its process carries
utils/distenv.py's NO_MULTICAST_ENV plus ENGINE_ENV: vLLM's TP all-reduce then runs on plain NCCL
(the log says "Using ['PYNCCL'] all-reduce backends") and never on NVLink multicast (`mnnvl`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import torch

from rltrain.compat.vllm import INSTALL_HINT, SUPPORTED_TEXT
from rltrain.utils import flops

# The process environment every vLLM engine needs (set before vLLM starts; its workers inherit it).
ENGINE_ENV: dict[str, str] = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in this process: tensors are never pickled
    "VLLM_USE_FLASHINFER_SAMPLER": "0",  # its JIT build costs ~2 minutes of start-up and nothing at our sizes
}


def apply_engine_env(env: dict | None = None, *, in_process: bool = True) -> dict[str, str]:
    """Set ENGINE_ENV and NO_MULTICAST_ENV in `env` (default: this process); returns what a vLLM engine and
    every process it spawns will carry. in_process=False: vLLM's engine core runs in a process of its own."""
    from rltrain.utils.distenv import apply_no_multicast

    env = os.environ if env is None else env
    engine_env = {**ENGINE_ENV, **({} if in_process else {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})}
    env.update(engine_env)
    env.setdefault("VLLM_HOST_IP", "127.0.0.1")  # vLLM's own rendezvous stays on this machine (engines are 1 node)
    return {**engine_env, **apply_no_multicast(env)}


@contextlib.contextmanager
def world_launcher_env(device: str = "cuda"):
    """vLLM's external launcher reads the torchrun variables (RANK, LOCAL_RANK, WORLD_SIZE) while the engine
    starts, even when the process group already exists. Ray workers set them (workers/placement.py); a
    process that made its world another way (a notebook, a test, the non-Ray trainer) may not: fill the
    missing ones from the world this process belongs to, for the start only (left set, they would tell
    every child process it was launched by torchrun)."""
    dist = torch.distributed
    local = torch.cuda.current_device() if device == "cuda" and torch.cuda.is_available() else 0
    filled = {"RANK": str(dist.get_rank()), "WORLD_SIZE": str(dist.get_world_size()), "LOCAL_RANK": str(local)}
    added = [k for k in filled if k not in os.environ]
    os.environ.update({k: filled[k] for k in added})
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


# The most sequences vLLM's offline LLM schedules at once (its default max_num_seqs on a large GPU; 256 on others).
MAX_NUM_SEQS = 1024


def _checkpoint_config(model: str):
    """The transformers config of a local HF checkpoint directory; None for a hub name or a directory without
    config.json."""
    if not os.path.isfile(os.path.join(str(model), "config.json")):
        return None
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model), trust_remote_code=False)


def true_on_policy_kwargs(device: str, enforce_eager: bool = False) -> dict[str, Any]:
    """vllm.LLM's keyword arguments under rollout.true_on_policy on a GPU (compat/vllm_kernels.py names what the
    actor matches): vLLM's custom ops and no Inductor (no graph rewrite changes an elementwise step), FlashAttention,
    KV pages of vllm_kernels.BLOCK_SIZE tokens; the decode steps replayed from full CUDA graphs (the same kernels,
    launched from a graph: a padded batch row changes no other row) unless `enforce_eager`. The process runs vLLM's
    batch-invariant mode (vllm_kernels.enable, set by the worker before the engine starts; its environment reaches
    an engine's own processes), and every worker process of the engine routes its residual norms (the worker
    extension compat/vllm_worker_ext.py: engines in processes of their own too)."""
    if device != "cuda":
        return {}
    from rltrain.compat.vllm_kernels import BLOCK_SIZE, WORKER_EXTENSION

    compilation = {"pass_config": {"fuse_allreduce_rms": False}, "custom_ops": ["all"]}
    if not enforce_eager:
        compilation.update(mode="NONE", cudagraph_mode="FULL_DECODE_ONLY")  # no torch.compile
    return dict(enforce_eager=enforce_eager, block_size=BLOCK_SIZE, attention_backend="FLASH_ATTN",
                compilation_config=compilation, worker_extension_cls=WORKER_EXTENSION)


def kv_cache_need_bytes(hf_config, *, tensor_parallel_size: int, dtype_bytes: int,
                        max_num_seqs: int = MAX_NUM_SEQS) -> int:
    """KV-cache bytes one rank needs to hold `max_num_seqs` sequences of the model's full length
    (max_position_embeddings, vLLM's default max_model_len): K and V of every layer, the rank's share of the KV
    heads (at least one: vLLM replicates KV heads when TP exceeds them)."""
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    head_dim = flops.head_dim(hf_config)
    per_token = 2 * int(hf_config.num_hidden_layers) * max(1, kv_heads // tensor_parallel_size) * head_dim * dtype_bytes
    return per_token * int(hf_config.max_position_embeddings) * max_num_seqs


def auto_kv_cache_bytes(hf_config, *, tensor_parallel_size: int, dtype_bytes: int, gpu_memory_utilization: float,
                        gpu_total_bytes: int) -> int | None:
    """The KV cache to fix when rollout.kv_cache_memory_gb is unset: what the engine can ever use
    (kv_cache_need_bytes, at least 256 MiB) when that is under half of the GPU share vLLM may take, else None (vLLM
    sizes it from gpu_memory_utilization). A small model (the tiny default: 0.1 GiB needed) otherwise gets tens of
    GiB of cache, hundreds of millions of token slots, and vLLM then sized other tables by them: on one H200 it asked
    for a second 70 GiB allocation and ran out of memory at start. A fixed cache also skips vLLM's start-up memory
    profiling, which other processes changing their GPU memory meanwhile upset."""
    try:
        need = max(256 << 20, kv_cache_need_bytes(hf_config, tensor_parallel_size=tensor_parallel_size,
                                                  dtype_bytes=dtype_bytes))
    except (AttributeError, TypeError):  # a config without these fields (not a plain decoder): vLLM sizes it
        return None
    return need if need <= gpu_memory_utilization * gpu_total_bytes / 2 else None


def checkpoint_kv_cache_bytes(model: str, *, dtype: str, tensor_parallel_size: int, gpu_memory_utilization: float,
                              device_index: int | None = None) -> int | None:
    """auto_kv_cache_bytes for a local HF checkpoint directory on this process's GPU (None for a hub name or a
    directory without config.json: vLLM sizes the cache from gpu_memory_utilization)."""
    hf_config = _checkpoint_config(model)
    if hf_config is None:
        return None
    index = torch.cuda.current_device() if device_index is None else device_index
    return auto_kv_cache_bytes(hf_config, tensor_parallel_size=tensor_parallel_size,
                               dtype_bytes=getattr(torch, dtype).itemsize,
                               gpu_memory_utilization=gpu_memory_utilization,
                               gpu_total_bytes=torch.cuda.get_device_properties(index).total_memory)


DEFAULT_GPU_MEMORY_UTILIZATION = 0.5  # rollout.gpu_memory_utilization's default too

def checkpoint_num_experts(model: str) -> int:
    """The experts of each sparse layer of a local HF checkpoint directory (0: dense, or no config)."""
    hf_config = _checkpoint_config(model)
    return 0 if hf_config is None else int(getattr(hf_config, "num_experts", 0) or 0)


def checkpoint_is_moe(model: str) -> bool:
    """Whether a local HF checkpoint directory holds a Mixture-of-Experts model (num_experts > 0)."""
    return checkpoint_num_experts(model) > 0


def checkpoint_moe_layers(model: str) -> list[int]:
    """The indices of a local HF checkpoint's sparse (MoE) layers: the rows of vLLM's routed-experts output that
    hold routing (it keeps one per hidden layer, dense ones zero). Empty for a dense model or no config."""
    hf_config = _checkpoint_config(model)
    return [] if hf_config is None else [i for i, s in enumerate(flops.sparse_layers(hf_config)) if s]


def checkpoint_head_dim(model: str) -> int | None:
    """head_dim of a local HF checkpoint directory (hidden_size / num_attention_heads where unset); None for a hub
    name or a directory without config.json."""
    hf_config = _checkpoint_config(model)
    return None if hf_config is None else flops.head_dim(hf_config)


def engine_kwargs(model: str, *, device: str, dtype: str, seed: int, tensor_parallel_size: int = 1,
                  data_parallel_size: int = 1, gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
                  enforce_eager: bool = False,
                  max_model_len: int | None = None, cpu_kv_cache_bytes: int = 256 << 20,
                  gpu_kv_cache_bytes: int | None = None,
                  weight_transfer_backend: str | None = None, external_launcher: bool = False,
                  **extra: Any) -> dict[str, Any]:
    """The keyword arguments of vllm.LLM for one rollout engine (the one place they are decided).

    device "cuda": KV cache sized by `gpu_memory_utilization` (the fraction of the GPU vLLM may take; the actor
    gets the rest), or of `gpu_kv_cache_bytes` when given (vLLM then skips its memory profiling, which other
    processes changing their GPU memory during the start would upset), sleep mode on, CUDA graphs unless
    enforce_eager. device "cpu": eager, KV cache of `cpu_kv_cache_bytes`, no sleep mode (vLLM's CPU build has none),
    no chunked prefill (seeded requests need it off on CPU: see below).
    """
    kw: dict[str, Any] = dict(
        model=model, skip_tokenizer_init=True, dtype=dtype, seed=seed, tensor_parallel_size=tensor_parallel_size,
        trust_remote_code=False,  # the engine loads our own export (or model.path, checked by the trainer first)
        max_model_len=max_model_len, logprobs_mode="processed_logprobs",
        # multi-GPU safety (always, whatever the GPU count): plain NCCL all-reduce, no NVLink multicast fusion
        disable_custom_all_reduce=True,
        compilation_config={"pass_config": {"fuse_allreduce_rms": False}},
    )
    if device == "cuda":
        kw.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=True, enforce_eager=enforce_eager)
        if gpu_kv_cache_bytes is not None:
            kw["kv_cache_memory_bytes"] = int(gpu_kv_cache_bytes)
    else:
        # chunked prefill off: a prompt split over steps has its sampled token discarded, and vLLM then rewinds the
        # request's seeded generator, which a CPU generator cannot do ("CPU Generator does not use offset"); a seeded
        # batch of more prompt tokens than one step takes crashed. Whole prompts per step instead.
        kw.update(enforce_eager=True, kv_cache_memory_bytes=int(cpu_kv_cache_bytes), enable_chunked_prefill=False)
    if external_launcher:
        kw["distributed_executor_backend"] = "external_launcher"
        if data_parallel_size > 1:
            kw["data_parallel_size"] = data_parallel_size
    if weight_transfer_backend is not None:
        kw["weight_transfer_config"] = {"backend": weight_transfer_backend}
    kw.update(extra)
    return kw


_MEMORY_WORDS = ("out of memory", "no available memory", "less than requested memory", "not enough memory",
                 "insufficient memory", "cache blocks", "kv cache is needed", "larger than the available kv")


def start_error(version: str, kwargs: dict, err: Exception, memory_key: str) -> str:
    text = f"{type(err).__name__}: {err}".strip()
    head = (f"vLLM {version} could not start the rollout engine for {kwargs['model']!r} "
            f"(tp={kwargs['tensor_parallel_size']}, dtype={kwargs['dtype']}): {text[-1500:]}.")
    if any(w in text.lower() for w in _MEMORY_WORDS):
        if "gpu_memory_utilization" in kwargs:
            kv = (f" A fixed KV cache of {kwargs['kv_cache_memory_bytes'] / 2**30:g} GiB was asked for "
                  "(rollout.kv_cache_memory_gb): lower it, or null to size it by the fraction."
                  if kwargs.get("kv_cache_memory_bytes") else "")
            return (f"{head} The engine does not fit: {memory_key}={kwargs['gpu_memory_utilization']} is the "
                    "fraction of each GPU vLLM may take (weights + KV cache); raise it if the KV cache is too "
                    "small, lower it if the GPU is out of memory (the actor gets the rest), or lower "
                    f"rollout.max_response_length / data.max_prompt_length.{kv}")
        return (f"{head} The engine does not fit in host memory: free memory or lower "
                "rollout.max_response_length / data.max_prompt_length.")
    return f"{head} rltrain's vllm engine supports {SUPPORTED_TEXT}; {INSTALL_HINT}."


# vLLM warms up chat-template rendering as the engine starts (renderers/base.py, both supported versions). rltrain
# hands it token ids and builds it with skip_tokenizer_init=True, so that warm-up fails by design and vLLM logs the
# failure as a warning with a traceback. Exactly that record is dropped; any other failure of the warm-up is shown.
WARMUP_LOGGER = "vllm.renderers.base"
NO_TOKENIZER = "Tokenizer not available when `skip_tokenizer_init=True`"


class _NoTokenizerWarmup(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        err = record.exc_info[1] if record.exc_info else None
        return not (err is not None and str(err).replace("`", "") == NO_TOKENIZER.replace("`", ""))


def quiet_tokenizer_warmup() -> None:
    """Drop vLLM's warm-up traceback of an engine without a tokenizer (see NO_TOKENIZER); called before each
    engine starts, installed once."""
    logger = logging.getLogger(WARMUP_LOGGER)
    if not any(isinstance(f, _NoTokenizerWarmup) for f in logger.filters):
        logger.addFilter(_NoTokenizerWarmup())
