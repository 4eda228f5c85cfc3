"""What the engine adds around megatron-core's MoE layers (the layers themselves are megatron's): the per-step router
statistics it logs, and the aux-loss scale of each micro-batch. No routing math of our own: the statistics read
the router's outputs through forward hooks.

Statistics, over the real tokens of a train step (padding is excluded; it is routed like any token, and a row
padded with one repeated id would otherwise pile onto a few experts):
- `moe_aux_loss`: the Switch/GShard load-balancing statistic `E / (k T^2) * sum_e P_e * n_e` per MoE layer
  (P_e: the sum over tokens of the full-softmax probability of expert e, n_e: tokens routed to e, k: top-k,
  T: tokens), averaged over layers. 1.0 when the load is perfectly balanced; it is megatron's `aux_loss` before its
  coefficient, logged whether or not the coefficient is 0 (the loss only adds it when it is > 0).
- `moe_load_max_over_mean`: the worst layer's max over mean of tokens per expert (1.0 = balanced, E/k = all on
  k experts).
Both are over the whole data-parallel batch (one small all-reduce per step). Under pipeline parallelism each stage
counts its own layers, padding included (megatron's schedule runs the layers, not the engine's trunk call), and the
step's metrics are those of the rank that reports them.
"""

from __future__ import annotations

import contextlib
import functools
import types

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from rltrain.compat.megatron import cpu_schedule_shim


def expert_collectives_on_cpu(method):
    """Run the engine's `method` under compat's CPU device shim when MoE tokens are dispatched over ranks: megatron's
    token dispatch allocates its collective buffers on `torch.cuda.current_device()`, forward and backward (a no-op
    with CUDA; pipeline-parallel calls take the same shim in pipeline.py)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with cpu_schedule_shim() if self._dispatch_collectives else contextlib.nullcontext():
            return method(self, *args, **kwargs)
    return run


class ExpertPasses:
    """MegatronEngine's part for expert parallelism (a mixin: it reads the engine's ep_size, device and trunk)."""

    def _expert_padding_passes(self, n_local: int) -> int:
        """Under expert parallelism every MoE layer's forward and backward is a collective of the expert-parallel
        ranks, so every data-parallel rank must run as many micro-batches as the one with the most (their token
        budgets split their rows differently): how many idle passes this rank adds. 0 without EP (no collective)."""
        if self.ep_size == 1:
            return 0
        n = torch.tensor([n_local], dtype=torch.int64, device=self.device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=parallel_state.get_data_parallel_group())
        return int(n.item()) - n_local

    def _idle_pass(self, backward: bool = False) -> None:
        """A forward (and zero backward) of one 2-token row that joins the experts' collectives and changes
        nothing: no grad (x 0), no router statistics (no real token), no aux loss (scale 0)."""
        ids = torch.zeros(1, 2, dtype=torch.long)
        with torch.enable_grad() if backward else contextlib.nullcontext():
            out = self._trunk(ids, torch.zeros(1, dtype=torch.long))
            if backward:
                if self._aux_losses:
                    set_aux_loss_scale(0.0, self.device)
                (out.float().sum() * 0.0).backward()


class RouterStats:
    """Counts tokens per expert and the summed routing probabilities of every MoE router of `model`, while
    `recording`; `valid` ([s*b] bool, megatron's sequence-major token order) marks the real tokens of the next
    forward."""

    def __init__(self, model: torch.nn.Module):
        from megatron.core.transformer.moe.router import TopKRouter

        self.routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        self.recording = False
        self.valid: torch.Tensor | None = None
        self._counts: list[torch.Tensor] = []
        self._probs: list[torch.Tensor] = []
        self._tokens: list[torch.Tensor] = []
        for i, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(i))

    def __bool__(self) -> bool:
        return bool(self.routers)

    def start(self) -> None:
        n, e = len(self.routers), self.routers[0].config.num_moe_experts if self.routers else 0
        device = self.routers[0].weight.device if self.routers else "cpu"
        self._counts = [torch.zeros(e, dtype=torch.float32, device=device) for _ in range(n)]
        self._probs = [torch.zeros(e, dtype=torch.float32, device=device) for _ in range(n)]
        self._tokens = [torch.zeros((), dtype=torch.float32, device=device) for _ in range(n)]
        self.recording = True

    def _hook(self, i: int):
        def on_forward(router, inputs, output) -> None:
            if not self.recording:
                return
            with torch.no_grad():  # masked sums, not boolean indexing: no host sync inside the step
                x = inputs[0].reshape(-1, inputs[0].shape[-1])
                routing_map = output[1].reshape(x.shape[0], -1)
                real = (self.valid if self.valid is not None and self.valid.numel() == x.shape[0]
                        else torch.ones(x.shape[0], dtype=torch.bool, device=x.device)).float()[:, None]
                scores = torch.softmax(torch.nn.functional.linear(x.float(), router.weight.float()), dim=-1)
                self._counts[i] += (routing_map.float() * real).sum(0)
                self._probs[i] += (scores * real).sum(0)
                self._tokens[i] += real.sum()
        return on_forward

    def finish(self) -> dict[str, torch.Tensor]:
        """Stop recording; the step's statistics as 0-dim device tensors (summed over data-parallel ranks)."""
        self.recording = False
        if not self.routers:
            return {}
        counts, probs, tokens = torch.stack(self._counts), torch.stack(self._probs), torch.stack(self._tokens)
        groups = [parallel_state.get_data_parallel_group()]
        if self.routers[0].config.sequence_parallel:  # each TP rank routed its own block of the sequence
            groups.append(parallel_state.get_tensor_model_parallel_group())
        groups = [g for g in groups if dist.get_world_size(g) > 1]
        if groups:
            flat = torch.cat([counts.reshape(-1), probs.reshape(-1), tokens])
            for group in groups:
                dist.all_reduce(flat, group=group)
            n = counts.numel()
            counts, probs, tokens = flat[:n].view_as(counts), flat[n:2 * n].view_as(probs), flat[2 * n:]
        e, k = counts.shape[1], self.routers[0].topk
        t = tokens.clamp(min=1.0)
        aux = (probs * counts).sum(1) * e / (k * t * t)
        imbalance = counts.max(1).values / (counts.mean(1)).clamp(min=1e-9)
        return {"moe_aux_loss": aux.mean(), "moe_load_max_over_mean": imbalance.max()}


def set_aux_loss_scale(scale: float, device: torch.device) -> None:
    """The weight of the next backward's router aux and z losses: the micro-batch's loss scale, as its main loss
    (megatron applies them with scale 1.0 per micro-batch otherwise: the coefficient times the micro-batch count)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(float(scale), dtype=torch.float32, device=device))


class RoutingReplay:
    """Rollout routing replay through megatron-core's RouterReplay (`moe_enable_routing_replay`, one per router):
    `set(routed)` makes every MoE layer of `model` route the next forward's tokens to the given experts (top-k
    weights still come from this model's router scores, so the router keeps its gradient); `clear()` returns to
    computed routing. Megatron keeps its instances in one process-wide list; this drives only `model`'s own (the
    reference beside it routes for itself). The targets stay set through the backward, so a recomputed layer
    routes as its forward did."""

    def __init__(self, model: torch.nn.Module):
        from megatron.core.transformer.moe.router import TopKRouter

        self.replays = [m.router_replay for m in model.modules()
                        if isinstance(m, TopKRouter) and m.router_replay is not None]
        self.active = False

    def set(self, routed: torch.Tensor) -> None:
        """routed: [b, s, L, k] expert ids of this micro-batch's tokens (L: the model's MoE layers, in order)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if routed.dim() != 4 or routed.shape[2] != len(self.replays):
            raise ValueError(f"routed experts must be [b, s, {len(self.replays)} MoE layers, top-k]; got "
                             f"{tuple(routed.shape)}")
        order = routed.long().transpose(0, 1)  # megatron's tokens are sequence-major: [s, b, L, k]
        for i, replay in enumerate(self.replays):
            replay.clear_indices()
            replay.set_target_indices(order[:, :, i].reshape(-1, routed.shape[3]))
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        self.active = True

    def clear(self) -> None:
        for replay in self.replays:
            replay.clear_indices()
            replay.clear_router_replay_action()
        self.active = False


class _StackedView(torch.autograd.Function):
    """The local experts' weights [E, ...] as one tensor without a copy, where they lie back to back in one storage
    (stack_expert_weights, or a data-parallel bucket's buffer: shards.py keeps them one unit); the backward hands
    each expert its slice of the stacked grad (a view: autograd keeps it as the expert's .grad, no copy)."""

    @staticmethod
    def forward(ctx, *weights):
        w = weights[0]
        return w.as_strided((len(weights), *w.shape), (w.numel(), *w.stride()), w.storage_offset())

    @staticmethod
    def backward(ctx, grad):
        return tuple(grad.contiguous().unbind(0))


def adjacent(weights: list[torch.Tensor]) -> bool:
    """Whether `weights` (contiguous, one shape) lie back to back in one storage, in order."""
    w0 = weights[0]
    step = w0.numel() * w0.element_size()
    return all(w.is_contiguous() and w.shape == w0.shape and w.untyped_storage().data_ptr()
               == w0.untyped_storage().data_ptr() and w.data_ptr() == w0.data_ptr() + j * step
               for j, w in enumerate(weights))


def stacked(weights: list[torch.Tensor]) -> torch.Tensor:
    """[E, ...] of the experts' weights: a view where they are adjacent, else a stacked copy (counted in
    `stacked.copies`: a test and the planner's note read it)."""
    if adjacent(weights):
        return _StackedView.apply(*weights)
    stacked.copies += 1
    return torch.stack(weights)


stacked.copies = 0


def _grouped_experts_forward(experts, hidden: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor):
    """megatron's SequentialMLP.forward (fc1 -> SwiGLU x routing prob -> fc2 per local expert over its contiguous
    block of the permuted tokens) as two grouped GEMMs over all local experts, on the same parameters (read as one
    [E, ...] block each where they are adjacent: stack_expert_weights makes them so; a copy per call otherwise)."""
    from rltrain.models.megatron.head import _ContiguousGrad  # torch._grouped_mm's backward rejects expanded grads

    cfg = experts.config
    if hidden.shape[0] == 0:
        return experts._rltrain_loop_forward(hidden, tokens_per_expert, probs)
    offs = tokens_per_expert.to(device=hidden.device, non_blocking=True).cumsum(0).to(torch.int32)
    w1 = stacked([e.linear_fc1.weight for e in experts.local_experts])  # [E, 2I, H]
    w2 = stacked([e.linear_fc2.weight for e in experts.local_experts])  # [E, H, I]
    h = _ContiguousGrad.apply(torch._grouped_mm(hidden, w1.transpose(1, 2), offs=offs))  # [T, 2I]
    if cfg.bias_activation_fusion:  # as megatron's MLP does under the same flag (fusion.py "mcore")
        from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl

        inter = weighted_bias_swiglu_impl(h, None, probs.unsqueeze(-1), cfg.activation_func_fp8_input_store)
    else:
        gate, up = torch.chunk(h, 2, dim=-1)
        inter = (cfg.activation_func(gate) * up * probs.unsqueeze(-1)).to(h.dtype)
    return _ContiguousGrad.apply(torch._grouped_mm(inter, w2.transpose(1, 2), offs=offs)), None


def use_grouped_expert_gemm(model: torch.nn.Module) -> int:
    """Run every SequentialMLP of `model` (megatron's experts without Transformer Engine or the grouped_gemm package)
    through torch._grouped_mm: one GEMM per projection for all local experts instead of a Python loop. Where the
    grouped GEMM does not apply (no SwiGLU, biases, fp8, probabilities on the input, widths not a multiple of 16
    bytes) the loop stays. Returns how many expert layers were switched."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    switched = 0
    for experts in model.modules():
        if not isinstance(experts, SequentialMLP) or not hasattr(torch, "_grouped_mm"):
            continue
        cfg = experts.config
        w1 = experts.local_experts[0].linear_fc1.weight
        align = 16 // w1.element_size()
        if (not cfg.gated_linear_unit or cfg.activation_func is not torch.nn.functional.silu or cfg.add_bias_linear
                or cfg.fp8 or cfg.fp4 or cfg.moe_apply_probs_on_input or cfg.activation_func_clamp_value is not None
                or cfg.glu_linear_offset or w1.shape[0] % (2 * align) or w1.shape[1] % align):
            continue
        experts._rltrain_loop_forward = experts.forward
        experts.forward = types.MethodType(_grouped_experts_forward, experts)  # bound to this module
        stack_expert_weights(experts)
        switched += 1
    return switched


def stack_expert_weights(experts) -> None:
    """Lay a SequentialMLP's local experts' fc1 weights back to back in one [E, 2I, H] storage, and their fc2 weights
    in one [E, H, I] (each expert's parameter a view of its row, names unchanged): the grouped GEMM then reads them
    without a copy. The data-parallel shards keep the layout (optim.expert_units)."""
    for name in ("linear_fc1", "linear_fc2"):
        weights = [getattr(e, name).weight for e in experts.local_experts]
        block = torch.stack([w.detach() for w in weights])
        for j, w in enumerate(weights):
            w.data = block[j]
