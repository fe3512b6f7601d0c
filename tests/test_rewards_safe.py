"""Safe execution: user rewards in worker processes under a time limit; hangs, crashes and exceptions become None
plus counted failures; a math check that would run for ever times out. Every test here is bounded in time."""

from __future__ import annotations

import textwrap
import time

import pytest
from PIL import Image

from vlmrl.config import RewardConfig
from vlmrl.rewards import FatalRewardError, RewardSpec, accuracy_reward, compute_rewards
from vlmrl.rewards.registry import reward_ref
from vlmrl.rewards.safe import Job, WorkerPool

USER_REWARDS = textwrap.dedent('''
    import asyncio, os, time
    from vlmrl.rewards import FatalRewardError

    def score(completions, solution, **columns):
        assert "images" not in columns  # only rewards that name `images` receive them
        return [float(c == s) for c, s in zip(completions, solution)]

    def hang(completions, **_):
        while True:
            pass

    def sleepy(completions, **_):
        time.sleep(60)

    def boom(completions, **_):
        raise KeyError("no such column")

    def crash(completions, **_):
        os._exit(3)

    def fatal(completions, **_):
        raise FatalRewardError("the key was refused")

    def width(completions, images, task, **_):
        return [float(imgs[0].width) if imgs else None for imgs in images]

    async def later(completions, **_):
        await asyncio.sleep(0.01)
        return [float(len(c)) for c in completions]

    def pid(completions, **_):
        return [float(os.getpid())] * len(completions)
''')


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_REWARDS)
    return path


@pytest.fixture
def pool():
    pool = WorkerPool(size=2)
    yield pool
    pool.close()


def test_user_reward_runs_in_a_worker_with_every_column(user_file, pool):
    spec = RewardSpec(f"{user_file}:score", 0.5)
    out = compute_rewards([spec], ["a", "b"], {"solution": ["a", "x"], "images": [[], []]}, pool=pool)
    assert out.components[spec.key] == [1.0, 0.0] and out.total.tolist() == [0.5, 0.0]
    worker_pid = compute_rewards([RewardSpec(f"{user_file}:pid")], ["a"], {}, pool=pool).components
    assert worker_pid[f"{user_file}:pid"][0] != __import__("os").getpid()


@pytest.mark.parametrize("name", ["hang", "sleepy"])
def test_a_hanging_reward_times_out_and_the_worker_is_replaced(user_file, pool, name):
    specs = [RewardSpec(f"{user_file}:{name}", timeout=0.5), RewardSpec("length", kwargs={"max_length": 4,
                                                                                           "cache_length": 2})]
    start = time.monotonic()
    out = compute_rewards(specs, ["ab", "abcdef"], {}, pool=pool)
    assert time.monotonic() - start < 5.0
    key = f"{user_file}:{name}"
    assert out.components[key] == [None, None] and out.failures[key] == 2 and "timed out" in out.errors[key]
    assert out.components["length"] == [0.0, -1.0]  # the other component is unaffected
    assert out.metrics()["reward/failure_rate"] == 2 / 4
    again = compute_rewards([RewardSpec(f"{user_file}:score")], ["a"], {"solution": ["a"]}, pool=pool)
    assert again.components[f"{user_file}:score"] == [1.0] and pool.restarts >= 1


def test_exceptions_and_crashes_are_counted_failures(user_file, pool):
    specs = [RewardSpec(f"{user_file}:boom"), RewardSpec(f"{user_file}:crash")]
    out = compute_rewards(specs, ["a", "b", "c"], {}, pool=pool)
    assert out.failures == {specs[0].key: 3, specs[1].key: 3}
    assert "KeyError" in out.errors[specs[0].key] and "worker died (exit code 3" in out.errors[specs[1].key]
    assert out.no_reward == 3


def test_fatal_errors_stop(user_file, pool):
    with pytest.raises(FatalRewardError, match="key was refused"):
        compute_rewards([RewardSpec(f"{user_file}:fatal")], ["a"], {}, pool=pool)


def test_images_go_only_to_rewards_that_name_them(user_file, pool):
    image = Image.new("RGB", (12, 7))
    columns = {"images": [[image], []], "task": ["t", "t"], "solution": ["a", "b"]}
    out = compute_rewards([RewardSpec(f"{user_file}:width"), RewardSpec(f"{user_file}:score")], ["a", "a"], columns,
                          pool=pool)
    assert out.components[f"{user_file}:width"] == [12.0, None]
    assert out.components[f"{user_file}:score"] == [1.0, 0.0]  # `score` asserts it got no images


def test_async_rewards_are_awaited(user_file, pool):
    isolated = compute_rewards([RewardSpec(f"{user_file}:later")], ["ab", "c"], {}, pool=pool)
    assert isolated.components[f"{user_file}:later"] == [2.0, 1.0]
    inline = compute_rewards([RewardSpec(f"{user_file}:later", isolate=False)], ["abc"], {})
    assert inline.components[f"{user_file}:later"] == [3.0]


def test_placement_rules():
    def local(completions, **_):
        return [1.0] * len(completions)

    assert reward_ref(local) is None  # a closure cannot be imported by a worker: it runs inline
    assert reward_ref(accuracy_reward) == "vlmrl.rewards.verifiable:accuracy_reward"
    spec = RewardSpec.from_config(RewardConfig(fn="x.py:f", weight=0.5, timeout=3.0, isolate=True))
    assert (spec.name, spec.weight, spec.timeout, spec.isolate) == ("x.py:f", 0.5, 3.0, True)


def test_pool_runs_jobs_in_parallel_within_a_batch_deadline(pool):
    pool.run([Job("time:sleep", (0,))] * 2)  # start both workers
    start = time.monotonic()
    outcomes = pool.run([Job("time:sleep", (0.4,)), Job("time:sleep", (0.4,))])
    assert all(o.ok for o in outcomes) and time.monotonic() - start < 0.75  # two workers
    outcomes = pool.run([Job("time:sleep", (0.3,))] * 6, deadline=time.monotonic() + 0.5)
    assert sum(o.ok for o in outcomes) == 2 and "budget" in outcomes[-1].error


def test_math_that_runs_forever_times_out_without_hanging():
    # 9^(9^(9^9)): CPython's big-integer power, which no signal interrupts; only killing the worker stops it
    completions = ["<answer>9^{9^{9^{9}}}</answer>", "<answer>x^2+2x+1</answer>", "<answer>x+2</answer>"]
    start = time.monotonic()
    out = compute_rewards([RewardSpec("accuracy", kwargs={"math_timeout": 1.0})], completions,
                          {"solution": ["(x+1)^2"] * 3, "answer_type": ["math"] * 3})
    elapsed = time.monotonic() - start
    assert out.components["accuracy"] == [None, 1.0, 0.0]
    assert out.failures["accuracy"] == 1 and "timed out" in out.errors["accuracy"]
    assert elapsed < 1.0 + 30.0  # the limit plus worker start-up (sympy import) on a loaded 2-core machine; the
    # pathological power itself would run for hours
    start = time.monotonic()  # the same pathological answer again: cached, no second wait
    assert accuracy_reward(completions[:1], ["(x+1)^2"], math_timeout=1.0)[0] != 1.0
    assert time.monotonic() - start < 0.5
