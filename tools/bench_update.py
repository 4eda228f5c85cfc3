"""Actor update step benchmark: Qwen3-0.6B and Qwen3-4B shapes (random init) at 8k and 32k tokens, with the
speed levers of issue 17 switched on and off, each configuration in its own subprocess (fresh GPU memory),
results written after every row to --out (bench_update.json + bench_update.md). Not a test.

    python tools/bench_update.py --list                       # the plan with predicted times, then exit
    python tools/bench_update.py --out $OUT                   # plan "full" (< 9 min on one H200)
    python tools/bench_update.py --out $OUT --plan quick      # the most telling rows (~5 min on one H200)
    python tools/bench_update.py --out $OUT --plan h100       # the Qwen3-0.6B rows only (one H100)
    python tools/bench_update.py --out $OUT --plan tp2        # two GPUs: TP=2 rows
    python tools/bench_update.py --out $OUT --rows '06b-8k-*' --reps 3

Each row: one sequence of `tokens` tokens (one micro-batch), PPO loss, AdamW step on fp32 master weights, bf16
params; one warm-up step (compiles kernels; its loss and grad norm are recorded: rows of one shape must agree
to bf16 rounding, which checks that a lever changes speed and not math), then --reps timed steps (median,
min, max). MFU = model FLOPs (rltrain/utils/flops.py `train_flops`: 6 per weight per token incl. the LM head,
plus causal attention; recomputation not counted) / step time / (peak_flops: 989 TFLOP/s dense bf16 x the row's GPUs: a TP=2
row's MFU is per GPU). Peak = max allocated (rank 0's GPU).

Levers (a row's fields; LEVER_SETS names the combinations):
- norms: "bf16" (build.py casts the norms to the params dtype, torch.rms_norm runs fused) or "fp32" (the
  model as built before: fp32 norm weights, torch's unfused composite; this tool reproduces it).
- optim: "fused" (AdamW(fused=True), the engine's choice on CUDA) or "foreach" (torch's default before).
- fusion: the engine's elementwise_fusion: "none", "mcore" (megatron's SwiGLU/bias-dropout-add fusions),
  "compile" (torch.compile of each layer).
- recompute: "none", "full" (whole layers) or "selective" (the MLP of each layer).
- head: "fused" (Triton LM head) or "unfused" (materialized logits).
- tp: 1 or 2 (two GPUs: the row's child spawns two ranks; rank 0 reports).
Not switchable here: the one-sync train step and the foreach grad norm/clip (engine code, always on).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fnmatch
import json
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/, for the harness
from harness import device_name, gemm_tflops, md_table, report_header, run_json_child, time_ms, times_ms, write_report
from harness import results as tables
from harness.cases import LEVER_SETS, PRESETS, Row, build_for_row, hf_config  # noqa: F401 (tests import them here)
from harness.update_profile import profile_train_step

from rltrain.utils.flops import peak_flops, train_flops
from rltrain.workers.base import free_port, publish_dist_env

SHORT = {"qwen3-0.6b": "06b", "qwen3-4b": "4b", "tiny": "tiny"}


def _row(preset: str, tokens: int, levers: str, *, recompute: str = "none", head: str = "fused", tp: int = 1,
         profile: bool = False) -> Row:
    size = f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)
    tag = f"{SHORT[preset]}-{size}-{levers}" + (f"-rc_{recompute}" if recompute != "none" else "") \
        + ("-unfused" if head == "unfused" else "") + (f"-tp{tp}" if tp > 1 else "")
    return Row(name=tag, preset=preset, tokens=tokens, head=head, recompute=recompute, tp=tp, profile=profile,
               **LEVER_SETS[levers])


def plans() -> dict[str, list[Row]]:
    p06, p4 = "qwen3-0.6b", "qwen3-4b"
    small_8k = [_row(p06, 8192, "legacy", profile=True), _row(p06, 8192, "norms"), _row(p06, 8192, "norms+optim"),
                _row(p06, 8192, "mcore"), _row(p06, 8192, "all", profile=True),
                _row(p06, 8192, "all", head="unfused")]
    small_32k = [_row(p06, 32768, "legacy", recompute="full"), _row(p06, 32768, "all", recompute="full"),
                 _row(p06, 32768, "all", recompute="selective"), _row(p06, 32768, "all")]
    big = [_row(p4, 8192, "legacy"), _row(p4, 8192, "all"), _row(p4, 8192, "all", head="unfused"),
           _row(p4, 32768, "legacy", recompute="full"), _row(p4, 32768, "all", recompute="full"),
           _row(p4, 32768, "all", recompute="selective")]
    # ~5 min on one H200: before/after at each shape (4B/32k "legacy" is issue 17's 5.37 s on the same kind)
    quick = [small_8k[0], small_8k[4], small_32k[0], small_32k[2], big[0], big[1], big[5]]
    tp2 = [_row(p06, 8192, "legacy", tp=2), _row(p06, 8192, "mcore", tp=2), _row(p4, 8192, "mcore", tp=2),
           _row(p4, 32768, "mcore", recompute="selective", tp=2), _row(p4, 8192, "all", tp=2)]
    # issue 17's 64k row (5.63 s, 30.7% with the legacy engine and full recompute): ~2 min on one H100
    small_64k = [_row(p06, 65536, "legacy", recompute="full"), _row(p06, 65536, "all", recompute="full"),
                 _row(p06, 65536, "all", recompute="selective")]
    full = [small_8k[0], small_8k[2], small_8k[4]] + small_32k + big  # < 9 min on one H200
    # issue 36: lengths no row had, to check rltrain.plan's attention rate blind (predicted with --plan-json first);
    # the 0.6B on one H100, ~4 min
    lengths = [_row(p06, 16384, "all"), _row(p06, 16384, "norms+optim"), _row(p06, 49152, "all", recompute="selective"),
               _row(p06, 49152, "norms+optim", recompute="full"), _row(p06, 98304, "all", recompute="full"),
               _row(p06, 131072, "all", recompute="full")]
    return {"full": full, "quick": quick, "h100": small_8k + small_32k, "h100-64k": small_64k,
            "h200-4b": big, "tp2": tp2, "lengths": lengths,
            "cpu": [_row("tiny", 256, "legacy", profile=True), _row("tiny", 256, "norms+optim")]}


# ------------------------------------------------------------------ predictions (docs/benchmarks/kernel.md)
# Predicted s/step per (preset, tokens, lever set, recompute, head), written before the GPU run: the 0.6B
# rows for one H100, the 4B rows for one H200 (issue 17's measurements are the "legacy" values).
PREDICTED_STEP_S = {
    ("qwen3-0.6b", 8192, "legacy", "none", "fused"): 0.269,
    ("qwen3-0.6b", 8192, "norms", "none", "fused"): 0.215,
    ("qwen3-0.6b", 8192, "norms+optim", "none", "fused"): 0.203,
    ("qwen3-0.6b", 8192, "mcore", "none", "fused"): 0.197,
    ("qwen3-0.6b", 8192, "all", "none", "fused"): 0.175,
    ("qwen3-0.6b", 8192, "all", "none", "unfused"): 0.220,
    ("qwen3-0.6b", 32768, "legacy", "full", "fused"): 1.82,
    ("qwen3-0.6b", 32768, "all", "full", "fused"): 1.49,
    ("qwen3-0.6b", 32768, "all", "selective", "fused"): 1.24,
    ("qwen3-0.6b", 32768, "all", "none", "fused"): 1.21,
    # 64k (2026-11-25): issue 17's legacy 32k -> 64k ratio (1.82 -> 5.63 s, 3.09x: attention grows 4x) applied to
    # the measured 32k rows (all + selective 1.121 s; all + full not measured at 32k: its 1.49 s prediction)
    ("qwen3-0.6b", 65536, "legacy", "full", "fused"): 5.63,
    ("qwen3-0.6b", 65536, "all", "full", "fused"): 4.60,
    ("qwen3-0.6b", 65536, "all", "selective", "fused"): 3.46,
    ("qwen3-4b", 8192, "legacy", "none", "fused"): 0.775,
    ("qwen3-4b", 8192, "all", "none", "fused"): 0.53,
    ("qwen3-4b", 8192, "all", "none", "unfused"): 0.60,
    ("qwen3-4b", 32768, "legacy", "full", "fused"): 5.37,
    ("qwen3-4b", 32768, "all", "full", "fused"): 4.66,
    ("qwen3-4b", 32768, "all", "selective", "fused"): 3.96,
}


def _levers_of(row: Row) -> str:
    return next((k for k, v in LEVER_SETS.items() if all(getattr(row, f) == x for f, x in v.items())), "custom")


def mfu_per_gpu(flops: float, step_s: float, gpus: int, device: str | None = None) -> float:
    """Model FLOPs per second over the peak of the GPUs the step ran on (rltrain.utils.flops.peak_flops each)."""
    return flops / step_s / (peak_flops(device) * gpus)


def predicted_step_s(row: Row) -> float:
    """PREDICTED_STEP_S, else 30% MFU; TP=2: the same at 0.6B (issue 17: 0.237 vs 0.231 s), 0.6x at 4B."""
    levers = "mcore" if row.tp > 1 and _levers_of(row) == "all" else _levers_of(row)
    key = (row.preset, row.tokens, levers, row.recompute, row.head)
    step = PREDICTED_STEP_S.get(key) if row.seq_len is None else None
    if step is None:
        rows, length = row.rows_and_len
        step = train_flops(hf_config(row.preset), rows * length, length) / (0.30 * peak_flops())
    return step * (0.6 if row.tp > 1 and row.preset == "qwen3-4b" else 1.0)


def predicted_row_s(row: Row, reps: int, compiled_before: bool) -> float:
    """Wall time of one row: process start + imports (~12 s), build (GPU init), warm-up + timed steps,
    compile (first compiling row ~60 s, later ones hit inductor's caches ~15 s), profile (~2 steps + parse)."""
    build = {"qwen3-0.6b": 3.0, "qwen3-4b": 10.0, "tiny": 1.0}[row.preset]
    compile_s = 0.0 if row.fusion != "compile" else (15.0 if compiled_before else 60.0)
    step = predicted_step_s(row)
    prof = (3 * step + 10.0) if row.profile else 0.0
    return 12.0 + build + compile_s + (1 + reps) * step + prof + (8.0 if row.tp == 2 else 0.0)


def table_row(out: dict, row: Row, device: str, date: str) -> dict | None:
    """A finished row as a row of the update table (tools/results/update.jsonl): its peak, reserved memory, step and
    MFU, or fits 0 when it ran out of memory; None for a row that did not run."""
    if out["status"] == "ok":
        metrics = {k: out[k] for k in ("peak_gib", "reserved_gib", "step_s", "mfu", "tokens_per_s") if out.get(k)}
    elif out["status"] == "OOM":
        metrics = {"fits": 0.0}
    else:
        return None
    r = tables.row("bench_update", row.preset, tables.device_kind(device, row.tp), row.name, metrics, date=date,
                   config=row.overrides())
    r["scope"] = "update"
    if row.norms == "fp32":
        r["legacy"] = ["all"]  # the engine before the 2026-11-23 levers: rltrain.plan does not describe it
    return r


def write_plan_predictions(rows: list[Row], gpu: str, path: str) -> None:
    """rltrain.plan's peak memory, update step time and fit of each row as its config (Row.overrides: one sequence of
    `tokens` in one micro-batch) on one `gpu` -> JSON at `path`."""
    from planlab.cases import Case
    from planlab.fit import predict

    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gpu": gpu,
           "command": "python " + " ".join(sys.argv), "rows": {}}
    for r in rows:
        case = Case(r.name, gpu, r.preset, out["date"][:10], r.overrides(), "update", {})
        p = predict(case)
        out["rows"][r.name] = {k: round(p[k], 4) for k in ("peak_gib", "reserved_gib", "step_s", "fits")}
        print(f"  {r.name:36s} plan: peak {p['peak_gib']:6.2f} GiB, step {p['step_s']:6.3f} s, "
              f"fits {bool(p['fits'])}")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


# ------------------------------------------------------------------ one row
def run_row(row: Row, reps: int, out_dir: str) -> dict:
    """Build, warm up, time; in this process. Returns the row's result dict."""
    import torch

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    res: dict = {"row": dataclasses.asdict(row)}
    t0 = time.perf_counter()
    eng, mbs, loss_fn = build_for_row(row)
    res["build_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    first = eng.train_step([dict(mb) for mb in mbs], loss_fn)
    sync()
    res["warmup_s"] = time.perf_counter() - t0
    res["warmup_loss"], res["warmup_grad_norm"] = first["loss"], first["grad_norm"]
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = [ms / 1e3 for ms in times_ms(lambda: eng.train_step([dict(mb) for mb in mbs], loss_fn), reps, warmup=0)]
    step = statistics.median(times)
    cfg = hf_config(row.preset)
    rows, length = row.rows_and_len
    flops = train_flops(cfg, rows * length, length)
    res.update(status="ok", step_s=step, step_min_s=min(times), step_max_s=max(times), reps=reps,
               tokens_per_s=rows * length / step, mfu=mfu_per_gpu(flops, step, row.tp, device_name()), model_tflop=flops / 1e12,
               peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
               reserved_gib=torch.cuda.max_memory_reserved() / 2**30 if cuda else None)
    if row.profile:
        s = profile_train_step(eng, mbs, loss_fn, out_dir=out_dir, name=row.name, steps=2, warmup=0)
        res["profile"] = {"step_ms": s["step_ms"], "host_syncs_per_step": s["host_syncs_per_step"],
                          "rows": s["rows"]}
    return res


def _tp_worker(rank: int, row_json: str, reps: int, out_dir: str, port: int) -> None:
    publish_dist_env(rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port, local_rank=rank)
    import torch

    torch.cuda.set_device(rank)
    row = Row(**json.loads(row_json))
    res = run_row(row, reps, out_dir)
    if rank == 0:
        with open(os.path.join(out_dir, f"row_{row.name}.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)


def child(row: Row, reps: int, out_dir: str) -> None:
    """One row in this (fresh) process; writes row_<name>.json. OOM and errors are results."""
    import torch

    path = os.path.join(out_dir, f"row_{row.name}.json")
    try:
        if row.tp > 1:
            import torch.multiprocessing as mp

            assert torch.cuda.device_count() >= row.tp, f"row {row.name} needs {row.tp} GPUs"
            mp.spawn(_tp_worker, args=(json.dumps(dataclasses.asdict(row)), reps, out_dir, free_port()), nprocs=row.tp)
            return
        res = run_row(row, reps, out_dir)
    except torch.OutOfMemoryError as err:
        res = {"row": dataclasses.asdict(row), "status": "OOM", "error": str(err).splitlines()[0][:300]}
    except Exception as err:  # noqa: BLE001 - a failed row is a result; the others still run
        res = {"row": dataclasses.asdict(row), "status": "error", "error": f"{type(err).__name__}: {err}"[:500],
               "traceback": traceback.format_exc()[-3000:]}
    with open(path, "w") as f:
        json.dump(res, f, indent=1, default=str)


# ------------------------------------------------------------------ attention backends
def attention_probe(shapes=((16, 8, 8192), (16, 8, 32768), (32, 8, 8192), (32, 8, 32768)), reps: int = 3) -> list:
    """Causal SDPA fwd and fwd+bwd at the models' attention shapes (q heads, kv heads, tokens; head dim 128,
    bf16, one sequence), per backend: what SDPACoreAttention runs today (`enable_gqa=True`, torch picks), each
    backend forced, and K/V expanded to the q heads first (cuDNN and efficient attention take no GQA broadcast).
    TFLOP/s from causal FLOPs (fwd 2*s^2*d*hq, bwd 2.5x fwd)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def timed(fn):
        return time_ms(fn, reps=reps, warmup=1, cuda=True)

    variants = {"default (gqa)": (None, False), "flash (gqa)": (SDPBackend.FLASH_ATTENTION, False),
                "cudnn (gqa)": (SDPBackend.CUDNN_ATTENTION, False),
                "cudnn (kv expanded)": (SDPBackend.CUDNN_ATTENTION, True),
                "flash (kv expanded)": (SDPBackend.FLASH_ATTENTION, True),
                "default (kv expanded)": (None, True)}
    rows = []
    for hq, hkv, s in shapes:
        g = torch.Generator(device="cuda").manual_seed(hq + s)
        q = torch.randn(1, hq, s, 128, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
        k = torch.randn(1, hkv, s, 128, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
        v = torch.randn(1, hkv, s, 128, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
        dout = torch.randn(1, hq, s, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        fwd_flop = 2.0 * s * s * 128 * hq
        for name, (backend, expand) in variants.items():
            def attn():
                kk, vv = (k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)) if expand else (k, v)
                ctx = sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext()
                with ctx:
                    return F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=not expand)

            row = {"hq": hq, "hkv": hkv, "tokens": s, "variant": name}
            try:
                with torch.no_grad():
                    row["fwd_ms"] = timed(attn)
                row["fwdbwd_ms"] = timed(lambda: torch.autograd.backward(attn(), dout))
                row["fwd_tflops"] = fwd_flop / row["fwd_ms"] / 1e9
                row["bwd_tflops"] = 2.5 * fwd_flop / (row["fwdbwd_ms"] - row["fwd_ms"]) / 1e9
            except Exception as err:  # noqa: BLE001 - an unsupported backend is a result
                row["error"] = f"{type(err).__name__}: {err}".splitlines()[0][:160]
            rows.append(row)
            print("[attention]", row, flush=True)
        del q, k, v, dout
        torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------ report
def _md_row(r: dict) -> tuple:
    row = Row(**r["row"])
    head = (row.name, row.tokens, f"{_levers_of(row)} ({row.norms} norms, {row.optim} AdamW, fusion {row.fusion})",
            row.recompute, row.head, row.tp, r["status"])
    if r["status"] != "ok":
        return (*head, "-", f"{r.get('predicted_step_s', 0):.3f}", "-", "-", str(r.get("error"))[:100])
    return (*head, f"{r['step_s']:.3f} ({r['step_min_s']:.3f}-{r['step_max_s']:.3f})", f"{r.get('predicted_step_s', 0):.3f}",
            f"{100 * r['mfu']:.1f}%", f"{(r['peak_gib'] or 0):.1f}", f"{r['warmup_loss']:.4f} / {r['warmup_grad_norm']:.4g}")


def to_markdown(res: dict) -> str:
    lines = [f"# Actor update step ({res['date']}, {res['device']}, torch {res['torch']})", "",
             f"Command: `{res['command']}`; measured bf16 GEMM ceiling {res.get('gemm_tflops', 0):.0f} TFLOP/s; "
             f"MFU against {peak_flops(res['device']) / 1e12:.0f} TFLOP/s per GPU (a TP=2 row: the FLOPs over two "
             "GPUs' peak).", "",
             md_table(["row", "tokens", "levers", "recompute", "head", "TP", "status", "s/step (min-max)", "pred s", "MFU",
                       "peak GiB", "warm-up loss / grad norm"], [_md_row(r) for r in res["rows"]])]
    if res.get("attention"):
        lines += ["", "Causal SDPA, one sequence, head dim 128, bf16 (ms; TFLOP/s from causal FLOPs, bwd = 2.5x fwd):",
                  "", md_table(["q/kv heads", "tokens", "variant", "fwd ms", "fwd+bwd ms", "fwd TFLOP/s", "bwd TFLOP/s"],
                               [(f"{a['hq']}/{a['hkv']}", a["tokens"], a["variant"], a["error"][:80], "", "", "")
                                if "error" in a else
                                (f"{a['hq']}/{a['hkv']}", a["tokens"], a["variant"], f"{a['fwd_ms']:.2f}",
                                 f"{a['fwdbwd_ms']:.2f}", f"{a['fwd_tflops']:.0f}", f"{a['bwd_tflops']:.0f}")
                                for a in res["attention"]])]
    profiled = [r for r in res["rows"] if r.get("profile")]
    if profiled:
        cats = [c["category"] for c in profiled[0]["profile"]["rows"]]
        rows = [(c, *(f"{p['profile']['rows'][i]['ms']:.1f} ({100 * p['profile']['rows'][i]['share']:.0f}%)"
                      for p in profiled)) for i, c in enumerate(cats)]
        rows.append(("host syncs/step", *(f"{p['profile']['host_syncs_per_step']:.0f}" for p in profiled)))
        lines += ["", "Profiles (kernel ms per step by category; details in profile_<row>.md):", "",
                  md_table(["category", *(r["row"]["name"] for r in profiled)], rows, ["---"] + ["---:"] * len(profiled))]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_update_out"))
    ap.add_argument("--plan", default="full", choices=sorted(plans()))
    ap.add_argument("--rows", nargs="*", help="only rows whose name matches one of these globs")
    ap.add_argument("--preset", choices=sorted(PRESETS), help="only rows of this preset")
    ap.add_argument("--tokens", type=int, nargs="*", help="only rows with these token counts")
    ap.add_argument("--reps", type=int, default=2, help="timed steps per row (after one warm-up)")
    ap.add_argument("--budget-s", type=float, default=540.0,
                    help="skip a row when the predicted total would pass this (the device's 10-minute limit)")
    ap.add_argument("--no-profile", action="store_true", help="skip the profiles of the profiled rows")
    ap.add_argument("--no-attention-probe", action="store_true",
                    help="skip the SDPA backend timing (fwd / fwd+bwd per backend at the models' shapes, ~15 s)")
    ap.add_argument("--list", action="store_true", help="print the plan with predicted times and exit")
    ap.add_argument("--plan-json", metavar="PATH",
                    help="write rltrain.plan's prediction of each row (peak GiB, step s, fits) for --gpu and exit: "
                         "the prediction a run is compared with, written before it runs")
    ap.add_argument("--gpu", choices=["h100", "h200"], default="h100", help="the device of --plan-json")
    tables.add_arguments(ap, "each finished row (update)")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # internal: one row (JSON) in this process
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)  # internal: device + GEMM ceiling
    args = ap.parse_args()
    from rltrain.utils.distenv import apply_no_multicast

    apply_no_multicast()  # every process this tool starts inherits it
    os.makedirs(args.out, exist_ok=True)
    if args.child:
        child(Row(**json.loads(args.child)), args.reps, args.out)
        return
    if args.probe:  # in a child, so that the parent never holds a CUDA context next to the rows
        import torch

        cuda = torch.cuda.is_available()
        probe = {"device": device_name(), "torch": torch.__version__,
                 "gemm_tflops": gemm_tflops() if cuda else 0.0, "attention": []}
        try:
            if cuda and not args.no_attention_probe:
                probe["attention"] = attention_probe()
        except Exception as err:  # noqa: BLE001 - the rows still run
            probe["attention_error"] = f"{type(err).__name__}: {err}"[:300]
        with open(os.path.join(args.out, "probe.json"), "w") as f:
            json.dump(probe, f)
        return
    rows = plans()[args.plan]
    if args.rows:
        rows = [r for r in rows if any(fnmatch.fnmatch(r.name, g) for g in args.rows)]
    if args.preset:
        rows = [r for r in rows if r.preset == args.preset]
    if args.tokens:
        rows = [r for r in rows if r.tokens in args.tokens]
    if args.no_profile:
        rows = [dataclasses.replace(r, profile=False) for r in rows]
    if not rows:
        sys.exit("bench_update: no row matches --plan/--rows/--preset/--tokens; see --list")
    preds, compiled = [], False
    for r in rows:
        preds.append(predicted_row_s(r, args.reps, compiled))
        compiled |= r.fusion == "compile"
    preds[0] += 15.0 if args.no_attention_probe else 30.0  # the device probe before the first row
    print(f"[bench_update] plan {args.plan}: {len(rows)} rows, predicted {sum(preds):.0f} s "
          f"(budget {args.budget_s:.0f} s)")
    for r, p in zip(rows, preds):
        print(f"  {r.name:36s} predicted step {predicted_step_s(r):6.3f} s, row {p:5.0f} s")
    if args.plan_json:
        write_plan_predictions(rows, args.gpu, args.plan_json)
        return
    if args.list:
        return
    start = time.time()
    probe, _ = run_json_child([sys.executable, os.path.abspath(__file__), "--probe", "--out", args.out]
                              + (["--no-attention-probe"] if args.no_attention_probe else []),
                              os.path.join(args.out, "probe.json"), timeout_s=300)
    probe = probe or {"device": "unknown (probe failed)", "torch": "?", "gemm_tflops": 0.0}
    res = {**report_header("bench_update", probe["device"]), **probe, "plan": args.plan, "rows": []}
    for r, pred in zip(rows, preds):
        elapsed = time.time() - start
        if elapsed + pred > args.budget_s:
            out = {"row": dataclasses.asdict(r), "status": "skipped (budget)"}
        else:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(dataclasses.asdict(r)),
                   "--out", args.out, "--reps", str(args.reps)]
            t0 = time.time()  # the row's output streams to the console
            out, run = run_json_child(cmd, os.path.join(args.out, f"row_{r.name}.json"), timeout_s=max(120.0, 3 * pred))
            if out is None:
                rc = "timeout" if run["timed_out"] else run["rc"]
                out = {"row": dataclasses.asdict(r), "status": f"died (exit {rc})"}
            out["wall_s"] = time.time() - t0
        out["predicted_step_s"], out["predicted_row_s"] = predicted_step_s(r), pred
        res["rows"].append(out)
        st = out["status"]
        msg = (f"{out['step_s']:.3f} s/step, MFU {100 * out['mfu']:.1f}%, peak {(out['peak_gib'] or 0):.1f} GiB"
               if st == "ok" else st)
        print(f"[bench_update] {r.name}: {msg} ({out.get('wall_s', 0):.0f} s, predicted {pred:.0f} s)", flush=True)
        write_report(args.out, "bench_update", res, to_markdown(res))
        done = table_row(out, r, probe["device"], res["date"])
        if done is not None:
            tables.upsert("update", [done], args.results)
    print(to_markdown(res))


if __name__ == "__main__":
    main()
