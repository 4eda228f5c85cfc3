"""MegatronEngine at PP=2 and TP=2 x PP=2 (2 / 4 gloo processes on CPU, megatron's 1F1B schedule)
against transformers' Qwen3 and the PP=1 engine (fp32), 4 layers, tied and untied embeddings:
log-prob/entropy parity, export round trip, one PPO step (loss, grad norm, weights), critic values.
All PP=2 checks share one spawned pair of processes; the PP=1 reference runs in the test process."""

from __future__ import annotations

import functools
import os

import torch

from _megatron_ref import (hf_logprobs, join_gloo_world, make_engine, ppo_loss_with_entropy as _ppo_loss, random_batch,
                           random_hf_model, spawn_gloo_ranks)

V = 301
LAYERS = 4
LR, CLIP = 1e-3, 0.5
STEP_LENS = [9, 6, 5, 3]  # budget 20 -> micro-batches [2, 9] and [2, 5]: one padded schedule call
STEP_BUDGET = 20
# forward: budget 24 -> micro-batches [2, 10], [3, 7], [1, 2]; the last two share one padded call
FWD_LENS = [10, 4, 7, 2, 5, 8]


def _value_loss(outputs, mb):
    m = mb.label_mask & (torch.arange(mb.input_ids.shape[1]) >= 1)
    err = (outputs.values - mb.extras["returns"]) * m
    return (err**2).sum() / m.sum(), {}


def _step_batch(hf):
    ids, lens, mask = random_batch(V, STEP_LENS, seed=8)
    with torch.no_grad():
        ref_lp, _ = hf_logprobs(hf, ids, mask)
    g = torch.Generator().manual_seed(3)
    batch = {"input_ids": ids, "label_mask": mask,
             "old_logprobs": (ref_lp.float() + 0.3 * torch.randn(ids.shape, generator=g)) * mask,
             "advantages": torch.randn(ids.shape, generator=g) * mask,
             "returns": torch.randn(ids.shape, generator=g) * mask}
    return batch, lens


def _micro_batches(eng, batch, lens):
    mbs = eng.make_micro_batches(batch, lens)
    total = float(batch["label_mask"][:, 1:].sum())
    for mb in mbs:
        mb.loss_scale = float(mb.label_mask[:, 1:].sum()) / total
    return mbs


def _export_all(eng) -> dict[str, torch.Tensor]:
    """Union of every pipeline stage's exported HF tensors (collective over the world)."""
    import torch.distributed as dist

    mine = dict(eng.export_hf_weights(bucket_bytes=10_000))
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    out: dict[str, torch.Tensor] = {}
    for p in parts:
        out.update(p)
    return out


def _steps(pp_size: int, make_engine) -> dict:
    """PPO step for untied and tied models and one critic step; shared by PP=1 and PP=2."""
    res: dict = {}
    for tied in (False, True):
        hf = random_hf_model(V, seed=41, num_hidden_layers=LAYERS, tie_word_embeddings=tied)
        batch, lens = _step_batch(hf)
        eng = make_engine(hf.config, lr=LR, weight_decay=0.0, grad_clip=CLIP,
                          max_tokens_per_micro_batch=STEP_BUDGET, logprobs_chunk_size=5)
        eng.load_hf_weights(hf.state_dict())
        mbs = _micro_batches(eng, batch, lens)
        metrics = eng.train_step(mbs, _ppo_loss)
        res[f"n_mb_tied={tied}"] = len(mbs)
        res[f"metrics_tied={tied}"] = metrics
        res[f"weights_tied={tied}"] = _export_all(eng) if pp_size > 1 else dict(eng.export_hf_weights())
    hf = random_hf_model(V, seed=43, num_hidden_layers=LAYERS)
    batch, lens = _step_batch(hf)
    critic = make_engine(hf.config, role="critic", lr=LR, weight_decay=0.0, grad_clip=CLIP,
                         max_tokens_per_micro_batch=STEP_BUDGET)
    critic.load_hf_weights(hf.state_dict())
    res["values"] = critic.forward_values(batch["input_ids"], lens, batch["label_mask"])
    res["critic_metrics"] = critic.train_step(_micro_batches(critic, batch, lens), _value_loss)
    res["critic_values_after"] = critic.forward_values(batch["input_ids"], lens, batch["label_mask"])
    return res


def test_group_micro_batches_hand_worked():
    from rltrain.models.megatron.pipeline import group_micro_batches, pad_ids

    assert group_micro_batches([(2, 10), (3, 7), (1, 2)], 24) == [[0], [1, 2]]
    assert group_micro_batches([(2, 9), (2, 5)], 20) == [[0, 1]]
    # a single row above the budget may absorb rows that fit in its own padded shape
    assert group_micro_batches([(1, 50), (1, 40), (2, 30)], 24) == [[0, 1], [2]]
    assert group_micro_batches([(4, 4)] * 3, 16) == [[0, 1, 2]]
    ids = torch.tensor([[5, 6, 7]])
    assert torch.equal(pad_ids(ids, 2, 4), torch.tensor([[5, 6, 7, 0], [0, 0, 0, 0]]))


@functools.cache
def _pp1_reference() -> dict:
    return _steps(1, lambda cfg, **kw: make_engine(cfg, **kw))


def _spawn(fn, world: int, tmp_path) -> list[dict]:
    spawn_gloo_ranks(fn, world, tmp_path)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _check_steps(res: dict, ref: dict) -> None:
    """PP>1 step results == the PP=1 engine's (metrics, exported weights, critic)."""
    for tied in (False, True):
        assert res[f"n_mb_tied={tied}"] == ref[f"n_mb_tied={tied}"] == 2
        got, want = res[f"metrics_tied={tied}"], ref[f"metrics_tied={tied}"]
        assert set(got) == set(want)
        for k in want:
            assert abs(got[k] - want[k]) <= 1e-5 * max(1.0, abs(want[k])), (tied, k, got[k], want[k])
        w_got, w_want = res[f"weights_tied={tied}"], ref[f"weights_tied={tied}"]
        assert set(w_got) == set(w_want)
        init = random_hf_model(V, seed=41, num_hidden_layers=LAYERS, tie_word_embeddings=tied).state_dict()
        assert max(float((w_want[k] - init[k]).abs().max()) for k in w_want) > 0.5 * LR  # it moved
        err = max(float((w_got[k] - w_want[k]).abs().max()) for k in w_want)
        assert err < 0.05 * LR, (tied, err)  # 5% of one Adam step, as in the TP=2 test
    assert float((res["values"] - ref["values"]).abs().max()) < 1e-5
    assert abs(res["critic_metrics"]["grad_norm"] - ref["critic_metrics"]["grad_norm"]) \
        <= 1e-5 * ref["critic_metrics"]["grad_norm"]
    assert float((res["critic_values_after"] - ref["critic_values_after"]).abs().max()) < 1e-5


def _worker_tp2_pp2(rank: int, world: int, port: int, out_dir: str) -> None:
    join_gloo_world(rank, world, port)
    from megatron.core import parallel_state

    def make(cfg, **kw):
        return make_engine(cfg, tensor_parallel_size=2, pipeline_parallel_size=2, **kw)

    res: dict = {}
    hf = random_hf_model(V, seed=31, num_hidden_layers=LAYERS, tie_word_embeddings=True)
    eng = make(hf.config, role="ref", logprobs_chunk_size=6, max_tokens_per_micro_batch=24)
    eng.load_hf_weights(hf.state_dict())
    ids, lens, mask = random_batch(V, FWD_LENS, seed=5)
    ref_lp, ref_ent = hf_logprobs(hf, ids, mask, temperature=0.8)
    lp, ent = eng.forward_logprobs(ids, lens, mask, temperature=0.8)
    res["lp_err"] = float((lp.double() - ref_lp).abs().max())
    res["ent_err"] = float((ent.double() - ref_ent).abs().max())
    res["ranks"] = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank())
    res.update(_steps(2, make))
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    join_gloo_world(rank, world, port)
    from megatron.core import parallel_state

    def make(cfg, **kw):
        return make_engine(cfg, pipeline_parallel_size=2, **kw)

    res: dict = {}
    for tied in (False, True):
        hf = random_hf_model(V, seed=31, num_hidden_layers=LAYERS, tie_word_embeddings=tied)
        sd = hf.state_dict()
        eng = make(hf.config, role="ref", logprobs_chunk_size=6, max_tokens_per_micro_batch=24)
        eng.load_hf_weights(sd)
        res[f"layers_on_stage_tied={tied}"] = len(eng.model.decoder.layers)
        out = _export_all(eng)
        expected = {k for k in sd if not (tied and k == "lm_head.weight")}
        res[f"roundtrip_keys_tied={tied}"] = sorted(set(out) ^ expected)
        res[f"roundtrip_exact_tied={tied}"] = all(torch.equal(out[k], sd[k]) for k in expected & set(out))
        ids, lens, mask = random_batch(V, FWD_LENS, seed=5)
        ref_lp, ref_ent = hf_logprobs(hf, ids, mask, temperature=0.8)
        for fused in (True, False):
            if not fused:
                eng = make(hf.config, role="ref", fused_linear_logprob=False, max_tokens_per_micro_batch=24)
                eng.load_hf_weights(sd)
            lp, ent = eng.forward_logprobs(ids, lens, mask, temperature=0.8)
            res[f"lp_err_fused={fused}_tied={tied}"] = float((lp.double() - ref_lp).abs().max())
            res[f"ent_err_fused={fused}_tied={tied}"] = float((ent.double() - ref_ent).abs().max())
        if tied:  # a tied HF checkpoint dir has no lm_head.weight: the last stage reads the embedding
            from safetensors.torch import save_file

            path = os.path.join(out_dir, f"hf_rank{rank}")
            os.makedirs(path)
            save_file({k: v.clone() for k, v in sd.items() if k != "lm_head.weight"},
                      os.path.join(path, "model.safetensors"))
            from_dir = make(hf.config, role="ref", fused_linear_logprob=False, max_tokens_per_micro_batch=24)
            from_dir.load_hf_weights(path)
            res["from_dir_equal"] = torch.equal(from_dir.forward_logprobs(ids, lens, mask, temperature=0.8)[0], lp)
    res["pp_rank"] = parallel_state.get_pipeline_model_parallel_rank()
    res.update(_steps(2, make))

    # a NaN loss on the last stage raises on every stage and takes no step
    hf = random_hf_model(V, seed=41, num_hidden_layers=LAYERS)
    batch, lens = _step_batch(hf)
    eng = make(hf.config, lr=LR, max_tokens_per_micro_batch=STEP_BUDGET)
    eng.load_hf_weights(hf.state_dict())
    before = [p.detach().clone() for p in eng.model.parameters()]
    try:
        eng.train_step(_micro_batches(eng, batch, lens), lambda out, mb: (out.logprobs.sum() * float("nan"), {}))
        res["nan_raised"] = False
    except FloatingPointError:
        res["nan_raised"] = True
    res["nan_no_step"] = all(torch.equal(a, p) for a, p in zip(before, eng.model.parameters()))
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


def test_pp2_logprobs_export_ppo_step_and_critic_match_pp1_and_transformers(tmp_path):
    results = _spawn(_worker, 2, tmp_path)
    ref = _pp1_reference()
    assert sorted(r["pp_rank"] for r in results) == [0, 1]
    for res in results:
        assert res["from_dir_equal"] and res["nan_raised"] and res["nan_no_step"]
        for tied in (False, True):
            assert res[f"layers_on_stage_tied={tied}"] == LAYERS // 2
            assert res[f"roundtrip_keys_tied={tied}"] == [] and res[f"roundtrip_exact_tied={tied}"]
            for fused in (True, False):
                assert res[f"lp_err_fused={fused}_tied={tied}"] < 1e-4
                assert res[f"ent_err_fused={fused}_tied={tied}"] < 1e-4
        _check_steps(res, ref)
    # both stages report the same metrics and outputs
    for k in ("metrics_tied=False", "metrics_tied=True", "critic_metrics"):
        assert results[0][k] == results[1][k]
    assert torch.equal(results[0]["values"], results[1]["values"])


def test_tp2_pp2_logprobs_and_steps_match(tmp_path):
    results = _spawn(_worker_tp2_pp2, 4, tmp_path)
    ref = _pp1_reference()
    assert sorted(r["ranks"] for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for res in results:
        assert res["lp_err"] < 1e-4 and res["ent_err"] < 1e-4
        _check_steps(res, ref)
    assert all(r["metrics_tied=True"] == results[0]["metrics_tied=True"] for r in results)
