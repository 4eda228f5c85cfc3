"""ops/head_blocking.py, the fused head's backward blocking shared by the Triton and CuTe backends: the chunk and
slice sizes against the rule found by search, and the blocked gradients against one unblocked product (the GPU
backends' own tests run it with their dlogits kernels: tests/ops/test_logprob_{triton,cute}.py)."""

import os

import torch

from rltrain.ops import head_blocking as B


def _block_by_search(total: int, most: int, step: int) -> int:
    """The blocking's rule by search: the fewest blocks whose size, rounded up to `step`, fits in `most` (floored to
    `step`, at least one step); the whole when it fits."""
    most = max(step, most // step * step)
    if total <= most:
        return total
    return next(-(-(-(-total // k)) // step) * step for k in range(1, total + 1)
                if -(-(-(-total // k)) // step) * step <= most)


def test_backward_blocking_is_balanced_and_within_budget():
    """The backward's (Ts, Vs) against the rule found by search, over random shapes and budgets (awkward sizes, one
    token, budgets too small for one step): the fewest token chunks and vocab slices, near-equal, each a multiple of
    the tile unless it is the whole; all buffers within the budget whenever the budget allows one tile."""
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    for _ in range(300):
        n = int(torch.randint(1, 70_000, (1,), generator=g))
        v = int(torch.randint(1, 160_000, (1,), generator=g))
        h = 8 * int(torch.randint(1, 1024, (1,), generator=g))
        budget = int(torch.randint(1 << 16, 1 << 29, (1,), generator=g))
        bm, bn = (128, 192) if int(torch.randint(0, 2, (1,), generator=g)) else (64, 256)
        itemsize = 2 if int(torch.randint(0, 4, (1,), generator=g)) else 4
        ts, vs = B.bwd_sizes(n, v, h, True, None, bm, bn, budget, itemsize)
        case = dict(seed=seed, n=n, v=v, h=h, budget=budget, bm=bm, bn=bn, itemsize=itemsize)
        assert ts == _block_by_search(n, budget // 2 // (4 * h), bm), case
        left = budget - B.ROW_BYTES * n - 4 * h * ts
        assert vs == _block_by_search(v, left // (itemsize * ts), bn), case
        for total, size, step in ((n, ts, bm), (v, vs, bn)):
            blocks = -(-total // size)
            assert size == total or size % step == 0, case
            assert (blocks - 1) * size < total, case  # no empty block
        if left >= itemsize * ts * bn:  # the budget holds one tile of slices: everything fits in it
            assert 4 * h * ts + itemsize * ts * vs + B.ROW_BYTES * n <= budget, case
    assert B.bwd_sizes(65536, 151936, 2560, True, None, 128, 192) == (11008, 6912)  # 6 chunks, not 5 and a sliver
    assert B.bwd_sizes(1, 151936, 4096, True, None, 128, 192) == (1, 151936)


def test_chunked_grads_over_chunks_and_slices_equal_the_unblocked_products():
    """chunked_grads with a dz of known values (a function of the global row and column) over 3 token chunks and 4
    vocab slices, with a padded row stride, in fp32 and bf16: dHidden = dz @ W and dWeight = dz^T @ h, against the
    whole products in fp64; dWeight is added to across token chunks, dHidden rounded once."""
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
        n, v, h = 301, 517, 24
        hid = torch.randn(n, h, generator=g).to(dtype)
        w = torch.randn(v, h, generator=g).to(dtype)
        dz_full = torch.randn(n, v, generator=g).to(dtype)
        ts, vs = 128, 160  # 3 token chunks (the last of 45 rows), 4 vocab slices (the last of 37 columns)
        seen = []

        def fill_dz(dz, c0, c1, v0, v1):
            seen.append((c0, c1, v0, v1))
            dz.copy_(dz_full[c0:c1, v0:v1])

        for stride in (None, 168):
            seen.clear()
            gh, gw = torch.empty_like(hid), torch.empty_like(w)
            B.chunked_grads(hid, w, gh, gw, (ts, vs), fill_dz, row_stride=stride)
            assert len(seen) == 12 and seen[-1] == (256, 301, 480, 517)
            want_h = dz_full.double() @ w.double()
            want_w = dz_full.double().t() @ hid.double()
            for got, want in ((gh, want_h), (gw, want_w)):
                err = (got.double() - want).norm() / want.norm()
                assert got.dtype == dtype and err < tol, (dtype, stride, float(err))
        gh_only = torch.empty_like(hid)
        B.chunked_grads(hid, w, gh_only, None, (ts, vs), fill_dz)  # dWeight not wanted: not computed
        assert torch.equal(gh_only, gh)
