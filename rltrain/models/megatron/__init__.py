"""Megatron-core backend: build a GPTModel from a HF config, HF<->Megatron weights, the fused LM head,
and MegatronEngine (forward log-probs/values, train step). It must not import Ray or rollout code.

Import order of the parts: compat (CPU shims) -> build -> weights / head -> engine.
"""

# first: importing it runs its CPU-only import shim before any megatron import below
from rltrain.compat.megatron import import_megatron_without_jit_on_cpu  # noqa: F401
from rltrain.models.megatron.build import build_gpt_model, transformer_config_from_hf
from rltrain.models.megatron.compat import setup_parallel, teardown_parallel
from rltrain.models.megatron.engine import MegatronEngine
from rltrain.models.megatron.tiny import tiny_qwen3_config
from rltrain.models.megatron.weights import WEIGHT_RULES, export_hf_weights, load_hf_weights

__all__ = [
    "MegatronEngine",
    "build_gpt_model",
    "transformer_config_from_hf",
    "setup_parallel",
    "teardown_parallel",
    "tiny_qwen3_config",
    "WEIGHT_RULES",
    "load_hf_weights",
    "export_hf_weights",
]
