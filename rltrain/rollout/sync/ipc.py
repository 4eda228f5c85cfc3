"""CUDA-IPC weight sync to vLLM engines in their own processes on this GPU (rollout.engines_per_gpu > 1, or one
engine with in_process=False): each bucket's CUDA-IPC handles go to every engine (vLLM's IPC weight-transfer
engine, VLLMEngine.send_ipc_bucket), the pool's threads fanning out. It must not start engines (rollout/vllm.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

from rltrain.rollout.sync.group import buckets


def send_ipc_buckets(engines, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                     threads: ThreadPoolExecutor | None = None) -> int:
    """Stream (HF name, CUDA tensor) pairs to vLLM engines in their own processes on this GPU: one weight-update
    session per engine, each bucket sent to every engine by CUDA IPC (VLLMEngine.send_ipc_bucket), so the stream
    is read once and at most one bucket is held. Given `threads` (the pool's), several engines take each bucket at
    once (they load in their own processes), so k engines cost about what one does. Returns the number of tensors."""
    on_every(engines, lambda engine: engine.start_weight_update(), threads)
    n = 0
    for bucket in buckets(named_tensors, bucket_bytes):
        bucket = [(name, t.detach().contiguous()) for name, t in bucket]  # any copy made here, on this stream
        for device in {t.device for _, t in bucket if t.is_cuda}:
            # what this thread's stream wrote is complete before the engines read it (the one sync per bucket: the
            # sending threads' current streams are not the one that wrote it)
            torch.cuda.current_stream(device).synchronize()
        on_every(engines, lambda engine, part=bucket: engine.send_ipc_bucket(part), threads)
        n += len(bucket)
    on_every(engines, lambda engine: engine.finish_weight_update(), threads)
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()  # the engines have closed their mappings: let the memory go
    return n


def on_every(engines, call, threads: ThreadPoolExecutor | None) -> None:
    """call(engine) for every engine, at once on `threads` when there are several; returns when all are done,
    raising the first error."""
    if threads is None or len(engines) == 1:
        for engine in engines:
            call(engine)
        return
    futures = [threads.submit(call, engine) for engine in engines]
    for future in futures:
        future.result()
