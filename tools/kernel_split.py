"""Where the fused head's time goes (issue 17: "the measured reason" for the kernel rows). Not a test and
not a library path: diagnostic copies of the two Triton kernels of `rltrain/ops/logprob_triton.py` with
one stage left out or done differently, timed side by side with the library kernels and cuBLAS on one GPU.

    python tools/kernel_split.py --out $OUT                      # forward + backward splits (~3 min, H100)
    python tools/kernel_split.py --out $OUT --only fwd --shapes 8192,4096,151936
    git show HEAD~1:rltrain/ops/logprob_triton.py > .whl/base.py
    python tools/kernel_split.py --out $OUT --only ab --baseline .whl/base.py   # before/after, interleaved
    ncu --clock-control none -k regex:_fwd_stats --launch-skip 2 --launch-count 1 --section WarpStateStats \
        python tools/kernel_split.py --ncu-target --shapes 8192,4096,151936   # stall reasons of the forward

Forward probes (the grid, split rule and TMA mainloop `_logit_tile_desc` of the library before 2026-11-25):
  var 0  that library's epilogue (columns >= V set to -inf, where() on p*z, label select in every tile)
  var 1  columns >= V set to a finite -1e30 instead: p is still exactly 0 there and p*z is 0, no where()
  var 3  mainloop only: the epilogue is a row sum of z (the GEMM in this loop structure, no softmax)
each with `flatten` on the vocab-tile loop (the K-loop pipeline crosses tile boundaries) or not, and the
number of vocab splits (waves of ~#SM programs: a last partial wave idles the rest of the chip).
Backward: a torch-profiler split of `logprob_triton.backward` by kernel (Triton recompute, cuBLAS dH/dW,
copies), and one chunk's recompute kernel vs a cuBLAS GEMM of the same [Tc, Vs, H] shape, with the dlogits
tile stored through 64-bit pointers (the library kernel), 32-bit offsets, or a TMA tensor descriptor.
Registers and spills come from the compiled kernels (`n_regs`, `n_spills`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rltrain.ops import logprob_triton as K  # noqa: E402
from rltrain.ops.logprob_triton import _logit_tile_desc  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_logprob_check import time_ms  # noqa: E402  (CUDA-event median, the benchmarks' one timer)

RESULTS: dict = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
OUT = Path(os.environ.get("OUT", "/tmp/kernel_split"))


@triton.jit
def _fwd_probe(h_desc, w_desc, lab_ptr, m_ptr, s_ptr, t_ptr, zl_ptr, N, V, H, inv_temp, tiles_per_split,
               num_splits, VAR: tl.constexpr, FLAT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    split = pid % num_splits
    pid_m = pid // num_splits
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    labels = tl.load(lab_ptr + tl.minimum(rows, N - 1))
    m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_M,), dtype=tl.float32)
    t = tl.zeros((BLOCK_M,), dtype=tl.float32)
    zl = tl.zeros((BLOCK_M,), dtype=tl.float32)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, tl.cdiv(V, BLOCK_N))
    for tile in tl.range(tile_lo, tile_hi, flatten=FLAT):
        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < V
        z = _logit_tile_desc(h_desc, w_desc, pid_m * BLOCK_M, tile * BLOCK_N, H, BLOCK_M, BLOCK_N, BLOCK_K) * inv_temp
        if VAR == 3:
            s += tl.sum(z, axis=1)
        else:
            if VAR == 0:
                z = tl.where(col_ok[None, :], z, float("-inf"))
            else:
                z = tl.where(col_ok[None, :], z, -1.0e30)
            m_new = tl.maximum(m, tl.max(z, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(z - m_new[:, None])
            s = s * alpha + tl.sum(p, axis=1)
            if VAR == 0:
                t = t * alpha + tl.sum(tl.where(col_ok[None, :], p * z, 0.0), axis=1)
            else:
                t = t * alpha + tl.sum(p * z, axis=1)
            zl += tl.sum(tl.where(cols[None, :] == labels[:, None], z, 0.0), axis=1)
            m = m_new
    out = split * N + rows
    tl.store(m_ptr + out, m, mask=row_ok)
    tl.store(s_ptr + out, s, mask=row_ok)
    tl.store(t_ptr + out, t, mask=row_ok)
    tl.store(zl_ptr + out, zl, mask=row_ok)


@triton.jit
def _dlogits_probe(h_desc, w_desc, dz_desc, lab_ptr, lse_ptr, mz_ptr, glp_ptr, gent_ptr, dz_ptr, N, V,
                   col_offset, H, stride_dz, inv_temp, STORE: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    n_m = tl.cdiv(N, BLOCK_M)
    n_n = tl.cdiv(V, BLOCK_N)
    per_group = GROUP_M * n_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_c = tl.minimum(rows, N - 1)
    z = _logit_tile_desc(h_desc, w_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, H, BLOCK_M, BLOCK_N, BLOCK_K) * inv_temp
    lse = tl.load(lse_ptr + rows_c)
    glp = tl.load(glp_ptr + rows_c)
    labels = tl.load(lab_ptr + rows_c)
    mz = tl.load(mz_ptr + rows_c)
    gent = tl.load(gent_ptr + rows_c)
    p = tl.exp(z - lse[:, None])
    is_label = (cols[None, :] + col_offset) == labels[:, None]
    dz = tl.where(is_label, glp[:, None], 0.0) - glp[:, None] * p + gent[:, None] * p * (mz[:, None] - z)
    dz = (dz * inv_temp).to(tl.bfloat16)
    if STORE == 1:  # one 64-bit base per tile + 32-bit offsets
        base = dz_ptr + (pid_m * BLOCK_M).to(tl.int64) * stride_dz + pid_n * BLOCK_N
        offs = tl.arange(0, BLOCK_M)[:, None] * stride_dz + tl.arange(0, BLOCK_N)[None, :]
        tl.store(base + offs, dz, mask=(rows < N)[:, None] & (cols < V)[None, :])
    else:  # TMA store (the copy engine clips rows/columns past the tensor)
        dz_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], dz)


def inputs(t, h_dim, v, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(t, h_dim, device="cuda", generator=g).bfloat16()
    w = (torch.randn(v, h_dim, device="cuda", generator=g) * 0.02).bfloat16()
    lab = torch.randint(0, v, (t,), device="cuda", generator=g)
    return h, w, lab


def default_splits(n_m: int, n_tiles: int) -> int:
    """The split rule of the library before 2026-11-25 (no wave rounding), for the probes."""
    want = max(K._FWD_MIN_SPLITS, triton.cdiv(4 * torch.cuda.get_device_properties(0).multi_processor_count, n_m))
    return max(1, min(want, n_tiles // 4 if n_tiles >= 4 else 1))


def fwd_probe(h, w, lab, var, flat, cfg, splits):
    """Launch the forward probe; returns (merged m, s, t, zl) and the compiled kernel."""
    bm, bn, bk, warps, stages = cfg
    n, _ = h.shape
    v = w.shape[0]
    n_m, n_tiles = triton.cdiv(n, bm), triton.cdiv(v, bn)
    splits = splits or default_splits(n_m, n_tiles)
    per = triton.cdiv(n_tiles, splits)
    splits = triton.cdiv(n_tiles, per)
    part = torch.full((4, splits, n), float("nan"), device="cuda")  # poisoned: every element must be written
    hd = K._TensorDescriptor.from_tensor(h, [bm, bk])
    wd = K._TensorDescriptor.from_tensor(w, [bn, bk])
    ck = _fwd_probe[(n_m * splits,)](hd, wd, lab, part[0], part[1], part[2], part[3], n, v, h.shape[1], 1.0,
                                     per, splits, VAR=var, FLAT=flat, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                     num_warps=warps, num_stages=stages)
    mp, sp, tp, zp = part
    m = mp.max(0).values
    sc = torch.exp(mp - m)
    return (m, (sp * sc).sum(0), (tp * sc).sum(0), zp.sum(0)), ck, splits


def fwd_split(shape, cfgs, splits_list) -> list[dict]:
    t, h_dim, v = shape
    h, w, lab = inputs(t, h_dim, v, 3)
    rows = []
    gemm = time_ms(lambda: torch.mm(h, w.T))
    flop = 2.0 * t * h_dim * v
    rows.append(dict(shape=shape, what="cuBLAS bf16 GEMM h @ W.T", ms=gemm, tflops=flop / gemm / 1e9))
    ref = K.forward_stats(h, w, lab, 1.0, True)
    for ent in (True, False):
        ms = time_ms(lambda: K.forward_stats(h, w, lab, 1.0, ent))
        rows.append(dict(shape=shape, what=f"library forward_stats, entropy {'on' if ent else 'off'}", ms=ms,
                         x_gemm=ms / gemm))
    base = K._config("fwd", torch.bfloat16)
    for cfg in cfgs:
        for var in (0, 1, 3):
            for flat in (False, True):
                for splits in splits_list:
                    if (cfg != base or var == 3) and splits is not None:
                        continue  # splits sweep on the library tile, for the softmax variants only
                    row = dict(shape=shape, what=f"probe var {var}", var=var, flatten=flat, cfg=cfg,
                               splits=splits or "default")
                    try:
                        out, ck, used = fwd_probe(h, w, lab, var, flat, cfg, splits)
                        row.update(splits_used=used, programs=triton.cdiv(t, cfg[0]) * used,
                                   n_regs=ck.n_regs, n_spills=ck.n_spills)
                        if var != 3:
                            lse, lse_ref = out[0] + out[1].log(), ref[0] + ref[1].log()
                            row["lse_maxdiff"] = (lse - lse_ref).abs().max().item()
                            row["t_over_s_maxdiff"] = (out[2] / out[1] - ref[2] / ref[1]).abs().max().item()
                            row["zl_maxdiff"] = (out[3] - ref[3]).abs().max().item()
                        row["ms"] = time_ms(lambda: fwd_probe(h, w, lab, var, flat, cfg, splits))
                        row["x_gemm"] = row["ms"] / gemm
                    except Exception as exc:  # noqa: BLE001
                        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                    rows.append(row)
                    print("fwd", row, flush=True)
    del h, w
    torch.cuda.empty_cache()
    return rows


def bwd_split(shape) -> dict:
    t, h_dim, v = shape
    h, w, lab = inputs(t, h_dim, v, 4)
    g = torch.Generator(device="cuda").manual_seed(9)
    glp, gent = torch.randn(t, device="cuda", generator=g), torch.randn(t, device="cuda", generator=g)
    m, s, tt, zl = K.forward_stats(h, w, lab, 1.0, True)
    lse, mz = m + s.log(), tt / s
    call = lambda: K.backward(h, w, lab, lse, mz, glp, gent, 1.0, True, True)  # noqa: E731
    res = dict(shape=shape, gemm_ms=time_ms(lambda: torch.mm(h, w.T)), backward_ms=time_ms(call, n=5))
    call()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    cats: dict[str, dict] = {}
    for ev in prof.key_averages():
        name = ev.key
        dev_us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if dev_us <= 0:
            continue
        low = name.lower()
        cat = ("triton dlogits" if "dlogits" in low else "cuBLAS GEMM" if ("gemm" in low or "sm90" in low
               or "cutlass" in low or "nvjet" in low) else "copy/fill/add")
        c = cats.setdefault(cat, dict(ms=0.0, calls=0, kernels={}))
        c["ms"] += dev_us / 1e3
        c["calls"] += ev.count
        c["kernels"][name[:120]] = round(dev_us / 1e3, 3)
    res["profile"] = cats
    # one chunk of the loop: recompute kernel variants vs a cuBLAS GEMM of the same shape
    bm, bn, bk, warps, stages = K._config("bwd", torch.bfloat16)
    ts, vs, tc = K._bwd_sizes(t, v, h_dim, True, None, bm, bn)
    hc, ws = h[:tc], w[:vs]
    res["chunk"] = dict(Ts=ts, Vs=vs, Tc=tc, gemm_ms=time_ms(lambda: torch.mm(hc, ws.T), n=20))
    ref = None
    for store in (0, 1, 2):
        dz = torch.full((tc, vs), float("nan"), device="cuda", dtype=torch.bfloat16)
        hd = K._TensorDescriptor.from_tensor(hc, [bm, bk])
        wd = K._TensorDescriptor.from_tensor(ws, [bn, bk])
        zd = K._TensorDescriptor.from_tensor(dz, [bm, bn])
        grid = (triton.cdiv(tc, bm) * triton.cdiv(vs, bn),)

        def launch():
            if store == 0:  # the library kernel itself
                return K._dlogits_kernel[grid](
                    hc, ws, hd, wd, lab[:tc], lse[:tc], mz[:tc], glp[:tc], gent[:tc], dz, tc, vs, h_dim, 0,
                    hc.stride(0), ws.stride(0), dz.stride(0), 1.0, HAS_ENT=True, EVEN_K=(h_dim % bk == 0),
                    IEEE=False, USE_DESC=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps,
                    num_stages=stages)
            return _dlogits_probe[grid](hd, wd, zd, lab[:tc], lse[:tc], mz[:tc], glp[:tc], gent[:tc], dz, tc, vs, 0,
                                        h_dim, dz.stride(0), 1.0, STORE=store, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                        GROUP_M=8, num_warps=warps, num_stages=stages)

        row = {}
        try:
            ck = launch()
            torch.cuda.synchronize()
            if ref is None:
                ref = dz.clone()
            row = dict(n_regs=ck.n_regs, n_spills=ck.n_spills, nan=bool(dz.isnan().any()),
                       maxdiff_vs_store0=(dz.float() - ref.float()).abs().max().item(),
                       ms=time_ms(launch, n=20))
            row["x_gemm"] = row["ms"] / res["chunk"]["gemm_ms"]
        except Exception as exc:  # noqa: BLE001
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        res["chunk"][f"store{store}"] = row
        print("bwd chunk store", store, row, flush=True)
    dzb = torch.randn(tc, vs, device="cuda").bfloat16()
    dh = torch.zeros(tc, h_dim, device="cuda")
    dw = torch.zeros(vs, h_dim, device="cuda")
    res["chunk"]["addmm_dH_ms"] = time_ms(lambda: K._mm_acc(dh, dzb, ws), n=20)
    res["chunk"]["addmm_dW_ms"] = time_ms(lambda: K._mm_acc(dw, dzb.t(), hc), n=20)
    print("bwd", {k: v for k, v in res.items() if k != "profile"}, flush=True)
    del h, w
    torch.cuda.empty_cache()
    return res


def load_baseline(path: str):
    """The kernels module of an earlier commit (`git show REV:rltrain/ops/logprob_triton.py > FILE`)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("baseline_logprob_triton", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def set_fwd(flatten: bool, cfg) -> None:
    K._FWD_FLATTEN = flatten
    K._CONFIGS["fwd_lowp"] = cfg


def ab(shape, old, rounds: int) -> dict:
    """Interleaved timing (every variant once per round, `rounds` rounds; median of each variant's round
    medians) of the library's forward and fwd+bwd against the baseline module's, on the same inputs."""
    t, h_dim, v = shape
    h, w, lab = inputs(t, h_dim, v, 5)
    g = torch.Generator(device="cuda").manual_seed(6)
    glp, gent = torch.randn(t, device="cuda", generator=g), torch.randn(t, device="cuda", generator=g)
    base_flat, base_cfg = K._FWD_FLATTEN, K._config("fwd", torch.bfloat16)

    def fwd_new(flat, cfg, ent=True):
        def f():
            set_fwd(flat, cfg)
            return K.forward_stats(h, w, lab, 1.0, ent)
        return f

    def fwdbwd(mod, flat=None, cfg=None):
        def f():
            if flat is not None:
                set_fwd(flat, cfg)
            m, s_, t_, zl = mod.forward_stats(h, w, lab, 1.0, True)
            lse = m + torch.log(s_)
            return mod.backward(h, w, lab, lse, t_ / s_, glp, gent, 1.0, True, True)
        return f

    s3, s4 = base_cfg[:4] + (3,), base_cfg[:4] + (4,)
    fwd_vars = {
        "cuBLAS GEMM": lambda: torch.mm(h, w.T),
        "baseline forward": lambda: old.forward_stats(h, w, lab, 1.0, True),
        "new forward, flatten, 3 stages": fwd_new(True, s3),
        "new forward, flatten, 4 stages": fwd_new(True, s4),
        "new forward, no flatten, 3 stages": fwd_new(False, s3),
        "new forward, flatten, 3 stages, no entropy": fwd_new(True, s3, False),
        "mainloop only (probe var 3), flatten, 4 stages": lambda: fwd_probe(h, w, lab, 3, True, s4, None),
    }
    both_vars = {
        "baseline fwd+bwd": fwdbwd(old),
        "new fwd+bwd (flatten, 3 stages)": fwdbwd(K, True, s3),
        "new fwd+bwd (flatten, 4 stages)": fwdbwd(K, True, s4),
    }
    # exactness of the new statistics against the baseline's on these inputs
    set_fwd(base_flat, base_cfg)
    mo, so, to, zo = old.forward_stats(h, w, lab, 1.0, True)
    mn, sn, tn, zn = K.forward_stats(h, w, lab, 1.0, True)
    lo, ln_ = mo + so.log(), mn + sn.log()
    res = dict(shape=shape, rounds=rounds, check=dict(
        lse_maxdiff=(lo - ln_).abs().max().item(), mean_z_maxdiff=(to / so - tn / sn).abs().max().item(),
        zlabel_maxdiff=(zo - zn).abs().max().item()))
    gn = fwdbwd(K, base_flat, base_cfg)()
    go = fwdbwd(old)()
    res["check"]["dH_rel"] = ((gn[0].float() - go[0].float()).norm() / go[0].float().norm()).item()
    res["check"]["dW_rel"] = ((gn[1].float() - go[1].float()).norm() / go[1].float().norm()).item()
    del gn, go
    print("ab check", res["check"], flush=True)
    times: dict[str, list] = {k: [] for k in [*fwd_vars, *both_vars]}
    for r in range(rounds):
        for name, fn in fwd_vars.items():
            times[name].append(time_ms(fn, n=5, warmup=1))
        for name, fn in both_vars.items():
            times[name].append(time_ms(fn, n=3, warmup=1))
        print("ab round", r, {k: round(x[-1], 2) for k, x in times.items()}, flush=True)
    set_fwd(base_flat, base_cfg)
    gemm = statistics.median(times["cuBLAS GEMM"])
    res["gemm_ms"] = gemm
    res["rows"] = {k: dict(ms=statistics.median(x), min_ms=min(x), all=x,
                           x_gemm=statistics.median(x) / gemm, x_floor=statistics.median(x) / (4 * gemm))
                   for k, x in times.items()}
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fwdbwd(K, base_flat, base_cfg)()
    torch.cuda.synchronize()
    res["new_peak_extra_gib"] = (torch.cuda.max_memory_allocated() - before
                                 - sum(x.numel() * x.element_size() for x in out)) / 2**30
    del out, h, w
    torch.cuda.empty_cache()
    return res


def markdown() -> str:
    lines = [f"Device: {RESULTS.get('device')}; torch {torch.__version__}; triton {triton.__version__}; "
             f"date {RESULTS['date']}", ""]
    for shape_key, a in RESULTS.get("ab", {}).items():
        lines += [f"A/B, T,H,V = {shape_key} ({a['rounds']} interleaved rounds; GEMM {a['gemm_ms']:.2f} ms; "
                  f"new vs baseline: max |d lse| {a['check']['lse_maxdiff']:.1e}, max |d mean z| "
                  f"{a['check']['mean_z_maxdiff']:.1e}, max |d z_label| {a['check']['zlabel_maxdiff']:.1e}, "
                  f"dH {a['check']['dH_rel']:.1e} / dW {a['check']['dW_rel']:.1e} relative; new peak extra "
                  f"{a['new_peak_extra_gib']:.3f} GiB)", "",
                  "| variant | ms (median of rounds) | min | x GEMM | x 4-GEMM floor |", "|---|---|---|---|---|"]
        for name, r in a["rows"].items():
            lines.append(f"| {name} | {r['ms']:.2f} | {r['min_ms']:.2f} | {r['x_gemm']:.3f} | {r['x_floor']:.3f} |")
        lines.append("")
    for shape_key, rows in RESULTS.get("fwd", {}).items():
        lines += [f"Forward, T,H,V = {shape_key}", "",
                  "| what | (BM,BN,BK,warps,stages) | flatten | splits (programs) | regs/spills | ms | x GEMM |",
                  "|---|---|---|---|---|---|---|"]
        for r in rows:
            if "error" in r:
                lines.append(f"| {r['what']} | {r.get('cfg')} | {r.get('flatten')} | | | {r['error'][:70]} | |")
                continue
            sp = f"{r.get('splits_used', '')} ({r.get('programs', '')})" if "splits_used" in r else ""
            rs = f"{r['n_regs']}/{r['n_spills']}" if "n_regs" in r else ""
            lines.append(f"| {r['what']} | {tuple(r['cfg']) if r.get('cfg') else ''} | {r.get('flatten', '')} | {sp} "
                         f"| {rs} | {r['ms']:.2f} | {r.get('x_gemm', 1.0):.3f} |")
        lines.append("")
    for shape_key, b in RESULTS.get("bwd", {}).items():
        lines += [f"Backward, T,H,V = {shape_key}: {b['backward_ms']:.1f} ms (3 GEMMs = {3 * b['gemm_ms']:.1f} ms)", "",
                  "| kernels | ms | launches |", "|---|---|---|"]
        for cat, c in b["profile"].items():
            lines.append(f"| {cat} | {c['ms']:.1f} | {c['calls']} |")
        ch = b["chunk"]
        lines += ["", f"One chunk [Tc={ch['Tc']}, Vs={ch['Vs']}, H]: cuBLAS GEMM {ch['gemm_ms']:.3f} ms, "
                      f"addmm dH {ch['addmm_dH_ms']:.3f} ms, addmm dW {ch['addmm_dW_ms']:.3f} ms", "",
                  "| dlogits store | regs/spills | ms | x GEMM |", "|---|---|---|---|"]
        for i, name in enumerate(("64-bit pointers (library)", "32-bit offsets", "TMA descriptor")):
            r = ch.get(f"store{i}", {})
            if "ms" in r:
                lines.append(f"| {name} | {r['n_regs']}/{r['n_spills']} | {r['ms']:.3f} | {r['x_gemm']:.3f} |")
            else:
                lines.append(f"| {name} | | {r.get('error', '')[:80]} | |")
        lines.append("")
    return "\n".join(lines)


def save():
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "kernel_split.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    (OUT / "kernel_split.md").write_text(markdown())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", nargs="*", choices=["fwd", "bwd", "ab"], default=["fwd", "bwd"])
    ap.add_argument("--baseline", default=None,
                    help="file holding an earlier logprob_triton.py, for --only ab (interleaved old vs new)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shapes", nargs="*", default=["8192,4096,151936", "32768,4096,151936", "65536,2560,151936"],
                    help="T,H,V triples")
    ap.add_argument("--splits", nargs="*", type=int, default=[16, 33, 66],
                    help="vocab splits tried besides the library's rule (library tile, softmax probes)")
    ap.add_argument("--ncu-target", action="store_true",
                    help="only run the library forward 3 times at the first shape (a program for ncu to profile)")
    args = ap.parse_args()
    global OUT
    if args.out:
        OUT = Path(args.out)
    if not K.is_available() or K._TensorDescriptor is None or torch.cuda.get_device_capability()[0] < 9:
        sys.exit("kernel_split needs a Hopper (or newer) GPU with triton's TensorDescriptor")
    RESULTS["device"] = torch.cuda.get_device_name()
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes]
    if args.ncu_target:
        h, w, lab = inputs(*shapes[0], 1)
        for _ in range(3):
            K.forward_stats(h, w, lab, 1.0, True)
        torch.cuda.synchronize()
        return
    base = K._config("fwd", torch.bfloat16)
    cfgs = [base, (128, 256, 64, 8, 3), (256, 128, 64, 8, 4)]
    for shape in shapes:
        key = ",".join(map(str, shape))
        if "fwd" in args.only:
            RESULTS.setdefault("fwd", {})[key] = fwd_split(shape, cfgs, [None, *args.splits])
            save()
        if "bwd" in args.only:
            RESULTS.setdefault("bwd", {})[key] = bwd_split(shape)
            save()
        if "ab" in args.only:
            if not args.baseline:
                sys.exit("--only ab needs --baseline FILE")
            RESULTS.setdefault("ab", {})[key] = ab(shape, load_baseline(args.baseline), args.rounds)
            save()
    print(markdown())


if __name__ == "__main__":
    main()
