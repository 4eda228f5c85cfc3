"""Parity of the Triton log-prob kernels (`rltrain.ops.logprob_triton`) with fp64 math: on CPU under
TRITON_INTERPRET=1 at tiny shapes (so CI runs the kernel code), and on a CUDA GPU at real shapes (`gpu`)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
HAVE_TRITON = importlib.util.find_spec("triton") is not None
HAVE_CUDA = torch.cuda.is_available()


def fp64_reference(hidden, weight, labels_local, inv_temp, grad_lp, grad_ent):
    """Materialized fp64 logits of the (already rounded) inputs: lp (label -1 -> z_label = 0), entropy,
    and the grads of sum(grad_lp * lp + grad_ent * entropy) w.r.t. hidden and weight."""
    h = hidden.detach().double().cpu().requires_grad_(True)
    w = weight.detach().double().cpu().requires_grad_(True)
    lab = labels_local.cpu()
    z = (h @ w.T) * inv_temp  # [N, V]
    lse = torch.logsumexp(z, dim=1)
    z_label = torch.where(lab >= 0, z.gather(1, lab.clamp(min=0)[:, None])[:, 0], torch.zeros_like(lse))
    lp = z_label - lse
    p = torch.softmax(z, dim=1)
    ent = lse - (p * z).sum(1)
    loss = (grad_lp.double().cpu() * lp).sum()
    if grad_ent is not None:
        loss = loss + (grad_ent.double().cpu() * ent).sum()
    loss.backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def rel(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def run_kernels(mod, hidden, weight, labels_local, inv_temp, grad_lp, grad_ent, chunk_size=None, **tuning):
    """lp, entropy (single shard: lse = m + log s) and grads through the backend's two functions (`tuning`:
    the Triton backend's `tuning=` keyword)."""
    m, s, t, zl = mod.forward_stats(hidden, weight, labels_local, inv_temp, True, chunk_size, **tuning)
    lse = m + torch.log(s)
    mean_z = t / s
    gh, gw = mod.backward(hidden, weight, labels_local, lse, mean_z, grad_lp, grad_ent, inv_temp,
                          True, True, chunk_size, **tuning)
    return zl - lse, lse - mean_z, gh, gw


# The interpreter check runs in a subprocess: TRITON_INTERPRET must be set before triton is imported.
# Triton 3.6's interpreter converts loop bounds with int(ndarray of shape (1,)), which numpy >= 2.4
# rejects; the shim below converts through .reshape(-1)[0] (test-only, does not touch the kernels).
INTERP_PRELUDE = r"""
import json, os, sys
os.environ["TRITON_INTERPRET"] = "1"
import numpy as np
import triton.runtime.interpreter as _interp
_orig = _interp._patch_lang_tensor
def _patched(tensor, scope):
    _orig(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))
_interp._patch_lang_tensor = _patched
"""


def run_interpreted(script: str, *args: str):
    """Run `script` (INTERP_PRELUDE + code printing "RESULT" + JSON) under TRITON_INTERPRET=1 with no GPU visible, in
    a subprocess (the variable must be set before triton is imported); returns the JSON value."""
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1][len("RESULT"):])


_INTERP_SCRIPT = INTERP_PRELUDE + r"""
import torch
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[2])
from rltrain.ops import logprob_triton as K
from test_logprob_triton import fp64_reference, rel, run_kernels
TINY = K.TritonTuning(bwd_budget_bytes=64 * 1024)  # tiny budget: several token chunks and vocab slices
out = []
for seed, (n, h, v, dtype, temp, chunk, ent) in enumerate([
        (5, 40, 123, torch.float32, 0.7, None, True),     # odd V, odd H (masked K loop), label -1
        (1, 32, 5, torch.float32, 1.0, None, True),       # T=1, V smaller than one tile
        (150, 48, 300, torch.float32, 1.3, 32, True),     # 5 token chunks of 32 x vocab slices
        (70, 64, 600, torch.float16, 1.0, None, False),   # low-precision path, no entropy gradient
        (130, 64, 260, torch.float16, 0.5, None, True)]):  # 2 token blocks, 2 vocab tiles (last masked)
    g = torch.Generator().manual_seed(1000 + seed)
    hid = torch.randn(n, h, generator=g).to(dtype)
    w = (torch.randn(v, h, generator=g) * 0.5).to(dtype)
    lab = torch.randint(0, v, (n,), generator=g)
    lab[torch.rand(n, generator=g) < 0.2] = -1
    glp = torch.randn(n, generator=g)
    gent = torch.randn(n, generator=g) if ent else None
    lp, en, gh, gw = run_kernels(K, hid, w, lab, 1.0 / temp, glp, gent, chunk, tuning=TINY)
    r_lp, r_en, r_gh, r_gw = fp64_reference(hid, w, lab, 1.0 / temp, glp, gent)
    m, s, t, zl = K.forward_stats(hid, w, lab, 1.0 / temp, False, None, tuning=TINY)
    out.append(dict(shape=[n, h, v], dtype=str(dtype), lp=rel(lp, r_lp), ent=rel(en, r_en),
                    gh=rel(gh, r_gh), gw=rel(gw, r_gw), t_without_entropy=float(t.abs().max()),
                    lp_without_entropy=rel(zl - m - torch.log(s), r_lp),
                    gh_dtype=str(gh.dtype), finite=bool(torch.isfinite(gh).all() and torch.isfinite(gw).all())))
# several vocab splits merged by log-sum-exp (what real vocab sizes get on a GPU; the shapes above fit one split)
g = torch.Generator().manual_seed(77)
n, v = 37, 700  # 11 fp32 vocab tiles of 64, the last partial; 4 splits of 3 tiles, the last of 2
hid, w = torch.randn(n, 40, generator=g), torch.randn(v, 40, generator=g) * 0.5
lab = torch.randint(0, v, (n,), generator=g)
lab[:3] = -1  # the label is on another tensor-parallel rank
lab[3] = v + 5  # outside this shard (the backend's caller never passes one): no read of w past its end, z_label 0
m, s, t, zl = K.forward_stats(hid, w, lab, 1.0 / 1.3, True, None, num_splits=4)
r_lp, r_en, _, _ = fp64_reference(hid, w, torch.where(lab >= v, -1, lab), 1.0 / 1.3, torch.zeros(n), None)
lse = m + torch.log(s)
split = dict(lp=rel(zl - lse, r_lp), ent=rel(lse - t / s, r_en), zl_off_shard=float(zl[:4].abs().max()))
print("RESULT" + json.dumps(dict(cases=out, split=split)))
"""


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed in this environment (pip install triton)")
def test_interpreter_kernels_match_fp64_on_cpu():
    got = run_interpreted(_INTERP_SCRIPT, str(REPO), str(Path(__file__).parent))
    results = got["cases"]
    assert got["split"]["lp"] <= 1e-5 and got["split"]["ent"] <= 1e-5, got["split"]
    assert got["split"]["zl_off_shard"] == 0.0, got["split"]
    assert len(results) == 5
    for r in results:
        low = "float16" in r["dtype"]
        assert r["finite"], r
        assert r["lp"] <= 1e-5 and r["ent"] <= 1e-5, r
        assert r["lp_without_entropy"] <= 1e-5 and r["t_without_entropy"] == 0.0, r
        assert r["gh"] <= (5e-3 if low else 1e-5) and r["gw"] <= (5e-3 if low else 1e-5), r
        assert r["gh_dtype"] == r["dtype"], r


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed in this environment")
@pytest.mark.parametrize("n_m,n_tiles,sms,expected", [
    (32, 1187, 132, 16),   # 8,192 tokens / 256: 17 splits = 544 programs = 4.12 waves; 16 = 512 = 3.88 waves
    (128, 1187, 132, 8),   # 32,768 tokens: 8 splits = 1,024 programs = 7.76 waves (no fuller count in 4..8)
    (1, 1187, 132, 132),   # one token block: 132 splits of 9 tiles = one full wave (not 238 of 5: 1.8 waves)
    (1, 3, 132, 1),        # fewer than 4 vocab tiles: one split
])
def test_forward_split_count_fills_the_last_wave(n_m, n_tiles, sms, expected):
    from rltrain.ops import logprob_triton as K

    assert K._fwd_splits(n_m, n_tiles, sms) == expected


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed in this environment")
def test_tuning_defaults_and_sizes_follow_the_budget():
    """DEFAULT_TUNING holds the H100-tuned values, a launcher given no tuning uses it (there are no module-global
    knobs), it is frozen, and a smaller budget gives smaller backward buffers."""
    from rltrain.ops import logprob_triton as K

    assert K._tuning(None) == K.DEFAULT_TUNING == K.TritonTuning()
    assert K.DEFAULT_TUNING.tile("fwd", torch.bfloat16) == (256, 128, 64, 8, 3)
    assert K.DEFAULT_TUNING.tile("bwd", torch.float32) == (64, 64, 32, 4, 2)
    assert K.DEFAULT_TUNING.bwd_budget_bytes == 256 * 2**20 and K.DEFAULT_TUNING.fwd_min_splits == 8
    big = K._bwd_extra_bytes(65536, 151936, 2560, torch.bfloat16)
    small = K._bwd_extra_bytes(65536, 151936, 2560, torch.bfloat16, K.TritonTuning(bwd_budget_bytes=96 * 2**20))
    assert big == K._bwd_extra_bytes(65536, 151936, 2560, torch.bfloat16, K.DEFAULT_TUNING)
    assert 0 < small <= 96 * 2**20 < big <= 256 * 2**20
    with pytest.raises(dataclasses.FrozenInstanceError):
        K.DEFAULT_TUNING.use_desc = False
    legacy = ("_CONFIGS", "_FWD_MIN_SPLITS", "_FWD_FLATTEN", "_USE_DESC", "_BWD_BUDGET_BYTES")
    assert not any(hasattr(K, g) for g in legacy)


def test_is_available_needs_cuda():
    from rltrain.ops import logprob_triton

    assert logprob_triton.is_available() == (HAVE_TRITON and HAVE_CUDA)


GPU_CASES = [  # (N, H, V, dtype, temperature)
    (257, 256, 151936, torch.bfloat16, 1.0),
    (300, 512, 151936, torch.float32, 0.8),
    (1, 128, 151936, torch.bfloat16, 1.0),
    (1, 64, 5, torch.float32, 1.0),
    (999, 200, 123, torch.bfloat16, 1.7),
    (513, 96, 123, torch.float32, 1.0),
]


@pytest.mark.gpu
@pytest.mark.skipif(not (HAVE_CUDA and HAVE_TRITON), reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("n,h,v,dtype,temp", GPU_CASES)
@pytest.mark.parametrize("with_grad_ent", [True, False])
def test_gpu_kernels_match_fp64(n, h, v, dtype, temp, with_grad_ent):
    from rltrain.ops import logprob_triton as K

    g = torch.Generator(device="cuda").manual_seed(n * 7 + v)
    hid = torch.randn(n, h, device="cuda", generator=g).to(dtype)
    w = (torch.randn(v, h, device="cuda", generator=g) * 0.3).to(dtype)
    lab = torch.randint(0, v, (n,), device="cuda", generator=g)
    lab[torch.rand(n, device="cuda", generator=g) < 0.1] = -1
    glp = torch.randn(n, device="cuda", generator=g)
    gent = torch.randn(n, device="cuda", generator=g) if with_grad_ent else None
    lp, ent, gh, gw = run_kernels(K, hid, w, lab, 1.0 / temp, glp, gent)
    r_lp, r_ent, r_gh, r_gw = fp64_reference(hid, w, lab, 1.0 / temp, glp, gent)
    gtol = 5e-3 if dtype != torch.float32 else 1e-5
    assert rel(lp, r_lp) <= 1e-5 and rel(ent, r_ent) <= 1e-5
    assert gh.dtype == dtype and gw.dtype == dtype
    assert rel(gh, r_gh) <= gtol and rel(gw, r_gw) <= gtol


@pytest.mark.gpu
@pytest.mark.skipif(not (HAVE_CUDA and HAVE_TRITON), reason="needs a CUDA GPU and triton")
def test_gpu_public_api_triton_backend_matches_fp64():
    from rltrain import ops
    n, h, v = 333, 256, 151936
    g = torch.Generator(device="cuda").manual_seed(5)
    hid = torch.randn(n, h, device="cuda", generator=g).bfloat16().requires_grad_(True)
    w = (torch.randn(v, h, device="cuda", generator=g) * 0.3).bfloat16().requires_grad_(True)
    lab = torch.randint(0, v, (n,), device="cuda", generator=g)
    glp, gent = torch.randn(n, device="cuda", generator=g), torch.randn(n, device="cuda", generator=g)
    lp, ent = ops.logprobs_from_hidden(hid, w, lab, backend="triton")
    (lp * glp + ent * gent).sum().backward()
    r_lp, r_ent, r_gh, r_gw = fp64_reference(hid, w, lab, 1.0, glp, gent)
    assert rel(lp, r_lp) <= 1e-5 and rel(ent, r_ent) <= 1e-5
    assert rel(hid.grad, r_gh) <= 5e-3 and rel(w.grad, r_gw) <= 5e-3
