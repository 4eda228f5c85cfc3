"""Which saved files a rank resumes from (workers/hybrid.py read_rank_state): its own when the checkpoint has this
run's layout; at another data-parallel size, a file of its TP/PP/EP coordinates for the model and RNG, and every file
of its TP/PP coordinates for the optimizer pieces; another TP, PP or EP size is a user error naming the keys."""

from __future__ import annotations

import pytest
import torch

from rltrain.utils.errors import UserError
from rltrain.workers.hybrid import read_rank_state


def _layout(dp, dp_size, ep=0, ep_size=1, tp=0, tp_size=1):
    return {"tp": tp, "pp": 0, "dp": dp, "ep": ep, "tp_size": tp_size, "pp_size": 1, "dp_size": dp_size,
            "ep_size": ep_size}


def _write(path, layouts):
    for rank, layout in enumerate(layouts):
        torch.save({"layout": layout, "rank": rank}, path / f"worker_rank{rank}.pt")


def test_own_file_when_the_layout_is_this_runs(tmp_path):
    _write(tmp_path, [_layout(0, 2), _layout(1, 2)])
    sd, others = read_rank_state(str(tmp_path), 1, _layout(1, 2))
    assert sd["rank"] == 1 and others == []


def test_another_data_parallel_size_reads_every_file_of_the_same_model_parallel_coordinates(tmp_path):
    # written at DP=4 with EP=2 (ranks 0, 2: expert rank 0; 1, 3: expert rank 1); resumed at DP=2, EP=2
    _write(tmp_path, [_layout(d, 4, ep=d % 2, ep_size=2) for d in range(4)])
    sd, others = read_rank_state(str(tmp_path), 1, _layout(1, 2, ep=1, ep_size=2))
    assert sd["rank"] == 1 and sorted(o["rank"] for o in others) == [0, 1, 2, 3]
    sd, others = read_rank_state(str(tmp_path), 0, _layout(0, 1, ep=0, ep_size=2))  # rank 0: its own is DP=4's
    assert sd["layout"]["ep"] == 0 and len(others) == 4
    # written at DP=1 x TP=2, resumed at DP=2 x TP=2: a rank takes the files of its TP rank only
    _write(tmp_path, [_layout(0, 1, tp=t, tp_size=2) for t in range(2)])
    for f in ("worker_rank2.pt", "worker_rank3.pt"):
        (tmp_path / f).unlink()
    sd, others = read_rank_state(str(tmp_path), 3, _layout(1, 2, tp=1, tp_size=2))
    assert sd["rank"] == 1 and [o["rank"] for o in others] == [1]


def test_another_tensor_parallel_size_is_refused_by_key(tmp_path):
    _write(tmp_path, [_layout(0, 2), _layout(1, 2)])
    with pytest.raises(UserError, match="actor.tensor_parallel_size"):
        read_rank_state(str(tmp_path), 0, _layout(0, 1, tp=0, tp_size=2))
