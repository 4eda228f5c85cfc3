"""Per-token KL estimators between the policy and the reference policy, from their log-probs.
Pure tensor math: it must not import the rest of rltrain, read the config or touch torch.distributed.

With d = lp - ref (lp = log pi(a_t), ref = log pi_ref(a_t), a_t sampled from pi), the kinds are
Schulman's estimators of KL(pi || pi_ref) (http://joschu.net/blog/kl-approx.html):

- `k1`          d                         unbiased, high variance, can be negative
- `abs`         |d|
- `k2` / `mse`  0.5 d^2                   biased, low variance
- `k3`          e^(-d) + d - 1            unbiased and >= 0
- `low_var_kl`  k3 clamped to [-10, 10]   (-d is clamped to [-20, 20] before exp: identical values
                                          after the outer clamp, but no inf * 0 = NaN gradient)

The result is per token `[B, L]`; masking and aggregation are the caller's (see `aggregate_loss`).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

__all__ = ["kl_penalty", "KL_KINDS"]


def _k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    return logprobs - ref_logprobs


def _abs(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    return (logprobs - ref_logprobs).abs()


def _k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    return 0.5 * (logprobs - ref_logprobs).square()


def _k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    x = ref_logprobs - logprobs
    return torch.exp(x) - x - 1


def _low_var_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    x = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
    return (torch.exp(x) - x - 1).clamp(-10.0, 10.0)


_KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "k1": _k1,
    "abs": _abs,
    "k2": _k2,
    "mse": _k2,
    "k3": _k3,
    "low_var_kl": _low_var_kl,
}
KL_KINDS: tuple[str, ...] = tuple(_KL_ESTIMATORS)


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate `[B, L]` of `kind` (one of `KL_KINDS`) from `logprobs` and `ref_logprobs` [B, L]."""
    fn = _KL_ESTIMATORS.get(kind)
    if fn is None:
        raise ValueError(f"KL kind {kind!r} is unknown; allowed: {', '.join(KL_KINDS)}")
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} must have the same shape"
        )
    return fn(logprobs, ref_logprobs)
