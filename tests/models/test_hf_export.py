"""The one HF writer (models/hf_export.py): what it writes loads in transformers with the same weights and the
same outputs; a tied head is written once; names that are not the architecture's are refused; atomic replaces."""

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from rltrain.models.hf_export import save_hf_checkpoint


def _model(tied: bool):
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, tie_word_embeddings=tied)
    return AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize("tied", [False, True])
def test_written_checkpoint_loads_with_identical_weights_and_logits(tmp_path, tied):
    model = _model(tied)
    out = save_hf_checkpoint(str(tmp_path / "hf"), model.config, model.state_dict())
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert loaded.config.architectures == ["Qwen3ForCausalLM"]
    for (k, a), (k2, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    ids = torch.tensor([[1, 5, 7, 9]])
    assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_dtype_cast_atomic_replace_and_wrong_names(tmp_path):
    model = _model(False)
    target = tmp_path / "hf"
    target.mkdir()
    (target / "stale.txt").write_text("old")
    save_hf_checkpoint(str(target), model.config, model.state_dict(), dtype=torch.bfloat16, atomic=True)
    assert not (target / "stale.txt").exists() and not os.path.exists(str(target) + ".tmp")
    loaded = AutoModelForCausalLM.from_pretrained(str(target), dtype="auto")
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    sd = dict(model.state_dict())
    sd["model.extra.weight"] = sd.pop("model.norm.weight")
    with pytest.raises(AssertionError, match="model.norm.weight"):
        save_hf_checkpoint(str(tmp_path / "bad"), model.config, sd)


@pytest.mark.parametrize("builtin", ["tiny", "qwen3-30b-a3b"])
def test_a_bare_config_is_written_with_the_architecture_a_model_would_record(tmp_path, builtin):
    # model.init=engine starts vLLM from a config alone (dummy weights); vLLM picks its model class by `architectures`,
    # which a bare config lacks: written as a model's own save_pretrained would (the reference: a meta model's class)
    import json

    from rltrain.models.hf_export import write_hf_config
    from rltrain.models.presets import hf_config_for

    cfg = hf_config_for(path=None, builtin=builtin, vocab_size=64)
    assert not cfg.architectures
    with torch.device("meta"):
        expected = type(AutoModelForCausalLM.from_config(cfg)).__name__
    write_hf_config(cfg, str(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [expected]
