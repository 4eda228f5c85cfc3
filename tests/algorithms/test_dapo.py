"""DAPO pieces against hand-worked examples (written out below): group filter, overlong penalty,
truncated-response mask."""

import pytest
import torch

from rltrain.algorithms import filter_informative_groups, overlong_penalty, truncated_response_mask


def test_filter_drops_groups_with_equal_scores_hand_worked():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0, 3.0, 0.5, 0.5, 0.25])
    gids = torch.tensor([5, 5, -2, -2, 8, 8, 4, 100, 100, 100])
    # 5: all 1 -> drop; -2: (0, 1) keep; 8: all 2 -> drop; 4: alone -> drop; 100: (0.5, 0.5, 0.25) keep
    keep, dropped = filter_informative_groups(scores, gids)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [False, False, True, True, False, False, False, True, True, True]
    assert dropped == 3


def test_filter_edge_cases_and_errors():
    keep, dropped = filter_informative_groups(torch.zeros(0), torch.zeros(0, dtype=torch.long))
    assert keep.shape == (0,) and dropped == 0
    keep, dropped = filter_informative_groups(torch.tensor([1, 0, 1]), torch.tensor([0, 0, 0]))  # int scores
    assert keep.tolist() == [True, True, True] and dropped == 0
    with pytest.raises(ValueError, match="group_ids"):
        filter_informative_groups(torch.zeros(3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        filter_informative_groups(torch.zeros(3), torch.zeros(3))


def test_overlong_penalty_hand_worked():
    # max_len 10, buffer 4 -> no penalty up to 6 tokens, then -(len - 6) / 4 * factor, capped at -factor
    lengths = torch.tensor([3, 6, 7, 8, 10, 12])
    torch.testing.assert_close(overlong_penalty(lengths, 10, 4, 1.0),
                               torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    torch.testing.assert_close(overlong_penalty(lengths.double(), 10, 4, 0.5),
                               torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5, -0.5], dtype=torch.float64))


def test_overlong_penalty_errors():
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(torch.tensor([1]), 10, 0, 1.0)
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(torch.tensor([1]), 10, 11, 1.0)
    with pytest.raises(ValueError, match="penalty_factor"):
        overlong_penalty(torch.tensor([1]), 10, 4, -1.0)


def test_truncated_response_mask_zeroes_truncated_rows():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    out = truncated_response_mask(mask, torch.tensor([False, True, False]))
    assert out.tolist() == [[1, 1, 0], [0, 0, 0], [1, 0, 0]] and out.dtype == mask.dtype
    out = truncated_response_mask(mask.bool(), torch.tensor([1, 0, 1]))
    assert out.tolist() == [[False, False, False], [True, True, True], [False, False, False]]
    with pytest.raises(ValueError, match="truncated"):
        truncated_response_mask(mask, torch.tensor([True]))
