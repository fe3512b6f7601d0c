"""Advantage estimators, the clipped surrogate, KL estimators and loss aggregation, on numbers worked by hand."""

import math

import pytest
import torch

from vlmrl.algorithms.advantages import grpo_advantages, zero_variance_fraction
from vlmrl.algorithms.kl import kl_estimate
from vlmrl.algorithms.losses import aggregate, ppo_clip_loss


def test_grpo_group_normalisation_by_hand():
    # group [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735 -> +-0.5 / 0.57735 = +-0.866025
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=4, eps=0.0)
    assert torch.allclose(adv, torch.tensor([0.866025, -0.866025, -0.866025, 0.866025]), atol=1e-5)


def test_grpo_groups_are_independent():
    # two groups of 2: [3, 1] -> mean 2, std sqrt(2) -> +-0.7071; [5, 5] -> all equal -> 0
    adv = grpo_advantages(torch.tensor([3.0, 1.0, 5.0, 5.0]), group_size=2, eps=0.0)
    assert torch.allclose(adv, torch.tensor([0.707107, -0.707107, 0.0, 0.0]), atol=1e-5)


def test_grpo_all_equal_group_gives_zero_not_nan():
    adv = grpo_advantages(torch.tensor([0.7, 0.7, 0.7, 0.0, 0.0, 0.0]), group_size=3)
    assert torch.equal(adv, torch.zeros(6))
    assert zero_variance_fraction(torch.tensor([0.7, 0.7, 0.7, 1.0, 0.0, 0.0]), 3) == 0.5


def test_grpo_group_of_one_gives_zero():
    assert torch.equal(grpo_advantages(torch.tensor([1.0, 0.0, 3.0]), group_size=1), torch.zeros(3))


def test_grpo_without_std_is_dr_grpo():
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), group_size=4, scale="none")
    assert torch.allclose(adv, torch.tensor([0.75, -0.25, -0.25, -0.25]))


def test_grpo_batch_scale():
    # centred by group: [0.5, -0.5, 0, 0]; batch std of [1, 0, 0, 0] (unbiased) = sqrt(0.75 / 3) = 0.5
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), group_size=2, scale="batch", eps=0.0)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 0.0, 0.0]))


def test_ppo_clip_four_quadrants_by_hand():
    # ratios 1.5, 0.5, 0.5, 1.5 with advantages +1, +1, -1, -1 and eps 0.2:
    #  A>0, r=1.5: min(1.5, 1.2) = 1.2 -> loss -1.2 (clipped)
    #  A>0, r=0.5: min(0.5, 0.8) = 0.5 -> loss -0.5
    #  A<0, r=0.5: min(-0.5, -0.8) = -0.8 -> loss 0.8 (clipped)
    #  A<0, r=1.5: min(-1.5, -1.2) = -1.5 -> loss 1.5
    ratio = torch.tensor([[1.5, 0.5, 0.5, 1.5]])
    logp = torch.log(ratio)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    out = ppo_clip_loss(logp, torch.zeros_like(logp), adv, torch.ones_like(logp))
    assert torch.allclose(out.per_token_loss, torch.tensor([[-1.2, -0.5, 0.8, 1.5]]), atol=1e-6)
    assert out.clip_fraction.item() == pytest.approx(0.5)


def test_ppo_clip_higher_is_asymmetric():
    logp = torch.log(torch.tensor([[1.25, 1.25]]))
    adv = torch.tensor([1.0, 1.0])
    low = ppo_clip_loss(logp, torch.zeros_like(logp), adv, torch.ones_like(logp), 0.2, 0.2).per_token_loss
    high = ppo_clip_loss(logp, torch.zeros_like(logp), adv, torch.ones_like(logp), 0.2, 0.28).per_token_loss
    assert torch.allclose(low, torch.tensor([[-1.2, -1.2]])) and torch.allclose(high, torch.tensor([[-1.25, -1.25]]))


def test_ppo_clip_gradient_on_policy_is_minus_advantage():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    out = ppo_clip_loss(logp, logp.detach(), torch.tensor([0.5]), torch.ones(1, 2))
    out.per_token_loss.sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([[-0.5, -0.5]]))


def test_kl_estimators_by_hand():
    logp, ref = torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25]))
    # log_ratio = log(0.25 / 0.5) = -0.693147
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(0.693147, abs=1e-6)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5 * 0.693147**2, abs=1e-6)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(0.5 - 1 + 0.693147, abs=1e-6)
    assert kl_estimate(logp, logp, "k3").item() == 0.0
    with pytest.raises(ValueError, match="k1"):
        kl_estimate(logp, ref, "k4")


def test_aggregation_modes_over_masked_padding():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert aggregate(x, mask, "token-mean").item() == pytest.approx(7 / 3)
    assert aggregate(x, mask, "seq-mean-token-mean").item() == pytest.approx((1.5 + 4.0) / 2)
    assert aggregate(x, mask, "seq-mean-token-sum-norm", max_tokens=3).item() == pytest.approx(7 / 6)


def test_aggregation_fully_masked_row_is_finite():
    x = torch.tensor([[1.0, 2.0], [9.0, 9.0]])
    mask = torch.tensor([[1, 1], [0, 0]])
    assert aggregate(x, mask, "token-mean").item() == pytest.approx(1.5)
    assert aggregate(x, mask, "seq-mean-token-mean").item() == pytest.approx(0.75)
    assert aggregate(x, torch.zeros_like(mask), "token-mean").item() == 0.0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_aggregation_micro_batch_shares_sum_to_whole(mode):
    torch.manual_seed(0)
    x = torch.randn(6, 5)
    mask = (torch.rand(6, 5) > 0.3).long()
    whole = aggregate(x, mask, mode, max_tokens=5)
    parts = sum(aggregate(x[i:i + 2], mask[i:i + 2], mode, 5, batch_tokens=mask.sum(), batch_sequences=6)
                for i in range(0, 6, 2))
    assert math.isclose(whole.item(), parts.item(), rel_tol=1e-5)
