"""The one place that turns `model.*` into an HF config: a built-in preset's shape (config/presets.py, random init,
no download) as a transformers Qwen3 / Qwen3-MoE config, or the config of the model at `model.path`. Must not build
Megatron models or load weights (that is models/megatron, models/hf).
"""

from __future__ import annotations

from typing import Any, Mapping

from rltrain.config.presets import BUILTINS
from rltrain.config.schema import ModelConfig
from rltrain.utils.errors import UserError, remote_code_refusal


class ModelNotFoundError(UserError, FileNotFoundError):
    """`model.path` (or `model.tokenizer`) names nothing that can be loaded."""


def model_hf_config(m: ModelConfig, tokenizer):
    """hf_config_for from the `model.*` sub-config; `tiny` and `small` take their vocab size from `tokenizer`."""
    vocab = getattr(tokenizer, "vocab_size", None) or len(tokenizer)
    return hf_config_for(path=m.path, builtin=m.builtin, vocab_size=vocab, overrides=m.overrides,
                         trust_remote_code=m.trust_remote_code)


def hf_config_for(*, path: str | None, builtin: str | None, vocab_size: int | None = None,
                  overrides: Mapping[str, Any] | None = None, trust_remote_code: bool = False):
    """The transformers config of `model.builtin` (a Qwen3Config) or of the model at `model.path`.

    vocab_size: the tokenizer's size, used by `tiny` and `small` (qwen3-0.6b keeps its real vocab unless overridden).
    """
    from transformers import AutoConfig, Qwen3Config, Qwen3MoeConfig

    overrides = dict(overrides or {})
    if builtin is not None:
        if builtin not in BUILTINS:
            raise ValueError(f"model.builtin={builtin!r} is unknown; choose one of {', '.join(BUILTINS)}")
        kw = dict(BUILTINS[builtin])
        if "vocab_size" not in kw:  # tiny, small: the tokenizer's vocabulary
            if vocab_size is None:
                raise ValueError(f"model.builtin={builtin} needs the tokenizer's vocab size")
            kw["vocab_size"] = vocab_size
        kw.update(overrides)
        return (Qwen3MoeConfig if kw.pop("model_type", "qwen3") == "qwen3_moe" else Qwen3Config)(**kw)
    if not path:
        raise ValueError("model.path is not set; give an HF model id or a local directory, or set model.builtin")
    from rltrain.utils.hub import check_model_source

    check_model_source(path, "model.path")  # missing, or a Hub id that cannot be fetched: the fix, before any retry
    try:
        cfg = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        refusal = remote_code_refusal(err, f"model.path={path!r}")
        if refusal is not None:
            raise ModelNotFoundError(refusal) from None
        raise ModelNotFoundError(f"model.path={path!r}: could not load its config.json ({err}); fix model.path "
                                "or download the model first") from err
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg
