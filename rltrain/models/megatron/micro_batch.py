"""Micro-batching of the engine's batches: rows grouped by length under a token budget (rows x longest row), so
padding stays small and no varlen kernels are needed (docs/megatron_backend.md). Pure tensor indexing: no model.
"""

from __future__ import annotations

import torch

from rltrain.models.loss_protocol import MicroBatch


def make_micro_batches(tensors: dict[str, torch.Tensor], seq_lens: torch.Tensor, max_tokens: int) -> list[MicroBatch]:
    """Split a batch into length-grouped micro-batches of at most max_tokens
    padded tokens (rows x longest row; a single longer row gets a micro-batch of its own).

    tensors: name -> [B, ...]; those with a second dim equal to input_ids' S are trimmed to the
    micro-batch's longest row. `input_ids`, `label_mask` and `routed_experts` become the MicroBatch's fields of those
    names, every other tensor (but a `seq_lens` entry, which is the argument's) goes to its `extras` under its name. Each
    micro-batch also carries `seq_lens` [b] and `sample_idx` [b] (row indices into the batch). Rows are ordered
    longest first.
    """
    seq_lens = torch.as_tensor(seq_lens).long().cpu()
    if "input_ids" not in tensors:
        raise ValueError("make_micro_batches needs tensors['input_ids'] [B, S]")
    B, S = tensors["input_ids"].shape
    if seq_lens.shape != (B,) or int(seq_lens.min()) < 1 or int(seq_lens.max()) > S:
        raise ValueError(f"seq_lens must be [B]={B} values in [1, {S}], got {seq_lens.tolist()}")
    order = torch.argsort(seq_lens, descending=True, stable=True).tolist()
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * int(seq_lens[groups[-1][0]]) <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    micro_batches = []
    for g in groups:
        idx = torch.tensor(g, dtype=torch.long)
        width = int(seq_lens[g[0]])
        rows: dict[str, torch.Tensor] = {}
        for k, v in tensors.items():
            if not torch.is_tensor(v) or v.dim() == 0 or v.shape[0] != B:
                raise ValueError(f"tensors[{k!r}] must be a tensor with first dim B={B}")
            if k == "seq_lens":
                continue
            v = v[idx.to(v.device)]
            rows[k] = v[:, :width] if v.dim() >= 2 and v.shape[1] == S else v
        input_ids, label_mask = rows.pop("input_ids"), rows.pop("label_mask", None)
        micro_batches.append(MicroBatch(input_ids=input_ids, seq_lens=seq_lens[idx], label_mask=label_mask,
                                        sample_idx=idx, routed_experts=rows.pop("routed_experts", None), extras=rows))
    return micro_batches
