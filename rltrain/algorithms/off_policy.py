"""Off-policy correction for samples whose behaviour policy (the rollout engine) differs from the old policy
the actor recomputes: truncated importance sampling (TIS) weights and the training/inference mismatch.
Pure tensor math: it must not import the rest of rltrain, read the config or touch torch.distributed.

Notation: old = log pi_old(a_t) recomputed by the trainer before the update (the proximal policy of the PPO
ratio), smp = log mu(a_t) reported by the sampler that drew a_t, m = the loss mask (sampled tokens only).
The behaviour policy mu differs from pi_old through numerics (bf16 engine vs trainer kernels) and, with
asynchronous rollout, through staleness (mu is the policy of an earlier step).

TIS (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"; verl's
`tis_imp_ratio_cap`, slime's `--use-tis`/`tis_clip`): the per-token policy-gradient loss is multiplied by
the detached weight w = min(rho, C), upper truncation only, with

- `token`     rho_t = pi_old(a_t) / mu(a_t)                      one weight per token
- `sequence`  rho_i = prod_t (pi_old(a_t) / mu(a_t)) over the row's masked tokens, shared by its tokens

The weight is computed as exp(min(log rho, log C)), so a huge ratio cannot overflow. Where the sampler and
the trainer agree exactly (old == smp) every weight is 1 and the loss is unchanged.

Mismatch (logged every step): mean |smp - old| over masked tokens, and KL(mu || pi_old) estimated from the
samples a_t ~ mu with Schulman's k3 estimator, (rho - 1) - log rho (unbiased, >= 0; see kl.py), computed in
fp64 so a stray token cannot overflow the metric.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from rltrain.algorithms.kl import kl_penalty

__all__ = ["truncated_is_weights", "policy_mismatch", "TIS_MODES"]


def _token_log_ratio(log_ratio: Tensor, keep: Tensor) -> tuple[Tensor, Tensor]:
    return log_ratio, log_ratio[keep]


def _sequence_log_ratio(log_ratio: Tensor, keep: Tensor) -> tuple[Tensor, Tensor]:
    row = log_ratio.sum(-1)  # [B] log of the product over the row's masked tokens
    return row.unsqueeze(-1).expand_as(log_ratio), row[keep.any(-1)]


# mode -> (log-ratio of each token's weight [B, L], log-ratio of each weighted unit [N]) from the masked
# per-token log-ratio [B, L] (0 outside the mask) and the mask [B, L] bool
_LOG_RATIOS: dict[str, Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]] = {
    "token": _token_log_ratio,
    "sequence": _sequence_log_ratio,
}
TIS_MODES: tuple[str, ...] = tuple(_LOG_RATIOS)


def _check(old_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor) -> None:
    if old_logprobs.shape != sampler_logprobs.shape or old_logprobs.shape != mask.shape or old_logprobs.dim() != 2:
        raise ValueError(f"old_logprobs {tuple(old_logprobs.shape)}, sampler_logprobs "
                         f"{tuple(sampler_logprobs.shape)} and mask {tuple(mask.shape)} must all be [B, L]")


def truncated_is_weights(old_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, *, cap: float,
                         mode: str = "token") -> tuple[Tensor, dict[str, Tensor]]:
    """TIS weights min(rho, cap) for the policy-gradient loss, and their statistics.

    old_logprobs:     [B, L] log pi_old(a_t) (no grad)
    sampler_logprobs: [B, L] log mu(a_t) of the sampler that drew a_t
    mask:             [B, L] 0/1 or bool, the sampled tokens (loss mask); weights are 0 outside it
    cap:              C >= 1, the upper truncation of the ratio
    mode:             one of `TIS_MODES`

    Returns (weights [B, L] detached, in the dtype of old_logprobs, 0 outside `mask`; stats) with 0-dim
    stats over the weighted units (tokens for `token`, rows with at least one token for `sequence`):
    `weight_mean` (mean truncated weight, what the loss applies), `ratio_max` (largest ratio before
    truncation, inf when it overflows fp64) and `clipfrac` (fraction of units whose ratio exceeded cap).
    """
    fn = _LOG_RATIOS.get(mode)
    if fn is None:
        raise ValueError(f"TIS mode {mode!r} is unknown; allowed: {', '.join(TIS_MODES)}")
    if not cap >= 1.0:
        raise ValueError(f"TIS cap={cap} must be >= 1 (a cap below 1 would down-weight on-policy tokens)")
    _check(old_logprobs, sampler_logprobs, mask)
    keep = mask.bool()
    zero = torch.zeros((), dtype=old_logprobs.dtype, device=old_logprobs.device)
    with torch.no_grad():
        token_log_ratio = torch.where(keep, old_logprobs - sampler_logprobs.to(old_logprobs.dtype), zero)
        log_ratio, unit_log_ratio = fn(token_log_ratio, keep)
        weights = torch.where(keep, torch.exp(log_ratio.clamp(max=math.log(cap))), zero)
        u = unit_log_ratio.double()
        if u.numel() == 0:
            one = torch.ones((), dtype=torch.float64)
            stats = {"weight_mean": one, "ratio_max": one, "clipfrac": one * 0}
        else:
            stats = {"weight_mean": torch.exp(u.clamp(max=math.log(cap))).mean(), "ratio_max": torch.exp(u.max()),
                     "clipfrac": (u > math.log(cap)).double().mean()}
    return weights, stats


def policy_mismatch(old_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Training/inference mismatch over the masked tokens ([B, L] inputs as in `truncated_is_weights`):
    0-dim fp64 `abs_mean` = mean |smp - old|, `abs_max` = max |smp - old|, `kl` = k3 estimate of
    KL(mu || pi_old) from the sampled tokens. All 0 when the mask is empty."""
    _check(old_logprobs, sampler_logprobs, mask)
    keep = mask.bool()
    old, smp = old_logprobs.double()[keep], sampler_logprobs.double()[keep]  # [N] sampled tokens
    if old.numel() == 0:
        z = torch.zeros((), dtype=torch.float64)
        return {"abs_mean": z, "abs_max": z, "kl": z}
    gap = (old - smp).abs()
    return {"abs_mean": gap.mean(), "abs_max": gap.max(), "kl": kl_penalty(smp, old, "k3").mean()}
