"""Experts written straight into vLLM's fused tensors (rollout/vllm_experts.py), on CPU tensors: the writer's result is
what vLLM's per-expert loader puts there (a reference written another way: each expert's gate, up and down copied
into its slice, this TP rank's rows or columns), for TP 1 and the second of two TP ranks, whatever order the tensors
come in; the switch checks the layout at the first sync, writes directly only after the syncs it is told to wait, and
stays on vLLM's loader when the layout differs."""

from __future__ import annotations

import random

import pytest
import torch

from rltrain.rollout.vllm_experts import ExpertFastPath, ExpertWriter

E, H, I = 5, 8, 6  # experts, hidden, expert width (awkward sizes)
LAYERS = ("model.layers.0.mlp.experts", "model.layers.3.mlp.experts")


def _checkpoint(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = [("model.layers.0.self_attn.q_proj.weight", torch.randn(H, H, generator=g))]
    for layer in LAYERS:
        for j in range(E):
            out += [(f"{layer}.{j}.gate_proj.weight", torch.randn(I, H, generator=g)),
                    (f"{layer}.{j}.up_proj.weight", torch.randn(I, H, generator=g)),
                    (f"{layer}.{j}.down_proj.weight", torch.randn(H, I, generator=g))]
    return out


def _targets(tp: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {layer: (torch.zeros(E, 2 * I // tp, H), torch.zeros(E, H, I // tp)) for layer in LAYERS}


def _vllm_loader(targets, named, rank: int, tp: int) -> None:
    """What vLLM's FusedMoE loader does per tensor: gate (w1) into the first half of w13, up (w3) into the second,
    this rank's rows; down (w2) this rank's columns."""
    n = I // tp
    for name, t in named:
        for layer, (w13, w2) in targets.items():
            if name.startswith(layer + "."):
                j, proj = int(name.split(".")[-3]), name.split(".")[-2]
                if proj == "gate_proj":
                    w13[j, :n].copy_(t[rank * n:(rank + 1) * n])
                elif proj == "up_proj":
                    w13[j, n:].copy_(t[rank * n:(rank + 1) * n])
                else:
                    w2[j].copy_(t[:, rank * n:(rank + 1) * n])


@pytest.mark.parametrize("rank,tp", [(0, 1), (1, 2)])
def test_writer_fills_the_fused_tensors_as_vllms_loader_does(rank, tp):
    named = _checkpoint(int(torch.randint(0, 10**6, ())))
    random.Random(0).shuffle(named)  # any order: a layer is written once all its tensors came
    ref, got = _targets(tp), _targets(tp)
    _vllm_loader(ref, named, rank, tp)
    writer = ExpertWriter(got, rank, tp)
    taken = [n for n, t in named if writer.offer(n, t)]
    assert len(taken) == 2 * 3 * E and writer.finish() == []
    for layer in LAYERS:
        assert torch.equal(got[layer][0], ref[layer][0]) and torch.equal(got[layer][1], ref[layer][1])


def test_switch_checks_the_layout_then_writes_directly_after_the_syncs_it_waits():
    fast = ExpertFastPath(E, after=2)
    vllm_side = _targets(1)
    for sync in range(1, 5):
        named = _checkpoint(sync)
        direct = fast.begin(vllm_side, 0, 1)
        passed = list(fast.split(named))
        _vllm_loader(vllm_side, passed, 0, 1)  # vLLM loads what it is given
        assert fast.check_after_reload == (sync == 3)  # the first direct sync checks its writes reached the engine
        assert fast.after_reload(vllm_side if fast.check_after_reload else None) is None or sync == 1
        assert direct == (sync >= 3) and fast.state == ("on" if sync >= 3 else "checked")
        assert len(passed) == (1 if direct else len(named))  # direct: the experts never reach vLLM's loader
        ref = _targets(1)
        _vllm_loader(ref, named, 0, 1)
        assert all(torch.equal(vllm_side[k][0], ref[k][0]) and torch.equal(vllm_side[k][1], ref[k][1]) for k in ref)


def test_switch_stays_on_vllms_loader_when_its_layout_differs():
    fast = ExpertFastPath(E, after=1)
    vllm_side = _targets(1)
    named = _checkpoint(7)
    fast.begin(vllm_side, 0, 1)
    passed = list(fast.split(named))
    _vllm_loader(vllm_side, passed, 0, 1)
    w13 = vllm_side[LAYERS[0]][0]
    w13.copy_(torch.cat([w13[:, I:], w13[:, :I]], dim=1))  # a vLLM that keeps [up; gate]
    assert "laid the experts out otherwise" in fast.after_reload() and fast.state == "off"
    assert not fast.begin(vllm_side, 0, 1) and len(list(fast.split(named))) == len(named)
    never = ExpertFastPath(E, after=-1)
    assert not never.begin(vllm_side, 0, 1) and never.state == "off"


def test_direct_writes_that_do_not_reach_the_engine_go_back_to_vllms_loader():
    # a vLLM whose reload puts back copies of its tensors taken before the sync: the writes land in storage it no
    # longer reads; the first direct sync finds its writes missing and the next one goes through vLLM's loader
    fast = ExpertFastPath(E, after=1)
    vllm_side = _targets(1)
    for sync in (1, 2):
        fast.begin(vllm_side, 0, 1)
        _vllm_loader(vllm_side, list(fast.split(_checkpoint(sync))), 0, 1)
        now = {k: (a.clone(), b.clone()) for k, (a, b) in vllm_side.items()}  # what the engine holds after it
        line = fast.after_reload(now if sync == 2 else None)
    assert fast.state == "on" and line is None  # reached: stays on
    fast.begin(vllm_side, 0, 1)  # sync 3 is not the first direct one: nothing to check
    list(fast.split(_checkpoint(3)))
    assert not fast.check_after_reload and fast.after_reload(None) is None
    fast = ExpertFastPath(E, after=1)
    vllm_side = _targets(1)
    fast.begin(vllm_side, 0, 1)
    _vllm_loader(vllm_side, list(fast.split(_checkpoint(1))), 0, 1)
    fast.after_reload()
    stale = {k: (a.clone(), b.clone()) for k, (a, b) in vllm_side.items()}  # what the engine reads after sync 2
    assert fast.begin(vllm_side, 0, 1) and fast.check_after_reload
    named = _checkpoint(2)
    assert len(list(fast.split(named))) == 1
    line = fast.after_reload(stale)
    assert "did not reach vLLM's tensors" in line and fast.state == "off"
    assert not fast.begin(vllm_side, 0, 1) and len(list(fast.split(named))) == len(named)
