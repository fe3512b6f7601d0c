"""Training strategies of issue 17: the curriculum's schedule and filters, SFT replay, the adaptive KL controller,
and held-out accuracy intervals; numbers worked by hand."""

import json
import math

import pytest
import torch

from vlmrl.algorithms.kl import KLController
from vlmrl.config import CurriculumConfig, load_config
from vlmrl.errors import ConfigError, DataError
from vlmrl.eval.metrics import accuracy_interval, bootstrap_interval, wilson_interval
from vlmrl.models import load_policy
from vlmrl.rewards import RewardSpec
from vlmrl.trainer.curriculum import Curriculum, difficulties, pass_rate_bin
from vlmrl.trainer.replay import Replay
from vlmrl.trainer.rl import build_trajectories, collect_and_score, pass_rate_histogram
from vlmrl.trainer.sft import sft_loss
from vlmrl.trainer.types import StepContext
from vlmrl.trainer.update import update


def curriculum(n=8, steps=10, difficulty=None, **cfg) -> Curriculum:
    return Curriculum(n, torch.Generator().manual_seed(0), CurriculumConfig(**cfg), steps, difficulty)


# -- easy_to_hard: the open share follows start + (1 - start) * (t - 1) / (ramp * steps) -----------------------------
def test_easy_to_hard_draws_only_the_open_easiest_share_at_each_step():
    # difficulty 8 - i: prompt 7 is the easiest, 0 the hardest. steps=10, ramp=0.5: every prompt open from step 6
    c = curriculum(difficulty=[8 - i for i in range(8)], order="easy_to_hard", start=0.25, ramp=0.5)
    expected_open = {1: {7, 6},  # 0.25 * 8 = 2
                     3: {7, 6, 5, 4, 3},  # 0.25 + 0.75 * 2/5 = 0.55 -> ceil(4.4) = 5
                     6: set(range(8))}  # 1.0
    for step, open_ in expected_open.items():
        c.set_step(step)
        drawn = set()
        for _ in range(20):  # within a step prompts are not repeated, so each draw of 1 is a new open prompt ...
            c.set_step(step + 100)  # ... unless the step changes: a new step per draw to see the whole pool
            c.set_step(step)
            drawn.update(c.next(1))
        assert drawn == open_, step
    assert c.open_share(1) == 0.25 and c.open_share(3) == pytest.approx(0.55) and c.open_share(11) == 1.0


def test_easy_to_hard_does_not_repeat_a_prompt_within_a_step():
    c = curriculum(difficulty=list(range(8)), order="easy_to_hard", start=0.5, ramp=0.5)
    c.set_step(1)  # open: prompts 0-3
    first, second = c.next(2), c.next(2)  # dynamic sampling's second round in the same step
    assert sorted(first + second) == [0, 1, 2, 3]


def test_difficulty_column_must_be_numeric_and_name_the_sample():
    assert difficulties([{"id": "a", "difficulty": 2}, {"id": "b", "difficulty": 0.5}]) == [2.0, 0.5]
    with pytest.raises(DataError, match=r"sample 'b' has difficulty 'hard'.*learnability"):
        difficulties([{"id": "a", "difficulty": 1}, {"id": "b", "difficulty": "hard"}])
    with pytest.raises(DataError, match=r"sample 'c' has difficulty None"):
        difficulties([{"id": "c"}])


# -- learnability: draws in proportion to p (1 - p), p = (solved + 1) / (answers + 2) --------------------------------
def test_learnability_weights_by_hand_and_draw_frequencies():
    c = curriculum(n=3, order="learnability")
    c.observe(0, [True] * 8)  # p = 9/10: weight 0.09
    c.observe(1, [True] * 4 + [False] * 4)  # p = 5/10: weight 0.25
    # prompt 2 unseen: p = 1/2, weight 0.25
    assert c.pass_rate(0) == pytest.approx(0.9) and c.learnability(0) == pytest.approx(0.09)
    assert c.learnability(1) == pytest.approx(0.25) and c.learnability(2) == pytest.approx(0.25)
    counts = [0, 0, 0]
    for step in range(1, 6001):
        c.set_step(step)
        counts[c.next(1)[0]] += 1
    shares = [x / 6000 for x in counts]
    assert shares == pytest.approx([0.09 / 0.59, 0.25 / 0.59, 0.25 / 0.59], abs=0.02)


# -- online filtering ------------------------------------------------------------------------------------------------
def test_filter_drops_always_and_never_solved_prompts_and_counts_them():
    c = curriculum(n=6, filter_solved=True, filter_unsolved=True, filter_after=1, filter_recheck=0.0)
    c.observe(0, [True, True, True])  # always solved
    c.observe(1, [False, False, False])  # never solved
    c.observe(2, [True, False, True])  # signal: kept
    drawn = [c.next(1)[0] for _ in range(4 * 4)]  # four passes over the 4 open prompts
    assert set(drawn) == {2, 3, 4, 5}
    assert c.metrics()["curriculum/filtered_solved"] == 1 and c.metrics()["curriculum/filtered_unsolved"] == 1
    assert c.skipped["solved"] >= 3 and c.skipped["unsolved"] >= 3  # stepped over in each pass
    c.observe(0, [True, False, False])  # a draw with signal (a refill) lifts the filter
    assert 0 not in c.filtered


def test_a_prompt_no_answer_solves_stays_open_while_its_graded_rewards_differ():
    # a box prompt: no answer reaches IoU 0.5 (none solved), but their IoUs differ (a signal): it still teaches
    c = curriculum(n=4, filter_unsolved=True, filter_after=2, filter_recheck=0.0)
    for _ in range(3):
        c.observe(0, [False] * 4, signal=True)
    assert 0 not in c.filtered
    c.observe(1, [False] * 4, signal=True)
    c.observe(1, [False] * 4, signal=False)  # one draw with a signal among the last two: open
    assert 1 not in c.filtered
    c.observe(1, [False] * 4, signal=False)  # two draws, none solved, every answer scored the same: skipped
    assert c.filtered == {1: "unsolved"}
    assert c.groups == {"filtered": 0, "filtered_signal": 0, "open": 6, "open_signal": 4}
    c.observe(1, [False] * 4, signal=True)  # a recheck whose IoUs differ again lifts the filter
    assert c.filtered == {}
    state = json.loads(json.dumps(c.state()))  # the graded draws survive a checkpoint
    d = curriculum(n=4, filter_unsolved=True, filter_after=2, filter_recheck=0.0)
    d.load(state)
    d.observe(0, [False] * 4, signal=False)
    assert 0 not in d.filtered  # its previous draw, kept as graded, still counts


def test_a_filtered_prompt_is_rechecked_at_its_rate_and_a_signal_lifts_its_filter():
    # random order, 4 prompts, prompt 0 filtered: each pass reaches it once and takes it with probability 0.25
    c = curriculum(n=4, filter_solved=True, filter_after=1, filter_recheck=0.25)
    c.observe(0, [True, True])
    passes = 4000
    drawn = [i for _ in range(passes) for i in c.next(3)]  # the 3 open prompts once per pass, plus the rechecks
    passes_done = c.epoch + 1
    rechecks = drawn.count(0)
    assert rechecks == c.rechecked and abs(c.skipped["solved"] + c.rechecked - passes_done) <= 1  # the last pass
    assert rechecks / passes_done == pytest.approx(0.25, abs=0.02)
    assert c.metrics()["curriculum/rechecked"] == rechecks
    c.observe(0, [True, False])  # the recheck found a signal: back in every pass
    assert 0 not in c.filtered
    c.observe(1, [False, False])  # an open prompt's group without a signal
    # the first draw of 0 was open (all right), the second filtered (a signal), then 1 open (all wrong)
    assert {k: v for k, v in c.metrics().items() if k.startswith("curriculum/groups_")} == {
        "curriculum/groups_filtered": 1.0, "curriculum/groups_filtered_signal": 1.0,
        "curriculum/groups_open": 2.0, "curriculum/groups_open_signal": 0.0}
    # learnability: prompt 0 (p = 2/3 after one solved draw) at 0.25 x 2/9 against 1/4 for the two unseen prompts
    w = curriculum(n=3, order="learnability", filter_solved=True, filter_after=1, filter_recheck=0.25)
    w.observe(0, [True])
    counts = [0, 0, 0]
    for step in range(1, 6001):
        w.set_step(step)
        counts[w.next(1)[0]] += 1
    assert counts[0] / 6000 == pytest.approx((0.25 * 2 / 9) / (0.25 * 2 / 9 + 0.5), abs=0.015)  # = 0.1
    assert w.rechecked == counts[0]
    z = curriculum(n=3, order="learnability", filter_solved=True, filter_after=1, filter_recheck=0.0)
    z.observe(0, [True])
    for step in range(1, 200):
        z.set_step(step)
        assert z.next(1) != [0]  # 0: skipped for good
    assert z.rechecked == 0


def test_filter_after_needs_that_many_draws_in_a_row():
    c = curriculum(n=4, filter_solved=True, filter_after=2)
    c.observe(0, [True, True])
    assert 0 not in c.filtered  # once is not "always"
    c.observe(0, [True, True])
    assert c.filtered == {0: "solved"}
    c.observe(1, [True, True])
    c.observe(1, [True, False])
    c.observe(1, [True, True])
    assert 1 not in c.filtered  # the last two draws were not both solved


def test_too_few_open_prompts_lift_the_filter_for_that_draw():
    c = curriculum(n=3, filter_solved=True, filter_after=1)
    for i in (0, 1):
        c.observe(i, [True, True])
    out = c.next(2)  # only prompt 2 is open
    assert len(out) == 2 and c.refills == 1
    w = curriculum(n=3, order="learnability", filter_solved=True, filter_after=1)
    for i in (0, 1):
        w.observe(i, [True, True])
    assert len(set(w.next(2))) == 2 and w.refills == 1


def test_state_round_trip_continues_the_same_draws():
    a = curriculum(n=20, order="learnability", filter_solved=True)
    for step in range(1, 4):
        a.set_step(step)
        for i in a.next(3):
            a.observe(i, [True] * 4 if i % 2 else [True, False, False, False])
    state = json.loads(json.dumps(a.state()))  # what a checkpoint stores
    b = curriculum(n=20, order="learnability", filter_solved=True)
    b.load(state)
    b.generator.set_state(a.generator.get_state())
    for step in range(4, 8):
        a.set_step(step)
        b.set_step(step)
        assert a.next(3) == b.next(3)
    assert a.metrics() == b.metrics()


def test_pass_rate_bins_and_histogram():
    assert [pass_rate_bin(k, 8) for k in range(9)] == ["0", "0-25", "0-25", "25-50", "25-50", "50-75", "50-75",
                                                       "75-100", "100"]
    hist = pass_rate_histogram([True] * 4 + [True, False, False, False] + [False] * 4 + [True, True, True, False], 4)
    # groups 4/4, 1/4, 0/4, 3/4 (75% is in (50, 75])
    assert hist == {"trained_pass_rate/0": 0.25, "trained_pass_rate/0-25": 0.25, "trained_pass_rate/25-50": 0.0,
                    "trained_pass_rate/50-75": 0.25, "trained_pass_rate/75-100": 0.0, "trained_pass_rate/100": 0.25}


# -- adaptive KL -----------------------------------------------------------------------------------------------------
def test_adaptive_kl_moves_beta_towards_the_target():
    c = KLController(0.1, target=0.02, rate=0.1)
    assert c.update(0.04) == pytest.approx(0.1 * (1 + 0.1 * 0.2))  # KL 2x the target: error clipped at +0.2
    c = KLController(0.1, target=0.02, rate=0.1)
    assert c.update(0.019) == pytest.approx(0.1 * (1 + 0.1 * (0.019 / 0.02 - 1)))  # -0.05 -> x 0.995, smaller
    c = KLController(0.1, target=0.02, rate=0.1)
    assert c.update(0.0) == pytest.approx(0.1 * 0.98)  # no KL at all: down by the clipped 0.2
    assert c.update(None) == pytest.approx(0.098)  # not measured: unchanged
    fixed = KLController(0.1)
    assert fixed.update(5.0) == 0.1 and not fixed.adaptive
    with pytest.raises(ConfigError, match="kl_target=0.02 with beta=0"):
        load_config(None, ["algorithm.kl_target=0.02"])


# -- replay ----------------------------------------------------------------------------------------------------------
def test_replay_adds_exactly_weight_times_the_sft_gradient_of_its_batch(tiny_model_dir, count_samples):
    cfg = load_config(None, ["rollout.group_size=2", "rollout.max_new_tokens=4", "trainer.max_grad_norm=1e9"])
    policy = load_policy(tiny_model_dir)
    opt = torch.optim.SGD(policy.model.parameters(), lr=1.0)
    ctx = StepContext(policy, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                      [RewardSpec("accuracy", 1.0, {"strict": False})], cfg.rollout, cfg.algorithm, cfg.trainer,
                      generator=torch.Generator().manual_seed(0))
    labelled = count_samples[2:6]
    ctx.replay = Replay(labelled, 0.5, 1, 3, cfg.sft.target_template, "{problem}", None)
    ctx.step = 1
    batch = collect_and_score(ctx, count_samples[:2])
    batch.rewards.total = torch.zeros(4)  # all-equal rewards: the RL loss has no gradient, only the replay's
    traj = build_trajectories(ctx, batch)
    assert traj.advantages.abs().max() == 0
    before = {k: v.detach().clone() for k, v in policy.model.named_parameters()}
    # the batch replay will draw: the same generator state, the same draw
    replay_batch = ctx.replay.draw(torch.Generator().set_state(ctx.generator.get_state()))
    metrics = update(ctx, batch.prompts, traj)
    params = dict(policy.model.named_parameters())
    delta = {k: params[k].detach() - v for k, v in before.items()}
    with torch.no_grad():  # back to the weights before the step, to take the SFT gradient there
        for k, v in before.items():
            params[k].copy_(v)
    policy.model.zero_grad(set_to_none=True)
    expected_loss = sft_loss(policy, replay_batch, cfg.sft.target_template)
    (0.5 * expected_loss).backward()
    assert metrics["replay/loss"] == pytest.approx(expected_loss.item(), rel=1e-5)
    moved = 0
    for k, d in delta.items():  # SGD with lr 1: each weight moved by -(0.5 x the SFT gradient of the replay batch)
        grad = params[k].grad
        expected = torch.zeros_like(d) if grad is None else -grad
        assert torch.allclose(d, expected, atol=1e-6), k
        moved += int(d.abs().max() > 0)
    assert moved > 10


# -- 95% intervals ---------------------------------------------------------------------------------------------------
def test_wilson_interval_by_hand():
    # 30 of 100: p = 0.3, z = 1.96: center (0.3 + 0.019208) / 1.038415 = 0.307402, half
    # 1.96 sqrt(0.0021 + 0.000096) / 1.038415 = 0.088455 -> [0.2189, 0.3959]
    low, high = wilson_interval(30, 100)
    assert low == pytest.approx(0.2189, abs=1e-4) and high == pytest.approx(0.3959, abs=1e-4)
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == pytest.approx(1.0)
    assert wilson_interval(0, 10)[1] > 0.2  # not empty at p = 0
    half = lambda n: (wilson_interval(n // 2, n)[1] - wilson_interval(n // 2, n)[0]) / 2  # noqa: E731
    assert half(600) <= 0.04 < half(500)  # the default eval set's size: at most +-4 points


def test_accuracy_interval_greedy_is_wilson_and_sampled_is_a_bootstrap_over_prompts():
    greedy = [[True]] * 30 + [[False]] * 70
    assert accuracy_interval(greedy) == wilson_interval(30, 100)
    sampled = [[True, True, False, False]] * 50  # every prompt 50%: no spread between prompts
    low, high = accuracy_interval(sampled)
    assert low == pytest.approx(0.5) and high == pytest.approx(0.5)
    mixed = [[True] * 4] * 50 + [[False] * 4] * 50  # prompts are all right or all wrong: the answers are not 400 draws
    low, high = accuracy_interval(mixed)
    assert high - low > wilson_interval(200, 400)[1] - wilson_interval(200, 400)[0]
    assert bootstrap_interval([0.0, 1.0] * 50) == bootstrap_interval([0.0, 1.0] * 50)  # seeded
    assert math.isclose(sum(bootstrap_interval([0.0, 1.0] * 50)) / 2, 0.5, abs_tol=0.02)


# -- resume ----------------------------------------------------------------------------------------------------------
def test_curriculum_replay_and_adaptive_kl_survive_resume_exactly(tmp_path):
    """Curriculum, replay, adaptive KL and dynamic sampling's fill draw (whose first round is sized from the step
    before: the checkpoint keeps that step's signal share), resumed at step 2: steps 3 and 4 as in the straight run."""
    from tests.test_train_e2e import small_config
    from vlmrl.trainer.run import train

    extra = ["trainer.steps=4", "curriculum.order=learnability", "curriculum.filter_solved=true",
             "curriculum.filter_unsolved=true", "replay.weight=0.5", "replay.batch_size=2", "algorithm.beta=0.04",
             "algorithm.kl_target=0.001", "algorithm.dynamic_sampling=true", "algorithm.resample_draw=fill"]
    train(small_config(tmp_path / "a", *extra))
    train(small_config(tmp_path / "b", *extra, "trainer.save_every=2"))
    train(small_config(tmp_path / "b", *extra), resume=tmp_path / "b/run/checkpoint-2")

    def rows(run):
        lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r for r in lines if r["phase"] == "train"}

    straight, resumed = rows(tmp_path / "a/run"), rows(tmp_path / "b/run")
    keys = ["loss", "kl", "kl_beta", "replay/loss", "curriculum/seen_prompts", "curriculum/filtered_unsolved",
            "curriculum/filtered_solved", "dynamic_sampling/prompts"]
    for step in (3, 4):
        assert {k: resumed[step][k] for k in keys} == {k: straight[step][k] for k in keys}, step
    betas = [straight[s]["kl_beta"] for s in (1, 2, 3, 4)]
    assert betas[0] == 0.04 and betas[1] != betas[0]  # the controller moved beta, and the resumed run kept it
