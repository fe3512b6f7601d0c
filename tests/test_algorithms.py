"""Advantage estimators, policy losses, KL estimators and loss aggregation, on numbers worked by hand."""

import math
import threading

import pytest
import torch

from vlmrl.algorithms.advantages import (
    discounted_returns,
    gae_advantages,
    grpo_advantages,
    nonzero_variance_groups,
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


# -- multi-turn trajectories: policy tokens with holes (observations) --------------------------------------------------
# three turns: policy columns 0-1, observation 2-3, policy 4, observation 5, policy 6-7, padding 8
TURNS = T([[1, 1, 0, 0, 1, 0, 1, 1, 0]])


def test_multi_turn_reward_lands_on_the_last_policy_token_and_returns_skip_observations():
    r = token_rewards(T([1.0]), TURNS, kl=torch.full((1, 9), 0.2), beta=0.5)
    # -0.1 on every policy token, +1 on column 7 (the last policy token), nothing on observations or padding
    assert close(r, [[-0.1, -0.1, 0, 0, -0.1, 0, -0.1, 0.9, 0]])
    # gamma 1: every policy token's return is the sum of the rewards at or after it, over policy tokens only
    assert close(discounted_returns(r, TURNS, 1.0), [[0.5, 0.6, 0, 0, 0.7, 0, 0.8, 0.9, 0]])
    # gamma 0.5 counts policy tokens, not columns: 7 -> 0.9; 6 -> -0.1 + 0.45; 4 -> -0.1 + 0.175; 1 -> -0.1 + 0.0375
    # 0 -> -0.1 + 0.5 * (-0.0625)
    assert close(discounted_returns(r, TURNS, 0.5), [[-0.13125, -0.0625, 0, 0, 0.075, 0, 0.35, 0.9, 0]])


def test_multi_turn_reinforce_pp_reaches_the_first_turn():
    # rewards [1, 0], no KL, gamma 1: row 0's five policy tokens all return 1, row 1's return 0; observations 0
    mask = torch.cat([TURNS, TURNS])
    adv = reinforce_pp_advantages(T([1.0, 0.0]), group_size=1, mask=mask).advantages
    # whitened over the 10 policy tokens (mean 0.5, std 0.5): +1 and -1
    assert close(adv, [[1, 1, 0, 0, 1, 0, 1, 1, 0], [-1, -1, 0, 0, -1, 0, -1, -1, 0]])


def test_multi_turn_gae_by_hand():
    # V on policy tokens [0.1, 0.2 | 0.4 | 0.6, 0.8]; observations hold 5.0, which must be ignored
    values = T([[0.1, 0.2, 5.0, 5.0, 0.4, 5.0, 0.6, 0.8, 5.0]])
    # gamma = lam = 1: delta over policy tokens = [0.2 - 0.1, 0.4 - 0.2, 0.6 - 0.4, 0.8 - 0.6, 1 - 0.8]
    # = [0.1, 0.2, 0.2, 0.2, 0.2]; A = suffix sums = [0.9, 0.8, 0.6, 0.4, 0.2]; returns = A + V = 1 everywhere
    out = gae_advantages(T([1.0]), TURNS, values, gamma=1.0, lam=1.0, whiten=False)
    assert close(out.advantages, [[0.9, 0.8, 0, 0, 0.6, 0, 0.4, 0.2, 0]])
    assert close(out.returns, [[1, 1, 0, 0, 1, 0, 1, 1, 0]])
    # lam = 0.5: A7 = 0.2, A6 = 0.2 + 0.1 = 0.3, A4 = 0.2 + 0.15 = 0.35, A1 = 0.2 + 0.175 = 0.375,
    # A0 = 0.1 + 0.1875 = 0.2875
    out = gae_advantages(T([1.0]), TURNS, values, gamma=1.0, lam=0.5, whiten=False)
    assert close(out.advantages, [[0.2875, 0.375, 0, 0, 0.35, 0, 0.3, 0.2, 0]])


def test_contiguous_masks_give_the_same_bits_as_the_plain_scan():
    """On single-turn rows (a contiguous mask) the hole-aware scans are the plain right-to-left recursions."""
    torch.manual_seed(0)
    lengths = torch.tensor([5, 1, 0, 7, 3])
    mask = (torch.arange(7)[None] < lengths[:, None]).float()
    r, v = torch.randn(5, 7) * mask, torch.randn(5, 7)
    plain, running = torch.zeros(5, 7), torch.zeros(5)
    for t in range(6, -1, -1):
        running = r[:, t] + 0.9 * running * mask[:, t]
        plain[:, t] = running
    assert torch.equal(discounted_returns(r, mask, 0.9), plain * mask)
    adv, running, vm = torch.zeros(5, 7), torch.zeros(5), v * mask
    rewards = torch.randn(5)
    tr = token_rewards(rewards, mask)
    for t in range(6, -1, -1):
        nxt = vm[:, t + 1] if t < 6 else torch.zeros(5)
        delta = tr[:, t] + 0.9 * nxt - vm[:, t]
        running = (delta + 0.9 * 0.8 * running * (mask[:, t + 1] if t < 6 else 0)) * mask[:, t]
        adv[:, t] = running
    assert torch.equal(gae_advantages(rewards, mask, v, gamma=0.9, lam=0.8, whiten=False).advantages, adv)


# -- failed rewards (scored = False): advantage 0, out of every statistic ---------------------------------------------
def test_a_failed_reward_in_an_all_equal_group_is_no_signal():
    # group [1, 1, failed, 1]: the failed row's total is a partial 0.0, which must not count as a low reward
    rewards, scored = T([1.0, 1.0, 0.0, 1.0]), T([True, True, False, True])
    for estimator in (grpo_advantages, rloo_advantages):
        assert torch.equal(estimator(rewards, 4, scored=scored).advantages, torch.zeros(4))
        assert estimator(rewards, 4).advantages[2] < 0  # (what a failure scored as 0 would do)
    assert not nonzero_variance_groups(rewards, 4, scored=scored).any()  # dynamic sampling: no signal here
    assert zero_variance_fraction(rewards, 4, scored=scored) == 1.0
    assert dpo_pairs(rewards, 4, scored)[0].numel() == 0  # and no DPO pair


def test_group_statistics_over_the_scored_answers_by_hand():
    # group [1, 0, failed, 0]: over the 3 scored answers mean 1/3, unbiased std sqrt((4/9 + 2/9) / 2) = 0.57735
    rewards, scored = T([1.0, 0.0, 9.0, 0.0]), T([True, True, False, True])
    adv = grpo_advantages(rewards, 4, scored=scored, eps=0.0).advantages
    assert close(adv, [(2 / 3) / 0.57735, (-1 / 3) / 0.57735, 0.0, (-1 / 3) / 0.57735])
    # RLOO over k = 3: A = k / (k - 1) * (r - mean) = 1.5 * [2/3, -1/3, -1/3]
    assert close(rloo_advantages(rewards, 4, scored=scored).advantages, [1.0, -0.5, 0.0, -0.5])
    # one scored answer left: no group to compare with, advantage 0
    assert torch.equal(grpo_advantages(T([1.0, 5.0]), 2, scored=T([True, False])).advantages, torch.zeros(2))
    assert close(remax_advantages(T([1.0, 0.0]), baseline_rewards=T([0.0, 1.0]), scored=T([True, False])).advantages,
                 [1.0, 0.0])
    # REINFORCE++: the failed row is out of the whitening and gets 0 on every token
    mask = T([[1, 1], [1, 0], [1, 1]])
    adv = reinforce_pp_advantages(T([1.0, 0.0, 7.0]), 1, mask, scored=T([True, True, False])).advantages
    assert close(adv, [[0.7071, 0.7071], [-1.4142, 0.0], [0.0, 0.0]])
    gae = gae_advantages(T([1.0, 0.0, 7.0]), mask, values=torch.zeros(3, 2), scored=T([True, True, False]))
    assert torch.equal(gae.advantages[2], torch.zeros(2))
    chosen, rejected = dpo_pairs(T([1.0, 0.0, 9.0, 0.5]), 4, T([True, True, False, True]))
    assert chosen.tolist() == [0] and rejected.tolist() == [1]  # the failed 9.0 is never "best"


# -- batch statistics over data-parallel ranks -----------------------------------------------------------------------
class ThreadRanks:
    """`world` threads that play data-parallel ranks: `reduce(rank)` sums a tensor over all of them (an
    all-reduce), so a batch split across the threads can be checked against the whole batch in one call."""

    def __init__(self, world: int):
        self.slots, self.barrier = [None] * world, threading.Barrier(world, timeout=10)

    def reduce(self, rank: int):
        def all_sum(t):
            self.slots[rank] = t.clone()
            self.barrier.wait()
            total = sum(self.slots[1:], self.slots[0])  # the same order on every rank
            self.barrier.wait()
            return total
        return all_sum

    def run(self, fns):
        out = [None] * len(fns)
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, fns[i](self.reduce(i))))
                   for i in range(len(fns))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out


def test_batch_statistics_are_the_global_batchs_under_data_parallel():
    """advantage_scale: batch, REINFORCE++'s and GAE's whitening: each rank's half of the batch, reduced over the
    ranks, gives the advantages of the whole batch in one process."""
    torch.manual_seed(0)
    rewards, mask = torch.rand(8), (torch.rand(8, 5) > 0.3).long()
    mask[:, 0] = 1
    values = torch.rand(8, 5)
    cases = {
        "grpo batch": lambda r, m, v, red: grpo_advantages(r, 2, scale="batch", reduce=red).advantages,
        "reinforce_pp": lambda r, m, v, red: reinforce_pp_advantages(r, 2, m, reduce=red).advantages,
        "reinforce_pp group": lambda r, m, v, red: reinforce_pp_advantages(r, 2, m, baseline="group",
                                                                           reduce=red).advantages,
        "gae": lambda r, m, v, red: gae_advantages(r, m, v, reduce=red).advantages,
    }
    for name, fn in cases.items():
        whole = fn(rewards, mask, values, None)
        halves = ThreadRanks(2).run([lambda red, s=s, fn=fn: fn(rewards[s], mask[s], values[s], red)
                                     for s in (slice(0, 4), slice(4, 8))])
        assert torch.allclose(torch.cat(halves), whole, atol=1e-6), name
        alone = fn(rewards[:4], mask[:4], values[:4], None)  # (what a rank on its own computes: different)
        assert not torch.allclose(alone, whole[:4], atol=1e-3), name


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


def test_wild_log_ratios_are_clamped_before_exp():
    """A log-ratio of +-1000 (a policy that moved very far, or garbage old log-probs) would give exp() = inf and a
    NaN loss; clamped to +-20 (verl, OpenRLHF), the loss and its gradient stay finite."""
    logp = T([[1000.0, -1000.0, 30.0], [1000.0, 1000.0, 1000.0]]).requires_grad_()  # (row 2: GSPO's sequence mean)
    old, mask, adv = torch.zeros(2, 3), torch.ones(2, 3), T([-1.0, -1.0])
    for loss_fn in (ppo_clip_loss, gspo_loss, reinforce_loss):
        out = loss_fn(logp, old, adv, mask)
        loss = aggregate(out.per_token_loss, mask)
        (grad,) = torch.autograd.grad(loss, logp)
        assert torch.isfinite(loss) and torch.isfinite(grad).all() and torch.isfinite(out.ratio_mean), loss_fn
    ratio = ppo_clip_loss(logp, old, adv, mask).per_token_loss.detach()
    assert close(ratio[0], [math.exp(20.0), 0.8, math.exp(20.0)], tol=1.0)  # A = -1: loss = ratio (unclipped side)


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


def kl_in_reward_gradient(theta: torch.Tensor, ref_logp: torch.Tensor, estimator: str, beta: float) -> torch.Tensor:
    """The gradient the trainer takes with `kl_in: reward`, in exact expectation: every answer x of a one-token
    categorical policy pi = softmax(theta) enumerated, weighted by pi(x). The reward is -beta * k(x), a constant
    (detached), and the loss is REINFORCE's -A * log pi(x)."""
    logp = torch.log_softmax(theta, -1)[:, None]  # [V answers, 1 token]
    kl = kl_estimate(logp.detach(), ref_logp[:, None], estimator)  # no gradient through a reward
    advantages = -beta * kl.sum(-1)  # what build_trajectories folds into the rewards (no baseline needed here)
    per_token = reinforce_loss(logp, logp.detach(), advantages, torch.ones_like(logp)).per_token_loss
    expected = (logp.detach().exp() * per_token).sum()  # E_{x ~ pi}[-A(x) log pi(x)]
    return torch.autograd.grad(expected, theta)[0]


def test_k1_as_a_reward_gives_the_kl_gradient_and_k3_does_not():
    """Score function: E_pi[k1 * grad log pi] = grad KL(pi || ref) exactly, since E_pi[grad log pi] = 0. k3 as a
    reward gives grad KL(pi || ref) - grad KL(ref || pi) instead."""
    torch.manual_seed(0)
    theta = (2 * torch.randn(6)).requires_grad_()
    ref_logp = torch.log_softmax(2 * torch.randn(6), -1)
    beta = 0.5
    def grad(fn):
        return torch.autograd.grad(fn(torch.log_softmax(theta, -1)), theta)[0]

    exact = grad(lambda logp: beta * (logp.exp() * (logp - ref_logp)).sum())  # grad of beta * KL(pi || ref)
    k1 = kl_in_reward_gradient(theta, ref_logp, "k1", beta)
    assert torch.allclose(k1, exact, atol=1e-6), (k1, exact)
    k3 = kl_in_reward_gradient(theta, ref_logp, "k3", beta)
    reverse = grad(lambda logp: beta * (ref_logp.exp() * (ref_logp - logp)).sum())  # grad of beta * KL(ref || pi)
    assert torch.allclose(k3, exact - reverse, atol=1e-6)  # the formula in vlmrl/algorithms/kl.py
    assert (k3 - exact).norm() > 0.3 * exact.norm()  # far from the KL gradient


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


def test_kl_in_the_reward_is_k1_summed_and_remax_shapes_its_greedy_baseline_too(tiny_model_dir, count_samples):
    """kl_in: reward folds -beta * sum_t k1_t = -beta * log(pi(y) / ref(y)) into each answer's reward, and ReMax's
    greedy baseline gets the same shaping: an answer identical to the greedy one has advantage 0 exactly."""
    from vlmrl.config import load_config
    from vlmrl.models import load_policy
    from vlmrl.models.forward import sequence_logprobs
    from vlmrl.models.reference import Reference
    from vlmrl.rewards import RewardSpec
    from vlmrl.trainer.rl import StepContext, build_trajectories, collect_and_score

    cfg = load_config(None, ["rollout.group_size=3", "rollout.max_new_tokens=6", "algorithm.advantage=remax",
                             "algorithm.policy_loss=reinforce", "algorithm.beta=0.5", "algorithm.kl_in=reward",
                             "algorithm.kl_estimator=k1"])
    policy, frozen = load_policy(tiny_model_dir), load_policy(tiny_model_dir)
    with torch.no_grad():  # a reference that differs from the policy, so the KL is not 0
        for p in frozen.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    opt = torch.optim.SGD(policy.model.parameters(), lr=0.1)
    ctx = StepContext(policy, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                      [RewardSpec("accuracy", 1.0, {"strict": False})], cfg.rollout, cfg.algorithm, cfg.trainer,
                      reference=Reference(policy, frozen), generator=torch.Generator().manual_seed(0))
    batch = collect_and_score(ctx, count_samples[:2])
    r = batch.rollout
    batch.rewards.total = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0])
    batch.baseline_rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0])  # the greedy answer = each group's first
    batch.greedy = r.select(torch.tensor([0, 3]), torch.arange(2))
    traj = build_trajectories(ctx, batch)
    with torch.no_grad():
        args = (batch.prompts, r.prompt_index, r.completion_ids, r.completion_mask, cfg.rollout.temperature)
        log_ratio = ((sequence_logprobs(policy, *args).logprobs - sequence_logprobs(frozen, *args).logprobs)
                     * r.completion_mask).sum(-1)
    assert log_ratio.abs().min() > 1e-3  # the shaping is visible
    assert torch.allclose(traj.rewards, batch.rewards.total - 0.5 * log_ratio, atol=1e-5)
    assert traj.advantages[0].abs() < 1e-5 and traj.advantages[3].abs() < 1e-5  # same answer as the baseline
    expected = traj.rewards - traj.rewards[[0, 0, 0, 3, 3, 3]]  # (r - beta KL(y)) - (r_greedy - beta KL(y_greedy))
    assert torch.allclose(traj.advantages, expected, atol=1e-5)
