"""rltrain.models.hf: building transformers models from a config or a local path."""

import pytest
import torch

from rltrain.models.hf import build_hf_causal_lm, load_hf_config
from rltrain.models.megatron.tiny import tiny_qwen3_config


def test_missing_model_path_names_the_config_key(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.path"):
        load_hf_config(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="model.path"):
        build_hf_causal_lm(str(tmp_path))  # exists but has no config.json


def test_saved_model_reloads_with_the_same_weights(tmp_path):
    torch.manual_seed(0)
    model = build_hf_causal_lm(tiny_qwen3_config(53, num_hidden_layers=1))
    model.save_pretrained(tmp_path)
    again = build_hf_causal_lm(str(tmp_path))
    ids = torch.randint(0, 53, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits)
    assert load_hf_config(tmp_path).vocab_size == 53
