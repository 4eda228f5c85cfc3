"""Split weight sync over NCCL (cuda, vLLM): the bucket metadata over the gloo SyncGroup, the tensors by NCCL
broadcast inside vLLM's weight-transfer engine (train rank 0 is its rank 0; each engine's TP workers take ranks
after it). It must not decide the placement (base.sync_method does).
"""

from __future__ import annotations

from typing import Any

from rltrain.rollout.sync.gloo import GlooSync
from rltrain.rollout.sync.group import SyncGroup


class NcclSync(GlooSync):
    """Like GlooSync (group, metadata, sender's drain on TP peers), with the tensors over vLLM's NCCL channel."""

    method = "nccl"

    def __init__(self, engine, *, engine_tp: int = 1) -> None:
        super().__init__(engine)
        self.engine_tp = engine_tp

    def connect(self, *, host: str, port: int, nccl_port: int, rank: int, num_rollout_ranks: int,
                sender: bool) -> None:
        super().connect(host=host, port=port, nccl_port=nccl_port, rank=rank, num_rollout_ranks=num_rollout_ranks,
                        sender=sender)
        if self.group is None:
            return
        if sender:
            self.group.init_nccl_sender(host=host, port=nccl_port, world_size=1 + num_rollout_ranks)
        else:
            tp = self.engine_tp
            self.engine.init_weight_transfer(nccl_init_info(
                host=host, port=nccl_port, engine_index=rank // tp, num_engines=num_rollout_ranks // tp,
                engine_tp=tp))

    def receive(self) -> int:
        return receive_nccl(self.engine, self.group)


def receive_nccl(engine, group: SyncGroup) -> int:
    """Rollout side of one NCCL sync: each bucket's metadata from `group`, its tensors by vLLM's NCCL engine."""
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
