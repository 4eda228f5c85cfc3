"""One question (issue 63): is the 8k forward's multiple over one GEMM (1.15x in the side-by-side of 2026-11-29) the
kernel or the clocks? In one process, at the short and a long shape: cuBLAS `h @ W^T` (the floor), quack's plain GEMM
at the shipped tile (identity epilogue: the mainloop alone) and the CuTe forward (`forward_stats`: the same mainloop
with the softmax statistics as its epilogue), each timed twice, alternating, in two states: cool (3 s idle before each)
and hot (~2 s of back-to-back GEMMs before each: the 700 W power cap reached). The SM clock, power and temperature
from nvidia-smi after each. Upserts one row per (shape, state, kernel) into the kernel table. Removed once its answer
is in docs/benchmarks/kernel.md (git history keeps it).

    PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD python tools/probe_head_clocks.py \\
        --results $OUT/results
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import results as tables  # noqa: E402
from harness.results import device_kind  # noqa: E402

from rltrain.ops import logprob_cute as C  # noqa: E402

V = 151936
SHAPES = [(8192, 4096), (65536, 2560)]


def timed(fn, reps=5):
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return sorted(out)[len(out) // 2]


def smi() -> list[float]:
    """[SM MHz, W, deg C] now."""
    text = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                           "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
    return [float(x) for x in text.split(",")]


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
    kw = C._gemm_kwargs(C.FWD_TILE)
    rows = []
    for t, h in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        hid = torch.randn(t, h, device="cuda", generator=g).bfloat16()
        w = (torch.randn(V, h, device="cuda", generator=g) * h ** -0.5).bfloat16()
        lab = torch.randint(0, V, (t,), device="cuda", generator=g)
        block = 4096  # the floor's and the plain GEMM's output in row blocks, as bench_logprob's floor
        d = torch.empty(block, V, device="cuda", dtype=torch.bfloat16)

        def blocks(mm):
            for s in range(0, t, block):
                mm(hid[s:s + block], d[: min(block, t - s)])

        kernels = {"cuBLAS GEMM": lambda: blocks(lambda a, o: torch.mm(a, w.t(), out=o)),
                   "quack plain GEMM": lambda: blocks(lambda a, o: identity_epi.gemm(a, w, o, epi_args={}, **kw)),
                   "cute forward": lambda: C.forward_stats(hid, w, lab, 1.0, True, None)}
        for fn in kernels.values():  # compile and warm
            fn()
        torch.cuda.synchronize()
        heat = kernels["cuBLAS GEMM"]
        reps_heat = max(1, int(2000 / timed(heat, 1)))
        flop = 2 * t * h * V
        for state in ("cool", "hot"):
            got: dict[str, list] = {k: [] for k in kernels}
            for name in list(kernels) * 2:
                torch.cuda.synchronize()
                if state == "cool":
                    time.sleep(3)
                else:
                    for _ in range(reps_heat):
                        heat()
                got[name].append((timed(kernels[name]), smi()))
            floor = min(ms for ms, _ in got["cuBLAS GEMM"])
            for name, runs in got.items():
                ms = min(m for m, _ in runs)
                clk, watt, temp = runs[[m for m, _ in runs].index(ms)][1]
                rows.append(tables.row("probe_head_clocks", f"{t}x{h}x{V}", dev, f"{state}: {name}", {
                    "ms": round(ms, 3), "x_gemm": round(ms / floor, 4), "tflops": round(flop / ms / 1e9, 1),
                    "sm_mhz": clk, "watts": watt, "temp_c": temp}, date=date))
                print(rows[-1], flush=True)
        del hid, w, d
        torch.cuda.empty_cache()
    tables.upsert("kernel", rows, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
