"""Convert public RL prompt sets into rltrain's prompt format: the files configs/data/gsm8k.yaml and
configs/data/dapo_math.yaml read. From the Hugging Face Hub, or offline from a local copy of the raw files (--from);
the training code must not import it.

    python -m rltrain.data.prepare gsm8k                         # -> data/gsm8k/train.parquet, test.parquet
    python -m rltrain.data.prepare gsm8k --from ~/raw/gsm8k/main # offline: the raw split files' directory
    python -m rltrain.data.prepare dapo_math                     # -> data/dapo_math/train.parquet
    python -m rltrain.data.prepare dapo_math --set aime2024      # -> data/dapo_math/aime2024.parquet (the val set)
    python -m rltrain.data.prepare dapo_math --from dapo-math-17k.parquet

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
import json
import os
import sys

from rltrain.data.dataset import DataError, read_rows, write_rows

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
    ap = argparse.ArgumentParser(prog="python -m rltrain.data.prepare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
            fail(f"--from {args.local} is one file: name its split, e.g. --splits train")
        for split in args.splits:
            raw = local_rows(args.local, split) if args.local else \
                hub_rows(GSM8K, config="main", split=split, parquet_prefix=f"main/{split}-")
            raw = raw[: args.max_rows]
            out = os.path.join(args.out_dir, f"{split}.{args.format}")
            write_rows(_converted(lambda: [gsm8k_row(r, i, split) for i, r in enumerate(raw)], args.local or GSM8K,
                                  "'question' and an 'answer' ending in '#### <number>'"), out)
            print(f"{split}: {len(raw)} rows -> {out}")
    else:
        repo, default_out = DAPO_SETS[args.which]
        raw = local_rows(args.local, args.which) if args.local else hub_rows(repo)
        rows = _converted(lambda: dapo_rows(raw, args.keep_prompt), args.local or repo,
                          "'prompt' (a list of messages) and 'reward_model': {'ground_truth': ...}")[: args.max_rows]
        write_rows(rows, args.out or default_out)
        print(f"{len(rows)} unique problems -> {args.out or default_out}")


def _converted(convert, source: str, needs: str) -> list[dict]:
    """convert(), or exit 2 naming `source` when its rows are not the raw rows expected (each row needs `needs`)."""
    try:
        return convert()
    except (KeyError, TypeError, IndexError, ValueError) as err:
        fail(f"{source}: not the raw rows expected ({type(err).__name__}: {err}); each row needs {needs}")
    return []


def fail(message: str) -> None:
    """A user's mistake or a missing input: `rltrain.data.prepare: message` on stderr and exit code 2, no traceback."""
    print(f"rltrain.data.prepare: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _offline() -> bool:
    return any(os.environ.get(k, "").lower() in ("1", "true", "yes", "on")
               for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"))


def local_rows(path: str, split: str) -> list[dict]:
    """The raw rows of `split` from a local copy: a .parquet / .jsonl / .json file (JSON lines or one JSON list), or
    a directory holding one whose name starts with the split's (`train-00000-of-00001.parquet`, `test.jsonl`; or
    its only data file). A missing or unreadable input: fail() naming it."""
    suffixes = (".parquet", ".jsonl", ".json")
    if os.path.isdir(path):
        found = sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(suffixes))
        mine = [f for f in found if os.path.basename(f).startswith(split)] or (found if len(found) == 1 else [])
        if len(mine) != 1:
            names = [os.path.relpath(f, path) for f in mine or found][:6]
            fail(f"--from {path}: expected one .parquet/.jsonl file of the {split!r} split (its name starting "
                       f"with {split!r}) in it, found {names}; give the file itself")
        path = mine[0]
    if not os.path.isfile(path):
        fail(f"--from {path}: no such file or directory")
    if path.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if text.lstrip().startswith("["):
            return json.loads(text)
    try:
        return [row for _, row in read_rows(path)]
    except DataError as err:
        fail(f"--from {path}: {err}")
    return []


def hub_rows(repo_id: str, *, config: str | None = None, split: str = "train",
             parquet_prefix: str = "") -> list[dict]:
    """The rows of one split of a Hugging Face dataset: through `datasets` when installed (its cache works
    offline), else its parquet files whose path starts with parquet_prefix, downloaded with huggingface_hub. Without
    the network (or in offline mode with nothing cached): fail() saying how to run from a local copy (--from)."""
    page = f"https://huggingface.co/datasets/{repo_id}"
    offline_fix = (f"without network, download the {split!r} split's file from {page} (Files and versions) on a "
                   "machine that has it, copy it here and rerun this command with --from <that file or its directory>")
    try:
        import datasets
    except ImportError:
        datasets = None
    try:
        if datasets is not None:
            return list(datasets.load_dataset(repo_id, *([config] if config else []), split=split))
        if _offline():
            fail(f"offline mode (HF_HUB_OFFLINE) and no `datasets` cache to read {repo_id} from; {offline_fix}")
        import huggingface_hub
        import pyarrow.parquet as pq

        files = [f for f in huggingface_hub.list_repo_files(repo_id, repo_type="dataset")
                 if f.startswith(parquet_prefix) and f.endswith(".parquet")]
        if not files:
            fail(f"no parquet file under {parquet_prefix or '/'} in {repo_id}")
        rows: list[dict] = []
        for f in sorted(files):
            rows += pq.read_table(huggingface_hub.hf_hub_download(repo_id, f, repo_type="dataset")).to_pylist()
        return rows
    except ImportError as err:
        fail(f"reading {repo_id} from the Hub needs `datasets` or `huggingface_hub` ({err}); or {offline_fix}")
    except Exception as err:  # noqa: BLE001 (no network, a proxy, the Hub down: one line, not the client's traceback)
        first = (str(err).strip().splitlines() or [""])[0][:200]
        fail(f"cannot read {repo_id} from the Hugging Face Hub ({type(err).__name__}: {first}); {offline_fix}")
    return []


if __name__ == "__main__":
    main()
