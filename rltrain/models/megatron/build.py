"""Build a megatron-core GPTModel from a Hugging Face config (Qwen3, Qwen3-MoE, Qwen2, Llama) with TP/PP/EP.
It must not load weights (weights.py) or wrap the output layer (head.py); it only builds modules.

Mapping choices:
- Qwen3: RMSNorm, SwiGLU (gated fc1 = [gate; up]), RoPE with `rope_theta`, GQA, per-head q/k
  RMSNorm (`qk_layernorm`), explicit `head_dim` (kv_channels), tied or untied embeddings.
- Qwen2: like Qwen3 without q/k norm and with q/k/v biases. Llama: no biases, no q/k norm.
- Qwen3-MoE: Qwen3's attention with megatron-core's own MoE layers (TopKRouter + SequentialMLP experts, or
  Transformer Engine's grouped expert GEMMs where TE is installed). Routing as transformers computes it:
  softmax over all experts in fp32, top-k, renormalized when `norm_topk_prob` (megatron: top-k of the logits,
  then softmax over the k, the same numbers), else not (megatron: `moe_router_pre_softmax`). Dense and sparse
  layers mixed by `mlp_only_layers` / `decoder_sparse_step` (megatron: a `moe_layer_freq` list); dense layers
  have `intermediate_size`, experts `moe_intermediate_size`. Shared experts (Qwen2-MoE) and Mixtral are refused.
- Only the default RoPE type is supported (scaled RoPE variants raise a ValueError).
- Refused at build, by field name (UnsupportedModelError), never run wrong: a sliding attention window
  on any layer (`use_sliding_window` / `sliding_window` / `layer_types`; attention here is always full
  causal), `attention_bias=True` (Qwen3/Llama: q/k/v/o biases) and Llama's `mlp_bias=True`.
- Core attention: `SDPACoreAttention` (torch scaled_dot_product_attention, causal; flash/memory-
  efficient kernels on GPU, never a materialized [s, s] score tensor there) unless Transformer
  Engine is installed, in which case megatron's TE layer spec is used.
- Vocab: padded to a multiple of `make_vocab_size_divisible_by * tp_size` as megatron does (ParallelDims); the
  padded rows are zero and the fused head masks them out of log-probs/entropy (head.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from rltrain.compat.megatron import (cuda_enabled, define_te_gemm_when_absent, patch_model_for_cpu,
                                     patch_moe_dispatch_for_cpu)
from rltrain.config.parallel import ParallelDims
from rltrain.config.schema import RECOMPUTE_GRANULARITIES, RECOMPUTE_MODULES
from rltrain.utils.errors import UserError
from rltrain.utils.flops import head_dim, sparse_layers

try:  # Transformer Engine is optional (GPU images); the local spec is used without it.
    import transformer_engine  # noqa: F401

    HAVE_TE = True
except ImportError:
    HAVE_TE = False

# HF model_type -> architecture flags. One row per supported family.
ARCHITECTURES: dict[str, dict[str, bool]] = {
    "qwen3": {"qk_layernorm": True, "qkv_bias": False, "moe": False},
    "qwen3_moe": {"qk_layernorm": True, "qkv_bias": False, "moe": True},
    "qwen2": {"qk_layernorm": False, "qkv_bias": True, "moe": False},
    "llama": {"qk_layernorm": False, "qkv_bias": False, "moe": False},
}
# MoE families transformers has that this backend does not build, and what to use instead.
REFUSED_MOE = {
    "mixtral": "Mixtral (model_type 'mixtral') is not built by the Megatron backend yet: its experts are named "
               "w1/w2/w3 and it uses a sliding window; use a Qwen3-MoE model (model_type 'qwen3_moe')",
    "qwen2_moe": "Qwen2-MoE (model_type 'qwen2_moe') has shared experts with a gate, which the Megatron backend "
                 "does not build; use a Qwen3-MoE model (model_type 'qwen3_moe')",
}


def _hf_get(hf_config: Any, key: str, default: Any = None) -> Any:
    return getattr(hf_config, key, default) if not isinstance(hf_config, dict) else hf_config.get(key, default)


class UnsupportedModelError(UserError, ValueError):
    """A model config this backend would not compute as transformers does; the message names the field."""


def architecture(hf_config: Any) -> dict[str, bool]:
    model_type = _hf_get(hf_config, "model_type")
    if model_type in REFUSED_MOE:
        raise UnsupportedModelError(REFUSED_MOE[model_type])
    if model_type not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"model.path config has model_type={model_type!r}; supported: {sorted(ARCHITECTURES)}"
        )
    return dict(ARCHITECTURES[model_type])


def sliding_window_layers(hf_config: Any) -> list[int]:
    """Layers on which transformers applies a sliding attention window: those whose `layer_types`
    entry is "sliding_attention" while `sliding_window` is set (the config nulls it unless
    `use_sliding_window`). Configs without `layer_types` follow the rule transformers derives it by:
    layers >= `max_window_layers` when `use_sliding_window`."""
    window = _hf_get(hf_config, "sliding_window")
    if window is None:
        return []
    layer_types = _hf_get(hf_config, "layer_types")
    if layer_types is not None:
        return [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    if not _hf_get(hf_config, "use_sliding_window", False):
        return []
    first = int(_hf_get(hf_config, "max_window_layers", 0) or 0)
    return list(range(first, int(_hf_get(hf_config, "num_hidden_layers"))))


def check_supported(hf_config: Any) -> None:
    """Refuse (UnsupportedModelError, naming the config fields) what build_gpt_model would compute
    differently from transformers. Called by transformer_config_from_hf, i.e. at every build."""
    model_type = _hf_get(hf_config, "model_type")
    problems = []
    layers = sliding_window_layers(hf_config)
    if layers:
        problems.append(
            f"use_sliding_window={_hf_get(hf_config, 'use_sliding_window')} with sliding_window="
            f"{_hf_get(hf_config, 'sliding_window')} puts a sliding attention window on layers {layers} "
            "(layer_types), but the Megatron backend computes full causal attention only; use a config "
            "without a window (use_sliding_window: false)")
    if _hf_get(hf_config, "attention_bias", False):
        problems.append(f"attention_bias=true ({model_type}: biases on q/k/v/o projections) is not built by the "
                        "Megatron backend; use a config with attention_bias: false")
    if model_type == "llama" and _hf_get(hf_config, "mlp_bias", False):
        problems.append("mlp_bias=true (llama: biases on the MLP projections) is not built by the Megatron "
                        "backend; use a config with mlp_bias: false")
    if problems:
        raise UnsupportedModelError("model config not supported: " + "; ".join(problems))


def rope_theta(hf_config: Any) -> float:
    params = _hf_get(hf_config, "rope_parameters") or {}
    scaling = _hf_get(hf_config, "rope_scaling") or {}
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type not in (None, "default"):
        raise ValueError(f"rope_type={rope_type!r} is not supported by the megatron backend (only 'default')")
    theta = params.get("rope_theta", _hf_get(hf_config, "rope_theta"))
    if theta is None:
        raise ValueError("HF config has no rope_theta (neither rope_parameters['rope_theta'] nor rope_theta)")
    return float(theta)


def moe_layer_pattern(hf_config: Any) -> list[int]:
    """Per layer, 1 where transformers builds a sparse MoE block and 0 where a dense MLP (Qwen3MoeDecoderLayer's
    rule: not in `mlp_only_layers`, and `(i + 1) % decoder_sparse_step == 0`); all 0 for a dense family."""
    if not architecture(hf_config)["moe"]:
        return [0] * int(hf_config.num_hidden_layers)
    return sparse_layers(hf_config)


def _moe_kwargs(hf_config: Any, *, dims: ParallelDims, aux_loss_coeff: float, z_loss_coeff: float) -> dict:
    """TransformerConfig's MoE keys for a Qwen3-MoE config (empty for a dense model)."""
    if not any(moe_layer_pattern(hf_config)):
        return {}
    experts, topk = int(hf_config.num_experts), int(hf_config.num_experts_per_tok)
    ffn = int(hf_config.moe_intermediate_size)
    if not 1 <= topk <= experts:
        raise UnsupportedModelError(f"MoE model config not supported: num_experts_per_tok={topk} must be between 1 "
                                    f"and num_experts={experts}")
    if aux_loss_coeff < 0 or z_loss_coeff < 0:
        raise ValueError(f"moe_aux_loss_coeff={aux_loss_coeff} and moe_z_loss_coeff={z_loss_coeff} must be >= 0")
    return dict(
        num_moe_experts=experts, moe_ffn_hidden_size=ffn, moe_router_topk=topk,
        # norm_topk_prob: softmax over the k chosen logits (= the renormalized top-k of the full softmax)
        moe_router_pre_softmax=not bool(_hf_get(hf_config, "norm_topk_prob", True)),
        moe_layer_freq=moe_layer_pattern(hf_config), moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss" if aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=float(aux_loss_coeff), moe_z_loss_coeff=float(z_loss_coeff) or None,
        expert_model_parallel_size=dims.ep, expert_tensor_parallel_size=dims.etp,
        # all-to-all exchanges only the routed tokens, and each rank may hold a different number of tokens
        moe_token_dispatcher_type="alltoall" if dims.ep > 1 else "allgather",
        moe_grouped_gemm=HAVE_TE, moe_permute_fusion=False,
        # a RouterReplay per router (idle unless the engine sets targets: rollout routing replay, moe.RoutingReplay)
        moe_enable_routing_replay=True,
    )


def transformer_config_from_hf(
    hf_config: Any,
    *,
    dims: ParallelDims | None = None,
    moe_aux_loss_coeff: float = 0.0,
    moe_z_loss_coeff: float = 0.0,
    params_dtype: torch.dtype = torch.float32,
    sequence_parallel: bool = False,
    recompute_activations: bool = False,
    recompute_granularity: str = "full",
    recompute_modules: tuple[str, ...] = ("mlp",),
) -> TransformerConfig:
    """The megatron TransformerConfig equivalent to a HF Qwen3/Qwen2/Llama config, split by `dims` (None: one rank);
    a shape the degrees cannot split raises UnsupportedModelError naming both (ParallelDims.model_problems).

    recompute_activations: activation recomputation. `recompute_granularity="full"`: whole layers, one at a
    time (keeps only each layer's input `[s, b, H]`); `"selective"`: only megatron's `recompute_modules` of each
    layer ("mlp", "core_attn"; with SDPA attention "core_attn" saves little: flash attention keeps no [s, s]
    scores)."""
    arch = architecture(hf_config)
    check_supported(hf_config)
    if _hf_get(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf_config.hidden_act!r} is not supported (only 'silu')")
    dims = dims or ParallelDims(world_size=1)
    n_kv = _hf_get(hf_config, "num_key_value_heads") or hf_config.num_attention_heads
    moe = any(moe_layer_pattern(hf_config))
    problems = dims.model_problems(layers=int(hf_config.num_hidden_layers), heads=int(hf_config.num_attention_heads),
                                   kv_heads=int(n_kv), experts=int(hf_config.num_experts) if moe else 0,
                                   expert_ffn=int(hf_config.moe_intermediate_size) if moe else 0)
    if problems:
        raise UnsupportedModelError(f"model {_hf_get(hf_config, 'model_type')!r} cannot be split this way: "
                                    + "; ".join(problems))
    moe = _moe_kwargs(hf_config, dims=dims, aux_loss_coeff=moe_aux_loss_coeff, z_loss_coeff=moe_z_loss_coeff)
    return TransformerConfig(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=n_kv,
        kv_channels=head_dim(hf_config),
        normalization="RMSNorm",
        layernorm_epsilon=float(hf_config.rms_norm_eps),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch["qkv_bias"],
        qk_layernorm=arch["qk_layernorm"],
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=float(_hf_get(hf_config, "initializer_range", 0.02)),
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        sequence_parallel=sequence_parallel and dims.tp > 1,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=not cuda_enabled(),
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        **(_recompute_kwargs(recompute_granularity, recompute_modules) if recompute_activations else {}),
        **moe,
    )


def _recompute_kwargs(granularity: str, modules) -> dict:
    if granularity not in RECOMPUTE_GRANULARITIES:
        raise ValueError(f"recompute_granularity must be one of {RECOMPUTE_GRANULARITIES}, got {granularity!r}")
    if granularity == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    # "layernorm" needs Transformer Engine in megatron-core 0.16.1 (CheckpointWithoutOutput takes its fp8 path
    # whatever the config says), so it is offered only with TE
    allowed = RECOMPUTE_MODULES + ("layernorm",) if HAVE_TE else RECOMPUTE_MODULES
    if not modules or set(modules) - set(allowed):
        raise ValueError(f"recompute_modules must be a non-empty subset of {allowed}, got {list(modules)}")
    return dict(recompute_granularity="selective", recompute_modules=list(modules))


class SDPACoreAttention(MegatronModule):
    """Causal core attention on torch.nn.functional.scaled_dot_product_attention.

    query [sq, b, np, hn], key/value [sk, b, ng, hn] (this rank's heads) -> context [sq, b, np*hn].
    GQA uses SDPA's `enable_gqa` (no repeated K/V copies). Padding is on the right of each row and
    attention is causal, so real tokens never attend to padding; no mask tensor is needed.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPACoreAttention does not support context parallelism (context_parallel_size != 1)")
        self.softmax_scale = softmax_scale  # None -> 1/sqrt(hn), SDPA's default
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPACoreAttention supports neither packed_seq_params nor attention_bias")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        ctx = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale,
            dropout_p=self.dropout_p if self.training else 0.0,
            enable_gqa=q.shape[1] != k.shape[1],
        )  # [b, np, sq, hn]
        sq, b = query.shape[0], query.shape[1]
        return ctx.permute(2, 0, 1, 3).reshape(sq, b, -1)


def layer_spec(config: TransformerConfig):
    """TE layer spec when Transformer Engine is installed, else the local spec with SDPA attention. For an MoE
    config: megatron's block spec (a dense or MoE layer spec per layer, by `moe_layer_freq`)."""
    if config.num_moe_experts:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        define_te_gemm_when_absent()
        patch_moe_dispatch_for_cpu()
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=HAVE_TE, normalization="RMSNorm")
        if not HAVE_TE:
            for spec in block.layer_specs:
                spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
        return block
    if HAVE_TE:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return spec


def build_gpt_model(
    hf_config: Any,
    *,
    dims: ParallelDims,
    params_dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    make_vocab_size_divisible_by: int = 128,
    sequence_parallel: bool = False,
    recompute_activations: bool = False,
    recompute_granularity: str = "full",
    recompute_modules: tuple[str, ...] = ("mlp",),
    moe_aux_loss_coeff: float = 0.0,
    moe_z_loss_coeff: float = 0.0,
) -> GPTModel:
    """GPTModel for this pipeline stage, on `device`, split by `dims` (what compat.setup_parallel() initialized and
    returned; it must run first).

    Tied embeddings follow `tie_word_embeddings` (pipeline stages > 1 share them via megatron's
    embedding group). The returned model carries `real_vocab_size` (the HF vocab) as an attribute.

    Every parameter is in `params_dtype`, norms included: megatron's local spec builds its norms as
    `torch.nn.RMSNorm` without a dtype (fp32 weights; megatron casts the whole model with Float16Module,
    which we do not use), and a bf16 input with an fp32 weight makes `torch.rms_norm` fall back to its
    unfused fp32 composite (several elementwise kernels and fp32 copies per norm). Cast here as Float16Module
    would; the fp32 master copies in the engine keep the optimizer's precision.
    """
    config = transformer_config_from_hf(
        hf_config, dims=dims, moe_aux_loss_coeff=moe_aux_loss_coeff,
        moe_z_loss_coeff=moe_z_loss_coeff,
        params_dtype=params_dtype, sequence_parallel=sequence_parallel,
        recompute_activations=recompute_activations, recompute_granularity=recompute_granularity,
        recompute_modules=tuple(recompute_modules),
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(config),
        vocab_size=dims.padded_vocab(int(hf_config.vocab_size), make_vocab_size_divisible_by),
        max_sequence_length=int(_hf_get(hf_config, "max_position_embeddings", 4096)),
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=bool(_hf_get(hf_config, "tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=rope_theta(hf_config),
    )
    model.real_vocab_size = int(hf_config.vocab_size)
    return patch_model_for_cpu(model).to(device=device, dtype=params_dtype)
