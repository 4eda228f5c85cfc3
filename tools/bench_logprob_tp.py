"""The fused head vocab-parallel: log-prob + entropy with the LM head split over TP ranks (one process and one device
each, the vocabulary in TP contiguous shards, `ops.logprobs_from_hidden(tp_group=...)`), timed beside the same
provider on one device with the whole vocabulary, and the two compared value for value. The GPU run of issue 63
(NCCL, one GPU a rank):

    python tools/bench_logprob_tp.py --T 8192 --H 4096 --V 151936 --tp 2 --dtype bf16 --device cuda \\
        --providers fused_cute,fused_triton --reps 5 --results $OUT/results

On CPU (gloo, the torch backend) it runs the same code at small shapes (tests/tools/test_bench_logprob_tp.py).

Per provider: `--tp` rank processes start at once (rank r on cuda:r, 127.0.0.1 only), each draws the same inputs
(seeded; the weight whole, then its shard), and times, after a barrier, its shard's floor (one GEMM before the
forward, the two-pass design's four GEMMs back to back before forward + backward: harness/head.gemm_floors_ms) and
the provider's forward and forward + backward (median of --reps after a warm-up; the backward with random upstream
gradients of log-prob and entropy). Rank 0 then times the provider on its device with the whole vocabulary (TP=1)
and compares: the largest |difference| of log-prob and entropy, and of its weight shard's gradient against the same
rows of the TP=1 gradient (relative L2; the hidden state's gradient is a sum over ranks that the caller's
all-reduce completes, so it is not compared here: tests/ops/test_logprob_tp_gpu.py checks it against fp64).
One row per provider into the kernel table (device e.g. `h200x2`, variant `<provider>, TP=<tp>`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import device_name, run_children, time_ms  # noqa: E402
from harness.head import DTYPES, gemm_floors_ms, make_inputs  # noqa: E402
from harness import results as tables  # noqa: E402

from rltrain.ops import logprobs_from_hidden  # noqa: E402
from rltrain.utils.distenv import free_port  # noqa: E402

BACKENDS = {"fused_torch": "torch", "fused_triton": "triton", "fused_cute": "cute"}


def _timed_step(hidden, weight, labels, backend, group, grads, reps, cuda):
    """(forward ms, forward + backward ms, (log-prob, entropy, weight grad) of one forward + backward)."""
    def step(backward: bool):
        if not backward:
            with torch.no_grad():
                return logprobs_from_hidden(hidden, weight, labels, tp_group=group, backend=backend)
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        lp, ent = logprobs_from_hidden(h, w, labels, tp_group=group, backend=backend)
        ((lp * grads[0]).sum() + (ent * grads[1]).sum()).backward()
        return lp.detach(), ent.detach(), w.grad

    out = step(True)
    fwd = time_ms(lambda: step(False), reps, cuda=cuda) if reps else None
    fb = time_ms(lambda: step(True), reps, cuda=cuda) if reps else None
    return fwd, fb, out


def rank_main(spec: dict, rank: int, port: int, out_path: str) -> None:
    """One rank: its shard's floors and times, and on rank 0 the TP=1 run and the comparison, written to out_path."""
    import torch.distributed as dist

    cuda, tp, reps = spec["device"] == "cuda", spec["tp"], spec["reps"]
    if cuda:
        torch.cuda.set_device(rank)
    dev = f"cuda:{rank}" if cuda else "cpu"
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=tp, **({"device_id": torch.device(dev)} if cuda else {}))
    group = dist.new_group(list(range(tp)))
    hidden, weight, labels, _ = make_inputs({**spec, "device": dev, "rows_fraction": None})
    g = torch.Generator(device=dev).manual_seed(1)
    grads = (torch.randn(spec["T"], generator=g, device=dev), torch.randn(spec["T"], generator=g, device=dev))
    v_local = spec["V"] // tp
    shard = weight[rank * v_local:(rank + 1) * v_local].contiguous()
    backend = BACKENDS[spec["provider"]]
    dist.barrier(group)
    one, four = gemm_floors_ms(hidden, shard, reps, four=True) if reps else (None, None)
    dist.barrier(group)
    fwd, fb, (lp, ent, gw) = _timed_step(hidden, shard, labels, backend, group, grads, reps, cuda)
    dist.barrier(group)
    dist.destroy_process_group()
    if rank != 0:
        return
    fwd1, fb1, (lp1, ent1, gw1) = _timed_step(hidden, weight, labels, backend, None, grads, reps, cuda)
    ref = gw1[:v_local].double()
    result = {"status": "ok", "fwd_ms": fwd, "fwdbwd_ms": fb, "gemm_ms": one, "gemm4_ms": four,
              "tp1_fwd_ms": fwd1, "tp1_fwdbwd_ms": fb1,
              "lp_max_abs_diff": (lp - lp1).abs().max().item(), "ent_max_abs_diff": (ent - ent1).abs().max().item(),
              "dweight_rel_l2": ((gw.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()}
    with open(out_path, "w") as f:
        json.dump(result, f)


def run_provider(spec: dict, timeout_s: int) -> dict:
    """The provider's `tp` ranks at once, each its own process -> rank 0's result (or the failure)."""
    port = free_port("127.0.0.1")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        jobs = {f"rank{r}": ([sys.executable, os.path.abspath(__file__), "--rank", str(r), "--port", str(port),
                              "--spec", json.dumps(spec), "--out-json", out], os.path.join(tmp, f"rank{r}.log"))
                for r in range(spec["tp"])}
        env = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
        res = run_children(jobs, timeout_s=timeout_s, env=env, poll_s=0.2)
        if os.path.exists(out):
            with open(out) as f:
                return json.load(f)
        failed = [n for n, r in res.items() if r["rc"] != 0 or r["timed_out"]] or list(res)
        with open(jobs[failed[0]][1], errors="replace") as f:
            tail = f.read()[-800:]
    return {"status": f"error in {failed[0]}: {tail}"}


def table_row(spec: dict, result: dict, date: str) -> dict:
    name = device_name() if spec["device"] == "cuda" else "CPU"
    metrics = {k: round(v, 6) if isinstance(v, float) else v for k, v in result.items() if k != "status"}
    variant = f"{spec['provider']}, TP={spec['tp']}" + ("" if spec["dtype"] == "bf16" else f", {spec['dtype']}")
    return tables.row("bench_logprob_tp", f"{spec['T']}x{spec['H']}x{spec['V']}",
                      tables.device_kind(name, gpus=spec["tp"]), variant, metrics, date=date)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--H", type=int, default=4096)
    ap.add_argument("--V", type=int, default=151936)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--providers", default="fused_cute,fused_triton")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--timeout", type=int, default=300, help="seconds a provider's ranks may take")
    ap.add_argument("--json", help="write the results here")
    tables.add_arguments(ap, "a row per provider (kernel)")
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # a rank process (run_provider starts them)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--out-json", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank is not None:
        rank_main(json.loads(args.spec), args.rank, args.port, args.out_json)
        return 0
    names = [p for p in args.providers.split(",") if p]
    bad = [p for p in names if p not in BACKENDS]
    why = (f"--providers {','.join(bad)}: the vocab-parallel head's providers are {', '.join(BACKENDS)}" if bad else
           f"--tp {args.tp}: at least 2" if args.tp < 2 else
           f"--V {args.V} is not a multiple of --tp {args.tp}" if args.V % args.tp else
           f"--device cuda --tp {args.tp}: this machine has {torch.cuda.device_count()} CUDA GPUs"
           if args.device == "cuda" and torch.cuda.device_count() < args.tp else "")
    if why:
        print(f"bench_logprob_tp: {why}", file=sys.stderr)
        return 2
    date, results, rows = datetime.date.today().isoformat(), {}, []
    print(f"T={args.T} H={args.H} V={args.V} TP={args.tp} dtype={args.dtype} device={args.device} "
          f"[{device_name()}]", flush=True)
    for name in names:
        spec = dict(T=args.T, H=args.H, V=args.V, tp=args.tp, dtype=args.dtype, device=args.device, reps=args.reps,
                    provider=name)
        r = results[name] = run_provider(spec, args.timeout)
        if r["status"] != "ok":
            print(f"{name}: {r['status']}", flush=True)
            continue
        rows.append(table_row(spec, r, date))
        times = (f"fwd {r['fwd_ms']:.2f} ms ({r['fwd_ms'] / r['gemm_ms']:.2f}x its shard's GEMM), fwd+bwd "
                 f"{r['fwdbwd_ms']:.2f} ms ({r['fwdbwd_ms'] / r['gemm4_ms']:.2f}x 4 GEMMs); TP=1 {r['tp1_fwd_ms']:.2f}"
                 f" / {r['tp1_fwdbwd_ms']:.2f} ms; " if args.reps else "")
        print(f"{name}: {times}max |diff| against TP=1: log-prob {r['lp_max_abs_diff']:.3g}, entropy "
              f"{r['ent_max_abs_diff']:.3g}; weight-shard grad rel L2 {r['dweight_rel_l2']:.3g}", flush=True)
    tables.upsert("kernel", rows, args.results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "results": results}, f, indent=1)
    return 0 if all(r["status"] == "ok" for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
