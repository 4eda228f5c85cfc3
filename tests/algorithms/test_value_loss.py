"""Clipped value loss against a hand-worked example (written out below), gradients and edge cases."""

import pytest
import torch

from rltrain.algorithms import value_loss


def t(rows):
    return torch.tensor(rows, dtype=torch.float64)


def example():
    # clip 0.2; per token (v, old, R):
    #  (1.0, 1.1, 1.5): (v-R)^2 = 0.25, clip(v) = 1.0 -> 0.25           -> 0.125, not clipped
    #  (2.0, 1.5, 2.1): 0.01, clip(v) = 1.7 -> 0.16 (larger)            -> 0.08, clipped
    #  (0.5, 0.5, 0.0): 0.25, clip(v) = 0.5 -> 0.25                     -> 0.125
    #  (0.2, 1.0, 0.0): 0.04, clip(v) = 0.8 -> 0.64 (larger)            -> 0.32, clipped
    #  masked token with garbage
    values = t([[1.0, 2.0, 0.5, 0.2, float("nan")]]).requires_grad_(True)
    old = t([[1.1, 1.5, 0.5, 1.0, 3.0]])
    returns = t([[1.5, 2.1, 0.0, 0.0, float("inf")]])
    mask = t([[1, 1, 1, 1, 0]])
    return values, old, returns, mask


def test_value_loss_hand_worked():
    values, old, returns, mask = example()
    loss, metrics = value_loss(values, old, returns, mask, clip=0.2)
    assert loss.item() == pytest.approx((0.125 + 0.08 + 0.125 + 0.32) / 4)
    assert float(metrics["vf_clipfrac"]) == pytest.approx(0.5)
    assert not metrics["vf_clipfrac"].requires_grad
    loss.backward()
    # unclipped tokens: d/dv 0.5 (v-R)^2 = v - R, / 4; clipped tokens and the masked one: 0
    torch.testing.assert_close(values.grad, t([[(1.0 - 1.5) / 4, 0.0, 0.5 / 4, 0.0, 0.0]]))


def test_value_loss_without_clip_and_with_seq_agg():
    values, old, returns, mask = example()
    loss, metrics = value_loss(values, old, returns, mask, clip=None)
    assert loss.item() == pytest.approx(0.5 * (0.25 + 0.01 + 0.25 + 0.04) / 4)
    assert float(metrics["vf_clipfrac"]) == 0.0
    loss, _ = value_loss(values, old, returns, mask, clip=0.2, agg="seq-mean-token-sum")
    assert loss.item() == pytest.approx(0.125 + 0.08 + 0.125 + 0.32)


def test_value_loss_empty_batch_and_errors():
    values = torch.randn(2, 3, requires_grad=True)
    loss, metrics = value_loss(values, torch.randn(2, 3), torch.randn(2, 3), torch.zeros(2, 3))
    assert loss.item() == 0.0 and float(metrics["vf_clipfrac"]) == 0.0
    loss.backward()
    assert torch.all(values.grad == 0)
    with pytest.raises(ValueError, match="returns"):
        value_loss(values, values, torch.zeros(2, 2), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="clip"):
        value_loss(values, values, values, torch.zeros(2, 3), clip=-1.0)
    with pytest.raises(ValueError, match="token-mean"):
        value_loss(values, values, values, torch.zeros(2, 3), agg="bogus")
