"""What crosses between a model engine's train step and the caller's loss: the typed micro-batch, the model's
outputs and the loss-function protocol. Generic: nothing here knows an algorithm (models/ knows no RL); the
caller's loss (workers/) carries its own per-row tensors through the engine in `MicroBatch.extras`, unread.

Shapes: b rows of a micro-batch, s = the micro-batch's width (its longest row); right-padded rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, Union, runtime_checkable

import torch
from torch import Tensor

__all__ = ["MicroBatch", "ModelOutputs", "LossFn", "LossResult", "as_micro_batch", "as_outputs"]


@dataclass
class MicroBatch:
    """One micro-batch of the train step (models/megatron/micro_batch.py makes them from a batch)."""

    input_ids: Tensor  # [b, s] long, right-padded token ids
    seq_lens: Tensor  # [b] long, real length of each row (<= s)
    label_mask: Tensor | None = None  # [b, s] bool: the positions whose log-prob / value is computed (t >= 1)
    sample_idx: Tensor | None = None  # [b] long, the rows' indices in the batch they were cut from
    loss_scale: float | None = None  # the micro-batch's share of the step's loss; None: 1 / number of micro-batches
    routed_experts: Tensor | None = None  # [b, s, L, k] expert ids the MoE layers route each token to (routing replay)
    extras: dict[str, Tensor] = field(default_factory=dict)  # the loss's own per-row tensors, [b, s] or [b, ...];
    #                                                          the engine trims and moves them, never reads them

    FIELDS = ("input_ids", "seq_lens", "label_mask", "sample_idx", "loss_scale", "routed_experts")

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> MicroBatch:
        """A micro-batch from the flat dict layout (tools and tests build those by hand): the named fields are
        taken by name, every other entry goes to `extras`."""
        if "input_ids" not in d or "seq_lens" not in d:
            raise ValueError(f"a micro-batch needs 'input_ids' [b, s] and 'seq_lens' [b]; got keys {sorted(d)}")
        scale = d.get("loss_scale")
        return cls(input_ids=d["input_ids"], seq_lens=torch.as_tensor(d["seq_lens"]).long(),
                   label_mask=d.get("label_mask"), sample_idx=d.get("sample_idx"),
                   loss_scale=None if scale is None else float(scale), routed_experts=d.get("routed_experts"),
                   extras={k: v for k, v in d.items() if k not in cls.FIELDS})


def as_micro_batch(mb: MicroBatch | Mapping[str, Any]) -> MicroBatch:
    """`mb` itself, or the MicroBatch of a flat dict (`MicroBatch.from_mapping`)."""
    return mb if isinstance(mb, MicroBatch) else MicroBatch.from_mapping(mb)


@dataclass
class ModelOutputs:
    """The engine's outputs for one micro-batch, fp32 on the engine's device; entry t is about token t given
    tokens < t, 0 at t = 0 and outside label_mask."""

    logprobs: Tensor | None = None  # [b, s] log p(x_t | x_<t) at the given temperature (log-prob models)
    entropy: Tensor | None = None  # [b, s] entropy of that distribution; carries grad iff loss_fn.needs_entropy_grad
    values: Tensor | None = None  # [b, s] V(x_<t) (value models)


def as_outputs(out: ModelOutputs | Mapping[str, Tensor]) -> ModelOutputs:
    """`out` itself, or the ModelOutputs of a {"logprobs": ..., "entropy": ..., "values": ...} dict."""
    if isinstance(out, ModelOutputs):
        return out
    unknown = set(out) - {"logprobs", "entropy", "values"}
    if unknown:
        raise ValueError(f"model outputs are logprobs, entropy and values; got {sorted(unknown)}")
    return ModelOutputs(**out)


LossResult = tuple[Tensor, Mapping[str, Union[Tensor, float]]]  # (loss 0-dim, metrics: floats or 0-dim tensors)


@runtime_checkable
class LossFn(Protocol):
    """The caller's loss of one micro-batch, called by the engine's train step:
    loss_fn(outputs, mb) -> (loss 0-dim with grad, metrics). The engine scales the loss by mb.loss_scale before
    backward and averages the metrics over the micro-batches."""

    needs_entropy_grad: bool  # True: outputs.entropy carries a gradient (an entropy bonus); False saves the pass

    def __call__(self, outputs: ModelOutputs, mb: MicroBatch) -> LossResult: ...
