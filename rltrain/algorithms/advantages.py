"""Advantage estimators: turn per-token rewards (and critic values) into advantages and returns `[B, L]`.
Pure tensor math: it must not import the rest of rltrain, read the config or touch torch.distributed.

All tensors are `[B, L]` over response tokens, `response_mask` in {0, 1} (or bool), responses
left-aligned. score_i = sum_t token_rewards[i, t] m[i, t] (an outcome reward sits on the last
response token). Groups are the samples of one prompt: `group_ids` [B] is any integer tensor, not
necessarily sorted or contiguous. A group of one sample has baseline 0 (and std 1 for GRPO), so its
advantage is its score: there is nothing to compare it with, and it must not silently become 0 or NaN.

- `grpo`        A_i = (score_i - mean_g) / (std_g + eps), unbiased std; `norm_by_std=False` skips
                the division. Broadcast over the response; returns = advantages.
- `dr_grpo`     grpo with norm_by_std=False (Dr. GRPO, Liu et al. 2025).
- `rloo`        A_i = score_i - mean of the other samples' scores of its group; returns = advantages.
- `reinforce_plus_plus`  G_t = sum_{k>=t} gamma^(k-t) r_k over masked tokens; advantages = G
                whitened over all masked tokens of the batch; returns = G.
- `reinforce_plus_plus_baseline`  score_i - group mean, broadcast, whitened over the batch's masked
                tokens; returns = advantages.
- `gae`         delta_t = r_t + gamma V_{t+1} - V_t (V after the last response token is 0),
                A_t = delta_t + gamma lam A_{t+1}; returns = A + V; advantages then whitened.
- `distill`     pure on-policy distillation: no reward in the advantage (zeros, returns zeros); the trainer
                adds the teacher's reverse-KL advantage (algorithms/distill.py), then the whole signal.

Whitening is (x - mean) / (std + eps) with the mean and unbiased std of the masked tokens (fewer than
two tokens: std 0). The reverse recursions of `reinforce_plus_plus` and `gae` skip positions outside
the mask (they carry the running value through unchanged), which for a contiguous response is the
plain recursion above and for a multi-turn mask with holes (tool output) discounts only over the
model's own tokens. Outputs are 0 outside the mask, computed under `no_grad` in at least fp32.

Your own estimator: decorate it with `@register_advantage_estimator("name")`, or name it in the
config as a dotted path `"pkg.module:function"` (or `"path/to/file.py:function"`). Its signature:

    def my_estimator(token_rewards: Tensor,          # [B, L]
                     response_mask: Tensor,          # [B, L] 0/1
                     *, group_ids: Tensor | None,    # [B] int
                     values: Tensor | None,          # [B, L] critic values
                     gamma: float, lam: float, norm_by_std: bool, eps: float,
                     ) -> tuple[Tensor, Tensor]:     # (advantages [B, L], returns [B, L])
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from typing import Callable, Optional

import torch
from torch import Tensor

__all__ = [
    "compute_advantages",
    "register_advantage_estimator",
    "get_advantage_estimator",
    "ADV_ESTIMATORS",
]

AdvantageFn = Callable[..., tuple[Tensor, Tensor]]

_ESTIMATORS: dict[str, AdvantageFn] = {}


def register_advantage_estimator(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator: make `fn` available as `compute_advantages(name, ...)` (signature in the module docstring)."""
    if not name or ":" in name:
        raise ValueError(
            f"advantage estimator name {name!r} must be non-empty and contain no ':' (reserved for dotted paths)"
        )

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        if name in _ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered; pick another name")
        _ESTIMATORS[name] = fn
        return fn

    return decorator


def _load_dotted(path: str) -> AdvantageFn:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"advantage estimator {path!r}: a dotted path must look like 'pkg.module:function'")
    try:
        if module_name.endswith(".py"):
            if not os.path.isfile(module_name):
                raise ImportError(f"no file {module_name!r}")
            spec = importlib.util.spec_from_file_location(os.path.basename(module_name)[:-3], module_name)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"advantage estimator {path!r}: cannot import {module_name!r} ({err})") from err
    try:
        fn = functools.reduce(getattr, attr.split("."), module)
    except AttributeError as err:
        raise ValueError(f"advantage estimator {path!r}: {module_name!r} has no attribute {attr!r}") from err
    if not callable(fn):
        raise ValueError(f"advantage estimator {path!r} is not callable")
    return fn


def get_advantage_estimator(name: str) -> AdvantageFn:
    """The estimator registered as `name`, or the function a `"pkg.module:function"` path names."""
    if ":" in name:
        return _load_dotted(name)
    fn = _ESTIMATORS.get(name)
    if fn is None:
        raise ValueError(
            f"advantage estimator {name!r} is unknown; allowed: {', '.join(_ESTIMATORS)} "
            "or a dotted path 'pkg.module:function'"
        )
    return fn


@torch.no_grad()
def compute_advantages(estimator: str, token_rewards: Tensor, response_mask: Tensor, *,
                       group_ids: Optional[Tensor] = None, values: Optional[Tensor] = None,
                       gamma: float = 1.0, lam: float = 1.0, norm_by_std: bool = True,
                       eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """(advantages [B, L], returns [B, L]) of `estimator` (an `ADV_ESTIMATORS` name, a registered
    name, or a dotted path). `group_ids` [B] is required by grpo, dr_grpo, rloo and
    reinforce_plus_plus_baseline; `values` [B, L] by gae."""
    fn = get_advantage_estimator(estimator)
    if token_rewards.dim() != 2 or token_rewards.shape != response_mask.shape:
        raise ValueError(
            f"token_rewards {tuple(token_rewards.shape)} and response_mask {tuple(response_mask.shape)} "
            "must both be [B, L]"
        )
    adv, ret = fn(token_rewards, response_mask, group_ids=group_ids, values=values, gamma=gamma, lam=lam,
                  norm_by_std=norm_by_std, eps=eps)
    if adv.shape != token_rewards.shape or ret.shape != token_rewards.shape:
        raise ValueError(
            f"advantage estimator {estimator!r} returned advantages {tuple(adv.shape)} and returns "
            f"{tuple(ret.shape)}; both must be [B, L] = {tuple(token_rewards.shape)}"
        )
    return adv, ret


# ---------------------------------------------------------------------------------------------- helpers


def _float_dtype(t: Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32) if t.is_floating_point() else torch.float32


def _scores(token_rewards: Tensor, mask: Tensor) -> Tensor:
    """score_i = sum of the masked rewards of row i, [B]."""
    rewards = token_rewards.to(_float_dtype(token_rewards))
    return torch.where(mask, rewards, torch.zeros((), dtype=rewards.dtype, device=rewards.device)).sum(-1)


def _groups(group_ids: Optional[Tensor], batch: int, estimator: str) -> tuple[Tensor, Tensor]:
    """(index of each sample's group [B], samples per group [G])."""
    if group_ids is None:
        raise ValueError(f"advantage estimator {estimator!r} needs group_ids [B] (the prompt each sample answers)")
    if group_ids.shape != (batch,) or group_ids.is_floating_point() or group_ids.is_complex():
        raise ValueError(
            f"group_ids must be an integer tensor of shape [{batch}], got {group_ids.dtype} {tuple(group_ids.shape)}"
        )
    _, index, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    return index, counts


def _group_sum(x: Tensor, index: Tensor, num_groups: int) -> Tensor:
    return torch.zeros(num_groups, dtype=x.dtype, device=x.device).index_add_(0, index, x)


def _group_baseline(scores: Tensor, index: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
    """(group mean of each sample [B], group unbiased std of each sample [B]); a group of one has mean 0, std 1."""
    n = counts.to(scores.dtype)
    mean_g = _group_sum(scores, index, len(counts)) / n
    sq_g = _group_sum((scores - mean_g[index]).square(), index, len(counts))
    std_g = (sq_g / (n - 1).clamp(min=1)).sqrt()
    single = counts[index] == 1
    mean = torch.where(single, torch.zeros_like(scores), mean_g[index])
    std = torch.where(single, torch.ones_like(scores), std_g[index])
    return mean, std


def _whiten(x: Tensor, mask: Tensor, eps: float) -> Tensor:
    """(x - mean) / (std + eps) over the masked tokens of the whole batch; 0 outside the mask."""
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    n = mask.sum().to(x.dtype)
    mean = torch.where(mask, x, zero).sum() / n.clamp(min=1)
    var = torch.where(mask, (x - mean).square(), zero).sum() / (n - 1).clamp(min=1)
    return torch.where(mask, (x - mean) / (var.sqrt() + eps), zero)


def _broadcast(per_seq: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, per_seq.unsqueeze(-1), torch.zeros((), dtype=per_seq.dtype, device=per_seq.device))


# ---------------------------------------------------------------------------------------------- estimators


@register_advantage_estimator("grpo")
def _grpo(token_rewards: Tensor, response_mask: Tensor, *, group_ids: Optional[Tensor], norm_by_std: bool,
          eps: float, **_: object) -> tuple[Tensor, Tensor]:
    mask = response_mask.bool()
    scores = _scores(token_rewards, mask)
    index, counts = _groups(group_ids, len(scores), "grpo")
    mean, std = _group_baseline(scores, index, counts)
    adv = scores - mean
    if norm_by_std:
        adv = adv / (std + eps)
    adv = _broadcast(adv, mask)
    return adv, adv.clone()


@register_advantage_estimator("dr_grpo")
def _dr_grpo(token_rewards: Tensor, response_mask: Tensor, *, group_ids: Optional[Tensor], eps: float,
             **_: object) -> tuple[Tensor, Tensor]:
    return _grpo(token_rewards, response_mask, group_ids=group_ids, norm_by_std=False, eps=eps)


@register_advantage_estimator("rloo")
def _rloo(token_rewards: Tensor, response_mask: Tensor, *, group_ids: Optional[Tensor],
          **_: object) -> tuple[Tensor, Tensor]:
    mask = response_mask.bool()
    scores = _scores(token_rewards, mask)
    index, counts = _groups(group_ids, len(scores), "rloo")
    n = counts[index].to(scores.dtype)
    others = _group_sum(scores, index, len(counts))[index] - scores
    baseline = torch.where(n > 1, others / (n - 1).clamp(min=1), torch.zeros_like(scores))
    adv = _broadcast(scores - baseline, mask)
    return adv, adv.clone()


@register_advantage_estimator("reinforce_plus_plus")
def _reinforce_plus_plus(token_rewards: Tensor, response_mask: Tensor, *, gamma: float, eps: float,
                         **_: object) -> tuple[Tensor, Tensor]:
    mask = response_mask.bool()
    rewards = token_rewards.to(_float_dtype(token_rewards))
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])  # [B]
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(mask[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    returns = torch.where(mask, returns, torch.zeros_like(returns))
    return _whiten(returns, mask, eps), returns


@register_advantage_estimator("reinforce_plus_plus_baseline")
def _reinforce_plus_plus_baseline(token_rewards: Tensor, response_mask: Tensor, *, group_ids: Optional[Tensor],
                                  eps: float, **_: object) -> tuple[Tensor, Tensor]:
    mask = response_mask.bool()
    scores = _scores(token_rewards, mask)
    index, counts = _groups(group_ids, len(scores), "reinforce_plus_plus_baseline")
    mean, _std = _group_baseline(scores, index, counts)
    adv = _whiten(_broadcast(scores - mean, mask), mask, eps)
    return adv, adv.clone()


@register_advantage_estimator("gae")
def _gae(token_rewards: Tensor, response_mask: Tensor, *, values: Optional[Tensor], gamma: float, lam: float,
         eps: float, **_: object) -> tuple[Tensor, Tensor]:
    if values is None:
        raise ValueError("advantage estimator 'gae' needs values [B, L] from the critic")
    if values.shape != token_rewards.shape:
        raise ValueError(
            f"values {tuple(values.shape)} must have the shape of token_rewards {tuple(token_rewards.shape)}"
        )
    mask = response_mask.bool()
    dtype = torch.promote_types(_float_dtype(token_rewards), _float_dtype(values))
    rewards, vals = token_rewards.to(dtype), values.to(dtype)
    adv = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])  # [B] V of the next masked token, 0 past the response
    running = torch.zeros_like(rewards[:, 0])  # [B] A of the next masked token
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - vals[:, t]
        running = torch.where(mask[:, t], delta + gamma * lam * running, running)
        next_value = torch.where(mask[:, t], vals[:, t], next_value)
        adv[:, t] = running
    zero = torch.zeros((), dtype=dtype, device=adv.device)
    adv = torch.where(mask, adv, zero)
    returns = torch.where(mask, adv + vals, zero)
    return _whiten(adv, mask, eps), returns


@register_advantage_estimator("distill")
def _distill(token_rewards: Tensor, response_mask: Tensor, **_: object) -> tuple[Tensor, Tensor]:
    zeros = torch.zeros_like(token_rewards, dtype=_float_dtype(token_rewards))
    return zeros, zeros.clone()


ADV_ESTIMATORS: tuple[str, ...] = tuple(_ESTIMATORS)
