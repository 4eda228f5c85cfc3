"""The trainer's driver under a busy thread of its own: slicing a batch over the data-parallel ranks, gathering the
results, and submitting a batch-carrying call to a Ray actor, each timed alone and beside a thread that runs pure
Python (as any other thread of the driver may: Ray runs its own there), at Python's default GIL hand-off (5 ms) and
the driver's (workers/group.py DRIVER_SWITCH_INTERVAL_S). Not a test; it changes no code.

    python tools/driver_gil_bench.py [--rows 256] [--response 64] [--dp 2 4] [--repeats 20] [--ray] [--json OUT]

Why: on 2026-11-27 the driver's slicing took 5-130 ms a phase at DP>=2 on GPU hosts (0 at one rank, which passes
the batch whole) while the same slicing alone took under 1 ms; cProfile put the time in Batch.select's own time (its
tensor indexing and row copies, no slow callee). A thread that lets the GIL go must wait to get it back while another
thread runs Python: up to the switch interval each time. Which calls wait varies from run to run (the busy thread may
hold the GIL through a whole case, or not at all), so a case beside the busy thread can read 0.2 ms once and 200 the
next; at the driver's shorter hand-off every case stays within a few times its time alone. Each row is the median of
--repeats.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/, for the harness (which puts the repo first)
from harness import md_table, time_ms, write_json  # noqa: E402

from rltrain.data.batch import Batch  # noqa: E402
from rltrain.utils.errors import UserError  # noqa: E402
from rltrain.workers.group import DRIVER_SWITCH_INTERVAL_S, gather_rows  # noqa: E402


def make_batch(rows: int, prompt: int, response: int) -> Batch:
    """A GRPO batch as the driver holds it before the update (the fields a vLLM rollout, the rewards, the log-probs
    and the advantages set)."""
    tok = lambda w: torch.randint(0, 151_000, (rows, w))  # noqa: E731
    ones = lambda w: torch.ones(rows, w, dtype=torch.long)  # noqa: E731
    return Batch(prompt_ids=tok(prompt), prompt_mask=ones(prompt), response_ids=tok(response),
                 response_mask=ones(response), loss_mask=ones(response), sampler_logprobs=torch.randn(rows, response),
                 old_logprobs=torch.randn(rows, response), ref_logprobs=torch.randn(rows, response),
                 advantages=torch.randn(rows, response), weight_versions=torch.zeros(rows, response, dtype=torch.long),
                 scores=torch.randn(rows), group_ids=torch.arange(rows) // 8,
                 non_tensor={"ground_truth": [str(i) for i in range(rows)], "data_source": ["bench"] * rows,
                             "finish_reason": ["length"] * rows})


class BusyThread:
    """A thread that runs pure Python until stopped (holds the GIL whenever it runs)."""

    def __init__(self):
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._spin, daemon=True, name="bench-busy")

    def _spin(self) -> None:
        x = 0
        while not self._stop.is_set():
            for _ in range(1000):
                x += 1

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def cases(batch: Batch, dps: list[int], actor=None) -> dict:
    out = {}
    for dp in dps:
        padded = batch.pad_to_multiple(dp)
        out[f"split dp={dp} (Batch.split)"] = lambda p=padded, d=dp: p.split(d)
        parts = [(torch.randn(len(s), batch.response_ids.shape[1]),) * 2 for s in padded.split(dp)]
        out[f"gather dp={dp} (torch.cat)"] = lambda r=parts: gather_rows(r, batch)
    if actor is not None:
        import ray

        out["remote call with the batch (submit to result)"] = lambda: ray.get(actor.rows.remote(batch))
        out["remote call without it"] = lambda: ray.get(actor.rows.remote(None))
    return out


def run(rows: int, prompt: int, response: int, dps: list[int], repeats: int, use_ray: bool) -> list[dict]:
    batch = make_batch(rows, prompt, response)
    actor = None
    if use_ray:
        import ray

        ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False,
                 _node_ip_address="127.0.0.1")

        @ray.remote(num_cpus=1)
        class Echo:
            def rows(self, b):
                return 0 if b is None else len(b)

        actor = Echo.remote()
        ray.get(actor.rows.remote(batch))
    fns = cases(batch, dps, actor)
    before = sys.getswitchinterval()
    results = []
    try:
        for name, fn in fns.items():
            row = {"case": name, "alone_ms": time_ms(fn, repeats, warmup=1, cuda=False)}
            with BusyThread():
                for label, interval in (("busy_5ms", 5e-3), ("busy_driver", DRIVER_SWITCH_INTERVAL_S)):
                    sys.setswitchinterval(interval)
                    row[f"{label}_ms"] = time_ms(fn, repeats, warmup=0, cuda=False)
            sys.setswitchinterval(before)
            results.append(row)
            print(f"{name}: {row['alone_ms']:.2f} ms alone, {row['busy_5ms_ms']:.2f} beside a busy thread, "
                  f"{row['busy_driver_ms']:.2f} at the driver's hand-off", file=sys.stderr, flush=True)
    finally:
        sys.setswitchinterval(before)
        if use_ray:
            import ray

            ray.shutdown()
    return results


def markdown(results: list[dict]) -> str:
    header = ["case", "alone (ms)", "beside a busy thread, hand-off 5 ms",
              f"the same, hand-off {DRIVER_SWITCH_INTERVAL_S * 1e3:g} ms"]
    return md_table(header, [[r["case"], *(f"{r[k]:.2f}" for k in ("alone_ms", "busy_5ms_ms", "busy_driver_ms"))]
                             for r in results], ["---", "---:", "---:", "---:"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=256, help="the batch's rows (default 256: 32 prompts x 8)")
    ap.add_argument("--prompt", type=int, default=5, help="prompt width (default 5)")
    ap.add_argument("--response", type=int, default=64, help="response width (default 64)")
    ap.add_argument("--dp", type=int, nargs="+", default=[2, 4], help="data-parallel ranks to slice over")
    ap.add_argument("--repeats", type=int, default=20, help="timings per case; the median is kept")
    ap.add_argument("--ray", action="store_true", help="also a remote call to a local Ray actor (starts Ray)")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    try:
        for name in ("rows", "prompt", "response", "repeats"):
            if getattr(args, name) < 1:
                raise UserError(f"driver_gil_bench: --{name} must be >= 1, got {getattr(args, name)}")
        bad = [d for d in args.dp if not 1 <= d <= args.rows]
        if bad:
            raise UserError(f"driver_gil_bench: --dp must be in [1, --rows {args.rows}], got {bad}")
    except UserError as err:
        print(err, file=sys.stderr)
        return 2
    results = run(args.rows, args.prompt, args.response, args.dp, args.repeats, args.ray)
    print(f"rows {args.rows}, prompt {args.prompt}, response {args.response}, torch threads {torch.get_num_threads()}, "
          f"{os.cpu_count()} CPUs\n")
    print(markdown(results))
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
