"""The "vllm" rollout engine: a thin adapter over vLLM's offline `LLM` API (GPU), with sleep mode and weight sync.
It translates our SamplingParams/RolloutResponse to vLLM's and back; it must not import vllm at module import time.

vLLM calls used (documented offline API):
  LLM(model=..., enable_sleep_mode=True, logprobs_mode="processed_logprobs",
      worker_extension_cls="rltrain.rollout.vllm.VLLMWorkerExtension", ...)
  LLM.generate([TokensPrompt(prompt_token_ids=ids)], vllm.SamplingParams(..., logprobs=0), use_tqdm=False)
      logprobs=0 returns the sampled token's log-prob only.
  LLM.sleep(level) / LLM.wake_up(tags)       level 1: weights to CPU, KV cache dropped; level 2: both dropped.
  LLM.collective_rpc("rltrain_load_weights", args=(bucket,)) -> every worker calls its model's
      load_weights (HF names; vLLM fuses q/k/v and gate/up itself, and shards for tensor parallelism).
  LLM.reset_prefix_cache() after a weight update, so no KV computed with old weights is reused.

Log-probs: vLLM's "processed_logprobs" are taken after its logits processing (temperature, and
top-k/top-p where set). They equal the hf engine's values (base.py: temperature-scaled, unfiltered)
when top_k/top_p are off, the usual RL setting; with filters on they are the filtered values.

Weights travel as CPU tensors in buckets of about `weight_bucket_bytes`; a CUDA-IPC / NCCL fast
path is not implemented.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from rltrain.rollout.base import FINISH_REASONS, Engine, RolloutResponse, SamplingParams, check_prompts

INSTALL_HINT = "pip install 'rltrain[vllm]'"


def import_vllm():
    """Import vllm, or raise ImportError telling the user how to install it."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(f"rollout engine 'vllm' needs the vllm package, which is not installed: {INSTALL_HINT} "
                          "(CUDA GPUs only), or choose rollout.engine=hf") from err
    return vllm


def vllm_sampling_kwargs(sampling: SamplingParams) -> dict[str, Any]:
    """Our SamplingParams as keyword arguments of vllm.SamplingParams."""
    return {
        "n": sampling.n,
        "temperature": float(sampling.temperature),
        "top_p": float(sampling.top_p),
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,
        "max_tokens": sampling.max_tokens,
        "stop": list(sampling.stop),
        "stop_token_ids": list(sampling.stop_token_ids),
        "include_stop_str_in_output": True,
        "seed": sampling.seed,
        "logprobs": 0 if sampling.logprobs else None,
    }


def response_from_completion(prompt_index: int, completion) -> RolloutResponse:
    """A vLLM CompletionOutput (token_ids, logprobs: list[dict[id, Logprob]] | None, finish_reason,
    stop_reason) as a RolloutResponse. Unfinished or unknown finish reasons become "abort"."""
    token_ids = [int(t) for t in completion.token_ids]
    if completion.logprobs:
        logprobs = [float(step[tok].logprob) for step, tok in zip(completion.logprobs, token_ids)]
    else:
        logprobs = [0.0] * len(token_ids)
    finish = completion.finish_reason if completion.finish_reason in FINISH_REASONS else "abort"
    return RolloutResponse(prompt_index=prompt_index, token_ids=token_ids, logprobs=logprobs,
                           finish_reason=finish, stop_reason=completion.stop_reason)


def weight_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]],
                   bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group the stream into lists of about bucket_bytes (a tensor larger than that is its own
    bucket), moving each tensor to CPU as it is taken; only one bucket is held at a time."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor.detach().to("cpu")))
        size += nbytes
    if bucket:
        yield bucket


class VLLMWorkerExtension:
    """Mixed into each vLLM GPU worker (worker_extension_cls); its methods run via collective_rpc."""

    def rltrain_load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        self.model_runner.model.load_weights(weights=named_tensors)  # type: ignore[attr-defined]
        return len(named_tensors)


class VLLMEngine(Engine):
    """vLLM offline engine. model: HF path or hub name. Extra keyword arguments go to vllm.LLM."""

    def __init__(self, model: str, *, tokenizer: str | None = None, dtype: str = "bfloat16",
                 tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.5,
                 enable_sleep_mode: bool = True, seed: int = 0, max_model_len: int | None = None,
                 weight_bucket_bytes: int = 512 * 1024**2, eos_token_id: int | list[int] | None = None,
                 **llm_kwargs: Any) -> None:
        vllm = import_vllm()
        if weight_bucket_bytes < 1:
            raise ValueError(f"VLLMEngine weight_bucket_bytes must be >= 1, got {weight_bucket_bytes!r}")
        self._vllm = vllm
        self.weight_bucket_bytes = weight_bucket_bytes
        self.llm = vllm.LLM(
            model=model, tokenizer=tokenizer, dtype=dtype, tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep_mode, seed=seed,
            max_model_len=max_model_len, logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{__name__}.VLLMWorkerExtension", **llm_kwargs)
        if eos_token_id is None:
            eos_token_id = self.llm.get_tokenizer().eos_token_id
        self._eos = () if eos_token_id is None else (
            (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    def generate(self, prompts_token_ids: list[list[int]], sampling: SamplingParams) -> list[RolloutResponse]:
        check_prompts(prompts_token_ids)
        from vllm.inputs import TokensPrompt

        params = self._vllm.SamplingParams(**vllm_sampling_kwargs(sampling))
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts_token_ids],
                                    params, use_tqdm=False)
        responses = []
        for prompt_index, request_output in enumerate(outputs):  # vLLM keeps the input order
            for completion in sorted(request_output.outputs, key=lambda c: c.index):
                responses.append(response_from_completion(prompt_index, completion))
        return responses

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        loaded = 0
        for bucket in weight_buckets(named_tensors, self.weight_bucket_bytes):
            self.llm.collective_rpc("rltrain_load_weights", args=(bucket,))
            loaded += len(bucket)
        self.llm.reset_prefix_cache()
        return loaded

    def sleep(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise ValueError(f"VLLMEngine.sleep level must be 1 (offload weights) or 2 (drop weights), got {level!r}")
        self.llm.sleep(level=level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake everything, or only `tags` (["weights"] before a weight update, then ["kv_cache"])."""
        self.llm.wake_up(tags=tags)
