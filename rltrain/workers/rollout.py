"""Rollout role: wraps a generation engine (hf or vllm), optionally the multi-turn tool loop, and turns
sampled responses into the Batch that flows to rewards and training.

No Ray and no training math here.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from typing import Iterable

import torch

from rltrain.config.schema import RolloutConfig, SandboxConfig
from rltrain.data.batch import Batch, pad_left, pad_right
from rltrain.rollout.base import RolloutOutput, SamplingParams, build_rollout_engine


class RolloutRole:
    """engine: "hf" | "vllm" | "pkg.module:Class". model: the transformers model every role starts from, or its
    config alone (model.init=engine: the engine starts from random or dummy weights; the actor's come at the first
    push).
    sync: how weights will reach the engine (rollout/sync/: "local", "gloo", "nccl"). routed_experts: the batches
    carry the MoE routing the engine used (rollout routing replay). lora: the actor's adapter spec (actor.lora): the
    engine serves the base with the actor's adapters, which are all a weight sync brings."""

    def __init__(self, *, engine: str, model, tokenizer, rollout_cfg: RolloutConfig, device: str, dtype: torch.dtype,
                 sync: str = "local", seed: int = 0, sandbox_cfg: SandboxConfig | None = None,
                 routed_experts: bool = False, lora=None):
        self.cfg, self.tokenizer, self.sync = rollout_cfg, tokenizer, sync
        # vLLM sleeps at level 2 (weights dropped, no host copy) when every wake is followed by a full update; with
        # LoRA only the adapters come: the base must survive the sleep (level 1: kept in host memory)
        self.sleep_level = 2 if engine == "vllm" and sync == "local" and lora is None else 1
        if engine == "hf":
            if _is_config(model):  # a config alone: random weights until the first push
                from transformers import AutoModelForCausalLM

                model = AutoModelForCausalLM.from_config(model, dtype=dtype)
            self.engine = build_rollout_engine("hf", model=model, tokenizer=tokenizer, device=device, dtype=dtype,
                                               max_batch_size=rollout_cfg.max_batch_size,
                                               return_routed_experts=routed_experts, lora=lora,
                                               true_on_policy=rollout_cfg.true_on_policy)
        else:
            assert engine == "vllm", engine  # config validation allows hf | vllm
            self.engine = _build_vllm(model, tokenizer, rollout_cfg, device=device, dtype=dtype, sync=sync, seed=seed,
                                      routed_experts=routed_experts, lora=lora)
        self.multi_turn = None
        mt = rollout_cfg.multi_turn
        if mt.enable:
            from rltrain.rollout.multiturn import MultiTurnRollout, SandboxToolExecutor

            # config group `sandbox`; refuses here where tool code cannot be isolated
            sb = sandbox_cfg or SandboxConfig()
            tools = SandboxToolExecutor(max_workers=mt.tool_max_workers, timeout_s=mt.tool_timeout_s,
                                        memory_mb=mt.tool_memory_mb, allow_unisolated=sb.allow_unisolated,
                                        allow_exec=sb.allow_exec)
            self.multi_turn = MultiTurnRollout(self.engine, tokenizer, tool_executor=tools,
                                               tool_pattern=mt.tool_pattern, max_turns=mt.max_turns,
                                               max_total_tokens=mt.max_total_tokens)
        # rollout.partial: generation in chunks in a thread of its own (rollout/partial.py), paused between two
        # chunks while new weights load (weight_sync_receive); it holds the version of the weights loaded
        self.partial = None
        if rollout_cfg.partial:
            from rltrain.rollout.partial import PartialRunner

            self.partial = PartialRunner()

    def sampling(self, *, validate: bool, seed: int | None) -> SamplingParams:
        c = self.cfg
        return SamplingParams(
            n=c.val_n if validate else c.n,
            temperature=c.val_temperature if validate else c.temperature,
            top_p=1.0 if validate else c.top_p, top_k=-1 if validate else c.top_k,
            max_tokens=c.max_response_length, stop=tuple(c.stop), seed=seed,
        )

    def generate(self, prompts: list[dict], *, group_offset: int, validate: bool = False,
                 seed: int | None = None) -> tuple[Batch, dict[str, float]]:
        """prompts: dataset items (prompt_ids, ground_truth, data_source, ...). Returns the Batch of n
        samples per prompt (group id = group_offset + prompt index) and rollout metrics; (None, {}) for no prompts
        (a replica left without a share when a batch has fewer prompts than replicas)."""
        if not prompts:
            return None, {}
        sampling = self.sampling(validate=validate, seed=seed)
        ids = [list(p["prompt_ids"]) for p in prompts]
        start = time.perf_counter()
        versions = None
        if self.multi_turn is not None:
            responses = self.multi_turn.generate(ids, sampling)
        elif self.partial is not None:
            responses, versions = self._generate_in_chunks(ids, sampling)
        else:
            responses = self.engine.generate(ids, sampling)
        engine_s = time.perf_counter() - start
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        out = RolloutOutput.from_responses(responses, pad_token_id=pad_id)
        rows = out.prompt_index.tolist()
        prompt_ids, prompt_mask = pad_left([ids[i] for i in rows], pad_value=pad_id)
        non_tensor = {
            "ground_truth": [prompts[i].get("ground_truth") for i in rows],
            "data_source": [prompts[i].get("data_source") for i in rows],
            "extra": [prompts[i].get("extra") or {} for i in rows],
            "finish_reason": list(out.finish_reasons),
            "num_turns": out.num_turns.tolist(),
            "tool_calls": out.tool_calls.tolist(),
        }
        routing = {}
        if responses[0].routed_experts is not None:
            routing = routing_fields(responses, prompt_mask.sum(-1).tolist(), prompt_ids.shape[1],
                                     out.response_ids.shape[1])
        batch = Batch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=out.response_ids,
                      response_mask=out.response_mask, loss_mask=out.loss_mask,
                      sampler_logprobs=out.sampler_logprobs,
                      group_ids=out.prompt_index + group_offset, non_tensor=non_tensor, **routing)
        if versions is not None:  # per token: the version of the weights of each token's chunk
            batch = batch.replace(weight_versions=pad_right(versions, 0, width=out.response_ids.shape[1])[0])
        # the engine's own time (multi-turn: with its tool calls); timing_s/gen minus this is the trainer's side
        # (dispatch, batching, rewards)
        return batch, {**out.metrics(), "timing_s/gen_engine": engine_s}

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        return self.engine.update_weights(named_tensors)

    # ------------------------------------------------------------------ partial rollouts (rollout.partial)
    def _generate_in_chunks(self, ids: list[list[int]], sampling: SamplingParams):
        from rltrain.rollout.partial import generate_in_chunks

        decode = self.tokenizer.decode if sampling.stop else None
        return generate_in_chunks(self.engine, ids, sampling, chunk_tokens=self.cfg.partial_chunk_tokens,
                                  gate=self.partial, decode=decode)

    def generate_start(self, job_id: int, prompts: list[dict], *, group_offset: int, validate: bool = False,
                       seed: int | None = None) -> None:
        """Queue a generation on the partial runner's thread and return at once; `generate_result(job_id)` gives
        what `generate` would. Calls that load weights meanwhile pause it between two chunks (`paused`)."""
        self.partial.submit(job_id, lambda: self.generate(prompts, group_offset=group_offset, validate=validate,
                                                          seed=seed))

    def generate_result(self, job_id: int) -> tuple[Batch, dict[str, float]]:
        return self.partial.result(job_id)

    @contextlib.contextmanager
    def paused(self, version: int | None = None):
        """A block in which the engine's weights may change (partial: generation holds between two chunks); the
        tokens generated after it are stamped with `version` (when given)."""
        if self.partial is None:
            yield
            return
        with self.partial.paused():
            yield
            if version is not None:
                self.partial.version = version

    def sleep(self) -> None:
        self.engine.sleep(level=self.sleep_level)

    def wake_up(self) -> None:
        self.engine.wake_up()

    def close(self) -> None:
        if self.partial is not None:
            self.partial.close()
        close = getattr(self.engine, "close", None)
        if callable(close):
            close()


def routing_fields(responses, prompt_lens: list[int], p: int, r: int) -> dict[str, torch.Tensor]:
    """Batch.prompt_routed_experts [B, P, L, k] (left-padded) and routed_experts [B, R, L, k] (right-padded) from
    each response's routing over its prompt + response tokens (a token the engine never fed, the last one, keeps
    experts 0..k-1: nothing reads the model's output there)."""
    first = responses[0].routed_experts
    layers, k = first.shape[1:]
    prompt = torch.zeros((len(responses), p, layers, k), dtype=first.dtype)
    response = torch.arange(k, dtype=first.dtype).expand(len(responses), r, layers, k).clone()
    for row, (resp, lp) in enumerate(zip(responses, prompt_lens)):
        got = resp.routed_experts
        if got is None or got.shape[1:] != (layers, k) or got.shape[0] < lp:
            raise RuntimeError(f"the rollout engine's routed experts of response {row} have shape "
                               f"{None if got is None else tuple(got.shape)}; expected [>= {lp}, {layers}, {k}]")
        prompt[row, p - lp:] = got[:lp]
        tail = got[lp:lp + len(resp.token_ids)]
        response[row, :len(tail)] = tail
    return {"prompt_routed_experts": prompt, "routed_experts": response}


def _is_config(model) -> bool:
    """model.init=engine: the role is given the model's transformers config alone, not a model."""
    from transformers import PretrainedConfig

    return isinstance(model, PretrainedConfig)


def _build_vllm(model, tokenizer, c: RolloutConfig, *, device: str, dtype: torch.dtype, sync: str, seed: int,
                routed_experts: bool = False, lora=None):
    """A VLLMEngine started from the HF checkpoint the roles start from: model.path as is, or (built-in presets)
    the initial weights written as config + safetensors to a temporary directory, removed once loaded."""
    from rltrain.rollout.sync import transfer_backend
    from rltrain.rollout.vllm import VLLMEngine
    from rltrain.workers.placement import engines_per_gpu_error, replica_size_error

    tp = c.tensor_parallel_size
    # this process's group is world / tp engines of tp consecutive ranks (vLLM's TP groups under its external
    # launcher); each engine serves the prompts its replica is given (RolloutSource.submit_generate)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    why = replica_size_error(world, tp)
    if why:
        raise ValueError(why)
    source = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    tmp, extra = None, {}
    if _is_config(model):  # model.init=engine: its config, dummy weights until the first push
        from rltrain.models.hf_export import write_hf_config

        tmp = tempfile.mkdtemp(prefix="rltrain-rollout-init-")
        write_hf_config(model, tmp)  # with its architectures: vLLM picks its model class by them
        source, extra = tmp, {"load_format": "dummy"}
    elif not (source and _is_checkpoint(source)):
        tmp = tempfile.mkdtemp(prefix="rltrain-rollout-init-")
        _write_checkpoint(model, tmp)
        source = tmp
    kv_gb = c.kv_cache_memory_gb
    kv_bytes = None if kv_gb is None else int(kv_gb * 2**30)  # unset: the engine fixes a small model's (vllm.py)
    common = dict(tokenizer=tokenizer, device=device, dtype=str(dtype).removeprefix("torch."), seed=seed,
                  tensor_parallel_size=tp, enforce_eager=c.enforce_eager, return_routed_experts=routed_experts,
                  eos_token_id=getattr(tokenizer, "eos_token_id", None), lora=lora, **extra)
    if c.true_on_policy:
        from rltrain.rollout.vllm_args import true_on_policy_kwargs

        common.update(true_on_policy_kwargs(device, c.enforce_eager))
    k = c.engines_per_gpu
    try:
        if k > 1:  # several engines in their own processes share this GPU; weights by CUDA IPC (rollout/pool.py)
            why = engines_per_gpu_error(k, engine="vllm", tensor_parallel_size=tp, colocated=sync == "local",
                                        device=device, group_size=world)
            if why:
                raise ValueError(why)
            from rltrain.rollout.vllm import start_engine_pool

            return start_engine_pool(source, k, **common, gpu_memory_utilization=c.gpu_memory_utilization,
                                     gpu_kv_cache_bytes=kv_bytes, bucket_bytes=c.weight_sync_bucket_mb << 20)
        return VLLMEngine(source, **common, gpu_memory_utilization=c.gpu_memory_utilization,
                          gpu_kv_cache_bytes=kv_bytes, weight_transfer_backend=transfer_backend(sync),
                          external_launcher=world > 1 or None, direct_expert_sync_after=c.direct_expert_sync_after)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _is_checkpoint(path: str) -> bool:
    """A local HF directory with weights, or a hub name (vLLM resolves those itself)."""
    if not os.path.isdir(path):
        return os.path.sep not in path and "/" in path
    return any(f.endswith((".safetensors", ".bin")) for f in os.listdir(path))


def _write_checkpoint(model, directory: str) -> None:
    """config.json + model.safetensors of `model` on every rank (every vLLM rank reads its own copy), by the one
    HF writer (models/hf_export.py)."""
    from rltrain.models.hf_export import save_hf_checkpoint

    save_hf_checkpoint(directory, model.config, model.state_dict())
