"""Rollout role: wraps a generation engine (hf or vllm), optionally the multi-turn tool loop, and turns
sampled responses into the Batch that flows to rewards and training.

No Ray and no training math here.
"""

from __future__ import annotations

from typing import Iterable

import torch

from rltrain.data.batch import Batch, pad_left
from rltrain.rollout.base import RolloutOutput, SamplingParams, build_engine


class RolloutRole:
    def __init__(self, *, engine: str, model, tokenizer, rollout_cfg: dict, device: str, dtype: torch.dtype,
                 sandbox_cfg: dict | None = None):
        self.cfg, self.tokenizer = rollout_cfg, tokenizer
        if engine == "hf":
            self.engine = build_engine("hf", model=model, tokenizer=tokenizer, device=device, dtype=dtype,
                                       max_batch_size=rollout_cfg["max_batch_size"])
        else:
            self.engine = build_engine(engine, model=model, tokenizer=tokenizer,
                                       gpu_memory_utilization=rollout_cfg["gpu_memory_utilization"],
                                       tensor_parallel_size=rollout_cfg["tensor_parallel_size"],
                                       enforce_eager=rollout_cfg["enforce_eager"])
        self.multi_turn = None
        mt = rollout_cfg.get("multi_turn") or {}
        if mt.get("enable"):
            from rltrain.rollout.multiturn import MultiTurnRollout, SandboxToolExecutor

            sb = sandbox_cfg or {}  # config group `sandbox`; refuses here where tool code cannot be isolated
            tools = SandboxToolExecutor(max_workers=mt["tool_max_workers"], timeout_s=mt["tool_timeout_s"],
                                        memory_mb=mt["tool_memory_mb"],
                                        allow_unisolated=sb.get("allow_unisolated", False),
                                        allow_exec=sb.get("allow_exec", False))
            self.multi_turn = MultiTurnRollout(self.engine, tokenizer, tool_executor=tools,
                                               tool_pattern=mt["tool_pattern"], max_turns=mt["max_turns"],
                                               max_total_tokens=mt["max_total_tokens"])

    def sampling(self, *, validate: bool, seed: int | None) -> SamplingParams:
        c = self.cfg
        return SamplingParams(
            n=c["val_n"] if validate else c["n"],
            temperature=c["val_temperature"] if validate else c["temperature"],
            top_p=1.0 if validate else c["top_p"], top_k=-1 if validate else c["top_k"],
            max_tokens=c["max_response_length"], stop=tuple(c["stop"]), seed=seed,
        )

    def generate(self, prompts: list[dict], *, group_offset: int, validate: bool = False,
                 seed: int | None = None) -> tuple[Batch, dict[str, float]]:
        """prompts: dataset items (prompt_ids, ground_truth, data_source, ...). Returns the Batch of n
        samples per prompt (group id = group_offset + prompt index) and rollout metrics."""
        sampling = self.sampling(validate=validate, seed=seed)
        ids = [list(p["prompt_ids"]) for p in prompts]
        if self.multi_turn is not None:
            responses = self.multi_turn.generate(ids, sampling)
        else:
            responses = self.engine.generate(ids, sampling)
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
        batch = Batch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=out.response_ids,
                      response_mask=out.response_mask, loss_mask=out.loss_mask,
                      sampler_logprobs=out.sampler_logprobs,
                      group_ids=out.prompt_index + group_offset, non_tensor=non_tensor)
        return batch, out.metrics()

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        return self.engine.update_weights(named_tensors)

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake_up()
