"""Data-parallel sharding of the trained parameters (ZeRO-2, the layout megatron-core's distributed optimizer uses):
the parameters of one data-parallel group go in buckets, each bucket's flat range is split evenly over the group's
ranks, and each rank keeps only its piece of the reduced gradients and of the optimizer state (optim.py). After the
backward the grads are reduce-scattered bucket by bucket (this rank receives the sum of its piece); after the
optimizer step each rank writes its updated piece into the bucket's parameter buffer and the buffer is all-gathered,
so every rank holds the whole updated parameters again. Communication per step is the same as one all-reduce of the
grads (a reduce-scatter plus an all-gather); the fp32 master copy and AdamW's two moments shrink by the group's size.

Buckets: parameters in reverse registration order (the backward makes the last layers' grads first, so buckets fill
in that order), one dtype and device per bucket, a new bucket once adding one would pass `bucket_bytes`. A `unit`
(default: each parameter alone) is placed whole and in its own order: the experts of one MoE layer stay one
contiguous [E, ...] block (moe.py reads them without stacking). Each bucket is padded to a multiple of the group's
size (times 64 elements, so every rank's piece starts aligned) and, with more than one rank, its parameters become
views of one flat buffer (the all-gather writes them in place).

With `overlap`, a post-accumulate-grad hook counts each parameter's grad of the step's last micro-batch and starts a
bucket's reduce-scatter as soon as it and every bucket before it are complete, while the backward still runs on the
layers below; `finish()` starts what is left, waits and divides by the data-parallel size. Launches go in bucket
order on every rank (bucket 0, 1, 2, ... whatever starts them), so ranks never pair different buckets. At launch the
bucket's grads are copied into one flat tensor and freed: the extra memory is one bucket in flight.

One rank (a group of size 1) shards nothing: its pieces are the whole parameters and the grads stay where the
backward put them (the engine's numbers are then exactly those of an unsharded AdamW). A parameter without a grad on
a rank contributes zeros to the sum (as megatron's DDP); with one rank its piece keeps no grad (AdamW skips it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Slice", "ShardedParams", "plan_buckets"]

ALIGN = 64  # elements: each rank's piece of a bucket starts at a multiple of this


@dataclass(frozen=True)
class Slice:
    """This rank's piece of one parameter: its flattened elements [start, stop), which sit at `offset` in this rank's
    shard of bucket `bucket`."""
    param: int  # index into ShardedParams.params
    start: int
    stop: int
    bucket: int
    offset: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def plan_buckets(params: list[torch.Tensor], bucket_bytes: int,
                 units: list[list[int]] | None = None) -> list[list[int]]:
    """Indices into `params`, grouped into buckets: units in reverse order (each unit's members in its own order;
    default one unit per parameter), one dtype and device per bucket, a new bucket once adding a unit would pass
    `bucket_bytes` (a unit larger than that is a bucket alone)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    units = [[i] for i in range(len(params))] if units is None else units
    buckets: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for unit in sorted(units, key=max, reverse=True):
        p = params[unit[0]]
        nbytes = sum(params[i].numel() * params[i].element_size() for i in unit)
        if cur and (p.dtype != params[cur[0]].dtype or p.device != params[cur[0]].device
                    or size + nbytes > bucket_bytes):
            buckets.append(cur)
            cur, size = [], 0
        cur.extend(unit)
        size += nbytes
    if cur:
        buckets.append(cur)
    return buckets


class ShardedParams:
    """`params` of one data-parallel `group` in buckets, this rank's piece of each (`slices`). `arm()` before the
    step's last backward (starts buckets from grad hooks when `overlap`), `finish()` after it (the grads of this
    rank's pieces are then the group's average: `grad(slice)`), `gather()` after the step."""

    def __init__(self, params: list[torch.Tensor], group, *, bucket_bytes: int = 64 * 2**20, overlap: bool = True,
                 divisor: int | None = None, units: list[list[int]] | None = None):
        """divisor: what the summed grads are divided by (default: the group's size). MoE experts are summed over
        the expert-data-parallel group but divided by the data-parallel size, as megatron's DDP does: an expert's
        grad on its rank already holds the tokens every expert-parallel rank sent it."""
        self.params = list(params)
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.divisor = self.world if divisor is None else int(divisor)
        self.buckets = plan_buckets(self.params, bucket_bytes, units)
        self._bucket_of = {i: b for b, idx in enumerate(self.buckets) for i in idx}
        self.offsets: dict[int, int] = {}  # param index -> its offset in its bucket
        self.bucket_numel: list[int] = []  # padded
        self.slices: list[Slice] = []
        for b, idx in enumerate(self.buckets):
            off = 0
            for i in idx:
                self.offsets[i] = off
                off += self.params[i].numel()
            unit = self.world * ALIGN
            padded = -(-off // unit) * unit if self.world > 1 else off
            self.bucket_numel.append(padded)
            lo, hi = self.shard_range(b)
            for i in idx:
                start, stop = max(self.offsets[i], lo), min(self.offsets[i] + self.params[i].numel(), hi)
                if start < stop:
                    self.slices.append(Slice(i, start - self.offsets[i], stop - self.offsets[i], b, start - lo))
        self.slices.sort(key=lambda s: s.param)  # registration order (the unsharded optimizer's)
        self.buffers: list[torch.Tensor] = []  # with world > 1: each bucket's parameters as one flat tensor
        if self.world > 1:
            for b, idx in enumerate(self.buckets):
                p0 = self.params[idx[0]]
                buf = torch.zeros(self.bucket_numel[b], dtype=p0.dtype, device=p0.device)
                for i in idx:
                    p = self.params[i]
                    buf[self.offsets[i]:self.offsets[i] + p.numel()].view_as(p).copy_(p.detach())
                self.buffers.append(buf)
            self.bind_params()
        self.overlap = overlap
        self._armed = False
        self._ready = [0] * len(self.buckets)
        self._next = 0  # the next bucket to launch (launches go in bucket order on every rank)
        self._inflight: list[tuple[int, torch.Tensor, torch.Tensor, object]] = []
        self._grads: dict[int, torch.Tensor] = {}  # bucket -> this rank's reduced piece (world > 1)
        self.launched_by_hooks = 0  # buckets started during the backward in the last step (a test reads it)
        if overlap and self.world > 1:
            for i, p in enumerate(self.params):
                p.register_post_accumulate_grad_hook(self._hook(i))

    def bind_params(self) -> None:
        """Make every parameter a view of its bucket's buffer (again, after a buffer moved: offload.py)."""
        for b, buf in enumerate(self.buffers):
            for i in self.buckets[b]:
                p = self.params[i]
                p.data = buf[self.offsets[i]:self.offsets[i] + p.numel()].view_as(p)

    def shard_range(self, b: int) -> tuple[int, int]:
        """This rank's [lo, hi) of bucket b's flat (padded) range."""
        n = self.bucket_numel[b] // self.world
        return self.rank * n, (self.rank + 1) * n

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
        idx = self.buckets[b]
        p0 = self.params[idx[0]]
        flat = torch.empty(self.bucket_numel[b], dtype=p0.dtype, device=p0.device)
        end = 0
        for i in idx:
            p, off = self.params[i], self.offsets[i]
            end = off + p.numel()
            if p.grad is None:
                flat[off:end].zero_()
            else:
                flat[off:end].copy_(p.grad.reshape(-1))
                p.grad = None
        flat[end:].zero_()
        out = torch.empty(self.bucket_numel[b] // self.world, dtype=flat.dtype, device=flat.device)
        self._inflight.append((b, flat, out, dist.reduce_scatter_tensor(out, flat, group=self.group, async_op=True)))
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
        for b, _flat, out, work in self._inflight:
            work.wait()
            self._grads[b] = out.div_(self.divisor)
        self._reset()  # ready for the next step, armed or not (pipeline parallel never arms)

    def grad(self, s: Slice) -> torch.Tensor | None:
        """The reduced grad of this rank's piece `s` (flat; a view), or None (one rank, no grad)."""
        if self.world == 1:
            g = self.params[s.param].grad
            return None if g is None else g.view(-1)
        return self._grads[s.bucket][s.offset:s.offset + s.numel]

    def drop_grads(self) -> None:
        self._grads = {}

    def param_piece(self, s: Slice) -> torch.Tensor:
        """This rank's piece of the parameter (flat; a view of its data)."""
        return self.params[s.param].detach().view(-1)[s.start:s.stop]

    def gather(self) -> None:
        """Every rank's updated pieces into every rank's parameters (all-gather of each bucket's buffer)."""
        if self.world == 1:
            return
        works = []
        for b, buf in enumerate(self.buffers):
            lo, hi = self.shard_range(b)
            works.append(dist.all_gather_into_tensor(buf, buf[lo:hi], group=self.group, async_op=True))
        for w in works:
            w.wait()
