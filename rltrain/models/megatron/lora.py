"""LoRA on the Megatron actor: PEFT's adapters (q/k/v/o_proj, gate/up/down_proj; models/lora.py) on megatron's fused
linear layers, tensor- and pipeline-parallel, the base frozen. It must not train (the engine's optimizer takes the
adapters, the only parameters left trainable) nor know what the rollout engine does with them.

Where each PEFT adapter sits, with y = x W^T of the fused layer and s = alpha / r:
- linear_qkv (column-parallel, megatron's per-group layout [q heads of g; k_g; v_g]): q_proj, k_proj, v_proj each
  with its own A [r, h] and B [rows, r] acting on its slice of the fused output (the rows of B_q land on the q rows
  of every group, B_k on the k row block, ...). linear_fc1 (column-parallel, [gate; up] per rank): gate_proj,
  up_proj likewise. The delta is (x A_cat^T) B_fused^T: A_cat stacks the parts' A [P r, h]; B_fused [out_local, P r]
  holds part p's B in columns p r .. (p+1) r at its rows, zeros elsewhere (built each forward from the B's: tiny).
- linear_proj (o_proj) and linear_fc2 (down_proj), row-parallel: one A, B each.

Tensor parallelism, as the base layer is split: column-parallel base -> B split on its output rows (each rank's rows of
its heads / ffn block), A whole on every rank; h = x A^T goes through megatron's copy-to-TP region, whose backward
sums dL/dh over the ranks (each rank's B sees only its rows), so A's grad and the input's grad are whole everywhere.
Row-parallel base -> A split on its input columns, B whole; h = x_local A_local^T is all-reduced (megatron's
reduce-from-TP region) before B. Split params carry megatron's `tensor_model_parallel` mark (the grad norm sums
them over the ranks, counts the whole ones once). Pipeline parallelism: a stage holds its layers' adapters; the
export merges the stages (pipeline.merge_stages).

Init (PEFT's): A uniform in +-1/sqrt(in) from a generator seeded by (seed, layer, target), drawn whole on every rank
and then sliced, so every TP layout starts from the same adapters; B = 0 (the adapted model starts as the base).
The adapters are in the params' dtype (bf16 on GPU; the optimizer steps fp32 masters of them, models/megatron/
optim.py). Dropout acts on the adapters' input in training (under TP each rank draws its own mask for its slice of
a row-parallel input: the same distribution as one mask, not the same draws as TP=1).

Refused (UnsupportedModelError): MLP targets on a Mixture-of-Experts block (adapters on experts are not built; target
the attention), Transformer Engine's fused layer-norm linears, sequence parallelism. The LM head and the embedding
are never adapted: the fused head is unchanged. With the base frozen nothing upstream of the first layer needs a
grad, so the embedding's output is marked as requiring one (an activation-recomputed layer passes grads to the
adapters inside it only when its input requires grad).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    reduce_from_tensor_model_parallel_region)
from megatron.core.transformer.mlp import MLP

from rltrain.models.lora import LORA_TARGETS, LoraSpec, adapter_name
from rltrain.models.megatron import weights as weights_mod
from rltrain.models.megatron.build import UnsupportedModelError

# megatron linear (path in the layer) -> (parallel kind, its PEFT targets in the fused order)
LINEARS = {
    "self_attention.linear_qkv": ("column", ("q_proj", "k_proj", "v_proj")),
    "self_attention.linear_proj": ("row", ("o_proj",)),
    "mlp.linear_fc1": ("column", ("gate_proj", "up_proj")),
    "mlp.linear_fc2": ("row", ("down_proj",)),
}
ATTR = weights_mod.ADAPTER_ATTR  # the adapters' submodule name in each linear (weights.py skips its params)


def _hf_dims(cfg, target: str) -> tuple[int, int]:
    """(out, in) of a target's HF weight, from megatron's TransformerConfig."""
    h, hn = cfg.hidden_size, cfg.kv_channels
    q, kv, ffn = cfg.num_attention_heads * hn, cfg.num_query_groups * hn, cfg.ffn_hidden_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (ffn, h),
            "up_proj": (ffn, h), "down_proj": (h, ffn)}[target]


def _fused_rows(cfg, target: str, tp: int) -> torch.Tensor:
    """The rows of this rank's fused output (linear_qkv or linear_fc1) that a column part's local B feeds, in the
    order of B's local rows (HF order: head-major for q, group-major for k/v)."""
    if target in ("gate_proj", "up_proj"):
        ffn_local = cfg.ffn_hidden_size // tp
        return torch.arange(ffn_local) + (ffn_local if target == "up_proj" else 0)
    hn, ng = cfg.kv_channels, cfg.num_query_groups // tp
    per = cfg.num_attention_heads // cfg.num_query_groups
    slot = {"q_proj": torch.arange(per), "k_proj": torch.tensor([per]), "v_proj": torch.tensor([per + 1])}[target]
    rows = (torch.arange(ng)[:, None] * (per + 2) + slot[None, :])  # [ng, heads of the part]
    return (rows[:, :, None] * hn + torch.arange(hn)).reshape(-1)


class LinearAdapters(torch.nn.Module):
    """The adapters of one megatron linear: A_<target> and B_<target> per part, and forward(x) -> the delta."""

    def __init__(self, cfg, kind: str, targets: tuple[str, ...], spec: LoraSpec, *, layer: int, seed: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.kind, self.targets, self.scale, self.layer = kind, targets, spec.scale, layer
        self.enabled = True
        self.dropout = torch.nn.Dropout(spec.dropout) if spec.dropout else torch.nn.Identity()
        tp, rank, r = (parallel_state.get_tensor_model_parallel_world_size(),
                       parallel_state.get_tensor_model_parallel_rank(), spec.rank)
        for target in targets:
            out_dim, in_dim = _hf_dims(cfg, target)
            gen = torch.Generator().manual_seed(seed * 1_000_003 + layer * 97 + LORA_TARGETS.index(target))
            a = (torch.rand(r, in_dim, generator=gen, dtype=torch.float64) * 2 - 1) / math.sqrt(in_dim)
            b = torch.zeros(out_dim, r, dtype=torch.float64)
            a, b = (a, b.chunk(tp, dim=0)[rank]) if kind == "column" else (a.chunk(tp, dim=1)[rank], b)
            for name, t, split in ((f"A_{target}", a, kind == "row"), (f"B_{target}", b, kind == "column")):
                p = torch.nn.Parameter(t.to(device=device, dtype=dtype).contiguous())
                p.tensor_model_parallel = split and tp > 1  # the grad norm sums split params over the TP ranks
                p.partition_dim = 1 if kind == "row" else 0
                self.register_parameter(name, p)
            if kind == "column":
                self.register_buffer(f"rows_{target}", _fused_rows(cfg, target, tp).to(device), persistent=False)

    def forward(self, x: torch.Tensor, out_local: int) -> torch.Tensor:
        """x: the base linear's input [s, b, in(_local)] -> the delta of its output [s, b, out_local]."""
        x = self.dropout(x)
        a = torch.cat([getattr(self, f"A_{t}") for t in self.targets]) if len(self.targets) > 1 \
            else getattr(self, f"A_{self.targets[0]}")
        h = F.linear(x, a)  # [s, b, P r]
        if self.kind == "row":
            h = reduce_from_tensor_model_parallel_region(h)  # partial sums over the input split
            return F.linear(h, getattr(self, f"B_{self.targets[0]}")) * self.scale
        h = copy_to_tensor_model_parallel_region(h)  # backward: dL/dh summed over the ranks' output rows
        cols = []
        for t in self.targets:
            b = getattr(self, f"B_{t}")  # [rows of t on this rank, r]
            cols.append(b.new_zeros(out_local, b.shape[1]).index_copy(0, getattr(self, f"rows_{t}"), b))
        return F.linear(h, torch.cat(cols, dim=1)) * self.scale

    def local_named(self) -> Iterator[tuple[str, str, torch.nn.Parameter]]:
        """(PEFT name, "A" | "B", this rank's shard) of each of its tensors."""
        for t in self.targets:
            for which in ("A", "B"):
                yield adapter_name(self.layer, t, which), which, getattr(self, f"{which}_{t}")


def _hook(module, args, kwargs, output):
    """The base linear's forward hook: (y, bias) -> (y + delta, bias) while the adapters are enabled."""
    adapters = getattr(module, ATTR)
    if not adapters.enabled:
        return output
    y, bias = output
    x = args[0] if args else kwargs["input_"]
    return y + adapters(x, y.shape[-1]).to(y.dtype), bias


class LoraAdapters:
    """The actor model's adapters on this rank (its pipeline stage's layers, its TP shards): attached at build, the
    base frozen. Enable/disable (`disabled()`: the reference is the base), export / load by PEFT names, the
    checkpoint's state (adapters only)."""

    def __init__(self, model, spec: LoraSpec, *, seed: int):
        cfg = model.config
        if cfg.sequence_parallel:
            raise UnsupportedModelError("actor.lora.rank > 0 with sequence parallelism (a Mixture-of-Experts model "
                                        "under tensor parallelism with Transformer Engine) is not supported; use "
                                        "actor.tensor_parallel_size=1 or full fine-tuning (actor.lora.rank=0)")
        self.model, self.spec = model, spec
        model.requires_grad_(False)
        offset = weights_mod.layer_offset(model)
        self.linears: list[LinearAdapters] = []
        dtype, device = next(model.parameters()).dtype, next(model.parameters()).device
        for i, layer in enumerate(model.decoder.layers):
            for path, (kind, parts) in LINEARS.items():
                targets = tuple(t for t in parts if t in spec.targets)
                if not targets:
                    continue
                block, _, name = path.partition(".")
                if block == "mlp" and not isinstance(layer.mlp, MLP):
                    raise UnsupportedModelError(
                        f"actor.lora.target_modules has {list(targets)} but layer {offset + i} is a Mixture-of-"
                        "Experts block: adapters on experts are not built; target the attention only "
                        "(actor.lora.target_modules=[q_proj,k_proj,v_proj,o_proj])")
                linear = getattr(getattr(layer, block), name)
                want = ColumnParallelLinear if kind == "column" else RowParallelLinear
                if not isinstance(linear, want):
                    raise UnsupportedModelError(
                        f"actor.lora.rank > 0 needs megatron's local layer spec; layer {offset + i}'s {path} is "
                        f"{type(linear).__name__} (Transformer Engine fuses the layer norm into it): uninstall "
                        "transformer_engine or use full fine-tuning (actor.lora.rank=0)")
                adapters = LinearAdapters(cfg, kind, targets, spec, layer=offset + i, seed=seed, dtype=dtype,
                                          device=device)
                setattr(linear, ATTR, adapters)  # a submodule: model.parameters() holds the adapters
                linear.register_forward_hook(_hook, with_kwargs=True)
                self.linears.append(adapters)
        if getattr(model, "pre_process", False):  # grads must reach recomputed layers' adapters (docstring)
            model.embedding.register_forward_hook(_needs_grad)

    @contextlib.contextmanager
    def disabled(self):
        """The base model inside the block (the reference role's forward)."""
        for a in self.linears:
            a.enabled = False
        try:
            yield
        finally:
            for a in self.linears:
                a.enabled = True

    def num_params(self) -> int:
        """Adapter parameters on this rank."""
        return sum(p.numel() for a in self.linears for p in a.parameters())

    @torch.no_grad()
    def export(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(PEFT name, full tensor) of this stage's adapters, gathered over TP. Collective over the TP group."""
        tp = parallel_state.get_tensor_model_parallel_world_size()
        for a in self.linears:
            for name, which, p in a.local_named():
                split = (which == "B") == (a.kind == "column")
                if tp > 1 and split:
                    shards = weights_mod.all_gather(p.detach(), parallel_state.get_tensor_model_parallel_group())
                    yield name, torch.cat(shards, dim=0 if a.kind == "column" else 1)
                else:
                    yield name, p.detach().clone()

    @torch.no_grad()
    def load(self, named: Mapping[str, torch.Tensor]) -> None:
        """Copy full PEFT-named tensors into this rank's shards (the other stages' names are skipped)."""
        tp = parallel_state.get_tensor_model_parallel_world_size()
        rank = parallel_state.get_tensor_model_parallel_rank()
        for a in self.linears:
            for name, which, p in a.local_named():
                if name not in named:
                    raise KeyError(f"adapter tensor {name} is missing (targets {list(self.spec.targets)}, rank "
                                   f"{self.spec.rank})")
                t = named[name]
                if (which == "B") == (a.kind == "column"):
                    t = t.chunk(tp, dim=0 if a.kind == "column" else 1)[rank]
                if tuple(t.shape) != tuple(p.shape):
                    raise ValueError(f"adapter tensor {name}: shard {tuple(t.shape)}, expected {tuple(p.shape)}")
                p.copy_(t)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's adapter shards by megatron parameter name (a checkpoint's model part)."""
        return {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}

    def load_state_dict(self, sd: Mapping[str, torch.Tensor]) -> None:
        params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        shapes = {n: tuple(p.shape) for n, p in params.items()} != {n: tuple(t.shape) for n, t in sd.items()}
        if shapes:
            raise ValueError(f"the checkpoint's adapters do not match this model's: missing "
                             f"{sorted(set(params) - set(sd))[:4]}, unexpected {sorted(set(sd) - set(params))[:4]}, "
                             "or other shapes (was it saved with other actor.lora.* or parallel sizes?)")
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(sd[n])


def _needs_grad(module, args, output):
    if torch.is_grad_enabled() and not output.requires_grad:
        return output.requires_grad_()
    return output
