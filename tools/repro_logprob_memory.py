"""Reproduce the log-prob/entropy OOM regime of slime issue #1951 and show the fused path avoiding it:
peak memory per path over the response fraction. Tools only: must not be imported by rltrain.

Regime: T = 205,280 packed tokens, V = 76,032 (a tensor-parallel shard of Qwen3's vocabulary),
H = 2,560, fp32 math, log-probs + entropy, forward + backward. Only the response rows (a fraction f of
T) are consumed. Paths, each measured in a fresh subprocess (see tools/bench_logprob.py for how memory
is measured on CPU and CUDA):

- naive:        fp32 logits of ALL T rows, then the response rows are selected (memory ~ T x V)
- naive_rows:   gather the response rows first, then materialize their logits (memory ~ f T x V)
- fused_torch:  logprobs_from_hidden(rows=...) (memory ~ chunk x V, independent of T and f)
- fused_triton: the same with backend="triton" (CUDA only, when available)

    python tools/repro_logprob_memory.py --sweep                      # full size (GPU)
    python tools/repro_logprob_memory.py --sweep --scale 200 --H 256 --device cpu   # laptop-sized

--scale S divides T (and nothing else); --H / --V override the hidden and vocab sizes (defaults are the
slime regime). Each path's analytic size of one fp32 [rows, V] logits tensor is printed beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_logprob import machine_description, measure_in_subprocess, providers  # noqa: E402

SLIME_T, SLIME_V, SLIME_H = 205_280, 76_032, 2_560
FRACTIONS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0)
PATHS = ("naive", "naive_rows", "fused_torch", "fused_triton")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", action="store_true", help="sweep the response fraction 0.05..1.0")
    parser.add_argument("--fraction", type=float, default=0.5, help="response fraction without --sweep")
    parser.add_argument("--scale", type=int, default=1, help="divide T by this (CPU runs)")
    parser.add_argument("--H", type=int, default=SLIME_H)
    parser.add_argument("--V", type=int, default=SLIME_V)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--paths", default=None, help=f"comma-separated subset of {list(PATHS)}")
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    if args.scale < 1:
        raise SystemExit(f"--scale must be >= 1, got {args.scale}")

    available = set(providers(args.device)) | {"naive_rows"}
    paths = [p for p in (args.paths.split(",") if args.paths else PATHS) if p in available]
    t = SLIME_T // args.scale
    fractions = FRACTIONS if args.sweep else (args.fraction,)
    print(f"T={t} (slime {SLIME_T} / {args.scale}) H={args.H} V={args.V} fp32 entropy+backward on {args.device}"
          f"  [{machine_description(args.device)}]")
    print(f"{'fraction':>9}{'rows':>9}{'rows x V fp32 MiB':>19}" + "".join(f"{p + ' MiB':>18}" for p in paths))
    table = []
    for frac in fractions:
        n_rows = max(1, int(round(t * frac)))
        row = {"fraction": frac, "rows": n_rows, "rows_logits_mib": n_rows * args.V * 4 / 2**20}
        for path in paths:
            spec = dict(provider=path, T=t, H=args.H, V=args.V, dtype="fp32", device=args.device,
                        fwd_only=False, reps=0, rows_fraction=frac)
            res = measure_in_subprocess(spec)
            row[path] = res["peak_extra_mib"] if res["status"] == "ok" else res["status"]
        table.append(row)
        cells = "".join(f"{row[p]:>18.1f}" if isinstance(row[p], float) else f"{row[p]:>18}" for p in paths)
        print(f"{frac:>9.2f}{n_rows:>9}{row['rows_logits_mib']:>19.1f}{cells}", flush=True)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(
            {"T": t, "H": args.H, "V": args.V, "device": args.device, "machine": machine_description(args.device),
             "rows": table}, indent=2))
        print(f"wrote {args.json_path}")


if __name__ == "__main__":
    main()
