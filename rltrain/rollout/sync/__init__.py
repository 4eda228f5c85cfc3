"""Weight sync: how the actor's weights reach the rollout engines, chosen once per placement; one file per transport.
Streams HF-named full tensors bucket by bucket (never a second full copy of the model); no Ray, no training math.

    method   placement                               transport (file)                        who moves the bytes
    "local"  colocated (any device/engine)           LocalSync (local.py):                    in process: hf copy_, vLLM
             (vLLM TP>1 colocated runs one vLLM        engine.update_weights(actor export)    in-place reload from the
             worker per trainer rank via                                                       device tensors (no host
             external_launcher, so every rank                                                  trip)
             reloads its own shard in process)
    "nccl"   split, cuda, vllm                       NcclSync (nccl.py): vLLM's NCCL          NCCL broadcast GPU -> GPUs
                                                       weight-transfer engine
    "gloo"   split, cpu (either engine);             GlooSync (gloo.py): gloo broadcast,      gloo (host memory, one
             split, cuda, hf                           then the engine's update_weights        bucket at a time)
    Colocated vLLM engines in their own processes (rollout.engines_per_gpu > 1) take the "local" stream through
    ipc.send_ipc_buckets: each bucket's CUDA-IPC handles to every engine (vLLM's IPC weight-transfer engine).

Every transport has one shape (`WeightTransport`, base.py), built here (`build_weight_sync`) and held by the worker that built it (workers/hybrid.py):
`connect(...)` once for a split placement (the weight-sync group of group.py's SyncGroup; a no-op colocated),
then per update `send(named_tensors, bucket_bytes)` on the train ranks and `receive()` on the rollout ranks (a
colocated worker only sends: its engine is in the same process). The driver asks for one push
(trainer/weight_sync.py) and never sees the handshake.
"""

from __future__ import annotations

from rltrain.rollout.sync.base import WeightTransport, sync_method, transfer_backend
from rltrain.rollout.sync.group import SyncGroup, buckets

SYNC_METHODS = ("local", "gloo", "nccl")

__all__ = ["SYNC_METHODS", "SyncGroup", "WeightTransport", "buckets", "build_weight_sync", "sync_method",
           "transfer_backend"]


def build_weight_sync(method: str, *, engine=None, engine_tp: int = 1) -> WeightTransport:
    """The transport of `method` for one worker. engine: this worker's rollout engine (None on a train-only
    worker); engine_tp: ranks per rollout engine (NCCL init)."""
    if method == "local":
        from rltrain.rollout.sync.local import LocalSync

        return LocalSync(engine)
    if method == "gloo":
        from rltrain.rollout.sync.gloo import GlooSync

        return GlooSync(engine)
    if method == "nccl":
        from rltrain.rollout.sync.nccl import NcclSync

        return NcclSync(engine, engine_tp=engine_tp)
    raise ValueError(f"unknown weight-sync method {method!r}; expected local, gloo or nccl")

