"""One question of issue 63: where the CuTe forward's multiple of one GEMM goes at 8,192 x 4,096 (vocab 151,936,
bf16, one H200): the GEMM kernel, the small kernels around it, or the time from the call to its first kernel. And
what one statistics reduction (one exp per element, 4 launches) changed against the two of commit 2340a1f (two exps,
21 launches): the older module is read from git into this process and run beside the current one.

Per variant (cuBLAS's two 4,096-row GEMMs writing bf16 logits; the CuTe forward now; the CuTe forward at 2340a1f),
after 2 s idle (the GPU's clocks as a first call meets them): the CUDA-event time of the call, the device time of its
kernels from the profiler (gaps excluded) and the kernel count, and, warm, the host time the call takes to return.
Rows `probe_head_launch` of the kernel table. Removed once its answer is in docs/benchmarks/kernel.md.

  git show 2340a1f:rltrain/ops/logprob_cute.py > /tmp/logprob_cute_old.py     # where git is (the checkout)
  PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD python tools/probe_head_launch.py \
      --old /tmp/logprob_cute_old.py --results $OUT/results
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/, for the harness
from harness import device_name, report_header
from harness import results as tables

OLD = "2340a1f"


def _module_from(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # inspect.getsource (quack's kernel keys, via our ops' digests) looks modules up there
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help=f"rltrain/ops/logprob_cute.py as of {OLD} (git show, above)")
    ap.add_argument("--rounds", type=int, default=3)
    tables.add_arguments(ap, "a row per variant (kernel)")
    args = ap.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from rltrain.ops import logprob_cute as new_mod

    old_mod = _module_from(args.old, "logprob_cute_old")
    t, h, v = 8192, 4096, 151936
    g = torch.Generator(device="cuda").manual_seed(0)
    hid = torch.randn(t, h, device="cuda", generator=g).bfloat16()
    w = (torch.randn(v, h, device="cuda", generator=g) / h ** 0.5).bfloat16()
    lab = torch.randint(0, v, (t,), device="cuda", generator=g)
    z = torch.empty(4096, v, dtype=torch.bfloat16, device="cuda")

    def gemm():
        for s in range(0, t, 4096):
            torch.mm(hid[s:s + 4096], w.T, out=z)

    variants = {"cuBLAS GEMM": gemm,
                "cute forward": lambda: new_mod.forward_stats(hid, w, lab, 1.0, True, None),
                f"cute forward at {OLD}": lambda: old_mod.forward_stats(hid, w, lab, 1.0, True, None)}
    a, b = variants["cute forward"](), variants[f"cute forward at {OLD}"]()
    same = all(torch.equal(x, y) for x, y in zip(a, b))
    got = {k: {"event_ms": [], "kernel_ms": [], "kernels": [], "host_ms": []} for k in variants}
    for fn in variants.values():
        fn()
    torch.cuda.synchronize()
    for _ in range(args.rounds):
        for name, fn in variants.items():
            for _ in range(3):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                got[name]["host_ms"].append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
            time.sleep(2)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                fn()
                e1.record()
                e1.synchronize()
            ks = [e.device_time for e in prof.events() if e.device_type.name == "CUDA" and e.device_time > 0]
            got[name]["event_ms"].append(e0.elapsed_time(e1))
            got[name]["kernel_ms"].append(sum(ks) / 1e3)
            got[name]["kernels"].append(len(ks))
    date = report_header("probe_head_launch")["date"]
    dev = tables.device_kind(device_name())
    rows = []
    base = statistics.median(got["cuBLAS GEMM"]["kernel_ms"])
    print(f"{device_name()}  T={t} H={h} V={v} bf16; new == {OLD} bitwise: {same}")
    print("variant                     event ms  kernel ms  kernels  host ms   kernel x cuBLAS kernel")
    for name, m in got.items():
        med = {k: statistics.median(x) for k, x in m.items()}
        print(f"{name:26s} {med['event_ms']:9.2f} {med['kernel_ms']:10.2f} {med['kernels']:8.0f} {med['host_ms']:8.2f}"
              f"   {med['kernel_ms'] / base:.3f}")
        rows.append(tables.row("probe_head_launch", f"{t}x{h}x{v}", dev, name,
                               {**{k: round(x, 4) for k, x in med.items()},
                                "kernel_x_cublas": round(med["kernel_ms"] / base, 4),
                                "bitwise_equal_to_old": int(same)}, date=date,
                               note="after 2 s idle; median of --rounds; host_ms: warm, after a synchronize"))
    tables.upsert("kernel", rows, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
