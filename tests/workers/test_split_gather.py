"""workers/group.py's data-parallel slicing (run_split) and gathering (gather_rows), without Ray: against the batch's
own rows and pad_to_multiple's dummies, for awkward sizes (one row, rows not a multiple of the ranks); the slicing's
record, and the driver's GIL hand-off and torch threads (init_ray)."""

import time

import pytest
import torch

from rltrain.data.batch import Batch
from rltrain.workers.group import WorkerGroup, gather_rows
from rltrain.workers.placement import replica_dispatch


def _batch(rows: int, p: int = 3, r: int = 5) -> Batch:
    return Batch(prompt_ids=torch.randint(0, 100, (rows, p)), prompt_mask=torch.ones(rows, p, dtype=torch.long),
                 response_ids=torch.randint(0, 100, (rows, r)), response_mask=torch.ones(rows, r, dtype=torch.long),
                 loss_mask=torch.ones(rows, r, dtype=torch.long), scores=torch.randn(rows),
                 non_tensor={"ground_truth": [str(i) for i in range(rows)]})


def _group(dp: int) -> WorkerGroup:
    g = WorkerGroup.__new__(WorkerGroup)  # no Ray: the dispatch hands back what each data-parallel rank would get
    g.train = replica_dispatch(dp, 1)  # dp data-parallel ranks of one worker each
    g._dispatch = lambda d, method, per_dp_args, kwargs, slicing=None: [args for args in per_dp_args]
    return g


@pytest.mark.parametrize("rows,dp", [(1, 1), (7, 1), (7, 2), (8, 4), (5, 4), (1, 3)])
def test_shards_cover_the_rows_in_order_and_gather_drops_the_dummies(rows, dp):
    b = _batch(rows)
    shards = [args[0] for args in _group(dp).run_split("compute_ref_logprobs", b, 1.0)]
    assert len(shards) == dp and len({len(s) for s in shards}) == 1  # equal shards, one per data-parallel rank
    assert all(args[1] == 1.0 for args in _group(dp).run_split("m", b, 1.0))
    ids = torch.cat([s.response_ids for s in shards])
    assert torch.equal(ids[:rows], b.response_ids)
    dummies = torch.cat([s.dummy_mask for s in shards])
    assert not dummies[:rows].any() and dummies[rows:].all()
    # each rank answers per row (a tensor, a tuple with a None): gathered, the batch's rows only, in order
    per_rank = [(s.response_ids.float() * 2, None) for s in shards]
    lp, ent = gather_rows(per_rank, b)
    assert ent is None and torch.equal(lp, b.response_ids.float() * 2)
    assert torch.equal(gather_rows([s.scores for s in shards], b), b.scores)


def test_run_split_notes_its_slicing_wall_start_and_cpu():
    g = _group(2)
    seen = []
    g._dispatch = lambda d, method, per_dp_args, kwargs, slicing=None: seen.append(slicing) or per_dp_args
    before = time.time()
    g.run_split("compute_ref_logprobs", _batch(7), 1.0)
    began, cpu_s = seen[0]
    assert before <= began <= time.time() and 0.0 <= cpu_s <= time.time() - began + 1e-3


def test_init_ray_shortens_the_drivers_gil_hand_off_and_keeps_a_shorter_one(monkeypatch):
    import sys

    from rltrain.workers import group

    monkeypatch.setattr(group, "ray_initialized", lambda: True)  # connected already: nothing else to do
    before, threads = sys.getswitchinterval(), torch.get_num_threads()
    try:
        sys.setswitchinterval(5e-3)  # Python's default
        group.init_ray(None)
        assert sys.getswitchinterval() == pytest.approx(group.DRIVER_SWITCH_INTERVAL_S, rel=0.05)
        sys.setswitchinterval(1e-4)  # a driver that set its own, shorter one keeps it
        group.init_ray(None)
        assert sys.getswitchinterval() == pytest.approx(1e-4, rel=0.05)  # Python keeps it in whole microseconds
    finally:
        sys.setswitchinterval(before)
        torch.set_num_threads(threads)


def test_init_ray_gives_the_driver_one_torch_thread_and_keeps_fewer(monkeypatch):
    from rltrain.workers import group

    monkeypatch.setattr(group, "ray_initialized", lambda: True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)  # torch's default is a thread per core
        group.init_ray(None)
        assert torch.get_num_threads() == group.DRIVER_TORCH_THREADS == 1
        monkeypatch.setattr(group, "DRIVER_TORCH_THREADS", 4)
        torch.set_num_threads(2)  # a driver that set fewer keeps them
        group.init_ray(None)
        assert torch.get_num_threads() == 2
        torch.set_num_threads(6)
        group.init_ray(None)
        assert torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(threads)
