"""How the actor's weights reach the rollout engine: the one place that picks the path from placement and device.
Streams HF-named full tensors bucket by bucket (never a second full copy of the model); no Ray, no training math.

    sync_method(colocated, device, engine)   path                                   who moves the bytes
    "local"  colocated (any device/engine)   engine.update_weights(actor export)    in process: hf copy_, vLLM
             (vLLM TP>1 colocated runs one vLLM worker per trainer rank via          in-place reload from the
             external_launcher, so every rank reloads its own shard in process)      device tensors (no host trip)
    "nccl"   split, cuda, vllm               vLLM's NCCL weight-transfer engine      NCCL broadcast GPU -> GPUs
    "gloo"   split, cpu (either engine);     gloo broadcast, then the engine's       gloo (host memory, one
             split, cuda, hf                 update_weights on the received stream   bucket at a time)
    Colocated vLLM engines in their own processes (rollout.engines_per_gpu > 1) take the "local" stream through
    send_ipc_buckets: each bucket's CUDA-IPC handles to every engine (vLLM's IPC weight-transfer engine).

Split mode builds a SyncGroup: rank 0 is the train rank that exports (train rank 0; every train rank still
iterates the export because its TP gathers are collective), ranks 1..R are the rollout engines. Per bucket
the sender broadcasts the bucket's metadata (names, dtypes, shapes) over gloo, then the tensors (over gloo,
or over NCCL inside vLLM's weight-transfer engine); an empty bucket ends the stream. The receivers consume
the stream lazily, so each side holds at most one bucket.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch

SYNC_METHODS = ("local", "gloo", "nccl")


def sync_method(*, colocated: bool, device: str, engine: str) -> str:
    """The weight path for a placement (see the module docstring)."""
    if colocated:
        return "local"
    if device == "cuda" and engine == "vllm":
        return "nccl"
    return "gloo"


def transfer_backend(method: str) -> str | None:
    """The vLLM weight-transfer backend an engine must be built with for `method` (None: in-place reload)."""
    return "nccl" if method == "nccl" else None


def buckets(named_tensors: Iterable[tuple[str, torch.Tensor]],
            bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a stream into lists of about bucket_bytes (a larger tensor is its own bucket), lazily."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes!r}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


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


class SyncGroup:
    """A gloo group of the exporting train rank (rank 0) and the rollout engines (1..world_size-1), its own
    TCPStore rendezvous, independent of any torch.distributed default group. Optionally an NCCL channel
    through vLLM's weight-transfer engine (init_nccl_sender / VLLMEngine.init_weight_transfer)."""

    def __init__(self, *, host: str, port: int, rank: int, world_size: int, timeout_s: float = 900.0) -> None:
        import torch.distributed as dist

        if world_size < 2 or not 0 <= rank < world_size:
            raise ValueError(f"SyncGroup needs world_size >= 2 and 0 <= rank < world_size, got {rank}/{world_size}")
        timeout = timedelta(seconds=timeout_s)
        self.rank, self.world_size = rank, world_size
        self.store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore("rltrain/weight_sync", self.store), rank, world_size,
                                        timeout)
        self.nccl = None  # trainer-side PyNcclCommunicator (rank 0, method "nccl")

    # ------------------------------------------------------------------ sender (rank 0)
    def init_nccl_sender(self, *, host: str, port: int, world_size: int) -> None:
        """Rank 0 of vLLM's NCCL weight-transfer group (the engines join with rank_offset >= 1, concurrently)."""
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        self.nccl = trainer_init({"master_address": host, "master_port": port, "world_size": world_size})

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> tuple[int, int]:
        """Broadcast every (name, tensor), bucket by bucket; returns (tensors, bytes) sent."""
        assert self.rank == 0
        count = nbytes = 0
        for bucket in buckets(named_tensors, bucket_bytes):
            self._broadcast_meta([(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in bucket])
            for _, tensor in bucket:
                tensor = tensor.detach().contiguous()
                if self.nccl is not None:
                    self.nccl.broadcast(tensor, src=0, stream=torch.cuda.current_stream())
                else:
                    self.pg.broadcast(tensor.to("cpu"), 0).wait()
                count += 1
                nbytes += tensor.numel() * tensor.element_size()
        self._broadcast_meta([])  # end of stream
        if self.nccl is not None:
            torch.cuda.synchronize()
        return count, nbytes

    # ------------------------------------------------------------------ receivers (ranks >= 1)
    def receive_metadata(self) -> Iterator[list[tuple[str, str, list[int]]]]:
        """Each bucket's [(name, dtype name, shape)] until the end of the stream."""
        while meta := self._broadcast_meta(None):
            yield meta

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The gloo stream as (name, CPU tensor) pairs, received lazily (feed it to engine.update_weights)."""
        for meta in self.receive_metadata():
            for name, dtype, shape in meta:
                tensor = torch.empty(shape, dtype=getattr(torch, dtype))
                self.pg.broadcast(tensor, 0).wait()
                yield name, tensor

    # ------------------------------------------------------------------ plumbing
    def _broadcast_meta(self, meta: list | None) -> list:
        """Rank 0 sends `meta` (pickled), the others receive it."""
        if self.rank == 0:
            payload = torch.frombuffer(bytearray(pickle.dumps(meta)), dtype=torch.uint8)
            length = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            length = torch.zeros(1, dtype=torch.int64)
        self.pg.broadcast(length, 0).wait()
        if self.rank != 0:
            payload = torch.empty(int(length.item()), dtype=torch.uint8)
        self.pg.broadcast(payload, 0).wait()
        return meta if self.rank == 0 else pickle.loads(payload.numpy().tobytes())

    def close(self) -> None:
        self.nccl = None
        self.pg = None
        self.store = None


def receive_into(engine, group: SyncGroup, method: str) -> int:
    """Rollout side of one split sync: load the stream from `group` into `engine`; returns tensors loaded."""
    if method == "gloo":
        return engine.update_weights(group.receive())
    assert method == "nccl", method
    n = 0
    engine.start_weight_update()
    for meta in group.receive_metadata():
        names, dtypes, shapes = (list(x) for x in zip(*meta))
        engine.receive_weight_bucket({"names": names, "dtype_names": dtypes, "shapes": shapes})
        n += len(names)
    engine.finish_weight_update()
    return n


def nccl_init_info(*, host: str, port: int, engine_index: int, num_engines: int, engine_tp: int) -> dict[str, Any]:
    """vLLM's NCCL init_info for rollout engine `engine_index` (its workers take ranks after the trainer's 0)."""
    return {"master_address": host, "master_port": port, "rank_offset": 1 + engine_index * engine_tp,
            "world_size": 1 + num_engines * engine_tp}
