"""The LLM judge: the reply parser, and the client end to end over HTTP against a local fault-injecting server."""

from __future__ import annotations

import base64
import random
import re
import time

import pytest
from PIL import Image

from tests.judge_server import JudgeServer
from vlmrl.rewards import FatalRewardError, RewardSpec, compute_rewards, parse_feedback
from vlmrl.rewards.judge import JudgeAuthError, JudgeClient, encode_image

FAST = {"backoff_base": 0.01, "timeout": 2.0, "cache_dir": None}


def client_for(server: JudgeServer, **options) -> JudgeClient:
    return JudgeClient(server.base_url, "judge-model", **{**FAST, **options})


# ------------------------------------------------------------------------------------------------------ parser


def test_parse_verdicts_and_reasons():
    fb = parse_feedback("+ names the red circle\n- misses the square\n* neutral note\n[RELEVANT]")
    assert (fb.verdict, fb.score) == ("RELEVANT", 1.0)
    assert fb.reasons == ["names the red circle", "misses the square", "neutral note"]
    assert fb.signals == [1.0, -1.0, 0.0]
    assert parse_feedback("[irrelevant]").score == 0.0  # any case
    assert parse_feedback("1. a\n2) b\n3. c\n[IRRELEVANT]", max_reasons=2).reasons == ["a", "b"]
    assert parse_feedback("<think>[RELEVANT]? no.</think>\n- wrong colour\n[IRRELEVANT]").verdict == "IRRELEVANT"


def test_parse_refuses_ambiguous_or_missing_verdicts():
    both = parse_feedback("[RELEVANT] or maybe [IRRELEVANT]")
    assert both.verdict is None and both.score is None and "both" in both.error
    none = parse_feedback("I think it is fine.")
    assert none.score is None and "no verdict" in none.error
    assert parse_feedback("").score is None


def test_parse_scores():
    assert parse_feedback("+ good\nScore: 7/10").score == pytest.approx(0.7)
    assert parse_feedback("score = 10").score == 1.0
    assert parse_feedback("[Score: 3]").score == pytest.approx(0.3)
    assert parse_feedback("Score: 4/10 ... final Score: 6/10").score == pytest.approx(0.6)  # the last one
    assert parse_feedback("Score: 11/10").score is None  # out of range: no score
    assert parse_feedback("Score: -1").score is None


# --------------------------------------------------------------------------------------- client over HTTP


def test_retry_after_is_honoured_then_success():
    with JudgeServer(script=["429", "ok"], retry_after="1") as server:
        client = client_for(server)
        start = time.monotonic()
        fb = client.judge(question="q", prediction="red", reference="red")
        elapsed = time.monotonic() - start
    assert fb is not None and fb.score == 1.0 and fb.reasons[0] == "the answer matches the reference"
    assert len(server.requests) == 2 and elapsed >= 1.0  # waited the server's Retry-After, not the 0.01 s backoff
    assert client.stats["rate_limited"] == 1 and client.stats["retries"] == 1


@pytest.mark.parametrize("fault", ["500", "malformed", "slow"])
def test_transient_faults_are_retried(fault):
    with JudgeServer(script=[fault, fault], slow_seconds=1.0) as server:
        client = client_for(server, timeout=0.3)
        fb = client.judge(question="q", prediction="red", reference="blue")
    assert fb is not None and fb.score == 0.0 and len(server.requests) == 3
    assert client.stats["retries"] == 2
    counter = {"500": "server_errors", "malformed": "malformed", "slow": "timeouts"}[fault]
    assert client.stats[counter] == 2


def test_retries_stay_within_the_cap():
    with JudgeServer(rules={"": "500"}) as server:
        client = client_for(server, max_retries=2)
        fb = client.judge(question="q", prediction="a", reference="a")
    assert fb is None and "gave up after 3 attempts" in client.last_error and "HTTP 500" in client.last_error
    assert len(server.requests) == 3 and client.stats["http_failures"] == 1 and client.stats["server_errors"] == 3


def test_backoff_grows_exponentially_with_jitter():
    client = JudgeClient("http://127.0.0.1:9/v1", "m", backoff_base=1.0, backoff_max=5.0, cache_dir=None)
    random.seed(0)
    for attempt, d in enumerate([1, 2, 4, 5, 5]):  # d = min(5, 2**attempt); delay in [d/2, d]
        delays = [client.endpoint._backoff(attempt) for _ in range(50)]
        assert d / 2 <= min(delays) and max(delays) <= d and len(set(delays)) > 1


def test_auth_errors_stop_without_retry(monkeypatch):
    with JudgeServer(rules={"": "401"}) as server:
        monkeypatch.setenv("JUDGE_TEST_KEY", "sk-wrong")
        client = client_for(server, api_key_env="JUDGE_TEST_KEY")
        with pytest.raises(JudgeAuthError, match=r"HTTP 401.*JUDGE_TEST_KEY"):
            client.judge(question="q", prediction="a", reference="a")
    assert len(server.requests) == 1 and server.headers[0]["Authorization"] == "Bearer sk-wrong"
    monkeypatch.delenv("JUDGE_TEST_KEY")
    with pytest.raises(JudgeAuthError, match="JUDGE_TEST_KEY.*not set"):
        JudgeClient("http://127.0.0.1:9/v1", "m", api_key_env="JUDGE_TEST_KEY")
    assert issubclass(JudgeAuthError, FatalRewardError)


def test_reply_without_verdict_is_reported_and_not_cached(tmp_path):
    with JudgeServer(rules={"": "noverdict"}) as server:
        client = client_for(server, cache_dir=tmp_path)
        first = client.judge(question="q", prediction="a", reference="a")
        second = client.judge(question="q", prediction="a", reference="a")
    assert first.score is None and first.raw == "I cannot decide." and second.score is None
    assert len(server.requests) == 2 and client.stats["no_verdict"] == 2 and not list(tmp_path.rglob("*.json"))


def test_disk_cache_serves_repeats_and_reruns(tmp_path):
    with JudgeServer() as server:
        client = client_for(server, cache_dir=tmp_path)
        a = client.judge(question="q", prediction="red", reference="red")
        b = client.judge(question="q", prediction="red", reference="red")
        rerun = client_for(server, cache_dir=tmp_path)  # a new process would build a new client
        c = rerun.judge(question="q", prediction="red", reference="red")
        other_model = JudgeClient(server.base_url, "other-model", **{**FAST, "cache_dir": tmp_path})
        other_model.judge(question="q", prediction="red", reference="red")
    assert a.score == b.score == c.score == 1.0
    assert len(server.requests) == 2  # once for judge-model, once for other-model: the key includes the model
    assert client.stats["cache_hits"] == 1 and rerun.stats["cache_hits"] == 1 and rerun.stats["requests"] == 0


def test_images_are_sent_as_data_urls_under_the_cap():
    rng = random.Random(0)
    noise = Image.frombytes("RGB", (400, 400), bytes(rng.getrandbits(8) for _ in range(400 * 400 * 3)))
    small = Image.new("RGB", (20, 10), (255, 0, 0))
    with JudgeServer() as server:
        client = client_for(server, image_max_bytes=40_000)
        fb = client.judge(question="q", prediction="red", reference="red", images=[noise, small])
    assert fb.score == 1.0
    parts = server.requests[0]["messages"][-1]["content"]
    urls = [p["image_url"]["url"] for p in parts if p["type"] == "image_url"]
    assert len(urls) == 2 and urls[1].startswith("data:image/png;base64,")  # the small one fits as PNG
    sizes = [len(base64.b64decode(u.split(",", 1)[1])) for u in urls]
    assert max(sizes) <= 40_000 and urls[0].startswith("data:image/jpeg")  # noise: JPEG, downscaled
    assert encode_image(small) == urls[1]


def test_concurrency_is_bounded():
    with JudgeServer(delay=0.1) as server:
        client = client_for(server, concurrency=3)
        requests = [client.messages("q", f"answer {i}", "ref") for i in range(9)]
        start = time.monotonic()
        results = client.judge_many(requests)
        elapsed = time.monotonic() - start
    assert all(r.feedback is not None for r in results)
    assert server.max_in_flight == 3 and elapsed < 0.9 * 9 * 0.1  # parallel, but never more than 3 at once


# ------------------------------------------------------------------------------------------- the judge reward


def test_judge_reward_every_sample_ends_with_a_reward_or_a_counted_failure(tmp_path):
    rules = {"SLOW": "slow", "BROKEN": "malformed", "MUTE": "noverdict", "DOWN": "500"}
    answers = ["red", "blue", "SLOW", "BROKEN", "MUTE", "DOWN", "", "red"]
    completions = [f"<answer>{a}</answer>" if a else "no answer block" for a in answers]
    columns = {"problem": ["What color?"] * 8, "solution": ["red"] * 8}
    spec = RewardSpec("judge", kwargs={"base_url": None, "model": "judge-model", "timeout": 0.3, "max_retries": 2,
                                       "backoff_base": 0.01, "cache_dir": str(tmp_path)})
    with JudgeServer(rules=rules, slow_seconds=1.0) as server:
        spec.kwargs["base_url"] = server.base_url
        out = compute_rewards([spec], completions, columns)
        sent = len(server.requests)
        again = compute_rewards([spec], completions, columns)
    assert out.components["judge"] == [1.0, 0.0, None, None, None, None, 0.0, 1.0]
    assert out.failures["judge"] == 4 and out.total.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    # the four failures are marked as failed (left out of training), the blank answer's 0.0 is a score
    assert out.failed.tolist() == [False, False, True, True, True, True, False, False]
    metrics = out.metrics()
    assert metrics["reward/failure_rate"] == 4 / 8 and metrics["reward/failed_samples"] == 4
    # 2 good answers (the repeated "red" is sent once) + 3 attempts for each of SLOW, BROKEN, DOWN + 1 for MUTE
    assert sent == 2 + 3 * 3 + 1 and metrics["reward/judge/requests"] == sent
    # failures: the 4 samples whose value failed; the judge's own counts of its 6 distinct requests beside it
    assert metrics["reward/judge/retries"] == 3 * 2 and metrics["reward/judge/failures"] == 4
    assert (metrics["reward/judge/verdicts"], metrics["reward/judge/http_failures"],
            metrics["reward/judge/no_verdict"]) == (2, 3, 1)
    assert [d.get("attempts") for d in out.details["judge"]] == [1, 1, 3, 3, 1, 3, None, 1]
    assert out.details["judge"][6] == {"skipped": "no answer to judge"}
    assert out.details["judge"][0]["reasons"][0] == "the answer matches the reference"
    # the rerun: the two verdicts come from the cache, the failures are tried again
    assert again.components["judge"] == out.components["judge"]
    assert again.metrics()["reward/judge/cache_hits"] == 2 and again.metrics()["reward/judge/requests"] == 3 * 3 + 1


def reports_no_failures(completions, **_):
    """A reward that fails one sample while reporting 0 "failures" of its own."""
    from vlmrl.rewards import RewardBatch, RewardFailure

    return RewardBatch([1.0, RewardFailure("down")], {"failures": 0.0, "calls": 2.0})


def test_a_rewards_own_failures_counter_never_overwrites_the_count_of_lost_values():
    spec = RewardSpec("tests.test_judge:reports_no_failures", label="own", isolate=False)
    m = compute_rewards([spec], ["a", "b"], {}).metrics()
    assert m["reward/own/failures"] == 1 and m["reward/own/reported_failures"] == 0 and m["reward/own/calls"] == 2


def test_judge_reward_refuses_the_repeated_closing_tag_hack():
    with JudgeServer() as server:
        spec = RewardSpec("judge", kwargs={"base_url": server.base_url, "model": "m", **FAST})
        out = compute_rewards([spec], ["<answer>red</answer></answer></answer>"], {"solution": ["red"]})
    assert out.components["judge"] == [0.0] and server.requests == []


def test_judge_reward_auth_error_stops_scoring(monkeypatch):
    monkeypatch.setenv("JUDGE_TEST_KEY", "sk-x")
    with JudgeServer(rules={"": "401"}) as server:
        spec = RewardSpec("judge", kwargs={"base_url": server.base_url, "model": "m", "api_key_env": "JUDGE_TEST_KEY",
                                           **FAST})
        with pytest.raises(FatalRewardError, match="401"):
            compute_rewards([spec], ["<answer>red</answer>"], {"solution": ["red"]})


def judge_spec(server: JudgeServer, **kwargs) -> RewardSpec:
    return RewardSpec("judge", kwargs={"base_url": server.base_url, "model": "m", "prediction": "completion",
                                       **FAST, **kwargs})


def test_judge_batch_deadline_bounds_a_hung_endpoint():
    """m9: a hung endpoint costs one batch deadline, not (retries + 1) x timeout per request."""
    completions = [f"answer {i}" for i in range(6)]
    with JudgeServer(rules={"": "slow"}, slow_seconds=3.0) as server:
        spec = judge_spec(server, timeout=5.0, max_retries=3, concurrency=2, batch_timeout=0.5)
        start = time.monotonic()
        out = compute_rewards([spec], completions, {"solution": ["x"] * 6})
        elapsed = time.monotonic() - start
    assert elapsed < 2.5 and out.components["judge"] == [None] * 6  # vs 6 / 2 x 3 s at least without it
    assert out.failed.all() and out.failures["judge"] == 6
    assert out.metrics()["reward/judge/deadline_misses"] == 6 and "deadline" in out.errors["judge"]


def test_judge_circuit_opens_after_consecutive_failures_and_recovers():
    completions = [f"answer {i}" for i in range(6)]
    with JudgeServer(script=["500"] * 4) as server:  # 4 failures, then the endpoint is back
        spec = judge_spec(server, max_retries=0, concurrency=1, circuit_failures=3, circuit_cooldown=0.3)
        out = compute_rewards([spec], completions, {"solution": ["x"] * 6})
        m = out.metrics()
        assert len(server.requests) == 3  # the circuit opened after 3: the other 3 never reached the network
        assert m["reward/judge/circuit_opens"] == 1 and m["reward/judge/short_circuited"] == 3
        assert out.failed.all() and out.failures["judge"] == 6
        assert ["circuit open" in d["error"] for d in out.details["judge"]] == [False] * 3 + [True] * 3
        again = compute_rewards([spec], completions, {"solution": ["x"] * 6})  # still open: nothing is sent
        assert len(server.requests) == 3 and again.metrics()["reward/judge/short_circuited"] == 6
        time.sleep(0.35)  # after the cool-down a request goes through; it fails (the 4th scripted 500): open again
        compute_rewards([spec], completions, {"solution": ["x"] * 6})
        assert len(server.requests) == 4
        time.sleep(0.35)  # then the endpoint answers: the circuit closes and every answer is judged
        last = compute_rewards([spec], completions, {"solution": ["x"] * 6})
        assert len(server.requests) == 10 and not last.failed.any() and last.components["judge"] == [0.0] * 6
        server.script.append("500")  # one failure after a reply: the count starts again, the circuit stays closed
        fresh = compute_rewards([spec], ["other 1", "other 2", "other 3"], {"solution": ["x"] * 3})
    assert fresh.failed.tolist() == [True, False, False] and fresh.metrics()["reward/judge/short_circuited"] == 0


def test_a_judge_timeout_in_an_all_equal_group_is_not_a_penalty(tiny_model_dir, count_samples):
    """D4/M3: one answer's judge request times out while its group's other answers all get 1.0. The failure is not
    a 0: every advantage stays 0, the failed answer gets no loss, and the failure is counted."""
    import torch

    from vlmrl.config import load_config
    from vlmrl.models import load_policy
    from vlmrl.trainer.rl import StepContext, build_trajectories, collect_and_score

    cfg = load_config(None, ["rollout.group_size=4", "rollout.max_new_tokens=6"])
    policy = load_policy(tiny_model_dir)
    opt = torch.optim.SGD(policy.model.parameters(), lr=0.1)
    with JudgeServer(script=["slow"], slow_seconds=1.0, reply=lambda prompt: "+ fine\n[RELEVANT]") as server:
        spec = judge_spec(server, timeout=0.3, max_retries=0, concurrency=1)  # the first request (row 0) times out
        ctx = StepContext(policy, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), [spec], cfg.rollout,
                          cfg.algorithm, cfg.trainer, generator=torch.Generator().manual_seed(0))
        batch = collect_and_score(ctx, count_samples[:2])
    texts = batch.rollout.texts
    assert all(t.strip() for t in texts)  # (every answer goes to the judge: a blank one would pay 0 unasked)
    failed = [t == texts[0] for t in texts]  # (a repeat of row 0's answer shares its one request)
    assert batch.rewards.failed.tolist() == failed and batch.rewards.components["judge"][1:4] == [
        None if f else 1.0 for f in failed[1:4]]
    traj = build_trajectories(ctx, batch)
    assert torch.equal(traj.advantages, torch.zeros(8))  # as a 0, the failure would push its siblings up
    assert traj.loss_mask[0].sum() == 0 and traj.loss_mask[~torch.tensor(failed)].sum(-1).min() > 0
    m = batch.rewards.metrics()
    assert m["reward/failed_samples"] == sum(failed) and m["reward/judge/timeouts"] == 1
    assert m["reward/total/mean"] == 1.0  # the step's reward curve does not dip for an infrastructure failure


# ----------------------------------------------------------------------------------------------- inspect-reward


def test_inspect_reward_prints_components_and_the_judges_feedback(tmp_path, capsys):
    from vlmrl.cli import main

    image = tmp_path / "scene.png"
    Image.new("RGB", (28, 28), (255, 0, 0)).save(image)
    with JudgeServer() as server:
        recipe = tmp_path / "judge.yaml"
        recipe.write_text(
            "rewards:\n  - {name: accuracy, weight: 1.0}\n  - {name: format, weight: 0.5}\n"
            f"  - {{name: judge, weight: 0.5, kwargs: {{base_url: '{server.base_url}', model: m, cache_dir: null}}}}\n")
        args = ["inspect-reward", str(recipe), "--question", "What color is it?", "--prediction",
                "<think>it is red</think><answer>red</answer>", "--solution", "red", "--image", str(image)]
        assert main(args) == 0
    out = capsys.readouterr().out
    assert "accuracy" in out and "format" in out and "judge" in out
    assert re.search(r"^total\s+2\.0000$", out, flags=re.M)  # 1 + 0.5 * 1 + 0.5 * 1
    assert "verdict: RELEVANT" in out and "+ the answer matches the reference" in out and "[RELEVANT]" in out
    parts = server.requests[0]["messages"][-1]["content"]
    assert parts[1]["image_url"]["url"].startswith("data:image/png;base64,")
