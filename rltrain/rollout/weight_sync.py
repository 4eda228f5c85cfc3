"""The old home of weight sync, kept for workers/hybrid.py and workers/rollout.py until they use rltrain/rollout/sync/
(issue #32: core-B rewires them after core-A's phase 1). It must not gain code: everything lives in rollout/sync/.
"""

from __future__ import annotations

from rltrain.rollout.sync import SYNC_METHODS, SyncGroup, buckets, sync_method, transfer_backend  # noqa: F401
from rltrain.rollout.sync.ipc import on_every, send_ipc_buckets  # noqa: F401
from rltrain.rollout.sync.nccl import nccl_init_info, receive_nccl


def receive_into(engine, group: SyncGroup, method: str) -> int:
    """Rollout side of one split sync: load the stream from `group` into `engine`; returns tensors loaded."""
    if method == "gloo":
        return engine.update_weights(group.receive())
    assert method == "nccl", method
    return receive_nccl(engine, group)


__all__ = ["SYNC_METHODS", "SyncGroup", "buckets", "nccl_init_info", "on_every", "receive_into",
           "send_ipc_buckets", "sync_method", "transfer_backend"]
