"""On-policy distillation's advantage (algorithms/distill.py) against a hand-worked example, and its policy gradient
against the exact gradient of the reverse KL computed another way (fp64 autograd of the closed-form KL); the
`distill` estimator (pure distillation: no reward in the advantage)."""

import math

import pytest
import torch

from rltrain.algorithms import compute_advantages, distill_advantages


def test_distill_advantage_hand_worked_with_tool_holes_padding_and_an_empty_response():
    # row 0: three model tokens; row 1: a model token, two tool-output tokens (loss_mask 0), a model token;
    # row 2: an empty response (all masked); row 3: one token, then padding
    teacher = torch.tensor([[-0.5, -1.0, -2.0, 0.0], [-0.1, -9.0, -9.0, -3.0], [-1.0, -1.0, -1.0, -1.0],
                            [-0.25, -7.0, 0.0, 0.0]], dtype=torch.float64)
    student = torch.tensor([[-1.5, -1.0, -0.5, 0.0], [-2.1, -0.2, -0.3, -1.0], [-2.0, -2.0, -2.0, -2.0],
                            [-4.25, -1.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 1], [0, 0, 0, 0], [1, 0, 0, 0]])
    expected = torch.tensor([[1.0, 0.0, -1.5, 0.0], [2.0, 0.0, 0.0, -2.0], [0.0, 0.0, 0.0, 0.0],
                             [4.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    adv = distill_advantages(teacher, student, mask, baseline=False)
    assert adv.dtype == torch.float64
    torch.testing.assert_close(adv, expected, rtol=0, atol=0)
    # the sampled reverse KL per trained token is its negation: (-1 + 0 + 1.5 - 2 + 2 - 4) / 6 over the 6 tokens
    assert float(-(adv * mask).sum() / mask.sum()) == pytest.approx(-3.5 / 6)
    # with the baseline, that mean (3.5 / 6) is subtracted on the trained tokens only
    centred = distill_advantages(teacher, student, mask)
    torch.testing.assert_close(centred, (expected - 3.5 / 6) * mask, rtol=0, atol=1e-15)
    assert float(centred.sum()) == pytest.approx(0.0, abs=1e-12)
    # bf16 inputs come back in fp32 (the advantage is accumulated in at least fp32); an all-masked batch is all 0
    assert distill_advantages(teacher.bfloat16(), student.bfloat16(), mask.bool()).dtype == torch.float32
    assert not distill_advantages(teacher, student, torch.zeros_like(mask)).any()


def test_distill_advantage_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="must all be"):
        distill_advantages(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 4))


@pytest.mark.parametrize("baseline", [False, True])
@pytest.mark.parametrize("vocab", [1, 5, 123])
def test_its_policy_gradient_is_minus_the_gradient_of_the_reverse_kl(vocab, baseline):
    """Summed over every token a of each position, weighted by the student's probability, the policy gradient
    E_{a ~ pi}[A(a) grad log pi(a)] with A = distill_advantages equals -grad KL(pi || pi_T) exactly (E[grad log pi] =
    0, so the baseline, a constant, changes nothing): the reference is the closed-form KL, differentiated by autograd
    in fp64."""
    gen = torch.Generator()
    print("seed", gen.seed())
    positions = 7
    logits = torch.randn(positions, vocab, generator=gen, dtype=torch.float64, requires_grad=True)
    teacher_lp = torch.log_softmax(3 * torch.randn(positions, vocab, generator=gen, dtype=torch.float64), -1)
    student_lp = torch.log_softmax(logits, -1)
    kl = (student_lp.exp() * (student_lp - teacher_lp)).sum()
    (grad_kl,) = torch.autograd.grad(kl, logits)
    # every token a of each position as one "sample" [positions, vocab], weighted by pi(a) (exact expectation)
    adv = distill_advantages(teacher_lp, student_lp.detach(), torch.ones(positions, vocab), baseline=baseline)
    surrogate = (student_lp.detach().exp() * adv * torch.log_softmax(logits, -1)).sum()
    (grad_pg,) = torch.autograd.grad(surrogate, logits)
    torch.testing.assert_close(grad_pg, -grad_kl, rtol=1e-10, atol=1e-12)
    if vocab > 1:
        assert grad_kl.abs().max() > 1e-3  # not a vacuous 0 = 0


def test_the_distill_estimator_gives_no_reward_advantage():
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 3.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv, ret = compute_advantages("distill", rewards, mask, group_ids=torch.tensor([0, 0]))
    assert adv.shape == ret.shape == rewards.shape and not adv.any() and not ret.any()
    assert adv.dtype == torch.float32 and math.isfinite(float(adv.sum()))
