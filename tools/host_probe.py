"""What kind of host this is, and how fast its CPU side runs: a few seconds of probes to set beside a run's step time.

  python tools/host_probe.py                      # CPU probes only (no GPU library imported)
  python tools/host_probe.py --cuda --json p.json # plus tiny-kernel launches, launch + sync, a bf16 GEMM, nvidia-smi

Why: the same config measured on different machines of one kind (the 0.6B GRPO step on one GPU) took 1.36 to
2.82 s (docs/plan.md, "Host spread, probed"). A small model's step is bound by the host's Python and kernel launches,
so a probe that runs in seconds might say in advance which hosts are slow. Every number is the best of several
repeats, and the guest's load average is printed beside them. On the lent machines (KVM guests) a vCPU runs at half
speed for spells of about a second; a probe's best is slow only when the spells last through all its repeats. Over
five machines the pure-Python probes ranked them roughly; the torch and CUDA ones moved between two levels within a
minute on one machine. tools/gpu_placements.py records the CPU probes with every GPU run.

Probes (each the best of --repeats):
  python_call_ns   one call of an empty Python function
  python_mix_ns    one iteration of a loop of dict/list/attribute work, like a trainer's bookkeeping
  torch_cpu_op_us  one torch.add on a one-element CPU tensor (the dispatcher's per-op cost)
  cuda_launch_us   one torch.add on a one-element CUDA tensor, no sync between (the launch cost the host pays)
  cuda_sync_us     one launch + torch.cuda.synchronize() (a round trip to the GPU)
  gemm_tflops      bf16 8192^3 matmuls (the GPU side, to tell a slow GPU from a slow host)
  --per-cpu N      python_call_ns pinned to each usable CPU, N passes: which CPUs are slow, and whether they stay so
  --series N       python_mix_ns N times, --interval apart, and the share of them at >= 1.5x the fastest (slow_share):
                   one probe flips between ~140 and ~290 ns within seconds on one machine (docs/plan.md, "Each phase
                   split"); the share over ~10 s is the candidate for a host's speed, recorded with every GPU run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/, for the harness
from harness.probes import cpu_probes, cuda_probes, host_facts, per_cpu_probes, series_probe  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cuda", action="store_true", help="also the CUDA probes (imports torch, uses GPU 0)")
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--per-cpu", type=int, default=0, metavar="PASSES",
                    help="also pin the Python call probe to each CPU in turn, PASSES times over")
    ap.add_argument("--series", type=int, default=0, metavar="N", help="also python_mix_ns N times, --interval apart")
    ap.add_argument("--interval", type=float, default=0.5, help="seconds between --series samples (default 0.5)")
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        print("host_probe: --repeats must be at least 1", file=sys.stderr)
        return 2
    if args.series < 0 or args.interval < 0:
        print("host_probe: --series and --interval must be >= 0", file=sys.stderr)
        return 2
    res = {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": host_facts(),
           "cpu": cpu_probes(args.repeats)}
    if args.cuda:
        res["cuda"] = cuda_probes(args.repeats)
    if args.per_cpu:
        res["per_cpu"] = per_cpu_probes(args.per_cpu)
    if args.series:
        res["series"] = series_probe(args.series, args.interval)
    text = json.dumps(res, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
