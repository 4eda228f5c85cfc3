"""How many token rows the chunked log-prob paths process at once, picked from a memory budget.
Pure arithmetic on sizes: it must not allocate tensors or look at the device's free memory (the result
has to be the same on every rank of a tensor-parallel group).
"""

from __future__ import annotations

import torch

__all__ = ["CPU_CHUNK_BUDGET_BYTES", "CUDA_CHUNK_BUDGET_BYTES", "pick_chunk_size"]

#: Default scratch budget for one chunk's logits-sized buffers on CPU (256 MiB).
CPU_CHUNK_BUDGET_BYTES = 256 * 1024 * 1024
#: On CUDA (2 GiB): the weight-grad GEMM of a chunk re-reads and re-writes the fp32 [V_local, H]
#: accumulator, so chunks need ~1,000+ rows for that GEMM to stay compute-bound on an H100.
CUDA_CHUNK_BUDGET_BYTES = 2 * 1024 * 1024 * 1024


def pick_chunk_size(
    n_rows: int,
    vocab_local: int,
    dtype: torch.dtype = torch.float32,
    budget_bytes: int | None = None,
    device: torch.device | str = "cpu",
) -> int:
    """Tokens per chunk so one chunk's scratch buffers fit in `budget_bytes` (None: 256 MiB, or 2 GiB
    when `device` is CUDA).

    Formula (all integers):

        bytes_per_row = vocab_local * (2 * 4 + itemsize(dtype))
        chunk = budget_bytes // bytes_per_row
        chunk = chunk - chunk % 64            if chunk >= 64   (GEMM-friendly)
        chunk = clamp(chunk, 1, max(n_rows, 1))

    Why `2 * 4 + itemsize`: per row of a chunk the torch paths hold at most two fp32 `[chunk, V_local]`
    buffers at once (the logits and exp(logits - m) in forward; the logits and the in-place gradient
    buffer in backward) plus one `[chunk, V_local]` tensor in the input dtype (the low-precision GEMM
    output before its fp32 upcast, or the gradient cast back for the GEMM in backward). For fp32 inputs
    that third buffer is one of the first two, so the estimate is conservative by a third.

    Example: V_local = 76,032, bf16, 256 MiB -> bytes_per_row = 760,320 -> 353 -> 320 rows per chunk;
    on CUDA (2 GiB) -> 2,824 -> 2,816 rows.
    """
    if vocab_local <= 0:
        raise ValueError(f"vocab_local must be positive, got {vocab_local}")
    if budget_bytes is None:
        cuda = torch.device(device).type == "cuda"
        budget_bytes = CUDA_CHUNK_BUDGET_BYTES if cuda else CPU_CHUNK_BUDGET_BYTES
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    bytes_per_row = vocab_local * (2 * 4 + itemsize)
    chunk = budget_bytes // bytes_per_row
    if chunk >= 64:
        chunk -= chunk % 64
    return int(min(max(chunk, 1), max(n_rows, 1)))
