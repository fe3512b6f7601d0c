"""Advantage estimators, policy losses, KL estimators and loss aggregation, on numbers worked by hand."""

import math

import pytest
import torch

from vlmrl.algorithms.advantages import (
    discounted_returns,
    gae_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    remax_advantages,
    rloo_advantages,
    token_rewards,
    zero_variance_fraction,
)
from vlmrl.algorithms.kl import kl_estimate
from vlmrl.algorithms.losses import aggregate, dpo_loss, gspo_loss, ppo_clip_loss, reinforce_loss, value_loss
from vlmrl.trainer.update import dpo_pairs

T = torch.tensor


def close(a, b, tol=1e-4):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol)


# -- advantages ------------------------------------------------------------------------------------------------------
def test_grpo_group_normalisation_by_hand():
    # group [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735 -> +-0.5 / 0.57735 = +-0.866025
    adv = grpo_advantages(T([1.0, 0.0, 0.0, 1.0]), group_size=4, eps=0.0).advantages
    assert close(adv, [0.866025, -0.866025, -0.866025, 0.866025])


def test_grpo_groups_are_independent():
    # [3, 1] -> mean 2, std sqrt(2) -> +-0.7071; [5, 5] -> all equal -> 0 (no NaN even with eps = 0)
    assert close(grpo_advantages(T([3.0, 1.0, 5.0, 5.0]), 2, eps=0.0).advantages, [0.707107, -0.707107, 0, 0])


def test_grpo_all_equal_group_and_group_of_one_give_zero():
    assert torch.equal(grpo_advantages(T([0.7, 0.7, 0.7, 0.0, 0.0, 0.0]), 3).advantages, torch.zeros(6))
    assert torch.equal(grpo_advantages(T([1.0, 0.0, 3.0]), 1).advantages, torch.zeros(3))
    assert zero_variance_fraction(T([0.7, 0.7, 0.7, 1.0, 0.0, 0.0]), 3) == 0.5


def test_dr_grpo_and_batch_scale():
    assert close(grpo_advantages(T([1.0, 0.0, 0.0, 0.0]), 4, scale="none").advantages, [0.75, -0.25, -0.25, -0.25])
    # centred by group [0.5, -0.5, 0, 0]; batch std of [1, 0, 0, 0] (unbiased) = sqrt(0.75 / 3) = 0.5
    assert close(grpo_advantages(T([1.0, 0.0, 0.0, 0.0]), 2, scale="batch", eps=0.0).advantages, [1, -1, 0, 0])


def test_rloo_leave_one_out():
    # A_1 = 1 - mean(0, 0, 1) = 2/3; A_2 = 0 - mean(1, 0, 1) = -2/3
    assert close(rloo_advantages(T([1.0, 0.0, 0.0, 1.0]), 4).advantages, [2 / 3, -2 / 3, -2 / 3, 2 / 3])
    assert torch.equal(rloo_advantages(T([1.0, 0.0]), 1).advantages, torch.zeros(2))
    assert torch.equal(rloo_advantages(T([0.3, 0.3, 0.3]), 3).advantages, torch.zeros(3))


def test_remax_subtracts_greedy_reward():
    assert close(remax_advantages(T([1.0, 0.0, 1.0]), baseline_rewards=T([1.0, 1.0, 0.0])).advantages, [0, -1, 1])


def test_token_rewards_and_returns():
    r = token_rewards(T([2.0]), T([[1, 1, 1, 0]]), kl=T([[0.1, 0.2, 0.3, 9.0]]), beta=0.5)
    assert close(r, [[-0.05, -0.1, 1.85, 0.0]])
    assert close(discounted_returns(r, T([[1, 1, 1, 0]]), 1.0), [[1.7, 1.75, 1.85, 0.0]])
    # gamma 0.5: t2 = 1.85; t1 = -0.1 + 0.5 * 1.85 = 0.825; t0 = -0.05 + 0.5 * 0.825 = 0.3625
    assert close(discounted_returns(r, T([[1, 1, 1, 0]]), 0.5), [[0.3625, 0.825, 1.85, 0.0]])
    assert torch.equal(token_rewards(T([5.0]), T([[0, 0]])), torch.zeros(1, 2))  # an empty answer gets nothing


def test_reinforce_pp_whitens_returns_over_the_batch():
    # returns over real tokens: row0 [1, 1], row1 [0]: mean 2/3, std sqrt(2/9) -> 0.7071, 0.7071, -1.4142
    mask = T([[1, 1], [1, 0]])
    adv = reinforce_pp_advantages(T([1.0, 0.0]), group_size=1, mask=mask).advantages
    assert close(adv, [[0.7071, 0.7071], [-1.4142, 0.0]])
    # group baseline (G=2): rewards centred to [0.5, -0.5] before the returns; same whitened values here
    adv_g = reinforce_pp_advantages(T([1.0, 0.0]), group_size=2, mask=mask, baseline="group").advantages
    assert close(adv_g, [[0.7071, 0.7071], [-1.4142, 0.0]])
    same = reinforce_pp_advantages(T([1.0, 1.0]), group_size=2, mask=mask, baseline="group").advantages
    assert torch.isfinite(same).all() and close(same, torch.zeros(2, 2))


def test_gae_by_hand():
    # V = [0.5, 0.8], reward 1 on the last token, gamma = lam = 1: delta = [0.8 - 0.5, 1 - 0.8] = [0.3, 0.2]
    # A = [0.5, 0.2], returns = A + V = [1.0, 1.0]; lam = 0.5: A0 = 0.3 + 0.5 * 0.2 = 0.4
    out = gae_advantages(T([1.0]), mask=T([[1, 1, 0]]), values=T([[0.5, 0.8, 7.0]]), gamma=1.0, lam=1.0, whiten=False)
    assert close(out.advantages, [[0.5, 0.2, 0.0]]) and close(out.returns, [[1.0, 1.0, 0.0]])
    out = gae_advantages(T([1.0]), mask=T([[1, 1]]), values=T([[0.5, 0.8]]), gamma=1.0, lam=0.5, whiten=False)
    assert close(out.advantages, [[0.4, 0.2]]) and close(out.returns, [[0.9, 1.0]])


# -- policy losses ---------------------------------------------------------------------------------------------------
def test_ppo_clip_four_quadrants_by_hand():
    #  A>0, r=1.5: min(1.5, 1.2) -> -1.2 (clipped) | A>0, r=0.5: min(0.5, 0.8) -> -0.5
    #  A<0, r=0.5: min(-0.5, -0.8) -> 0.8 (clipped) | A<0, r=1.5: min(-1.5, -1.2) -> 1.5
    logp = torch.log(T([[1.5, 0.5, 0.5, 1.5]]))
    out = ppo_clip_loss(logp, torch.zeros_like(logp), T([[1.0, 1.0, -1.0, -1.0]]), torch.ones_like(logp))
    assert close(out.per_token_loss, [[-1.2, -0.5, 0.8, 1.5]], 1e-6) and out.clip_fraction.item() == 0.5


def test_ppo_ratios_far_outside_the_clip_range():
    logp = torch.log(T([[50.0, 1e-4, 50.0, 1e-4]]))
    adv = T([[1.0, 1.0, -1.0, -1.0]])
    out = ppo_clip_loss(logp, torch.zeros_like(logp), adv, torch.ones_like(logp))
    assert close(out.per_token_loss, [[-1.2, -1e-4, 50.0, 0.8]])
    dual = ppo_clip_loss(logp, torch.zeros_like(logp), adv, torch.ones_like(logp), dual_clip=3.0)
    assert close(dual.per_token_loss, [[-1.2, -1e-4, 3.0, 0.8]])  # A<0 with ratio 50: bounded by c * |A| = 3


def test_ppo_clip_higher_is_asymmetric():
    logp = torch.log(T([[1.25]]))
    assert close(ppo_clip_loss(logp, torch.zeros_like(logp), T([1.0]), torch.ones(1, 1)).per_token_loss, [[-1.2]])
    assert close(ppo_clip_loss(logp, torch.zeros_like(logp), T([1.0]), torch.ones(1, 1), 0.2, 0.28).per_token_loss,
                 [[-1.25]])


def test_on_policy_gradient_is_minus_advantage():
    for fn in (ppo_clip_loss, reinforce_loss):
        logp = T([[-1.0, -2.0]], requires_grad=True)
        fn(logp, logp.detach(), T([0.5]), torch.ones(1, 2)).per_token_loss.sum().backward()
        assert close(logp.grad, [[-0.5, -0.5]])
    assert close(reinforce_loss(T([[-1.0, -2.0]]), T([[-1.0, -2.0]]), T([2.0]), torch.ones(1, 2)).per_token_loss,
                 [[2.0, 4.0]])


def test_gspo_uses_the_sequence_ratio():
    # token log-ratios [0.2, -0.1] -> s = exp(0.05) = 1.05127 for every token of the sequence
    logp = T([[0.2, -0.1]], requires_grad=True)
    out = gspo_loss(logp, torch.zeros(1, 2), T([1.0]), torch.ones(1, 2), epsilon_low=0.2, epsilon_high=0.2)
    assert close(out.per_token_loss, [[-1.05127, -1.05127]])
    out.per_token_loss.sum().backward()
    assert close(logp.grad, [[-1.05127, -1.05127]])  # d/dlogp_t of -sg[s] * exp(logp_t - sg[logp_t]) * A
    clipped = gspo_loss(T([[0.2, -0.1]]), torch.zeros(1, 2), T([1.0]), torch.ones(1, 2), 0.01, 0.01)
    assert close(clipped.per_token_loss, [[-1.01, -1.01]]) and clipped.clip_fraction.item() == 1.0


def test_value_loss_clipping():
    loss, frac = value_loss(T([1.0]), T([0.0]), T([0.5]), torch.ones(1), clip=0.2)
    assert close(loss, [0.125]) and frac.item() == 0.0  # max((1-0.5)^2, (0.2-0.5)^2) / 2
    loss, frac = value_loss(T([0.0]), T([1.0]), T([0.0]), torch.ones(1), clip=0.2)
    assert close(loss, [0.32]) and frac.item() == 1.0  # clipped value 0.8: (0.8)^2 / 2


def test_dpo_loss_by_hand():
    # margin = (-1 + 1.5) - (-2 + 1.5) = 1; h = 0.1; -log sigmoid(0.1) = log(1 + e^-0.1) = 0.644397
    loss, margin = dpo_loss(T([-1.0]), T([-2.0]), T([-1.5]), T([-1.5]), beta=0.1)
    assert close(loss, [0.644397]) and close(margin, [1.0])
    smoothed, _ = dpo_loss(T([-1.0]), T([-2.0]), T([-1.5]), T([-1.5]), beta=0.1, label_smoothing=0.1)
    assert close(smoothed, [0.9 * 0.644397 + 0.1 * 0.744397])


def test_online_dpo_pairs_best_and_worst_of_each_group():
    chosen, rejected = dpo_pairs(T([1.0, 0.0, 0.5, 1.0, 1.0, 1.0, 0.2, 0.9, 0.1]), 3)
    assert chosen.tolist() == [0, 7] and rejected.tolist() == [1, 8]  # the all-equal middle group is skipped


# -- KL and aggregation ----------------------------------------------------------------------------------------------
def test_kl_estimators_by_hand():
    logp, ref = torch.log(T([0.5])), torch.log(T([0.25]))  # log_ratio = log(0.25 / 0.5) = -0.693147
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(0.693147, abs=1e-6)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5 * 0.693147**2, abs=1e-6)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(0.5 - 1 + 0.693147, abs=1e-6)
    assert kl_estimate(logp, logp, "k3").item() == 0.0
    with pytest.raises(ValueError, match="k1"):
        kl_estimate(logp, ref, "k4")


def test_aggregation_modes_over_masked_padding():
    x, mask = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), T([[1, 1, 0], [1, 0, 0]])
    assert aggregate(x, mask, "token-mean").item() == pytest.approx(7 / 3)
    assert aggregate(x, mask, "seq-mean-token-mean").item() == pytest.approx((1.5 + 4.0) / 2)
    assert aggregate(x, mask, "seq-mean-token-sum-norm", max_tokens=3).item() == pytest.approx(7 / 6)


def test_aggregation_fully_masked_rows_are_finite():
    x, mask = T([[1.0, 2.0], [9.0, 9.0]]), T([[1, 1], [0, 0]])
    assert aggregate(x, mask, "token-mean").item() == pytest.approx(1.5)
    assert aggregate(x, mask, "seq-mean-token-mean").item() == pytest.approx(0.75)
    assert aggregate(x, torch.zeros_like(mask), "token-mean").item() == 0.0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_aggregation_micro_batch_shares_sum_to_whole(mode):
    torch.manual_seed(0)
    x, mask = torch.randn(6, 5), (torch.rand(6, 5) > 0.3).long()
    whole = aggregate(x, mask, mode, max_tokens=5)
    parts = sum(aggregate(x[i:i + 2], mask[i:i + 2], mode, 5, batch_tokens=mask.sum(), batch_sequences=6)
                for i in range(0, 6, 2))
    assert math.isclose(whole.item(), parts.item(), rel_tol=1e-5)


def test_micro_batches_by_token_budget():
    from vlmrl.trainer.update import micro_batches

    rows = torch.tensor([10, 11, 12, 13, 14])
    prompt = torch.zeros(20, dtype=torch.long)
    completion = torch.zeros(20, dtype=torch.long)
    prompt[10:15] = torch.tensor([20, 20, 30, 20, 20])
    completion[10:15] = torch.tensor([2, 8, 5, 3, 40])
    # longest first: 14 (60), 12 (35), 11 (28), 13 (23), 10 (22). Budget 80 padded tokens:
    # [14] alone (60; adding 12 -> 2 x (30 + 40) = 140); [12, 11] = 2 x (30 + 8) = 76; [13, 10] = 2 x (20 + 3) = 46
    chunks = micro_batches(rows, (prompt, completion), 0, 80)
    assert [c.tolist() for c in chunks] == [[14], [12, 11], [13, 10]]
    # a row over the budget still goes (alone); a row cap applies as well
    assert [c.tolist() for c in micro_batches(rows, (prompt, completion), 0, 10)] == [[14], [12], [11], [13], [10]]
    assert [c.tolist() for c in micro_batches(rows, (prompt, completion), 1, 1000)] == [[14], [12], [11], [13], [10]]
    assert [c.tolist() for c in micro_batches(rows, (prompt, completion), 2, 0)] == [[10, 11], [12, 13], [14]]
    assert [c.tolist() for c in micro_batches(rows, (prompt, completion), 0, 0)] == [[10, 11, 12, 13, 14]]
