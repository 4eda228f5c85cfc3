"""LoRA as transformers and PEFT name it: the adapter spec (actor.lora.*), PEFT's tensor names, the adapter's math on a
plain transformers model (forward hooks, for the hf rollout engine) and the merge W + (alpha / r) B A. It must not
know Megatron (models/megatron/lora.py puts the same adapters on the actor's fused layers) nor write files
(models/hf_export.py writes PEFT adapter directories).

An adapter on a linear layer y = x W^T is y + (alpha / r) * dropout(x) A^T B^T, A [r, in], B [out, r] (Hu et al.
2021, arXiv:2106.09685; PEFT's lora_A / lora_B). PEFT's file names the weights
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` (the model wrapped twice, adapter name dropped).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rltrain.config.schema import LORA_TARGETS, resolve_targets  # noqa: F401  (importers take them from here too)

# The block of the decoder layer that holds each target (LORA_TARGETS: the schema's, with resolve_targets)
BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
         "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
PEFT_PREFIX = "base_model.model."
_ADAPTER = re.compile(r"^base_model\.model\.(model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+))\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class LoraSpec:
    """What every adapter is: rank r, alpha (output scale alpha / r), dropout on its input, the targets."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_config(cls, cfg) -> LoraSpec | None:
        """actor.lora (a LoraConfig) -> a spec, or None when rank is 0 (off)."""
        if cfg is None or not cfg.rank:
            return None
        return cls(rank=int(cfg.rank), alpha=float(cfg.alpha), dropout=float(cfg.dropout),
                   targets=resolve_targets(cfg.target_modules))

    def peft_config(self, base_model: str | None = None) -> dict:
        """adapter_config.json as PEFT writes it for a causal LM (vLLM's PEFTHelper reads the same fields)."""
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.rank, "lora_alpha": self.alpha,
                "lora_dropout": self.dropout, "target_modules": list(self.targets), "bias": "none",
                "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None,
                "init_lora_weights": True, "inference_mode": True, "base_model_name_or_path": base_model}


def module_path(layer: int, target: str) -> str:
    """The transformers module an adapter sits on: model.layers.{i}.self_attn.q_proj ..."""
    return f"model.layers.{layer}.{BLOCK[target]}.{target}"


def adapter_name(layer: int, target: str, which: str) -> str:
    """PEFT's name of lora_A (which="A") or lora_B of an adapter."""
    return f"{PEFT_PREFIX}{module_path(layer, target)}.lora_{which}.weight"


def parse_adapter_name(name: str) -> tuple[str, int, str, str] | None:
    """(module path, layer, target, "A" | "B") of a PEFT adapter tensor name; None for any other name."""
    m = _ADAPTER.match(name)
    if m is None or m.group(4) not in LORA_TARGETS:
        return None
    return m.group(1), int(m.group(2)), m.group(4), m.group(5)


def merged_weights(base: Mapping[str, torch.Tensor], adapters: Mapping[str, torch.Tensor],
                   spec: LoraSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """The base's (HF name, tensor) pairs with every adapted weight merged: W + scale * B @ A (in fp32, back in W's
    dtype). `adapters`: PEFT-named A and B tensors."""
    delta: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name in adapters:
        parsed = parse_adapter_name(name)
        if parsed is None:
            raise ValueError(f"{name!r} is not a PEFT adapter tensor name")
        if parsed[3] == "A":
            path = parsed[0]
            delta[path + ".weight"] = (adapters[name], adapters[f"{PEFT_PREFIX}{path}.lora_B.weight"])
    for name, w in base.items():
        if name in delta:
            a, b = delta.pop(name)
            w = (w.float() + spec.scale * (b.float().to(w.device) @ a.float().to(w.device))).to(w.dtype)
        yield name, w
    if delta:
        raise KeyError(f"adapters of weights the base does not have: {sorted(delta)[:4]}")


class HFAdapters:
    """LoRA on a transformers causal LM by forward hooks (the base untouched): each targeted nn.Linear's output gets
    scale * x A^T B^T. The hf rollout engine's adapters, loaded from the actor's PEFT-named stream (`load`); until
    then B is 0 and the model is the base. No dropout (generation)."""

    def __init__(self, model: torch.nn.Module, spec: LoraSpec):
        self.spec = spec
        self.tensors: dict[str, torch.Tensor] = {}  # PEFT name -> A or B, on the module's device and dtype
        self.handles = []
        modules = dict(model.named_modules())
        layers = int(model.config.num_hidden_layers)
        for i in range(layers):
            for target in spec.targets:
                linear = modules[module_path(i, target)]
                w = linear.weight
                self.tensors[adapter_name(i, target, "A")] = torch.zeros(spec.rank, w.shape[1], dtype=w.dtype,
                                                                         device=w.device)
                self.tensors[adapter_name(i, target, "B")] = torch.zeros(w.shape[0], spec.rank, dtype=w.dtype,
                                                                         device=w.device)
                self.handles.append(linear.register_forward_hook(self._hook(i, target)))

    def _hook(self, layer: int, target: str):
        a_name, b_name = adapter_name(layer, target, "A"), adapter_name(layer, target, "B")

        def hook(module, args, out):
            a, b = self.tensors[a_name], self.tensors[b_name]
            return out + self.spec.scale * F.linear(F.linear(args[0].to(a.dtype), a), b).to(out.dtype)
        return hook

    @torch.no_grad()
    def load(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy PEFT-named A/B tensors in; returns how many."""
        n = 0
        for name, t in named:
            if name not in self.tensors:
                raise KeyError(f"adapter tensor {name!r} is not one of this model's adapters "
                               f"(targets {list(self.spec.targets)})")
            dst = self.tensors[name]
            if tuple(t.shape) != tuple(dst.shape):
                raise ValueError(f"adapter tensor {name} has shape {tuple(t.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(t)
            n += 1
        return n

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
