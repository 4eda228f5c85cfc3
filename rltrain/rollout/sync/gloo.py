"""Split weight sync over gloo (CPU either engine; CUDA with the hf engine): train rank 0 broadcasts each bucket's
metadata and tensors over the SyncGroup (group.py), each rollout rank loads the stream lazily with its engine's
update_weights. It must not decide the placement (base.sync_method does).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from rltrain.rollout.sync.base import WeightTransport
from rltrain.rollout.sync.group import SyncGroup


class GlooSync(WeightTransport):
    method = "gloo"

    def __init__(self, engine) -> None:
        self.engine = engine  # None on a train rank
        self.group: SyncGroup | None = None

    def connect(self, *, host: str, port: int, nccl_port: int, rank: int, num_rollout_ranks: int,
                sender: bool) -> None:
        self.group = None
        if sender and rank != 0:
            return  # a TP peer of the exporting rank: it only iterates the export (collective gathers)
        self.group = SyncGroup(host=host, port=port, rank=0 if sender else 1 + rank, world_size=1 + num_rollout_ranks)

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> tuple[int, int]:
        """(tensors, bytes) sent; a train rank other than 0 iterates the export and sends nothing."""
        if self.group is None:
            return sum(1 for _ in named_tensors), 0  # TP peers: the export's gathers are collective
        return self.group.send(named_tensors, bucket_bytes)

    def receive(self) -> int:
        return self.engine.update_weights(self.group.receive())
