"""ops/exact.py and ops/invariant.py: each op against its plain version and an fp64 reference (values to fp32
rounding, gradients the plain op's), and bit for bit against itself across batch sizes, row orders, chunkings,
padding and prefix layouts. Fresh random inputs each run (the seed is in the failure message)."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from rltrain.ops import exact, invariant as inv
from rltrain.rollout.hf import filter_top_k_top_p


@pytest.fixture
def seed():
    s = random.randrange(2**31)
    torch.manual_seed(s)
    return s


def _rounded_once(a: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor) -> bool:
    """a is ref rounded to fp32 once: within half an fp32 spacing of ref, plus what the two slices leave out of
    the exact value (ops/exact.py: under 2^-35 of sum |x_k w_k|)."""
    return bool(((a.double() - ref).abs() <= 0.5 * torch.finfo(torch.float32).eps * ref.abs() * 1.0001
                 + 2.0 ** -35 * scale).all())


@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (7, 65, 5), (33, 24, 123), (130, 128, 40)])
def test_exact_matmul_is_accurate_and_each_row_ignores_the_others(m, k, n, seed):
    a, b = torch.randn(m, k) * 3, torch.randn(k, n)
    a[0, : k // 2] *= 1e-6  # small entries beside large ones on one row
    got = exact.exact_matmul(a, b)
    ref = a.double() @ b.double()
    scale = a.double().abs() @ b.double().abs()
    assert float(((got - ref).abs() / scale.clamp_min(1e-300)).max()) < 2.0 ** -35, seed
    perm = torch.randperm(m)
    assert torch.equal(exact.exact_matmul(a[perm], b), got[perm]), seed  # other rows, other order, other count
    assert torch.equal(exact.exact_matmul(a[m // 2:], b), got[m // 2:]), seed
    assert torch.equal(exact.exact_matmul(a[:, None], b)[:, 0], got), seed  # one row at a time (batched GEMMs)
    padded = exact.exact_matmul(torch.cat([a, torch.zeros(m, 3)], 1), torch.cat([b, torch.zeros(3, n)], 0))
    assert torch.equal(padded, got), seed  # zeros appended to the reduction change nothing


def test_exact_sum_and_cumsum_are_independent_of_order_and_zeros(seed):
    x = torch.randn(6, 1001) * torch.logspace(-8, 8, 1001)  # 16 orders of magnitude on one line
    s = exact.exact_sum(x, -1)
    for row, total in zip(x.double().tolist(), s.tolist()):
        assert total == pytest.approx(math.fsum(row), rel=1e-15, abs=1e-300), seed
    shuffled = torch.cat([torch.zeros(6, 9), x[:, torch.randperm(1001)], torch.zeros(6, 4)], 1)
    assert torch.equal(exact.exact_sum(shuffled, -1), s), seed
    assert torch.equal(exact.exact_sum(x.t(), 0), s), seed
    c = exact.exact_cumsum(x, -1)
    assert torch.equal(c[:, -1], s), seed
    perm = torch.randperm(6)
    assert torch.equal(exact.exact_cumsum(x[perm], -1), c[perm]), seed


def test_exp_and_log_match_libm_in_fp64(seed):
    x = torch.randn(20000, dtype=torch.float64) * 200
    ref = torch.exp(x)
    ok = (ref > 1e-300) & torch.isfinite(ref)
    assert torch.equal(exact.exp(x)[~ok] > 1, ref[~ok] > 1), seed  # inf above, 0 below
    rel = ((exact.exp(x) - ref).abs() / ref.clamp_min(1e-300))[ok]
    assert float(rel.max()) < 1e-15, seed
    assert exact.exp(torch.tensor([0.0, -math.inf, math.inf, -800.0, 800.0])).tolist() == [1.0, 0.0, math.inf, 0.0,
                                                                                             math.inf]
    y = torch.rand(20000, dtype=torch.float64) * 1e6 + 1e-12
    assert float(((exact.log(y) - torch.log(y)).abs() / torch.log(y).abs().clamp_min(1e-6)).max()) < 1e-15, seed
    special = exact.log(torch.tensor([0.0, 1.0, math.inf, -1.0]))
    assert special[:3].tolist() == [-math.inf, 0.0, math.inf] and math.isnan(special[3])


@pytest.mark.parametrize("rows,k,n", [(1, 64, 96), (37, 65, 5), (300, 24, 123)])
def test_linear_rounds_the_exact_value_once_and_its_grad_is_the_plain_one(rows, k, n, seed):
    x = torch.randn(rows, k, requires_grad=True)
    w = (torch.randn(n, k) / k ** 0.5).requires_grad_()
    bias = torch.randn(n, requires_grad=True)
    y = inv.linear(x, w, bias)
    ref = x.double() @ w.double().T
    with torch.no_grad():  # the product rounded once (a plain GEMM rounds at every step of its sum)
        assert _rounded_once(inv.linear(x, w), ref, x.double().abs() @ w.double().abs().T), seed
    g = torch.randn(rows, n)
    grads = torch.autograd.grad((y * g).sum(), (x, w, bias))
    plain = torch.autograd.grad((F.linear(x, w, bias) * g).sum(), (x, w, bias))
    for a, b in zip(grads, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        x3 = x.detach().reshape(1, rows, k)
        assert torch.equal(inv.linear(x3, w, bias)[0], y.detach()), seed
        assert torch.equal(inv.linear(x.detach()[rows // 2:], w, bias), y.detach()[rows // 2:]), seed


def test_another_linear_arithmetic_runs_once_and_takes_the_plain_gradient_of_3d_inputs_without_bias():
    calls = []

    def other(x, w, *b):  # another arithmetic of the same product (fp64, rounded), counted
        calls.append(x.shape)
        return (x.double() @ w.double().T).to(x.dtype)

    x = torch.randn(3, 5, 7, requires_grad=True)
    w = torch.randn(4, 7, requires_grad=True)
    y = inv.linear_with_plain_backward(other, x, w)
    g = torch.randn(3, 5, 4)
    grads = torch.autograd.grad((y * g).sum(), (x, w))
    plain = torch.autograd.grad((F.linear(x, w) * g).sum(), (x, w))
    assert len(calls) == 1  # the backward needs no recomputed output
    for a, b in zip(grads, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    x_only = torch.randn(2, 7, requires_grad=True)
    (gx,) = torch.autograd.grad(inv.linear_with_plain_backward(other, x_only, w.detach()).sum(), (x_only,))
    torch.testing.assert_close(gx, w.detach().sum(0).expand(2, 7))

def test_rms_norm_and_silu_match_plain_and_are_position_free(seed):
    x = torch.randn(9, 5, 24) * 4
    w = torch.randn(24)
    plain = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    got = inv.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(got, plain, rtol=2e-6, atol=1e-6)
    assert torch.equal(inv.rms_norm(x[3:4, 2:], w, 1e-6), got[3:4, 2:]), seed
    s = inv.silu(x)
    torch.testing.assert_close(s, F.silu(x), rtol=2e-7, atol=1e-7)
    assert torch.equal(inv.silu(x.flatten()[5:23]), s.flatten()[5:23]), seed  # no tail-element code path
    xg = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(inv.silu(xg).sum() + inv.rms_norm(xg, w, 1e-6).sum(), xg)
    xp = x.clone().requires_grad_()
    (gp,) = torch.autograd.grad(F.silu(xp).sum() + (w * (xp * torch.rsqrt(xp.pow(2).mean(-1, keepdim=True)
                                                                            + 1e-6))).sum(), xp)
    torch.testing.assert_close(g, gp)


def test_rope_table_and_rotation_match_transformers(seed):
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    pos = torch.randint(0, 3000, (2, 7))
    cos, sin = inv.rope_cos_sin(pos, 24, 1e6, torch.float64)
    inv_freq = 1.0 / 1e6 ** (torch.arange(0, 24, 2, dtype=torch.float64) / 24)
    ang = pos[..., None].double() * torch.cat([inv_freq, inv_freq])
    torch.testing.assert_close(cos, torch.cos(ang), rtol=0, atol=1e-15)
    torch.testing.assert_close(sin, torch.sin(ang), rtol=0, atol=1e-15)
    c32, s32 = inv.rope_cos_sin(pos, 24, 1e6, torch.float32)
    assert torch.equal(inv.rope_cos_sin(pos[1:, 3:], 24, 1e6, torch.float32)[0], c32[1:, 3:])
    q, k = torch.randn(2, 4, 7, 24), torch.randn(2, 2, 7, 24)
    ref_q, ref_k = apply_rotary_pos_emb(q, k, c32, s32)
    assert torch.equal(inv.apply_rope(q, c32[:, None], s32[:, None]), ref_q), seed
    assert torch.equal(inv.apply_rope(k, c32[:, None], s32[:, None]), ref_k), seed


def _causal(lq, lk, offset=0):
    i = torch.arange(lq)[:, None] + (lk - lq)
    j = torch.arange(lk)[None, :]
    return (j <= i) & (j >= offset)


def test_attention_matches_sdpa_and_a_query_sees_only_its_keys(seed):
    b, h, hkv, s, d = 3, 4, 2, 11, 24
    q, k, v = torch.randn(b, h, s, d), torch.randn(b, hkv, s, d), torch.randn(b, hkv, s, d)
    valid = _causal(s, s)[None, None]
    got = inv.attention(q, k, v, valid, d ** -0.5)
    ref = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(2, 1),
                                         v.double().repeat_interleave(2, 1), attn_mask=valid, scale=d ** -0.5)
    torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-6)
    # query t of row 1 as a decode step: its prefix left-padded by 5 garbage keys, in a batch of another row
    t = 6
    pad = 5
    kq = torch.cat([torch.randn(1, hkv, pad, d) * 50, k[1:2, :, : t + 1]], 2)
    vq = torch.cat([torch.randn(1, hkv, pad, d) * 50, v[1:2, :, : t + 1]], 2)
    kk, vv = torch.cat([kq, torch.randn(1, hkv, pad + t + 1, d)]), torch.cat([vq, torch.randn(1, hkv, pad + t + 1, d)])
    mask = torch.stack([_causal(1, pad + t + 1, offset=pad), _causal(1, pad + t + 1)])[:, None]
    dec = inv.attention(torch.stack([q[1, :, t:t + 1], torch.randn(h, 1, d)]), kk, vv, mask, d ** -0.5)
    assert torch.equal(dec[0, :, 0], got[1, :, t]), seed
    none = inv.attention(q[:1, :, :1], k[:1], v[:1], torch.zeros(1, 1, 1, s, dtype=torch.bool), d ** -0.5)
    assert torch.equal(none, torch.zeros_like(none))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    grads = torch.autograd.grad(inv.attention(qg, kg, vg, valid, d ** -0.5).square().sum(), (qg, kg, vg))
    qp, kp, vp = (x.clone().requires_grad_() for x in (q, k, v))
    plain = F.scaled_dot_product_attention(qp, kp.repeat_interleave(2, 1), vp.repeat_interleave(2, 1),
                                           attn_mask=valid, scale=d ** -0.5)
    for a, bb in zip(grads, torch.autograd.grad(plain.square().sum(), (qp, kp, vp))):
        torch.testing.assert_close(a, bb, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, 5, 1.0), (1.3, -1, 0.8),
                                                     (1.0, 40, 0.95), (1.0, 1, 1.0)])
def test_log_softmax_is_the_renormalized_sampled_distribution(temperature, top_k, top_p, seed):
    logits = torch.randn(13, 123) * 3
    lp = inv.log_softmax(logits, temperature, top_k, top_p)
    kept = torch.isfinite(filter_top_k_top_p(logits.double() / temperature, top_k, top_p))  # the hf engine's rule
    assert torch.equal(torch.isfinite(lp), kept), seed
    ref = torch.log_softmax((logits.double() / temperature).masked_fill(~kept, -math.inf), -1)
    torch.testing.assert_close(lp[kept], ref[kept], rtol=0, atol=1e-14)
    labels = torch.multinomial(lp.exp(), 1).squeeze(-1)
    got_lp, ent, lse, mean_z, keep = inv.token_stats(logits, labels, temperature, top_k, top_p)
    assert torch.equal(got_lp, lp.gather(-1, labels[:, None]).squeeze(-1).float()), seed  # the sampler's bits
    p = ref.exp().nan_to_num(0.0)
    torch.testing.assert_close(ent.double(), -(p * ref.nan_to_num(0.0, neginf=0.0)).sum(-1), rtol=1e-6, atol=1e-6)
    assert (keep is None) == (top_k <= 0 and top_p >= 1.0)
    assert torch.equal(inv.token_stats(logits[4:9], labels[4:9], temperature, top_k, top_p)[0], got_lp[4:9])


def test_moe_route_and_experts_match_transformers_and_ignore_slot_order(seed):
    t, hdim, i, e, k = 17, 16, 8, 5, 2
    x, logits = torch.randn(t, hdim), torch.randn(t, e) * 2
    gate_up, down = torch.randn(e, 2 * i, hdim) / 4, torch.randn(e, hdim, i) / 3
    weights, experts = inv.moe_route(logits, k, normalize=True)
    probs = torch.softmax(logits.double(), -1)
    top = torch.topk(probs, k, -1)
    assert torch.equal(experts, top.indices), seed
    torch.testing.assert_close(weights.double(), top.values / top.values.sum(-1, keepdim=True), rtol=1e-6, atol=0)
    out = inv.moe_experts(x, experts, weights, gate_up, down)
    ref = torch.zeros(t, hdim, dtype=torch.float64)
    for tok in range(t):
        for slot in range(k):
            g, u = (gate_up[experts[tok, slot]].double() @ x[tok].double()).chunk(2)
            ref[tok] += weights[tok, slot].double() * (down[experts[tok, slot]].double() @ (F.silu(g) * u))
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    swapped = inv.moe_experts(x, experts.flip(-1), weights.flip(-1), gate_up, down)
    assert torch.equal(swapped, out), seed
    assert torch.equal(inv.moe_experts(x[5:9], experts[5:9], weights[5:9], gate_up, down), out[5:9]), seed
