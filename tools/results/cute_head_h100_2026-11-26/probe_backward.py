import sys, time, torch
sys.path.insert(0, "tests/ops")
from test_logprob_cute import fp64_reference, rel
from rltrain.ops import logprob_cute as C, logprob_triton as T

def ev(fn, reps=5):
    fn(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]

for (n, h, v) in [(4096, 1024, 32000), (2048, 4096, 151936)]:
    g = torch.Generator(device="cuda").manual_seed(n * 7 + v)
    hid = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    w = (torch.randn(v, h, device="cuda", generator=g) * 0.3).bfloat16()
    lab = torch.randint(0, v, (n,), device="cuda", generator=g)
    glp = torch.randn(n, device="cuda", generator=g); gent = torch.randn(n, device="cuda", generator=g)
    ref = fp64_reference(hid, w, lab, 1.0, glp, gent)
    for name, K in (("triton", T), ("cute", C)):
        m, s, t, zl = K.forward_stats(hid, w, lab, 1.0, True, None)
        lse, mz = m + torch.log(s), t / s
        gh, gw = K.backward(hid, w, lab, lse, mz, glp, gent, 1.0, True, True, None)
        print(n, h, v, name, "lp %.2e ent %.2e gh %.2e gw %.2e" % (rel(zl - lse, ref[0]), rel(lse - mz, ref[1]), rel(gh, ref[2]), rel(gw, ref[3])), flush=True)

for (n, h) in [(8192, 4096), (32768, 4096), (65536, 2560)]:
    v = 151936
    hid = torch.randn(n, h, device="cuda").bfloat16(); w = (torch.randn(v, h, device="cuda") * 0.02).bfloat16()
    lab = torch.randint(0, v, (n,), device="cuda"); glp = torch.randn(n, device="cuda"); gent = torch.randn(n, device="cuda")
    out = torch.empty(4096, v, device="cuda", dtype=torch.bfloat16)
    def gemm():
        for s0 in range(0, n, 4096):
            torch.mm(hid[s0:s0 + 4096], w.T, out=out)
    g_ms = ev(gemm)
    del out
    m, s, t, zl = C.forward_stats(hid, w, lab, 1.0, True, None)
    lse, mz = m + torch.log(s), t / s
    f_ms = ev(lambda: C.forward_stats(hid, w, lab, 1.0, True, None))
    row = [f"{n}x{h}: gemm {g_ms:.2f} fwd {f_ms/g_ms:.3f}x"]
    for mib in (384, 224, 160):
        torch.cuda.synchronize(); base = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
        C.backward(hid, w, lab, lse, mz, glp, gent, 1.0, True, True, None, budget_bytes=mib << 20)
        torch.cuda.synchronize(); extra = (torch.cuda.max_memory_allocated() - base) / 2**20
        b_ms = ev(lambda: C.backward(hid, w, lab, lse, mz, glp, gent, 1.0, True, True, None, budget_bytes=mib << 20))
        row.append(f"bwd@{mib}MiB {b_ms/g_ms:.3f} gemms, peak+{extra:.0f} MiB (grads {(n*h+v*h)*2/2**20:.0f}), f+b/4gemm {(f_ms+b_ms)/(4*g_ms):.3f}")
    print(" | ".join(row), flush=True)
    if n == 8192:
        from torch.profiler import profile, ProfilerActivity
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            C.backward(hid, w, lab, lse, mz, glp, gent, 1.0, True, True, None); torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60), flush=True)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            T.backward(hid, w, lab, lse, mz, glp, gent, 1.0, True, True, None); torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=6, max_name_column_width=60), flush=True)
    del hid, w
