"""The fused LM head: makes GPTModel's output layer return final hidden states instead of logits,
and computes per-token log-probs/entropy with rltrain.ops. It must not build or train models.

`set_head_mode(model, mode)` switches the (kept, same-named) output layer between:
- "logits": megatron's ColumnParallelLinear, vocab-parallel logits [b, s, V_local] (unfused path).
- "hidden": final hidden states [b, s, H] ready for a vocab-parallel loss: without sequence
  parallelism passed through megatron's copy-to-TP-region (identity forward, all-reduce of the
  partial hidden grads that ops returns in backward); with sequence parallelism all-gathered
  along the sequence (reduce-scatter backward). Paired with `lm_head_weight(model)`, the shard
  [V_local, H] of the output layer or of the tied embedding.
- "hidden_replicated": same hidden states for a replicated consumer (critic value head): every
  TP rank computes the same loss, so no gradient reduction.

Padded vocab rows (megatron pads V to a multiple of make_vocab_size_divisible_by * tp) never count:
the unfused path sets their logits to -1e30 before the softmax, and the fused path appends a
constant input column whose weight is -1e30 for padded rows (0 for real ones), which gives the
same logits without touching the ops API. That copy of the weight shard happens only on ranks
that hold padded rows; with no padding the weight is passed as is.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

HEAD_MODES = ("logits", "hidden", "hidden_replicated")
_PAD_LOGIT = -1e30  # exp(_PAD_LOGIT - max) == 0 in fp32; finite so 0 * logit stays 0 in entropy


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (also before moe.py's grouped expert GEMMs,
    whose backward rejects an expanded gradient). GPTModel transposes our
    [s, b, H] output to [b, s, H], so the gradient reaching the TP region op is a transposed view,
    and megatron's in-place all-reduce of a non-contiguous gradient is silently lost on gloo."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


class _SwitchableOutputLayer(ColumnParallelLinear):
    """ColumnParallelLinear whose forward can return the hidden states instead (see module doc)."""

    head_mode: str = "logits"

    def forward(self, input_, weight=None, runtime_gather_output=None):
        if self.head_mode == "logits":
            return super().forward(input_, weight=weight, runtime_gather_output=runtime_gather_output)
        vocab_parallel = self.head_mode == "hidden"
        if self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(
                input_, tensor_parallel_output_grad=vocab_parallel, group=self.tp_group
            )
        elif vocab_parallel:
            hidden = copy_to_tensor_model_parallel_region(input_, group=self.tp_group)
        else:
            hidden = input_
        return _ContiguousGrad.apply(hidden), None


def set_head_mode(model, mode: str) -> None:
    """Switch the output layer of a last-stage GPTModel to `mode` (one of HEAD_MODES)."""
    if mode not in HEAD_MODES:
        raise ValueError(f"head mode must be one of {HEAD_MODES}, got {mode!r}")
    layer = model.output_layer
    if type(layer) is ColumnParallelLinear:
        # Same object, same parameter names; only forward changes.
        layer.__class__ = _SwitchableOutputLayer
    assert isinstance(layer, _SwitchableOutputLayer), type(layer)
    layer.head_mode = mode


def attach_value_head(model, hidden_size: int, *, dtype: torch.dtype, device, seed: int) -> None:
    """The critic's last stage: a value head h -> 1 (the same init on every TP rank: replicated) in place of the LM
    head, whose weight is dropped when untied (frees [V, H]); the output layer returns the gathered hidden states."""
    gen = torch.Generator().manual_seed(seed + 17)
    value_head = torch.nn.Linear(hidden_size, 1, dtype=dtype)
    with torch.no_grad():
        value_head.weight.copy_(torch.randn(value_head.weight.shape, generator=gen) * 0.02)
        value_head.bias.zero_()
    model.value_head = value_head.to(device)
    if not model.share_embeddings_and_output_weights:
        model.output_layer.weight = None
    set_head_mode(model, "hidden_replicated")


def lm_head_weight(model) -> torch.Tensor:
    """This rank's LM-head shard [V_local_padded, H] (tied embedding or output layer)."""
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


def _local_real_rows(model, v_local: int) -> int:
    rank = parallel_state.get_tensor_model_parallel_rank()
    return max(0, min(v_local, model.real_vocab_size - rank * v_local))


def _tp_group():
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return None
    return parallel_state.get_tensor_model_parallel_group()


def fused_logprobs(
    model,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    *,
    rows: torch.Tensor | None = None,
    with_entropy: bool = True,
    entropy_grad: bool = True,
    temperature: float = 1.0,
    backend: str = "auto",
    chunk_size: int | None = None,
    check_bounds: bool = True,
    sampled: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden [N, H] (from "hidden" mode), labels [N] -> fp32 log p(label) [N], entropy [N] | None.

    Never builds [N, V] logits: ops.logprobs_from_hidden recomputes chunks of logits in backward.
    sampled: (top_k, top_p, exact_logprob) of rollout.true_on_policy, whose log-probs are the rollout engine's to the
    bit, over the real vocab rows only: exact_logprob, the engine's own kernels for the value (the entropy and the
    gradient the fused head's on `backend`: ops.logprobs_from_hidden(exact_logprob=...)), or None: the head's
    batch-invariant mode on the torch backend (ops/invariant.py's arithmetic, the hf engine's).
    """
    from rltrain.ops import logprobs_from_hidden

    weight = lm_head_weight(model)  # [V_local, H]
    v_local = weight.shape[0]
    real = _local_real_rows(model, v_local)
    if sampled is not None:  # the padded rows are left out (a constant column would change the exact products)
        top_k, top_p, exact = sampled
        mode = dict(backend=backend, exact_logprob=exact) if exact is not None else dict(
            backend="torch", batch_invariant=True, top_k=top_k, top_p=top_p)
        return logprobs_from_hidden(
            hidden, weight[:real], labels, tp_group=_tp_group(), chunk_size=chunk_size, rows=rows,
            with_entropy=with_entropy, entropy_grad=entropy_grad, temperature=temperature, check_bounds=check_bounds,
            **mode)
    if real < v_local:
        bias = torch.zeros(v_local, 1, dtype=weight.dtype, device=weight.device)
        bias[real:] = _PAD_LOGIT
        weight = torch.cat([weight, bias], dim=1)  # [V_local, H + 1]
        hidden = torch.cat([hidden, hidden.new_ones(hidden.shape[0], 1)], dim=1)  # [N, H + 1]
    return logprobs_from_hidden(
        hidden, weight, labels, tp_group=_tp_group(), backend=backend, chunk_size=chunk_size,
        rows=rows, with_entropy=with_entropy, entropy_grad=entropy_grad, temperature=temperature,
        check_bounds=check_bounds,
    )


def unfused_logprobs(
    model,
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    rows: torch.Tensor | None = None,
    with_entropy: bool = True,
    entropy_grad: bool = True,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    check_bounds: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [N, V_local_padded] (from "logits" mode), labels [N] -> like fused_logprobs."""
    from rltrain.ops import logprobs_from_logits

    v_local = logits.shape[-1]
    real = _local_real_rows(model, v_local)
    if real < v_local:
        pad = torch.arange(v_local, device=logits.device) >= real
        logits = logits.masked_fill(pad, _PAD_LOGIT)
    return logprobs_from_logits(
        logits, labels, tp_group=_tp_group(), chunk_size=chunk_size, rows=rows,
        with_entropy=with_entropy, entropy_grad=entropy_grad, temperature=temperature, check_bounds=check_bounds,
    )
