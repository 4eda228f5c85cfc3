"""Write a small prompt data set in rltrain's row format, both ways a prompt can be given (docs/guide/data.md).

    python examples/own_data/make_rows.py --out data/own

train.jsonl: prompts as chat messages; val.parquet: prompts as plain strings (the chat template wraps them as one
user message). The task, sized for the built-in tiny model: the largest of three digits ("max 4 8 2" -> "8").
Each row: {"prompt": ..., "answer": "8", "data_source": "max3", "extra_info": {...}}.
"""

import argparse
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from rltrain.data.dataset import write_rows  # noqa: E402  (.jsonl or .parquet by the extension)


def row(digits: list[int], chat: bool) -> dict:
    question = "max " + " ".join(map(str, digits))
    return {"prompt": [{"role": "user", "content": question}] if chat else question,
            "answer": str(max(digits)),
            "data_source": "max3",  # validation accuracy is logged as val/max3/accuracy
            "extra_info": {"digits": digits}}  # handed to the reward function as `extra`


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="data/own")
    ap.add_argument("--train-size", type=int, default=2000)
    ap.add_argument("--val-size", type=int, default=100)
    args = ap.parse_args()
    rng = random.Random(0)
    rows = [[rng.randrange(10) for _ in range(3)] for _ in range(args.train_size + args.val_size)]
    write_rows([row(d, chat=True) for d in rows[:args.train_size]], os.path.join(args.out, "train.jsonl"))
    write_rows([row(d, chat=False) for d in rows[args.train_size:]], os.path.join(args.out, "val.parquet"))
    print(f"{args.train_size} rows -> {args.out}/train.jsonl, {args.val_size} rows -> {args.out}/val.parquet")


if __name__ == "__main__":
    main()
