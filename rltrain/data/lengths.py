"""The training data's prompt lengths in tokens, as the trainer renders them: what rltrain.plan plans a step's
sequences at (memory and the fit at the longest prompt, time at the mean) in place of data.max_prompt_length, the
config's bound, which the data may never reach (the embedded task's prompts are 5 tokens against 32-64).

`cfg` is a typed RLConfig (rltrain.config.convert.as_config).
"""

from __future__ import annotations

from dataclasses import dataclass

LENGTHS_SAMPLE = 20_000  # the synthetic prompts data_lengths tokenizes at most


@dataclass(frozen=True)
class DataLengths:
    """Prompt lengths of a run's training data: the longest, the mean, how many were read and where from."""

    longest: int
    mean: float
    count: int
    where: str  # what was read, for the report: the files, or the synthetic task


def data_lengths(cfg, dataset=None) -> DataLengths:
    """Of `dataset` (the trainer's train dataset), or of the one the config builds (its tokenizer and
    data.train_files / data.synthetic: data/build.py; a missing file or tokenizer raises their UserError)."""
    d = cfg.data
    if dataset is None:
        from rltrain.data.build import prompt_datasets
        from rltrain.data.tokenizer import load_tokenizer

        m = cfg.model
        tokenizer = load_tokenizer(m.tokenizer or m.path, trust_remote_code=m.trust_remote_code)
        dataset, _ = prompt_datasets(cfg, tokenizer, val=False)
    n = len(dataset)
    # file datasets hold their tokenized prompts (all are read); a synthetic one tokenizes on access (~36 us each):
    # evenly spaced LENGTHS_SAMPLE of a larger one (its prompts share one format)
    picks = range(n) if d.source != "synthetic" or n <= LENGTHS_SAMPLE else \
        sorted({i * (n - 1) // (LENGTHS_SAMPLE - 1) for i in range(LENGTHS_SAMPLE)})
    lengths = [len(dataset[i]["prompt_ids"]) for i in picks]
    if d.source == "synthetic":
        where = f"the synthetic task {d.synthetic.task!r}" + (f", {len(lengths):,} of {n:,} sampled"
                                                             if len(lengths) < n else "")
    else:
        where = ", ".join(str(p) for p in d.train_files)
    return DataLengths(longest=max(lengths), mean=sum(lengths) / len(lengths), count=len(lengths), where=where)
