"""Pipeline-parallel plumbing for MegatronEngine: grouping micro-batches into shape-uniform schedule
calls, running megatron-core's own forward/backward schedule, and the cross-stage reductions
(last-stage broadcasts, tied-embedding grads, squared grad norm) and the merge of the stages' exported
weights (`merge_stages`: every stage ends up with the whole HF model). It must not hold the LM head, the
loss or the optimizer (engine.py does).

Shapes: megatron's p2p sends [s, b, H] activations whose shape it must know in advance
(`variable_seq_lengths=False`), so every micro-batch of one schedule call is right-padded to the
group's [b_max, s_max]. `group_micro_batches` starts a new call whenever padding would push a
micro-batch above the token budget, so padding costs at most that budget per micro-batch. Padded
rows and columns are sliced off before the head: right padding under causal attention never
changes the real tokens' hidden states.

CPU: megatron's schedule and p2p code create tensors on `"cuda"` / `torch.cuda.current_device()`,
and building a tied-embedding last stage calls `.cuda()`. Without CUDA, `cpu_schedule_shim`
(rltrain/compat/megatron.py) redirects those to the CPU for the duration of the schedule call (or model build) only; the
engine also turns off batched isend/irecv, whose `batch_p2p_sync` calls `torch.cuda.synchronize`.
With CUDA it does nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from rltrain.compat.megatron import cpu_schedule_shim
from rltrain.models.loss_protocol import LossFn, MicroBatch


def group_micro_batches(shapes: Sequence[tuple[int, int]], max_tokens: int) -> list[list[int]]:
    """Consecutive micro-batch indices per schedule call, given each micro-batch's [b, s].

    A micro-batch joins the current group while the padded shape b_max * s_max stays within
    max(max_tokens, the largest single micro-batch of the group) tokens.
    """
    groups: list[list[int]] = []
    gb = gs = cap = 0
    for i, (b, s) in enumerate(shapes):
        nb, ns = max(gb, b), max(gs, s)
        ncap = max(cap, max_tokens, b * s)
        if groups and nb * ns <= ncap:
            groups[-1].append(i)
            gb, gs, cap = nb, ns, ncap
        else:
            groups.append([i])
            gb, gs, cap = b, s, max(max_tokens, b * s)
    return groups


def pad_ids(input_ids: torch.Tensor, b: int, s: int) -> torch.Tensor:
    """[b0, s0] ids -> [b, s] right/bottom padded with id 0 (b >= b0, s >= s0)."""
    out = input_ids.new_zeros(b, s)
    out[: input_ids.shape[0], : input_ids.shape[1]] = input_ids
    return out


def run_schedule(
    model: torch.nn.Module,
    input_ids: list[torch.Tensor],
    last_stage_fn: Callable[[int, torch.Tensor], torch.Tensor],
    *,
    forward_only: bool,
    device: torch.device,
) -> None:
    """One megatron forward(/backward) schedule call over equally shaped micro-batches.

    input_ids: list of [b, s] (same shape). On the last stage `last_stage_fn(k, out)` gets the
    k-th micro-batch's model output `out` [b, s, X] and returns the 0-dim loss to backpropagate
    (forward_only: any 0-dim tensor; its results are the caller's side effects). The schedule
    divides that loss by len(input_ids) (megatron's averaging); callers pre-multiply to undo it.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    b, s = input_ids[0].shape
    if any(t.shape != (b, s) for t in input_ids):
        raise ValueError(f"run_schedule needs equally shaped micro-batches, got {[tuple(t.shape) for t in input_ids]}")
    position_ids = torch.arange(s, device=device).unsqueeze(0).expand(b, s)
    data = iter(list(enumerate(input_ids)))

    def forward_step(data_iterator, mdl):
        k, ids = next(data_iterator)
        out = mdl(ids.to(device), position_ids, None)

        def loss_func(output_tensor):
            return last_stage_fn(k, output_tensor), {}

        return out, loss_func

    with cpu_schedule_shim():
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=data,
            model=[model],
            num_microbatches=len(input_ids),
            seq_length=s,
            micro_batch_size=b,
            forward_only=forward_only,
        )


class TiedHeadAlias(Mapping):
    """HF weights as a mapping in which a missing `lm_head.weight` reads the embedding: the last
    stage's copy of a tied embedding loads from `model.embed_tokens.weight` (HF checkpoints of tied
    models store only that)."""

    def __init__(self, src: Mapping[str, torch.Tensor]):
        self._src = src
        self._alias = {}
        if "lm_head.weight" not in src:
            for k in ("model.embed_tokens.weight", "embed_tokens.weight"):
                if k in src:
                    self._alias = {"lm_head.weight": k}
                    break

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._src[self._alias.get(key, key)]

    def __iter__(self):
        yield from self._src
        yield from self._alias

    def __len__(self) -> int:
        return len(self._src) + len(self._alias)


def _last_stage_src() -> int:
    return parallel_state.get_pipeline_model_parallel_last_rank()


def broadcast_from_last_stage(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """In-place broadcast of the last pipeline stage's `tensor` to this pipeline group, sent from
    `device` (the communication device: a CPU tensor is staged on the GPU under nccl)."""
    buf = tensor.to(device)
    dist.broadcast(buf, src=_last_stage_src(), group=parallel_state.get_pipeline_model_parallel_group())
    if buf is not tensor:
        tensor.copy_(buf)
    return tensor


def broadcast_object_from_last_stage(obj: Any) -> Any:
    """The last pipeline stage's picklable `obj`, on every rank of this pipeline group."""
    box = [obj]
    dist.broadcast_object_list(box, src=_last_stage_src(), group=parallel_state.get_pipeline_model_parallel_group())
    return box[0]


def reduce_tied_embedding_grads(model) -> None:
    """Sum the tied embedding / output weight grads of the first and last stage (embedding group),
    as megatron's finalize_model_grads does; a missing grad counts as zeros."""
    if not getattr(model, "share_embeddings_and_output_weights", False):
        return
    if not parallel_state.is_rank_in_embedding_group(ignore_virtual=True):
        return
    if not (model.pre_process or model.post_process):
        return
    weight = model.shared_embedding_or_output_weight()
    if not weight.requires_grad:  # frozen (LoRA): nothing to sum
        return
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    dist.all_reduce(weight.grad, group=parallel_state.get_embedding_group())


def is_stage_duplicate(param: torch.Tensor) -> bool:
    """True for the last stage's copy of a tied embedding (counted once, on the first stage)."""
    return bool(getattr(param, "shared", False))


def merge_stages(stage_stream: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                 device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Every pipeline stage's (HF name, full tensor) stream, on every rank of this pipeline group: the
    whole model, stage by stage. Collective over the pipeline group (every rank must iterate).

    Stage s in turn packs its stream into buckets of about `bucket_bytes` and broadcasts each bucket to the
    other stages: first its names, shapes and dtypes (one object), then its tensors, sent from `device`
    (the communication device: CUDA under nccl, CPU under gloo); an empty bucket ends the stage. Peak extra
    memory is one bucket. Tensors come out on `device`, in the order the owning stage produced them.
    """
    group = parallel_state.get_pipeline_model_parallel_group()
    me, stages = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_world_size()
    for stage in range(stages):
        src = dist.get_global_rank(group, stage)
        if stage == me:
            bucket: list[tuple[str, torch.Tensor]] = []
            size = 0
            for name, t in stage_stream:
                bucket.append((name, t))
                size += t.numel() * t.element_size()
                if size >= bucket_bytes:
                    yield from _send_bucket(bucket, src, group, device)
                    bucket, size = [], 0
            if bucket:
                yield from _send_bucket(bucket, src, group, device)
            _broadcast_meta([], src, group)  # end of this stage
        else:
            while meta := _broadcast_meta(None, src, group):
                for name, shape, dtype in meta:
                    buf = torch.empty(shape, dtype=dtype, device=device)
                    dist.broadcast(buf, src=src, group=group)
                    yield name, buf


def _broadcast_meta(meta: list | None, src: int, group) -> list:
    box = [meta]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def _send_bucket(bucket: list[tuple[str, torch.Tensor]], src: int, group, device: torch.device):
    _broadcast_meta([(n, tuple(t.shape), t.dtype) for n, t in bucket], src, group)
    for name, t in bucket:
        buf = t.detach().to(device).contiguous()
        dist.broadcast(buf, src=src, group=group)
        yield name, t


def all_reduce_over_stages(t: torch.Tensor) -> torch.Tensor:
    """In-place sum of `t` over this rank's pipeline group."""
    dist.all_reduce(t, group=parallel_state.get_pipeline_model_parallel_group())
    return t


class PipelineStages:
    """The pipeline-parallel half of MegatronEngine (a mixin: it reads the engine's model, micro-batch budget and
    device): megatron's schedule over shape-uniform groups of micro-batches, forward-only and with the loss."""

    def _pp_schedule(self, micro_batches: list[MicroBatch], last_stage_fn, *, forward_only: bool) -> None:
        """Run megatron's schedule over `micro_batches` in shape-uniform groups (pipeline.py):
        last_stage_fn(mb, out) gets the real [b, s] slice of the last stage's output and returns
        the micro-batch's loss (or None when forward_only)."""
        shapes = [tuple(mb.input_ids.shape) for mb in micro_batches]
        for group in group_micro_batches(shapes, self._budget(forward_only)):
            b = max(shapes[i][0] for i in group)
            s = max(shapes[i][1] for i in group)
            ids = [pad_ids(micro_batches[i].input_ids, b, s) for i in group]

            def fn(k, out, group=group):
                mb = micro_batches[group[k]]
                mb_b, mb_s = mb.input_ids.shape
                loss = last_stage_fn(mb, out[:mb_b, :mb_s])
                if loss is None:
                    return torch.zeros((), device=self.device)
                return loss * len(group)  # the schedule divides by the group's micro-batch count

            run_schedule(self.model, ids, fn, forward_only=forward_only, device=self.device)

    def _pp_forward_only(self, micro_batches: list[MicroBatch], head) -> None:
        def fn(mb, out):
            head(mb, out)
            return None

        self._pp_schedule(micro_batches, fn, forward_only=True)

    def _pp_accumulate(self, micro_batches: list[MicroBatch], loss_fn: LossFn, temperature: float,
                       needs_entropy_grad: bool) -> dict[str, float]:
        """Pipeline-parallel forward/backward of all micro-batches (grads accumulate in .grad);
        the loss runs on the last stage. Returns the metric sums, the same on every stage; a
        non-finite loss raises FloatingPointError on every stage (after the schedule, grads cleared)."""
        for mb in micro_batches:
            self._check_rows(mb.input_ids, mb.seq_lens)
        sums: dict[str, float] = {}
        bad: list[float] = []

        def last_stage(mb: MicroBatch, out):
            outputs = self._outputs(mb, temperature=temperature, entropy_grad=needs_entropy_grad, trunk_out=out)
            loss, metrics = loss_fn(outputs, mb)
            if not bool(torch.isfinite(loss.detach())):
                bad.append(float(loss))
            for k, v in {"loss": loss, **metrics}.items():
                sums[k] = sums.get(k, 0.0) + float(v.detach() if torch.is_tensor(v) else v)
            return loss * float(1.0 / len(micro_batches) if mb.loss_scale is None else mb.loss_scale)

        self._pp_schedule(micro_batches, last_stage, forward_only=False)
        sums, bad = broadcast_object_from_last_stage((sums, bad))
        if bad:
            self.model.zero_grad(set_to_none=True)
            raise FloatingPointError(f"loss is {bad[0]} in a micro-batch; no optimizer step taken")
        return sums
