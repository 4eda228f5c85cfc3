"""Synthetic tool-use traces for the tiny ReTool pipeline: arithmetic a*b+c solved by calling the interpreter.

Must not run code or score answers: the traces hold the tool output a real `print` would give, and the
RL rows hold the ground truth for the `gsm8k` reward (strict "#### n").

One problem, e.g. a=12, b=7, c=3, gives the SFT conversation (rltrain/data/sft_data.py layout):

  user:       "12*7+3"
  assistant:  "<code>print(12*7+3)</code>"        the `code_tag` tool pattern of the rollout
  tool:       "87\\n"                             the sandbox's stdout (print adds the newline)
  assistant:  "#### 87"                           then EOS

and the RL prompt row {"prompt": [user message], "answer": "87", "data_source": "retool_synthetic"}.
Every character is in the 64-token CharTokenizer (it has no backslash or braces, so the tiny task
answers with gsm8k's "#### n" instead of the ReTool recipe's \\boxed{}). The pool of (a, b, c)
triples is shuffled with `seed`; validation rows come first and never appear in SFT or RL training.

Write the files: `python -m rltrain.data.retool_synthetic --out data/retool_tiny` (sft.jsonl,
train.jsonl, val.jsonl).
"""

from __future__ import annotations

import argparse
import os

import numpy as np

DATA_SOURCE = "retool_synthetic"


def problems(max_operand: int = 20, seed: int = 0) -> list[tuple[int, int, int]]:
    """All (a, b, c) with a, b in [2, max_operand] and c in [0, max_operand], shuffled by `seed`."""
    if max_operand < 2:
        raise ValueError(f"max_operand must be >= 2, got {max_operand}")
    grid = [(a, b, c) for a in range(2, max_operand + 1) for b in range(2, max_operand + 1)
            for c in range(0, max_operand + 1)]
    order = np.random.default_rng(seed).permutation(len(grid))
    return [grid[i] for i in order]


def question(a: int, b: int, c: int) -> str:
    return f"{a}*{b}+{c}"


def sft_conversation(a: int, b: int, c: int) -> list[dict]:
    """The messages of one solved trace (see the module docstring)."""
    expr, answer = question(a, b, c), a * b + c
    return [
        {"role": "user", "content": expr},
        {"role": "assistant", "content": f"<code>print({expr})</code>"},
        {"role": "tool", "content": f"{answer}\n"},
        {"role": "assistant", "content": f"#### {answer}"},
    ]


def rl_row(a: int, b: int, c: int) -> dict:
    return {"prompt": [{"role": "user", "content": question(a, b, c)}], "answer": str(a * b + c),
            "data_source": DATA_SOURCE}


def make_splits(*, sft_size: int, train_size: int, val_size: int, max_operand: int = 20,
                seed: int = 0) -> dict[str, list[dict]]:
    """{"sft": [{"messages": ...}], "train": [RL rows], "val": [RL rows]}; val is disjoint from the others.

    SFT and RL-train rows are drawn from the pool after the validation rows (they may overlap each other).
    """
    pool = problems(max_operand, seed)
    if val_size + max(sft_size, train_size) > len(pool):
        raise ValueError(f"asked for val_size={val_size} + max(sft_size={sft_size}, train_size={train_size}) "
                         f"problems but max_operand={max_operand} gives only {len(pool)}; raise max_operand")
    val, rest = pool[:val_size], pool[val_size:]
    return {
        "sft": [{"messages": sft_conversation(*p)} for p in rest[:sft_size]],
        "train": [rl_row(*p) for p in rest[len(rest) - train_size:]],
        "val": [rl_row(*p) for p in val],
    }


def write_splits(out_dir: str, **kwargs) -> dict[str, str]:
    """Write sft.jsonl, train.jsonl and val.jsonl under out_dir; returns split -> path."""
    from rltrain.data.dataset import write_rows

    paths = {}
    for name, rows in make_splits(**kwargs).items():
        paths[name] = os.path.join(out_dir, f"{name}.jsonl")
        write_rows(rows, paths[name])
    return paths


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--sft-size", type=int, default=2000)
    p.add_argument("--train-size", type=int, default=1000)
    p.add_argument("--val-size", type=int, default=64)
    p.add_argument("--max-operand", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    paths = write_splits(a.out, sft_size=a.sft_size, train_size=a.train_size, val_size=a.val_size,
                         max_operand=a.max_operand, seed=a.seed)
    for name, path in paths.items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
