"""Data-parallel gradient averaging (models/megatron/grad_reduce.py): two gloo ranks at DP=2 each take two
train steps on their own micro-batches; their grads must equal the grads of one process that accumulates every
rank's micro-batches with half the loss scale (no collective at all), with buckets started from grad hooks
during the backward, with one bucket per step, without overlap, and never armed (the pipeline-parallel path:
only finish() runs, so it must start over by itself each step)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from _megatron_ref import (hf_logprobs, join_gloo_world, make_engine, ppo_loss_with_entropy as _ppo_loss, random_batch,
                           random_hf_model, spawn_gloo_ranks)

V = 211
SETTINGS = {  # name -> (grad_reduce_bucket_mb, overlap_grad_reduce)
    "small_buckets_overlap": (0.002, True),  # ~2 KB: nearly one bucket per tensor, most started by hooks
    "one_bucket_overlap": (1024.0, True),
    "no_overlap": (0.05, False),
    "never_armed": (0.05, True),  # as under pipeline parallelism: only finish() runs, step after step
}


def _rank_batch(hf, rank: int):
    """Rank `rank`'s rows (lengths differ per rank) with PPO inputs; the same on any process."""
    ids, lens, mask = random_batch(V, [[9, 6, 3], [11, 4, 7, 2]][rank], seed=100 + rank)
    with torch.no_grad():
        ref_lp, _ = hf_logprobs(hf, ids, mask)
    g = torch.Generator().manual_seed(7 + rank)
    batch = {"input_ids": ids, "label_mask": mask,
             "old_logprobs": (ref_lp.float() + 0.3 * torch.randn(ids.shape, generator=g)) * mask,
             "advantages": torch.randn(ids.shape, generator=g) * mask}
    return batch, lens


def _micro_batches(eng, batch, lens, share: float):
    mbs = eng.make_micro_batches(batch, lens)
    total = float(batch["label_mask"][:, 1:].sum())
    for mb in mbs:
        mb.loss_scale = share * float(mb.label_mask[:, 1:].sum()) / total
    return mbs


def _step_grads(eng, mbs):
    """One train step; the grads as the optimizer sees them (after the data-parallel average)."""
    seen = {}
    clip = eng._clip

    def capture(params, norm):
        seen["grads"] = [None if p.grad is None else p.grad.detach().clone() for p in params]
        return clip(params, norm)

    eng._clip = capture
    metrics = eng.train_step(mbs, _ppo_loss)
    eng._clip = clip
    return seen["grads"], metrics


def _engine(hf, **kw):

    eng = make_engine(hf.config, seed=0, lr=1e-3, weight_decay=0.0, grad_clip=1e9,
                         max_tokens_per_micro_batch=16, **kw)
    eng.load_hf_weights(hf.state_dict())
    return eng


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    join_gloo_world(rank, world, port)
    hf = random_hf_model(V, seed=23)
    res = {}
    for name, (bucket_mb, overlap) in SETTINGS.items():
        eng = _engine(hf, grad_reduce_bucket_mb=bucket_mb, overlap_grad_reduce=overlap)
        batch, lens = _rank_batch(hf, rank)
        mbs = _micro_batches(eng, batch, lens, share=1.0)
        if name == "never_armed":
            eng._dp_reducer.arm = lambda: None
        for step in range(2):  # the second step checks that the reducer starts over
            grads, metrics = _step_grads(eng, mbs)
            torch.save(grads, os.path.join(out_dir, f"{name}_rank{rank}_step{step}.pt"))
        red = eng._dp_reducer
        res[name] = {"n_micro_batches": len(mbs), "buckets": len(red.buckets),
                     "launched_by_hooks": red.launched_by_hooks, "grad_norm": metrics["grad_norm"],
                     "params_after": float(sum(p.double().sum() for p in eng.model.parameters()))}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


def test_dp2_grads_equal_one_process_accumulating_both_ranks_batches(tmp_path):
    spawn_gloo_ranks(_worker, 2, tmp_path)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]

    # reference: this process (data parallel 1) accumulates both ranks' micro-batches, each at half its scale
    hf = random_hf_model(V, seed=23)
    eng = _engine(hf)
    assert eng._dp_reducer is None
    mbs = []
    for r in range(2):
        batch, lens = _rank_batch(hf, r)
        mbs += _micro_batches(eng, batch, lens, share=0.5)
    refs = [_step_grads(eng, mbs) for _ in range(2)]
    ref_metrics = refs[-1][1]

    for name in SETTINGS:
        for step, (ref, _) in enumerate(refs):
            scale = max(float(g.abs().max()) for g in ref if g is not None)
            for r in range(2):
                got = torch.load(tmp_path / f"{name}_rank{r}_step{step}.pt")
                assert len(got) == len(ref)
                for i, (a, b) in enumerate(zip(got, ref)):
                    assert (a is None) == (b is None), (name, step, r, i)
                    if a is not None:
                        torch.testing.assert_close(a, b, atol=1e-6 * scale, rtol=1e-5,
                                                   msg=f"{name} step {step} rank {r} param {i}")
        res0, res1 = results[0][name], results[1][name]
        assert res0["n_micro_batches"] >= 2 and res1["n_micro_batches"] >= 2  # the hooks count the last one only
        assert res0["grad_norm"] == pytest.approx(ref_metrics["grad_norm"], rel=1e-5)
        assert res0["params_after"] == res1["params_after"]  # both ranks took the same optimizer step
    small, one, none, never = (results[0][k] for k in SETTINGS)
    assert small["buckets"] > 10 and small["launched_by_hooks"] == small["buckets"]  # all started in the backward
    assert one["buckets"] == 1 and one["launched_by_hooks"] == 1
    assert none["buckets"] > 1 and none["launched_by_hooks"] == 0
    assert never["launched_by_hooks"] == 0


def test_buckets_go_in_reverse_order_split_by_size_and_dtype():
    from rltrain.models.megatron.grad_reduce import plan_buckets

    ps = [torch.zeros(10), torch.zeros(30), torch.zeros(5, dtype=torch.bfloat16), torch.zeros(20), torch.zeros(4)]
    # bytes: 40, 120, 10 (bf16), 80, 16; reversed: 4 (16 B), 3 (80 B) -> 96 B; 2 is bf16 -> new bucket;
    # 1 (120 B) -> new (dtype); 0 (40 B) would make 160 > 128 -> new
    assert plan_buckets(ps, 128) == [[4, 3], [2], [1], [0]]
    assert plan_buckets(ps, 10**6) == [[4, 3], [2], [1, 0]]
    assert plan_buckets(ps, 1) == [[4], [3], [2], [1], [0]]  # a tensor larger than the bucket goes alone
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets(ps, 0)
