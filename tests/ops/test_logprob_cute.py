"""The CuTe-DSL backend (`rltrain.ops.logprob_cute`): against fp64 math on a Hopper GPU (`gpu`, skipped
without one or without quack-kernels / nvidia-cutlass-dsl), and on every machine: it imports without its
optional packages, says why it is unavailable, and the public API refuses it clearly off CUDA."""

from __future__ import annotations

import pytest
import torch

from rltrain import ops
from rltrain.ops import logprob_cute as C
# the per-shard fp64 reference (labels -1: off this shard) and the relative error, as the Triton backend's tests
# use them (tests/ops is on sys.path under pytest, as that file's interpreter script also relies on)
from test_logprob_triton import INTERP_PRELUDE, fp64_reference, rel, run_interpreted

HOPPER = C.is_available()


def test_unavailable_is_explained_and_refused_off_cuda():
    assert isinstance(C.unavailable_reason(), str) and C.unavailable_reason()
    if not torch.cuda.is_available():
        assert not C.is_available()
    h, w = torch.randn(3, 8), torch.randn(5, 8)
    with pytest.raises(ValueError, match="backend='cute' needs CUDA tensors"):
        ops.logprobs_from_hidden(h, w, torch.tensor([0, 1, 2]), backend="cute")


def test_supports_names_what_the_kernels_need():
    h, w = torch.randn(3, 8), torch.randn(5, 8)
    assert "bf16/fp16" in C.supports(h, w)
    assert "multiple of 8" in C.supports(h[:, :6].bfloat16(), w[:, :6].bfloat16())
    assert "SM90" in C.supports(h.bfloat16(), w.bfloat16())


def test_forward_chunk_keeps_partials_within_budget():
    rows = C._fwd_chunk(65536, 151936, C.FWD_TILE[1], None)
    assert rows % 128 == 0 and 2 * 4 * rows * -(-151936 // C.FWD_TILE[1]) <= C.FWD_PARTIALS_BUDGET
    assert C._fwd_chunk(5, 151936, C.FWD_TILE[1], None) == 5 and C._fwd_chunk(1000, 10, 192, 64) == 64
    assert C._fwd_extra_bytes(65536, 151936) <= C.FWD_PARTIALS_BUDGET


def _tile_stats(z: torch.Tensor, tile_n: int) -> torch.Tensor:
    """What the forward GEMM's epilogue writes for logits z [rows, V]: fp32 [rows, 2 * n_tiles], each vocab tile's
    softmax mean of z, then each tile's log-sum-exp (computed in fp64 here, tile by tile)."""
    tiles = z.split(tile_n, dim=1)
    lse = torch.stack([torch.logsumexp(t, 1) for t in tiles], 1)
    mean = torch.stack([(torch.softmax(t, 1) * t).sum(1) for t in tiles], 1)
    return torch.cat([mean, lse], 1).float()


# (rows, V, tile_N): one row, one tile, V not a multiple of the tile, many tiles (a 1024-wide program, 792 live)
MERGE_CASES = [(1, 5, 192), (7, 1000, 192), (33, 151936 // 8, 24), (3, 300, 1)]


def _merge_case(rows, v, tile_n, seed):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, v, generator=g, dtype=torch.float64) * 4 + 30  # a large mean: lse's rounding shows
    return z, _tile_stats(z, tile_n)


@pytest.mark.parametrize("with_entropy", [True, False])
def test_merge_tiles_torch_path_matches_whole_rows(with_entropy):
    for i, (rows, v, tile_n) in enumerate(MERGE_CASES):
        z, stats = _merge_case(rows, v, tile_n, 40 + i)
        out = torch.full((3, rows), float("nan"))
        C.merge_tiles(stats, out, with_entropy)
        lse = torch.logsumexp(z, 1)
        mean = (torch.softmax(z, 1) * z).sum(1) if with_entropy else torch.zeros(rows, dtype=torch.float64)
        assert torch.equal(out[1], torch.ones(rows))
        assert (out[0].double() - lse).abs().max() <= 1e-5 * lse.abs().max()
        # the entropy lse - mean, each of them ~30: their difference holds to a few fp32 ulps of 30
        assert (out[2].double() - mean).abs().max() <= 2e-5 * lse.abs().max()


_MERGE_SCRIPT = INTERP_PRELUDE + r"""
import torch
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[2])
from rltrain.ops import logprob_cute as C
from test_logprob_cute import MERGE_CASES, _merge_case
assert C.triton is not None
res = []
for i, (rows, v, tile_n) in enumerate(MERGE_CASES):
    z, stats = _merge_case(rows, v, tile_n, 40 + i)
    for ent in (True, False):
        wide = torch.full((3, rows + 5), float("nan"))  # a row stride past the rows: a slice of a wider buffer
        C.merge_tiles(stats, wide[:, :rows], ent)
        ref = torch.full((3, rows), float("nan"))
        C.triton = None  # the torch path, on the same inputs
        C.merge_tiles(stats, ref, ent)
        C.triton = sys.modules["triton"]
        res.append([((wide[:, :rows].double() - ref.double()).abs().max() / ref.abs().max()).item(),
                wide[:, rows:].isnan().all().item()])
print("RESULT" + json.dumps(res))
"""


def test_merge_tiles_triton_kernel_matches_torch_path_interpreted():
    """The Triton merge under TRITON_INTERPRET=1 against the torch path (itself held to fp64 above), writing into
    a slice of a wider buffer and leaving the rest untouched."""
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    res = run_interpreted(_MERGE_SCRIPT, root, here)
    assert len(res) == 2 * len(MERGE_CASES)
    for diff, untouched in res:
        assert diff <= 1e-6 and untouched  # a few fp32 ulps: the two sum in different orders


# (N, H, V, temperature): the shapes of the Triton tests plus the tile edges: V not a multiple of the 192-wide
# vocab tile, one token, H a multiple of 8 but not of 16, N not a multiple of the 128-row tile.
GPU_CASES = [
    (257, 256, 151936, 1.0),
    (1, 128, 151936, 1.0),
    (999, 200, 123, 1.7),
    (130, 72, 1000, 0.8),
    (4096, 1024, 32000, 1.0),
    (64, 64, 5, 1.0),
]


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason=f"needs the CuTe backend: {C.unavailable_reason()}")
@pytest.mark.parametrize("n,h,v,temp", GPU_CASES)
@pytest.mark.parametrize("with_grad_ent", [True, False])
def test_gpu_cute_matches_fp64(n, h, v, temp, with_grad_ent):
    g = torch.Generator(device="cuda").manual_seed(n * 7 + v)
    hid = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    w = (torch.randn(v, h, device="cuda", generator=g) * 0.3).bfloat16()
    lab = torch.randint(0, v, (n,), device="cuda", generator=g)
    lab[torch.rand(n, device="cuda", generator=g) < 0.1] = -1
    glp = torch.randn(n, device="cuda", generator=g)
    gent = torch.randn(n, device="cuda", generator=g) if with_grad_ent else None
    m, s, t, zl = C.forward_stats(hid, w, lab, 1.0 / temp, True, None)
    lse, mean_z = m + torch.log(s), t / s
    gh, gw = C.backward(hid, w, lab, lse, mean_z, glp, gent, 1.0 / temp, True, True, None)
    r_lp, r_ent, r_gh, r_gw = fp64_reference(hid, w, lab, 1.0 / temp, glp, gent)
    assert rel(zl - lse, r_lp) <= 1e-5 and rel(lse - mean_z, r_ent) <= 1e-5
    assert gh.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16
    assert rel(gh, r_gh) <= 5e-3 and rel(gw, r_gw) <= 5e-3


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason=f"needs the CuTe backend: {C.unavailable_reason()}")
def test_gpu_public_api_cute_rows_and_peaked_softmax():
    """Row subsets through the public API, and rows whose softmax is one-hot (p_label ~ 1): the label term of
    the gradient is exact in fp32, not a rounded difference of two near-equal numbers."""
    n, h, v = 333, 256, 151936
    g = torch.Generator(device="cuda").manual_seed(11)
    hid = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    w = (torch.randn(v, h, device="cuda", generator=g) * 0.3).bfloat16()
    lab = torch.randint(0, v, (n,), device="cuda", generator=g)
    hid[:40] = (w[lab[:40]].float() * 4).bfloat16()  # the label's logit dominates: p_label ~ 1
    hid.requires_grad_(True)
    w.requires_grad_(True)
    rows = torch.arange(0, n, 3, device="cuda")
    glp, gent = torch.randn(n, device="cuda", generator=g), torch.randn(n, device="cuda", generator=g)
    lp, ent = ops.logprobs_from_hidden(hid, w, lab, rows=rows, backend="cute")
    (lp * glp + ent * gent).sum().backward()
    keep = torch.zeros(n, dtype=torch.bool, device="cuda")
    keep[rows] = True
    r_lp, r_ent, r_gh, r_gw = fp64_reference(hid[keep], w, lab[keep], 1.0, glp[keep], gent[keep])
    assert rel(lp[keep], r_lp) <= 1e-5 and rel(ent[keep], r_ent) <= 1e-5
    assert rel(hid.grad[keep], r_gh) <= 5e-3 and rel(w.grad, r_gw) <= 5e-3
    assert hid.grad[~keep].abs().max().item() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason=f"needs the CuTe backend: {C.unavailable_reason()}")
def test_gpu_cached_launch_plans_match_quacks_own_call_bitwise():
    """`_launch` replays quack's plan per operand metadata: its statistics are the bits quack's `gemm` writes
    (int64 and int32 labels alike), a repeated call reuses the plan, and a new shape or temperature (a scalar of
    1.0 compiles out) gets its own."""
    g = torch.Generator(device="cuda").manual_seed(5)
    v = 1000
    w = (torch.randn(v, 136, device="cuda", generator=g) * 0.3).bfloat16()
    n_tiles = -(-v // C.FWD_TILE[1])
    C._PLANS.clear()
    for n, inv_temp in [(130, 1.0), (130, 1.0), (7, 1.0), (130, 1.0 / 0.7)]:
        hid = torch.randn(n, 136, device="cuda", generator=g).bfloat16()
        lab = torch.randint(0, v, (n,), device="cuda", generator=g)
        lab[::5] = -1
        got, ref = torch.zeros(n, 2 * n_tiles, device="cuda"), torch.zeros(n, 2 * n_tiles, device="cuda")
        zy_got, zy_ref = torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
        C._launch(C._stats_epi, hid, w, None, dict(inv_temp=inv_temp, label=lab, stats=got, zy=zy_got), C.FWD_TILE)
        C._stats_epi.gemm(hid, w, None, epi_args=dict(inv_temp=inv_temp, label=lab.to(torch.int32), stats=ref,
                                                      zy=zy_ref), **C._gemm_kwargs(C.FWD_TILE))
        assert torch.equal(got, ref) and torch.equal(zy_got, zy_ref)
        assert (zy_got[::5] == 0).all()
    assert len(C._PLANS) == 3


@pytest.mark.parametrize("n,h", [(8192, 4096), (32768, 4096), (65536, 2560), (1_000_000, 8192), (1, 64), (300, 128)])
def test_backward_working_memory_within_quarter_gib_by_default(n, h):
    """Issue 63: the default working memory <= 0.25 GiB beyond the inputs and the gradients (the three benchmark
    shapes, a million tokens at H = 8,192, short batches), using most of it at the benchmark shapes; the forward's
    tile partials are under it too."""
    extra = C._bwd_extra_bytes(n, 151936, h, torch.bfloat16)
    assert 0 < extra <= 0.25 * 2**30
    if n >= 8192 and h <= 4096:
        assert extra >= 0.2 * 2**30
    assert C._fwd_extra_bytes(n, 151936) <= 0.25 * 2**30


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason=f"needs the CuTe backend: {C.unavailable_reason()}")
@pytest.mark.parametrize("backend", ["cute", "triton"])
def test_gpu_backward_over_many_token_chunks_matches_fp64(backend):
    """A budget small enough for several token chunks and vocab slices on the GPU: the weight gradient is written by
    the first token chunk and added to in bf16 by cuBLAS (addmm_) by the next ones, each adding in fp32 and rounding
    once; it stays within the bf16 tolerance of the fp64 reference (the default budget's shapes take one chunk)."""
    from rltrain.ops import head_blocking as B
    from rltrain.ops import logprob_triton as K

    n, h, v = 1000, 256, 32000
    g = torch.Generator(device="cuda").manual_seed(3)
    hid = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    w = (torch.randn(v, h, device="cuda", generator=g) * 0.3).bfloat16()
    lab = torch.randint(0, v, (n,), device="cuda", generator=g)
    glp, gent = torch.randn(n, device="cuda", generator=g), torch.randn(n, device="cuda", generator=g)
    m, s, t, zl = C.forward_stats(hid, w, lab, 1.0, True, None)
    lse, mean_z = m + torch.log(s), t / s
    budget = 2 * 4 * h * 256  # 4 token chunks of 256 rows, slices of 384 (cute) or 256 (triton) vocab columns
    assert B.bwd_sizes(n, v, h, True, None, 128, 192, budget)[0] == 256
    if backend == "cute":
        gh, gw = C.backward(hid, w, lab, lse, mean_z, glp, gent, 1.0, True, True, budget_bytes=budget)
    else:
        gh, gw = K.backward(hid, w, lab, lse, mean_z, glp, gent, 1.0, True, True,
                            tuning=K.TritonTuning(bwd_budget_bytes=budget))
    r_lp, r_ent, r_gh, r_gw = fp64_reference(hid, w, lab, 1.0, glp, gent)
    assert rel(gh, r_gh) <= 5e-3 and rel(gw, r_gw) <= 5e-3
