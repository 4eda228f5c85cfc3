"""The fused head's batch-invariant mode (logprobs_from_hidden(batch_invariant=True)): on the torch backend the
sampler's log-prob bits (ops.invariant) in any chunking and row count, values and gradients as the plain head's (an
fp64 autograd reference where top-k / top-p filter); on the Triton backend under TRITON_INTERPRET=1, each row's
statistics the same bits whatever the number of rows."""

from __future__ import annotations

import importlib.util
import math
import random
from pathlib import Path

import pytest
import torch

from rltrain.ops import invariant as inv
from rltrain.ops import logprobs_from_hidden
from test_logprob_triton import INTERP_PRELUDE, run_interpreted

REPO = Path(__file__).resolve().parents[2]
HAVE_TRITON = importlib.util.find_spec("triton") is not None


def _inputs(t, h, v, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, h, generator=g)
    weight = torch.randn(v, h, generator=g) * (2.0 / h ** 0.5)
    return hidden, weight, torch.randint(0, v, (t,), generator=g)


@pytest.mark.parametrize("t,h,v,temperature,top_k,top_p", [(1, 8, 5, 1.0, -1, 1.0), (29, 24, 123, 0.7, -1, 1.0),
                                                           (40, 16, 257, 1.0, 20, 0.9), (17, 32, 130, 1.3, -1, 0.85)])
def test_torch_mode_gives_the_sampler_bits_in_any_chunking(t, h, v, temperature, top_k, top_p):
    seed = random.randrange(2**31)
    hidden, weight, labels = _inputs(t, h, v, seed)
    sampler = inv.log_softmax(inv.linear(hidden, weight), temperature, top_k, top_p)
    labels = torch.multinomial(sampler.exp(), 1, generator=torch.Generator().manual_seed(seed)).squeeze(-1)
    want = sampler.gather(-1, labels[:, None]).squeeze(-1).float()
    kw = dict(backend="torch", batch_invariant=True, temperature=temperature, top_k=top_k, top_p=top_p)
    for chunk in (None, 1, 3, 64):
        lp, ent = logprobs_from_hidden(hidden, weight, labels, chunk_size=chunk, **kw)
        assert torch.equal(lp, want), (seed, chunk)
    rows = torch.rand(t, generator=torch.Generator().manual_seed(seed)) < 0.5
    lp_rows, _ = logprobs_from_hidden(hidden, weight, labels, rows=rows, **kw)
    assert torch.equal(lp_rows[rows], want[rows]) and (lp_rows[~rows] == 0).all(), seed
    if top_k <= 0 and top_p >= 1.0:
        plain, plain_ent = logprobs_from_hidden(hidden, weight, labels, backend="torch", temperature=temperature)
        torch.testing.assert_close(lp, plain, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent, plain_ent, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("top_k,top_p", [(-1, 1.0), (7, 1.0), (-1, 0.8), (30, 0.95)])
def test_torch_mode_gradients_are_the_sampled_distributions(top_k, top_p):
    seed = random.randrange(2**31)
    t, h, v, temperature = 23, 16, 97, 0.9
    hidden, weight, _ = _inputs(t, h, v, seed)
    logits = inv.linear(hidden, weight)
    keep = torch.isfinite(inv.log_softmax(logits, temperature, top_k, top_p))
    labels = torch.multinomial(keep.double(), 1, generator=torch.Generator().manual_seed(seed)).squeeze(-1)
    g_lp, g_ent = torch.randn(t), torch.randn(t)
    hg, wg = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = logprobs_from_hidden(hg, wg, labels, backend="torch", batch_invariant=True, temperature=temperature,
                                   top_k=top_k, top_p=top_p, chunk_size=5)
    grads = torch.autograd.grad((lp * g_lp + ent * g_ent).sum(), (hg, wg))
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    z = ((h64 @ w64.T) / temperature).masked_fill(~keep, -math.inf)
    ref_lp = torch.log_softmax(z, -1)
    p = ref_lp.exp()
    ref_ent = -(p * ref_lp.masked_fill(~keep, 0.0)).sum(-1)
    ref_lp = ref_lp.gather(-1, labels[:, None]).squeeze(-1)
    torch.testing.assert_close(lp.double(), ref_lp.detach(), rtol=1e-5, atol=1e-5)
    ref = torch.autograd.grad((ref_lp * g_lp.double() + ref_ent * g_ent.double()).sum(), (h64, w64))
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)


def test_batch_invariant_mode_refuses_what_it_cannot_do():
    from rltrain.ops import logprob_cute, logprob_triton
    from rltrain.ops.logprob import _batch_invariant

    with pytest.raises(ValueError, match="top_k"):
        _batch_invariant(logprob_triton, None, 5, 1.0)  # the Triton mode has no top-k / top-p
    with pytest.raises(ValueError, match="not available"):
        _batch_invariant(logprob_cute, None, -1, 1.0)


_INTERP_SCRIPT = INTERP_PRELUDE + r"""
import torch
sys.path.insert(0, sys.argv[1])
from rltrain.ops import logprob_triton
from rltrain.ops.logprob import _TritonInvariant
INV = _TritonInvariant(logprob_triton)
g = torch.Generator().manual_seed(int(sys.argv[2]))
n, h, v = 70, 24, 2567  # two fp32 token blocks of 64; 41 vocab tiles of 64 (the last partial)
hid, w = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g) * 0.5
lab = torch.randint(0, v, (n,), generator=g)
out = {"same": [], "plain_same": [], "lp": 0.0}
for invariant in (True, False):
    stats = INV.forward_stats if invariant else logprob_triton.forward_stats
    full = stats(hid, w, lab, 1 / 1.3, True, None)
    # row sets starting on a token block: the interpreter's dot is numpy's BLAS, whose result for a row may depend on
    # the row's place in the block (a GPU's MMA does not; tests below under `gpu` take any rows)
    for rows in (slice(0, 1), slice(64, 70)):
        part = stats(hid[rows], w, lab[rows], 1 / 1.3, True, None)
        out["same" if invariant else "plain_same"].append(all(bool(torch.equal(a, b[rows])) for a, b in zip(part, full)))
    if invariant:
        m, s, t, zl = full
        z = (hid.double() @ w.double().T) / 1.3
        ref = z.gather(1, lab[:, None])[:, 0] - torch.logsumexp(z, 1)
        out["lp"] = float(((zl - m - torch.log(s)).double() - ref).abs().max())
print("RESULT" + json.dumps(out))
"""


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed in this environment")
def test_triton_mode_rows_are_the_same_bits_for_any_number_of_rows_under_the_interpreter():
    got = run_interpreted(_INTERP_SCRIPT, str(REPO), str(random.randrange(2**31)))
    assert got["same"] == [True, True], got
    # the control: the default split count follows the number of token blocks (41 vocab tiles: 7 splits for one
    # block, 6 for two), so a row's merge order, and with it its bits, can change with the rows beside it; the two
    # row sets' 7 rows all agreeing to the last bit in both orders would need every sum to round alike
    assert not all(got["plain_same"]), got
    assert got["lp"] < 1e-4, got


@pytest.mark.gpu
@pytest.mark.skipif(not (HAVE_TRITON and torch.cuda.is_available()), reason="needs triton and a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_mode_any_rows_are_the_same_bits_on_a_gpu(dtype):
    from rltrain.ops import logprob_triton
    from rltrain.ops.logprob import _TritonInvariant

    stats = _TritonInvariant(logprob_triton).forward_stats
    seed = random.randrange(2**31)
    hidden, weight, labels = (x.cuda() for x in _inputs(3000, 1024, 151_936 // 8, seed))
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    full = stats(hidden, weight, labels, 1.0, True, None)
    for rows in (slice(0, 1), slice(5, 6), slice(17, 1400), torch.randperm(3000, device="cuda")[:777]):
        part = stats(hidden[rows].contiguous(), weight, labels[rows].contiguous(), 1.0, True, None)
        assert all(torch.equal(a, b[rows]) for a, b in zip(part, full)), (seed, rows)


def test_another_engines_log_prob_is_the_value_to_the_bit_and_the_fused_head_gives_entropy_and_gradient():
    """exact_logprob (rollout.true_on_policy with vLLM: its kernels' log-prob): returned bit for bit, chunk by chunk;
    the entropy and the gradients are the fused head's own; without entropy or gradient only it runs."""
    torch.manual_seed(random.randrange(1 << 30))
    n, h, v = 37, 16, 203  # the vocab not a multiple of any tile, 4 chunks of 10 rows
    hidden, weight = torch.randn(n, h, requires_grad=True), torch.randn(v, h, requires_grad=True)
    labels = torch.randint(0, v, (n,))
    calls = []

    def exact(hc, w, lab, temperature):  # fp64, rounded once: other bits than the fused head's fp32 ones
        calls.append(hc.shape[0])
        z = (hc.double() @ w.double().T) / temperature
        return torch.log_softmax(z, -1).gather(-1, lab[:, None]).squeeze(-1).float()

    lp, ent = logprobs_from_hidden(hidden, weight, labels, backend="torch", temperature=0.8, chunk_size=10,
                                   exact_logprob=exact)
    assert torch.equal(lp, exact(hidden.detach(), weight.detach(), labels, 0.8)) and calls[:4] == [10, 10, 10, 7]
    plain_lp, plain_ent = logprobs_from_hidden(hidden, weight, labels, backend="torch", temperature=0.8, chunk_size=10)
    assert not torch.equal(lp, plain_lp) and torch.equal(ent, plain_ent)
    g_lp, g_ent = torch.randn(n), torch.randn(n)
    got = torch.autograd.grad((lp * g_lp + ent * g_ent).sum(), (hidden, weight))
    want = torch.autograd.grad((plain_lp * g_lp + plain_ent * g_ent).sum(), (hidden, weight))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    calls.clear()
    with torch.no_grad():
        only, none = logprobs_from_hidden(hidden, weight, labels, backend="torch", temperature=0.8, chunk_size=10,
                                          with_entropy=False, exact_logprob=exact)
    assert none is None and torch.equal(only, lp.detach()) and calls == [10, 10, 10, 7]
    with pytest.raises(ValueError, match="no batch_invariant, top_k or top_p"):
        logprobs_from_hidden(hidden, weight, labels, backend="torch", top_k=5, batch_invariant=True,
                             exact_logprob=exact)
