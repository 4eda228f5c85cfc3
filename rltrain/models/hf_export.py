"""The one writer of a transformers-format checkpoint (config.json + model.safetensors [+ tokenizer]): the RL
actor's export (workers/hybrid.py), SFT's output (trainer/sft.py) and the rollout engine's initial weights
(workers/rollout.py) all write through `save_hf_checkpoint`; a LoRA actor's adapter is written as PEFT writes one
(adapter_config.json + adapter_model.safetensors) by `save_peft_adapter`.

It writes on the rank that calls it (transformers' save_pretrained writes on rank 0 only once torch.distributed is
up, while every vLLM rank reads its own copy); callers decide which ranks write. Tensor names are checked against the
architecture's own (built on the meta device, no memory), in the checkpoint layout (Mixture-of-Experts: one tensor per
expert, models/hf_experts.py); a tied LM head is not written twice.
"""

from __future__ import annotations

import os
import shutil
from typing import Iterable, Mapping

import torch

from rltrain.models.hf_experts import CheckpointLayout, checkpoint_names


def write_hf_config(hf_config, directory: str, architecture: str | None = None) -> None:
    """`hf_config`'s config.json in `directory`, its `architectures` the causal LM's class name as a model's
    save_pretrained records it (vLLM picks its model class by it; a bare config has none): `architecture`, or the
    one transformers maps the config's model_type to."""
    if architecture is None:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(hf_config.model_type)
    if architecture:
        hf_config.architectures = [architecture]
    hf_config.save_pretrained(directory)


def save_hf_checkpoint(directory: str, hf_config, tensors: Mapping[str, torch.Tensor] | Iterable, *,
                       tokenizer=None, dtype: torch.dtype | None = None, atomic: bool = False) -> str:
    """Write `tensors` (HF names -> full tensors) of the causal LM `hf_config` describes to `directory`, with the
    tokenizer when given (one with save_pretrained). dtype: cast floating tensors to it (None: as given). atomic:
    write into `<directory>.tmp`, then replace `directory` with it. Returns the absolute directory."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    tensors = dict(tensors)
    if CheckpointLayout.needed(tensors):  # a transformers 5 MoE state dict (fused experts): one tensor per expert
        tensors = dict(CheckpointLayout(tensors).items())
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(hf_config)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    names = checkpoint_names((k, v.shape) for k, v in meta.state_dict().items())  # MoE: one tensor per expert
    expected = {k for k in names if not (tied and k == "lm_head.weight")}
    tensors = {k: v for k, v in tensors.items() if not (tied and k == "lm_head.weight")}
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    assert not missing and not unexpected, (missing[:5], unexpected[:5])
    directory = os.path.abspath(directory)
    target = directory + ".tmp" if atomic else directory
    if atomic:
        shutil.rmtree(target, ignore_errors=True)
    os.makedirs(target, exist_ok=True)
    write_hf_config(hf_config, target, type(meta).__name__)

    def prepared(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        return t.cpu().contiguous()

    save_file({k: prepared(v) for k, v in tensors.items()}, os.path.join(target, "model.safetensors"),
              metadata={"format": "pt"})
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(target)
    if not os.path.exists(os.path.join(target, "config.json")):
        raise RuntimeError(f"could not write the checkpoint's config.json to {target}")
    if atomic:
        if os.path.exists(directory):
            shutil.rmtree(directory)
        os.replace(target, directory)
    return directory


def save_peft_adapter(directory: str, spec, tensors: Mapping[str, torch.Tensor], *, base_model: str | None = None,
                      tokenizer=None, dtype: torch.dtype = torch.float32) -> str:
    """Write a LoRA adapter (spec: models/lora.LoraSpec; tensors: PEFT names -> A / B) as a PEFT adapter directory:
    adapter_config.json (base_model_name_or_path = `base_model`, the model it adapts) and adapter_model.safetensors,
    with the tokenizer when given. `peft.PeftModel.from_pretrained(base, directory)` and vLLM's LoRARequest read it.
    Returns the absolute directory."""
    import json

    from safetensors.torch import save_file

    from rltrain.models.lora import parse_adapter_name

    bad = [k for k in tensors if parse_adapter_name(k) is None]
    assert not bad, bad[:5]
    directory = os.path.abspath(directory)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump(spec.peft_config(base_model), f, indent=2)
    save_file({k: v.detach().to(dtype).cpu().contiguous() for k, v in tensors.items()},
              os.path.join(directory, "adapter_model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(directory)
    return directory
