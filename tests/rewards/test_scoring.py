"""score_batch: the one scorer of the trainer and the recipe's evaluator, on hand-worked batches."""

import pytest
import torch

from rltrain.data.batch import Batch
from rltrain.data.tokenizer import CharTokenizer
from rltrain.rewards import get_reward_fn
from rltrain.rewards.scoring import reward_extras, score_batch


def _batch(tok_rows: list[list[int]], width: int, non_tensor: dict) -> Batch:
    b = len(tok_rows)
    ids = torch.full((b, width), 10, dtype=torch.long)  # 10 is the char "0": padding that must not be decoded
    mask = torch.zeros(b, width, dtype=torch.long)
    for i, row in enumerate(tok_rows):
        ids[i, :len(row)] = torch.tensor(row)
        mask[i, :len(row)] = 1
    prompt = torch.ones(b, 2, dtype=torch.long)
    return Batch(prompt_ids=prompt, prompt_mask=prompt, response_ids=ids, response_mask=mask, loss_mask=mask.clone(),
                 non_tensor=non_tensor)


def test_arithmetic_rows_decode_to_their_mask_and_out_of_vocab_ids_read_as_unk():
    tok = CharTokenizer()
    rows = [tok.encode("#### 12"), tok.encode("#### 13"), tok.encode("#### 7") + [99, tok.eos_token_id]]
    batch = _batch(rows, 12, {"ground_truth": ["12", "12", "7"], "data_source": ["a", "a", None],
                              "extra": [{}, {}, {}], "tool_calls": [0, 0, 0]})
    scores, metrics = score_batch(batch, get_reward_fn("arithmetic"), tokenizer=tok, multi_turn=False,
                                  timeout_s=5, max_workers=0)
    # row 0 exact; row 1 wrong; row 2 "#### 7" once id 99 (outside the 64-token vocab) reads as <unk> and the
    # specials are skipped; the "0" padding after each mask would turn 12 into 12000 if it were decoded
    assert scores.dtype == torch.float32
    assert scores.tolist() == [1.0, 0.0, 1.0]
    assert metrics == {"reward/errors": 0.0, "reward/timeouts": 0.0}


class _Words:
    """A tokenizer stub: id i decodes to WORDS[i]."""
    WORDS = ["<pad>", "\\boxed{42}", "\\boxed{41}", " think"]
    vocab_size = len(WORDS)
    unk_token_id = 0

    def batch_decode(self, seqs, skip_special_tokens=True):
        return ["".join(self.WORDS[i] for i in s if not (skip_special_tokens and i == 0)) for s in seqs]


def test_multi_turn_rows_pass_num_turns_and_tool_calls_to_the_retool_reward():
    batch = _batch([[3, 1], [3, 2], [2], [2]], 3,
                   {"ground_truth": ["42"] * 4, "data_source": ["dapo"] * 4,
                    "extra": [{"index": 0}, {"index": 1}, {"index": 2}, None], "tool_calls": [0, 3, 5, 0]})
    assert reward_extras(batch, multi_turn=True) == [
        {"index": 0, "num_turns": 2, "tool_calls": 0}, {"index": 1, "num_turns": 8, "tool_calls": 3},
        {"index": 2, "num_turns": 12, "tool_calls": 5}, {"num_turns": 2, "tool_calls": 0}]
    scores, metrics = score_batch(batch, get_reward_fn("retool"), tokenizer=_Words(), multi_turn=True,
                                  timeout_s=5, max_workers=0)
    # correct: +1; wrong with 3 calls: -1 + 0.3 = -0.7; wrong with 5 calls: -0.5 capped at -0.6; wrong, no call: -1
    assert scores.tolist() == pytest.approx([1.0, -0.7, -0.6, -1.0])
    assert metrics["reward/acc/mean"] == pytest.approx(0.25)
    assert metrics["reward/num_turns/mean"] == pytest.approx((2 + 8 + 12 + 2) / 4)
    # single-turn: the dataset's extra as is, so every wrong answer is -1
    assert reward_extras(batch, multi_turn=False) == batch.non_tensor["extra"]
    scores, _ = score_batch(batch, get_reward_fn("retool"), tokenizer=_Words(), multi_turn=False,
                            timeout_s=5, max_workers=0)
    assert scores.tolist() == [1.0, -1.0, -1.0, -1.0]
