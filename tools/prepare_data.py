"""Convert public RL prompt sets into rltrain's prompt format: the files configs/data/gsm8k.yaml and
configs/data/dapo_math.yaml read. From the Hugging Face Hub, or offline from a local copy of the raw files (--from);
the training code must not import it.

    python tools/prepare_data.py gsm8k                         # -> data/gsm8k/train.parquet, test.parquet
    python tools/prepare_data.py gsm8k --from ~/raw/gsm8k/main # offline: the raw split files' directory
    python tools/prepare_data.py dapo_math                     # -> data/dapo_math/train.parquet
    python tools/prepare_data.py dapo_math --set aime2024      # -> data/dapo_math/aime2024.parquet (the val set)
    python tools/prepare_data.py dapo_math --from dapo-math-17k.parquet

gsm8k (`openai/gsm8k`, config "main"; raw files main/train-00000-of-00001.parquet and main/test-...): the answer
is the number after "####" in the reference solution, commas removed (tests/data/gsm8k_sample.jsonl):
  {"data_source": "openai/gsm8k",
   "prompt": [{"role": "user", "content": "<question> Let's think step by step and output the final answer after \\"####\\"."}],
   "answer": "72",
   "extra_info": {"split": "train", "index": 0, "question": "...", "solution": "<full reference solution>"}}
Train on it with `--config-name grpo_qwen3` (data: gsm8k, reward.fn=gsm8k).

dapo_math (`BytedTsinghua-SIA/DAPO-Math-17k`, raw file data/dapo-math-17k.parquet; `--set aime2024`: DAPO's AIME 2024
set `BytedTsinghua-SIA/AIME-2024`, the same format): the published files repeat each problem many times; rows are
de-duplicated by problem text. DAPO's prompt asks for an "Answer: ..." line; we keep the problem and ask for
`\\boxed{}` instead, which the `math_dapo`, `retool` and `math` rewards read (`--keep-prompt` keeps the original)
(tests/data/dapo_math_sample.parquet):
  {"data_source": "math_dapo",
   "prompt": [{"role": "user", "content": "<problem>\\n\\nPlease reason step by step, and put your final answer within \\\\boxed{}."}],
   "answer": "34",
   "extra_info": {"index": "<original extra_info.index>"}}
Train on it with `reward.fn=math_dapo` (or `retool` with the tool loop).

From the Hub: through `datasets` when installed (its cache also works offline), else `huggingface_hub`. No
network, or offline mode with nothing cached: exit 2 saying how to use --from. `--from` takes a .parquet / .jsonl
file (or a .json list of raw rows), or a directory where each split's file is found by its name.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/, for the harness
from harness import fail, hub_rows, local_rows

from rltrain.data.dataset import write_rows

GSM8K = "openai/gsm8k"
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
DAPO = "BytedTsinghua-SIA/DAPO-Math-17k"
DAPO_SETS = {"train": (DAPO, "data/dapo_math/train.parquet"),  # --set: (Hub dataset, default --out)
             "aime2024": ("BytedTsinghua-SIA/AIME-2024", "data/dapo_math/aime2024.parquet")}
DAPO_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
_DAPO_PREFIX = ("Solve the following math problem step by step. The last line of your response should be of the form "
                "Answer: $Answer (without quotes) where $Answer is the answer to the problem.")
_DAPO_SUFFIX = 'Remember to put your answer on its own line after "Answer:".'


def gsm8k_row(row: dict, index: int, split: str) -> dict:
    """One `openai/gsm8k` row ({"question", "answer"}) -> our row."""
    solution = row["answer"]
    if "####" not in solution:
        raise ValueError(f"gsm8k {split} row {index}: reference solution has no '####' answer marker")
    answer = solution.split("####")[-1].strip().replace(",", "")
    return {
        "data_source": GSM8K,
        "prompt": [{"role": "user", "content": f"{row['question']} {GSM8K_INSTRUCTION}"}],
        "answer": answer,
        "extra_info": {"split": split, "index": index, "question": row["question"], "solution": solution},
    }


def dapo_problem(content: str) -> str:
    """The problem text of a DAPO prompt, without its "Answer:" formatting instructions."""
    text = content.strip()
    if text.startswith(_DAPO_PREFIX):
        text = text[len(_DAPO_PREFIX):]
    if text.endswith(_DAPO_SUFFIX):
        text = text[: -len(_DAPO_SUFFIX)]
    return text.strip()


def dapo_row(row: dict, keep_prompt: bool = False) -> dict:
    """One DAPO row ({"prompt": [messages], "reward_model": {"ground_truth"}, "extra_info"}) -> our row."""
    content = row["prompt"][-1]["content"]
    prompt = content if keep_prompt else f"{dapo_problem(content)}\n\n{DAPO_INSTRUCTION}"
    return {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": prompt}],
        "answer": str(row["reward_model"]["ground_truth"]),
        "extra_info": {"index": str((row.get("extra_info") or {}).get("index", ""))},
    }


def dapo_rows(raw: list[dict], keep_prompt: bool = False) -> list[dict]:
    """dapo_row of each problem once (the first row of each prompt text)."""
    seen: set[str] = set()
    out = []
    for row in raw:
        key = row["prompt"][-1]["content"]
        if key in seen:
            continue
        seen.add(key)
        out.append(dapo_row(row, keep_prompt))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="dataset", required=True)
    g = sub.add_parser("gsm8k", help=f"{GSM8K} -> <out-dir>/<split>.<format>")
    g.add_argument("--out-dir", default="data/gsm8k")
    g.add_argument("--format", choices=["jsonl", "parquet"], default="parquet")
    g.add_argument("--splits", nargs="+", default=["train", "test"])
    g.add_argument("--max-rows", type=int, default=None, help="keep only the first N rows of each split")
    d = sub.add_parser("dapo_math", help=f"{DAPO} (or --set aime2024) -> --out")
    d.add_argument("--set", dest="which", choices=list(DAPO_SETS), default="train",
                   help="train: DAPO-Math-17k; aime2024: DAPO's AIME 2024 validation set")
    d.add_argument("--out", default=None,
                   help=".parquet or .jsonl (default: the file configs/data/dapo_math.yaml reads)")
    d.add_argument("--max-rows", type=int, default=None, help="keep only the first N unique problems")
    d.add_argument("--keep-prompt", action="store_true", help="keep DAPO's original 'Answer:' prompt")
    for p in (g, d):
        p.add_argument("--from", dest="local", default=None,
                       help="a local copy of the raw files: a file (gsm8k: with one --splits name) or a directory")
    args = ap.parse_args(argv)
    if args.dataset == "gsm8k":
        if args.local and os.path.isfile(args.local) and len(args.splits) != 1:
            fail("prepare_data", f"--from {args.local} is one file: name its split, e.g. --splits train")
        for split in args.splits:
            raw = local_rows("prepare_data", args.local, split) if args.local else \
                hub_rows("prepare_data", GSM8K, config="main", split=split, parquet_prefix=f"main/{split}-")
            raw = raw[: args.max_rows]
            out = os.path.join(args.out_dir, f"{split}.{args.format}")
            write_rows(_converted(lambda: [gsm8k_row(r, i, split) for i, r in enumerate(raw)], args.local or GSM8K,
                                  "'question' and an 'answer' ending in '#### <number>'"), out)
            print(f"{split}: {len(raw)} rows -> {out}")
    else:
        repo, default_out = DAPO_SETS[args.which]
        raw = local_rows("prepare_data", args.local, args.which) if args.local else hub_rows("prepare_data", repo)
        rows = _converted(lambda: dapo_rows(raw, args.keep_prompt), args.local or repo,
                          "'prompt' (a list of messages) and 'reward_model': {'ground_truth': ...}")[: args.max_rows]
        write_rows(rows, args.out or default_out)
        print(f"{len(rows)} unique problems -> {args.out or default_out}")


def _converted(convert, source: str, needs: str) -> list[dict]:
    """convert(), or exit 2 naming `source` when its rows are not the raw rows expected (each row needs `needs`)."""
    try:
        return convert()
    except (KeyError, TypeError, IndexError, ValueError) as err:
        fail("prepare_data", f"{source}: not the raw rows expected ({type(err).__name__}: {err}); each row needs "
                             f"{needs}")
    return []


if __name__ == "__main__":
    main()
