"""rollout/sync/: the transport chosen once per placement, and the gloo transport end to end in one process (a train
rank that exports and sends, its TP peer that only iterates the export, a rollout rank that loads the stream lazily),
checked tensor by tensor against what was sent. The vLLM ends (NCCL, CUDA IPC) run on GPUs only (docs/vllm.md)."""

from __future__ import annotations

import threading

import pytest
import torch

from rltrain.rollout.sync import build_weight_sync, sync_method, transfer_backend
from rltrain.rollout.sync.gloo import GlooSync
from rltrain.rollout.sync.local import LocalSync
from rltrain.rollout.sync.nccl import NcclSync, nccl_init_info
from rltrain.workers.base import free_port


class RecordingEngine:
    """update_weights consumes the stream lazily and keeps copies of what it got."""

    def __init__(self):
        self.got: list[tuple[str, torch.Tensor]] = []

    def update_weights(self, named):
        for name, t in named:
            self.got.append((name, t.clone()))
        return len(self.got)


def test_each_placement_gets_one_transport():
    for colocated, device, engine, method, cls in [(True, "cuda", "vllm", "local", LocalSync),
                                                   (True, "cpu", "hf", "local", LocalSync),
                                                   (False, "cuda", "vllm", "nccl", NcclSync),
                                                   (False, "cpu", "vllm", "gloo", GlooSync),
                                                   (False, "cuda", "hf", "gloo", GlooSync)]:
        got = sync_method(colocated=colocated, device=device, engine=engine)
        assert got == method
        sync = build_weight_sync(got, engine=None, engine_tp=2)
        assert type(sync) is cls and sync.method == method
    assert transfer_backend("nccl") == "nccl" and transfer_backend("gloo") is None and transfer_backend("local") is None
    assert build_weight_sync("nccl", engine_tp=2).engine_tp == 2
    with pytest.raises(ValueError, match="unknown weight-sync method 'disk'"):
        build_weight_sync("disk")
    # engine e of E with TP t: its workers take ranks 1 + e*t .. after the trainer's rank 0
    assert nccl_init_info(host="h", port=5, engine_index=1, num_engines=2, engine_tp=2) == {
        "master_address": "h", "master_port": 5, "rank_offset": 3, "world_size": 5}


def test_local_sync_streams_the_export_into_the_engine_of_this_process():
    engine = RecordingEngine()
    weights = [("a", torch.arange(3.0)), ("b", torch.ones(2, 2))]
    assert LocalSync(engine).send(iter(weights), bucket_bytes=1) == 2
    assert [n for n, _ in engine.got] == ["a", "b"] and torch.equal(engine.got[1][1], torch.ones(2, 2))


def test_gloo_sync_streams_train_rank0s_export_to_the_rollout_rank_and_the_tp_peer_only_iterates():
    g = torch.Generator().manual_seed(0)
    weights = [(f"layer{i}.weight", torch.randn(5, 7, generator=g)) for i in range(4)]
    weights.append(("embed", torch.randn(40, 3, generator=g).to(torch.bfloat16)))
    host, port = "127.0.0.1", free_port()
    engine = RecordingEngine()
    train0, train1, rollout0 = GlooSync(None), GlooSync(None), GlooSync(engine)
    results: dict[str, object] = {}

    def run(name, fn):
        try:
            results[name] = fn()
        except BaseException as err:  # surfaced below
            results[name] = err

    def connect(sync, rank, sender):
        sync.connect(host=host, port=port, nccl_port=0, rank=rank, num_rollout_ranks=1, sender=sender)

    threads = [threading.Thread(target=run, args=("c0", lambda: connect(train0, 0, True))),
               threading.Thread(target=run, args=("cr", lambda: connect(rollout0, 0, False)))]
    for t in threads:
        t.start()
    connect(train1, 1, True)  # a TP peer of train rank 0: no group
    for t in threads:
        t.join(timeout=60)
    assert train1.group is None and train0.group.rank == 0 and rollout0.group.rank == 1
    taken = []

    def export():
        for item in weights:
            taken.append(item[0])
            yield item

    send = threading.Thread(target=run, args=("send", lambda: train0.send(export(), bucket_bytes=300)))
    send.start()
    received = rollout0.receive()
    send.join(timeout=60)
    assert received == len(weights)
    assert results["send"] == (len(weights), sum(t.numel() * t.element_size() for _, t in weights))
    assert [n for n, _ in engine.got] == [n for n, _ in weights]
    for (_, a), (_, b) in zip(engine.got, weights):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert train1.send(iter(weights), bucket_bytes=300) == (len(weights), 0)  # iterated, nothing sent
