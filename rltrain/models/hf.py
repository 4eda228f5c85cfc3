"""Plain transformers model helpers: a HF config or causal-LM from a config object or a local path.
It must not download anything implicitly or know about Megatron; a missing path is a clear error.
"""

from __future__ import annotations

import os
from typing import Any

import torch


def _check_path(path: str | os.PathLike) -> str:
    path = os.fspath(path)
    if not os.path.isdir(path) or not os.path.exists(os.path.join(path, "config.json")):
        raise FileNotFoundError(
            f"model.path={path!r} is not a local Hugging Face model directory with a config.json; "
            "set model.path to a downloaded checkpoint (or use the tiny built-in model config)"
        )
    return path


def load_hf_config(path: str | os.PathLike, *, trust_remote_code: bool = False) -> Any:
    """transformers config of the model directory `path` (the `model.path` key); its custom code (auto_map) runs only
    with trust_remote_code (`model.trust_remote_code`)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(_check_path(path), trust_remote_code=trust_remote_code)


def build_hf_causal_lm(config_or_path: Any, *, dtype: torch.dtype = torch.float32,
                       load_weights: bool = True, trust_remote_code: bool = False) -> torch.nn.Module:
    """A transformers *ForCausalLM: from a config object (random init) or from a model directory
    (weights loaded when load_weights, else random init with that directory's config)."""
    from transformers import AutoModelForCausalLM

    if isinstance(config_or_path, (str, os.PathLike)):
        path = _check_path(config_or_path)
        if load_weights:
            return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
        config_or_path = load_hf_config(path, trust_remote_code=trust_remote_code)
    return AutoModelForCausalLM.from_config(config_or_path, dtype=dtype)


def is_peft_adapter(path: str | os.PathLike) -> bool:
    """Whether `path` is a PEFT adapter directory (a LoRA run's export: adapter_config.json, no model of its own)."""
    return os.path.exists(os.path.join(os.fspath(path), "adapter_config.json"))


def load_merged_adapter(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A LoRA run's export as one transformers causal LM: its base (adapter_config.json's base_model_name_or_path, a
    local model directory) with every adapter merged in (W + alpha / r B A, models/lora.merged_weights)."""
    import json

    from safetensors.torch import load_file

    from rltrain.models.lora import LoraSpec, merged_weights

    path = os.fspath(path)
    with open(os.path.join(path, "adapter_config.json")) as f:
        peft = json.load(f)
    spec = LoraSpec(rank=int(peft["r"]), alpha=float(peft["lora_alpha"]), dropout=0.0,
                    targets=tuple(peft["target_modules"]))
    model = build_hf_causal_lm(peft["base_model_name_or_path"], dtype=dtype)
    adapters = load_file(os.path.join(path, "adapter_model.safetensors"))
    model.load_state_dict(dict(merged_weights(model.state_dict(), adapters, spec)))
    return model
