"""Data-parallel gradient averaging in buckets, started during the last backward of a step.

Before this, the engine all-reduced every parameter's grad after the whole backward: one collective per tensor
(~310 at Qwen3-0.6B), each paying the collective's latency, and none of it hidden behind compute. Here the
grads go in buckets of about `bucket_bytes` (parameters in reverse registration order: the backward makes the
last layers' grads first, so buckets fill in that order), one asynchronous all-reduce per bucket. With
`overlap`, a post-accumulate-grad hook counts each parameter's grad of the step's last micro-batch and starts
a bucket's all-reduce as soon as it and every bucket before it are complete, while the backward still runs on
the layers below; `finish()` starts what is left, waits, and divides by the data-parallel size.

The order of collectives is the same on every rank (bucket 0, 1, 2, ... whatever launches them), so a rank whose
hook-driven launches run ahead of another's never pairs different buckets. At launch the bucket's grads are
copied into one flat tensor and each parameter's `.grad` becomes a view of it (the separate grad is freed):
the extra memory is one bucket in flight at the copy, not a second copy of every grad.

Assumption, as before: every data-parallel rank produces grads for the same parameters (a dense model does).
A parameter without a grad in a bucket that `finish()` launches contributes zeros and keeps `.grad = None`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["DataParallelGradReducer", "plan_buckets"]


def plan_buckets(params: list[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Indices into `params`, grouped into buckets: reverse order, one dtype and device per bucket, a new
    bucket once adding a parameter would pass `bucket_bytes` (a parameter larger than that is a bucket alone)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    buckets: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i in reversed(range(len(params))):
        p = params[i]
        nbytes = p.numel() * p.element_size()
        if cur and (p.dtype != params[cur[0]].dtype or p.device != params[cur[0]].device
                    or size + nbytes > bucket_bytes):
            buckets.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += nbytes
    if cur:
        buckets.append(cur)
    return buckets


class DataParallelGradReducer:
    """Averages `params`' grads over `group` in buckets; `arm()` before the step's last backward (starts
    buckets from grad hooks when `overlap`), `finish()` after it (the grads are then the average)."""

    def __init__(self, params: list[torch.Tensor], group, *, bucket_bytes: int = 64 * 2**20, overlap: bool = True,
                 divisor: int | None = None):
        """divisor: what the summed grads are divided by (default: the group's size). MoE experts are summed over
        the expert-data-parallel group but divided by the data-parallel size, as megatron's DDP does: an expert's
        grad on its rank already holds the tokens every expert-parallel rank sent it."""
        self.params = list(params)
        self.group = group
        self.world = dist.get_world_size(group)
        self.divisor = self.world if divisor is None else int(divisor)
        self.buckets = plan_buckets(self.params, bucket_bytes)
        self._bucket_of = {i: b for b, idx in enumerate(self.buckets) for i in idx}
        self.overlap = overlap
        self._armed = False
        self._ready = [0] * len(self.buckets)
        self._next = 0  # the next bucket to launch (launches go in bucket order on every rank)
        self._inflight: list[tuple[torch.Tensor, object]] = []
        self.launched_by_hooks = 0  # buckets started during the backward in the last step (a test reads it)
        if overlap and self.world > 1:
            for i, p in enumerate(self.params):
                p.register_post_accumulate_grad_hook(self._hook(i))

    def _hook(self, i: int):
        def on_grad(_p: torch.Tensor) -> None:
            if not self._armed:
                return
            b = self._bucket_of[i]
            self._ready[b] += 1
            while self._next < len(self.buckets) and self._ready[self._next] == len(self.buckets[self._next]):
                self._launch(self._next)
                self.launched_by_hooks += 1
        return on_grad

    def arm(self) -> None:
        """The next backward is the step's last: start buckets as their grads complete."""
        self._reset()
        self.launched_by_hooks = 0
        self._armed = self.overlap and self.world > 1

    def _reset(self) -> None:
        self._ready = [0] * len(self.buckets)
        self._next = 0
        self._inflight = []

    def _launch(self, b: int) -> None:
        ps = [self.params[i] for i in self.buckets[b]]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in ps])
        off = 0
        for p in ps:
            n = p.numel()
            if p.grad is not None:
                p.grad = flat[off:off + n].view_as(p)
            off += n
        self._inflight.append((flat, dist.all_reduce(flat, group=self.group, async_op=True)))
        self._next = b + 1

    def finish(self) -> None:
        """Start the buckets not started yet, wait for all, divide by the data-parallel size."""
        self._armed = False
        if self.world == 1:
            if self.divisor != 1:
                grads = [p.grad for p in self.params if p.grad is not None]
                if grads:
                    torch._foreach_div_(grads, self.divisor)
            return
        while self._next < len(self.buckets):
            self._launch(self._next)
        for flat, work in self._inflight:
            work.wait()
            flat.div_(self.divisor)
        self._reset()  # ready for the next step, armed or not (pipeline parallel never arms)
