"""Expert parallelism on gloo: EP=2 over two ranks (data parallel 2 for the dense layers, each rank holding half the
experts) and TP=2 x EP=2 over four (experts split over the expert-parallel ranks and each expert's matrices over the
tensor-parallel ranks, forward only: training it needs Transformer Engine). Each rank has its own rows, split into a
different number of micro-batches (the engine adds idle passes so the expert collectives pair up). The reference
is one process without any parallelism that accumulates every data-parallel rank's rows at its share of the loss.
The ranks' forward log-probs must equal transformers', their step the reference's (grad norm, router statistics,
every exported weight: the export gathers the experts from every expert-parallel rank)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from rltrain.models.hf_experts import CheckpointLayout
from _megatron_ref import hf_logprobs, join_gloo_world, make_engine, random_batch, random_moe_model, spawn_gloo_ranks
from test_megatron_moe import _PPOLoss, _ppo_batch

V = 101
SHAPE = dict(num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0], num_hidden_layers=2)
LENS = [[9, 6, 3], [11, 4, 7, 2, 12, 3]]  # per data-parallel rank: 2 vs 3 micro-batches


def _engine(hf, **kw):

    eng = make_engine(hf.config, seed=0, lr=1e-3, weight_decay=0.0, grad_clip=0.7,
                         max_tokens_per_micro_batch=16, **kw)
    eng.load_hf_weights(hf.state_dict())
    return eng


def _shares(eng, batch, lens, share):
    mbs = eng.make_micro_batches(batch, lens)
    total = float(batch["label_mask"][:, 1:].sum())
    for mb in mbs:
        mb.loss_scale = share * float(mb.label_mask[:, 1:].sum()) / total
    return mbs


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    join_gloo_world(rank, world, port)
    tp = world // 2
    hf = random_moe_model(V, seed=31, **SHAPE)
    res = {}
    if tp > 1:  # forward only: megatron trains MoE under TP only with sequence parallelism (Transformer Engine)
        from rltrain.models.megatron.build import UnsupportedModelError

        try:
            _engine(hf, tensor_parallel_size=tp, expert_parallel_size=2)
        except UnsupportedModelError as err:
            res["refusal"] = str(err)
        eng = _engine(hf, tensor_parallel_size=tp, expert_parallel_size=2, role="ref")
    else:
        eng = _engine(hf, tensor_parallel_size=tp, expert_parallel_size=2)
    dp_rank, dp = eng.data_parallel
    ids, lens, mask = random_batch(V, [[12, 5, 1, 8], [7, 3]][dp_rank], seed=40 + dp_rank)  # 1 vs 2 micro-batches
    lp, ent = eng.forward_logprobs(ids, lens, mask)
    ref_lp, ref_ent = hf_logprobs(hf, ids, mask)
    if tp == 1:
        batch, blens = _ppo_batch(hf, LENS[dp_rank], seed=50 + dp_rank)
        metrics = eng.train_step(_shares(eng, batch, blens, 1.0), _PPOLoss())  # the ranks' grads are averaged
        res.update({k: metrics[k] for k in ("grad_norm", "moe_aux_loss", "moe_load_max_over_mean")})
    exported = dict(eng.export_hf_weights(bucket_bytes=2048))
    if rank == 0:
        torch.save(exported, os.path.join(out_dir, "export.pt"))
    res.update(dp=dp, local_experts=len(eng.model.decoder.layers[1].mlp.experts.local_experts),
               lp_err=float((lp.double() - ref_lp).abs().max()), ent_err=float((ent.double() - ref_ent).abs().max()),
               n_exported=len(exported))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


def _reference():
    """One process, no parallelism: both data-parallel ranks' rows, each at half its share."""
    hf = random_moe_model(V, seed=31, **SHAPE)
    eng = _engine(hf)
    mbs = []
    for r in range(2):
        batch, lens = _ppo_batch(hf, LENS[r], seed=50 + r)
        mbs += _shares(eng, batch, lens, 0.5)
    return eng.train_step(mbs, _PPOLoss()), dict(eng.export_hf_weights()), CheckpointLayout(hf.state_dict())


def test_ep2_ranks_match_transformers_and_one_process(tmp_path):
    spawn_gloo_ranks(_worker, 2, tmp_path)
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    ref, ref_weights, _ = _reference()
    for r in res:
        assert r["dp"] == 2 and r["local_experts"] == 2  # 4 experts over 2 expert-parallel ranks
        assert r["lp_err"] < 1e-4 and r["ent_err"] < 1e-4
        assert r["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
        assert r["grad_norm"] > 0.7  # clipping ran on the global norm (experts of both ranks counted)
        for k in ("moe_aux_loss", "moe_load_max_over_mean"):
            assert r[k] == pytest.approx(ref[k], rel=1e-6)
    got = torch.load(tmp_path / "export.pt")
    assert set(got) == set(ref_weights) and res[0]["n_exported"] == len(ref_weights)
    for k, v in ref_weights.items():
        torch.testing.assert_close(got[k], v, atol=0.05 * 1e-3, rtol=0, msg=k)  # 5% of an Adam step


def test_tp2_ep2_forward_matches_transformers_and_training_is_refused_without_te(tmp_path):
    spawn_gloo_ranks(_worker, 4, tmp_path)
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for r in res:
        assert r["dp"] == 2 and r["local_experts"] == 2
        assert r["lp_err"] < 1e-4 and r["ent_err"] < 1e-4
        assert "expert_parallel_size" in r["refusal"] and "Transformer Engine" in r["refusal"]
    got = torch.load(tmp_path / "export.pt")  # gathered over TP and EP: the checkpoint, exactly
    ckpt = CheckpointLayout(random_moe_model(V, seed=31, **SHAPE).state_dict())
    assert set(got) == set(ckpt) and all(torch.equal(got[k], ckpt[k]) for k in got)
