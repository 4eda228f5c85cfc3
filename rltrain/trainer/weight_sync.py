"""The driver's one call that moves the actor's weights to the rollout engines: `WeightSync.push()`, whatever the
placement. It must not move bytes or pick a transport: each worker built its end once (rltrain/rollout/sync/).

Colocated (one group): every worker wakes its rollout engine (timed as `timing_s/rollout_wake`; not with
rollout.free_cache_engine=false, where the engine never slept: `wake_up=False`) and streams its actor's export into
it in process. Split (a train and a rollout group): the first push builds the weight-sync group
(train rank 0 names the address; both groups join at once), then each push streams train rank 0's export while
the rollout ranks receive it (both groups called together).
"""

from __future__ import annotations

from rltrain.utils.timing import timer
from rltrain.workers.group import run_together


class WeightSync:
    def __init__(self, train_group, rollout_group, *, bucket_bytes: int, wake_up: bool = True) -> None:
        self.train_group, self.rollout_group, self.bucket_bytes = train_group, rollout_group, bucket_bytes
        self.wake_up = wake_up  # colocated: the engine slept through the training phases (rollout.free_cache_engine)
        self.colocated = rollout_group is train_group
        self._connected = False  # split: the weight-sync group is built at the first push

    def push(self, metrics: dict | None = None, *, version: int | None = None) -> None:
        """Actor weights -> rollout engines. `metrics` gets `timing_s/rollout_wake` (colocated, when the engine
        slept). version: the policy version of the weights, told to split rollout workers (rollout.partial stamps
        tokens with it; a partial generation in flight pauses between two chunks while they load)."""
        if self.colocated:
            if self.wake_up:
                m = {} if metrics is None else metrics
                with timer("rollout_wake", m):
                    parts = [p for p in self.train_group.run("rollout_wake_up") if p]
                if parts:
                    for key in ("empty_cache", "engine"):  # its two parts, the slowest rank's
                        m[f"timing_s/rollout_wake_{key}"] = max(p[key] for p in parts)
            self.train_group.run("weight_sync_send", self.bucket_bytes)
            return
        if not self._connected:
            self._connect()
        run_together((self.train_group, "weight_sync_send", (self.bucket_bytes,)),
                     (self.rollout_group, "weight_sync_receive", () if version is None else (version,)))

    def _connect(self) -> None:
        host, port, nccl_port = self.train_group.run_rank0("weight_sync_address")
        ranks = self.rollout_group.world_size
        run_together((self.train_group, "weight_sync_connect", (host, port, nccl_port, ranks)),
                     (self.rollout_group, "weight_sync_connect", (host, port, nccl_port, ranks)))
        self._connected = True
