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
