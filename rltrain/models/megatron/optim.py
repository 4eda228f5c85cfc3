"""The trained engine's optimizer side: AdamW (on fp32 master copies when the params are not fp32) with its lr
schedule, the gradient reductions after the backward (data-parallel buckets, TP partial sums, tied embeddings across
pipeline stages), the global grad norm, clipping and the step. No forward math and no loss here (engine.py).

Speed (docs/benchmarks/update.md): grad norm, clipping and the master -> param copy are multi-tensor
(`torch._foreach_*`) ops; AdamW is the fused CUDA kernel on GPU; data-parallel grads are averaged in buckets started
during the last backward (grad_reduce.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from rltrain.utils.lr_schedule import LR_SCHEDULES
from rltrain.models.megatron import pipeline as pipeline_mod
from rltrain.models.megatron.grad_reduce import DataParallelGradReducer


class EngineOptimizer:
    """AdamW + schedule over `model`'s trainable params on this rank, and the grad plumbing around its step."""

    def __init__(self, model, *, params_dtype: torch.dtype, device: torch.device, pp_size: int, lr: float,
                 weight_decay: float, betas: tuple[float, float], eps: float, grad_clip: float, warmup_steps: int,
                 total_steps: int, lr_schedule: str, min_lr_ratio: float, grad_reduce_bucket_mb: float,
                 overlap_grad_reduce: bool):
        self.model, self.device, self.pp_size, self.grad_clip = model, device, pp_size, grad_clip
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters: list[torch.Tensor] | None = None
        if params_dtype != torch.float32:
            self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        # MoE experts under expert parallelism (megatron marks them allreduce=False) are distinct per expert-parallel
        # rank: their grads are summed over the expert-data-parallel group only (expert_reducer)
        self.experts = [p for p in self.params if not getattr(p, "allreduce", True)]
        self._expert_ids = {id(p) for p in self.experts}
        dense = [p for p in self.params if getattr(p, "allreduce", True)]
        self.dp_reducer: DataParallelGradReducer | None = None
        self.expert_reducer: DataParallelGradReducer | None = None
        dp_group = parallel_state.get_data_parallel_group()
        dp = dist.get_world_size(dp_group)
        # under pipeline parallelism megatron's schedule runs the backward: no hook knows which is the last
        # micro-batch's, so the buckets start after it
        bucketing = dict(bucket_bytes=int(grad_reduce_bucket_mb * 2**20), overlap=overlap_grad_reduce and pp_size == 1)
        if dp > 1:
            self.dp_reducer = DataParallelGradReducer(dense, dp_group, **bucketing)
            if self.experts:
                self.expert_reducer = DataParallelGradReducer(
                    self.experts, parallel_state.get_expert_data_parallel_group(), divisor=dp, **bucketing)
        # Replicated params whose grads are per-rank partial sums under TP (megatron's
        # finalize_model_grads sums them): q/k layer norms (each rank sees its own heads) and,
        # with sequence parallelism, the norms marked `sequence_parallel`.
        self.tp_partial = [
            p for n, p in model.named_parameters()
            if p.requires_grad and ("q_layernorm" in n or "k_layernorm" in n
                                    or (model.config.sequence_parallel and getattr(p, "sequence_parallel", False)))
        ]
        # one fused CUDA kernel per step on GPU (torch's default there is foreach: ~10 passes over the fp32
        # state); CPU keeps the default implementation (the tiny runs' numbers stay as they were)
        fused = {"fused": True} if device.type == "cuda" else {}
        self.optimizer = torch.optim.AdamW(self.masters if self.masters is not None else self.params, lr=lr,
                                           betas=betas, eps=eps, weight_decay=weight_decay, **fused)
        schedule = LR_SCHEDULES[lr_schedule]
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: schedule(step, warmup_steps, total_steps, min_lr_ratio)
        )

    def arm(self) -> None:
        """The next backward is the step's last: data-parallel buckets start as their grads complete."""
        for reducer in (self.dp_reducer, self.expert_reducer):
            if reducer is not None:
                reducer.arm()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)

    def reduce_grads(self) -> list[torch.Tensor]:
        """After the backward passes: average over data-parallel ranks, sum TP partial grads, sum the tied
        embedding over pipeline stages, move bf16 grads onto the fp32 masters. Returns the params the optimizer
        steps (masters or the model's)."""
        for reducer in (self.dp_reducer, self.expert_reducer):  # averaged over data-parallel ranks (sums commute
            if reducer is not None:                               # with the TP one below)
                reducer.finish()
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            group = parallel_state.get_tensor_model_parallel_group()
            for p in self.tp_partial:
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=group)
        if self.pp_size > 1:
            pipeline_mod.reduce_tied_embedding_grads(self.model)
        if self.masters is None:
            return self.params
        for m, p in zip(self.masters, self.params):  # drop each bf16 grad once cast: 2 B/param less peak
            m.grad, p.grad = (None if p.grad is None else p.grad.float()), None
        return self.masters

    def grad_norm(self, params: list[torch.Tensor]) -> torch.Tensor:
        """Global L2 grad norm over the TP group (replicated params counted once) and pipeline stages, as a
        0-dim fp32 tensor on the device (no host sync)."""
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        expert_ids = self._expert_ids
        grads = [p.grad.detach() for p, model_p in zip(params, self.params)
                 if p.grad is not None and id(model_p) not in expert_ids
                 and not (self.pp_size > 1 and pipeline_mod.is_stage_duplicate(model_p))  # counted on stage 0
                 and (getattr(model_p, "tensor_model_parallel", False) or tp_rank == 0)]
        sq = self._sq_norm(grads)
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(sq, group=parallel_state.get_tensor_model_parallel_group())
        if self.experts:  # each expert shard lives on one rank of its expert-tensor x expert-parallel group
            expert_sq = self._sq_norm([p.grad.detach() for p, model_p in zip(params, self.params)
                                       if p.grad is not None and id(model_p) in expert_ids])
            group = parallel_state.get_expert_tensor_and_model_parallel_group()
            if dist.get_world_size(group) > 1:
                dist.all_reduce(expert_sq, group=group)
            sq = sq + expert_sq
        if self.pp_size > 1:
            pipeline_mod.all_reduce_over_stages(sq)
        return sq.sqrt()

    def _sq_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        if grads:
            sq = sq + torch.stack(torch._foreach_norm(grads)).float().pow(2).sum()
        return sq

    def clip(self, params: list[torch.Tensor], norm: float) -> None:
        if self.grad_clip and self.grad_clip > 0:
            coef = self.grad_clip / (norm + 1e-6)
            grads = [p.grad for p in params if p.grad is not None]
            if coef < 1.0 and grads:
                torch._foreach_mul_(grads, coef)

    def step(self) -> float:
        """AdamW + scheduler step on the (clipped) grads, params refreshed from the masters, grads cleared.
        Returns the lr of this step."""
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        if self.masters is not None:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.masters)
        self.zero_grad()
        return lr

    def masters_from_params(self) -> None:
        """Refresh the fp32 masters after the params were loaded."""
        if self.masters is not None:
            with torch.no_grad():
                for m, p in zip(self.masters, self.params):
                    m.copy_(p.float())

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        if self.masters is not None:
            sd["masters"] = [m.detach().clone() for m in self.masters]
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if "optimizer" not in sd:
            raise KeyError("checkpoint has no optimizer state (was it saved by a 'ref' engine?)")
        self.optimizer.load_state_dict(sd["optimizer"])
        self.scheduler.load_state_dict(sd["scheduler"])
        if self.masters is not None:
            with torch.no_grad():
                for m, saved in zip(self.masters, sd["masters"]):
                    m.copy_(saved)
