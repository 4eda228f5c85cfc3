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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rltrain.data.dataset import write_rows  # noqa: E402

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
    try:
        import datasets
    except ImportError:
        datasets = None
    if datasets is not None:
        return list(datasets.load_dataset(REPO_ID, "main", split=split))
    try:
        import huggingface_hub
        import pyarrow.parquet as pq
    except ImportError as e:
        raise SystemExit(f"prepare_gsm8k needs `datasets` or `huggingface_hub` (pip install datasets): {e}")
    files = [f for f in huggingface_hub.list_repo_files(REPO_ID, repo_type="dataset")
             if f.startswith(f"main/{split}-") and f.endswith(".parquet")]
    if not files:
        raise SystemExit(f"no parquet file for split {split!r} under main/ in {REPO_ID}")
    rows: list[dict] = []
    for f in sorted(files):
        rows += pq.read_table(huggingface_hub.hf_hub_download(REPO_ID, f, repo_type="dataset")).to_pylist()
    return rows


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
