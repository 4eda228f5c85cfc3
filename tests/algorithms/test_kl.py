"""KL estimators against hand-worked values (written out below), their gradients, and error messages."""

import math

import pytest
import torch

from rltrain.algorithms import KL_KINDS, kl_penalty

# d = lp - ref = (0.5, -1.0, 0.0); x = ref - lp = (-0.5, 1.0, 0.0)
LP = torch.tensor([[-1.0, -2.0, -0.3]], dtype=torch.float64)
REF = torch.tensor([[-1.5, -1.0, -0.3]], dtype=torch.float64)
EXPECTED = {
    "k1": [0.5, -1.0, 0.0],
    "abs": [0.5, 1.0, 0.0],
    "k2": [0.125, 0.5, 0.0],
    "mse": [0.125, 0.5, 0.0],
    "k3": [math.exp(-0.5) + 0.5 - 1, math.e - 1 - 1, 0.0],
    "low_var_kl": [math.exp(-0.5) + 0.5 - 1, math.e - 1 - 1, 0.0],
}


@pytest.mark.parametrize("kind", KL_KINDS)
def test_kl_hand_worked(kind):
    torch.testing.assert_close(kl_penalty(LP, REF, kind), torch.tensor([EXPECTED[kind]], dtype=torch.float64))


def test_every_kind_has_a_hand_worked_example():
    assert set(EXPECTED) == set(KL_KINDS)


def test_low_var_kl_is_clamped_to_ten_and_its_gradient_stays_finite():
    lp = torch.tensor([[-20.0, 0.0, -500.0, 0.0]], requires_grad=True)
    ref = torch.tensor([[0.0, -30.0, 0.0, -0.1]])
    # k3: x = 20 -> e^20 - 21; x = -30 -> e^-30 + 29; both exceed 10
    k3 = kl_penalty(lp.detach()[:, :2], ref[:, :2], "k3")
    torch.testing.assert_close(k3, torch.tensor([[math.exp(20) - 21, math.exp(-30) + 29]]))
    low = kl_penalty(lp, ref, "low_var_kl")
    torch.testing.assert_close(low, torch.tensor([[10.0, 10.0, 10.0, math.exp(-0.1) + 0.1 - 1]]))
    low.sum().backward()
    # d/dlp (e^(ref-lp) + lp - ref - 1) = 1 - e^(ref-lp); clamped entries have zero gradient, never NaN
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 0.0, 0.0, 1 - math.exp(-0.1)]]))


def test_k2_and_k3_gradients_hand_worked():
    lp = LP.clone().requires_grad_(True)
    kl_penalty(lp, REF, "k2").sum().backward()  # d/dlp 0.5 d^2 = d
    torch.testing.assert_close(lp.grad, torch.tensor([[0.5, -1.0, 0.0]], dtype=torch.float64))
    lp.grad = None
    kl_penalty(lp, REF, "k3").sum().backward()  # 1 - e^(ref - lp)
    torch.testing.assert_close(lp.grad, torch.tensor([[1 - math.exp(-0.5), 1 - math.e, 0.0]], dtype=torch.float64))


def test_unknown_kind_and_bad_shapes_are_clear_errors():
    with pytest.raises(ValueError) as err:
        kl_penalty(LP, REF, "k4")
    assert "k4" in str(err.value) and all(k in str(err.value) for k in KL_KINDS)
    with pytest.raises(ValueError, match="ref_logprobs"):
        kl_penalty(LP, REF[:, :2], "k1")
