"""Convert DAPO-Math-17k (Hugging Face `BytedTsinghua-SIA/DAPO-Math-17k`) into rltrain's prompt format.

Needs network access (the Hugging Face Hub); it must not be imported by the training code.

    python tools/prepare_dapo_math.py --out data/dapo_math/train.parquet

The published file repeats each problem many times; rows are de-duplicated by problem text.
DAPO's prompt asks for an "Answer: ..." line; we keep the problem and ask for `\\boxed{}` instead,
which the `math_dapo`, `retool` and `math` rewards read (`--keep-prompt` keeps the original).
Uses `datasets` when installed, else `huggingface_hub`. Output rows (tests/data/dapo_math_sample.parquet):
  {"data_source": "math_dapo",
   "prompt": [{"role": "user", "content": "<problem>\\n\\nPlease reason step by step, and put your final answer within \\\\boxed{}."}],
   "answer": "34",
   "extra_info": {"index": "<original extra_info.index>"}}
Train on it with `reward.fn=math_dapo` (or `retool` with the tool loop).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/, for the harness
from harness import hub_rows

from rltrain.data.dataset import write_rows

REPO_ID = "BytedTsinghua-SIA/DAPO-Math-17k"
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
_PREFIX = ("Solve the following math problem step by step. The last line of your response should be of the form "
           "Answer: $Answer (without quotes) where $Answer is the answer to the problem.")
_SUFFIX = 'Remember to put your answer on its own line after "Answer:".'


def extract_problem(content: str) -> str:
    """The problem text of a DAPO prompt, without its "Answer:" formatting instructions."""
    text = content.strip()
    if text.startswith(_PREFIX):
        text = text[len(_PREFIX):]
    if text.endswith(_SUFFIX):
        text = text[: -len(_SUFFIX)]
    return text.strip()


def convert_row(row: dict, keep_prompt: bool = False) -> dict:
    """One DAPO row ({"prompt": [messages], "reward_model": {"ground_truth"}, "extra_info"}) -> our row."""
    content = row["prompt"][-1]["content"]
    prompt = content if keep_prompt else f"{extract_problem(content)}\n\n{INSTRUCTION}"
    return {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": prompt}],
        "answer": str(row["reward_model"]["ground_truth"]),
        "extra_info": {"index": str((row.get("extra_info") or {}).get("index", ""))},
    }


def convert_rows(raw: list[dict], keep_prompt: bool = False) -> list[dict]:
    seen: set[str] = set()
    out = []
    for row in raw:
        key = row["prompt"][-1]["content"]
        if key in seen:
            continue
        seen.add(key)
        out.append(convert_row(row, keep_prompt))
    return out


def load_rows() -> list[dict]:
    return hub_rows("prepare_dapo_math", REPO_ID)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="data/dapo_math/train.parquet", help=".parquet or .jsonl")
    ap.add_argument("--max-rows", type=int, default=None, help="keep only the first N unique problems")
    ap.add_argument("--keep-prompt", action="store_true", help="keep DAPO's original 'Answer:' prompt")
    args = ap.parse_args()
    rows = convert_rows(load_rows(), args.keep_prompt)[: args.max_rows]
    write_rows(rows, args.out)
    print(f"{len(rows)} unique problems -> {args.out}")


if __name__ == "__main__":
    main()
