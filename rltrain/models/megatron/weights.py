"""HF <-> Megatron weights: ONE table of name/layout rules, loading HF tensors into the TP-sharded
model, and streamed bucketed export back to full HF tensors. It must not build models or train.

Why our own converter: `mbridge` (PyPI) does this job but pulls its own model/config layer and is
being retired in favour of Megatron-Bridge; for three dense families the rules fit in one table.

Layouts (tp = tensor-parallel size, r = this rank):
- `replicated`: same tensor on every rank (norms, value head).
- `vocab`: rows padded with zeros from the HF vocab V to megatron's padded vocab, split in tp row
  blocks (embedding, untied lm_head). Export drops the padding.
- `row`: split along dim 1 (RowParallelLinear: o_proj, down_proj).
- `qkv`: q [np*hn, ...], k/v [ng*hn, ...] -> per query group g: [q heads of g; k_g; v_g], i.e.
  [ng, np/ng + 2, hn, ...]; rank r holds groups [r*ng/tp, (r+1)*ng/tp). Weights and biases.
- `gate_up`: fc1 on rank r = [gate rows of r; up rows of r] (each split in tp row blocks).

- Mixture-of-Experts (Qwen3-MoE): the router `mlp.gate` is replicated; each expert's `gate_proj`/`up_proj`
  (`expert_gate_up`) and `down_proj` (`expert_row`) are laid out as the dense MLP's, over the expert-tensor-parallel
  ranks. Expert parallelism: EP rank r holds experts [r*E/ep, (r+1)*E/ep) under local indices; the table's `{e}`
  is the global expert index. HF tensors are the checkpoint layout (one per expert); a transformers 5 state dict
  with fused expert tensors is read through hf_experts.CheckpointLayout. Export gathers the experts over EP.

Pipeline parallelism: a stage holds layers [stage*L/pp, (stage+1)*L/pp) under local indices; the
table's `{i}` is the global index. `export_hf_weights` yields the tensors of this stage only; the engine
merges the stages (pipeline.merge_stages) so that every rank gets the whole model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from rltrain.models.hf_experts import CheckpointLayout

# (megatron name template, HF name templates, layout). `{i}` is the global layer index.
WEIGHT_RULES: list[tuple[str, tuple[str, ...], str]] = [
    ("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"),
    ("decoder.layers.{i}.input_layernorm.weight", ("model.layers.{i}.input_layernorm.weight",), "replicated"),
    ("decoder.layers.{i}.self_attention.linear_qkv.weight",
     ("model.layers.{i}.self_attn.q_proj.weight", "model.layers.{i}.self_attn.k_proj.weight",
      "model.layers.{i}.self_attn.v_proj.weight"), "qkv"),
    ("decoder.layers.{i}.self_attention.linear_qkv.bias",
     ("model.layers.{i}.self_attn.q_proj.bias", "model.layers.{i}.self_attn.k_proj.bias",
      "model.layers.{i}.self_attn.v_proj.bias"), "qkv"),
    ("decoder.layers.{i}.self_attention.q_layernorm.weight", ("model.layers.{i}.self_attn.q_norm.weight",), "replicated"),
    ("decoder.layers.{i}.self_attention.k_layernorm.weight", ("model.layers.{i}.self_attn.k_norm.weight",), "replicated"),
    ("decoder.layers.{i}.self_attention.linear_proj.weight", ("model.layers.{i}.self_attn.o_proj.weight",), "row"),
    ("decoder.layers.{i}.pre_mlp_layernorm.weight", ("model.layers.{i}.post_attention_layernorm.weight",), "replicated"),
    ("decoder.layers.{i}.mlp.linear_fc1.weight",
     ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"), "gate_up"),
    ("decoder.layers.{i}.mlp.linear_fc2.weight", ("model.layers.{i}.mlp.down_proj.weight",), "row"),
    # Mixture-of-Experts layers (megatron's TopKRouter + SequentialMLP; TEGroupedMLP names its experts weight{e})
    ("decoder.layers.{i}.mlp.router.weight", ("model.layers.{i}.mlp.gate.weight",), "replicated"),
    ("decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight",
     ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight", "model.layers.{i}.mlp.experts.{e}.up_proj.weight"),
     "expert_gate_up"),
    ("decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc2.weight",
     ("model.layers.{i}.mlp.experts.{e}.down_proj.weight",), "expert_row"),
    ("decoder.layers.{i}.mlp.experts.linear_fc1.weight{e}",
     ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight", "model.layers.{i}.mlp.experts.{e}.up_proj.weight"),
     "expert_gate_up"),
    ("decoder.layers.{i}.mlp.experts.linear_fc2.weight{e}",
     ("model.layers.{i}.mlp.experts.{e}.down_proj.weight",), "expert_row"),
    ("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"),
    ("output_layer.weight", ("lm_head.weight",), "vocab"),
    # Critic value head (HF *ForTokenClassification with num_labels=1 names it `score`).
    ("value_head.weight", ("score.weight",), "replicated"),
    ("value_head.bias", ("score.bias",), "replicated"),
]

# The submodule of a megatron linear that holds its LoRA adapters (models/megatron/lora.py): not base weights, so the
# HF table neither loads nor exports its parameters (the adapters have their own PEFT names and export)
ADAPTER_ATTR = "lora"

# HF keys that carry no weights of ours (buffers, or the tied copy of the embedding).
_IGNORED_HF = re.compile(r"(.*rotary_emb\.inv_freq$)")


@dataclass(frozen=True)
class _Layout:
    tp: int
    rank: int
    num_heads: int
    num_groups: int
    head_dim: int
    vocab: int  # real HF vocab
    padded_vocab: int


def _rule_regex(template: str) -> re.Pattern:
    pattern = re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{e\}", r"(?P<e>\d+)")
    return re.compile("^" + pattern + "$")


_RULES = [(_rule_regex(m), m, hf, layout) for m, hf, layout in WEIGHT_RULES]
_EXPERT_LAYOUTS = {"expert_gate_up": "gate_up", "expert_row": "row"}


def _match(megatron_name: str) -> tuple[tuple[str, ...], str, dict[str, int]]:
    """(HF name templates, layout, {"i": local layer, "e": local expert} as far as the name has them)."""
    for regex, _, hf, layout in _RULES:
        m = regex.match(megatron_name)
        if m:
            return hf, layout, {k: int(v) for k, v in m.groupdict().items()}
    raise KeyError(f"no HF<->Megatron rule for megatron parameter {megatron_name!r}")


def _hf_names(templates: tuple[str, ...], local: dict[str, int], layer_offset: int,
              expert_offset: int) -> list[str]:
    idx = {}
    if "i" in local:
        idx["i"] = local["i"] + layer_offset
    if "e" in local:
        idx["e"] = local["e"] + expert_offset
    return [t.format(**idx) for t in templates]


def _layout(model) -> _Layout:
    cfg = model.config
    return _Layout(
        tp=parallel_state.get_tensor_model_parallel_world_size(),
        rank=parallel_state.get_tensor_model_parallel_rank(),
        num_heads=cfg.num_attention_heads,
        num_groups=cfg.num_query_groups,
        head_dim=cfg.kv_channels,
        vocab=model.real_vocab_size,
        padded_vocab=model.vocab_size,
    )


def _expert_layout(lay: _Layout) -> _Layout:
    """The layout of expert matrices: split over the expert-tensor-parallel ranks instead of the TP ranks."""
    return dataclasses.replace(lay, tp=parallel_state.get_expert_tensor_parallel_world_size(),
                               rank=parallel_state.get_expert_tensor_parallel_rank())


def layer_offset(model) -> int:
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    return parallel_state.get_pipeline_model_parallel_rank() * (model.config.num_layers // pp)


def _local_experts(model) -> int:
    """Experts per expert-parallel rank (0 for a dense model)."""
    experts = model.config.num_moe_experts or 0
    return experts // parallel_state.get_expert_model_parallel_world_size()


def _expert_offset(model) -> int:
    return parallel_state.get_expert_model_parallel_rank() * _local_experts(model)


# ---- layout transforms: HF full tensors -> this rank's shard, and all ranks' shards -> HF ----

def _qkv_full(hf: list[torch.Tensor], lay: _Layout) -> torch.Tensor:
    q, k, v = hf
    per = lay.num_heads // lay.num_groups
    rest = q.shape[1:]
    q = q.reshape(lay.num_groups, per, lay.head_dim, *rest)
    k = k.reshape(lay.num_groups, 1, lay.head_dim, *rest)
    v = v.reshape(lay.num_groups, 1, lay.head_dim, *rest)
    return torch.cat([q, k, v], dim=1)  # [ng, per + 2, hn, ...]


def hf_to_local(hf: list[torch.Tensor], layout: str, lay: _Layout) -> torch.Tensor:
    if layout in _EXPERT_LAYOUTS:
        return hf_to_local(hf, _EXPERT_LAYOUTS[layout], _expert_layout(lay))
    if layout == "replicated":
        return hf[0]
    if layout == "vocab":
        w = hf[0]
        if w.shape[0] != lay.vocab:
            raise ValueError(f"vocab tensor has {w.shape[0]} rows, the HF config says vocab_size={lay.vocab}")
        w = torch.cat([w, w.new_zeros(lay.padded_vocab - lay.vocab, *w.shape[1:])])
        return w.chunk(lay.tp, dim=0)[lay.rank]
    if layout == "row":
        return hf[0].chunk(lay.tp, dim=1)[lay.rank]
    if layout == "qkv":
        full = _qkv_full(hf, lay).chunk(lay.tp, dim=0)[lay.rank]
        return full.reshape(-1, *hf[0].shape[1:])
    if layout == "gate_up":
        gate, up = hf
        return torch.cat([gate.chunk(lay.tp, dim=0)[lay.rank], up.chunk(lay.tp, dim=0)[lay.rank]])
    raise AssertionError(layout)


def locals_to_hf(shards: list[torch.Tensor], layout: str, lay: _Layout) -> list[torch.Tensor]:
    if layout in _EXPERT_LAYOUTS:
        return locals_to_hf(shards, _EXPERT_LAYOUTS[layout], _expert_layout(lay))
    if layout == "replicated":
        return [shards[0]]
    if layout == "vocab":
        return [torch.cat(shards, dim=0)[: lay.vocab]]
    if layout == "row":
        return [torch.cat(shards, dim=1)]
    if layout == "qkv":
        rest = shards[0].shape[1:]
        per = lay.num_heads // lay.num_groups
        full = torch.cat(shards, dim=0).reshape(lay.num_groups, per + 2, lay.head_dim, *rest)
        q, k, v = full.split([per, 1, 1], dim=1)
        return [t.reshape(-1, *rest) for t in (q, k, v)]
    if layout == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    raise AssertionError(layout)


# ---- HF sources ----

class _SafetensorsDir(Mapping):
    """Lazy read-only mapping over the *.safetensors files of a HF checkpoint directory."""

    def __init__(self, path: str):
        from safetensors import safe_open

        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {path!r} (set model.path to a HF checkpoint dir)")
        self._handles = [safe_open(os.path.join(path, f), framework="pt") for f in files]
        self._where = {k: h for h in self._handles for k in h.keys()}

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._where[key].get_tensor(key)

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def _as_source(state_dict_or_path) -> Mapping[str, torch.Tensor]:
    if isinstance(state_dict_or_path, (str, os.PathLike)):
        path = os.fspath(state_dict_or_path)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"HF weights directory {path!r} does not exist (check model.path)")
        return _SafetensorsDir(path)
    if CheckpointLayout.needed(state_dict_or_path):  # transformers 5's in-memory fused experts
        return CheckpointLayout(state_dict_or_path)
    return state_dict_or_path


def _strip_prefix(name: str) -> str:
    # Critic checkpoints may come from *ForTokenClassification or plain AutoModel ("layers.0...").
    return name if name.startswith(("model.", "lm_head.", "score.")) else "model." + name


def checkpoint_state(model) -> dict[str, torch.Tensor]:
    """`model.state_dict()` for a checkpoint: without the modules' `_extra_state` entries, where Transformer Engine
    keeps fp8 metadata as a pickle (no fp8 here), so a checkpoint holds tensors only."""
    return {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def with_own_extra_state(model, saved: dict) -> dict:
    """`saved` (a checkpoint's model state) with `model`'s own `_extra_state` entries for load_state_dict: a module
    never unpickles what a file holds there (Transformer Engine would)."""
    own = {k: v for k, v in model.state_dict().items() if k.endswith("_extra_state")}
    return {**{k: v for k, v in saved.items() if not k.endswith("_extra_state")}, **own}


def _named_params(model) -> Iterable[tuple[str, torch.nn.Parameter]]:
    """Parameters in table order; the tied output layer (weight None) has no parameter of its own; LoRA adapters
    (ADAPTER_ATTR) are not base weights."""
    return [(n, p) for n, p in model.named_parameters()
            if not n.endswith("_extra_state") and f".{ADAPTER_ATTR}." not in n]


@torch.no_grad()
def load_hf_weights(model, state_dict_or_path, *, strict: bool = True) -> None:
    """Copy HF-named full tensors (a state_dict, or a safetensors checkpoint dir) into this rank's
    shards of `model`. strict: every model parameter must be found (except a critic's value head,
    kept as initialized when the checkpoint has no `score.*`) and every HF weight used (the tied
    `lm_head.weight`, rotary buffers, and `score.*` for non-critics excepted)."""
    src = _as_source(state_dict_or_path)
    keys = {_strip_prefix(k): k for k in src.keys()}
    lay, offset, e_offset = _layout(model), layer_offset(model), _expert_offset(model)
    used: set[str] = set()
    for name, param in _named_params(model):
        hf_templates, layout, local = _match(name)
        hf_names = _hf_names(hf_templates, local, offset, e_offset)
        missing = [n for n in hf_names if n not in keys]
        if missing and all(n.startswith("score.") for n in hf_names):
            continue  # a critic started from a causal-LM checkpoint keeps its fresh value head
        if missing:
            raise KeyError(f"HF weights lack {missing} needed for megatron parameter {name!r}")
        hf = [src[keys[n]].to(param.dtype) for n in hf_names]
        local = hf_to_local(hf, layout, lay)
        if local.shape != param.shape:
            raise ValueError(
                f"shape mismatch for {name!r}: converted HF {hf_names} to {tuple(local.shape)}, "
                f"model shard is {tuple(param.shape)} (is the HF config the one of these weights?)"
            )
        param.copy_(local)
        used.update(hf_names)
    if strict:
        no_head = getattr(model, "share_embeddings_and_output_weights", False) or (
            getattr(model, "output_layer", None) is not None and model.output_layer.weight is None
        )  # tied, or a critic (no LM head): lm_head.weight is not ours
        stage_layers = range(offset, offset + len(model.decoder.layers)) if hasattr(model, "decoder") else ()
        unused = []
        for k in keys:
            if k in used or _IGNORED_HF.match(k) or (no_head and k == "lm_head.weight") or k.startswith("score."):
                continue
            m = re.match(r"model\.layers\.(\d+)\.", k)
            if m and int(m.group(1)) not in stage_layers:
                continue  # another pipeline stage's layer
            ex = re.match(r"model\.layers\.\d+\.mlp\.experts\.(\d+)\.", k)
            if ex and not e_offset <= int(ex.group(1)) < e_offset + _local_experts(model):
                continue  # another expert-parallel rank's expert
            if parallel_state.get_pipeline_model_parallel_world_size() > 1 and not m:
                continue  # embedding / final norm / head of another stage
            unused.append(k)
        if unused:
            raise KeyError(f"HF weights not used by the megatron model (wrong architecture?): {unused[:8]}")


def all_gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def _gather_tp(t: torch.Tensor, layout: str) -> list[torch.Tensor]:
    if layout in _EXPERT_LAYOUTS:
        if parallel_state.get_expert_tensor_parallel_world_size() == 1:
            return [t]
        return all_gather(t, parallel_state.get_expert_tensor_parallel_group())
    if layout == "replicated" or parallel_state.get_tensor_model_parallel_world_size() == 1:
        return [t]
    return all_gather(t, parallel_state.get_tensor_model_parallel_group())


def _gather_experts(t: torch.Tensor, layout: str) -> list[torch.Tensor]:
    """The same local expert's tensor from every expert-parallel rank (rank order = expert blocks), or [t]."""
    if layout not in _EXPERT_LAYOUTS or parallel_state.get_expert_model_parallel_world_size() == 1:
        return [t]
    return all_gather(t, parallel_state.get_expert_model_parallel_group())


@torch.no_grad()
def export_hf_weights(model, bucket_bytes: int = 512 << 20) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full HF tensor) for this pipeline stage's parameters, gathered over TP (and, for experts,
    over the expert-parallel ranks: every rank yields every expert).

    Every TP (and EP) rank must iterate (the gathers are collective) and gets the same tensors. Parameters
    are gathered `bucket_bytes` (full size) at a time and yielded per bucket, so peak extra memory
    is about one bucket (or one tensor when a tensor is larger). The tied lm_head is not emitted
    (HF re-ties it from `tie_word_embeddings`).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    lay, offset, n_local = _layout(model), layer_offset(model), _local_experts(model)
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, param in _named_params(model):
        hf_templates, layout, local = _match(name)
        for ep_rank, full in enumerate(_gather_experts(param.detach(), layout)):
            hf_names = _hf_names(hf_templates, local, offset, ep_rank * n_local)
            tensors = locals_to_hf(_gather_tp(full, layout), layout, lay)
            for n, t in zip(hf_names, tensors):
                bucket.append((n, t.clone() if layout == "replicated" else t))
                size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            yield from bucket
            bucket, size = [], 0
    yield from bucket
