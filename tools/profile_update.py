"""Where the actor update step's time goes: a torch-profiler trace of MegatronEngine.train_step summarized into
a per-category table (GEMMs, attention, norms, elementwise, copies/casts, optimizer, communication, the LM
head, idle), written as markdown + json (+ the gzipped chrome trace) under --out. Not a test; it changes no code.

    python tools/profile_update.py --out $OUT                                 # Qwen3-0.6B shape, 8k tokens
    python tools/profile_update.py --out $OUT --preset qwen3-4b --tokens 8192 --levers legacy
    python tools/profile_update.py --out $OUT --preset tiny --tokens 256      # CPU: op self-times, no idle
    python tools/profile_update.py --out $OUT --tokens 8832 --seq-len 69 --levers all   # the GRPO update's shape

How the trace is read: tools/harness/update_profile.py. The rows are tools/bench_update.py's (harness/cases.py).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/, for the harness
from harness.cases import LEVER_SETS, PRESETS, Row, build_for_row
from harness.update_profile import CATEGORIES, profile_train_step, summarize_trace, to_markdown  # noqa: F401


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "profile_update_out"))
    ap.add_argument("--preset", default="qwen3-0.6b", choices=sorted(PRESETS))
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--levers", nargs="*", default=["legacy", "all"], choices=sorted(LEVER_SETS),
                    help="profile each of these lever sets (bench_update.py LEVER_SETS)")
    ap.add_argument("--seq-len", type=int, default=None,
                    help="rows of this many tokens in one micro-batch (the GRPO update: --tokens 8832 --seq-len 69); "
                         "default: one sequence of --tokens")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--summarize", help="only summarize this chrome trace (.json or .json.gz) and print the table")
    args = ap.parse_args()
    if args.summarize:
        opener = gzip.open if args.summarize.endswith(".gz") else open
        with opener(args.summarize, "rt") as f:
            print(to_markdown(summarize_trace(json.load(f)), args.summarize))
        return
    md = []
    for levers in args.levers:
        name = f"{args.preset}-{args.tokens}" + (f"x{args.seq_len}" if args.seq_len else "") + f"-{levers}"
        row = Row(name=name, preset=args.preset, tokens=args.tokens, seq_len=args.seq_len, **LEVER_SETS[levers])
        t0 = time.time()
        engine, mbs, loss_fn = build_for_row(row)
        s = profile_train_step(engine, mbs, loss_fn, out_dir=args.out, name=row.name, steps=args.steps)
        md.append(to_markdown(s, f"Profile: {row.name}"))
        print(md[-1], f"({time.time() - t0:.0f} s)", flush=True)
        del engine
    with open(os.path.join(args.out, "profile_update.md"), "w") as f:
        f.write("\n".join(md))


if __name__ == "__main__":
    main()
