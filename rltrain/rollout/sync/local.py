"""Colocated weight sync: the actor's export streams straight into the rollout engine of the same process (hf:
copy_; vLLM in process: in-place reload from the device tensors; an engine pool: CUDA IPC, ipc.py). No group,
no handshake; it must not touch another process.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from rltrain.rollout.sync.base import WeightTransport


class LocalSync(WeightTransport):
    method = "local"

    def __init__(self, engine) -> None:
        self.engine = engine

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> int:
        return self.engine.update_weights(named_tensors)
