"""Loss aggregation modes against a hand-worked example (written out below), masking of garbage,
empty sequences and the all-empty batch."""

import pytest
import torch

from rltrain.algorithms import AGG_MODES, aggregate_loss, masked_mean

NAN, INF = float("nan"), float("inf")
# row 2 has an empty mask and is ignored; NaN/inf sit outside the mask
LOSS = torch.tensor([[1.0, 2.0, INF], [4.0, 5.0, 6.0], [NAN, 8.0, 9.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
EXPECTED = {
    "token-mean": (1 + 2 + 4 + 5 + 6) / 5,  # 3.6
    "seq-mean-token-sum": (3 + 15) / 2,  # 9
    "seq-mean-token-mean": (1.5 + 5.0) / 2,  # 3.25
    "seq-mean-token-sum-norm": 18 / (2 * 3),  # 3: B = 2 non-empty rows, L = 3
}


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregation_hand_worked(mode):
    out = aggregate_loss(LOSS, MASK, mode)
    assert out.dim() == 0 and out.dtype == torch.float64
    assert out.item() == pytest.approx(EXPECTED[mode])


def test_every_mode_has_a_hand_worked_example():
    assert set(EXPECTED) == set(AGG_MODES)


def test_seq_mean_token_sum_norm_uses_max_len():
    assert aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", max_len=6).item() == pytest.approx(18 / (2 * 6))
    # the other modes ignore it
    assert aggregate_loss(LOSS, MASK, "token-mean", max_len=6).item() == pytest.approx(3.6)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_gradients_hand_worked_and_zero_outside_the_mask(mode):
    loss = LOSS.clone().requires_grad_(True)
    aggregate_loss(loss, MASK, mode).backward()
    m = MASK.double()
    expected = {
        "token-mean": m / 5,
        "seq-mean-token-sum": m / 2,
        "seq-mean-token-mean": torch.tensor([[1 / 4, 1 / 4, 0], [1 / 6, 1 / 6, 1 / 6], [0, 0, 0]], dtype=torch.float64),
        "seq-mean-token-sum-norm": m / 6,
    }[mode]
    torch.testing.assert_close(loss.grad, expected)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_all_empty_batch_gives_zero_with_zero_gradient(mode):
    loss = torch.full((3, 4), NAN, requires_grad=True)
    out = aggregate_loss(loss, torch.zeros(3, 4, dtype=torch.bool), mode)
    assert out.item() == 0.0
    out.backward()
    assert torch.all(loss.grad == 0)


def test_masked_mean_and_bool_mask():
    x = torch.tensor([[2.0, 4.0], [6.0, -1.0]])
    assert masked_mean(x, torch.tensor([[True, True], [True, False]])).item() == pytest.approx(4.0)


def test_unknown_mode_bad_shape_and_bad_max_len_are_clear_errors():
    with pytest.raises(ValueError) as err:
        aggregate_loss(LOSS, MASK, "sum")
    assert "sum" in str(err.value) and all(m in str(err.value) for m in AGG_MODES)
    with pytest.raises(ValueError, match="response_mask"):
        aggregate_loss(LOSS, MASK[:, :2], "token-mean")
    with pytest.raises(ValueError, match="max_len"):
        aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", max_len=0)
