"""Synthetic verifiable tasks for the embedded tiny default: prompts generated on the fly from a seed.

Must not score responses (that is `rltrain.rewards.synthetic`) or depend on any download.

Every task shows `length` random digits followed by a task symbol, and the answer is ONE digit:

  copy_last   "482="  -> "2"   the last digit                         (default: easiest to learn)
  successor   "482>"  -> "3"   the last digit plus one, mod 10
  sum_mod10   "482+"  -> "4"   the digit sum mod 10 (4+8+2 = 14)

Why this shape: with the 64-token CharTokenizer a random-init policy emits the right first
character with probability about 1/64 (small but non-zero, so GRPO groups of 8-16 samples get a
signal from step 0), and the rule reads a fixed position, which a 1-2 layer transformer learns
in tens of steps. The checker looks only at the response's first character (see
rewards/synthetic.py), so responses can be 1-8 tokens long.

Held-out split: a prompt belongs to "val" iff crc32(prompt) % 5 == 0, else to "train", so
validation prompts are never seen in training (length=3: ~200 val and ~800 train prompts). Item i
of a split is drawn from numpy's generator seeded with (seed, split, i): random access,
reproducible, and train and val draw from disjoint seeds.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

from rltrain.data.chat import prompt_token_ids, render_prompt


def _copy_last(digits: list[int]) -> int:
    return digits[-1]


def _successor(digits: list[int]) -> int:
    return (digits[-1] + 1) % 10


def _sum_mod10(digits: list[int]) -> int:
    return sum(digits) % 10


# task name -> (symbol ending the prompt, answer digit from the prompt digits)
TASKS = {
    "copy_last": ("=", _copy_last),
    "successor": (">", _successor),
    "sum_mod10": ("+", _sum_mod10),
}
SPLITS = {"train": 0, "val": 1}
_VAL_MODULUS = 5


def prompt_split(prompt: str) -> str:
    """"val" for the held-out fifth of all prompts (by crc32), else "train"."""
    return "val" if zlib.crc32(prompt.encode()) % _VAL_MODULUS == 0 else "train"


class SyntheticTaskDataset(torch.utils.data.Dataset):
    """`size` prompts of `task` for `split`, generated on access; items look like PromptDataset's."""

    def __init__(
        self,
        task: str = "copy_last",
        seed: int = 0,
        size: int = 1024,
        *,
        tokenizer,
        split: str = "train",
        length: int = 3,
        apply_chat_template: bool = False,
        system_prompt: str | None = None,
    ) -> None:
        if task not in TASKS:
            raise ValueError(f"synthetic task must be one of {sorted(TASKS)}, got {task!r}")
        if split not in SPLITS:
            raise ValueError(f"synthetic split must be one of {sorted(SPLITS)}, got {split!r}")
        if not 2 <= length <= 12:
            raise ValueError(f"synthetic length (digits per prompt) must be in [2, 12], got {length}")
        if size <= 0:
            raise ValueError(f"synthetic size must be positive, got {size}")
        self.task, self.seed, self.size, self.split, self.length = task, seed, size, split, length
        self.tokenizer = tokenizer
        self.apply_chat_template = apply_chat_template
        self.system_prompt = system_prompt

    def __len__(self) -> int:
        return self.size

    def sample(self, i: int) -> tuple[str, str]:
        """(raw prompt, answer) of item i, e.g. ("482=", "2")."""
        symbol, rule = TASKS[self.task]
        rng = np.random.default_rng([self.seed, SPLITS[self.split], i])
        while True:  # rejection: ~1.25 draws for train, ~5 for val
            digits = rng.integers(0, 10, size=self.length).tolist()
            raw = "".join(map(str, digits)) + symbol
            if prompt_split(raw) == self.split:
                return raw, str(rule(digits))

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.size:
            raise IndexError(f"index {i} out of range for a synthetic dataset of size {self.size}")
        raw, answer = self.sample(i)
        text = render_prompt(self.tokenizer, raw, apply_chat_template=self.apply_chat_template,
                             system_prompt=self.system_prompt)
        return {
            "prompt_ids": prompt_token_ids(self.tokenizer, text, apply_chat_template=self.apply_chat_template),
            "prompt": text,
            "ground_truth": answer,
            "data_source": f"synthetic/{self.task}",
            "extra": {},
            "index": i,
        }
