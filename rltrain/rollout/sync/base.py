"""The one shape of a weight-sync transport (`WeightTransport`) and the rule that picks one per placement
(`sync_method`; the package's `build_weight_sync` builds it). It must not move bytes itself (local.py, gloo.py,
nccl.py do) nor import them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def sync_method(*, colocated: bool, device: str, engine: str, adapters_only: bool = False) -> str:
    """The weight path for a placement (see the package docstring). adapters_only (LoRA): a split placement sends the
    adapters over gloo (megabytes; vLLM's NCCL weight-transfer engine loads only base weights)."""
    if colocated:
        return "local"
    if device == "cuda" and engine == "vllm" and not adapters_only:
        return "nccl"
    return "gloo"


def transfer_backend(method: str) -> str | None:
    """The vLLM weight-transfer backend an engine must be built with for `method` (None: in-place reload)."""
    return "nccl" if method == "nccl" else None


class WeightTransport:
    """One worker's end of the weight path. `method`: "local" | "gloo" | "nccl". A train-side end exports and sends;
    a rollout-side end receives into its engine; a colocated end does both in one call (send)."""

    method = ""

    def connect(self, *, host: str, port: int, nccl_port: int, rank: int, num_rollout_ranks: int,
                sender: bool) -> None:
        """Split placement: join the weight-sync group (train rank 0 sends; rollout ranks receive; other train ranks
        only take part in the export's collectives). `rank`: this worker's rank in its own group."""

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Any:
        """Stream the actor's (HF name, tensor) pairs, bucket by bucket, to the rollout side (colocated: into the
        engine of this process); every train rank iterates the stream (the export's gathers are collective)."""
        raise NotImplementedError

    def receive(self) -> int:
        """Rollout side of a split sync: load what the train side sends into the engine; returns tensors loaded."""
        raise NotImplementedError
