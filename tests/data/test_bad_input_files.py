"""Input files a user gets wrong end as one UserError (exit 2 through the entry points) naming the file and the
fix: deeply nested rows, a data path that is a directory, an empty data file, a role the chat template cannot
render, a tokenizer without a chat template or with a corrupt file, a model directory without weights or with a
truncated safetensors file, a reward module that blocks or exits at import."""

import json
import os
import struct

import pytest

from rltrain.data.chat import ChatTemplateError, render_prompt
from rltrain.data.dataset import DataError, PromptDataset, read_rows
from rltrain.data.sft_data import SFTDataset
from rltrain.data.tokenizer import CharTokenizer, TokenizerNotFoundError, load_tokenizer
from rltrain.models.checkpoint_files import ModelFilesError, check_model_dir
from rltrain.rewards.loader import RewardFnError, load_function
from rltrain.utils.errors import UserError


def _ds(path, **kw):
    return PromptDataset(path, tokenizer=CharTokenizer(), max_prompt_length=64, **kw)


def test_deeply_nested_rows_are_refused_by_line(tmp_path):
    f = tmp_path / "deep.jsonl"
    f.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n"
                 + '{"prompt": "1+1=", "answer": "2", "extra_info": {"x": ' + "[" * 100_000 + "]" * 100_000 + "}}\n")
    with pytest.raises(DataError, match=rf"{f}:2: the row is nested too deeply to parse"):
        read_rows(f)
    g = tmp_path / "deep2.jsonl"  # parses, but deeper than anything a row needs
    g.write_text('{"prompt": "1=", "answer": "1", "extra_info": {"x": ' + "[" * 200 + "]" * 200 + "}}\n")
    with pytest.raises(DataError, match=rf"{g}:1: the row is nested \d+ levels deep \(at most 64\); flatten it"):
        read_rows(g)


def test_a_data_path_that_is_a_directory_says_so(tmp_path):
    (tmp_path / "shard-0.jsonl").write_text('{"prompt": "1=", "answer": "1"}\n')
    with pytest.raises(DataError, match=r"is a directory, not a file \(it holds shard-0.jsonl\); list the .jsonl"):
        read_rows(tmp_path)


@pytest.mark.parametrize("content", ["", "\n\n"])
def test_an_empty_data_file_is_called_empty_not_too_long(tmp_path, content):
    f = tmp_path / "empty.jsonl"
    f.write_text(content)
    with pytest.raises(DataError) as info:
        _ds(f)
    assert "holds no rows (it is empty)" in str(info.value) and "max_prompt_length" not in str(info.value)
    with pytest.raises(DataError, match="holds no rows"):
        SFTDataset([str(f)], tokenizer=CharTokenizer(), max_length=64)


def test_a_tool_role_under_the_builtin_tokenizer_names_the_row(tmp_path):
    f = tmp_path / "tool.jsonl"
    rows = [{"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"},
            {"prompt": [{"role": "user", "content": "2+2="}, {"role": "tool", "content": "4"}], "answer": "4"}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(DataError) as info:
        _ds(f)
    msg = str(info.value)
    assert msg.startswith(f"{f}:2: key 'prompt': the chat template of the tokenizer (CharTokenizer) cannot render "
                          "a prompt with roles ['user', 'tool']"), msg
    assert "data.apply_chat_template=false" in msg


def _hf_tokenizer_dir(path, *, chat_template=None):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, "hello": 2, "world": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(str(path))
    return path


def test_a_tokenizer_without_a_chat_template_is_a_user_error(tmp_path):
    tok = load_tokenizer(str(_hf_tokenizer_dir(tmp_path / "tok")))
    with pytest.raises(ChatTemplateError, match="has no chat template; set data.apply_chat_template=false"):
        render_prompt(tok, "hello", apply_chat_template=True)
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "hello", "answer": "1"}\n')
    with pytest.raises(DataError, match=f"{f}:1: key 'prompt': the tokenizer .* has no chat template"):
        PromptDataset(f, tokenizer=tok, max_prompt_length=64)
    assert issubclass(ChatTemplateError, UserError)


def test_a_corrupt_tokenizer_file_is_a_user_error(tmp_path):
    d = _hf_tokenizer_dir(tmp_path / "tok")
    (d / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "nonsense"')
    with pytest.raises(TokenizerNotFoundError, match=f"could not load tokenizer '{d}'"):
        load_tokenizer(str(d))
    c = tmp_path / "char"
    CharTokenizer().save_pretrained(c)
    (c / "char_tokenizer.json").write_text('{"vocab": [')
    with pytest.raises(TokenizerNotFoundError, match="char_tokenizer.json is corrupt"):
        load_tokenizer(str(c))


def _safetensors(path, tensors):
    from safetensors.torch import save_file

    save_file(tensors, str(path))


def _model_dir(tmp_path):
    import torch

    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": 8}))
    _safetensors(d / "model.safetensors", {"a": torch.zeros(64, 64), "b": torch.ones(8)})
    return d


def test_a_complete_model_dir_passes(tmp_path):
    check_model_dir(str(_model_dir(tmp_path)))
    with pytest.raises(UserError, match="does not exist; fix model.path"):
        check_model_dir(str(tmp_path / "not-a-dir"))  # a missing local path, before any hub client (utils/hub.py)


def test_a_model_dir_without_weights_is_a_user_error(tmp_path):
    d = _model_dir(tmp_path)
    os.remove(d / "model.safetensors")
    with pytest.raises(ModelFilesError, match=rf"model.path='{d}': no \*.safetensors weight files"):
        check_model_dir(str(d))
    (d / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ModelFilesError, match="it has pytorch_model.bin: convert them to safetensors"):
        check_model_dir(str(d))
    os.remove(d / "config.json")
    with pytest.raises(ModelFilesError, match="no config.json"):
        check_model_dir(str(d))


def test_a_truncated_or_corrupt_safetensors_file_is_a_user_error(tmp_path):
    d = _model_dir(tmp_path)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 100])
    with pytest.raises(ModelFilesError, match=r"model.safetensors is truncated: its header needs \d+ bytes"):
        check_model_dir(str(d))
    f.write_bytes(data[:20])
    with pytest.raises(ModelFilesError, match="not a complete safetensors file"):
        check_model_dir(str(d))
    f.write_bytes(struct.pack("<Q", 10) + b"{not json}" + b"\0" * 100)
    with pytest.raises(ModelFilesError, match="unreadable safetensors header"):
        check_model_dir(str(d))


def test_a_sharded_model_missing_a_shard_is_a_user_error(tmp_path):
    d = _model_dir(tmp_path)
    os.rename(d / "model.safetensors", d / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
                            "c": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelFilesError, match="1 of the 2 weight files its index names are missing"):
        check_model_dir(str(d))


def test_a_reward_module_that_blocks_at_import_is_reported_not_hung(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RLTRAIN_REWARD_IMPORT_TIMEOUT_S", "1")
    f = tmp_path / "blocking_reward.py"
    f.write_text("import threading\nthreading.Event().wait()\ndef r(*a, **k):\n    return 1.0\n")
    with pytest.raises(RewardFnError, match=r"importing .*blocking_reward.py' did not finish in 1 s"):
        load_function(f"{f}:r")


def test_a_reward_module_that_exits_at_import_is_a_user_error(tmp_path):
    f = tmp_path / "exiting_reward.py"
    f.write_text("import sys\nsys.exit(0)\ndef r(*a, **k):\n    return 1.0\n")
    with pytest.raises(RewardFnError, match=r"called sys.exit\(0\), which would end the run"):
        load_function(f"{f}:r")
    g = tmp_path / "fine_reward.py"
    g.write_text("def r(*a, **k):\n    return 1.0\n")
    assert load_function(f"{g}:r")("x", "y") == 1.0


def test_a_sharded_transformers_save_passes(tmp_path):
    """No false alarm on what transformers writes: shards + model.safetensors.index.json."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(tmp_path / "m"), max_shard_size="20KB")
    shards = [f for f in os.listdir(tmp_path / "m") if f.endswith(".safetensors")]
    assert len(shards) > 1 and (tmp_path / "m" / "model.safetensors.index.json").exists()
    check_model_dir(str(tmp_path / "m"))
    os.truncate(tmp_path / "m" / sorted(shards)[-1], 50)
    with pytest.raises(ModelFilesError, match="truncated|not a complete safetensors file"):
        check_model_dir(str(tmp_path / "m"))
