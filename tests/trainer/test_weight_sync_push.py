"""trainer/weight_sync.WeightSync: the driver's one push, on recording fake groups. Colocated: wake every engine, then
each worker streams its export in process. Split: the first push builds the weight-sync group (train rank 0's address,
both groups joining at once), every push then sends and receives together; the handshake happens once."""

from rltrain.trainer import weight_sync as ws


class FakeGroup:
    def __init__(self, name, world_size=2):
        self.name, self.world_size, self.calls = name, world_size, []

    def run(self, method, *args):
        self.calls.append((method, args))
        return [None] * self.world_size

    def run_rank0(self, method, *args):
        self.calls.append((method, args))
        return "10.0.0.1", 29500, 29501


def test_colocated_push_wakes_the_engines_then_streams_in_process():
    group = FakeGroup("both")
    metrics = {}
    ws.WeightSync(group, group, bucket_bytes=1 << 20).push(metrics)
    assert group.calls == [("rollout_wake_up", ()), ("weight_sync_send", (1 << 20,))]
    assert "timing_s/rollout_wake" in metrics


def test_colocated_push_logs_the_slowest_ranks_parts_of_the_wake_up():
    """Each worker times its wake-up's two parts (releasing the update's cached blocks, the engine's own wake-up);
    the driver logs the slowest rank's of each beside the whole."""
    class Timed(FakeGroup):
        def run(self, method, *args):
            super().run(method, *args)
            if method != "rollout_wake_up":
                return [None] * self.world_size
            return [{"empty_cache": 0.25, "engine": 0.5}, {"empty_cache": 0.5, "engine": 0.125}]

    metrics = {}
    group = Timed("both")
    ws.WeightSync(group, group, bucket_bytes=1 << 20).push(metrics)
    assert metrics["timing_s/rollout_wake_empty_cache"] == 0.5
    assert metrics["timing_s/rollout_wake_engine"] == 0.5


def test_colocated_push_of_an_engine_kept_awake_only_streams():
    """rollout.free_cache_engine=false: the engine never slept, so the push reloads in place without a wake-up (and
    logs no timing_s/rollout_wake)."""
    group = FakeGroup("both")
    metrics = {}
    ws.WeightSync(group, group, bucket_bytes=1 << 20, wake_up=False).push(metrics)
    assert group.calls == [("weight_sync_send", (1 << 20,))]
    assert metrics == {}


def test_split_push_connects_once_then_sends_and_receives_together(monkeypatch):
    together = []
    monkeypatch.setattr(ws, "run_together", lambda *calls: together.append([(g.name, m, a) for g, m, a in calls]))
    train, rollout = FakeGroup("train"), FakeGroup("rollout", world_size=3)
    sync = ws.WeightSync(train, rollout, bucket_bytes=64)
    sync.push()
    sync.push({})
    assert train.calls == [("weight_sync_address", ())] and rollout.calls == []
    connect = ("10.0.0.1", 29500, 29501, 3)
    assert together == [
        [("train", "weight_sync_connect", connect), ("rollout", "weight_sync_connect", connect)],
        [("train", "weight_sync_send", (64,)), ("rollout", "weight_sync_receive", ())],
        [("train", "weight_sync_send", (64,)), ("rollout", "weight_sync_receive", ())]]
