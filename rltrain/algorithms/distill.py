"""On-policy distillation's signal: a teacher's per-token log-probs of the tokens the student sampled.
Pure tensor math: it must not import the rest of rltrain, read the config or touch torch.distributed.

The student pi samples a response; the teacher pi_T scores every sampled token. With lp = log pi(a_t | s_t) and
lt = log pi_T(a_t | s_t) for the sampled a_t, d_t = lp - lt is the one-sample (k1) estimate of the per-token
reverse KL, KL(pi(. | s_t) || pi_T(. | s_t)), whose expectation over a_t ~ pi is that KL (each sampled term can be
negative; the mean over many tokens is not). The advantage is its negation,

    A_t = lt - lp = log pi_T(a_t | s_t) - log pi(a_t | s_t)     on the trained tokens (`mask`), 0 elsewhere,

so the policy-gradient step raises the tokens the teacher likes more than the student does and lowers the others:
minimising the reverse KL to the teacher token by token (no discount over later tokens; Agarwal et al. 2024,
"On-Policy Distillation of Language Models", and Thinking Machines' "On-Policy Distillation", 2025, use this
per-token form). It is added to any estimator's advantages with a coefficient (RL plus distillation), or is the
whole signal (pure distillation: the `distill` estimator of advantages.py gives zeros).

Baseline (`baseline=True`): the mean of A over the batch's trained tokens is subtracted. E[grad log pi] = 0, so a
baseline that does not depend on the sampled token leaves the gradient's expectation alone; the centred advantage is
exactly the leave-one-out baseline's times (N - 1) / N (N tokens), so its expected gradient is the reverse KL's times
(N - 1) / N. It removes the common offset, -KL per token, which from a random-init student is ~6 nats on every
token (log 64 for a uniform student against a confident teacher) and whose sampling noise otherwise swamps the
differences between tokens: grpo_tiny's student at step 20 had held-out accuracy 0.62 with it, 0.27 without
(docs/benchmarks.md, "On-policy distillation").

Which student log-probs: the caller passes the ones the policy loss's ratio is taken against (the proximal policy
pi_old, recomputed before the update), so the advantage is fixed during the update as every advantage is, and an
off-policy correction (asynchronous rollout) weights the samples towards that same policy.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["distill_advantages"]


@torch.no_grad()
def distill_advantages(teacher_logprobs: Tensor, student_logprobs: Tensor, mask: Tensor, *,
                       baseline: bool = True) -> Tensor:
    """A_t = teacher_logprobs - student_logprobs where `mask` (the trained tokens: response tokens the model
    sampled, tool output excluded), 0 elsewhere; [B, L] each, in at least fp32. baseline: minus A's mean over the
    masked tokens (see the module docstring). Without it A is minus the per-token reverse-KL estimate, so
    `-distill_advantages(..., baseline=False)` over the mask is the reverse KL the metrics report."""
    if teacher_logprobs.shape != student_logprobs.shape or mask.shape != student_logprobs.shape:
        raise ValueError(f"teacher_logprobs {tuple(teacher_logprobs.shape)}, student_logprobs "
                         f"{tuple(student_logprobs.shape)} and mask {tuple(mask.shape)} must all be [B, L]")
    dtype = torch.promote_types(torch.promote_types(teacher_logprobs.dtype, student_logprobs.dtype), torch.float32)
    keep = mask.bool()
    diff = teacher_logprobs.to(dtype) - student_logprobs.to(dtype)
    if baseline and keep.any():
        diff = diff - diff[keep].mean()
    return torch.where(keep, diff, torch.zeros((), dtype=dtype, device=diff.device))
