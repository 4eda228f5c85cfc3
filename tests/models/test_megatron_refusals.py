"""Model configs the Megatron backend cannot compute as transformers does are refused at build, by field.

A sliding attention window is refused only where transformers really applies one (a layer whose
`layer_types` entry is "sliding_attention" while `sliding_window` is set); the accepted look-alikes are
checked against transformers itself: their logits equal full causal attention's, which is what the
Megatron backend computes.
"""

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config, Qwen2ForCausalLM, Qwen3Config

from rltrain.models.megatron.build import (
    UnsupportedModelError,
    check_supported,
    sliding_window_layers,
    transformer_config_from_hf,
)
from rltrain.utils.errors import UserError

TINY = dict(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False)


def _logits(config, state, ids):
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    if state is not None:
        model.load_state_dict(state)
    with torch.no_grad():
        return model(ids).logits.double(), model.state_dict()


@pytest.mark.parametrize("config_cls", [Qwen2Config, Qwen3Config])
def test_sliding_window_on_some_layer_is_refused_naming_the_fields(config_cls):
    cfg = config_cls(**TINY, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert sliding_window_layers(cfg) == [1, 2]
    with pytest.raises(UnsupportedModelError) as info:
        transformer_config_from_hf(cfg)
    msg = str(info.value)
    assert "use_sliding_window=True with sliding_window=8" in msg and "layers [1, 2] (layer_types)" in msg
    assert isinstance(info.value, UserError) and isinstance(info.value, ValueError)


def test_refused_window_really_changes_transformers_output_and_accepted_look_alikes_do_not():
    """Past the window the refused config's logits move away from full attention (so running it would
    train on wrong log-probs); a window on no layer, or a window flag set after loading (as
    model.overrides does), leaves transformers on full attention, which Megatron computes."""
    ids = torch.randint(0, TINY["vocab_size"], (2, 23))  # longer than the window
    full, state = _logits(Qwen2Config(**TINY), None, ids)
    windowed, _ = _logits(Qwen2Config(**TINY, use_sliding_window=True, sliding_window=4, max_window_layers=0), state, ids)
    assert (windowed[:, 4:] - full[:, 4:]).abs().max() > 1e-3
    torch.testing.assert_close(windowed[:, :4], full[:, :4])  # inside the window nothing differs

    no_layer = Qwen2Config(**TINY, use_sliding_window=True, sliding_window=4, max_window_layers=TINY["num_hidden_layers"])
    set_later = Qwen2Config(**TINY)
    set_later.use_sliding_window = True  # what model.overrides does to a loaded config: layer_types stay full
    for cfg in (no_layer, set_later):
        assert sliding_window_layers(cfg) == []
        transformer_config_from_hf(cfg)  # accepted
        torch.testing.assert_close(_logits(cfg, state, ids)[0], full)


def test_configs_without_layer_types_follow_the_rule_transformers_derives_them_by():
    d = dict(model_type="qwen2", num_hidden_layers=4, use_sliding_window=True, sliding_window=16, max_window_layers=2)
    assert sliding_window_layers(d) == [2, 3]
    assert sliding_window_layers({**d, "use_sliding_window": False}) == []
    assert sliding_window_layers({**d, "sliding_window": None}) == []
    with pytest.raises(UnsupportedModelError, match="sliding_window=16"):
        check_supported(d)


@pytest.mark.parametrize("config_cls, field, words", [
    (LlamaConfig, "attention_bias", "attention_bias=true (llama: biases on q/k/v/o projections)"),
    (LlamaConfig, "mlp_bias", "mlp_bias=true (llama: biases on the MLP projections)"),
    (Qwen3Config, "attention_bias", "attention_bias=true (qwen3: biases on q/k/v/o projections)"),
])
def test_biases_the_backend_does_not_build_are_refused_naming_the_field(config_cls, field, words):
    with pytest.raises(UnsupportedModelError) as info:
        transformer_config_from_hf(config_cls(**TINY, **{field: True}))
    assert words in str(info.value) and f"{field}: false" in str(info.value)


@pytest.mark.parametrize("config_cls", [Qwen2Config, Qwen3Config, LlamaConfig])
def test_default_configs_of_each_family_are_accepted(config_cls):
    cfg = config_cls(**TINY)
    tc = transformer_config_from_hf(cfg)
    assert tc.add_qkv_bias == (config_cls is Qwen2Config) and not tc.add_bias_linear


def test_megatron_imports_without_compiling_its_fused_functions_on_cpu():
    """compat/megatron's import shim, in a fresh process on this CPU-only machine: megatron's jit fuser is the
    pass-through and its @jit_fuser functions are the plain functions (not torch.compile wrappers), and they compute
    what their formula says (bias + SwiGLU against a hand-written one)."""
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("the shim does nothing where CUDA is available")
    code = (
        "import torch, rltrain.models.megatron\n"
        "import megatron.core.jit as j\n"
        "from megatron.core.fusions import fused_bias_swiglu as f\n"
        "assert j.jit_fuser.__name__ == '_eager' and torch.compile.__name__ == 'compile'\n"
        "assert not hasattr(f.swiglu, '_torchdynamo_orig_callable'), 'a torch.compile wrapper'\n"
        "y = torch.randn(5, 8, dtype=torch.float64)\n"
        "a, b = torch.chunk(y, 2, -1)\n"
        "torch.testing.assert_close(f.swiglu(y), torch.nn.functional.silu(a) * b)\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]
