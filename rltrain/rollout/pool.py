"""Several rollout engines serving one batch at once: EnginePool splits the prompts into contiguous shares, runs
the engines' generate calls concurrently (one thread each; the engines are other processes, so their host work
runs in parallel) and joins the responses in prompt order. Weight updates stream each bucket to every engine once,
the engines taking it at once; sleep and wake run on every engine at once too.

Why: vLLM's engine core spends ~43 us of host time per running request per decode step (docs/benchmarks.md,
section 5: an H100 profile of the GRPO step's generation), so one engine at 256 sequences of a 0.6B model is
host-bound while the GPU idles; two engine cores on the same GPU, each with half the requests, split that work.

Seeds: request j of the batch gets the seed `sampling.seed + j` whichever engine serves it (an engine numbers its
own requests from 0, so a share starting at prompt s is given seed + s): a seeded batch samples the same tokens
from a pool as from one engine. Pure orchestration: no vLLM import, no Ray.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from rltrain.rollout.base import Engine, RolloutResponse, SamplingParams, check_prompts
from rltrain.rollout.sync.ipc import on_every, send_ipc_buckets


def shares(n: int, k: int) -> list[tuple[int, int]]:
    """[start, stop) of k contiguous shares of n items, sizes differing by at most one (empty shares dropped)."""
    if k < 1:
        raise ValueError(f"need at least one share, got {k}")
    base, extra = divmod(n, k)
    out, start = [], 0
    for i in range(k):
        stop = start + base + (1 if i < extra else 0)
        if stop > start:
            out.append((start, stop))
        start = stop
    return out


class EnginePool(Engine):
    """engines: started engines of one model. Weight updates need each engine's bucket API (start_weight_update,
    send_ipc_bucket, finish_weight_update: vLLM engines in their own processes, weight_transfer_backend="ipc")."""

    def __init__(self, engines: Sequence[Engine], *, bucket_bytes: int = 256 << 20) -> None:
        if not engines:
            raise ValueError("EnginePool needs at least one engine")
        self.engines = list(engines)
        self.bucket_bytes = bucket_bytes
        self._threads = ThreadPoolExecutor(max_workers=len(self.engines), thread_name_prefix="rltrain-engine")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.engines[0].eos_token_ids

    def generate(self, prompts_token_ids: list[list[int]], sampling: SamplingParams) -> list[RolloutResponse]:
        check_prompts(prompts_token_ids)
        parts = shares(len(prompts_token_ids), len(self.engines))
        futures = []
        for engine, (start, stop) in zip(self.engines, parts):
            part = sampling if sampling.seed is None else dataclasses.replace(sampling, seed=sampling.seed + start)
            futures.append((start, self._threads.submit(engine.generate, prompts_token_ids[start:stop], part)))
        responses = []
        for start, future in futures:  # in prompt order; an engine's error is raised here
            responses += [dataclasses.replace(r, prompt_index=r.prompt_index + start) for r in future.result()]
        return responses

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        return send_ipc_buckets(self.engines, named_tensors, self.bucket_bytes, self._threads)

    def sleep(self, level: int = 1) -> None:
        on_every(self.engines, lambda engine: engine.sleep(level=level), self._threads)

    def wake_up(self) -> None:
        on_every(self.engines, lambda engine: engine.wake_up(), self._threads)

    def close(self) -> None:
        """Close every engine at once: each engine process gets vLLM's grace period to exit (5 s on the CPU build),
        which one after another would add up."""
        try:
            on_every([e for e in self.engines if callable(getattr(e, "close", None))], lambda engine: engine.close(),
                     self._threads)
        finally:
            self._threads.shutdown(wait=True)
