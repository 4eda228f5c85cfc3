"""Train a byte-level BPE tokenizer on local chat data and save it as a transformers tokenizer directory.

Nothing is downloaded: the `tokenizers` library learns the merges from the given files' text. The directory
(tokenizer.json + tokenizer_config.json + the chat template) loads with `AutoTokenizer.from_pretrained`, so
`model.tokenizer=<dir>` (rltrain.data.tokenizer.load_tokenizer) and `rltrain.sft`'s export use it as is.

Choices (the ones Qwen's tokenizer makes, scaled down): bytes are the base alphabet, so any text encodes and
there is no <unk>; every digit is its own token (numbers are read digit by digit, which arithmetic needs);
the GPT-2 split regex keeps words, spaces and punctuation apart before merging. Special tokens:
`<|endoftext|>` (padding), `<|im_start|>`, `<|im_end|>` (end of a turn: the EOS the rollout stops on).
Chat template: `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message, then `<|im_start|>assistant\\n`
as the generation prompt.

Text used: every message of the rows' "messages" (SFT conversations: tool messages rendered with the
rollout's output template) and "prompt" (RL prompt rows) of the given .jsonl files. Held-out files should
not be passed.

  python -m rltrain.data.train_tokenizer --files data/learn/add/sft.jsonl data/learn/add/train.jsonl \\
      --out data/learn/tokenizer --vocab-size 512
"""

from __future__ import annotations

import argparse
import json
import os
import sys

BPE_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def corpus(paths: list[str]):
    """Yield the texts of every message / prompt of the rows of `paths` (.jsonl)."""
    from rltrain.data.dataset import read_rows
    from rltrain.data.sft_data import DEFAULT_TOOL_OUTPUT_TEMPLATE

    for path in paths:
        for _, row in read_rows(path):
            messages = row.get("messages") or row.get("prompt") or []
            if isinstance(messages, str):
                messages = [{"role": "user", "content": messages}]
            for m in messages:
                content = m["content"]
                if m["role"] == "tool":
                    content = DEFAULT_TOOL_OUTPUT_TEMPLATE.replace("{output}", content)
                yield f"{m['role']}\n{content}"


def train_tokenizer(texts, out_dir: str, *, vocab_size: int = 512, min_frequency: int = 2):
    """Learn byte-level BPE merges from `texts` (an iterable of str); save and return the HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(BPE_SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {256 + len(BPE_SPECIAL_TOKENS)} (256 bytes + special tokens), "
                         f"got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=BPE_SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False)
    os.makedirs(out_dir, exist_ok=True)
    hf.save_pretrained(out_dir)
    return hf


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m rltrain.data.train_tokenizer", description=__doc__.splitlines()[0])
    p.add_argument("--files", nargs="+", required=True, help=".jsonl files of chat rows (messages or prompt)")
    p.add_argument("--out", required=True, help="output directory (HF tokenizer)")
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--min-frequency", type=int, default=2)
    a = p.parse_args(argv)
    try:
        hf = train_tokenizer(corpus(a.files), a.out, vocab_size=a.vocab_size, min_frequency=a.min_frequency)
    except ValueError as err:
        print(f"rltrain.data.train_tokenizer: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(json.dumps({"out": os.path.abspath(a.out), "vocab_size": len(hf)}))


if __name__ == "__main__":
    main()
