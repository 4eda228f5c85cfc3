"""Character-level tokenizer for the embedded tiny default, and `load_tokenizer` for real models.

Must not download anything for "char"; it does not try to be a general tokenizer (64-token vocab:
lowercase letters, digits, a little punctuation; other characters become <unk>).

Vocabulary (ids fixed, `vocab_size == 64`):
  0 <pad>  1 <bos>  2 <eos>  3 <unk>  4 <|system|>  5 <|user|>  6 <|assistant|>  7 <|end|>
  8.. ' ', '\\n', digits 0-9, lowercase a-z, then the punctuation `!"#'()*+,-./:;<=>?`
Uppercase letters are lowered (encoding is lossy for them; decoding returns lowercase).

Chat template (each role marker and <|end|> is ONE token, so prompts stay short):
  <bos><|system|>{system}<|end|><|user|>{user}<|end|><|assistant|>{assistant}<|end|>...
With `add_generation_prompt=True` the text ends with `<|assistant|>` and the model writes the
reply, which ends with <eos> (the rollout stops there).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from rltrain.utils.errors import UserError, remote_code_refusal

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
_ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
_CHARS = " \n" + "0123456789" + "abcdefghijklmnopqrstuvwxyz" + "!\"#'()*+,-./:;<=>?"
_CONFIG_NAME = "char_tokenizer.json"


class CharTokenizer:
    """One token per character; see the module docstring for the vocabulary and chat template."""

    def __init__(self) -> None:
        self.id_to_token: list[str] = SPECIAL_TOKENS + list(_CHARS)
        assert len(self.id_to_token) == 64 and len(set(self.id_to_token)) == 64
        self.token_to_id = {t: i for i, t in enumerate(self.id_to_token)}
        self.pad_token_id = 0
        self.bos_token_id = 1
        self.eos_token_id = 2
        self.unk_token_id = 3
        self.pad_token, self.bos_token, self.eos_token, self.unk_token = SPECIAL_TOKENS[:4]
        self.all_special_ids = list(range(len(SPECIAL_TOKENS)))
        # Lets `chat.render_prompt` treat us like an HF tokenizer that has a template.
        self.chat_template = "rltrain-char"
        self._special_re = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")

    @property
    def vocab_size(self) -> int:
        return len(self.id_to_token)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Text -> ids. Special-token strings in `text` (e.g. "<|user|>") become their single id."""
        ids = [self.bos_token_id] if add_special_tokens else []
        for piece in self._special_re.split(text):
            if piece in self.token_to_id and piece in SPECIAL_TOKENS:
                ids.append(self.token_to_id[piece])
                continue
            for ch in piece.lower():
                ids.append(self.token_to_id.get(ch, self.unk_token_id))
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Ids (list or 1-D tensor) -> text; with skip_special_tokens, specials are dropped."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the CharTokenizer vocabulary [0, {self.vocab_size})")
            if skip_special_tokens and i < len(SPECIAL_TOKENS):
                continue
            out.append(self.id_to_token[i])
        return "".join(out)

    def batch_decode(self, sequences, skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(s, skip_special_tokens=skip_special_tokens) for s in sequences]

    def get_vocab(self) -> dict[str, int]:
        """token -> id, as transformers' tokenizers give it."""
        return dict(self.token_to_id)

    def convert_tokens_to_ids(self, token: str) -> int:
        return self.token_to_id.get(token, self.unk_token_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tokenize: bool = False):
        """Render messages (dicts with "role" in system/user/assistant and "content") with the template
        of the module docstring; returns the text, or its ids when `tokenize=True`."""
        parts = [self.bos_token]
        for i, m in enumerate(messages):
            role = m.get("role") if isinstance(m, dict) else None
            if role not in _ROLE_TOKENS:
                raise ValueError(f"messages[{i}]['role'] must be one of {sorted(_ROLE_TOKENS)}, got {role!r}")
            content = m.get("content")
            if not isinstance(content, str):
                raise ValueError(f"messages[{i}]['content'] must be a string, got {type(content).__name__}")
            parts.append(f"{_ROLE_TOKENS[role]}{content}<|end|>")
        if add_generation_prompt:
            parts.append(_ROLE_TOKENS["assistant"])
        text = "".join(parts)
        return self.encode(text) if tokenize else text

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        """char_tokenizer.json (what rltrain loads) and the same tokenizer in transformers' files (tokenizer.json,
        tokenizer_config.json, the chat template), so `AutoTokenizer.from_pretrained(directory)` of an exported tiny
        model encodes, decodes and renders chats as this class does."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        (path / _CONFIG_NAME).write_text(json.dumps({"type": "char", "vocab": self.id_to_token}, indent=1))
        self.as_transformers().save_pretrained(str(path))

    def as_transformers(self):
        """This tokenizer as a transformers fast tokenizer: a word-level vocabulary over single characters
        (lowercased; an unknown one is <unk>), the special tokens matched whole, pieces joined without spaces."""
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        tok = Tokenizer(models.WordLevel(vocab=dict(self.token_to_id), unk_token=self.unk_token))
        tok.normalizer = normalizers.Lowercase()
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        tok.decoder = decoders.Fuse()
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
        template = ("{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}"
                    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
        return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=self.bos_token, eos_token=self.eos_token,
                                       unk_token=self.unk_token, pad_token=self.pad_token, chat_template=template)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> "CharTokenizer":
        path = Path(directory) / _CONFIG_NAME
        if not path.is_file():
            raise TokenizerNotFoundError(f"no {_CONFIG_NAME} in {directory}: not a saved CharTokenizer")
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))["vocab"]
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as err:
            raise TokenizerNotFoundError(f"tokenizer file {path} is corrupt ({type(err).__name__}: {err}); "
                                         "save the tokenizer again or set model.tokenizer=char") from None
        tok = cls()
        if saved != tok.id_to_token:
            raise TokenizerNotFoundError(f"{path} holds a different character vocabulary than this rltrain version; "
                                         "set model.tokenizer=char")
        return tok


class TokenizerNotFoundError(UserError, ValueError):
    """`model.tokenizer` (or `model.path`) names no tokenizer that can be loaded."""


def is_char_tokenizer_dir(path: str | os.PathLike) -> bool:
    return (Path(path) / _CONFIG_NAME).is_file()


def load_tokenizer(name_or_path: str, *, trust_remote_code: bool = False):
    """"char" -> CharTokenizer; a directory saved by CharTokenizer -> CharTokenizer; anything else
    -> transformers.AutoTokenizer.from_pretrained (a local path that does not exist is an error). A tokenizer with
    custom code (auto_map) is refused unless trust_remote_code (`model.trust_remote_code`); transformers is never left
    to ask on stdin.

    Config key: `model.tokenizer`.
    """
    if name_or_path == "char":
        return CharTokenizer()
    if is_char_tokenizer_dir(name_or_path):
        return CharTokenizer.from_pretrained(name_or_path)
    expanded = os.path.expanduser(name_or_path)
    looks_local = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
    key = "config key `model.tokenizer`, or `model.path` when model.tokenizer is null"
    if looks_local and not os.path.exists(expanded):
        raise TokenizerNotFoundError(
            f"tokenizer path {name_or_path!r} does not exist ({key}): "
            "give an existing directory, a Hugging Face model id, or 'char' for the built-in tokenizer"
        )
    from rltrain.utils.hub import check_model_source

    check_model_source(name_or_path, "model.tokenizer")  # a Hub id that cannot be fetched: the fix now, not retries
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(expanded, trust_remote_code=bool(trust_remote_code))
    except ValueError as e:
        refusal = remote_code_refusal(e, f"tokenizer {name_or_path!r} ({key})")
        if refusal is not None:
            raise TokenizerNotFoundError(refusal) from None
        raise TokenizerNotFoundError(f"could not load tokenizer {name_or_path!r} ({key}): {_one_line(e)}") from None
    except OSError as e:
        raise TokenizerNotFoundError(f"could not load tokenizer {name_or_path!r} ({key}): {_one_line(e)}") from None
    except Exception as e:  # the tokenizers library's parse errors of a corrupt tokenizer.json are bare Exceptions
        raise TokenizerNotFoundError(f"could not load tokenizer {name_or_path!r} ({key}): its files look corrupt "
                                     f"({type(e).__name__}: {_one_line(e)}); download or save the tokenizer again"
                                     ) from None


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text[:400] + ("..." if len(text) > 400 else "")
