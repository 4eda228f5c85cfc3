"""Prompt datasets from jsonl/parquet, the resumable sampler, and `n` samples per prompt.

Must not generate or score: a dataset yields prompt items, the sampler yields which ones, nothing else.

A row (one json line or parquet row) holds a prompt (string, or a list of {"role", "content"}
messages), a ground-truth answer (string or number) and optionally a data source; key names are
configurable and may be dotted paths into nested dicts (verl's `reward_model.ground_truth`). An
`extra_info` dict, when present, is passed through to the reward function as `extra`.

Each item is a dict: prompt_ids (list[int]), prompt (rendered text), ground_truth (str),
data_source (str), extra (dict), index (0-based row number in the file, counting dropped rows).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from rltrain.data.chat import ChatTemplateError, prompt_token_ids, render_prompt
from rltrain.utils.errors import UserError

logger = logging.getLogger(__name__)

_MISSING = object()
# the recipes' data files (configs/) and the command that makes each: a missing one names it
PREPARE = {"data/retool_tiny/": "python -m rltrain.data.retool_synthetic --out data/retool_tiny",
           "data/gsm8k/": "python -m rltrain.data.prepare gsm8k",
           "data/dapo_math/aime2024": "python -m rltrain.data.prepare dapo_math --set aime2024",
           "data/dapo_math/": "python -m rltrain.data.prepare dapo_math"}
MAX_NESTING = 64  # deeper rows are refused: nothing a prompt needs is that deep, and deeper ones break pickling


class DataError(UserError, ValueError):
    """A data file the user gave is missing or malformed; the message names the file, line and key."""


def read_rows(path: str | os.PathLike) -> list[tuple[int, dict]]:
    """(line number or 1-based row number, row dict) for every row of a .jsonl/.json lines or .parquet file."""
    path = Path(path)
    if path.is_dir():
        inside = sorted(p.name for p in path.iterdir() if p.suffix.lower() in (".jsonl", ".json", ".parquet"))[:3]
        hint = f" (it holds {', '.join(inside)}{', ...' if len(inside) == 3 else ''})" if inside else ""
        raise DataError(f"data file {str(path)!r} is a directory, not a file{hint}; list the .jsonl / .parquet "
                        "files themselves in data.train_files / data.val_files")
    if not path.is_file():
        make = next((cmd for prefix, cmd in PREPARE.items() if path.as_posix().lstrip("./").startswith(prefix)), None)
        raise DataError(f"data file {str(path)!r} does not exist; " + (f"make it with `{make}` (from the repository "
                        "root), or fix" if make else "fix") + " the path in data.train_files / data.val_files")
    try:
        rows = _read_rows(path)
    except OSError as e:
        raise DataError(f"data file {str(path)!r} cannot be read ({e.strerror or e}); fix its permissions or the "
                        "path in data.train_files / data.val_files") from None
    for where, row in rows:
        depth = _nesting(row)
        if depth > MAX_NESTING:
            raise DataError(f"{path}:{where}: the row is nested {depth} levels deep (at most {MAX_NESTING}); "
                            "flatten it")
    return rows


def _nesting(value: Any) -> int:
    """How deeply lists/dicts nest in `value` (without recursion: a hostile row cannot overflow the stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = list(v.values())
        if isinstance(v, list):
            deepest = max(deepest, d)
            if d <= MAX_NESTING:
                stack.extend((x, d + 1) for x in v if isinstance(x, (dict, list)))
    return deepest


def _read_rows(path: Path) -> list[tuple[int, dict]]:
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        rows = []
        with open(path, encoding="utf-8") as f:
            try:
                for lineno, line in enumerate(f, start=1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg}); each line must be one JSON "
                                        "object (JSON lines)") from None
                    except RecursionError:
                        raise DataError(f"{path}:{lineno}: the row is nested too deeply to parse (at most "
                                        f"{MAX_NESTING} levels); flatten it") from None
                    if not isinstance(row, dict):
                        raise DataError(f"{path}:{lineno}: a row must be a JSON object, got {type(row).__name__}")
                    rows.append((lineno, row))
            except UnicodeDecodeError as e:
                raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start} after line "
                                f"{len(rows)}); is it a .jsonl file?") from None
        return rows
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
            rows = table.to_pylist()
        except (pa.ArrowException, OSError, RecursionError) as e:
            raise DataError(f"{path}: not a readable parquet file ({e})") from None
        return [(i + 1, row) for i, row in enumerate(rows)]
    raise DataError(f"data file {str(path)!r}: unsupported extension {suffix!r}; use .jsonl, .json or .parquet")


def write_rows(rows: Sequence[dict], path: str | os.PathLike) -> None:
    """Write row dicts as .jsonl (one JSON object per line) or .parquet, chosen by the extension."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        with open(path, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    elif suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(list(rows)), path)
    else:
        raise ValueError(f"output file {str(path)!r}: unsupported extension {suffix!r}; use .jsonl or .parquet")


def _get(row: dict, key: str) -> Any:
    cur: Any = row
    for part in key.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return _MISSING
        cur = cur[part]
    return cur


class PromptDataset(torch.utils.data.Dataset):
    """Prompts of one file, rendered and tokenized up front; too-long prompts are dropped and counted."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        data_source_key: str | None = "data_source",
        tokenizer,
        max_prompt_length: int,
        apply_chat_template: bool = True,
        system_prompt: str | None = None,
        default_data_source: str | None = None,
    ) -> None:
        if max_prompt_length <= 0:
            raise ValueError(f"max_prompt_length must be positive, got {max_prompt_length}")
        self.path = str(path)
        self.items: list[dict] = []
        self.num_dropped = 0
        default_source = default_data_source or Path(path).stem
        rows = read_rows(path)
        if not rows:
            raise DataError(f"data file {self.path!r} holds no rows (it is empty); give a file with prompts in "
                            "data.train_files / data.val_files")
        for ordinal, (lineno, row) in enumerate(rows):
            where = f"{self.path}:{lineno}"
            prompt = _get(row, prompt_key)
            if prompt is _MISSING:
                raise DataError(f"{where}: missing key {prompt_key!r} (data.prompt_key); row keys: {sorted(row)}")
            _check_prompt(prompt, where, prompt_key)
            answer = _get(row, answer_key)
            if answer is _MISSING:
                raise DataError(f"{where}: missing key {answer_key!r} (data.answer_key); row keys: {sorted(row)}")
            if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
                raise DataError(f"{where}: key {answer_key!r} must be a string or number, got {type(answer).__name__}")
            if data_source_key is None:
                source = default_source
            else:
                source = _get(row, data_source_key)
                if source is _MISSING:  # optional metadata: rows without it are tagged with the default
                    source = default_source
                if not isinstance(source, str):
                    raise DataError(f"{where}: key {data_source_key!r} must be a string, got {type(source).__name__}")
            extra = row.get("extra_info") or {}
            if not isinstance(extra, dict):
                raise DataError(f"{where}: key 'extra_info' must be an object, got {type(extra).__name__}")
            try:
                text = render_prompt(tokenizer, prompt, apply_chat_template=apply_chat_template,
                                     system_prompt=system_prompt)
            except ChatTemplateError as e:
                raise DataError(f"{where}: key {prompt_key!r}: {e}") from None
            ids = prompt_token_ids(tokenizer, text, apply_chat_template=apply_chat_template)
            if len(ids) > max_prompt_length:
                self.num_dropped += 1
                continue
            self.items.append({"prompt_ids": ids, "prompt": text, "ground_truth": str(answer), "data_source": source,
                               "extra": extra, "index": ordinal})
        if self.num_dropped:
            logger.warning("%s: dropped %d of %d prompts longer than max_prompt_length=%d",
                           self.path, self.num_dropped, self.num_dropped + len(self.items), max_prompt_length)
        if not self.items:
            raise DataError(f"{self.path}: no prompts left (all {self.num_dropped} longer than max_prompt_length="
                            f"{max_prompt_length}); raise data.max_prompt_length")

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


def _check_prompt(prompt: Any, where: str, key: str) -> None:
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt:
        for j, m in enumerate(prompt):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise DataError(f"{where}: key {key!r}: message {j} must be an object with string 'role' and 'content'")
        return
    raise DataError(f"{where}: key {key!r} must be a string or a non-empty list of messages, got {type(prompt).__name__}")


class PromptSampler:
    """Endless batches of dataset indices: a fresh permutation per epoch from (seed, epoch), so the
    order is reproducible and `state_dict()` (epoch, position) is enough to resume mid-epoch.
    An epoch's leftover (< batch_size) indices are skipped."""

    def __init__(self, dataset: Sequence, batch_size: int, seed: int, shuffle: bool = True) -> None:
        if not 1 <= batch_size <= len(dataset):
            raise DataError(f"batch_size (data.train_batch_size) must be in [1, {len(dataset)}] (the number of "
                            f"usable prompts), got {batch_size}; lower it or give more data")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0  # batches already taken in this epoch

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.dataset))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))

    def next_indices(self) -> list[int]:
        if (self.position + 1) * self.batch_size > len(self.dataset):
            self.epoch += 1
            self.position = 0
        start = self.position * self.batch_size
        self.position += 1
        return self._order(self.epoch)[start : start + self.batch_size].tolist()

    def next_batch(self) -> list[dict]:
        return [self.dataset[i] for i in self.next_indices()]

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict) -> None:
        if state.get("batch_size", self.batch_size) != self.batch_size or state.get("seed", self.seed) != self.seed:
            logger.warning("resuming a PromptSampler saved with seed=%s batch_size=%s into seed=%s batch_size=%s",
                           state.get("seed"), state.get("batch_size"), self.seed, self.batch_size)
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])


def repeat_for_groups(prompts: Sequence, n: int, group_offset: int = 0) -> tuple[list, torch.Tensor]:
    """Each prompt repeated `n` times in a row, and group_ids [len(prompts) * n] int64 (the prompt's
    position + group_offset), e.g. n=2: [a, a, b, b], [0, 0, 1, 1]."""
    if n < 1:
        raise ValueError(f"n (samples per prompt, rollout.n) must be >= 1, got {n}")
    repeated = [p for p in prompts for _ in range(n)]
    group_ids = torch.arange(len(prompts), dtype=torch.long).repeat_interleave(n) + group_offset
    return repeated, group_ids
