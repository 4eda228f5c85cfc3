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

Every transport has one shape (`WeightSync`), held by the worker that built it (workers/hybrid.py):
`connect(...)` once for a split placement (the weight-sync group of group.py's SyncGroup; a no-op colocated),
then per update `send(named_tensors, bucket_bytes)` on the train ranks and `receive()` on the rollout ranks (a
colocated worker only sends: its engine is in the same process). The driver asks for one push
(trainer/weight_sync.py) and never sees the handshake.
"""

from __future__ import annotations

from rltrain.rollout.sync.base import WeightSync, build_weight_sync, sync_method, transfer_backend
from rltrain.rollout.sync.group import SyncGroup, buckets

SYNC_METHODS = ("local", "gloo", "nccl")

__all__ = ["SYNC_METHODS", "SyncGroup", "WeightSync", "buckets", "build_weight_sync", "sync_method",
           "transfer_backend"]
