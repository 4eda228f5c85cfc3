"""Datasets, chat templates, the synthetic task, the tokenizer for the tiny default, and the Batch.

Must not import models, workers or Ray: everything here is plain Python and torch tensors.
"""

from rltrain.data.batch import Batch, pad_left, pad_right, response_from_full
from rltrain.data.dataset import PromptDataset, PromptSampler, read_rows, repeat_for_groups, write_rows
from rltrain.data.synthetic import SyntheticTaskDataset
from rltrain.data.tokenizer import CharTokenizer, load_tokenizer

__all__ = ["Batch", "pad_left", "pad_right", "response_from_full", "PromptDataset", "PromptSampler", "read_rows",
           "repeat_for_groups", "write_rows", "SyntheticTaskDataset", "CharTokenizer", "load_tokenizer"]
