"""What each GPU's training ranks hold, in parameters (a layer, a stage, a role's rank, the checkpoint), the share
whose optimizer state a rank keeps and what offload moves to the host; memory.py turns it into bytes by phase.
"""

from __future__ import annotations

from rltrain.plan.inputs import Inputs, Shape
from rltrain.utils import flops


def layer_params(shape: Shape, tp: int, *, sparse: bool = False, ep: int = 1) -> float:
    """One decoder layer on one rank: the matrices / TP, the norms whole; a sparse layer's router whole and its E / EP
    experts, each / TP (megatron's expert TP is the TP size)."""
    norms = 2 * shape.hidden_size + (2 * shape.head_dim if shape.model_type in ("qwen3", "qwen3_moe") else 0)
    if not sparse:
        return flops.layer_matmul_params(shape) / tp + norms
    experts = shape.num_experts / ep * flops.expert_params(shape) / tp
    return flops.attention_params(shape) / tp + shape.hidden_size * shape.num_experts + experts + norms


def stage_layers(shape: Shape, pp: int, stage: int) -> int:
    L = shape.num_hidden_layers
    base, rem = divmod(L, pp)
    return base + (1 if stage < rem else 0)


def stage_sparse(shape: Shape, pp: int, stage: int) -> list[int]:
    """The sparse-layer flags (1: MoE block) of the layers of pipeline stage `stage`."""
    start = sum(stage_layers(shape, pp, s) for s in range(stage))
    return list(shape.sparse[start:start + stage_layers(shape, pp, stage)])


def role_params(shape: Shape, tp: int, pp: int, stage: int, *, critic: bool = False, ep: int = 1) -> float:
    """Parameters of one rank (TP, stage `stage`, EP) of the actor/reference (critic: with the value head)."""
    h, V = shape.hidden_size, shape.vocab_size
    p = sum(layer_params(shape, tp, sparse=bool(f), ep=ep) for f in stage_sparse(shape, pp, stage))
    first, last = stage == 0, stage == pp - 1
    if first:
        p += V * h / tp  # input embedding
    if last:
        p += h  # final norm
        if critic:
            p += h + 1  # value head
        elif not shape.tie_word_embeddings or pp > 1:
            p += V * h / tp  # LM head (a tied head's copy on the last stage when pp > 1)
    return p


def expert_params_rank(shape: Shape, tp: int, pp: int, stage: int, ep: int = 1) -> float:
    """Of role_params, the experts' (E / EP local experts of each sparse layer of the stage, each / TP)."""
    per_layer = shape.num_experts / ep * flops.expert_params(shape) / tp
    return sum(per_layer for f in stage_sparse(shape, pp, stage) if f)


def state_share(x: Inputs, P: float, Pe: float) -> float:
    """Of P parameters on a rank (Pe of them experts), the elements whose optimizer state this rank keeps: the dense
    ones / DP, the experts / ParallelDims.edp (the legacy engine: all of P)."""
    if x.legacy_engine:
        return P
    dims = x.dims
    return (P - Pe) / dims.dp + Pe / dims.edp


def ref_resident_params(x: Inputs, stage: int) -> float:
    """The reference's parameters on a GPU of `stage`: all, or with ref.offload all but two of its layers."""
    P = role_params(x.shape, x.tp, x.pp, stage, ep=x.ep)
    if not x.ref_offload:
        return P
    layers = [layer_params(x.shape, x.tp, sparse=bool(f), ep=x.ep) for f in stage_sparse(x.shape, x.pp, stage)]
    return P - sum(layers) + 2 * max(layers, default=0.0)


def full_params(shape: Shape) -> float:
    """Every parameter of the checkpoint, all experts (what the rollout engine holds and the weight sync moves)."""
    return float(flops.num_params(shape))


def optimizer_state(x: Inputs, stage: int, *, critic: bool = False) -> tuple[float, float, float]:
    """(fp32 master, AdamW moments, the host's share of both) in bytes of one role's state_share on a `stage` rank."""
    P = role_params(x.shape, x.tp, x.pp, stage, critic=critic, ep=x.ep)
    S = state_share(x, P, expert_params_rank(x.shape, x.tp, x.pp, stage, x.ep))
    per = (4 if x.dtype_bytes == 2 else 0) + 8
    on_gpu = 1.0 - x.optimizer_offload_fraction
    return S * (4 if x.dtype_bytes == 2 else 0) * on_gpu, S * 8 * on_gpu, S * per * x.optimizer_offload_fraction


def host_bytes(x: Inputs, stage: int) -> float:
    """Pinned host memory one GPU's offloaded state takes (optimizer share, offload_while_rollout, ref.offload)."""
    P = role_params(x.shape, x.tp, x.pp, stage, ep=x.ep)
    master, moments, host = optimizer_state(x, stage)
    out = host + (P * x.dtype_bytes + master + moments if x.offload_while_rollout else 0.0)
    return out + (P * x.dtype_bytes if x.use_ref and x.ref_offload else 0.0)
