"""One question (issue 63): does the head's new backward blocking (token chunk > vocab slice, dWeight straight into its
gradient, 256 MiB) beat the one before it (token super-chunk > vocab slice > token chunk, an fp32 dWeight buffer
copied out, 384 MiB), and what does the budget buy? Times `backward` of the CuTe and Triton backends directly (no
autograd) with each blocking in one run, beside the cuBLAS GEMM and the CuTe forward, at the head's three shapes;
prints and upserts a row per (shape, backend, blocking, budget) into the kernel table, and a profile of the new
blocking's 8k CuTe backward (kernel time by kernel, the wall) as one more row. Removed once its answer is in
docs/benchmarks/kernel.md (git history keeps it).

    PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD python tools/probe_head_blocking.py \\
        --results $OUT/results
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness.results import device_kind  # noqa: E402
from harness import results as tables  # noqa: E402

from rltrain.ops import logprob_cute as C  # noqa: E402
from rltrain.ops import logprob_triton as K  # noqa: E402

V = 151936
SHAPES = [(8192, 4096), (32768, 4096), (65536, 2560)]
RUNS = [("cute", "old", 384), ("cute", "new", 256), ("cute", "new", 384), ("cute", "new", 240),
        ("triton", "old", 384), ("triton", "new", 256)]


def old_sizes(n, v, h, need_hidden_grad, chunk_size, bm, bn, budget_bytes=None, itemsize=2):
    """The blocking before: (Ts, Vs, Tc) from the budget split 2 : 1 : 1 (dHidden acc : dWeight acc : dlogits)."""
    quarter = budget_bytes // 4
    ts = min(n, max(bm, (2 * quarter // (4 * h)) // bm * bm)) if need_hidden_grad else n
    vs = min(v, max(bn, (quarter // (4 * h)) // bn * bn))
    tc = max(1, min(int(chunk_size), ts)) if chunk_size else min(ts, max(bm, (quarter // (2 * vs)) // bm * bm))
    return ts, vs, tc


def old_chunked_grads(hidden, weight, grad_h, grad_w, sizes, fill_dz, *, row_stride=None):
    """The loop before: token super-chunk (fp32 dHidden acc) > vocab slice (fp32 dWeight acc, copied out) > chunk."""
    n, h = hidden.shape
    v = weight.shape[0]
    ts, vs, tc = sizes
    dz_buf = torch.empty(tc * (row_stride or vs), device=hidden.device, dtype=hidden.dtype)
    dh_acc = torch.empty((ts, h), device=hidden.device, dtype=torch.float32)
    dw_acc = torch.empty((vs, h), device=hidden.device, dtype=torch.float32)
    for s0 in range(0, n, ts):
        s1 = min(n, s0 + ts)
        for v0 in range(0, v, vs):
            v1 = min(v, v0 + vs)
            for c0 in range(s0, s1, tc):
                c1 = min(s1, c0 + tc)
                rows, cols = c1 - c0, v1 - v0
                dz = (dz_buf[: rows * cols].view(rows, cols) if row_stride is None
                      else dz_buf[: rows * row_stride].view(rows, row_stride)[:, :cols])
                fill_dz(dz, c0, c1, v0, v1)
                K._mm_acc(dh_acc[c0 - s0:c1 - s0], dz, weight[v0:v1], overwrite=(v0 == 0))
                K._mm_acc(dw_acc[:cols], dz.t(), hidden[c0:c1], overwrite=(c0 == s0))
            if s0 == 0:
                grad_w[v0:v1].copy_(dw_acc[: v1 - v0])
            else:
                grad_w[v0:v1].add_(dw_acc[: v1 - v0])
        grad_h[s0:s1].copy_(dh_acc[: s1 - s0])


def profile_row(fn, shape: str, dev: str, date: str) -> dict:
    """One backward under torch.profiler: the GPU time of each kernel family (the three GEMMs, the rest) and the wall."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    total, by = 0.0, {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            ms = e.device_time_total / 1e3
            total += ms
            by[e.name[:70]] = by.get(e.name[:70], 0.0) + ms
    top = dict(sorted(by.items(), key=lambda kv: -kv[1])[:4])
    metrics = {"wall_ms": round(wall, 2), "kernel_ms": round(total, 2), **{k: round(v, 2) for k, v in top.items()}}
    return tables.row("probe_head_blocking", shape, dev, "cute, new blocking, 256 MiB: profile", metrics, date=date)


def timed(fn, reps=3):
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return sorted(out)[len(out) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    tables.add_arguments(ap, "kernel")
    args = ap.parse_args()
    if not (torch.cuda.is_available() and C.is_available()):
        print("needs a Hopper GPU with the cute extra", file=sys.stderr)
        return 2
    dev = device_kind(torch.cuda.get_device_name())
    date = datetime.date.today().isoformat()
    rows = []
    for t, h in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        hid = torch.randn(t, h, device="cuda", generator=g).bfloat16()
        w = (torch.randn(V, h, device="cuda", generator=g) * h ** -0.5).bfloat16()
        lab = torch.randint(0, V, (t,), device="cuda", generator=g)
        d = torch.empty(t, V, device="cuda", dtype=torch.bfloat16)
        gemm = timed(lambda: torch.mm(hid, w.t(), out=d))
        del d
        torch.cuda.empty_cache()
        m, s, tt, _ = C.forward_stats(hid, w, lab, 1.0, True, None)
        lse, mean = m + torch.log(s), tt / s
        glp, gent = torch.randn(t, device="cuda", generator=g), torch.randn(t, device="cuda", generator=g)
        fwd = timed(lambda: C.forward_stats(hid, w, lab, 1.0, True, None))
        for backend, kind, mib in RUNS:
            new = (K._bwd_sizes, K.chunked_grads)
            if kind == "old":
                K._bwd_sizes, K.chunked_grads = old_sizes, old_chunked_grads
            try:
                if backend == "cute":
                    fn = lambda: C.backward(hid, w, lab, lse, mean, glp, gent, 1.0, True, True,  # noqa: E731
                                            budget_bytes=mib * 2**20)
                else:
                    tun = K.TritonTuning(bwd_budget_bytes=mib * 2**20)
                    fn = lambda: K.backward(hid, w, lab, lse, mean, glp, gent, 1.0, True, True,  # noqa: E731
                                            tuning=tun)
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                gh, gw = fn()
                extra = (torch.cuda.max_memory_allocated() - base - 2 * (gh.numel() + gw.numel())) / 2**30
                del gh, gw
                bwd = timed(fn)
            finally:
                K._bwd_sizes, K.chunked_grads = new
            metrics = {"gemm_ms": round(gemm, 3), "fwd_ms": round(fwd, 3), "bwd_ms": round(bwd, 3),
                       "x_fwdbwd_4gemm": round((fwd + bwd) / (4 * gemm), 4), "extra_gib": round(extra, 4)}
            rows.append(tables.row("probe_head_blocking", f"{t}x{h}x{V}", dev, f"{backend}, {kind} blocking, {mib} MiB",
                                   metrics, date=date))
            print(rows[-1], flush=True)
            if (backend, kind, mib, t) == ("cute", "new", 256, 8192):
                rows.append(profile_row(fn, f"{t}x{h}x{V}", dev, date))
                print(rows[-1], flush=True)
    tables.upsert("kernel", rows, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
