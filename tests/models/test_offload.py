"""Offload (models/megatron/offload.py) on the CPU, where a "device move" is a copy into another tensor: every
path runs and must give back exactly what it took. actor.optimizer_offload_fraction: the host share's AdamW steps
the same numbers as the device's; actor.offload_while_rollout: params and optimizer state leave (other storage)
and come back bit-identical, and training goes on as if nothing moved; ref.offload: the layer-streamed forward
gives the log-probs of the resident one."""

from __future__ import annotations

import pytest
import torch

from _megatron_ref import make_engine, ppo_batch, ppo_loss_with_entropy as _loss, random_batch, random_hf_model

V = 97


def _engine(hf, role="actor", **kw):
    eng = make_engine(hf.config, role=role, seed=0, lr=1e-3, max_tokens_per_micro_batch=24, **kw)
    eng.load_hf_weights(hf.state_dict())
    return eng


def _train(eng, hf, steps: int, seed: int):
    out = []
    for k in range(steps):
        batch, lens = ppo_batch(hf, V, [9, 5, 7, 1], seed=seed + k)
        out.append(eng.train_step(eng.make_micro_batches(batch, lens), _loss))
    return out


def _snapshot(eng) -> dict[str, torch.Tensor]:
    """Every tensor the engine keeps between steps: params, masters, AdamW's state (device and host share)."""
    snap = {f"param/{n}": p.detach().clone() for n, p in eng.model.named_parameters()}
    snap.update({f"master/{i}": m.detach().clone() for i, m in enumerate(eng.optim.masters)})
    for opt in (eng.optimizer, eng.optim.host.optimizer):
        for i, st in enumerate([] if opt is None else opt.state.values()):
            snap.update({f"state/{id(opt)}/{i}/{k}": v.clone() for k, v in st.items()})
    return snap


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_share_of_the_optimizer_steps_the_same_numbers(dtype):
    hf = random_hf_model(V, seed=int(torch.randint(0, 10**6, ())))
    seed = int(torch.randint(0, 10**6, ()))
    ref, off = _engine(hf, params_dtype=dtype), _engine(hf, params_dtype=dtype, optimizer_offload_fraction=0.5)
    host = off.optim.host
    assert host.index and host.optimizer is not None and 0.3 < host.fraction_taken <= 0.5
    assert _train(ref, hf, 3, seed) == _train(off, hf, 3, seed)
    for (n, a), b in zip(ref.model.named_parameters(), off.model.parameters()):
        assert torch.equal(a, b), n
    full = _engine(hf, params_dtype=dtype, optimizer_offload_fraction=1.0)  # everything on the host
    assert full.optimizer.param_groups[0]["params"] == [] and len(full.optim.host.index) == len(full.optim.masters)
    _train(full, hf, 1, seed)
    start = _engine(hf, params_dtype=dtype).model.parameters()
    assert any(not torch.equal(a, b) for a, b in zip(start, full.model.parameters()))  # it trained


@pytest.mark.parametrize("dtype,fraction", [(torch.float32, 0.0), (torch.bfloat16, 0.0), (torch.bfloat16, 0.4)])
def test_offload_while_rollout_round_trip_is_bit_identical(dtype, fraction):
    hf = random_hf_model(V, seed=int(torch.randint(0, 10**6, ())))
    seed = int(torch.randint(0, 10**6, ()))
    ref, eng = (_engine(hf, params_dtype=dtype, optimizer_offload_fraction=fraction) for _ in range(2))
    _train(ref, hf, 1, seed)
    _train(eng, hf, 1, seed)
    before = _snapshot(eng)
    ptrs = {n: p.data_ptr() for n, p in eng.model.named_parameters()}
    eng.offload(params=False)  # the optimizer's state first (the weight sync still reads the params)
    assert eng.state_offload.state_on_host and not eng.state_offload.params_on_host
    eng.offload()
    assert all(p.data_ptr() != ptrs[n] for n, p in eng.model.named_parameters())  # other storage now
    assert all(torch.equal(v, before[k]) for k, v in _snapshot(eng).items())
    exported = dict(eng.export_hf_weights())  # brings the params back, not the optimizer's state
    assert not eng.state_offload.params_on_host and eng.state_offload.state_on_host
    assert all(torch.equal(v, exported[k]) for k, v in ref.export_hf_weights())
    eng.offload()
    eng.onload()
    after = _snapshot(eng)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    eng.offload()  # the next step brings everything back by itself
    assert _train(ref, hf, 2, seed + 1) == _train(eng, hf, 2, seed + 1)
    for (n, a), b in zip(ref.model.named_parameters(), eng.model.parameters()):
        assert torch.equal(a, b), n


def test_reference_streamed_layer_by_layer_gives_the_resident_log_probs():
    hf = random_hf_model(V, seed=int(torch.randint(0, 10**6, ())), num_hidden_layers=3)
    ids, lens, mask = random_batch(V, [12, 1 + int(torch.randint(2, 11, ())), 5], seed=int(torch.randint(0, 10**6, ())))
    resident = _engine(hf, role="ref")
    streamed = _engine(hf, role="ref", offload_layers=True)
    layers = list(streamed.model.decoder.layers)
    host = {id(p): p.data_ptr() for layer in layers for p in layer.parameters()}
    lp0, ent0 = resident.forward_logprobs(ids, lens, mask)
    lp1, ent1 = streamed.forward_logprobs(ids, lens, mask)
    assert torch.equal(lp0, lp1) and torch.equal(ent0, ent1)
    n_forwards = len(streamed.make_micro_batches({"input_ids": ids, "label_mask": mask}, lens, forward_only=True))
    assert streamed.layer_streamer.copies == len(layers) * n_forwards  # each layer brought in once a forward
    assert all(p.data_ptr() == host[id(p)] for layer in layers for p in layer.parameters())  # back on the host
