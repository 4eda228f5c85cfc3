"""Log p(label) and entropy of the LM head's softmax without materializing the [T, V] logits:
the public `logprobs_from_hidden` / `logprobs_from_logits`, their autograd Functions and the
tensor-parallel combine. It must not import the rest of rltrain nor read configs; the only collective
calls are the all-reduces over the caller's `tp_group`.

Algorithm. The vocabulary is split over a tensor-parallel group of W ranks (rank r holds global rows
[r*V_local, (r+1)*V_local)); W = 1 without a group. Each rank computes per-token statistics of its
shard with a backend (`logprob_torch`, `logprob_triton` or `logprob_cute`, all chunked so only O(chunk x V_local) of
logits ever exists):

    m = max_j z_j,  s = sum_j exp(z_j - m),  t = sum_j exp(z_j - m) z_j,  z_label (0 off-shard)

and one MAX all-reduce of m plus one SUM all-reduce of [s e^(m-M), t e^(m-M), z_label] give the global

    lse = M + log S,  mean_z = T / S = E_p[z],  logprob = z_label - lse,  entropy = lse - mean_z.

Backward recomputes each chunk's logits and uses

    dlogprob/dz_j = 1[j == label] - p_j,   dentropy/dz_j = p_j (mean_z - z_j),

so the forward saves only hidden, weight, labels and four fp32 [N] vectors.

Tensor parallelism and gradients: the returned grad of `weight` is exact for this rank's shard. The
returned grad of `hidden` is this rank's PARTIAL sum over its vocab shard, like the input grad of a
column-parallel linear before its all-reduce; a caller holding a replicated `hidden` must all-reduce
it over `tp_group` (Megatron's `copy_to_tensor_model_parallel_region` does exactly this in backward).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable
from types import ModuleType

import torch
import torch.distributed as dist

from rltrain.ops import logprob_invariant, logprob_torch
from rltrain.ops.chunking import pick_chunk_size

__all__ = ["BACKENDS", "logprobs_from_hidden", "logprobs_from_logits", "resolve_backend"]

#: backend name -> module implementing `forward_stats` / `backward` / `is_available` (imported lazily).
BACKENDS: dict[str, str] = {
    "torch": "rltrain.ops.logprob_torch",
    "triton": "rltrain.ops.logprob_triton",
    "cute": "rltrain.ops.logprob_cute",
}
_ALLOWED_BACKENDS = ("auto", *BACKENDS)


#: "auto" on CUDA tries these in order and takes the first available one: the fastest first, as measured on
#: one H100 (docs/benchmarks/kernel.md: CuTe forward 1.2-1.3x faster than Triton's, forward +
#: backward 1-5% faster); "cute" is available on Hopper with the `cute` extra installed.
AUTO_ORDER: tuple[str, ...] = ("cute", "triton")


@functools.cache
def _import_backend(name: str) -> tuple[ModuleType | None, str]:
    """(module, "") when importable and available, else (None, why not)."""
    try:
        module = importlib.import_module(BACKENDS[name])
    except ImportError as exc:  # triton (or the kernel module) not installed
        return None, f"cannot import {BACKENDS[name]}: {exc}"
    if not module.is_available():
        why = getattr(module, "unavailable_reason", lambda: "needs triton and a CUDA device")()
        return None, f"{BACKENDS[name]}.is_available() is False ({why})"
    return module, ""


def resolve_backend(backend: str, device: torch.device) -> ModuleType:
    """The backend module for `backend` ("auto" | a name of BACKENDS) and tensors on `device`.

    "auto" picks the first available of AUTO_ORDER when the tensors are on CUDA, else torch. A named GPU
    backend ("triton", "cute") without CUDA tensors or unavailable raises ValueError."""
    if backend not in _ALLOWED_BACKENDS:
        raise ValueError(f"backend must be one of {list(_ALLOWED_BACKENDS)}, got {backend!r}")
    if backend == "torch":
        return logprob_torch
    if backend == "auto":
        if device.type == "cuda":
            for name in AUTO_ORDER:
                module, _ = _import_backend(name)
                if module is not None:
                    return module
        return logprob_torch
    if device.type != "cuda":
        raise ValueError(
            f"backend={backend!r} needs CUDA tensors, got tensors on {device}; use backend='torch' or 'auto'"
        )
    module, why = _import_backend(backend)
    if module is None:
        raise ValueError(f"backend={backend!r} is unavailable ({why}); use backend='torch' or 'auto'")
    return module


def _tp_rank_world(tp_group) -> tuple[int, int]:
    if tp_group is None:
        return 0, 1
    return dist.get_rank(tp_group), dist.get_world_size(tp_group)


def _combine(m, s, t, z_label, tp_group):
    """Global (logprob, entropy, lse, mean_z), fp32 [N], from this shard's statistics."""
    _, world = _tp_rank_world(tp_group)
    if world > 1:
        m_global = m.clone()
        dist.all_reduce(m_global, op=dist.ReduceOp.MAX, group=tp_group)
        scale = torch.exp(m - m_global)
        packed = torch.stack([s * scale, t * scale, z_label])  # [3, N]
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=tp_group)
        m, (s, t, z_label) = m_global, packed.unbind(0)
    lse = m + torch.log(s)
    mean_z = t / s
    return z_label - lse, lse - mean_z, lse, mean_z


def _row_index(rows, n_tokens: int, device: torch.device, check_bounds: bool = True) -> torch.Tensor | None:
    """rows (None | LongTensor of indices | BoolTensor [T]) -> int64 [N] indices on `device` or None.
    A bool mask costs a host sync (nonzero), as does the range check of indices (check_bounds)."""
    if rows is None:
        return None
    if not isinstance(rows, torch.Tensor):
        raise ValueError(f"rows must be None, an integer index tensor or a bool tensor [T], got {type(rows)}")
    rows = rows.to(device)
    if rows.dtype == torch.bool:
        if rows.shape != (n_tokens,):
            raise ValueError(f"bool rows must have shape [T] = [{n_tokens}], got {list(rows.shape)}")
        return rows.nonzero().squeeze(1)
    if rows.is_floating_point() or rows.is_complex() or rows.dim() != 1:
        raise ValueError(
            f"rows must be a 1-D integer index tensor or a bool tensor [T], got dtype {rows.dtype} "
            f"shape {list(rows.shape)}"
        )
    rows = rows.long()
    if check_bounds and rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= n_tokens):
        raise ValueError(
            f"rows out of range: indices must be in [0, {n_tokens}), got min {int(rows.min())} "
            f"max {int(rows.max())}"
        )
    return rows


def _scatter_rows(values: torch.Tensor, index: torch.Tensor | None, n_tokens: int) -> torch.Tensor:
    """[N] values at `index` of a zero [T] vector (differentiable; the other rows get zero grad)."""
    if index is None:
        return values
    return torch.zeros(n_tokens, dtype=values.dtype, device=values.device).index_copy(0, index, values)


def _local_labels(labels: torch.Tensor, v_local: int, tp_group, check_bounds: bool = True) -> torch.Tensor:
    """Global ids [N] -> ids in this rank's shard [0, V_local), -1 where the label is on another rank; with one
    rank the ids themselves (no kernels before the head's first GEMM). Raises ValueError for labels outside the
    global vocabulary [0, W * V_local) (check_bounds; a host sync); unchecked ones out of it are undefined."""
    rank, world = _tp_rank_world(tp_group)
    v_global = v_local * world
    labels = labels.long()
    if check_bounds and labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= v_global):
        raise ValueError(
            f"labels must be token ids in [0, {v_global}) (vocab size {v_local} x {world} tp ranks), "
            f"got min {int(labels.min())} max {int(labels.max())}; mask padding with `rows` instead"
        )
    if world == 1:
        return labels
    local = labels - rank * v_local
    return torch.where((local >= 0) & (local < v_local), local, -1)


def _check_labels(labels: torch.Tensor, n_tokens: int, device: torch.device) -> None:
    if labels.shape != (n_tokens,):
        raise ValueError(f"labels must have shape [T] = [{n_tokens}], got {list(labels.shape)}")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise ValueError(f"labels must be an integer tensor of token ids, got dtype {labels.dtype}")
    if labels.device != device:
        raise ValueError(f"labels are on {labels.device} but the inputs are on {device}; move them to one device")


def _check_common(temperature: float, chunk_size: int | None) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size <= 0):
        raise ValueError(f"chunk_size must be None or a positive int (tokens per chunk), got {chunk_size!r}")


class _FusedLinearLogprob(torch.autograd.Function):
    """(hidden [N, H], weight [V_local, H], labels_local [N]) -> (logprob fp32 [N], entropy fp32 [N]).
    Saves only the inputs and fp32 [N] lse / mean_z; backward recomputes logits chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, labels_local, backend, tp_group, inv_temp, with_entropy, entropy_grad, chunk_size,
                exact=None):
        m, s, t, z_label = backend.forward_stats(hidden, weight, labels_local, inv_temp, with_entropy, chunk_size)
        logprob, entropy, lse, mean_z = _combine(m, s, t, z_label, tp_group)
        if exact is not None:  # another engine's arithmetic gives the value; the gradient stays this head's
            logprob = exact()
        logprob_torch.save_for_head_backward(ctx, entropy, with_entropy, entropy_grad,
                                             hidden, weight, labels_local, lse, mean_z)
        ctx.backend, ctx.inv_temp, ctx.chunk_size = backend, inv_temp, chunk_size
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_lp, grad_ent):
        hidden, weight, labels_local, lse, mean_z = ctx.saved_tensors
        grads = logprob_torch.head_output_grads(ctx, grad_lp, grad_ent, lse)
        if grads is None:
            return (None,) * 10
        grad_lp, grad_ent = grads
        grad_hidden, grad_weight = ctx.backend.backward(
            hidden,
            weight,
            labels_local,
            lse,
            mean_z,
            grad_lp,
            grad_ent,
            ctx.inv_temp,
            ctx.needs_input_grad[0],
            ctx.needs_input_grad[1],
            ctx.chunk_size,
        )
        if grad_hidden is not None:
            grad_hidden = grad_hidden.to(hidden.dtype)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None


def logprobs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    tp_group=None,
    backend: str = "auto",
    chunk_size: int | None = None,
    rows: torch.Tensor | None = None,
    with_entropy: bool = True,
    entropy_grad: bool = True,
    temperature: float = 1.0,
    check_bounds: bool = True,
    batch_invariant: bool = False,
    top_k: int = -1,
    top_p: float = 1.0,
    exact_logprob: Callable | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log p(label) and entropy of softmax(hidden @ weight.T / temperature), fused with the LM head.

    hidden [T, H] any float dtype (cast to weight.dtype for the GEMMs; its grad is cast back);
    weight [V_local, H] this rank's LM-head shard (rank r of `tp_group` holds global vocab rows
    [r*V_local, (r+1)*V_local)); labels [T] integer global token ids in [0, W*V_local).
    backend: "torch" | "triton" | "cute" | "auto" (AUTO_ORDER's first available for CUDA tensors, else torch).
    chunk_size: tokens per chunk (None: `pick_chunk_size` from a 256 MiB budget, 2 GiB on CUDA).
    rows: None, a 1-D LongTensor of unique row indices, or a BoolTensor [T]: only these rows are
    computed; the others are returned as 0 and get zero gradient.
    with_entropy=False returns None for the entropy and skips its math; entropy_grad=False returns the
    entropy detached (no autograd graph, no entropy work in backward).
    check_bounds=False skips the range checks of labels and integer rows, which read values on the host (a
    device sync each): for callers that validated them already (the Megatron engine checks them on the host
    before the copy). Out-of-range values are then undefined behaviour, as in an unchecked gather.
    batch_invariant: every row's result the same bits whatever the number of rows or the chunking. "torch": the
    arithmetic of ops/invariant.py (logprob_invariant.py; one vocab shard), the rollout engine's under
    rollout.true_on_policy, and the log-prob is of the distribution sampled from: softmax(logits / temperature)
    restricted to the top_k / top_p set (top_k -1: off, top_p 1: off) and renormalized. "triton": one vocab split per
    token block, pointer loads (_TritonInvariant); no top-k / top-p. Backward unchanged.
    exact_logprob: another engine's log-prob of the sampled token, (hidden [c, H], weight, labels [c], temperature)
    -> fp32 [c] (its own kernels: the rollout engine's arithmetic under rollout.true_on_policy), applied in chunks of
    rows and returned as the log-prob; the entropy and the gradient are `backend`'s (one vocab shard; no top-k /
    top-p; not with batch_invariant). Without entropy or a gradient to give, only it runs.

    Returns (logprobs fp32 [T], entropy fp32 [T] over the full global vocabulary, or None).
    Peak extra memory is O(chunk_size x V_local) (torch backend), independent of T. With a tp_group the
    hidden gradient is this rank's partial sum (see the module docstring).
    """
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"hidden must be [T, H] and weight [V_local, H], got shapes {list(hidden.shape)} and {list(weight.shape)}"
        )
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden [T, H] and weight [V_local, H] disagree on H: {hidden.shape[1]} vs {weight.shape[1]}"
        )
    if not hidden.is_floating_point() or not weight.is_floating_point():
        raise ValueError(f"hidden and weight must be floating point, got {hidden.dtype} and {weight.dtype}")
    if weight.device != hidden.device:
        raise ValueError(f"hidden is on {hidden.device} but weight is on {weight.device}; move them to one device")
    n_tokens = hidden.shape[0]
    _check_labels(labels, n_tokens, hidden.device)
    _check_common(temperature, chunk_size)
    module = resolve_backend(backend, hidden.device)
    if batch_invariant:
        module = _batch_invariant(module, tp_group, top_k, top_p)

    index = _row_index(rows, n_tokens, hidden.device, check_bounds)
    if index is not None:
        hidden = hidden.index_select(0, index)
        labels = labels.index_select(0, index)
    labels_local = _local_labels(labels, weight.shape[0], tp_group, check_bounds)
    hidden = hidden.to(weight.dtype)  # the GEMMs' dtype; autograd casts the gradient back
    exact = None if exact_logprob is None else _exact_rows(
        exact_logprob, hidden, weight, labels_local, temperature, chunk_size, tp_group,
        batch_invariant or top_k > 0 or top_p < 1.0)
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if exact is not None and not with_entropy and not needs_grad:
        logprob, entropy = exact(), None
    elif module is None:  # batch-invariant torch: ops/invariant.py's arithmetic
        logprob, entropy = logprob_invariant.invariant_logprobs(
            hidden, weight, labels_local, temperature=temperature, top_k=top_k, top_p=top_p,
            with_entropy=with_entropy, entropy_grad=entropy_grad, chunk_size=chunk_size)
    else:
        logprob, entropy = _FusedLinearLogprob.apply(
            hidden, weight, labels_local, module, tp_group, 1.0 / temperature, with_entropy, entropy_grad, chunk_size,
            exact)
    logprob = _scatter_rows(logprob, index, n_tokens)
    if not with_entropy:
        return logprob, None
    return logprob, _scatter_rows(entropy, index, n_tokens)


def _exact_rows(fn: Callable, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float,
                chunk_size: int | None, tp_group, filtered: bool) -> Callable[[], torch.Tensor]:
    """logprobs_from_hidden's exact_logprob over the rows in chunks of one [chunk, V] logits buffer, deferred."""
    if _tp_rank_world(tp_group)[1] > 1:
        raise ValueError("exact_logprob needs one vocab shard (a tp_group of 1 rank)")
    if filtered:
        raise ValueError("exact_logprob computes the full distribution's log-prob: no batch_invariant, top_k or top_p")
    chunk = chunk_size or pick_chunk_size(hidden.shape[0], weight.shape[0], weight.dtype, device=hidden.device)

    def run() -> torch.Tensor:
        with torch.no_grad():
            parts = [fn(hidden[i:i + chunk], weight, labels[i:i + chunk], temperature).float()
                     for i in range(0, hidden.shape[0], chunk)]
        return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)
    return run


def _batch_invariant(module: ModuleType, tp_group, top_k: int, top_p: float):
    """The backend of logprobs_from_hidden(batch_invariant=True): None for torch (logprob_invariant's path), a
    batch-invariant view of the Triton backend; ValueError where neither applies."""
    if module is logprob_torch:
        if _tp_rank_world(tp_group)[1] > 1:
            raise ValueError("batch_invariant=True on the torch backend needs one vocab shard (tp_group of 1 rank)")
        return None
    if module.__name__.endswith("logprob_triton"):
        if top_k > 0 or top_p < 1.0:
            raise ValueError("batch_invariant=True with top_k / top_p needs backend='torch'")
        return _TritonInvariant(module)
    raise ValueError(f"batch_invariant=True is not available on backend {module.__name__}; use 'torch' or 'triton'")


class _TritonInvariant:
    """logprob_triton's forward in one vocab split per token block (each program walks the whole vocab in tile
    order: nothing is merged across programs, whose split count would follow the number of token blocks) and with
    pointer loads (TMA's use depends on the rows' alignment); the backward is unchanged."""

    def __init__(self, module: ModuleType):
        self.module, self.backward = module, module.backward
        self.tuning = dataclasses.replace(module.DEFAULT_TUNING, use_desc=False)

    def forward_stats(self, *args):
        return self.module.forward_stats(*args, num_splits=1, tuning=self.tuning)


def _logits_chunk_fp32(logits_c: torch.Tensor, inv_temp: float) -> tuple[torch.Tensor, bool]:
    """(fp32 logits / temperature of one chunk, whether it is a fresh buffer we may overwrite)."""
    if logits_c.dtype == torch.float32:
        if inv_temp == 1.0:
            return logits_c, False  # a view of the caller's (and autograd's saved) tensor: read only
        return logits_c * inv_temp, True
    z = logits_c.float()
    if inv_temp != 1.0:
        z.mul_(inv_temp)
    return z, True


class _LogitsLogprob(torch.autograd.Function):
    """(logits [N, V_local], labels_local [N]) -> (logprob fp32 [N], entropy fp32 [N]), chunked over
    tokens with fp32 math. Never writes into `logits` (autograd may have saved it elsewhere)."""

    @staticmethod
    def forward(ctx, logits, labels_local, tp_group, inv_temp, with_entropy, entropy_grad, chunk_size):
        n = logits.shape[0]
        stats = torch.empty(4, n, dtype=torch.float32, device=logits.device)  # m, s, t, z_label
        for start in range(0, n, chunk_size):
            stop = min(start + chunk_size, n)
            z, _ = _logits_chunk_fp32(logits[start:stop], inv_temp)
            for i, value in enumerate(logprob_torch.logit_stats(z, labels_local[start:stop], with_entropy)):
                stats[i, start:stop] = value
            del z
        logprob, entropy, lse, mean_z = _combine(stats[0], stats[1], stats[2], stats[3], tp_group)
        logprob_torch.save_for_head_backward(ctx, entropy, with_entropy, entropy_grad, logits, labels_local, lse, mean_z)
        ctx.inv_temp, ctx.chunk_size = inv_temp, chunk_size
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_lp, grad_ent):
        logits, labels_local, lse, mean_z = ctx.saved_tensors
        grads = logprob_torch.head_output_grads(ctx, grad_lp, grad_ent, lse)
        if grads is None or not ctx.needs_input_grad[0]:
            return (None,) * 7
        grad_lp, grad_ent = grads
        n, chunk, inv_temp = logits.shape[0], ctx.chunk_size, ctx.inv_temp

        def chunk_grad(start: int, stop: int) -> torch.Tensor:
            z, owned = _logits_chunk_fp32(logits[start:stop], inv_temp)
            dz = logprob_torch.grad_logits_inplace(
                z,
                owned,
                labels_local[start:stop],
                lse[start:stop],
                mean_z[start:stop],
                grad_lp[start:stop],
                None if grad_ent is None else grad_ent[start:stop],
            )
            if inv_temp != 1.0:
                dz.mul_(inv_temp)
            return dz  # fp32 [stop - start, V_local]

        if chunk >= n:  # one chunk covers everything: the probabilities buffer IS the gradient
            return (chunk_grad(0, n).to(logits.dtype),) + (None,) * 6
        grad_logits = torch.empty_like(logits)
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            grad_logits[start:stop] = chunk_grad(start, stop)
        return (grad_logits,) + (None,) * 6


def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    tp_group=None,
    chunk_size: int | None = None,
    rows: torch.Tensor | None = None,
    with_entropy: bool = True,
    entropy_grad: bool = True,
    temperature: float = 1.0,
    check_bounds: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log p(label) and entropy from already computed logits [T, V_local] (the unfused path for models
    that must emit logits). Vocab-parallel over `tp_group` like `logprobs_from_hidden`, chunked over
    tokens with fp32 math; the backward adds the chosen-token term with `scatter_add_` and never writes
    into `logits`. Same `rows`, `with_entropy`, `entropy_grad`, `temperature`, `check_bounds` semantics.

    Returns (logprobs fp32 [T], entropy fp32 [T] or None). The logits grad is exact for this shard.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, V_local], got shape {list(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    n_tokens = logits.shape[0]
    _check_labels(labels, n_tokens, logits.device)
    _check_common(temperature, chunk_size)
    index = _row_index(rows, n_tokens, logits.device, check_bounds)
    if index is not None:
        logits = logits.index_select(0, index)
        labels = labels.index_select(0, index)
    v_local = logits.shape[1]
    labels_local = _local_labels(labels, v_local, tp_group, check_bounds)
    chunk = chunk_size or pick_chunk_size(logits.shape[0], v_local, logits.dtype, device=logits.device)
    logprob, entropy = _LogitsLogprob.apply(
        logits, labels_local, tp_group, 1.0 / temperature, with_entropy, entropy_grad, chunk
    )
    logprob = _scatter_rows(logprob, index, n_tokens)
    if not with_entropy:
        return logprob, None
    return logprob, _scatter_rows(entropy, index, n_tokens)
