"""torch and Triton features probed at run time: fp32-output low-precision GEMMs (torch >= 2.8 on CUDA) and
Triton's TMA tensor descriptors (newer Triton). Probes only: no numerics here (ops/ decides what to do with them).
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def cuda_mm_out_dtype() -> bool:
    """Whether this torch has `torch.mm(..., out_dtype=torch.float32)` / `torch.addmm(...)` for bf16 CUDA
    GEMMs (fp32 result straight from the fp32 accumulator, torch >= 2.8)."""
    try:
        a = torch.ones(2, 2, dtype=torch.bfloat16, device="cuda")
        acc = torch.zeros(2, 2, dtype=torch.float32, device="cuda")
        torch.mm(a, a, out_dtype=torch.float32)
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
        return bool(acc[0, 0] == 2)
    except (TypeError, RuntimeError):
        return False


def triton_tensor_descriptor():
    """Triton's TensorDescriptor class (TMA loads on Hopper), or None on a Triton without it / without Triton."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # older triton: pointer loads only (or no triton at all)
        return None
    return TensorDescriptor
