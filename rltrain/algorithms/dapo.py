"""DAPO's batch-shaping pieces: the dynamic-sampling group filter, the soft overlong punishment and
the truncated-response mask. Pure tensor math: it must not import the rest of rltrain, read the
config or touch torch.distributed; the trainer decides when to call them.

Reference: Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
arXiv:2503.14476 (2025), section 3.2 (dynamic sampling), 3.4 (overlong reward shaping, Eq. 13).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["filter_informative_groups", "overlong_penalty", "truncated_response_mask"]


def filter_informative_groups(scores: Tensor, group_ids: Tensor) -> tuple[Tensor, int]:
    """Dynamic sampling: keep only the groups whose scores differ.

    A group whose samples all scored the same (all right, all wrong, or a group of one) has zero
    group-relative advantage everywhere and only dilutes the batch. Scores are compared exactly.

    scores:    [N] float, one per sample
    group_ids: [N] int, the prompt of each sample (any integers, any order)
    Returns (keep_mask [N] bool, number of dropped groups).
    """
    if scores.dim() != 1 or group_ids.shape != scores.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and group_ids {tuple(group_ids.shape)} must both be [N]")
    if group_ids.is_floating_point():
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    if scores.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=scores.device), 0
    _, index = torch.unique(group_ids, return_inverse=True)
    num_groups = int(index.max()) + 1
    x = scores.to(torch.promote_types(scores.dtype, torch.float32))
    group_max = torch.full((num_groups,), -torch.inf, dtype=x.dtype, device=x.device).scatter_reduce(
        0, index, x, reduce="amax")
    group_min = torch.full((num_groups,), torch.inf, dtype=x.dtype, device=x.device).scatter_reduce(
        0, index, x, reduce="amin")
    informative = group_max > group_min  # [G]
    return informative[index], int((~informative).sum())


def overlong_penalty(response_lengths: Tensor, max_len: int, buffer_len: int, penalty_factor: float) -> Tensor:
    """DAPO's soft overlong punishment (Eq. 13 of arXiv:2503.14476), a reward term per response.

    With L_exp = max_len - buffer_len: 0 for length <= L_exp, then linear from 0 down to
    -penalty_factor at length == max_len, and -penalty_factor beyond it.

    response_lengths: [B] int or float, tokens in each response
    max_len: the generation limit in tokens; buffer_len: 0 < buffer_len <= max_len
    Returns [B] float32 (or the lengths' float dtype) penalties, added to the score by the caller.
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"overlong buffer_len={buffer_len} must satisfy 0 < buffer_len <= max_len={max_len}")
    if penalty_factor < 0:
        raise ValueError(f"overlong penalty_factor={penalty_factor} must be >= 0")
    lengths = response_lengths.to(torch.promote_types(response_lengths.dtype, torch.float32)
                                  if response_lengths.is_floating_point() else torch.float32)
    expected = max_len - buffer_len
    over = (lengths - expected).clamp(min=0, max=buffer_len)
    return -penalty_factor * over / buffer_len


def truncated_response_mask(response_mask: Tensor, truncated: Tensor) -> Tensor:
    """`response_mask` [B, L] with the rows of truncated responses (`truncated` [B] bool) zeroed, so a
    response cut off by the length limit contributes no loss (DAPO's overlong filtering)."""
    if response_mask.dim() != 2 or truncated.shape != response_mask.shape[:1]:
        raise ValueError(
            f"response_mask {tuple(response_mask.shape)} must be [B, L] and truncated {tuple(truncated.shape)} [B]"
        )
    keep = ~truncated.bool()
    return torch.where(keep.unsqueeze(-1), response_mask, torch.zeros_like(response_mask))
