"""What each GPU's training ranks hold, in parameters: one decoder layer, a pipeline stage, a role's rank (the
experts split over expert parallelism), the whole checkpoint; of those, the share whose optimizer state the sharded
optimizer keeps on a rank, and what offload moves to the host (models/megatron/shards.py, offload.py). Pure
arithmetic on the shape and the config (no torch); memory.py turns it into bytes by phase.
"""

from __future__ import annotations

from types import SimpleNamespace

from rltrain.plan.inputs import Inputs, Shape
from rltrain.utils import flops


def ns(shape: Shape) -> SimpleNamespace:
    return SimpleNamespace(**{k: getattr(shape, k) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "tie_word_embeddings", "model_type", "num_experts", "num_experts_per_tok",
        "moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers")})


def layer_params(shape: Shape, tp: int, *, sparse: bool = False, ep: int = 1) -> float:
    """One decoder layer on one rank: attention matrices / TP, the two RMSNorms and Qwen3's q/k norms whole; the
    MLP / TP, or for a sparse layer the router (h x E, whole on every rank) and E / EP experts, each / TP (megatron's
    expert tensor-parallel size is the TP size)."""
    s = ns(shape)
    norms = 2 * shape.hidden_size + (2 * shape.head_dim if shape.model_type in ("qwen3", "qwen3_moe") else 0)
    if not sparse:
        return flops.layer_matmul_params(s) / tp + norms
    experts = shape.num_experts / ep * flops.expert_params(s) / tp
    return flops.attention_params(s) / tp + shape.hidden_size * shape.num_experts + experts + norms


def stage_layers(shape: Shape, pp: int, stage: int) -> int:
    L = shape.num_hidden_layers
    base, rem = divmod(L, pp)
    return base + (1 if stage < rem else 0)


def stage_sparse(shape: Shape, pp: int, stage: int) -> list[int]:
    """The sparse-layer flags (1: MoE block) of the layers of pipeline stage `stage`."""
    start = sum(stage_layers(shape, pp, s) for s in range(stage))
    return list(shape.sparse[start:start + stage_layers(shape, pp, stage)])


def role_params(shape: Shape, tp: int, pp: int, stage: int, *, critic: bool = False, ep: int = 1) -> float:
    """Parameters of one rank (TP rank, pipeline stage `stage`, expert-parallel rank) of the actor/reference
    (critic: value head)."""
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
    per_layer = shape.num_experts / ep * flops.expert_params(ns(shape)) / tp
    return sum(per_layer for f in stage_sparse(shape, pp, stage) if f)


def state_share(x: Inputs, P: float, Pe: float) -> float:
    """Of P parameters on a rank (Pe of them experts), the elements whose optimizer state this rank keeps: the sharded
    optimizer splits the dense ones over the data-parallel ranks and the experts over the expert-data-parallel ones
    (ParallelDims.edp: the ranks holding the same experts). The engine before issue 59 (Inputs.legacy_engine): all
    of P."""
    if x.legacy_engine:
        return P
    dims = x.dims
    return (P - Pe) / dims.dp + Pe / dims.edp


def ref_resident_params(x: Inputs, stage: int) -> float:
    """The reference's parameters on a GPU of `stage`: all of them, or with ref.offload its embedding, head and
    final norm and two of its layers (the one running and the next arriving)."""
    P = role_params(x.shape, x.tp, x.pp, stage, ep=x.ep)
    if not x.ref_offload:
        return P
    layers = [layer_params(x.shape, x.tp, sparse=bool(f), ep=x.ep) for f in stage_sparse(x.shape, x.pp, stage)]
    return P - sum(layers) + 2 * max(layers, default=0.0)


def full_params(shape: Shape) -> float:
    """Every parameter of the checkpoint, all experts (what the rollout engine holds and the weight sync moves)."""
    return float(flops.num_params(ns(shape)))


def optimizer_state(x: Inputs, stage: int, *, critic: bool = False) -> tuple[float, float, float]:
    """(fp32 master, AdamW moments, the host's share of both) in bytes of one role on a rank of `stage`: this rank's
    pieces (state_share), the actor.optimizer_offload_fraction of them on the host."""
    P = role_params(x.shape, x.tp, x.pp, stage, critic=critic, ep=x.ep)
    S = state_share(x, P, expert_params_rank(x.shape, x.tp, x.pp, stage, x.ep))
    per = (4 if x.dtype_bytes == 2 else 0) + 8
    on_gpu = 1.0 - x.optimizer_offload_fraction
    return S * (4 if x.dtype_bytes == 2 else 0) * on_gpu, S * 8 * on_gpu, S * per * x.optimizer_offload_fraction


def host_bytes(x: Inputs, stage: int) -> float:
    """Pinned host memory one GPU's offloaded state takes (offload.py): the host share of the optimizer state, with
    actor.offload_while_rollout the actor's weights, master and moments, with ref.offload the reference's weights."""
    P = role_params(x.shape, x.tp, x.pp, stage, ep=x.ep)
    master, moments, host = optimizer_state(x, stage)
    out = host + (P * x.dtype_bytes + master + moments if x.offload_while_rollout else 0.0)
    return out + (P * x.dtype_bytes if x.use_ref and x.ref_offload else 0.0)
