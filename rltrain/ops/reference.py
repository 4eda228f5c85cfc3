"""The fp64 reference for log-probs and entropy: materialized logits, `torch.log_softmax`, -sum p log p.
Only for tests and benchmarks' correctness checks: it builds the full [T, V] tensor and must never be
used on the training path.
"""

from __future__ import annotations

import torch

__all__ = ["reference_logprobs_fp64"]


def reference_logprobs_fp64(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log p(label) and entropy of softmax(hidden @ weight.T / temperature), all in fp64.

    hidden [T, H], weight [V, H] (the FULL vocabulary), labels [T] int64 in [0, V).
    Returns (logprobs fp64 [T], entropy fp64 [T]). Differentiable: pass fp64 leaves with
    `requires_grad=True` to get reference gradients (the casts below are no-ops on fp64 inputs, so
    autograd reaches the caller's tensors).
    """
    logits = (hidden.double() @ weight.double().T) / temperature  # [T, V]
    logp = torch.log_softmax(logits, dim=-1)  # [T, V]
    logprobs = logp.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logprobs, entropy
