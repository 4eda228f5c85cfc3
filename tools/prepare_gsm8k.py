"""Convert GSM8K (Hugging Face `openai/gsm8k`, config "main") into rltrain's prompt format.

Needs network access (the Hugging Face Hub); it must not be imported by the training code.

    python tools/prepare_gsm8k.py --out-dir data/gsm8k            # -> train.jsonl, test.jsonl
    python tools/prepare_gsm8k.py --out-dir data/gsm8k --format parquet

Uses the `datasets` library when installed, otherwise downloads the parquet files with
`huggingface_hub`. Output rows (see tests/data/gsm8k_sample.jsonl):
  {"data_source": "openai/gsm8k",
   "prompt": [{"role": "user", "content": "<question> Let's think step by step and output the final answer after \\"####\\"."}],
   "answer": "72",                       # the number after "####" in the reference solution, commas removed
   "extra_info": {"split": "train", "index": 0, "question": "...", "solution": "<full reference solution>"}}
Train on it with `data.prompt_key=prompt data.answer_key=answer reward.fn=gsm8k`.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/, for the harness
from harness import hub_rows

from rltrain.data.dataset import write_rows

REPO_ID = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def convert_row(row: dict, index: int, split: str) -> dict:
    """One `openai/gsm8k` row ({"question", "answer"}) -> our row."""
    solution = row["answer"]
    if "####" not in solution:
        raise ValueError(f"gsm8k {split} row {index}: reference solution has no '####' answer marker")
    answer = solution.split("####")[-1].strip().replace(",", "")
    return {
        "data_source": REPO_ID,
        "prompt": [{"role": "user", "content": f"{row['question']} {INSTRUCTION}"}],
        "answer": answer,
        "extra_info": {"split": split, "index": index, "question": row["question"], "solution": solution},
    }


def load_split(split: str) -> list[dict]:
    return hub_rows("prepare_gsm8k", REPO_ID, config="main", split=split, parquet_prefix=f"main/{split}-")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default="data/gsm8k")
    ap.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl")
    ap.add_argument("--splits", nargs="+", default=["train", "test"])
    ap.add_argument("--max-rows", type=int, default=None, help="keep only the first N rows of each split")
    args = ap.parse_args()
    for split in args.splits:
        raw = load_split(split)[: args.max_rows]
        out = os.path.join(args.out_dir, f"{split}.{args.format}")
        write_rows([convert_row(r, i, split) for i, r in enumerate(raw)], out)
        print(f"{split}: {len(raw)} rows -> {out}")


if __name__ == "__main__":
    main()
