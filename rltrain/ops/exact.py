"""Order-free arithmetic: sums, matrix products, exp and log whose every output element is a fixed function of its
own inputs alone, whatever the BLAS, the thread count, the memory alignment, the batch or the padding around them.
Pure tensor math on any device; it must not import the rest of rltrain (ops/invariant.py builds the layers on it).

Why: a float sum depends on its order, and libraries pick the order by the shape (a GEMM's blocking and kernel change
with the number of rows, a reduction's vector width and thread split with the length), so the same token gets another
log-prob in a batch of another size. Here every sum is made of terms that add EXACTLY, so no order can change it:

- Error-free slicing (the splitting of Ozaki, Ogita, Oishi and Rump, "Error-free transformations of matrix
  multiplication by using fast routines of matrix multiplication", Numer. Algorithms 59, 2012). Along the
  reduction dim, values x (as fp64) are cut into slices on a grid set by the largest |x| of their line (2^e >
  max |x|): x1 = fl((x + sigma) - sigma) with ulp(sigma) = 2^(e - b) rounds x to multiples of 2^(e - b); the rest
  x - x1 is exact and is sliced again on 2^(e - 2b). A slice holds at most b + 1 significant bits on a grid shared
  by its whole line, so n such terms add exactly in fp64 while n * 2^b <= 2^53, and products of two slices
  (2b + 1 bits on the grid of the product) add exactly while K * 2^(2b) <= 2^53. fp64 GEMMs of slices are then
  exact in any order; what two slices leave out is below 2^-2b of the line's largest value (2^-38 for products,
  2^-68 for sums), far under fp32's rounding.
- exp and log as fixed sequences of +, -, *, / (IEEE correctly rounded, the same in every code path) on fp64:
  Cody-Waite reduction and a degree-13 Taylor polynomial for exp, frexp and the atanh series for log; powers of
  two are built from their bits. torch's own exp/sigmoid/silu take other code paths for a tensor's tail elements
  (silu differed from itself at 2 of 10^5 positions on an AVX2 CPU), so they are not used.

A line's grid depends on the values on it only: zeros (padding, masked keys, future tokens) change nothing, which is
what makes a padded batch, a prefix cache and a full sequence agree.
"""

from __future__ import annotations

import math

import torch

__all__ = ["MAX_MATMUL_K", "MAX_SUM_N", "exact_matmul", "exact_sum", "exact_cumsum", "exp", "log", "slices"]

PRODUCT_BITS = 19  # bits per slice of a matmul operand: K * 2^(2*19) <= 2^53 for K <= 2^15
SUM_BITS = 34  # bits per slice of a summand: n * 2^34 <= 2^53 for n <= 2^19
MAX_MATMUL_K = 2 ** (53 - 2 * PRODUCT_BITS)
MAX_SUM_N = 2 ** (53 - SUM_BITS)

_LN2_HI = 6.93147180369123816490e-01  # ln 2 with its low 21 bits zero: n * _LN2_HI is exact for |n| < 2^21
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.44269504088896338700e00
_EXP_COEFFS = tuple(1.0 / math.factorial(k) for k in range(13, -1, -1))  # Horner, highest degree first
_LOG_COEFFS = tuple(1.0 / (2 * k + 1) for k in range(11, -1, -1))  # atanh series in s^2, highest first
_SQRT_HALF = 0.70710678118654752440


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2.0 ** e as fp64 from the bits (e int64 in [-1022, 1023])."""
    return ((e + 1023) << 52).view(torch.float64)


def slices(x: torch.Tensor, dim: int, bits: int, count: int = 2) -> list[torch.Tensor]:
    """`count` fp64 slices of x along `dim` (module docstring): slice i holds x on the grid 2^(e - bits*(i+1)) of
    its line, e from the line's largest |x|; their sum is x up to 2^(e - bits*count - 1) per element."""
    x = x.double()
    e = torch.frexp(x.abs().amax(dim=dim, keepdim=True)).exponent.long().clamp_(-900, 1000)  # max |x| < 2^e
    sigma = 1.5 * _pow2(e + (52 - bits))  # ulp(sigma) = 2^(e - bits): (r + sigma) - sigma rounds r to it
    out, rest = [], x
    for i in range(count):
        part = (rest + sigma) - sigma
        out.append(part)
        if i + 1 < count:
            rest, sigma = rest - part, sigma * 2.0 ** -bits
    return out


def exact_sum(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """fp64 sum of x along `dim`, the same whatever the order of the terms or the zeros beside them."""
    if x.shape[dim] > MAX_SUM_N:
        raise ValueError(f"exact_sum adds at most {MAX_SUM_N} terms exactly, got {x.shape[dim]}")
    hi, lo = slices(x, dim, SUM_BITS)
    return hi.sum(dim=dim, keepdim=keepdim) + lo.sum(dim=dim, keepdim=keepdim)


def exact_cumsum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """fp64 inclusive cumulative sum along `dim` with exact partial sums (as exact_sum)."""
    if x.shape[dim] > MAX_SUM_N:
        raise ValueError(f"exact_cumsum adds at most {MAX_SUM_N} terms exactly, got {x.shape[dim]}")
    hi, lo = slices(x, dim, SUM_BITS)
    return hi.cumsum(dim=dim) + lo.cumsum(dim=dim)


def exact_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp64 a @ b (a [..., M, K], b [..., K, N], broadcast like torch.matmul) from three exact fp64 GEMMs of
    slices: entry (m, n) depends only on row m of a and column n of b."""
    if a.shape[-1] > MAX_MATMUL_K:
        raise ValueError(f"exact_matmul reduces at most K = {MAX_MATMUL_K} exactly, got {a.shape[-1]}")
    a1, a2 = slices(a, -1, PRODUCT_BITS)
    b1, b2 = slices(b, -2, PRODUCT_BITS)
    return a1 @ b1 + (a1 @ b2 + a2 @ b1)


def exp(x: torch.Tensor) -> torch.Tensor:
    """e^x in fp64 (relative error ~1e-16) from a fixed sequence of exact-rounded operations: 0 below -745
    (and for -inf), inf above 709.78, NaN for NaN."""
    x = x.double()
    xc = x.clamp(-745.0, 709.78)
    n = torch.round(xc * _INV_LN2)
    r = (xc - n * _LN2_HI) - n * _LN2_LO  # |r| <= ln(2)/2
    p = torch.full_like(r, _EXP_COEFFS[0])
    for c in _EXP_COEFFS[1:]:
        p = p * r + c
    k = n.long()
    half = torch.div(k, 2, rounding_mode="floor")
    y = (p * _pow2(half)) * _pow2(k - half)  # two steps: 2^k alone leaves fp64's range below 2^-1022
    y = torch.where(x < -745.0, torch.zeros_like(y), y)
    return torch.where(x > 709.78, torch.full_like(y, math.inf), y)


def log(x: torch.Tensor) -> torch.Tensor:
    """Natural log in fp64 (relative error ~1e-16) from frexp and the atanh series: -inf at 0, NaN below 0."""
    x = x.double()
    m, e = torch.frexp(x)  # x = m * 2^e, m in [0.5, 1)
    small = m < _SQRT_HALF
    m = torch.where(small, m * 2.0, m)
    e = (e - small.to(e.dtype)).double()  # m in [0.707, 1.414)
    s = (m - 1.0) / (m + 1.0)  # |s| <= 0.1716; log m = 2 atanh s
    s2 = s * s
    q = torch.full_like(s, _LOG_COEFFS[0])
    for c in _LOG_COEFFS[1:]:
        q = q * s2 + c
    y = e * _LN2_HI + (e * _LN2_LO + 2.0 * s * q)
    y = torch.where(x == 0, torch.full_like(y, -math.inf), y)
    y = torch.where(x < 0, torch.full_like(y, math.nan), y)
    return torch.where(x == math.inf, x, y)
