"""One scorer of a rollout Batch: decode the responses and call the reward with everything it reads.

Must not shape rewards (overlong penalty, KL-in-reward) or sample: the trainer and the evaluator do that.

Both the trainer (training steps and validation) and the learning recipe's evaluator call `score_batch`,
so a number logged during training and one printed by an evaluation come from the same code.
"""

from __future__ import annotations

from typing import Callable

import torch

from rltrain.data.batch import Batch
from rltrain.rewards.runner import compute_rewards


def response_texts(batch: Batch, tokenizer) -> list[str]:
    """The decoded response of every row (padding cut by response_mask, special tokens skipped).

    A model whose vocab is larger than its tokenizer's (e.g. Qwen3 shapes + the char tokenizer) may sample
    ids the tokenizer cannot decode: they read as <unk> (the tokenizer's unk_token_id, else 0)."""
    vocab = getattr(tokenizer, "vocab_size", None) or len(tokenizer)
    unk = getattr(tokenizer, "unk_token_id", None) or 0
    ids = torch.where(batch.response_ids < vocab, batch.response_ids, torch.full_like(batch.response_ids, unk))
    return tokenizer.batch_decode([row[:n].tolist() for row, n in zip(ids, batch.response_mask.sum(-1))],
                                  skip_special_tokens=True)


def reward_extras(batch: Batch, *, multi_turn: bool) -> list[dict]:
    """Each row's `extra` for the reward function: the dataset row's extra, plus, for multi-turn rollouts, the
    tool use rewards/retool.py reads: num_turns counted as chat messages (user + assistant = 2, plus a call and
    a result per executed tool call) and tool_calls as executed."""
    extras = list(batch.non_tensor["extra"])
    if multi_turn:
        extras = [{**(e or {}), "num_turns": 2 + 2 * int(tc), "tool_calls": int(tc)}
                  for e, tc in zip(extras, batch.non_tensor["tool_calls"])]
    return extras


def score_batch(batch: Batch, reward_fn: Callable, *, tokenizer, multi_turn: bool, timeout_s: float,
                max_workers: int) -> tuple[torch.Tensor, dict[str, float]]:
    """Score every row of a rollout batch.

    batch: non_tensor holds ground_truth, data_source, extra (and tool_calls when multi_turn).
    multi_turn: the rollout ran the tool loop (config rollout.multi_turn.enable): the reward sees num_turns
    and tool_calls in its extra.
    Returns (scores [B] fp32, metrics keyed "reward/...": errors, timeouts, <key>/mean of dict rewards)."""
    texts = response_texts(batch, tokenizer)
    scores, rm = compute_rewards(reward_fn, texts, batch.non_tensor["ground_truth"],
                                 data_sources=batch.non_tensor["data_source"],
                                 extras=reward_extras(batch, multi_turn=multi_turn),
                                 timeout_s=timeout_s, max_workers=max_workers)
    metrics = {k if "/" in k else f"reward/{k}": v for k, v in rm.items()}
    return torch.tensor(scores, dtype=torch.float32), metrics
