"""Mixture-of-Experts tensors in their two Hugging Face layouts: as published checkpoints store them (one tensor per
expert: `model.layers.{i}.mlp.experts.{j}.gate_proj.weight`, `up_proj`, `down_proj`) and as transformers 5 holds
them in memory (Qwen3-MoE: `model.layers.{i}.mlp.experts.gate_up_proj` [E, 2I, H] with each expert's gate rows
first, `mlp.experts.down_proj` [E, H, I]). transformers converts on load and back on save; the checkpoint layout is
the one every reader takes (transformers, vLLM's load_weights), so it is the one rltrain exports and streams.

No torch modules, no Megatron: names and views only. Used by the Megatron weight loader (a state dict in the
in-memory layout), the HF export's name check and the HF rollout engine's weight update.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping

import torch

# fused in-memory parameter -> the per-expert checkpoint projections it holds, in row order
FUSED = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
_FUSED_NAME = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def _is_fused(name: str, tensor_dim: int) -> re.Match | None:
    m = _FUSED_NAME.match(name)
    return m if m and tensor_dim == 3 else None


def per_expert_views(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, view) of each expert's projections in a fused in-memory tensor; the tensor itself (one
    pair) when `name` is not a fused expert tensor. Views share storage: copying into them writes the fused one."""
    m = _is_fused(name, tensor.dim())
    if m is None:
        yield name, tensor
        return
    parts = FUSED[m["kind"]]
    for j in range(tensor.shape[0]):
        for p, view in zip(parts, tensor[j].chunk(len(parts), dim=0)):
            yield f"{m['prefix']}.{j}.{p}.weight", view


def checkpoint_names(named_shapes: Iterable[tuple[str, torch.Size | tuple]]) -> list[str]:
    """The checkpoint names of a model's in-memory (name, shape) pairs (fused experts expanded per expert)."""
    out = []
    for name, shape in named_shapes:
        m = _is_fused(name, len(shape))
        if m is None:
            out.append(name)
        else:
            out.extend(f"{m['prefix']}.{j}.{p}.weight" for j in range(shape[0]) for p in FUSED[m["kind"]])
    return out


class CheckpointLayout(Mapping):
    """A read-only mapping in the checkpoint layout over a state dict that may hold fused expert tensors (views,
    no copies: per_expert_views); other names pass through."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor]):
        self._views = dict(pair for name in state_dict.keys() for pair in per_expert_views(name, state_dict[name]))

    @staticmethod
    def needed(state_dict: Mapping[str, torch.Tensor]) -> bool:
        return any(_FUSED_NAME.match(k) for k in state_dict.keys())

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._views[key]

    def __iter__(self):
        return iter(self._views)

    def __len__(self) -> int:
        return len(self._views)
