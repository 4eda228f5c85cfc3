"""Batch: layouts (full_sequences / response_from_full), split/concat/select, data-parallel padding."""

import random

import pytest
import torch

from rltrain.data.batch import Batch, pad_left, pad_right, response_from_full


def make_batch(b, max_p, max_r, seed, with_scores=True):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 100) for _ in range(rng.randint(1, max_p))] for _ in range(b)]
    responses = [[rng.randrange(3, 100) for _ in range(rng.randint(1, max_r))] for _ in range(b)]
    prompt_ids, prompt_mask = pad_left(prompts, pad_value=0)
    response_ids, response_mask = pad_right(responses, pad_value=0)
    loss_mask = response_mask.clone()
    for i, r in enumerate(responses):  # pretend a tool output in the middle of long responses
        if len(r) >= 4:
            loss_mask[i, 1:3] = 0
    g = torch.Generator().manual_seed(seed)
    kw = {}
    if with_scores:
        kw = dict(old_logprobs=-torch.rand(response_ids.shape, generator=g) * response_mask,
                  advantages=torch.randn(response_ids.shape, generator=g) * response_mask,
                  scores=torch.rand(b, generator=g), group_ids=torch.arange(b) // 2)
    batch = Batch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids, response_mask=response_mask,
                  loss_mask=loss_mask, non_tensor={"ground_truth": [str(i) for i in range(b)]}, **kw)
    return batch, prompts, responses


def assert_batches_equal(a, b):
    for name in a._tensor_fields():
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert torch.equal(x, y), name
    assert a.non_tensor == b.non_tensor


def test_pad_helpers_hand_example():
    ids, mask = pad_left([[5, 6], [7]], pad_value=0)
    assert ids.tolist() == [[5, 6], [0, 7]] and mask.tolist() == [[1, 1], [0, 1]]
    ids, mask = pad_right([[5, 6], [7]], pad_value=9, width=3)
    assert ids.tolist() == [[5, 6, 9], [7, 9, 9]] and mask.tolist() == [[1, 1, 0], [1, 0, 0]]
    with pytest.raises(ValueError, match="width"):
        pad_right([[1, 2, 3]], width=2)


@pytest.mark.parametrize("b,max_p,max_r,seed", [(1, 1, 1, 0), (7, 5, 9, 1), (13, 11, 3, 2)])
def test_full_sequences_matches_per_row_concatenation(b, max_p, max_r, seed):
    batch, prompts, responses = make_batch(b, max_p, max_r, seed + random.randrange(10**6))
    input_ids, attn, seq_lens, start = batch.full_sequences(pad_token_id=1)
    p, r = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    assert input_ids.shape == (b, p + r)
    for i in range(b):
        row = prompts[i] + responses[i]
        assert input_ids[i].tolist() == row + [1] * (p + r - len(row))
        assert attn[i].tolist() == [1] * len(row) + [0] * (p + r - len(row))
        assert seq_lens[i] == len(row) and start[i] == len(prompts[i])


@pytest.mark.parametrize("trailing", [(), (3,)])
def test_response_from_full_inverts_the_full_layout(trailing):
    batch, prompts, responses = make_batch(9, 6, 7, random.randrange(10**6))
    input_ids, _, _, start = batch.full_sequences()
    b, length = input_ids.shape
    full = torch.randn(b, length, *trailing, dtype=torch.float64)
    out = batch.response_from_full(full)
    assert out.shape == (b, batch.response_ids.shape[1], *trailing)
    for i in range(b):  # reference: python slicing per row
        n = len(responses[i])
        s = len(prompts[i])
        assert torch.equal(out[i, :n], full[i, s : s + n])
        assert torch.all(out[i, n:] == 0)
    # token ids themselves round-trip: the response slice of input_ids is response_ids
    assert torch.equal(response_from_full(input_ids, start, batch.response_mask), batch.response_ids)


def test_select_by_index_and_by_mask():
    batch, _, _ = make_batch(6, 4, 4, 3)
    picked = batch.select([4, 1])
    assert torch.equal(picked.prompt_ids, batch.prompt_ids[[4, 1]])
    assert torch.equal(picked.advantages, batch.advantages[[4, 1]])
    assert picked.non_tensor["ground_truth"] == ["4", "1"]
    mask = torch.tensor([True, False, False, True, False, True])
    by_mask = batch.select(mask)
    assert by_mask.non_tensor["ground_truth"] == ["0", "3", "5"] and len(by_mask) == 3
    with pytest.raises(ValueError, match="shape"):
        batch.select(torch.tensor([True, False]))


def test_split_chunk_and_concat_round_trip():
    batch, _, _ = make_batch(11, 5, 6, 4)
    parts = batch.split(3)
    assert [len(p) for p in parts] == [4, 4, 3]
    assert_batches_equal(Batch.concat(parts), batch)
    chunks = batch.chunk(4)
    assert [len(c) for c in chunks] == [4, 4, 3]
    assert_batches_equal(Batch.concat(chunks), batch)
    with pytest.raises(ValueError, match="n_chunks"):
        batch.split(12)


def test_concat_pads_different_widths_and_keeps_sequences():
    a, pa, ra = make_batch(3, 2, 3, 5)
    b, pb, rb = make_batch(4, 7, 9, 6)
    both = Batch.concat([a, b])
    assert both.prompt_ids.shape[1] == max(a.prompt_ids.shape[1], b.prompt_ids.shape[1])
    input_ids, _, seq_lens, _ = both.full_sequences()
    for i, (p, r) in enumerate(zip(pa + pb, ra + rb)):
        assert input_ids[i, : seq_lens[i]].tolist() == p + r
    assert both.non_tensor["ground_truth"] == ["0", "1", "2", "0", "1", "2", "3"]


def test_concat_refuses_a_field_set_in_only_some_batches():
    a, _, _ = make_batch(2, 3, 3, 7)
    b, _, _ = make_batch(2, 3, 3, 8, with_scores=False)
    with pytest.raises(ValueError, match="old_logprobs"):
        Batch.concat([a, b])


@pytest.mark.parametrize("b,n", [(5, 4), (8, 4), (1, 3)])
def test_pad_to_multiple_adds_masked_dummies_that_drop_again(b, n):
    batch, _, _ = make_batch(b, 4, 5, 9)
    padded = batch.pad_to_multiple(n)
    assert len(padded) % n == 0 and len(padded) - b == (-b) % n
    dummies = padded.select(padded.dummy_mask)
    assert dummies.response_mask.sum() == 0 and dummies.loss_mask.sum() == 0
    assert torch.all(dummies.advantages == 0) and torch.all(dummies.scores == 0)
    assert torch.all(dummies.group_ids < 0) and torch.all(dummies.prompt_mask.sum(-1) > 0)
    if len(padded) >= n:
        assert {len(part) for part in padded.split(n)} == {len(padded) // n}
    assert_batches_equal(padded.drop_dummies(), batch)


def test_to_keeps_dtypes_and_values():
    batch, _, _ = make_batch(3, 3, 3, 10)
    moved = batch.to("cpu")
    assert moved.prompt_ids.dtype == torch.long and moved.old_logprobs.dtype == torch.float32
    assert_batches_equal(moved, batch)
