"""The fused head's benchmark inputs and GEMM floors, shared by tools/bench_logprob.py (one device) and
tools/bench_logprob_tp.py (vocab-parallel): the same seeded inputs and the same floors for both."""

from __future__ import annotations

import torch

from harness import time_ms

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def make_inputs(spec: dict):
    """hidden [T, H], weight [V, H], labels [T], rows (int64 [N] or None) from a spec dict, drawn on the spec's device
    (a CPU generator took seconds a process for a [151,936, 4,096] weight; every process of a run draws the same)."""
    device = spec["device"]
    gen = torch.Generator(device=device).manual_seed(spec.get("seed", 0))
    t, h, v = spec["T"], spec["H"], spec["V"]
    dtype = DTYPES[spec["dtype"]]
    hidden = torch.randn(t, h, generator=gen, device=device).to(dtype)
    weight = (torch.randn(v, h, generator=gen, device=device) / h**0.5).to(dtype)
    labels = torch.randint(0, v, (t,), generator=gen, device=device)
    rows = None
    frac = spec.get("rows_fraction")
    if frac is not None and frac < 1.0:
        n = max(1, int(round(t * frac)))
        rows = torch.randperm(t, generator=gen, device=device)[:n].sort().values
    return hidden, weight, labels, rows


def gemm_floors_ms(hidden: torch.Tensor, weight: torch.Tensor, reps: int, *, one: bool = True,
                   four: bool = False) -> tuple[float | None, float | None]:
    """(one GEMM, the two-pass design's four GEMMs), each timed where asked (else None), on hidden [T, H] and
    weight [V, H], in row blocks of 4,096 into [4096, V] buffers (the floor never needs [T, V] memory; same FLOPs).
    One GEMM: hidden @ weight.T. Four, timed back to back as one unit -- the clocks a GPU holds through ~4x a GEMM's
    work, not the burst a single short GEMM gets: per block z = h W^T (forward), z again (recompute), z W (dHidden)
    and dW += z^T h (dWeight, in the weight's dtype), the FLOPs of forward + backward."""
    t, block = hidden.shape[0], min(4096, hidden.shape[0])
    z = torch.empty(block, weight.shape[0], dtype=hidden.dtype, device=hidden.device)
    dh = torch.empty(block, hidden.shape[1], dtype=hidden.dtype, device=hidden.device) if four else None
    dw = torch.zeros_like(weight) if four else None

    def gemms(all_four: bool):
        for start in range(0, t, block):
            zb, hb = z[: min(block, t - start)], hidden[start:start + block]
            torch.mm(hb, weight.T, out=zb)
            if all_four:
                torch.mm(hb, weight.T, out=zb)
                torch.mm(zb, weight, out=dh[: zb.shape[0]])
                dw.addmm_(zb.T, hb)

    cuda = hidden.is_cuda
    return (time_ms(lambda: gemms(False), reps, cuda=cuda) if one else None,
            time_ms(lambda: gemms(True), reps, cuda=cuda) if four else None)
