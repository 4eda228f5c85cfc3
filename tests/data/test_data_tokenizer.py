"""CharTokenizer, load_tokenizer and chat-template rendering."""

import pytest

from rltrain.data.chat import render_prompt
from rltrain.data.tokenizer import SPECIAL_TOKENS, CharTokenizer, load_tokenizer


def test_char_vocab_is_small_and_every_character_round_trips():
    tok = CharTokenizer()
    assert tok.vocab_size == 64 and len(tok) == 64
    chars = "".join(tok.id_to_token[len(SPECIAL_TOKENS):])
    ids = tok.encode(chars)
    assert ids == list(range(len(SPECIAL_TOKENS), 64))
    assert tok.decode(ids) == chars


def test_char_encode_hand_worked_example_with_specials_unknowns_and_uppercase():
    tok = CharTokenizer()
    # '1' -> 8 + 2 + 1 = 11 (specials 0-7, ' ' = 8, '\n' = 9, digits from 10), 'a' -> 20, '@' unknown
    assert tok.encode("1a") == [11, 20]
    assert tok.encode("A@", add_special_tokens=True) == [tok.bos_token_id, 20, tok.unk_token_id]
    assert tok.encode("<|user|>hi<|end|>") == [5, tok.token_to_id["h"], tok.token_to_id["i"], 7]
    ids = [tok.bos_token_id, 11, tok.eos_token_id, tok.pad_token_id]
    assert tok.decode(ids) == "1"
    assert tok.decode(ids, skip_special_tokens=False) == "<bos>1<eos><pad>"
    with pytest.raises(ValueError, match="outside"):
        tok.decode([64])


def test_char_chat_template_matches_documented_format():
    tok = CharTokenizer()
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "<bos><|system|>be brief<|end|><|user|>2+2?<|end|><|assistant|>"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("<|end|>")
    ids = tok.apply_chat_template(msgs, tokenize=True)
    assert ids == tok.encode(text) and ids[0] == tok.bos_token_id and ids[-1] == 6
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])


def test_char_save_and_load(tmp_path):
    tok = CharTokenizer()
    tok.save_pretrained(tmp_path / "tok")
    again = load_tokenizer(str(tmp_path / "tok"))
    assert isinstance(again, CharTokenizer) and again.id_to_token == tok.id_to_token
    assert isinstance(load_tokenizer("char"), CharTokenizer)


def test_a_saved_char_tokenizer_loads_in_autotokenizer_as_itself(tmp_path):
    """An exported tiny model's directory (config.json of a qwen3 model beside the tokenizer) loads in transformers'
    AutoTokenizer as the same tokenizer: ids, special tokens whole, decoding and the chat template."""
    from transformers import AutoTokenizer

    tok = CharTokenizer()
    tok.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert (hf.vocab_size, len(hf), hf.eos_token_id, hf.pad_token_id) == (64, 64, 2, 0)
    text = "<|user|>Hello, 482=?\n~<|end|><|assistant|>"  # upper case lowered, '~' unknown
    assert hf.encode(text, add_special_tokens=False) == tok.encode(text)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "12*7+3="}]
    rendered = tok.apply_chat_template(msgs)
    assert hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == rendered
    ids = tok.encode(rendered + "87")
    assert hf.decode(ids, skip_special_tokens=True) == tok.decode(ids) == "be brief12*7+3=87"
    assert hf.decode(ids) == tok.decode(ids, skip_special_tokens=False)
    assert isinstance(load_tokenizer(str(tmp_path)), CharTokenizer)  # rltrain itself still loads its own


def test_load_tokenizer_missing_path_names_path_and_config_key(tmp_path):
    missing = str(tmp_path / "no_such_model")
    with pytest.raises(ValueError, match="model.tokenizer") as e:
        load_tokenizer(missing)
    assert missing in str(e.value)


def _hf_tokenizer_with_template():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "[PAD]", "<s>", "hello", "world", "sys"])}
    inner = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    inner.pre_tokenizer = Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="[UNK]", pad_token="[PAD]")
    tok.chat_template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}[assistant] {% endif %}")
    return tok


def test_render_prompt_uses_the_hf_tokenizers_own_chat_template():
    tok = _hf_tokenizer_with_template()
    text = render_prompt(tok, "hello world", apply_chat_template=True, system_prompt="sys")
    assert text == "[system] sys\n[user] hello world\n[assistant] "
    assert render_prompt(tok, "hello world", apply_chat_template=False, system_prompt="sys") == "sys\nhello world"
    tok.chat_template = None
    with pytest.raises(ValueError, match="apply_chat_template"):
        render_prompt(tok, "hello", apply_chat_template=True)
