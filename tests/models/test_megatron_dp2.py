"""The sharded optimizer at data parallel 2 (models/megatron/shards.py, optim.py): two gloo ranks each take train
steps on their own micro-batches, each rank reduce-scattering the grads and stepping only its pieces of the
optimizer state. The reference is one process (DP=1, nothing sharded) that accumulates every rank's micro-batches
at half the loss scale. Checked: every piece's grad against the reference's grad of those elements (the pieces of
the two ranks tile every parameter once), the losses and grad norms, the parameters after two steps (all-gathered:
the same on both ranks, and the reference's within fp32 rounding), with buckets started from grad hooks during the
backward, one bucket per step, no overlap, and never armed (the pipeline-parallel path). Checkpoints: state saved at
DP=2 after one step and resumed at DP=2 (the next step bit-identical to the uninterrupted run, whose params and
optimizer state went to the host and back in between) and at DP=1, and the reference's DP=1 state resumed at DP=2
(both within fp32 rounding of the reference's next step). A tiny MoE at expert parallel 1 (experts sharded with the
dense params, as one unit per layer) takes the reference's step too."""

from __future__ import annotations

import json
import os

import pytest
import torch

from _megatron_ref import (hf_logprobs, join_gloo_world, make_engine, ppo_loss_with_entropy as _ppo_loss, random_batch,
                           random_hf_model, random_moe_model, spawn_gloo_ranks)

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


def _step(eng, mbs):
    """One train step -> (this rank's pieces' grads as the optimizer sees them: [(name, start, stop, grad)], metrics)."""
    seen = {}
    clip = eng._clip

    def capture(grads, norm):
        seen["grads"] = [(name, s.start, s.stop, None if g is None else g.detach().clone())
                         for (_, s, name, _), g in zip(eng.optim.pieces, grads)]
        return clip(grads, norm)

    eng._clip = capture
    metrics = eng.train_step(mbs, _ppo_loss)
    eng._clip = clip
    return seen["grads"], metrics


def _engine(hf, **kw):

    eng = make_engine(hf.config, seed=0, lr=1e-3, weight_decay=0.01, grad_clip=1e9,
                         max_tokens_per_micro_batch=16, **kw)
    eng.load_hf_weights(hf.state_dict())
    return eng


def _params(eng) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in eng.model.named_parameters()}


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    join_gloo_world(rank, world, port)
    hf = random_hf_model(V, seed=23)
    batch, lens = _rank_batch(hf, rank)
    res = {}
    for name, (bucket_mb, overlap) in SETTINGS.items():
        eng = _engine(hf, grad_reduce_bucket_mb=bucket_mb, overlap_grad_reduce=overlap)
        mbs = _micro_batches(eng, batch, lens, share=1.0)
        if name == "never_armed":
            for shards, _, _ in eng.optim.groups:
                shards.arm = lambda: None
        steps = []
        for _ in range(2):  # the second step checks that the shards start over
            grads, metrics = _step(eng, mbs)
            steps.append({"grads": grads, "loss": metrics["loss"], "grad_norm": metrics["grad_norm"]})
        red = eng._dp_reducer
        torch.save({"steps": steps, "params": _params(eng)}, os.path.join(out_dir, f"{name}_rank{rank}.pt"))
        res[name] = {"n_micro_batches": len(mbs), "buckets": len(red.buckets), "launched_by_hooks": red.launched_by_hooks}
    # checkpoints: one step, save this rank's state, a second step (the uninterrupted run)
    eng = _engine(hf)
    mbs = _micro_batches(eng, batch, lens, share=1.0)
    eng.train_step(mbs, _ppo_loss)
    torch.save(eng.state_dict(), os.path.join(out_dir, f"ckpt_rank{rank}.pt"))
    eng.offload()  # actor.offload_while_rollout: the buckets' buffers leave; the step brings them back
    assert eng.state_offload.params_on_host
    m2 = eng.train_step(mbs, _ppo_loss)
    uninterrupted = (_params(eng), m2)
    resumed = {}
    for source in ("dp2", "dp1"):  # resumed at DP=2 from this rank's own state, or from the DP=1 reference's
        fresh = _engine(random_hf_model(V, seed=99))  # other weights: everything must come from the checkpoint
        path = f"ckpt_rank{rank}.pt" if source == "dp2" else "ref_ckpt.pt"
        fresh.load_state_dict(torch.load(os.path.join(out_dir, path), weights_only=True))
        m = fresh.train_step(mbs, _ppo_loss)
        resumed[source] = (_params(fresh), m)
    torch.save({"uninterrupted": uninterrupted, "resumed": resumed}, os.path.join(out_dir, f"resume_rank{rank}.pt"))
    res["moe"] = _moe_step(rank, out_dir)[0]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


def _moe_step(rank: int | None, out_dir: str | None):
    """A tiny MoE at expert parallel 1: its experts are sharded with the dense params (each layer's experts one
    unit of a bucket, so the grouped GEMM still reads them as one block, no copy). Rank `rank`'s rows (None: the
    reference, both ranks' rows at half scale); returns the step's metrics (and saves the params)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from rltrain.models.megatron.moe import adjacent, stacked

    hf = random_moe_model(V, seed=5, num_hidden_layers=2, mlp_only_layers=[0])
    eng = _engine(hf)
    mbs = []
    for r in range(2) if rank is None else (rank,):
        batch, lens = _rank_batch(hf, r)
        mbs += _micro_batches(eng, batch, lens, share=0.5 if rank is None else 1.0)
    copies = stacked.copies
    metrics = eng.train_step(mbs, _ppo_loss)
    experts = next(m for m in eng.model.modules() if isinstance(m, SequentialMLP))
    metrics["no_copy"] = stacked.copies == copies and adjacent([e.linear_fc1.weight for e in experts.local_experts])
    metrics["n_micro_batches"] = len(mbs)
    if out_dir is not None:
        torch.save(_params(eng), os.path.join(out_dir, f"moe_rank{rank}.pt"))
    return metrics, _params(eng)


def _reference(hf, steps: int, ckpt_path=None):
    """DP=1, one process: both ranks' micro-batches at half scale; (grads by name, metrics) of each step, the params
    after, and the engine's state after step 1 written to ckpt_path."""
    eng = _engine(hf)
    mbs = []
    for r in range(2):
        batch, lens = _rank_batch(hf, r)
        mbs += _micro_batches(eng, batch, lens, share=0.5)
    out = []
    for step in range(steps):
        grads, metrics = _step(eng, mbs)
        out.append(({name: g for name, _, _, g in grads}, metrics))
        if step == 0 and ckpt_path is not None:
            torch.save(eng.state_dict(), ckpt_path)
    return out, _params(eng), mbs


def _close(a: torch.Tensor, b: torch.Tensor, msg: str) -> None:
    torch.testing.assert_close(a, b, atol=1e-6 * max(1.0, float(b.abs().max())), rtol=1e-5, msg=msg)


def test_dp2_sharded_step_equals_one_process_accumulating_both_ranks_batches(tmp_path):
    hf = random_hf_model(V, seed=23)
    refs, ref_params, ref_mbs = _reference(hf, 2, ckpt_path=tmp_path / "ref_ckpt.pt")
    spawn_gloo_ranks(_worker, 2, tmp_path)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    numel = {n: p.numel() for n, p in ref_params.items()}
    for name in SETTINGS:
        got = [torch.load(tmp_path / f"{name}_rank{r}.pt") for r in range(2)]
        for step, (ref_grads, ref_metrics) in enumerate(refs):
            covered = {n: 0 for n in numel}
            n_mbs = [results[r][name]["n_micro_batches"] for r in range(2)]  # a loss is its micro-batches' mean
            loss = sum(n * got[r]["steps"][step]["loss"] for r, n in enumerate(n_mbs)) / sum(n_mbs)
            assert loss == pytest.approx(ref_metrics["loss"], rel=1e-5)
            for r in range(2):
                s = got[r]["steps"][step]
                assert s["grad_norm"] == pytest.approx(ref_metrics["grad_norm"], rel=1e-5)
                for pname, start, stop, g in s["grads"]:
                    covered[pname] += stop - start
                    _close(g, ref_grads[pname].reshape(-1)[start:stop], f"{name} step {step} rank {r} {pname}")
            assert covered == numel, name  # the two ranks' pieces tile every parameter once
        for n, p in ref_params.items():  # both ranks hold the whole updated params, the reference's
            assert torch.equal(got[0]["params"][n], got[1]["params"][n]), (name, n)
            _close(got[0]["params"][n], p, f"{name} params {n}")
        res0 = results[0][name]
        assert res0["n_micro_batches"] >= 2  # the hooks count the last one only
    small, one, none, never = (results[0][k] for k in SETTINGS)
    assert small["buckets"] > 10 and small["launched_by_hooks"] == small["buckets"]  # all started in the backward
    assert one["buckets"] == 1 and one["launched_by_hooks"] == 1
    assert none["buckets"] > 1 and none["launched_by_hooks"] == 0
    assert never["launched_by_hooks"] == 0

    # resume: at DP=2 from DP=2 (exact), at DP=2 from DP=1 and at DP=1 from DP=2 (the reference's step 2, rounding)
    ref_m2 = refs[1][1]
    for r in range(2):
        res = torch.load(tmp_path / f"resume_rank{r}.pt")
        (p_u, m_u), resumed = res["uninterrupted"], res["resumed"]
        p_same, m_same = resumed["dp2"]
        assert all(torch.equal(p_same[n], p_u[n]) for n in p_u) and m_same == m_u
        p_dp1, m_dp1 = resumed["dp1"]
        assert m_dp1["grad_norm"] == pytest.approx(ref_m2["grad_norm"], rel=1e-5)
        for n, p in ref_params.items():
            _close(p_dp1[n], p, f"dp1 -> dp2 rank {r} {n}")
    eng = _engine(random_hf_model(V, seed=99))
    files = [torch.load(tmp_path / f"ckpt_rank{r}.pt", weights_only=True) for r in range(2)]
    assert set(files[0]["optimizer"]["params"]) | set(files[1]["optimizer"]["params"]) == set(numel)
    assert any(e["stop"] - e["start"] < e["numel"] for e in files[0]["optimizer"]["params"].values())  # sharded
    eng.load_state_dict(files[0], optimizer_pieces=[(f["optimizer"]["params"], True) for f in files])
    m = eng.train_step(ref_mbs, _ppo_loss)
    assert m["loss"] == pytest.approx(ref_m2["loss"], rel=1e-5)
    assert m["grad_norm"] == pytest.approx(ref_m2["grad_norm"], rel=1e-5)
    for n, p in ref_params.items():
        _close(eng.model.get_parameter(n).detach(), p, f"dp2 -> dp1 {n}")
    # the MoE at expert parallel 1: experts sharded with the dense params, read as one block, the reference's step
    ref_moe, ref_moe_params = _moe_step(None, None)
    assert ref_moe["no_copy"] and all(r["moe"]["no_copy"] for r in results)
    assert results[0]["moe"]["grad_norm"] == pytest.approx(ref_moe["grad_norm"], rel=1e-5)
    n = [r["moe"]["n_micro_batches"] for r in results]
    assert (n[0] * results[0]["moe"]["loss"] + n[1] * results[1]["moe"]["loss"]) / sum(n) == pytest.approx(
        ref_moe["loss"], rel=1e-5)
    got = torch.load(tmp_path / "moe_rank1.pt")
    for k, p in ref_moe_params.items():
        _close(got[k], p, f"moe {k}")
    with pytest.raises(ValueError, match="covers"):  # one rank's file alone lacks the other's pieces
        _engine(hf).load_state_dict(files[0], optimizer_pieces=[(files[0]["optimizer"]["params"], True)])


def test_buckets_go_in_reverse_order_split_by_size_and_dtype():
    from rltrain.models.megatron.shards import plan_buckets

    ps = [torch.zeros(10), torch.zeros(30), torch.zeros(5, dtype=torch.bfloat16), torch.zeros(20), torch.zeros(4)]
    # bytes: 40, 120, 10 (bf16), 80, 16; reversed: 4 (16 B), 3 (80 B) -> 96 B; 2 is bf16 -> new bucket;
    # 1 (120 B) -> new (dtype); 0 (40 B) would make 160 > 128 -> new
    assert plan_buckets(ps, 128) == [[4, 3], [2], [1], [0]]
    assert plan_buckets(ps, 10**6) == [[4, 3], [2], [1, 0]]
    assert plan_buckets(ps, 1) == [[4], [3], [2], [1], [0]]  # a tensor larger than the bucket goes alone
    # a unit (an MoE layer's experts) stays whole and in its own order, placed by its last member
    assert plan_buckets(ps, 10**6, units=[[0], [1, 3], [2], [4]]) == [[4, 1, 3], [2], [0]]
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets(ps, 0)
