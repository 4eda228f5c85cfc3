"""Off-policy correction: truncated importance sampling weights (token and sequence), their effect on the
policy loss, and the training/inference mismatch metrics. Hand-worked examples written out below, an fp64
reference computed another way (products of ratios, exact KL of a categorical), awkward shapes."""

import math

import pytest
import torch

from rltrain.algorithms import TIS_MODES, policy_loss, policy_mismatch, truncated_is_weights
from rltrain.config.schema import OffPolicyConfig
from rltrain.workers.actor import PolicyLoss

LN2 = math.log(2.0)


def t(rows, dtype=torch.float64):
    return torch.tensor(rows, dtype=dtype)


def worked_example():
    """Ratios pi_old / mu per token. Row 0: 0.5, 3.0 (their product 1.5); row 1: 2.0, 2.0 (product 4);
    row 2: an empty response whose padding holds garbage (NaN, a huge log-prob)."""
    old = t([[math.log(0.5), math.log(3.0), 0.0], [LN2, LN2, 0.0], [float("nan"), 50.0, 0.0]])
    smp = torch.zeros_like(old)
    mask = t([[1, 1, 0], [1, 1, 0], [0, 0, 0]])
    return old, smp, mask


def test_token_tis_hand_worked():
    old, smp, mask = worked_example()
    w, st = truncated_is_weights(old, smp, mask, cap=2.0, mode="token")
    # 0.5 and 2.0 pass, 3.0 is truncated to 2; padding and the empty row get 0
    torch.testing.assert_close(w, t([[0.5, 2.0, 0.0], [2.0, 2.0, 0.0], [0.0, 0.0, 0.0]]))
    assert float(st["weight_mean"]) == pytest.approx((0.5 + 2 + 2 + 2) / 4)
    assert float(st["ratio_max"]) == pytest.approx(3.0)
    assert float(st["clipfrac"]) == pytest.approx(1 / 4)  # only 3.0 exceeds the cap (2.0 == cap is kept)


def test_sequence_tis_hand_worked():
    old, smp, mask = worked_example()
    w, st = truncated_is_weights(old, smp, mask, cap=2.0, mode="sequence")
    # row 0: 0.5 * 3 = 1.5 on both tokens; row 1: 2 * 2 = 4 -> 2; the empty row weighs nothing
    torch.testing.assert_close(w, t([[1.5, 1.5, 0.0], [2.0, 2.0, 0.0], [0.0, 0.0, 0.0]]))
    assert float(st["weight_mean"]) == pytest.approx((1.5 + 2.0) / 2)
    assert float(st["ratio_max"]) == pytest.approx(4.0)
    assert float(st["clipfrac"]) == pytest.approx(1 / 2)


@pytest.mark.parametrize("mode", TIS_MODES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (5, 123)])
def test_tis_matches_fp64_products_of_ratios(mode, shape):
    b, n = shape
    old = -torch.rand(b, n) * 3  # fp32 log-probs of two nearby policies
    smp = old + 0.3 * torch.randn(b, n)
    mask = (torch.rand(b, n) < 0.8).float()
    mask[0, 0] = 1  # at least one token
    if b > 2:
        mask[1] = 0  # an empty response
    cap = 1.7
    w, st = truncated_is_weights(old, smp, mask, cap=cap, mode=mode)
    ratio = (old.double().exp() / smp.double().exp())  # [B, L] per-token ratio, computed as probabilities
    if mode == "token":
        raw = torch.where(mask.bool(), ratio, torch.ones_like(ratio))
        units = raw[mask.bool()]
    else:
        per_row = torch.where(mask.bool(), ratio, torch.ones_like(ratio)).prod(-1)  # the product over the row
        raw = per_row[:, None].expand_as(ratio)
        units = per_row[mask.bool().any(-1)]
    ref = torch.where(mask.bool(), raw.clamp(max=cap), torch.zeros_like(raw))
    assert w.dtype == torch.float32
    torch.testing.assert_close(w.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(st["weight_mean"], units.clamp(max=cap).mean(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(st["ratio_max"], units.max(), rtol=1e-5, atol=1e-6)
    assert float(st["clipfrac"]) == pytest.approx(float((units > cap).double().mean()), abs=1e-9)


def test_tis_huge_ratio_is_truncated_without_overflow():
    old, smp, mask = t([[1000.0, 0.0]], torch.float32), t([[0.0, 1000.0]], torch.float32), t([[1, 1]])
    w, st = truncated_is_weights(old, smp, mask, cap=2.0)
    torch.testing.assert_close(w, t([[2.0, 0.0]], torch.float32))  # e^1000 -> cap, e^-1000 -> 0
    assert math.isinf(float(st["ratio_max"])) and float(st["clipfrac"]) == 0.5


def test_tis_empty_mask_gives_neutral_stats():
    w, st = truncated_is_weights(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), cap=2.0, mode="sequence")
    assert torch.equal(w, torch.zeros(2, 3))
    assert float(st["weight_mean"]) == 1.0 and float(st["clipfrac"]) == 0.0


def _ppo_token_loss(lp, old, adv, lo=0.2, hi=0.28):
    r = torch.exp(lp - old)
    return torch.maximum(-adv * r, -adv * r.clamp(1 - lo, 1 + hi))


def _cispo_token_loss(lp, old, adv, lo=0.2, hi=0.28):
    return -torch.exp(lp - old).detach().clamp(1 - lo, 1 + hi) * adv * lp


@pytest.mark.parametrize("mode,token_loss", [("ppo", _ppo_token_loss), ("cispo", _cispo_token_loss)])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_weights_scale_each_token_loss_and_gradient(mode, token_loss, agg):
    b, n = 4, 9
    lp0, old = -torch.rand(b, n, dtype=torch.float64) * 2, -torch.rand(b, n, dtype=torch.float64) * 2
    adv, mask = torch.randn(b, n, dtype=torch.float64), (torch.rand(b, n) < 0.7).double()
    mask[0] = 0  # an empty response
    mask[1, 0] = 1
    w = torch.rand(b, n, dtype=torch.float64) * 2
    lp = lp0.clone().requires_grad_(True)
    loss, _ = policy_loss(lp, old, adv, mask, mode=mode, clip_low=0.2, clip_high=0.28, agg=agg, weights=w)
    loss.backward()
    # reference: the written-out per-token loss times its weight, averaged by hand
    x = lp0.clone().requires_grad_(True)
    per_token = torch.where(mask.bool(), w * token_loss(x, old, adv), torch.zeros(()))
    if agg == "token-mean":
        ref = per_token.sum() / mask.sum()
    else:
        rows = mask.sum(-1) > 0
        ref = (per_token.sum(-1)[rows] / mask.sum(-1)[rows]).mean()
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(lp.grad, x.grad)


def test_unit_weights_leave_the_loss_unchanged():
    lp, old = -torch.rand(2, 5, requires_grad=True), -torch.rand(2, 5)
    adv, mask = torch.randn(2, 5), torch.ones(2, 5)
    a, _ = policy_loss(lp, old, adv, mask)
    w, _ = truncated_is_weights(old, old, mask, cap=2.0)  # sampler == old: every weight is exactly 1
    b, _ = policy_loss(lp, old, adv, mask, weights=w)
    assert torch.equal(w, mask) and torch.equal(a, b)


def test_actor_policy_loss_applies_tis_from_the_sampler_logprobs():
    torch.manual_seed(1)
    b, s = 2, 6
    mask = torch.ones(b, s)
    mask[:, :2] = 0
    mb = {"loss_mask_full": mask, "old_logprobs_full": -torch.rand(b, s), "advantages_full": torch.randn(b, s),
          "sampler_logprobs_full": -torch.rand(b, s)}
    lp = -torch.rand(b, s)
    kw = dict(mode="ppo", clip_low=0.2, clip_high=0.28, dual_clip=None, agg="token-mean", entropy_coef=0.0,
              use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="low_var_kl")
    got, _ = PolicyLoss(**kw, off_policy=OffPolicyConfig(mode="token_tis", cap=1.5))({"logprobs": lp}, mb)
    w, _ = truncated_is_weights(mb["old_logprobs_full"], mb["sampler_logprobs_full"], mask, cap=1.5)
    want, _ = policy_loss(lp, mb["old_logprobs_full"], mb["advantages_full"], mask, clip_low=0.2, clip_high=0.28,
                          weights=w)
    plain, _ = PolicyLoss(**kw)({"logprobs": lp}, mb)
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, plain)  # the correction changed the loss


def test_mismatch_hand_worked():
    # log rho = old - smp = (ln 2, -ln 2, 0) on sampled tokens; a padded token holds garbage
    old = t([[LN2, 0.0], [0.0, float("nan")]])
    smp = t([[0.0, LN2], [0.0, 7.0]])
    mask = t([[1, 1], [1, 0]])
    mm = policy_mismatch(old, smp, mask)
    assert float(mm["abs_mean"]) == pytest.approx(2 * LN2 / 3)
    assert float(mm["abs_max"]) == pytest.approx(LN2)
    # k3 = (rho - 1) - ln rho: (2 - 1 - ln 2) + (0.5 - 1 + ln 2) + 0 = 0.5 over 3 tokens
    assert float(mm["kl"]) == pytest.approx(0.5 / 3)


def test_mismatch_kl_estimates_the_exact_kl_of_sampler_to_old():
    g = torch.Generator().manual_seed(0)
    v = 11
    mu = torch.softmax(torch.randn(v, generator=g, dtype=torch.float64), -1)  # the sampler
    pi = torch.softmax(torch.log(mu) + 0.3 * torch.randn(v, generator=g, dtype=torch.float64), -1)  # pi_old
    exact = float((mu * (mu.log() - pi.log())).sum())  # KL(mu || pi_old)
    a = torch.multinomial(mu, 200_000, replacement=True, generator=g).view(400, 500)  # tokens ~ mu
    mm = policy_mismatch(pi.log()[a].float(), mu.log()[a].float(), torch.ones(400, 500))
    assert float(mm["kl"]) == pytest.approx(exact, rel=0.03)
    assert float(mm["kl"]) > 0


def test_mismatch_empty_mask_is_zero():
    mm = policy_mismatch(torch.zeros(1, 3), torch.ones(1, 3), torch.zeros(1, 3))
    assert all(float(v) == 0.0 for v in mm.values())


@pytest.mark.parametrize("kwargs,match", [
    (dict(mode="geometric"), "mode"),
    (dict(cap=0.5), "cap"),
    (dict(cap=float("nan")), "cap"),
])
def test_tis_bad_arguments_name_the_problem(kwargs, match):
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=match):
        truncated_is_weights(x, x, x, **{"cap": 2.0, **kwargs})


def test_shape_mismatch_is_reported():
    with pytest.raises(ValueError, match=r"\[B, L\]"):
        policy_mismatch(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="weights"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), weights=torch.ones(3))
