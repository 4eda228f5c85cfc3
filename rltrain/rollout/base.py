"""The rollout contract: sampling parameters, one sampled response, the engine interface and registry.
It holds no generation code and imports no engine backend (vllm stays unimported until chosen).

Which log-probs the sampler reports (all engines, `RolloutResponse.logprobs`):
    log softmax(logits / temperature)[token], i.e. the token's log-prob under the
    temperature-scaled distribution *before* top-k / top-p filtering. This is what the actor
    computes in training (logits divided by the rollout temperature), so on-policy PPO importance
    ratios start at exactly 1. With temperature == 0 (greedy) the plain log softmax(logits) is
    reported. (vLLM can only report the filtered values; see rollout/vllm.py for that caveat.)
"""

from __future__ import annotations

import importlib
import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample; the fields mirror vLLM's SamplingParams so both engines read one object.

    n: samples per prompt. temperature: 0 means greedy (argmax). top_p in (0, 1]; top_k = -1 (or 0)
    disables top-k. max_tokens: most new tokens per response. stop: strings that end a response
    (the token completing the string is kept). stop_token_ids: extra ids that end a response
    (kept, like EOS). seed: makes sampling reproducible. logprobs: return sampler log-probs.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    logprobs: bool = True

    def __post_init__(self) -> None:
        # Lists from YAML/Hydra become tuples so the object stays hashable and immutable.
        object.__setattr__(self, "stop", _as_tuple(self.stop, "stop", str))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids, "stop_token_ids", int))
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"SamplingParams.n must be an int >= 1, got {self.n!r}")
        temperature = self.temperature
        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"SamplingParams.temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be an int >= 1, or -1 / 0 to disable, got {self.top_k!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if any(s == "" for s in self.stop):
            raise ValueError("SamplingParams.stop must not contain the empty string")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(
                f"SamplingParams.stop_token_ids must be non-negative token ids, got {self.stop_token_ids!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"SamplingParams.seed must be an int or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _as_tuple(value, name: str, kind: type) -> tuple:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ValueError(f"SamplingParams.{name} must be a list/tuple of {kind.__name__}, got {value!r}")
    items = tuple(value)
    if not all(isinstance(v, kind) and not isinstance(v, bool) for v in items):
        raise ValueError(f"SamplingParams.{name} must contain only {kind.__name__} values, got {items!r}")
    return items


@dataclass
class RolloutResponse:
    """One sampled response (all turns of it, for multi-turn rollouts).

    token_ids:    [R] response token ids exactly as sampled (and, multi-turn, tool-output ids as
                  tokenized once); includes a final EOS / stop token when one was generated.
    logprobs:     [R] sampler log-probs (see the module docstring), 0.0 on tool-output tokens.
    loss_mask:    [R] 1 on model-sampled tokens, 0 on tool-output tokens.
    finish_reason: "stop" (EOS, stop token, stop string), "length" (max tokens / total length /
                  max turns), "abort".
    stop_reason:  what stopped it, as in vLLM: the stop string (str), the stop token id (int), or
                  None for EOS / length.
    routed_experts: [N, L, k] the experts each token of prompt + response was routed to in each of the L MoE
                  layers, when the engine was asked for them (MoE models; rollout routing replay); N = prompt +
                  response length, or one less (the last token is never fed to the model).
    """

    prompt_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    loss_mask: list[int] = field(default_factory=list)
    stop_reason: str | int | None = None
    num_turns: int = 1
    tool_calls: int = 0
    routed_experts: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not self.loss_mask:
            self.loss_mask = [1] * len(self.token_ids)
        assert self.finish_reason in FINISH_REASONS, self.finish_reason
        assert len(self.logprobs) == len(self.token_ids) == len(self.loss_mask), (
            len(self.token_ids), len(self.logprobs), len(self.loss_mask))


@dataclass
class RolloutOutput:
    """A batch of responses as right-padded tensors, the form the trainer's Batch takes.

    response_ids:     [B, L] long, pad_token_id after each response's end
    response_mask:    [B, L] long, 1 on response tokens (model and tool), 0 on padding
    loss_mask:        [B, L] long, 1 on model-sampled tokens only
    sampler_logprobs: [B, L] float32, sampler log-probs, 0 outside loss_mask
    prompt_index:     [B] long, which prompt each row answers (rows are prompt-major)
    num_turns, tool_calls: [B] long
    finish_reasons:   list of B strings
    """

    response_ids: torch.Tensor
    response_mask: torch.Tensor
    loss_mask: torch.Tensor
    sampler_logprobs: torch.Tensor
    prompt_index: torch.Tensor
    num_turns: torch.Tensor
    tool_calls: torch.Tensor
    finish_reasons: list[str]

    @classmethod
    def from_responses(cls, responses: Sequence[RolloutResponse], pad_token_id: int) -> RolloutOutput:
        if not responses:
            raise ValueError("RolloutOutput.from_responses needs at least one response")
        batch, length = len(responses), max(1, max(len(r.token_ids) for r in responses))
        ids = torch.full((batch, length), pad_token_id, dtype=torch.long)
        mask = torch.zeros((batch, length), dtype=torch.long)
        loss = torch.zeros((batch, length), dtype=torch.long)
        logp = torch.zeros((batch, length), dtype=torch.float32)
        for row, r in enumerate(responses):
            n = len(r.token_ids)
            ids[row, :n] = torch.tensor(r.token_ids, dtype=torch.long)
            mask[row, :n] = 1
            loss[row, :n] = torch.tensor(r.loss_mask, dtype=torch.long)
            logp[row, :n] = torch.tensor(r.logprobs, dtype=torch.float32) * loss[row, :n]
        return cls(
            response_ids=ids,
            response_mask=mask,
            loss_mask=loss,
            sampler_logprobs=logp,
            prompt_index=torch.tensor([r.prompt_index for r in responses], dtype=torch.long),
            num_turns=torch.tensor([r.num_turns for r in responses], dtype=torch.long),
            tool_calls=torch.tensor([r.tool_calls for r in responses], dtype=torch.long),
            finish_reasons=[r.finish_reason for r in responses],
        )

    def metrics(self) -> dict[str, float]:
        """Rollout metrics keyed for the loggers (`response_length/mean`, `rollout/num_turns/mean` ...)."""
        lengths = self.response_mask.sum(-1).float()
        out = {
            "response_length/mean": lengths.mean().item(),
            "response_length/max": lengths.max().item(),
            "response_length/min": lengths.min().item(),
            "rollout/model_tokens/mean": self.loss_mask.sum(-1).float().mean().item(),
            "rollout/num_turns/mean": self.num_turns.float().mean().item(),
            "rollout/num_turns/max": self.num_turns.max().item(),
            "rollout/tool_calls/mean": self.tool_calls.float().mean().item(),
        }
        for reason in FINISH_REASONS:
            count = sum(f == reason for f in self.finish_reasons)
            out[f"rollout/finish_{reason}_frac"] = count / len(self.finish_reasons)
        return out


class Engine(ABC):
    """A generation engine. Implementations: "hf" (rollout/hf.py), "vllm" (rollout/vllm.py).

    generate returns responses prompt-major: prompt 0's n samples, then prompt 1's, ...
    update_weights consumes (HF parameter name, tensor) pairs one at a time (the caller streams
    buckets; the engine never needs the whole model at once). sleep frees accelerator memory for a
    colocated trainer; wake_up restores it.
    """

    @property
    @abstractmethod
    def eos_token_ids(self) -> tuple[int, ...]:
        """Token ids that end a response besides SamplingParams.stop_token_ids."""

    @abstractmethod
    def generate(self, prompts_token_ids: list[list[int]], sampling: SamplingParams) -> list[RolloutResponse]: ...

    @abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load new weights by HF name; returns the number of tensors loaded."""

    @abstractmethod
    def sleep(self, level: int = 1) -> None: ...

    @abstractmethod
    def wake_up(self) -> None: ...


def check_prompts(prompts_token_ids: list[list[int]]) -> None:
    """ValueError for an empty batch or an empty prompt (every engine needs >= 1 prompt token)."""
    if not isinstance(prompts_token_ids, (list, tuple)) or not prompts_token_ids:
        raise ValueError("prompts_token_ids must be a non-empty list of token-id lists")
    for i, p in enumerate(prompts_token_ids):
        if len(p) == 0:
            raise ValueError(f"prompts_token_ids[{i}] is empty; every prompt needs at least one token")


# Engine registry keyed by the config string `rollout.engine`. Values are "module:Class" paths so
# that listing engines imports no backend; users may also pass their own "pkg.module:Class".
ENGINES: dict[str, str] = {
    "hf": "rltrain.rollout.hf:HFEngine",
    "vllm": "rltrain.rollout.vllm:VLLMEngine",
}


def engine_class(name: str) -> type[Engine]:
    """Resolve a registry key ("hf", "vllm") or a dotted "pkg.module:Class" path to an Engine class."""
    path = ENGINES.get(name, name)
    if ":" not in path:
        raise ValueError(f"rollout engine {name!r} is unknown; choose one of {sorted(ENGINES)} "
                         "or give a 'pkg.module:Class' path to your own Engine subclass")
    module_name, _, attr = path.partition(":")
    cls = getattr(importlib.import_module(module_name), attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Engine)):
        raise ValueError(f"rollout engine {name!r} resolves to {cls!r}, which is not an Engine subclass")
    return cls


def build_rollout_engine(name: str, **kwargs) -> Engine:
    """Construct the engine registered as `name` with its own keyword arguments."""
    return engine_class(name)(**kwargs)
