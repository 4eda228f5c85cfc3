"""ops.norm_grad.rms_norm_backward against autograd through the plain RMSNorm formula in fp64: the torch formula on
CPU, the Triton kernel under TRITON_INTERPRET=1 (a subprocess: the variable must be set before triton is imported),
awkward shapes included (H not a power of two, one row, rows not a multiple of the row tile, non-contiguous input)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rltrain.ops.norm_grad import rms_norm_backward
from test_logprob_triton import HAVE_TRITON, INTERP_PRELUDE, REPO, run_interpreted

CASES = [  # (rows, H, dtype, need_weight_grad)
    (1, 40, torch.float32, True),
    (37, 130, torch.float32, True),
    (70, 64, torch.bfloat16, True),
    (5, 1024, torch.bfloat16, False),
]


def fp64_reference(x, w, g, eps):
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    y = w64 * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps))
    dx, dw = torch.autograd.grad(y, (x64, w64), g.double())
    return dx, dw


def draw(rows, h, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, h, generator=gen) * 3).to(dtype)
    w = (torch.rand(h, generator=gen) + 0.5).to(dtype)
    g = torch.randn(rows, h, generator=gen).to(dtype)
    return x, w, g


def rel(a, b):
    return float((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30))


def check(got_dx, got_dw, ref_dx, ref_dw, dtype, need_w):
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got_dx.dtype == dtype and rel(got_dx, ref_dx) <= tol
    if need_w:
        assert got_dw.dtype == dtype and rel(got_dw, ref_dw) <= tol
    else:
        assert got_dw is None


@pytest.mark.parametrize("rows,h,dtype,need_w", CASES)
def test_torch_formula_is_autograd_of_the_plain_norm(rows, h, dtype, need_w):
    x, w, g = draw(rows, h, dtype, seed=rows * h)
    dx, dw = rms_norm_backward(x, w, g, 1e-6, need_weight_grad=need_w)
    check(dx, dw, *fp64_reference(x, w, g, 1e-6), dtype, need_w)


def test_leading_dims_and_non_contiguous_input():
    base = torch.randn(3, 5, 2, 48)  # [s, b, heads, d] with heads taken from a wider tensor (as q/k from fused QKV)
    x = torch.cat([base, torch.randn(3, 5, 1, 48)], dim=2)[:, :, :2]
    w, g = torch.rand(48) + 0.5, torch.randn(3, 5, 2, 48)
    dx, dw = rms_norm_backward(x, w, g, 1e-5)
    rdx, rdw = fp64_reference(x, w, g, 1e-5)
    assert dx.shape == x.shape and rel(dx, rdx) <= 1e-5 and rel(dw, rdw) <= 1e-5


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="disagree"):
        rms_norm_backward(torch.randn(4, 8), torch.randn(7), torch.randn(4, 8), 1e-6)


_INTERP_SCRIPT = INTERP_PRELUDE + r"""
import torch
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[2])
from rltrain.ops import norm_grad
from test_norm_grad import CASES, draw, fp64_reference, rel
out = []
for seed, (rows, h, dtype, need_w) in enumerate(CASES + [(300, 24, torch.float32, True)]):
    x, w, g = draw(rows, h, dtype, seed)
    dx, dw = norm_grad.rms_norm_backward(x, w, g, 1e-6, need_weight_grad=need_w)
    rdx, rdw = fp64_reference(x, w, g, 1e-6)
    out.append(dict(dtype=str(dtype), dx=rel(dx, rdx), dw=rel(dw, rdw) if need_w else None, dw_none=dw is None))
print("RESULT" + json.dumps(out))
"""


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed in this environment (pip install triton)")
def test_triton_kernel_under_the_interpreter():
    results = run_interpreted(_INTERP_SCRIPT, str(REPO), str(Path(__file__).parent))
    assert len(results) == len(CASES) + 1
    for r, case in zip(results, CASES + [(300, 24, torch.float32, True)]):
        tol = 1e-5 if r["dtype"] == "torch.float32" else 2e-2
        assert r["dx"] <= tol, r
        assert (r["dw"] <= tol) if case[3] else r["dw_none"], r


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_kernel_on_gpu():
    for seed, (rows, h) in enumerate([(1, 40), (16384, 1024), (262144, 128), (333, 4096)]):
        x, w, g = (t.cuda() for t in draw(rows, h, torch.bfloat16, seed))
        dx, dw = rms_norm_backward(x, w, g, 1e-6)
        rdx, rdw = fp64_reference(x, w, g, 1e-6)
        assert rel(dx, rdx) <= 2e-2 and rel(dw, rdw) <= 2e-2
