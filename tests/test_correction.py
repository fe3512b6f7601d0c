"""Off-policy correction (vlmrl/algorithms/correction.py): each method's weights and each mismatch metric worked by
hand, the bias of truncation and masking on a policy small enough to enumerate, and the update's wiring (the
behaviour denominator, corrections off leaving the loss untouched, the recipe's refusals)."""

import copy
import itertools
import math

import pytest
import torch

from vlmrl.algorithms.correction import (
    Correction,
    correction_weights,
    mismatch_metrics,
    policy_turns,
    resolve_correction,
)
from vlmrl.algorithms.losses import ppo_clip_loss
from vlmrl.config import ConfigError, load_config
from vlmrl.models import load_policy
from vlmrl.trainer.rl import build_trajectories, collect_and_score
from vlmrl.trainer.update import update

from .test_algorithms_e2e import _context

L = math.log
# behaviour log-probs and proximal ones whose ratios are, per token: row 0 [2, 0.5, 4], row 1 [1.5, 1, (pad)],
# row 2 [1, 1, 1]; so the answers' ratios are 4, 1.5 and 1, their geometric means 4^(1/3), 1.5^(1/2) and 1
BEHAVIOUR = torch.log(torch.tensor([[0.2, 0.4, 0.1], [0.4, 0.5, 0.3], [0.3, 0.3, 0.3]]))
RATIOS = torch.tensor([[2.0, 0.5, 4.0], [1.5, 1.0, 7.0], [1.0, 1.0, 1.0]])
PROXIMAL = BEHAVIOUR + torch.log(RATIOS)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]])


@pytest.mark.parametrize("method,low,high,expected", [
    ("token_tis", None, 2.0, [[2.0, 0.5, 2.0], [1.5, 1.0, 0.0], [1.0, 1.0, 1.0]]),
    ("sequence_tis", None, 2.0, [[2.0, 2.0, 2.0], [1.5, 1.5, 0.0], [1.0, 1.0, 1.0]]),
    ("mis", None, 3.0, [[0.0, 0.0, 0.0], [1.5, 1.5, 0.0], [1.0, 1.0, 1.0]]),  # 4 > 3: the whole answer masked
    ("icepop", 0.45, 5.0, [[2.0, 0.5, 4.0], [1.5, 1.0, 0.0], [1.0, 1.0, 1.0]]),
    ("icepop", 0.6, 3.0, [[2.0, 0.0, 0.0], [1.5, 1.0, 0.0], [1.0, 1.0, 1.0]]),
    ("geometric", 0.999, 1.001, [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]),
    ("geometric", 0.9, 1.3, [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]),  # sqrt(1.5) = 1.22 kept
])
def test_each_correction_weighs_as_worked_by_hand(method, low, high, expected):
    w = correction_weights(PROXIMAL, BEHAVIOUR, MASK, Correction(method, low, high))
    assert torch.allclose(w, torch.tensor(expected), atol=1e-5), w
    assert not w.requires_grad


def test_weights_carry_no_gradient():
    proximal = PROXIMAL.clone().requires_grad_()
    w = correction_weights(proximal, BEHAVIOUR, MASK, Correction("token_tis", None, 2.0))
    assert not w.requires_grad


def test_mismatch_metrics_worked_by_hand():
    # one answer with ratios [2, 0.5] and one with [1, 1]
    behaviour = torch.log(torch.tensor([[0.2, 0.4], [0.5, 0.5]]))
    proximal = behaviour + torch.log(torch.tensor([[2.0, 0.5], [1.0, 1.0]]))
    mask = torch.ones(2, 2)
    m = mismatch_metrics(proximal, behaviour, mask, Correction("token_tis", None, 1.5), torch.tensor([1, 2]))
    # k1 = mean(log mu - log pi) = (-L2 + L2 + 0 + 0) / 4 = 0; k3 = mean(rho - 1 - log rho) over the four tokens
    k3_row0 = (2 - 1 - L(2)) + (0.5 - 1 + L(2))
    assert m["mismatch/k1"] == pytest.approx(0.0, abs=1e-7)
    assert m["mismatch/k3"] == pytest.approx(k3_row0 / 4)
    assert m["mismatch/ratio_mean"] == pytest.approx(1.125) and m["mismatch/ratio_min"] == pytest.approx(0.5)
    assert m["mismatch/ratio_max"] == pytest.approx(2.0)
    assert m["mismatch/ess"] == pytest.approx(1.0)  # both answers' ratios are 1 (2 x 0.5 and 1 x 1)
    assert m["mismatch/clipped_fraction"] == pytest.approx(0.25)  # the 2 capped at 1.5
    assert m["mismatch/masked_fraction"] == 0.0
    assert m["mismatch/k3/images_1"] == pytest.approx(k3_row0 / 2)  # split by the images in the prompt
    assert m["mismatch/k3/images_2"] == pytest.approx(0.0)
    assert "mismatch/k3/turn_1" not in m  # single-turn answers: no split by turn
    # answer ratios 4 and 1: ESS = (4 + 1)^2 / (2 (16 + 1)) = 25/34; icepop [0.6, 3] masks the 0.5
    proximal[1] = behaviour[1] + torch.log(torch.tensor([4.0, 1.0]))
    m = mismatch_metrics(proximal, behaviour, mask, Correction("icepop", 0.6, 3.0))
    assert m["mismatch/ess"] == pytest.approx(25 / 34)
    assert m["mismatch/masked_fraction"] == pytest.approx(2 / 4)  # the 0.5 and the 4
    assert "mismatch/masked_fraction" not in mismatch_metrics(proximal, behaviour, mask, Correction("none", None,
                                                                                                     None))


def test_mismatch_is_split_by_turn_for_multi_turn_trajectories():
    # turn 1 (2 tokens), an observation (masked), turn 2 (1 token)
    mask = torch.tensor([[1, 1, 0, 0, 1], [1, 0, 0, 0, 0]])
    assert policy_turns(mask).tolist() == [[1, 1, 0, 0, 2], [1, 0, 0, 0, 0]]
    behaviour = torch.zeros(2, 5)
    proximal = torch.tensor([[0.0, 0.0, 5.0, 5.0, L(2)], [0.0, 0.0, 0.0, 0.0, 0.0]])
    m = mismatch_metrics(proximal, behaviour, mask, Correction("none", None, None))
    assert m["mismatch/k3/turn_1"] == pytest.approx(0.0)  # observation tokens never count
    assert m["mismatch/k3/turn_2"] == pytest.approx(2 - 1 - L(2))
    assert m["mismatch/k1/turn_2"] == pytest.approx(-L(2))


# -- an enumerable toy: two tokens from a vocabulary of three, the second conditioned on the first -------------------
def _toy():
    torch.manual_seed(0)
    theta1, theta2 = torch.randn(3, requires_grad=True), torch.randn(3, 3, requires_grad=True)
    mu1, mu2 = torch.randn(3).log_softmax(-1), torch.randn(3, 3).log_softmax(-1)  # the behaviour policy
    seqs = torch.tensor(list(itertools.product(range(3), repeat=2)))  # all 9 answers
    adv = torch.randn(9)

    def logp():  # [9, 2] the policy's log-prob of each token of each answer
        return torch.stack([theta1.log_softmax(-1)[seqs[:, 0]],
                            theta2.log_softmax(-1)[seqs[:, 0], seqs[:, 1]]], -1)

    behaviour = torch.stack([mu1[seqs[:, 0]], mu2[seqs[:, 0], seqs[:, 1]]], -1)
    return (theta1, theta2), logp, behaviour, adv


def _grad(loss, params):
    return torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])


def _expected_gradient(weighting):
    """E_mu[ sum_t w_t A d(-log pi_t) ] exactly: every answer weighted by its behaviour probability, the per-token
    loss the update's (PPO-clip at ratio 1, which is the policy gradient) times the correction's weights."""
    params, logp, behaviour, adv = _toy()
    lp = logp()
    mask = torch.ones_like(lp)
    per_token = ppo_clip_loss(lp, lp.detach(), adv, mask).per_token_loss * weighting(lp, behaviour, mask)
    mu = behaviour.sum(-1).exp()
    return _grad((mu[:, None] * per_token).sum(), params), (params, logp, behaviour, adv)


def _on_policy_gradient():
    params, logp, _, adv = _toy()
    lp = logp()
    pi = lp.sum(-1).exp().detach()
    return _grad((pi * adv * -lp.sum(-1)).sum(), params)


def test_sequence_is_recovers_the_on_policy_gradient_exactly():
    on_policy = _on_policy_gradient()
    uncorrected, _ = _expected_gradient(lambda lp, b, m: torch.ones_like(lp))
    corrected, _ = _expected_gradient(lambda lp, b, m: correction_weights(lp, b, m, Correction("sequence_tis", None,
                                                                                              1e9)))
    assert (uncorrected - on_policy).abs().max() > 1e-2  # the behaviour policy is really off
    assert torch.allclose(corrected, on_policy, atol=1e-6)


@pytest.mark.parametrize("method,cap", [("sequence_tis", 1.2), ("mis", 1.2)])
def test_truncation_and_masking_bias_equals_the_cut_mass(method, cap):
    """sequence TIS: E_mu[min(rho, C) ...] - E_pi[...] = -E_mu[(rho - C)^+ A grad log pi]; MIS: the answers with
    rho > C are dropped, so the bias is -E_mu[rho 1(rho > C) A grad log pi]."""
    on_policy = _on_policy_gradient()
    corrected, (params, logp, behaviour, adv) = _expected_gradient(
        lambda lp, b, m: correction_weights(lp, b, m, Correction(method, None, cap)))
    lp = logp()
    mu = behaviour.sum(-1).exp()
    rho = (lp.sum(-1) - behaviour.sum(-1)).exp().detach()
    cut = (rho - cap).clamp(min=0) if method == "sequence_tis" else rho * (rho > cap)
    assert 0 < int((rho > cap).sum()) < 9  # the cap binds on some answers, not all
    # the cut mass's own gradient contribution: sum_x mu(x) cut(x) A(x) grad(-log pi(x))
    cut_gradient = _grad((mu * cut * adv * -lp.sum(-1)).sum(), params)
    assert torch.allclose(corrected - on_policy, -cut_gradient, atol=1e-6)


def test_token_truncation_bias_equals_the_truncated_token_mass():
    """Against per-token IS (uncapped), token TIS differs by exactly the mass truncated at each token."""
    cap = 1.3
    capped, (params, logp, behaviour, adv) = _expected_gradient(
        lambda lp, b, m: correction_weights(lp, b, m, Correction("token_tis", None, cap)))
    uncapped, _ = _expected_gradient(lambda lp, b, m: correction_weights(lp, b, m, Correction("token_tis", None, 1e9)))
    lp = logp()
    mu = behaviour.sum(-1).exp()
    rho_t = (lp - behaviour).exp().detach()
    assert 0 < int((rho_t > cap).sum()) < 18
    cut_gradient = _grad((mu[:, None] * (rho_t - cap).clamp(min=0) * adv[:, None] * -lp).sum(), params)
    assert torch.allclose(capped - uncapped, -cut_gradient, atol=1e-6)


# -- the update's wiring ----------------------------------------------------------------------------------------------
def test_auto_resolves_by_where_answers_come_from():
    cfg = load_config(None)
    assert resolve_correction(cfg.algorithm, cfg.rollout).method == "none"  # built-in, synchronous
    cfg = load_config(None, ["rollout.asynchronous=true"])
    assert resolve_correction(cfg.algorithm, cfg.rollout) == Correction("token_tis", None, 2.0)
    cfg = load_config(None, ["rollout.asynchronous=true", "rollout.max_staleness=0"])
    assert resolve_correction(cfg.algorithm, cfg.rollout).method == "none"  # staleness 0: synchronous
    cfg = load_config(None, ["rollout.asynchronous=true", "algorithm.rollout_correction=icepop",
                             "algorithm.correction_high=4"])
    assert resolve_correction(cfg.algorithm, cfg.rollout) == Correction("icepop", 0.5, 4.0)


@pytest.mark.parametrize("overrides,needle", [
    (["algorithm.rollout_correction=token_tis", "rollout.top_p=0.9"], "not of the same distribution"),
    (["algorithm.ratio_denominator=behaviour", "rollout.top_k=5"], "not of the same distribution"),
    (["algorithm.rollout_correction=mis", "algorithm.ratio_denominator=behaviour"], "already"),
    (["algorithm.rollout_correction=icepop", "algorithm.correction_low=3", "algorithm.correction_high=2"], "ratio 1"),
    (["algorithm.rollout_correction=token_tis", "algorithm.correction_low=0.5"], "from above only"),
    # one bound set across the other's default: every weight would be 0 for the whole run
    (["algorithm.rollout_correction=icepop", "algorithm.correction_low=6"], r"\[6.0, 5.0\].*ratio 1"),
    (["algorithm.rollout_correction=icepop", "algorithm.correction_high=0.4"], r"\[0.5, 0.4\].*ratio 1"),
    (["algorithm.rollout_correction=geometric", "algorithm.correction_low=1.01"], r"\[1.01, 1.001\]"),
    (["algorithm.rollout_correction=mis", "algorithm.correction_high=0.9"], "ratio 1"),
    (["rollout.asynchronous=true", "rollout.max_staleness=1", "algorithm.correction_low=0.5"], "auto .*above only"),
    (["rollout.asynchronous=true", "algorithm.dynamic_sampling=true", "trainer.minibatches=2"], "minibatches > 1"),
    (["rollout.asynchronous=true", "curriculum.order=learnability", "replay.weight=0.1", "data.sft={task: shapes_count}"],
     "replay.weight > 0"),
    (["rollout.asynchronous=true", "data.preferences={task: shapes_count}"], "offline DPO"),
    (["rollout.asynchronous=true", "algorithm.advantage=remax", "rollout.group_size=2"], "remax"),
])
def test_the_recipe_refuses_what_cannot_be_corrected(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, overrides)


def _batch(policy, cfg, samples, **algo):
    ctx = _context(policy, cfg, **algo)
    batch = collect_and_score(ctx, samples)
    batch.rewards.total = torch.tensor([1.0, 0.0, 0.5, 0.0] * len(samples))  # every group carries signal
    return ctx, batch


def test_behaviour_denominator_takes_the_ratio_against_the_sampler(tiny_model_dir, count_samples):
    cfg = load_config(None, ["rollout.group_size=4", "rollout.max_new_tokens=6"])
    policy = load_policy(tiny_model_dir)
    ctx, batch = _batch(policy, cfg, count_samples[:2], ratio_denominator="behaviour")
    traj = build_trajectories(ctx, batch)
    assert torch.equal(traj.old_logprobs, batch.rollout.logprobs)  # no recomputation, even for a batch used once
    proximal_ctx, _ = _batch(load_policy(tiny_model_dir), cfg, count_samples[:2])
    assert build_trajectories(proximal_ctx, batch).old_logprobs is None  # (proximal, used once: the update's own)
    metrics = update(ctx, batch.prompts, traj)
    assert "mismatch/k3" in metrics and metrics["mismatch/k3"] < 1e-6  # same weights: only rounding apart


def test_a_stale_sampler_is_measured_and_corrected(tiny_model_dir, count_samples):
    """Answers sampled by another policy: the mismatch metrics see it, a correction changes the update, and a
    correction whose weights are all 1 (the sampler is the trainer) gives the uncorrected update bit for bit."""
    cfg = load_config(None, ["rollout.group_size=4", "rollout.max_new_tokens=6"])
    stale = load_policy(tiny_model_dir)
    with torch.no_grad():
        for p in stale.model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    ctx_stale, batch = _batch(stale, cfg, count_samples[:3])
    results = {}
    for name, algo in {"none": {"rollout_correction": "none"}, "tis": {"rollout_correction": "token_tis"},
                       "tis_self": {"rollout_correction": "token_tis"}}.items():
        policy = load_policy(tiny_model_dir)
        ctx = _context(policy, cfg, **algo)
        traj = build_trajectories(ctx, batch)
        if name == "tis_self":  # behaviour log-probs = the trainer's own: every weight exactly 1
            from vlmrl.models.scoring import score_batch
            with torch.no_grad():
                own = score_batch(policy, *batch.rollout.scoring_inputs(batch.prompts), batch.rollout.completion_ids,
                                  batch.rollout.completion_mask, cfg.rollout.temperature).logprobs
            traj = traj._replace(sample_logprobs=own)
        metrics = update(ctx, batch.prompts, traj)
        results[name] = (metrics, torch.cat([p.detach().flatten() for p in policy.model.parameters()]))
    assert results["none"][0]["mismatch/k3"] > 1e-3  # the gap is seen
    assert results["none"][0]["mismatch/ratio_max"] > 1.0 > results["none"][0]["mismatch/ratio_min"]
    assert results["tis"][0]["mismatch/clipped_fraction"] >= 0.0
    assert not torch.equal(results["none"][1], results["tis"][1])  # the correction changed the update
    assert torch.equal(results["none"][1], results["tis_self"][1])  # weights of 1: the same update, bit for bit
    del ctx_stale


def test_correction_none_leaves_the_loss_untouched(tiny_model_dir, count_samples, monkeypatch):
    """With the correction off no weight is ever computed: the loss is the one before corrections existed."""
    import vlmrl.trainer.update as upd

    def boom(*a, **k):
        raise AssertionError("correction weights computed with the correction off")

    monkeypatch.setattr(upd, "correction_weights", boom)
    cfg = load_config(None, ["rollout.group_size=4", "rollout.max_new_tokens=6"])
    ctx, batch = _batch(load_policy(tiny_model_dir), cfg, count_samples[:2])
    assert ctx.correction.method == "none"
    update(ctx, batch.prompts, build_trajectories(ctx, batch))
    ctx = _context(load_policy(tiny_model_dir), copy.deepcopy(cfg), rollout_correction="mis")
    with pytest.raises(AssertionError, match="correction weights computed"):
        update(ctx, batch.prompts, build_trajectories(ctx, batch))


def test_a_mismatch_past_the_threshold_is_said_once_per_stretch():
    from vlmrl.trainer.watch import MismatchWatch

    cfg = load_config(None, ["rollout.asynchronous=true", "rollout.max_staleness=2"])
    watch = MismatchWatch(cfg)
    assert watch.update(1, {"mismatch/k3": 0.001}) is None
    said = watch.update(2, {"mismatch/k3": 0.05, "mismatch/ess": 0.4})
    assert "KL of 0.05" in said and "rollout.max_staleness=2" in said and "mismatch/ess=0.40" in said
    assert watch.update(3, {"mismatch/k3": 0.2}) is None  # once per stretch
    assert watch.update(4, {"mismatch/k3": 0.0}) is None
    assert watch.update(5, {"mismatch/k3": 0.5}) is not None  # a new stretch
    assert MismatchWatch(load_config(None, ["algorithm.mismatch_warn_kl=null"])).update(1, {"mismatch/k3": 9}) is None
