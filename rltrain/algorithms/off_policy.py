"""Off-policy correction for samples whose behaviour policy (the rollout engine) differs from the old policy
the actor recomputes: one registry of corrections (truncated importance sampling, masking, masked importance
sampling; per token, per sequence or by the sequence's geometric mean) and the training/inference mismatch.
Pure tensor math: it must not import the rest of rltrain, read the config or touch torch.distributed.

Notation: old = log pi_old(a_t) recomputed by the trainer before the update (the proximal policy of the PPO
ratio), smp = log mu(a_t) reported by the sampler that drew a_t, m = the loss mask (sampled tokens only),
l_t = old_t - smp_t the per-token log-ratio, rho_t = exp(l_t) = pi_old(a_t) / mu(a_t). The behaviour policy
mu differs from pi_old through numerics (bf16 engine vs trainer kernels) and, with asynchronous rollout,
through staleness (mu is the policy of an earlier step).

A mode (`OFF_POLICY_MODES`, the config's `actor.off_policy.mode`) is `none` or `<unit>_<correction>`.
The unit fixes which ratio is corrected and which tokens share it:

- `token`  rho_t = exp(l_t), one per masked token
- `seq`    rho_i = exp(sum_t l_t) = prod_t rho_t over row i's masked tokens, shared by them
- `geo`    rho_i = exp(mean_t l_t) = (prod_t rho_t)^(1/|o_i|), the geometric mean over row i's masked
           tokens (length-normalised like GSPO's sequence ratio, Zheng et al. 2025), shared by them

and the correction maps the unit's ratio rho to the detached weight w that multiplies each of its tokens'
policy-gradient loss (`policy_loss(..., weights=w)`):

- `tis`   w = min(rho, C), upper truncation only. Truncated IS: Yao et al. 2025, "Your Efficient RL
          Framework Secretly Brings You Off-Policy RL Training" (token level; verl's
          `tis_imp_ratio_cap`, slime's `--use-tis`). The sequence-level variants (Seq-TIS, Seq-MIS) and
          the geometric-mean rejection are compared in Liu, Li et al. 2025, "When Speed Kills Stability:
          Demystifying RL Collapse from the Training-Inference Mismatch" (blog post).
- `mask`  w = 1 if low <= rho <= high else 0: rejection of the unit (the token, or the whole row); the
          kept units are not reweighted. The geometric variant (`geo_mask`, with bounds close to 1) is the
          geometric rejection of the same post.
- `mis`   w = rho if low <= rho <= high else 0: masked importance sampling, the unit keeps its IS weight
          when inside the band and is dropped outside it. `token_mis` is IcePop's double-sided masking
          M(k) = k on [alpha, beta], 0 elsewhere (Ling Team 2025, Ring-1T / "Every Step Evolves", alpha =
          0.5, beta = 5); `seq_mis` is the blog's Seq-MIS (rho * 1[rho <= C]: take high = C, low small).
- `none`  w = 1 (the ratio statistics are still reported, over tokens).

All bounds are inclusive (rho == C is not truncated, rho == low or high is kept). The ratio is handled as
its log in fp64, the weights being rounded once, at the end, to the dtype of old_logprobs: w =
exp(min(log rho, log C)) for `tis`, exp(log rho) only inside [low, high] for `mis`, so a ratio of e^800
gives w = C or 0, never inf or NaN; positions outside the mask (padding garbage included) are replaced by 0
before any arithmetic. Where the sampler and the trainer agree exactly (old == smp)
every ratio is 1, every weight is 1 and nothing is truncated or masked, whatever the mode.

Masked units get weight 0 but stay in the loss mask, so the aggregation's normaliser is unchanged (IcePop's
objective: M(.) multiplies the token term inside the 1/|o_i| sum); `OffPolicyCorrection.keep` is the loss
mask minus the masked units, for a caller that prefers to renormalise over the kept tokens.

Mismatch (logged every step): mean |smp - old| over masked tokens, and KL(mu || pi_old) estimated from the
samples a_t ~ mu with Schulman's k3 estimator, (rho - 1) - log rho (unbiased, >= 0; see kl.py), computed in
fp64 so a stray token cannot overflow the metric.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

from rltrain.algorithms.kl import kl_penalty

__all__ = ["off_policy_weights", "check_off_policy_args", "OffPolicyCorrection", "OFF_POLICY_MODES",
           "truncated_is_weights", "policy_mismatch", "TIS_MODES"]


# ---------------------------------------------------------------- units: which ratio, shared by which tokens
# unit(l, keep) -> (the log-ratio of each token's unit [B, L]; the units' log-ratios [N]), from the fp64
# per-token log-ratio l [B, L] (0 outside the mask) and the mask keep [B, L] bool. A row's broadcast entries
# hold the very value of its entry in [N], so per-token and per-unit decisions agree bit for bit.

def _token_unit(l: Tensor, keep: Tensor) -> tuple[Tensor, Tensor]:
    return l, l[keep]


def _seq_unit(l: Tensor, keep: Tensor) -> tuple[Tensor, Tensor]:
    row = l.sum(-1)  # [B] log of the product over the row's masked tokens
    return row.unsqueeze(-1).expand_as(l), row[keep.any(-1)]


def _geo_unit(l: Tensor, keep: Tensor) -> tuple[Tensor, Tensor]:
    row = l.sum(-1) / keep.sum(-1).clamp(min=1).to(l.dtype)  # [B] mean log-ratio (an empty row is no unit)
    return row.unsqueeze(-1).expand_as(l), row[keep.any(-1)]


_UNITS: dict[str, Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]] = {
    "token": _token_unit,
    "seq": _seq_unit,
    "geo": _geo_unit,
}


# ---------------------------------------------------------------- corrections: a unit's log-ratio -> its weight
class _Bounds(NamedTuple):
    log_cap: float
    log_low: float
    log_high: float


class _Corrected(NamedTuple):
    weight: Tensor  # fp64, the shape of the log-ratio u
    flagged: Tensor  # bool: truncated (tis: rho > cap) or masked (mask / mis: rho outside [low, high], or NaN)
    below: Tensor  # bool: rho < low (mask / mis only)
    above: Tensor  # bool: rho > high (mask / mis only)


def _none(u: Tensor, b: _Bounds) -> _Corrected:
    no = torch.zeros_like(u, dtype=torch.bool)
    return _Corrected(torch.ones_like(u), no, no, no)


def _tis(u: Tensor, b: _Bounds) -> _Corrected:
    no = torch.zeros_like(u, dtype=torch.bool)
    return _Corrected(torch.exp(u.clamp(max=b.log_cap)), u > b.log_cap, no, no)


def _mask(u: Tensor, b: _Bounds) -> _Corrected:
    inside = (u >= b.log_low) & (u <= b.log_high)  # NaN is outside
    return _Corrected(inside.to(u.dtype), ~inside, u < b.log_low, u > b.log_high)


def _mis(u: Tensor, b: _Bounds) -> _Corrected:
    inside = (u >= b.log_low) & (u <= b.log_high)
    # exp only of values inside [log low, log high]: the other branch never computes exp(800)
    weight = torch.where(inside, torch.exp(torch.where(inside, u, torch.zeros_like(u))), torch.zeros_like(u))
    return _Corrected(weight, ~inside, u < b.log_low, u > b.log_high)


# correction -> (weight function, the arguments it uses, the share metric it reports)
_CORRECTIONS: dict[str, tuple[Callable[[Tensor, _Bounds], _Corrected], tuple[str, ...], Optional[str]]] = {
    "none": (_none, (), None),
    "tis": (_tis, ("cap",), "clipfrac"),
    "mask": (_mask, ("low", "high"), "masked_frac"),
    "mis": (_mis, ("low", "high"), "masked_frac"),
}

# mode -> (unit, correction): `none` (weight 1, token ratios reported) and every `<unit>_<correction>`
_MODES: dict[str, tuple[str, str]] = {"none": ("token", "none")}
_MODES.update({f"{u}_{c}": (u, c) for c in ("tis", "mask", "mis") for u in _UNITS})
OFF_POLICY_MODES: tuple[str, ...] = tuple(_MODES)


class OffPolicyCorrection(NamedTuple):
    """What `off_policy_weights` returns.

    weights: [B, L] detached, in the dtype of old_logprobs, 0 outside the mask and on masked units: the
             per-token factor of the policy-gradient loss (`policy_loss(..., weights=weights)`)
    keep:    [B, L] bool, the mask minus the masked units (= the mask for `none` and the `*_tis` modes)
    stats:   0-dim fp64 tensors over the units (see `off_policy_weights`)
    """
    weights: Tensor
    keep: Tensor
    stats: dict[str, Tensor]


def _check_shapes(old_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor) -> None:
    if old_logprobs.shape != sampler_logprobs.shape or old_logprobs.shape != mask.shape or old_logprobs.dim() != 2:
        raise ValueError(f"old_logprobs {tuple(old_logprobs.shape)}, sampler_logprobs "
                         f"{tuple(sampler_logprobs.shape)} and mask {tuple(mask.shape)} must all be [B, L]")


def check_off_policy_args(mode: str, *, cap: Optional[float] = None, low: Optional[float] = None,
                          high: Optional[float] = None) -> None:
    """Raise ValueError (naming the parameter) unless `mode` is one of `OFF_POLICY_MODES` and the arguments it
    uses are valid: cap >= 1 for the `*_tis` modes, 0 < low <= 1 <= high for the `*_mask` / `*_mis` modes.
    Arguments a mode does not use are not checked (None or not), so a config may hold all three."""
    _bounds(mode, cap, low, high)


def _bounds(mode: str, cap: Optional[float], low: Optional[float], high: Optional[float]) -> _Bounds:
    entry = _MODES.get(mode)
    if entry is None:
        raise ValueError(f"off-policy mode {mode!r} is unknown; allowed: {', '.join(OFF_POLICY_MODES)}")
    uses = _CORRECTIONS[entry[1]][1]
    log_cap = log_low = log_high = 0.0
    if "cap" in uses:
        if cap is None or not cap >= 1.0:  # `not >=` also rejects NaN
            raise ValueError(f"off-policy cap={cap} must be a number >= 1 for mode {mode!r} (a cap below 1 would "
                             f"down-weight on-policy tokens)")
        log_cap = math.log(cap)
    if "low" in uses:
        if low is None or not 0.0 < low <= 1.0:
            raise ValueError(f"off-policy low={low} must satisfy 0 < low <= 1 for mode {mode!r} (ratio 1, on "
                             f"policy, must be kept)")
        if high is None or not high >= 1.0:
            raise ValueError(f"off-policy high={high} must satisfy high >= 1 for mode {mode!r} (ratio 1, on "
                             f"policy, must be kept)")
        log_low, log_high = math.log(low), math.log(high)
    return _Bounds(log_cap, log_low, log_high)


def off_policy_weights(old_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, *, mode: str,
                       cap: Optional[float] = None, low: Optional[float] = None,
                       high: Optional[float] = None) -> OffPolicyCorrection:
    """The off-policy correction `mode` (one of `OFF_POLICY_MODES`, see the module docstring) of the sampled
    tokens.

    old_logprobs:     [B, L] log pi_old(a_t) (no grad)
    sampler_logprobs: [B, L] log mu(a_t) of the sampler that drew a_t
    mask:             [B, L] 0/1 or bool, the sampled tokens (loss mask); nothing outside it is read
    cap:              C >= 1, the upper truncation of the `*_tis` modes (unused otherwise)
    low, high:        0 < low <= 1 <= high, the band of ratios kept by the `*_mask` and `*_mis` modes
                      (unused otherwise)

    Returns `OffPolicyCorrection(weights, keep, stats)`. The 0-dim fp64 stats are over the units (masked
    tokens for `token_*` and `none`; rows with at least one masked token for `seq_*` and `geo_*`):
    `weight_mean`, `weight_max` (of the weights the loss applies), `ratio_max`, `ratio_min` (of the units'
    ratios before correction; inf / 0 where they overflow / underflow fp64), and for the `*_tis` modes
    `clipfrac` (share of units with rho > cap), for the `*_mask` / `*_mis` modes `masked_frac` (share of
    units dropped) with its parts `masked_frac_low` (rho < low) and `masked_frac_high` (rho > high). With no
    unit at all (empty mask) the stats are neutral: weights and ratios 1, shares 0.
    """
    bounds = _bounds(mode, cap, low, high)
    _check_shapes(old_logprobs, sampler_logprobs, mask)
    unit, correction = _MODES[mode]
    fn, _, share = _CORRECTIONS[correction]
    keep = mask.bool()
    with torch.no_grad():
        zero = torch.zeros((), dtype=torch.float64, device=old_logprobs.device)
        l = torch.where(keep, old_logprobs.double() - sampler_logprobs.double(), zero)
        per_token, units = _UNITS[unit](l, keep)
        c = fn(per_token, bounds)
        weights = torch.where(keep, c.weight, zero).to(old_logprobs.dtype)
        kept = keep & ~c.flagged if share == "masked_frac" else keep  # tis: flagged = truncated, not dropped
        stats = _stats(units, fn(units, bounds), share)
    return OffPolicyCorrection(weights, kept, stats)


def _stats(u: Tensor, c: _Corrected, share: Optional[str]) -> dict[str, Tensor]:
    """0-dim fp64 statistics of the units' log-ratios u [N] and their correction c."""
    if u.numel() == 0:
        one, zero = torch.ones((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        stats = {"weight_mean": one, "weight_max": one, "ratio_max": one, "ratio_min": one}
        if share == "clipfrac":
            stats["clipfrac"] = zero
        elif share == "masked_frac":
            stats.update(masked_frac=zero, masked_frac_low=zero, masked_frac_high=zero)
        return stats
    stats = {"weight_mean": c.weight.mean(), "weight_max": c.weight.max(), "ratio_max": torch.exp(u.max()),
             "ratio_min": torch.exp(u.min())}
    if share == "clipfrac":
        stats["clipfrac"] = c.flagged.double().mean()
    elif share == "masked_frac":
        stats.update(masked_frac=c.flagged.double().mean(), masked_frac_low=c.below.double().mean(),
                     masked_frac_high=c.above.double().mean())
    return stats


# ---------------------------------------------------------------- the TIS-only interface (actor.tis)
_TIS_TO_MODE = {"token": "token_tis", "sequence": "seq_tis"}
TIS_MODES: tuple[str, ...] = tuple(_TIS_TO_MODE)


def truncated_is_weights(old_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, *, cap: float,
                         mode: str = "token") -> tuple[Tensor, dict[str, Tensor]]:
    """TIS weights min(rho, cap) for the policy-gradient loss, and their statistics: `off_policy_weights` with
    mode `token_tis` (`mode="token"`) or `seq_tis` (`mode="sequence"`), one of `TIS_MODES`.

    Returns (weights [B, L] detached, in the dtype of old_logprobs, 0 outside `mask`; stats) with 0-dim
    stats over the weighted units (tokens for `token`, rows with at least one token for `sequence`):
    `weight_mean` (mean truncated weight, what the loss applies), `ratio_max` (largest ratio before
    truncation, inf when it overflows fp64), `clipfrac` (fraction of units whose ratio exceeded cap), and
    `weight_max`, `ratio_min` as in `off_policy_weights`.
    """
    full = _TIS_TO_MODE.get(mode)
    if full is None:
        raise ValueError(f"TIS mode {mode!r} is unknown; allowed: {', '.join(TIS_MODES)}")
    if not cap >= 1.0:
        raise ValueError(f"TIS cap={cap} must be >= 1 (a cap below 1 would down-weight on-policy tokens)")
    out = off_policy_weights(old_logprobs, sampler_logprobs, mask, mode=full, cap=cap)
    return out.weights, out.stats


def policy_mismatch(old_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Training/inference mismatch over the masked tokens ([B, L] inputs as in `off_policy_weights`):
    0-dim fp64 `abs_mean` = mean |smp - old|, `abs_max` = max |smp - old|, `nonzero_frac` = share of the tokens
    whose two log-probs differ at all (0 under rollout.true_on_policy), `kl` = k3 estimate of KL(mu || pi_old) from
    the sampled tokens. All 0 when the mask is empty."""
    _check_shapes(old_logprobs, sampler_logprobs, mask)
    keep = mask.bool()
    old, smp = old_logprobs.double()[keep], sampler_logprobs.double()[keep]  # [N] sampled tokens
    if old.numel() == 0:
        z = torch.zeros((), dtype=torch.float64)
        return {"abs_mean": z, "abs_max": z, "nonzero_frac": z, "kl": z}
    gap = (old - smp).abs()
    return {"abs_mean": gap.mean(), "abs_max": gap.max(), "nonzero_frac": (gap != 0).double().mean(),
            "kl": kl_penalty(smp, old, "k3").mean()}
