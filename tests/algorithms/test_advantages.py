"""Advantage estimators against hand-worked examples (numbers written out below), fp64 loop references
on fresh random inputs, properties, and the plug-in points (registry, dotted paths, error messages)."""

import math
import textwrap

import pytest
import torch

from rltrain.algorithms import ADV_ESTIMATORS, compute_advantages, register_advantage_estimator
from rltrain.algorithms import advantages as adv_module


def t(rows, dtype=torch.float64):
    return torch.tensor(rows, dtype=dtype)


# Six samples, groups 7, 3, 7, 3, 7 (not sorted) and a singleton group 9. Outcome reward on the last
# response token; row 2 has a reward outside its mask that must be ignored.
GROUP_REWARDS = t([
    [0.0, 1.0, 0.0],  # gid 7, score 1
    [0.0, 0.0, 0.0],  # gid 3, score 0
    [0.0, 0.0, 5.0],  # gid 7, score 0 (the 5 is outside the mask)
    [0.0, 0.0, 1.0],  # gid 3, score 1
    [0.0, 0.0, 1.0],  # gid 7, score 1
    [0.0, 0.5, 0.0],  # gid 9 (alone), score 0.5
])
GROUP_MASK = t([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 1, 1], [1, 1, 0]])
GROUP_IDS = torch.tensor([7, 3, 7, 3, 7, 9])


def fresh_generator():
    gen = torch.Generator()
    print("seed", gen.seed())  # fresh inputs every run; the seed is shown if the test fails
    return gen


def broadcast(per_row, mask):
    return torch.tensor(per_row, dtype=torch.float64)[:, None] * mask


def test_grpo_hand_worked():
    # group 7: scores 1, 0, 1 -> mean 2/3, unbiased var ((1/3)^2 + (2/3)^2 + (1/3)^2) / 2 = 1/3
    # group 3: scores 0, 1 -> mean 1/2, unbiased var 1/2; group 9: alone -> mean 0, std 1
    s7, s3 = math.sqrt(1 / 3), math.sqrt(1 / 2)
    expected = broadcast([(1 / 3) / s7, -0.5 / s3, -(2 / 3) / s7, 0.5 / s3, (1 / 3) / s7, 0.5], GROUP_MASK)
    adv, ret = compute_advantages("grpo", GROUP_REWARDS, GROUP_MASK, group_ids=GROUP_IDS, eps=0.0)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected)
    # the eps sits in the denominator: (score - mean) / (std + eps)
    adv_eps, _ = compute_advantages("grpo", GROUP_REWARDS, GROUP_MASK, group_ids=GROUP_IDS, eps=0.1)
    torch.testing.assert_close(adv_eps[0, 0], torch.tensor((1 / 3) / (s7 + 0.1), dtype=torch.float64))
    torch.testing.assert_close(adv_eps[5, 0], torch.tensor(0.5 / 1.1, dtype=torch.float64))


def test_dr_grpo_and_grpo_without_std_hand_worked():
    expected = broadcast([1 / 3, -0.5, -2 / 3, 0.5, 1 / 3, 0.5], GROUP_MASK)
    adv, ret = compute_advantages("dr_grpo", GROUP_REWARDS, GROUP_MASK, group_ids=GROUP_IDS)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected)
    adv2, _ = compute_advantages("grpo", GROUP_REWARDS, GROUP_MASK, group_ids=GROUP_IDS, norm_by_std=False)
    torch.testing.assert_close(adv2, expected)


def test_rloo_hand_worked():
    # group 7 (1, 0, 1): 1 - (0+1)/2, 0 - (1+1)/2, 1 - (1+0)/2; group 3 (0, 1): 0 - 1, 1 - 0; alone: 0.5
    expected = broadcast([0.5, -1.0, -1.0, 1.0, 0.5, 0.5], GROUP_MASK)
    adv, ret = compute_advantages("rloo", GROUP_REWARDS, GROUP_MASK, group_ids=GROUP_IDS)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected)


def test_reinforce_plus_plus_hand_worked():
    rewards = t([[1.0, 0.0, 2.0], [0.0, 4.0, 9.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    # gamma 0.5: row 0: G2 = 2, G1 = 0 + 0.5*2 = 1, G0 = 1 + 0.5*1 = 1.5; row 1 (9 masked): G1 = 4, G0 = 2
    returns = t([[1.5, 1.0, 2.0], [2.0, 4.0, 0.0]])
    # whiten {1.5, 1, 2, 2, 4}: mean 2.1, squared deviations 0.36+1.21+0.01+0.01+3.61 = 5.2, var 5.2/4 = 1.3
    s = math.sqrt(1.3)
    expected = t([[-0.6 / s, -1.1 / s, -0.1 / s], [-0.1 / s, 1.9 / s, 0.0]])
    adv, ret = compute_advantages("reinforce_plus_plus", rewards, mask, gamma=0.5, eps=0.0)
    torch.testing.assert_close(ret, returns)
    torch.testing.assert_close(adv, expected)


def test_reinforce_plus_plus_baseline_hand_worked():
    rewards = t([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [2.0, 0.0, 0.0]])
    mask = t([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    gids = torch.tensor([4, 4, 1])
    # group 4: scores 1, 0 -> 0.5, -0.5; row 2 alone -> baseline 0 -> 2
    # masked tokens 0.5, 0.5, -0.5, -0.5, -0.5, 2: mean 0.25, squared deviations
    # 2*0.0625 + 3*0.5625 + 3.0625 = 4.875, var 4.875/5 = 0.975
    s = math.sqrt(0.975)
    expected = t([[0.25 / s, 0.25 / s, 0.0], [-0.75 / s, -0.75 / s, -0.75 / s], [1.75 / s, 0.0, 0.0]])
    adv, ret = compute_advantages("reinforce_plus_plus_baseline", rewards, mask, group_ids=gids, eps=0.0)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected)


def test_gae_hand_worked():
    rewards = t([[0.0, 0.0, 1.0], [0.0, 2.0, 7.0]])
    values = t([[0.5, 0.2, 0.4], [1.0, 0.6, 3.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    # gamma = lam = 0.5
    # row 0: t2 delta = 1 - 0.4 = 0.6, A2 = 0.6; t1 delta = 0.5*0.4 - 0.2 = 0, A1 = 0.25*0.6 = 0.15;
    #        t0 delta = 0.5*0.2 - 0.5 = -0.4, A0 = -0.4 + 0.25*0.15 = -0.3625
    # row 1: t1 delta = 2 + 0 - 0.6 = 1.4 (no value after the response), A1 = 1.4;
    #        t0 delta = 0.5*0.6 - 1 = -0.7, A0 = -0.7 + 0.25*1.4 = -0.35
    returns = t([[-0.3625 + 0.5, 0.15 + 0.2, 0.6 + 0.4], [-0.35 + 1.0, 1.4 + 0.6, 0.0]])
    # whiten {-0.3625, 0.15, 0.6, -0.35, 1.4}: mean 0.2875; squared deviations sum 2.183125, var /4
    s = math.sqrt(2.183125 / 4)
    expected = t([[-0.65 / s, -0.1375 / s, 0.3125 / s], [-0.6375 / s, 1.1125 / s, 0.0]])
    adv, ret = compute_advantages("gae", rewards, mask, values=values, gamma=0.5, lam=0.5, eps=0.0)
    torch.testing.assert_close(ret, returns)
    torch.testing.assert_close(adv, expected)


def test_gae_with_gamma_lam_one_and_zero_values_gives_reward_to_go():
    rewards = t([[1.0, 2.0, 3.0, 0.0]])
    mask = t([[1, 1, 1, 0]])
    _, ret = compute_advantages("gae", rewards, mask, values=torch.zeros_like(rewards))
    torch.testing.assert_close(ret, t([[6.0, 5.0, 3.0, 0.0]]))


def test_recursions_skip_holes_in_the_mask():
    # a tool-output hole at t=1: discounting counts only the model's own tokens
    rewards = t([[0.0, 100.0, 0.0, 1.0]])
    mask = t([[1, 0, 1, 1]])
    _, ret = compute_advantages("reinforce_plus_plus", rewards, mask, gamma=0.5)
    torch.testing.assert_close(ret, t([[0.25, 0.0, 0.5, 1.0]]))
    values = t([[0.1, 9.0, 0.2, 0.3]])
    # gamma = lam = 1: A_t = R - V_t over masked tokens (the hole's value is skipped)
    _, ret_gae = compute_advantages("gae", rewards, mask, values=values)
    torch.testing.assert_close(ret_gae, t([[1.0, 0.0, 1.0, 1.0]]))


# ------------------------------------------------------------------------------- fp64 loop references


def _random_batch(gen, batch, length, num_groups):
    lengths = torch.randint(0, length + 1, (batch,), generator=gen)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).double()
    rewards = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    gids = torch.randint(-3, num_groups - 3, (batch,), generator=gen) * 11  # sparse, negative, unsorted
    return rewards, mask, gids


def test_grpo_and_rloo_match_python_loops_on_random_groups():
    gen = fresh_generator()
    rewards, mask, gids = _random_batch(gen, 37, 9, 6)
    scores = [float((rewards[i] * mask[i]).sum()) for i in range(37)]
    grpo, rloo = [], []
    for i in range(37):
        same = [scores[j] for j in range(37) if gids[j] == gids[i]]
        n = len(same)
        if n == 1:
            grpo.append(scores[i] / (1.0 + 1e-6))
            rloo.append(scores[i])
            continue
        mean = sum(same) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in same) / (n - 1))
        grpo.append((scores[i] - mean) / (std + 1e-6))
        rloo.append(scores[i] - (sum(same) - scores[i]) / (n - 1))
    adv, _ = compute_advantages("grpo", rewards, mask, group_ids=gids)
    torch.testing.assert_close(adv, broadcast(grpo, mask))
    adv, _ = compute_advantages("rloo", rewards, mask, group_ids=gids)
    torch.testing.assert_close(adv, broadcast(rloo, mask))


def test_gae_matches_python_loop_on_random_input():
    gen = fresh_generator()
    rewards, mask, _ = _random_batch(gen, 5, 11, 2)
    values = torch.randn(5, 11, generator=gen, dtype=torch.float64)
    gamma, lam = 0.9, 0.7
    adv_ref = torch.zeros(5, 11, dtype=torch.float64)
    for i in range(5):
        n = int(mask[i].sum())
        last = 0.0
        for k in reversed(range(n)):
            next_v = float(values[i, k + 1]) if k + 1 < n else 0.0
            last = float(rewards[i, k]) + gamma * next_v - float(values[i, k]) + gamma * lam * last
            adv_ref[i, k] = last
    adv, ret = compute_advantages("gae", rewards, mask, values=values, gamma=gamma, lam=lam)
    torch.testing.assert_close(ret, (adv_ref + values) * mask)
    flat = adv_ref[mask.bool()]
    white = (adv_ref - flat.mean()) / (flat.std() + 1e-6) * mask
    torch.testing.assert_close(adv, white)


# ------------------------------------------------------------------------------- properties


def test_grpo_advantages_of_each_group_sum_to_zero():
    gen = fresh_generator()
    rewards = torch.randn(40, 1, generator=gen)
    mask = torch.ones(40, 1)
    gids = torch.arange(40) % 5  # interleaved groups of 8
    adv, _ = compute_advantages("grpo", rewards, mask, group_ids=gids)
    for g in range(5):
        assert abs(float(adv[gids == g].sum())) < 1e-4
        # and they are standardized: unbiased std 1 (up to eps)
        assert abs(float(adv[gids == g].std()) - 1.0) < 1e-4


def test_group_of_one_keeps_its_score():
    rewards = t([[0.0, 3.0]])
    mask = t([[1, 1]])
    gids = torch.tensor([0])
    for name, expected in (("grpo", 3.0 / (1 + 1e-6)), ("dr_grpo", 3.0), ("rloo", 3.0)):
        adv, _ = compute_advantages(name, rewards, mask, group_ids=gids)
        torch.testing.assert_close(adv, t([[expected, expected]]))


def test_identical_scores_and_empty_masks_give_zero_not_nan():
    rewards = t([[1.0, 0.0], [1.0, 0.0], [4.0, 4.0]])
    mask = t([[1, 0], [1, 0], [0, 0]])
    gids = torch.tensor([0, 0, 1])
    for name in ADV_ESTIMATORS:
        adv, ret = compute_advantages(name, rewards, mask, group_ids=gids, values=torch.ones_like(rewards))
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all(), name
        assert float(adv[2].abs().sum()) == 0.0, name  # outside the mask
    adv, _ = compute_advantages("grpo", rewards, mask, group_ids=gids)
    torch.testing.assert_close(adv, torch.zeros_like(adv))
    empty = torch.zeros(2, 3)
    for name in ADV_ESTIMATORS:
        adv, ret = compute_advantages(name, torch.randn(2, 3), empty, group_ids=torch.tensor([0, 0]),
                                      values=torch.randn(2, 3))
        assert float(adv.abs().sum()) == 0.0 and float(ret.abs().sum()) == 0.0, name


def test_low_precision_rewards_are_computed_in_fp32_and_carry_no_grad():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]], dtype=torch.bfloat16)
    values = torch.zeros(2, 2, requires_grad=True)
    adv, ret = compute_advantages("gae", rewards, torch.ones(2, 2), values=values)
    assert adv.dtype == torch.float32 and not adv.requires_grad and not ret.requires_grad


# ------------------------------------------------------------------------------- plug-in points and errors


def test_unknown_estimator_lists_allowed_names():
    with pytest.raises(ValueError) as err:
        compute_advantages("ppo_magic", torch.zeros(1, 1), torch.ones(1, 1))
    for name in ADV_ESTIMATORS:
        assert name in str(err.value)
    assert "ppo_magic" in str(err.value)


def test_missing_group_ids_or_values_is_a_clear_error():
    with pytest.raises(ValueError, match="group_ids"):
        compute_advantages("grpo", torch.zeros(2, 1), torch.ones(2, 1))
    with pytest.raises(ValueError, match="group_ids"):
        compute_advantages("rloo", torch.zeros(2, 1), torch.ones(2, 1), group_ids=torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="values"):
        compute_advantages("gae", torch.zeros(2, 1), torch.ones(2, 1))
    with pytest.raises(ValueError, match="response_mask"):
        compute_advantages("grpo", torch.zeros(2, 3), torch.ones(2, 2), group_ids=torch.tensor([0, 0]))


def test_registered_estimator_is_called_with_the_documented_keywords():
    seen = {}

    @register_advantage_estimator("test_only_negated_rewards")
    def negated(token_rewards, response_mask, *, group_ids, values, gamma, lam, norm_by_std, eps):
        seen.update(gamma=gamma, lam=lam, norm_by_std=norm_by_std, eps=eps)
        return -token_rewards * response_mask, token_rewards * response_mask

    try:
        adv, ret = compute_advantages("test_only_negated_rewards", t([[1.0, 2.0]]), t([[1, 0]]), gamma=0.9, lam=0.8)
        torch.testing.assert_close(adv, t([[-1.0, 0.0]]))
        torch.testing.assert_close(ret, t([[1.0, 0.0]]))
        assert seen == {"gamma": 0.9, "lam": 0.8, "norm_by_std": True, "eps": 1e-6}
        with pytest.raises(ValueError, match="already registered"):
            register_advantage_estimator("test_only_negated_rewards")(negated)
    finally:
        adv_module._ESTIMATORS.pop("test_only_negated_rewards", None)


def test_dotted_path_estimators(tmp_path, monkeypatch):
    source = textwrap.dedent("""
        def doubled(token_rewards, response_mask, **kwargs):
            return 2 * token_rewards * response_mask, token_rewards * response_mask

        def wrong_shape(token_rewards, response_mask, **kwargs):
            return token_rewards[:, :1], token_rewards
        NOT_CALLABLE = 3
    """)
    (tmp_path / "rltrain_test_user_estimators.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    rewards, mask = t([[1.0, 2.0]]), t([[1, 1]])
    adv, _ = compute_advantages("rltrain_test_user_estimators:doubled", rewards, mask)
    torch.testing.assert_close(adv, t([[2.0, 4.0]]))
    adv, _ = compute_advantages(f"{tmp_path}/rltrain_test_user_estimators.py:doubled", rewards, mask)
    torch.testing.assert_close(adv, t([[2.0, 4.0]]))
    with pytest.raises(ValueError, match="both must be"):
        compute_advantages("rltrain_test_user_estimators:wrong_shape", rewards, mask)
    with pytest.raises(ValueError, match="no attribute"):
        compute_advantages("rltrain_test_user_estimators:missing", rewards, mask)
    with pytest.raises(ValueError, match="not callable"):
        compute_advantages("rltrain_test_user_estimators:NOT_CALLABLE", rewards, mask)
    with pytest.raises(ValueError, match="cannot import"):
        compute_advantages("no_such_module_for_rltrain_tests:fn", rewards, mask)
    with pytest.raises(ValueError, match="cannot import"):
        compute_advantages(f"{tmp_path}/nope.py:fn", rewards, mask)
