"""One question of issue 63: which part of the CuTe forward's statistics epilogue costs the 8k forward its ~6% over
cuBLAS (8,192 x 4,096, vocab 151,936, bf16, one H200). METHOD.md's way without counters: the same quack GEMM (the
shipped tile, 128 x 192, cluster 2 x 1, ping-pong) under epilogues that each keep one part of the shipped one, timed
side by side in one process, and the compiled kernels' registers and spills read from their SASS.

Variants: cuBLAS (two 4,096-row GEMMs writing bf16 logits: the floor); quack's GEMM storing the bf16 logits (the
mainloop with a plain epilogue); a sum of z per (row, tile) (the reduction's scaffolding: shuffles, the shared-memory
exchange, the partials' writes, no exp); quack's own online log-sum-exp (max + one exp per element); the shipped
statistics reduction alone (max, one exp, the t term); the label's logit alone (ColVecSelect); the shipped
epilogue (statistics + label logit, the GEMM alone, through quack's `gemm`); the shipped `forward_stats` (its
kernels); the public `logprobs_from_hidden` as the actor calls it (check_bounds=False, no grad).

Times: "device" = after 2 s idle, the call enqueued behind a ~3 ms spin kernel so that the events time the device
only (the host's enqueue hidden); "event" = after 2 s idle as a caller meets it (the GPU idles while the host
prepares the launches); "hot" = eight calls back to back, the median of the last five gaps; "host" = the warm call's
time to return after a synchronize, and for the paths through `_launch` the time until the GEMM is queued. Rows
`probe_head_epilogue` of the kernel table; the SASS counts (registers, local-memory loads/stores, MUFU.EX2, barriers)
come from the CUTE_DSL_KEEP=cubin dumps (cuobjdump). Removed once its answer is in docs/benchmarks/kernel.md.

  PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD python tools/probe_head_epilogue.py \
      --dump /tmp/dump --results $OUT/results
  ncu --clock-control none --profile-from-start off -k regex:Gemm --section SpeedOfLight --section WarpStateStats \
      python tools/probe_head_epilogue.py --profile-only "shipped epilogue (GEMM only)" "quack GEMM, logits stored"
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/, for the harness
from harness import device_name, report_header
from harness import results as tables


def build_variants(hid, w, lab, z_blocks):
    import torch
    from quack.epilogue.frontend import gemm_epilogue
    from quack.epilogue.ops import ColVecLoad, ColVecReduce, ColVecSelect, OnlineLSEReduce

    from rltrain.ops import logprob_cute as C
    from rltrain.ops import logprobs_from_hidden

    t, v = hid.shape[0], w.shape[0]
    tile_n = C.FWD_TILE[1]
    n_tiles = -(-v // tile_n)
    kw = C._gemm_kwargs(C.FWD_TILE)
    lab32 = lab.to(torch.int32).contiguous()
    dev = hid.device

    @gemm_epilogue()
    def logits_epi(acc):
        return {"D": acc}

    @gemm_epilogue(outs={"s": ColVecReduce("s")})
    def sum_epi(acc):
        return {"s": acc}

    @gemm_epilogue(outs={"lse": OnlineLSEReduce("lse")})
    def lse_epi(acc):
        return {"lse": acc}

    @gemm_epilogue(outs={"stats": C._OnlineStatsReduce("stats")})
    def stats_epi(acc):
        return {"stats": acc}

    sel_label = ColVecLoad("label")

    @gemm_epilogue(outs={"zy": ColVecSelect("zy", idx_op=sel_label)}, extra_ops=(sel_label,))
    def label_epi(acc):
        return {"zy": acc}

    d = torch.empty(t, v, dtype=hid.dtype, device=dev)
    part1 = torch.empty(t, n_tiles, dtype=torch.float32, device=dev)
    part2 = torch.empty(t, 2 * n_tiles, dtype=torch.float32, device=dev)
    zy = torch.empty(t, dtype=torch.float32, device=dev)

    def cublas():
        for s in range(0, t, z_blocks.shape[0]):
            torch.mm(hid[s:s + z_blocks.shape[0]], w.T, out=z_blocks)

    return {
        "cuBLAS GEMM": (cublas, None),
        "quack GEMM, logits stored": (lambda: logits_epi.gemm(hid, w, d, epi_args={}, **kw), "logits_epi"),
        "sum of z per tile": (lambda: sum_epi.gemm(hid, w, None, epi_args=dict(s=part1), **kw), "sum_epi"),
        "quack online log-sum-exp": (lambda: lse_epi.gemm(hid, w, None, epi_args=dict(lse=part1), **kw), "lse_epi"),
        "statistics reduction alone": (lambda: stats_epi.gemm(hid, w, None, epi_args=dict(stats=part2), **kw),
                                       "stats_epi"),
        "label logit alone": (lambda: label_epi.gemm(hid, w, None, epi_args=dict(label=lab32, zy=zy), **kw),
                              "label_epi"),
        "shipped epilogue (GEMM only)": (lambda: C._stats_epi.gemm(
            hid, w, None, epi_args=dict(inv_temp=1.0, label=lab32, stats=part2, zy=zy), **kw), "_stats_epi"),
        "shipped forward_stats": (lambda: C.forward_stats(hid, w, lab, 1.0, True, None), None),
        "public call, check_bounds=False": (lambda: _no_grad(logprobs_from_hidden, hid, w, lab, backend="cute",
                                                             check_bounds=False), None),
    }


def _no_grad(fn, *a, **k):
    import torch

    with torch.no_grad():
        return fn(*a, **k)


def sass_counts(folder: str) -> dict:
    """Registers (cuobjdump's resource usage of the cubin) and instruction counts of the dumped SASS."""
    out = {}
    cubins = sorted(glob.glob(os.path.join(folder, "*.cubin")))
    if cubins and shutil.which("cuobjdump"):
        res = subprocess.run(["cuobjdump", "--dump-resource-usage", cubins[-1]], capture_output=True, text=True)
        m = re.search(r"REG:(\d+)", res.stdout)
        s = re.search(r"STACK:(\d+)", res.stdout)
        if m:
            out["regs"] = int(m.group(1))
        if s:
            out["stack_bytes"] = int(s.group(1))
    if cubins and shutil.which("cuobjdump"):
        text = subprocess.run(["cuobjdump", "--dump-sass", cubins[-1]], capture_output=True, text=True).stdout
        for name, pat in (("ldl", r"\bLDL\b"), ("stl", r"\bSTL\b"), ("mufu_ex2", r"MUFU\.EX2"),
                          ("bar", r"\bBAR\.\w+"), ("setmaxnreg", r"SETMAXNREG|USETMAXREG"),
                          ("instructions", r"/\*[0-9a-f]{4,}\*/\s+[A-Z@]")):
            out[name] = len(re.findall(pat, text))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dump", default=None, help="folder for the compiled kernels' cubins (CUTE_DSL_KEEP=cubin)")
    ap.add_argument("--profile-only", nargs="+", default=None, metavar="VARIANT",
                    help="warm these variants, then call each once between cudaProfilerStart/Stop (for ncu "
                         "--profile-from-start off); no timing, no rows")
    tables.add_arguments(ap, "a row per variant (kernel)")
    args = ap.parse_args()
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
        os.environ.setdefault("CUTE_DSL_KEEP", "cubin")
        os.environ.setdefault("CUTE_DSL_DUMP_DIR", args.dump)
    import torch

    from rltrain.ops import logprob_cute as C

    date = report_header("probe_head_epilogue")["date"]
    print(device_name(), flush=True)
    t, h, v = 8192, 4096, 151936
    g = torch.Generator(device="cuda").manual_seed(0)
    hid = torch.randn(t, h, device="cuda", generator=g).bfloat16()
    w = (torch.randn(v, h, device="cuda", generator=g) / h ** 0.5).bfloat16()
    lab = torch.randint(0, v, (t,), device="cuda", generator=g)
    z = torch.empty(4096, v, dtype=torch.bfloat16, device="cuda")
    variants = build_variants(hid, w, lab, z)
    if args.profile_only:
        for name in args.profile_only:
            variants[name][0]()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        for name in args.profile_only:
            variants[name][0]()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        return 0
    sass = {}
    for name, (fn, kname) in variants.items():
        before = set(os.listdir(args.dump)) if args.dump else set()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        print(f"first call of {name}: {time.perf_counter() - t0:.1f} s", flush=True)
        if args.dump and kname:
            sub = os.path.join(args.dump, kname)
            os.makedirs(sub, exist_ok=True)
            for f in set(os.listdir(args.dump)) - before:
                if os.path.isfile(os.path.join(args.dump, f)):
                    shutil.move(os.path.join(args.dump, f), os.path.join(sub, f))
            sass[name] = sass_counts(sub)
            print(f"  {kname}: {sass[name]}", flush=True)

    # host time: to return (warm, after a synchronize) and, for the paths through C._launch, until the GEMM is queued
    launch = C._launch
    stamp = []

    def stamped(*a, **k):
        launch(*a, **k)
        stamp.append(time.perf_counter())

    host, to_gemm = {k: [] for k in variants}, {k: [] for k in variants}
    C._launch = stamped
    try:
        for _ in range(5):
            for name, (fn, _) in variants.items():
                stamp.clear()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                host[name].append((time.perf_counter() - t0) * 1e3)
                if stamp:
                    to_gemm[name].append((stamp[0] - t0) * 1e3)
    finally:
        C._launch = launch
    torch.cuda.synchronize()

    cool, event, hot = ({k: [] for k in variants} for _ in range(3))
    for r in range(args.rounds):
        order = list(variants.items()) if r % 2 == 0 else list(reversed(variants.items()))
        for name, (fn, _) in order:
            for spin in (True, False):  # device only (the host's enqueue hidden), then as a caller after idle sees it
                torch.cuda.synchronize()
                time.sleep(2)
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                if spin:
                    torch.cuda._sleep(4_000_000)  # the host enqueues fn while this spins
                e0.record()
                fn()
                e1.record()
                e1.synchronize()
                (cool if spin else event)[name].append(e0.elapsed_time(e1))
        for name, (fn, _) in order:
            torch.cuda.synchronize()
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(9)]
            ev[0].record()
            for i in range(8):
                fn()
                ev[i + 1].record()
            ev[-1].synchronize()
            hot[name].append(statistics.median(ev[i].elapsed_time(ev[i + 1]) for i in range(3, 8)))
    med = statistics.median
    base = {k: med(d["cuBLAS GEMM"]) for k, d in (("cool", cool), ("event", event), ("hot", hot))}
    rows = []
    print("\n| variant | device ms (cool) | x cuBLAS | event ms after idle | x cuBLAS | hot ms | x cuBLAS | host ms "
          "| host ms to the GEMM | SASS |\n|---|---|---|---|---|---|---|---|---|---|")
    for name in variants:
        m = {"cool_ms": med(cool[name]), "event_ms": med(event[name]), "hot_ms": med(hot[name]),
             "host_ms": med(host[name])}
        m.update({f"{k}_x_cublas": m[f"{k}_ms"] / base[k] for k in ("cool", "event", "hot")})
        if to_gemm[name]:
            m["host_ms_to_gemm"] = med(to_gemm[name])
        print(f"| {name} | {m['cool_ms']:.2f} | {m['cool_x_cublas']:.3f} | {m['event_ms']:.2f} | "
              f"{m['event_x_cublas']:.3f} | {m['hot_ms']:.2f} | {m['hot_x_cublas']:.3f} | {m['host_ms']:.3f} | "
              f"{m.get('host_ms_to_gemm', float('nan')):.3f} | {sass.get(name, '')} |", flush=True)
        rows.append(tables.row("probe_head_epilogue", f"{t}x{h}x{v}", tables.device_kind(device_name()), name,
                               {**{k: round(x, 4) for k, x in m.items()}, **sass.get(name, {})}, date=date,
                               note="device ms: after 2 s idle, behind a spin kernel; event ms: after 2 s idle as "
                                    "called; hot: 8 calls back to back, median of the last 5 gaps; medians of "
                                    f"{args.rounds} rounds, alternate rounds in reverse order"))
    tables.upsert("kernel", rows, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
