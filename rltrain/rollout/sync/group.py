"""The split placement's weight-sync group: a gloo group of the exporting train rank (rank 0) and the rollout engines
(ranks 1..R), with its own TCPStore rendezvous, and the bucketed stream over it. It must not know an engine.

Rank 0 is the train rank that exports (train rank 0; every train rank still iterates the export because its TP
gathers are collective), ranks 1..R are the rollout engines. Per bucket the sender broadcasts the bucket's metadata
(names, dtypes, shapes) over gloo, then the tensors (over gloo, or over NCCL inside vLLM's weight-transfer engine,
nccl.py); an empty bucket ends the stream. The receivers consume the stream lazily, so each side holds at most one
bucket.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch

from rltrain.compat.torch import bound_store
from rltrain.compat.vllm import nccl_trainer_init


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
        # rank 0's store listens on `host` only (127.0.0.1 on one node: workers/hybrid.weight_sync_address)
        self.store = bound_store(host, port, world_size, is_master=rank == 0, timeout=timeout)
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore("rltrain/weight_sync", self.store), rank, world_size,
                                        timeout)
        self.nccl = None  # trainer-side PyNcclCommunicator (rank 0, method "nccl")

    # ------------------------------------------------------------------ sender (rank 0)
    def init_nccl_sender(self, *, host: str, port: int, world_size: int) -> None:
        """Rank 0 of vLLM's NCCL weight-transfer group (the engines join with rank_offset >= 1, concurrently)."""
        self.nccl = nccl_trainer_init({"master_address": host, "master_port": port, "world_size": world_size})

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
        """Rank 0 sends `meta` (as JSON: names, dtype names and shapes are data; a receiver unpickles nothing), the
        others receive it."""
        if self.rank == 0:
            payload = torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8)
            length = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            length = torch.zeros(1, dtype=torch.int64)
        self.pg.broadcast(length, 0).wait()
        if self.rank != 0:
            payload = torch.empty(int(length.item()), dtype=torch.uint8)
        self.pg.broadcast(payload, 0).wait()
        return meta if self.rank == 0 else json.loads(payload.numpy().tobytes())

    def close(self) -> None:
        self.nccl = None
        self.pg = None
        self.store = None
