"""One question (issue 63): is the CuTe forward's tile (128x192, cluster 2x1, ping-pong) the one to ship on an H200, and
does the 8k shape's 1.22x (2026-11-28) come from the tile? Times, at the head's three shapes in one run: cuBLAS
`h @ W^T` (the floor), quack's plain GEMM with the identity epilogue at each tile config (bf16 D), the CuTe statistics
GEMM (`forward_stats`) at each config, and the host's time to enqueue one forward call; upserts a row per (shape,
config) into the kernel table. Removed once its answer is in docs/benchmarks/kernel.md (git history keeps it).

    PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD python tools/probe_head_tiles.py \\
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
from harness import results as tables  # noqa: E402
from harness.results import device_kind  # noqa: E402

from rltrain.ops import logprob_cute as C  # noqa: E402

V = 151936
SHAPES = [(8192, 4096), (32768, 4096), (65536, 2560)]
#: (tile_M, tile_N, cluster_M, cluster_N, pingpong)
CONFIGS = [(128, 192, 2, 1, True), (128, 192, 1, 2, True), (128, 208, 2, 1, True), (128, 160, 2, 1, True),
           (128, 256, 2, 1, False), (256, 192, 2, 1, False), (256, 128, 2, 1, False)]


def timed(fn, reps=5):
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
    from quack.epilogue.frontend import gemm_epilogue

    @gemm_epilogue()
    def identity_epi(acc):
        return {"D": acc}

    dev, date = device_kind(torch.cuda.get_device_name()), datetime.date.today().isoformat()
    data = {}
    for t, h in SHAPES:  # all three shapes' operands at once (~33 GB with the floor's outputs): configs outermost
        g = torch.Generator(device="cuda").manual_seed(0)
        hid = torch.randn(t, h, device="cuda", generator=g).bfloat16()
        w = (torch.randn(V, h, device="cuda", generator=g) * h ** -0.5).bfloat16()
        lab = torch.randint(0, V, (t,), device="cuda", generator=g)
        d = torch.empty(t, V, device="cuda", dtype=torch.bfloat16)
        data[(t, h)] = (hid, w, lab, d, timed(lambda: torch.mm(hid, w.t(), out=d)))
    rows = []
    saved = C.FWD_TILE
    try:
        for cfg in CONFIGS:
            C.FWD_TILE = cfg
            kw = C._gemm_kwargs(cfg)
            for (t, h), (hid, w, lab, d, floor) in data.items():
                plain = timed(lambda: identity_epi.gemm(hid, w, d, epi_args={}, **kw))
                fwd = timed(lambda: C.forward_stats(hid, w, lab, 1.0, True, None))
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(3):
                    C.forward_stats(hid, w, lab, 1.0, True, None)
                host = (time.perf_counter() - t0) / 3 * 1e3
                torch.cuda.synchronize()
                name = f"{cfg[0]}x{cfg[1]}, cluster {cfg[2]}x{cfg[3]}, {'ping-pong' if cfg[4] else 'cooperative'}"
                rows.append(tables.row("probe_head_tiles", f"{t}x{h}x{V}", dev, name, {
                    "gemm_ms": round(floor, 3), "quack_plain_ms": round(plain, 3), "fwd_ms": round(fwd, 3),
                    "x_plain": round(plain / floor, 4), "x_fwd": round(fwd / floor, 4), "host_ms": round(host, 3)},
                    date=date))
                print(rows[-1], flush=True)
    finally:
        C.FWD_TILE = saved
    tables.upsert("kernel", rows, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
