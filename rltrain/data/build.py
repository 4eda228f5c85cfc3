"""The prompt datasets of a run's config, built one way for the trainer (trainer/setup.py build_datasets) and for
rltrain.plan (the training data's prompt lengths before launch, data/lengths.py).

`cfg` is a typed RLConfig (rltrain.config.convert.as_config); only its `data` section is read.
"""

from __future__ import annotations

import os

import torch


def prompt_datasets(cfg, tokenizer, *, val: bool = True):
    """(train dataset, val dataset or None), tokenized with `tokenizer`: data.synthetic's task, or the rows of
    data.train_files / data.val_files (prompts over data.max_prompt_length dropped, as PromptDataset does)."""
    from rltrain.data.dataset import PromptDataset

    d = cfg.data
    if d.source == "synthetic":
        from rltrain.data.synthetic import SyntheticTaskDataset

        s = d.synthetic
        common = dict(tokenizer=tokenizer, apply_chat_template=d.apply_chat_template, system_prompt=d.system_prompt)
        return (SyntheticTaskDataset(s.task, s.seed, s.train_size, split="train", **common),
                SyntheticTaskDataset(s.task, s.seed, s.val_size, split="val", **common) if val else None)
    common = dict(prompt_key=d.prompt_key, answer_key=d.answer_key, data_source_key=d.data_source_key,
                  tokenizer=tokenizer, max_prompt_length=d.max_prompt_length,
                  apply_chat_template=d.apply_chat_template, system_prompt=d.system_prompt)

    def load(path):  # rows without a data_source key are tagged with the file's name
        name = os.path.splitext(os.path.basename(path))[0]
        return PromptDataset(path, default_data_source=name, **common)

    train = _concat([load(p) for p in d.train_files])
    return train, (_concat([load(p) for p in d.val_files]) if val and d.val_files else None)


def _concat(datasets):
    if len(datasets) == 1:
        return datasets[0]
    return torch.utils.data.ConcatDataset(datasets)
