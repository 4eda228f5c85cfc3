"""Policy-gradient losses (PPO clip with optional dual clip, GSPO, CISPO) on `[B, L]` response tokens.
Pure tensor math: it must not import the rest of rltrain, read the config or touch torch.distributed.

Notation: lp = log pi(a_t) (carries the graph), old = log pi_old(a_t), A = advantage, r = exp(lp - old),
sg = stop-gradient, clip(x) = clamp(x, 1 - clip_low, 1 + clip_high) (asymmetric bounds: DAPO's
clip-higher).

- `ppo`   l = max(-A r, -A clip(r)) (Schulman et al. 2017). With `dual_clip=c` (c > 1, Ye et al. 2020)
          tokens with A < 0 use min(l, -A c), which bounds the loss when r explodes.
- `gspo`  sequence ratio s_i = exp(masked mean_t (lp - old)); token ratio sg(s_i) exp(lp - sg(lp)),
          whose value is s_i and whose gradient is s_i d lp; clipped (and dual-clipped) like ppo.
          Default aggregation `seq-mean-token-mean` (Zheng et al. 2025, GSPO-token).
- `cispo` l = -sg(clip(r)) A lp: the clipped ratio is only a weight, so every token keeps its
          gradient (MiniMax-M1, 2025). `dual_clip` does not apply.

Each mode is a registry entry (`POLICY_LOSS_MODES`) returning the per-token loss and the clip masks;
`policy_loss` masks, aggregates and computes the metrics. Positions outside `response_mask` are set to
0 in every input before any math, so padding garbage gives neither values nor gradients. The log-ratio
is clamped to [-20, 20] before exp so one stray token cannot overflow to inf.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

from rltrain.algorithms.aggregation import aggregate_loss, masked_mean

__all__ = ["policy_loss", "POLICY_LOSS_MODES"]

_MAX_LOG_RATIO = 20.0


class _TokenLoss(NamedTuple):
    loss: Tensor  # [B, L] per-token loss, 0 outside the mask
    clipped: Tensor  # [B, L] bool, the clipped branch is active
    dual_clipped: Tensor  # [B, L] bool, the dual clip is active


def _clipped_surrogate(ratio: Tensor, adv: Tensor, clip_low: float, clip_high: float,
                       dual_clip: Optional[float]) -> _TokenLoss:
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    if dual_clip is None:
        return _TokenLoss(loss, clip_active, torch.zeros_like(clip_active))
    bound = -adv * dual_clip
    negative = adv < 0
    dual_active = negative & (bound < loss)
    loss = torch.where(negative, torch.minimum(loss, bound), loss)
    return _TokenLoss(loss, clip_active, dual_active)


def _ppo(lp: Tensor, old: Tensor, adv: Tensor, mask: Tensor, clip_low: float, clip_high: float,
         dual_clip: Optional[float]) -> _TokenLoss:
    ratio = torch.exp((lp - old).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    return _clipped_surrogate(ratio, adv, clip_low, clip_high, dual_clip)


def _gspo(lp: Tensor, old: Tensor, adv: Tensor, mask: Tensor, clip_low: float, clip_high: float,
          dual_clip: Optional[float]) -> _TokenLoss:
    maskf = mask.to(lp.dtype)
    log_seq_ratio = ((lp - old) * maskf).sum(-1) / maskf.sum(-1).clamp(min=1)  # [B]
    seq_ratio = torch.exp(log_seq_ratio.detach().clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))  # [B]
    ratio = seq_ratio.unsqueeze(-1) * torch.exp(lp - lp.detach())  # [B, L], value s_i, grad s_i * d lp
    return _clipped_surrogate(ratio, adv, clip_low, clip_high, dual_clip)


def _cispo(lp: Tensor, old: Tensor, adv: Tensor, mask: Tensor, clip_low: float, clip_high: float,
           dual_clip: Optional[float]) -> _TokenLoss:
    if dual_clip is not None:
        raise ValueError(f"dual_clip={dual_clip} applies to policy-loss modes ppo and gspo, not cispo; set it to None")
    ratio = torch.exp((lp - old).detach().clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = -weight * adv * lp
    return _TokenLoss(loss, weight != ratio, torch.zeros_like(mask))


_ModeFn = Callable[[Tensor, Tensor, Tensor, Tensor, float, float, Optional[float]], _TokenLoss]

# mode -> (per-token loss, default aggregation)
_POLICY_LOSSES: dict[str, tuple[_ModeFn, str]] = {
    "ppo": (_ppo, "token-mean"),
    "gspo": (_gspo, "seq-mean-token-mean"),
    "cispo": (_cispo, "token-mean"),
}
POLICY_LOSS_MODES: tuple[str, ...] = tuple(_POLICY_LOSSES)


def policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor, *,
                mode: str = "ppo", clip_low: float = 0.2, clip_high: float = 0.2,
                dual_clip: Optional[float] = None, agg: Optional[str] = None,
                weights: Optional[Tensor] = None) -> tuple[Tensor, dict[str, Tensor]]:
    """The policy-gradient loss of `mode` (one of `POLICY_LOSS_MODES`) and its metrics.

    logprobs:      [B, L] log pi(a_t), requires grad
    old_logprobs:  [B, L] log pi_old(a_t) of the policy that sampled (no grad)
    advantages:    [B, L] (no grad)
    response_mask: [B, L] 0/1 or bool; tokens outside it get no loss and no gradient
    clip_low, clip_high: the ratio is clipped to [1 - clip_low, 1 + clip_high]
    dual_clip:     c > 1 bounds the loss of tokens with A < 0 by -A c (ppo, gspo), None disables
    agg:           an `AGG_MODES` name; None uses the mode's default (gspo: seq-mean-token-mean,
                   the others: token-mean)
    weights:       [B, L] per-token weights (no grad) multiplying the per-token loss before aggregation,
                   e.g. the truncated importance weights of `off_policy.truncated_is_weights`; None: 1

    Returns (loss 0-dim, metrics) with detached 0-dim metrics `pg_clipfrac` (fraction of tokens whose
    clipped branch is active; for cispo, whose ratio was clipped), `pg_clipfrac_lower` (fraction
    where the dual clip is active) and `ppo_kl` (masked mean of old - lp).
    """
    entry = _POLICY_LOSSES.get(mode)
    if entry is None:
        raise ValueError(f"policy-loss mode {mode!r} is unknown; allowed: {', '.join(POLICY_LOSS_MODES)}")
    fn, default_agg = entry
    shape = logprobs.shape
    for name, t in (("old_logprobs", old_logprobs), ("advantages", advantages), ("response_mask", response_mask),
                    ("weights", weights)):
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} {tuple(t.shape)} must have the shape of logprobs {tuple(shape)}")
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low={clip_low} and clip_high={clip_high} must be >= 0")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip={dual_clip} must be > 1 (or None to disable)")

    mask = response_mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    lp = torch.where(mask, logprobs, zero)
    old = torch.where(mask, old_logprobs.to(logprobs.dtype), zero)
    adv = torch.where(mask, advantages.to(logprobs.dtype), zero)

    out = fn(lp, old, adv, mask, clip_low, clip_high, dual_clip)
    token_loss = out.loss if weights is None else out.loss * torch.where(mask, weights.detach().to(lp.dtype), zero)
    loss = aggregate_loss(token_loss, mask, default_agg if agg is None else agg)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean(out.clipped.to(logprobs.dtype), mask).detach(),
            "pg_clipfrac_lower": masked_mean(out.dual_clipped.to(logprobs.dtype), mask).detach(),
            "ppo_kl": masked_mean(old - lp, mask).detach(),
        }
    return loss, metrics
