"""Policy losses (ppo, dual clip, gspo, cispo): hand-worked values, metrics and gradients written out
below, an fp64 per-token reference on fresh random inputs, and properties."""

import math

import pytest
import torch

from rltrain.algorithms import AGG_MODES, POLICY_LOSS_MODES, policy_loss

L15, L05, L4 = math.log(1.5), math.log(0.5), math.log(4.0)


def t(rows):
    return torch.tensor(rows, dtype=torch.float64)


def ppo_example(with_dual_token):
    """Tokens (A, r): (1, 1.5) clipped -> -1.2; (1, 0.5) -> -0.5; (-1, 1.5) -> 1.5; (-2, 0.5) clipped -> 1.6;
    optionally (-1, 4) -> 4 (dual clip 3 -> 3); and a masked token with garbage values."""
    lp = [L15, L05, L15, L05] + ([L4] if with_dual_token else []) + [100.0]
    adv = [1.0, 1.0, -1.0, -2.0] + ([-1.0] if with_dual_token else []) + [float("nan")]
    mask = [1] * (len(lp) - 1) + [0]
    logprobs = t([lp]).requires_grad_(True)
    return logprobs, torch.zeros_like(logprobs), t([adv]), t([mask])


def test_ppo_hand_worked_values_metrics_and_grads():
    lp, old, adv, mask = ppo_example(with_dual_token=False)
    loss, metrics = policy_loss(lp, old, adv, mask, mode="ppo", clip_low=0.2, clip_high=0.2)
    torch.testing.assert_close(loss, torch.tensor((-1.2 - 0.5 + 1.5 + 1.6) / 4, dtype=torch.float64))
    assert float(metrics["pg_clipfrac"]) == pytest.approx(0.5)
    assert float(metrics["pg_clipfrac_lower"]) == 0.0
    assert float(metrics["ppo_kl"]) == pytest.approx(-(2 * L15 + 2 * L05) / 4)
    assert all(not m.requires_grad for m in metrics.values())
    loss.backward()
    # d(-A r)/d lp = -A r on unclipped tokens, / 4 tokens; clipped and masked tokens get 0
    torch.testing.assert_close(lp.grad, t([[0.0, -0.5 / 4, 1.5 / 4, 0.0, 0.0]]))


def test_ppo_dual_clip_hand_worked():
    lp, old, adv, mask = ppo_example(with_dual_token=True)
    loss, metrics = policy_loss(lp, old, adv, mask, mode="ppo", dual_clip=3.0)
    torch.testing.assert_close(loss, torch.tensor((-1.2 - 0.5 + 1.5 + 1.6 + 3.0) / 5, dtype=torch.float64))
    assert float(metrics["pg_clipfrac"]) == pytest.approx(2 / 5)
    assert float(metrics["pg_clipfrac_lower"]) == pytest.approx(1 / 5)
    loss.backward()
    torch.testing.assert_close(lp.grad, t([[0.0, -0.5 / 5, 1.5 / 5, 0.0, 0.0, 0.0]]))
    # without the dual clip the exploding token costs -A r = 4 and has gradient 4/5
    lp2, old2, adv2, mask2 = ppo_example(with_dual_token=True)
    loss2, metrics2 = policy_loss(lp2, old2, adv2, mask2, mode="ppo")
    torch.testing.assert_close(loss2, torch.tensor((1.4 + 4.0) / 5, dtype=torch.float64))
    assert float(metrics2["pg_clipfrac_lower"]) == 0.0
    loss2.backward()
    assert float(lp2.grad[0, 4]) == pytest.approx(4.0 / 5)


def test_ppo_asymmetric_clip_higher():
    # r = 1.25, A = 1: clip_high 0.2 clips to 1.2; clip_high 0.28 does not
    lp = t([[math.log(1.25)]])
    for clip_high, expected, frac in ((0.2, -1.2, 1.0), (0.28, -1.25, 0.0)):
        loss, metrics = policy_loss(lp, torch.zeros_like(lp), t([[1.0]]), t([[1]]), clip_high=clip_high)
        assert loss.item() == pytest.approx(expected)
        assert float(metrics["pg_clipfrac"]) == frac


def test_gspo_hand_worked():
    # seq 0: lp - old = (0.2, 0.0) -> s = e^0.1 (inside [0.8, 1.2]), A = 1: token losses -e^0.1
    # seq 1: lp - old = (0.3, 0.3, 0.6) -> s = e^0.4 = 1.49 > 1.2, A = 1: clipped, token losses -1.2
    old = t([[-1.0, -2.0, -3.0], [-0.5, -1.5, -1.0]])
    lp = (old + t([[0.2, 0.0, 9.0], [0.3, 0.3, 0.6]])).requires_grad_(True)
    adv = t([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    mask = t([[1, 1, 0], [1, 1, 1]])
    loss, metrics = policy_loss(lp, old, adv, mask, mode="gspo")  # default agg seq-mean-token-mean
    torch.testing.assert_close(loss, torch.tensor((-math.exp(0.1) - 1.2) / 2, dtype=torch.float64))
    assert float(metrics["pg_clipfrac"]) == pytest.approx(3 / 5)
    assert float(metrics["ppo_kl"]) == pytest.approx(-(0.2 + 0.0 + 0.3 + 0.3 + 0.6) / 5)
    loss.backward()
    # each token of seq 0 has gradient -A s / (2 seqs * 2 tokens); seq 1 is clipped
    g = -math.exp(0.1) / 4
    torch.testing.assert_close(lp.grad, t([[g, g, 0.0], [0.0, 0.0, 0.0]]))


def test_gspo_uses_the_sequence_ratio_not_the_token_ratio():
    # token ratios e^0.3 and e^-0.3 are each outside [0.8, 1.2] but the sequence ratio is exactly 1
    old = t([[0.0, 0.0]])
    lp = t([[0.3, -0.3]]).requires_grad_(True)
    loss, metrics = policy_loss(lp, old, t([[2.0, 2.0]]), t([[1, 1]]), mode="gspo")
    assert loss.item() == pytest.approx(-2.0)
    assert float(metrics["pg_clipfrac"]) == 0.0
    loss.backward()
    torch.testing.assert_close(lp.grad, t([[-1.0, -1.0]]))


def test_cispo_hand_worked():
    # r = (1.5, 1.0, 0.5) -> weights sg(clip(r)) = (1.2, 1.0, 0.8); A = (1, 1, -1); lp = (-1, -2, -0.5)
    # l = -w A lp = (1.2, 2.0, -0.4); every token keeps a gradient -w A / 3
    lp = t([[-1.0, -2.0, -0.5, 7.0]]).requires_grad_(True)
    old = t([[-1.0 - L15, -2.0, -0.5 - L05, 0.0]])
    adv = t([[1.0, 1.0, -1.0, 5.0]])
    mask = t([[1, 1, 1, 0]])
    loss, metrics = policy_loss(lp, old, adv, mask, mode="cispo")
    torch.testing.assert_close(loss, torch.tensor((1.2 + 2.0 - 0.4) / 3, dtype=torch.float64))
    assert float(metrics["pg_clipfrac"]) == pytest.approx(2 / 3)
    loss.backward()
    torch.testing.assert_close(lp.grad, t([[-1.2 / 3, -1.0 / 3, 0.8 / 3, 0.0]]))


def test_ppo_matches_per_token_fp64_reference_on_random_input():
    gen = torch.Generator()
    print("seed", gen.seed())
    batch, length = 7, 13
    old = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 3
    lp = (old + 0.4 * torch.randn(batch, length, generator=gen, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    mask = (torch.rand(batch, length, generator=gen) < 0.7).double()
    loss, metrics = policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    total, count, clipped, lower, grads = 0.0, 0, 0, 0, torch.zeros(batch, length, dtype=torch.float64)
    for i in range(batch):
        for k in range(length):
            if not mask[i, k]:
                continue
            a, r = float(adv[i, k]), math.exp(float(lp[i, k].detach() - old[i, k]))
            l1, l2 = -a * r, -a * min(max(r, 0.8), 1.28)
            l, g = (l1, -a * r) if l1 >= l2 else (l2, 0.0)
            clipped += l2 > l1
            if a < 0 and -a * 3.0 < l:
                l, g = -a * 3.0, 0.0
                lower += 1
            total, count = total + l, count + 1
            grads[i, k] = g
    torch.testing.assert_close(loss, torch.tensor(total / count, dtype=torch.float64))
    assert float(metrics["pg_clipfrac"]) == pytest.approx(clipped / count)
    assert float(metrics["pg_clipfrac_lower"]) == pytest.approx(lower / count)
    loss.backward()
    torch.testing.assert_close(lp.grad, grads / count)


# ------------------------------------------------------------------------------- properties


def test_loss_is_minus_advantage_when_policy_equals_old():
    gen = torch.Generator()
    print("seed", gen.seed())
    lp = torch.randn(4, 6, generator=gen, dtype=torch.float64).requires_grad_(True)
    adv = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    mask = t([[1, 1, 1, 0, 0, 0], [1] * 6, [1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0]])
    for mode in ("ppo", "gspo"):
        lp.grad = None
        loss, metrics = policy_loss(lp, lp.detach().clone(), adv, mask, mode=mode, agg="token-mean")
        torch.testing.assert_close(loss, -(adv * mask).sum() / mask.sum())
        assert float(metrics["pg_clipfrac"]) == 0.0 and float(metrics["ppo_kl"]) == 0.0
        loss.backward()
        torch.testing.assert_close(lp.grad, -adv * mask / mask.sum())


@pytest.mark.parametrize("mode", POLICY_LOSS_MODES)
def test_gradients_flow_only_through_masked_tokens(mode):
    gen = torch.Generator()
    print("seed", gen.seed())
    lp = torch.randn(3, 5, generator=gen).requires_grad_(True)
    old = lp.detach() + 0.01 * torch.randn(3, 5, generator=gen)  # ratios stay inside the clip range
    adv = torch.randn(3, 5, generator=gen)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    outside = mask == 0
    old[outside] = float("inf")  # garbage outside the mask must not leak
    adv[outside] = float("nan")
    loss, metrics = policy_loss(lp, old, adv, mask, mode=mode)
    assert torch.isfinite(loss) and all(torch.isfinite(torch.as_tensor(m)) for m in metrics.values())
    loss.backward()
    assert torch.all(lp.grad[outside] == 0)
    assert torch.all(lp.grad[~outside] != 0)


@pytest.mark.parametrize("mode", POLICY_LOSS_MODES)
@pytest.mark.parametrize("agg", AGG_MODES)
def test_all_empty_batch_gives_zero_not_nan(mode, agg):
    lp = torch.randn(2, 3, requires_grad=True)
    loss, metrics = policy_loss(lp, torch.randn(2, 3), torch.randn(2, 3), torch.zeros(2, 3), mode=mode, agg=agg)
    assert loss.item() == 0.0
    assert all(float(m) == 0.0 for m in metrics.values())
    loss.backward()
    assert torch.all(lp.grad == 0)


def test_bool_mask_and_float32():
    lp = torch.tensor([[math.log(0.5), 0.0]], requires_grad=True)
    loss, _ = policy_loss(lp, torch.zeros(1, 2), torch.ones(1, 2), torch.tensor([[True, False]]))
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(-0.5)


# ------------------------------------------------------------------------------- errors


def test_errors_name_the_argument_and_the_allowed_values():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError) as err:
        policy_loss(x, x, x, x, mode="trpo")
    assert "trpo" in str(err.value) and all(m in str(err.value) for m in POLICY_LOSS_MODES)
    with pytest.raises(ValueError) as err:
        policy_loss(x, x, x, x, agg="mean")
    assert all(m in str(err.value) for m in AGG_MODES)
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(x, x, x, x, dual_clip=0.5)
    with pytest.raises(ValueError, match="cispo"):
        policy_loss(x, x, x, x, mode="cispo", dual_clip=3.0)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(x, x, torch.zeros(1, 3), x)
    with pytest.raises(ValueError, match="clip_low"):
        policy_loss(x, x, x, x, clip_low=-0.1)
