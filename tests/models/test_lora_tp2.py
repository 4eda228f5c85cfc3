"""LoRA on the Megatron actor over two gloo processes: TP=2, then PP=2 in the same pair, against the transformers model
with explicitly adapted weights W + (alpha / r) B A (fp64) and the TP=1 engine: the same initial adapters, log-probs,
entropy, every adapter's gradient (gathered over the ranks), the step's grad norm, the export."""

from __future__ import annotations

import os

import torch
from torch.func import functional_call

from _megatron_ref import join_gloo_world, make_engine, random_batch, random_hf_model, spawn_gloo_ranks

V = 301  # padded at TP=2
ALPHA, RANK = 6.0, 4


def _reference(hf, ad, ids, mask, w):
    """(log-probs [B, S-1], entropy [B, S-1], {adapter name: grad}) of the explicitly adapted HF model in fp64, and
    the loss sum(w * (lp + 0.1 ent)) over the mask that the grads are of."""
    hf64 = random_hf_model(V, seed=31).double()
    hf64.load_state_dict({k: v.double() for k, v in hf.state_dict().items()})
    leaves = {n: t.double().requires_grad_(True) for n, t in ad.items()}
    weights = {k: v.detach() for k, v in hf64.named_parameters()}
    for n, a in leaves.items():
        if ".lora_A." in n:
            name = n.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            weights[name] = weights[name] + ALPHA / RANK * leaves[n.replace("lora_A", "lora_B")] @ a
    logp = torch.log_softmax(functional_call(hf64, weights, (ids,)).logits[:, :-1], -1)
    m = mask[:, 1:]
    lp = torch.where(m, logp.gather(-1, ids[:, 1:, None]).squeeze(-1), 0.0)
    ent = torch.where(m, -(logp.exp() * logp).sum(-1), 0.0)
    (w[:, 1:] * (lp + 0.1 * ent)).sum().backward()
    return lp.detach(), ent.detach(), {n: t.grad for n, t in leaves.items()}


def _loss(outputs, mb):
    w = mb.extras["w"]
    return (w * (outputs.logprobs + 0.1 * outputs.entropy)).sum(), {}


_loss.needs_entropy_grad = True


def _gathered_grads(eng) -> dict[str, torch.Tensor]:
    """Every adapter's gradient as a full HF-layout tensor (split ones gathered over TP), this stage's adapters."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    out = {}
    group = parallel_state.get_tensor_model_parallel_group()
    for a in eng.lora.linears:
        for name, which, p in a.local_named():
            g = p.grad
            if getattr(p, "tensor_model_parallel", False):
                parts = [torch.empty_like(g) for _ in range(dist.get_world_size(group))]
                dist.all_gather(parts, g.contiguous(), group=group)
                g = torch.cat(parts, dim=p.partition_dim)
            out[name] = g
    return out


def _phase(make, hf, res: dict, tag: str, ref: dict) -> None:
    """One layout's checks; `ref` caches the adapters, batch and fp64 reference (the same for every layout)."""
    from rltrain.models.loss_protocol import MicroBatch

    eng = make()
    eng.load_hf_weights(hf.state_dict())
    res[f"init_{tag}"] = dict(eng.export_lora_weights())
    if not ref:
        g = torch.Generator().manual_seed(9)
        ad = {n: torch.randn(t.shape, generator=g) * 0.2 for n, t in sorted(res[f"init_{tag}"].items())}
        ids, lens, mask = random_batch(V, [10, 4, 7, 2], seed=5)
        w = torch.randn(ids.shape, generator=g) * mask
        ref.update(ad=ad, batch=(ids, lens, mask, w), out=_reference(hf, ad, ids, mask, w))
    ad, (ids, lens, mask, w), (ref_lp, ref_ent, ref_grads) = ref["ad"], ref["batch"], ref["out"]
    eng.lora.load(ad)
    if tag == "tp2":
        res["b_q_rows_per_rank"] = eng.model.decoder.layers[0].self_attention.linear_qkv.lora.B_q_proj.shape[0]
    lp, ent = eng.forward_logprobs(ids, lens, mask)
    res[f"lp_err_{tag}"] = float((lp[:, 1:].double() - ref_lp).abs().max())
    res[f"ent_err_{tag}"] = float((ent[:, 1:].double() - ref_ent).abs().max())
    res[f"export_equal_{tag}"] = all(torch.equal(ad[k], v) for k, v in eng.export_lora_weights())
    mb = MicroBatch(input_ids=ids, seq_lens=lens, label_mask=mask, extras={"w": w})
    if tag == "tp2":  # the adapters' gradients, before any step (the PP schedule owns its backward: norm only)
        eng.model.train()
        out = eng._outputs(mb, temperature=1.0, entropy_grad=True)
        _loss(out, mb)[0].backward()
        got = _gathered_grads(eng)
        res["grad_rel_err_tp2"] = max(float((got[n].double() - ref_grads[n]).abs().max() / ref_grads[n].abs().max())
                                      for n in ref_grads)
        res["grad_names_tp2"] = sorted(got) == sorted(ref_grads)
    ref_norm = float(torch.sqrt(sum((g ** 2).sum() for g in ref_grads.values())))
    metrics = eng.train_step([mb], _loss)
    res[f"grad_norm_rel_err_{tag}"] = abs(metrics["grad_norm"] - ref_norm) / ref_norm


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    join_gloo_world(rank, world, port)
    from megatron.core import parallel_state

    hf = random_hf_model(V, seed=31)
    kw = dict(rank=RANK, alpha=ALPHA, lr=1e-3, logprobs_chunk_size=6, seed=0)
    res: dict = {}
    ref: dict = {}
    _phase(lambda: make_engine(hf.config, tensor_parallel_size=2, **kw), hf, res, "tp2", ref)
    parallel_state.destroy_model_parallel()  # the same two processes, now two pipeline stages
    _phase(lambda: make_engine(hf.config, pipeline_parallel_size=2, **kw), hf, res, "pp2", ref)
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


def test_lora_tp2_and_pp2_equal_tp1_and_the_adapted_hf_model(tmp_path):
    spawn_gloo_ranks(_worker, 2, tmp_path)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    hf = random_hf_model(V, seed=31)
    tp1 = make_engine(hf.config, rank=RANK, alpha=ALPHA, seed=0)
    init = dict(tp1.export_lora_weights())
    for res in results:
        for tag in ("tp2", "pp2"):
            got = res[f"init_{tag}"]  # the same initial adapters as TP=1 (drawn whole, then sliced)
            assert set(got) == set(init) and all(torch.equal(got[k], init[k]) for k in init)
            assert res[f"lp_err_{tag}"] < 1e-5 and res[f"ent_err_{tag}"] < 1e-5, res
            assert res[f"export_equal_{tag}"]
            assert res[f"grad_norm_rel_err_{tag}"] < 1e-5, res
        assert res["grad_names_tp2"] and res["grad_rel_err_tp2"] < 1e-5, res
        assert res["b_q_rows_per_rank"] == 4 * 24 // 2  # 4 query heads of 24, half on each rank
