"""The vLLM kernel set of rollout.true_on_policy (compat/vllm_kernels.py, models/megatron/invariant.VllmKernels) on
CPU, with reference implementations of the vLLM entry points it calls (their documented semantics: vLLM's paged
FlashAttention call, its neox rotary kernel on the [cos | sin] cache, RMSNorm, SiLU-and-mul): our side's
layouts (the paged KV cache, sequence-major positions, packed queries) against plain torch, and the Megatron actor
wired to the set against the plain actor, values and gradients. The kernels themselves run on a GPU only
(tests/rollout/test_true_on_policy_vllm_gpu.py)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from rltrain.compat import vllm_kernels as vk
from rltrain.models.engine_config import SampledDistribution
from rltrain.ops import invariant as inv
from _megatron_ref import make_engine, random_batch, random_hf_model, random_moe_model


def _norm(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class _Rotary:
    """vLLM RotaryEmbedding's cache recipe: inv_freq = 1 / base^(arange(0, d, 2) / d), rows [cos | sin]."""

    def _compute_inv_freq(self, base):
        return 1.0 / (base ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float) / self.rotary_dim))

    def _compute_cos_sin_cache(self):
        f = torch.einsum("i,j->ij", torch.arange(self.max_position_embeddings, dtype=torch.float),
                         self._compute_inv_freq(self.base))
        return torch.cat([f.cos(), f.sin()], -1)


def _rotary_embedding(positions, query, key, head_size, cache, is_neox):
    half = head_size // 2
    for t in (query, key):
        if t is not None:
            x = t.view(t.shape[0], -1, head_size)
            cos, sin = cache[positions][:, None, :half], cache[positions][:, None, half:]
            x1, x2 = x[..., :half].clone(), x[..., half:].clone()
            x[..., :half], x[..., half:] = x1 * cos - x2 * sin, x2 * cos + x1 * sin


def _flash_attn(q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, softmax_scale, causal,
                block_table, fa_version, num_splits, k_descale, v_descale):
    """Paged varlen attention: sequence i's queries cu[i]:cu[i+1] over its seqused_k[i] keys, read page by page
    through block_table[i] from k/v [pages, page, hkv, d]; causal with the queries last."""
    assert num_splits == 1 and causal
    for i in range(len(seqused_k)):
        lo, hi, n = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]), int(seqused_k[i])
        keys, vals = (c[block_table[i].long()].flatten(0, 1)[:n].transpose(0, 1) for c in (k, v))  # [hkv, n, d]
        rep = q.shape[1] // keys.shape[0]
        qi = q[lo:hi].transpose(0, 1)
        valid = torch.arange(n)[None, :] <= torch.arange(n - (hi - lo), n)[:, None]
        out[lo:hi] = F.scaled_dot_product_attention(qi, keys.repeat_interleave(rep, 0), vals.repeat_interleave(rep, 0),
                                                    attn_mask=valid, scale=softmax_scale).transpose(0, 1)


@pytest.fixture
def reference_vllm(monkeypatch):
    calls = {"rms_norm": 0}

    def fused_topk(hidden_states, gating_output, topk, renormalize):  # vLLM's topk_softmax: fp32 softmax, top k
        assert gating_output.shape[0] == hidden_states.shape[0]
        calls["fused_topk"] = calls.get("fused_topk", 0) + 1
        weights, experts = torch.softmax(gating_output.float(), -1).topk(topk, dim=-1)
        if renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, experts.to(torch.int32), None

    def fused_experts(x, w13, w2, weights, experts):  # every (token, slot) through its expert, weighted, summed
        assert x.is_contiguous() and weights.dtype == torch.float32 and experts.dtype == torch.int32
        calls["fused_experts"] = calls.get("fused_experts", 0) + 1
        i = w2.shape[-1]
        h = torch.einsum("th,tkoh->tko", x.float(), w13[experts.long()].float())
        a = F.silu(h[..., :i]) * h[..., i:]
        y = torch.einsum("tki,tkoi->tko", a, w2[experts.long()].float())
        return (y * weights[..., None]).sum(1).to(x.dtype)

    def rms_norm(x, w, eps):
        calls["rms_norm"] += 1
        return _norm(x, w, eps)

    def apply_temperature(logits, idx, temperature):  # vLLM's kernel: in place, the quotient in the logits' dtype
        logits.copy_(logits.float() / temperature[idx.long()][:, None])

    def compute_token_logprobs(logits, ids):  # vLLM's kernel: fp32 log-sum-exp of each row, at ids [rows, k]
        return torch.log_softmax(logits.float(), -1).gather(-1, ids)

    ref = SimpleNamespace(linear=lambda x, w, b=None: F.linear(x, w, b), rms_norm=rms_norm,
                          apply_temperature=apply_temperature,
                          compute_token_logprobs=compute_token_logprobs,
                          rotary_embedding=_rotary_embedding, fa_version=lambda head_size: 3, rotary_class=_Rotary,
                          silu_and_mul=lambda out, x: out.copy_(F.silu(x[..., :x.shape[-1] // 2])
                                                                * x[..., x.shape[-1] // 2:]),
                          flash_attn_varlen_func=_flash_attn, fused_topk=fused_topk, fused_experts=fused_experts)
    monkeypatch.setattr(vk, "_vllm", lambda: ref)
    caches = (vk._cos_sin_cache, vk._fa_version, vk._paged_meta, vk.sequence_major_positions)
    for c in caches:
        c.cache_clear()
    yield calls
    for c in caches:
        c.cache_clear()


def test_our_layouts_around_vllms_kernels_compute_the_plain_ops(reference_vllm):
    torch.manual_seed(0)
    b, h, hkv, s, d = 3, 4, 2, 37, 24  # s not a multiple of the 16-token page
    q, k, v = torch.randn(b, h, s, d), torch.randn(b, hkv, s, d), torch.randn(b, hkv, s, d)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True,
                                         scale=d ** -0.5)
    torch.testing.assert_close(vk.attention(q, k, v, d ** -0.5), ref)
    t, pos = torch.randn(11, h, d), torch.randint(0, 500, (11,))
    ang = pos[:, None].double() * (1.0 / 1e6 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None].float(), torch.cat([ang.sin()] * 2, -1)[:, None].float()
    torch.testing.assert_close(vk.rope(t, pos, 1e6, 4096), inv.apply_rope(t, cos, sin), rtol=1e-5, atol=1e-5)
    g = torch.randn(6, 2 * 32)
    torch.testing.assert_close(vk.silu_and_mul(g), F.silu(g[:, :32]) * g[:, 32:])
    hid, wt, lab = torch.randn(9, 16), torch.randn(33, 16), torch.randint(0, 33, (9,))
    lp = vk.token_logprobs(hid, wt, lab, 0.7)
    z = (hid @ wt.T) / 0.7
    torch.testing.assert_close(lp, torch.log_softmax(z, -1).gather(-1, lab[:, None]).squeeze(-1))
    # bf16: the sampled distribution is that of the logits / temperature rounded to bf16 (vLLM's in-place kernel)
    lp16 = vk.token_logprobs(hid.bfloat16(), wt.bfloat16(), lab, 0.7)
    z16 = ((hid.bfloat16() @ wt.bfloat16().T).float() / 0.7).bfloat16().float()
    assert torch.equal(lp16, torch.log_softmax(z16, -1).gather(-1, lab[:, None]).squeeze(-1))


def test_actor_wired_to_vllms_kernels_computes_the_plain_actor(reference_vllm, caplog):
    hf = random_hf_model(61, seed=4)
    ids, lens, mask = random_batch(61, [9, 17, 3], seed=5)
    engines = {}
    for name, top in (("plain", None), ("vllm", SampledDistribution(engine="vllm"))):
        engines[name] = make_engine(hf.config, seed=0, lr=1e-2, true_on_policy=top,
                                    fused_linear_logprob_backend="torch")
        engines[name].load_hf_weights(hf.state_dict())
    # a small head: FlashAttention 3's decode and prefill tiles differ there, which the set says (docs/vllm.md)
    assert hf.config.head_dim <= 64 and "tiles of another size" in caplog.text
    lp, ent = engines["vllm"].forward_logprobs(ids, lens, mask, temperature=0.8)
    ref_lp, ref_ent = engines["plain"].forward_logprobs(ids, lens, mask, temperature=0.8)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    # per forward of the 2-layer model: every norm (2 input, 2 q/k and 1 post-attention a layer, the final one)
    assert reference_vllm == {"rms_norm": 9}
    grads, steps = {}, {}
    for name, eng in engines.items():  # the backward runs through every routed op
        reduce = eng.optim.reduce_grads

        def keep(reduce=reduce, name=name, model=eng.model):  # each parameter's gradient before the step
            out = reduce()
            grads[name] = {k: (p.main_grad if getattr(p, "main_grad", None) is not None else p.grad).clone()
                           for k, p in model.named_parameters()}
            return out

        eng.optim.reduce_grads = keep
        steps[name] = eng.train_step([dict(input_ids=ids, seq_lens=lens, label_mask=mask)],
                                     lambda out, mb: (-(out.logprobs * mb.label_mask).sum(), {}), temperature=0.8)
    assert steps["vllm"]["grad_norm"] == pytest.approx(steps["plain"]["grad_norm"], rel=1e-4)
    assert steps["vllm"]["loss"] == pytest.approx(steps["plain"]["loss"], rel=1e-5)
    assert grads["plain"].keys() == grads["vllm"].keys() and len(grads["plain"]) > 10
    for k, ref in grads["plain"].items():  # every weight's gradient, norms' and embeddings' included
        torch.testing.assert_close(grads["vllm"][k], ref, rtol=1e-4, atol=1e-5 * float(ref.abs().max()),
                                   msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("shape", [{}, dict(norm_topk_prob=False, num_experts=6, num_experts_per_tok=3)])
def test_moe_actor_wired_to_vllms_kernels_computes_the_plain_actor(reference_vllm, shape):
    """A Qwen3-MoE actor through vLLM's router and fused-experts entry points (their semantics above) against the
    plain actor, log-probs and every weight's gradient; with replayed experts that are not the router's own on some
    tokens, against the hf engine's kernel set given the same replay (the rows whose choice differs take the plain
    formula's weights)."""
    seed = int(torch.randint(0, 1000, ()))
    hf = random_moe_model(61, seed=seed, **shape)
    ids, lens, mask = random_batch(61, [9, 17, 3], seed=seed + 1)
    engines = {}
    for name, top in (("plain", None), ("vllm", SampledDistribution(engine="vllm")),
                      ("exact", SampledDistribution())):
        engines[name] = make_engine(hf.config, seed=0, lr=1e-2, true_on_policy=top,
                                    fused_linear_logprob_backend="torch")
        engines[name].load_hf_weights(hf.state_dict())
    lp, ent = engines["vllm"].forward_logprobs(ids, lens, mask, temperature=0.8)
    ref_lp, ref_ent = engines["plain"].forward_logprobs(ids, lens, mask, temperature=0.8)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    layers, k, e = hf.config.num_hidden_layers, hf.config.num_experts_per_tok, hf.config.num_experts
    assert reference_vllm["fused_experts"] == reference_vllm["fused_topk"] == layers
    g = torch.Generator().manual_seed(seed)
    replay = torch.rand(*ids.shape, layers, e, generator=g).argsort(-1)[..., :k]  # distinct experts per token
    lp_v, _ = engines["vllm"].forward_logprobs(ids, lens, mask, temperature=0.8, routed_experts=replay)
    lp_x, _ = engines["exact"].forward_logprobs(ids, lens, mask, temperature=0.8, routed_experts=replay)
    torch.testing.assert_close(lp_v, lp_x, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(lp_v, lp, rtol=1e-3, atol=1e-3)  # the replay changed the routing
    grads = {}
    for name in ("plain", "vllm"):
        eng = engines[name]
        reduce = eng.optim.reduce_grads

        def keep(reduce=reduce, name=name, model=eng.model):
            out = reduce()
            grads[name] = {n: (p.main_grad if getattr(p, "main_grad", None) is not None else p.grad).clone()
                           for n, p in model.named_parameters()}
            return out

        eng.optim.reduce_grads = keep
        eng.train_step([dict(input_ids=ids, seq_lens=lens, label_mask=mask)],
                       lambda out, mb: (-(out.logprobs * mb.label_mask).sum(), {}), temperature=0.8)
    assert grads["plain"].keys() == grads["vllm"].keys()
    assert any("experts" in n for n in grads["plain"]) and any("router" in n for n in grads["plain"])
    for n, ref in grads["plain"].items():  # the experts', the router's, every other weight's
        torch.testing.assert_close(grads["vllm"][n], ref, rtol=1e-4, atol=1e-5 * float(ref.abs().max()) + 1e-12,
                                   msg=lambda m, n=n: f"{n}: {m}")


def test_vllms_residual_norms_are_routed_through_the_add_then_the_row_norm_once():
    """vLLM 0.26's CUDA fused add + RMSNorm gives some rows other bits in a large call (docs/vllm.md): the engine's
    residual norms become the model-dtype add, then the norm it uses without a residual, (normed, sum) returned."""
    seen = []

    def row_norm(x, w, eps=1e-6, residual=None):
        assert residual is None  # the routed path never hands the residual on
        seen.append(x.shape)
        return _norm(x, w, eps)

    layernorm = SimpleNamespace(rms_norm_batch_invariant=row_norm)
    vk.route_residual_norms(layernorm)
    vk.route_residual_norms(layernorm)  # once: a second call wraps nothing
    x, r, w = torch.randn(6, 32).bfloat16(), torch.randn(6, 32).bfloat16(), torch.randn(32).bfloat16()
    out, total = layernorm.rms_norm_batch_invariant(x, w, 1e-6, residual=r)
    assert torch.equal(total, x + r) and torch.equal(out, _norm(x + r, w, 1e-6))
    assert torch.equal(layernorm.rms_norm_batch_invariant(x, w, 1e-6), _norm(x, w, 1e-6))
    assert len(seen) == 2


def test_each_routed_op_has_its_plain_formulas_gradient(reference_vllm):
    """VllmKernels' backwards (the norm's kernel, rotary's rotation back, SiLU-and-mul's products, the recomputed
    attention) against autograd through the plain formulas, op by op, fresh inputs with awkward sizes."""
    from rltrain.models.megatron.invariant import VllmKernels, _plain_attention

    kern = VllmKernels(1e4, 512)
    torch.manual_seed(int(torch.randint(0, 10_000, ())))
    s, b, h, hkv, d = 19, 3, 4, 2, 12

    def grads(fn, *xs):
        xs = [x.detach().clone().requires_grad_() for x in xs]
        out = fn(*xs)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))  # not _like: strides differ
        return torch.autograd.grad(out, xs, g)

    def plain_rope(t):
        ang = torch.arange(s)[:, None].float() * (1.0 / 1e4 ** (torch.arange(0, d, 2).float() / d))
        cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None, None], torch.cat([ang.sin()] * 2, -1)[:, None, None]
        return inv.apply_rope(t, cos, sin)

    x, w = torch.randn(s, b, 40) * 2, torch.rand(40) + 0.5
    q, k, v = torch.randn(b, h, s, d), torch.randn(b, hkv, s, d), torch.randn(b, hkv, s, d)
    hh = torch.randn(s, b, 2 * 24)
    cases = [
        (lambda x, w: kern.norm(x, w, 1e-6), lambda x, w: _norm(x, w, 1e-6), (x, w)),
        (kern.rope, plain_rope, (torch.randn(s, b, h, d),)),
        (kern.glu, lambda t: F.silu(t[..., :24]) * t[..., 24:], (hh,)),
        (lambda q, k, v: kern.attention(q, k, v, d ** -0.5),
         lambda q, k, v: _plain_attention(q, k, v, d ** -0.5), (q, k, v)),
    ]
    for ours, plain, xs in cases:
        for got, ref in zip(grads(ours, *xs), grads(plain, *xs)):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_true_on_policy_engines_carry_the_worker_extension_that_routes_their_norms(monkeypatch):
    """Every engine process routes its residual norms (an engine pool's own processes too: the pool test in
    tests/rollout/test_rollout_vllm.py asks them): vLLM imports the extension the engine is started with."""
    import importlib

    pytest.importorskip("vllm")
    from vllm.model_executor.layers import layernorm

    from rltrain.rollout.vllm_args import true_on_policy_kwargs

    assert true_on_policy_kwargs("cuda")["worker_extension_cls"] == vk.WORKER_EXTENSION
    assert true_on_policy_kwargs("cpu") == {}
    monkeypatch.setattr(layernorm, "rms_norm_batch_invariant", layernorm.rms_norm_batch_invariant)  # restored after
    module, name = vk.WORKER_EXTENSION.rsplit(".", 1)
    importlib.reload(importlib.import_module(module))  # as vLLM's worker process imports it
    ext = getattr(importlib.import_module(module), name)
    assert ext().rltrain_norms_routed() and layernorm.rms_norm_batch_invariant._rltrain_routed
