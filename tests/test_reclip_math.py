"""ReCLIP's math on numbers worked by hand: the REINFORCE gradient, candidates, advantages, InfoNCE, KL, R@k."""

import math

import pytest
import torch

from vlmrl.reclip.evaluate import recall_at_k
from vlmrl.reclip.losses import (
    distill_kl,
    group_advantages,
    info_nce,
    pick_candidates,
    policy_weighted_advantages,
    reinforce_loss,
    retrieval_logprobs,
)


def test_reinforce_gradient_direction_on_a_3x3_similarity_matrix():
    # 3 queries x 3 candidates, tau = 0.5. Each query judges K = 2 candidates:
    #   q0 picks [0, 1] with rewards [1, 0]  -> A = [+0.5, -0.5]
    #   q1 picks [2, 1] with rewards [0, 1]  -> A = [-0.5, +0.5]
    #   q2 picks [0, 2] with rewards [1, 1]  -> A = [0, 0]
    # dL/dsim[q, j] = -(1 / (Q tau)) sum_k A[q, k] (1[j = c_k] - pi(j | q)); the pi terms cancel because the
    # advantages of a query sum to 0, so a picked candidate moves by -A / (Q tau) = -+0.5 / 1.5 = -+1/3, the rest 0.
    sim = torch.tensor([[0.9, 0.1, 0.0], [0.2, 0.8, 0.1], [0.0, 0.3, 0.7]], requires_grad=True)
    picked = torch.tensor([[0, 1], [2, 1], [0, 2]])
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    adv = group_advantages(rewards)
    assert torch.equal(adv, torch.tensor([[0.5, -0.5], [-0.5, 0.5], [0.0, 0.0]]))
    reinforce_loss(retrieval_logprobs(sim, 0.5), picked, adv).backward()
    third = 1.0 / 3.0
    expected = torch.tensor([[-third, third, 0.0], [0.0, -third, third], [0.0, 0.0, 0.0]])
    assert torch.allclose(sim.grad, expected, atol=1e-6)
    # a gradient-descent step raises the rewarded similarity and lowers the penalised one
    stepped = sim.detach() - 0.1 * sim.grad
    assert stepped[0, 0] > sim[0, 0] and stepped[0, 1] < sim[0, 1] and stepped[1, 1] > sim[1, 1]


def test_reinforce_loss_value_by_hand():
    # one query, uniform pi over 2 candidates (log 0.5 each), A = [+1, -1] -> L = -(1 log .5 - 1 log .5) = 0;
    # A = [1, 0] -> L = -log 0.5 = 0.693147
    logp = torch.log(torch.tensor([[0.5, 0.5]]))
    assert reinforce_loss(logp, torch.tensor([[0, 1]]), torch.tensor([[1.0, -1.0]])).item() == pytest.approx(0.0)
    assert reinforce_loss(logp, torch.tensor([[0, 1]]), torch.tensor([[1.0, 0.0]])).item() == pytest.approx(
        math.log(2), abs=1e-6)


def test_group_advantages_normalised_and_degenerate():
    # [1, 0, 0, 1]: mean .5, population std .5 -> [1, -1, -1, 1]; an all-equal row gives zeros, not NaN
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.3, 0.3, 0.3, 0.3]]), normalize=True, eps=0.0)
    assert torch.allclose(adv, torch.tensor([[1.0, -1.0, -1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]))


def test_policy_weighted_advantages_are_the_exact_gradient_over_the_candidates():
    # pi = [.5, .3, .2]; candidates {0, 1} -> pi_K = [.625, .375]; rewards [1, 0] -> b = .625;
    # A = K pi_K (r - b) = 2 * [.625 * .375, .375 * -.625] = [+.46875, -.46875]
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).requires_grad_(True)
    picked, rewards = torch.tensor([[0, 1]]), torch.tensor([[1.0, 0.0]])
    adv = policy_weighted_advantages(retrieval_logprobs(logits, 1.0), picked, rewards)
    assert torch.allclose(adv, torch.tensor([[0.46875, -0.46875]]))
    # the loss gradient equals -K * grad of E_{pi_K}[r] = -K * pi_K(0) on the logits
    reinforce_loss(retrieval_logprobs(logits, 1.0), picked, adv).backward()
    logits2 = logits.detach().clone().requires_grad_(True)
    expected = -2 * torch.softmax(logits2[:, :2], -1)[0, 0]
    expected.backward()
    assert torch.allclose(logits.grad, logits2.grad, atol=1e-6)
    # a candidate the student finds unlikely weighs little: the truth at pi .01 among two likely misses
    low = policy_weighted_advantages(torch.log(torch.tensor([[0.01, 0.5, 0.49]])), torch.tensor([[0, 1, 2]]),
                                     torch.tensor([[1.0, 0.0, 0.0]]))
    assert 0 < low[0, 0] < 0.05 and torch.allclose(low.sum(-1), torch.zeros(1), atol=1e-6)


def test_pick_candidates_topk_and_forced_truth():
    logp = torch.log(torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3]]))
    assert pick_candidates(logp, 2, "topk").tolist() == [[1, 2], [0, 2]]
    # the truth (0 for row 0, 1 for row 1) replaces the last slot where it was not picked
    assert pick_candidates(logp, 2, "topk", force=torch.tensor([0, 1])).tolist() == [[1, 0], [0, 1]]
    g = torch.Generator().manual_seed(0)
    sampled = pick_candidates(logp, 3, "sample", g)
    assert sorted(sampled[0].tolist()) == [0, 1, 2]  # without replacement
    with pytest.raises(ValueError, match="rl.candidates"):
        pick_candidates(logp, 4)


def test_info_nce_by_hand():
    # 2x2 identity similarities, scale 1: each CE = -log(e / (e + 1)) = log(1 + e^-1) = 0.313262
    loss = info_nce(torch.eye(2), 1.0)
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-1)), abs=1e-6)
    # extra text columns (hard negatives) enter the image->text direction only
    loss_neg = info_nce(torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]), 1.0)
    i2t = 0.5 * (-math.log(math.e / (2 * math.e + 1)) - math.log(math.e / (math.e + 2)))
    assert loss_neg.item() == pytest.approx(0.5 * (i2t + math.log(1 + math.exp(-1))), abs=1e-6)
    # extra image columns (counterfactual scenes) enter the text->image direction only: caption 0 against images
    # (1, 0) and one more at similarity 1 -> -log(e / (2e + 1)); caption 1 unchanged (its column masked at -1e4)
    loss_img = info_nce(torch.eye(2), 1.0, image_extra=torch.tensor([[1.0], [-1.0e4]]))
    t2i = 0.5 * (-math.log(math.e / (2 * math.e + 1)) + math.log(1 + math.exp(-1)))
    assert loss_img.item() == pytest.approx(0.5 * (math.log(1 + math.exp(-1)) + t2i), abs=1e-6)
    # split by rows (ranks), the shares add up to the whole
    halves = [info_nce(torch.eye(2), 1.0, rows=r, image_extra=torch.tensor([[1.0], [-1.0e4]])) for r in ((0, 1), (1, 2))]
    assert sum(h.item() for h in halves) == pytest.approx(loss_img.item(), abs=1e-6)


def test_distill_kl_by_hand():
    ref = torch.log(torch.tensor([[0.5, 0.5]]))
    cur = torch.log(torch.tensor([[0.25, 0.75]]))
    # 0.5 log(0.5/0.25) + 0.5 log(0.5/0.75) = 0.5 (log 2 + log 2/3) = 0.143841
    assert distill_kl(cur, ref).item() == pytest.approx(0.5 * (math.log(2) + math.log(2 / 3)), abs=1e-6)
    assert distill_kl(ref, ref).item() == pytest.approx(0.0)


def test_recall_at_k_counts_strictly_higher_candidates():
    # row 0: target .9 is best (rank 1); row 1: two candidates above .5 (rank 3); row 2: a tie with the target
    sim = torch.tensor([[0.9, 0.1, 0.2], [0.6, 0.5, 0.7], [0.3, 0.3, 0.3]])
    r = recall_at_k(sim, [1, 2, 3])
    assert r == {1: pytest.approx(2 / 3), 2: pytest.approx(2 / 3), 3: pytest.approx(1.0)}


def test_log_advantages_by_hand_and_as_the_cross_entropy_of_the_relevant_candidates():
    from vlmrl.reclip.losses import log_policy_advantages

    # K = 2, pi_K = (0.25, 0.75), rewards (1, 0): b = 0.25, floor 0 -> A = (0.25 * 0.75, 0.75 * -0.25) / 0.25
    sim = torch.tensor([[0.0, math.log(3.0)]])
    adv = log_policy_advantages(retrieval_logprobs(sim, 1.0), torch.tensor([[0, 1]]), torch.tensor([[1.0, 0.0]]))
    assert torch.allclose(adv, torch.tensor([[0.75, -0.75]]))
    # over a pool of 5 with 3 candidates, 0/1 rewards: the loss's gradient is that of -log sum_{relevant} pi_K
    sim = torch.tensor([[0.3, -0.2, 0.9, 0.1, -0.5]], requires_grad=True)
    picked, rewards = torch.tensor([[2, 0, 3]]), torch.tensor([[0.0, 1.0, 1.0]])
    logp = retrieval_logprobs(sim, 0.5)
    reinforce_loss(logp, picked, log_policy_advantages(logp, picked, rewards)).backward()
    mine = sim.grad.clone()
    sim.grad = None
    logp = retrieval_logprobs(sim, 0.5)
    pi_k = torch.softmax(logp.gather(-1, picked), -1)
    (-torch.log((pi_k * rewards).sum())).backward()
    assert torch.allclose(mine, sim.grad, atol=1e-6)
    # shifting every reward leaves the advantages as they are; equal rewards give zeros
    shifted = log_policy_advantages(logp.detach(), picked, rewards - 0.7)
    assert torch.allclose(shifted, log_policy_advantages(logp.detach(), picked, rewards), atol=1e-6)
    assert log_policy_advantages(logp.detach(), picked, torch.full((1, 3), 0.4)).abs().max() == 0
