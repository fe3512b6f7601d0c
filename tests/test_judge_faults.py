"""The judge against a real local HTTP server that fails on cue: every injected failure is counted, once, in the
counter that names it, and nothing else is (reward/judge/failures = the samples whose value failed)."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from PIL import Image

from tests.judge_server import JudgeServer
from vlmrl.rewards import RewardSpec, compute_rewards
from vlmrl.rewards.judge import OUTCOMES, JudgeClient, JudgeRefusedError

FAST = {"backoff_base": 0.01, "timeout": 2.0, "cache_dir": None, "prediction": "completion"}
RED = Image.new("RGB", (16, 16), (255, 0, 0))


def spec_for(base_url: str, **kwargs) -> RewardSpec:
    return RewardSpec("judge", kwargs={"base_url": base_url, "model": "judge-model", **FAST, **kwargs})


def score(spec: RewardSpec, answers: list[str], images: bool = False):
    columns = {"problem": ["What colour?"] * len(answers), "solution": ["red"] * len(answers)}
    if images:
        columns["images"] = [[RED]] * len(answers)
    out = compute_rewards([spec], answers, columns)
    return out, out.metrics()


def outcomes(m: dict) -> dict:
    """The batch's request outcomes (each distinct request has exactly one)."""
    return {name: m[f"reward/judge/{name}"] for name in OUTCOMES.values() if m[f"reward/judge/{name}"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_mixed_batch_counts_each_injected_failure_once():
    """Eight distinct answers, six of them failing six different ways (max_retries=0: one attempt each)."""
    rules = {"A1": "ok", "A2": "500", "A3": "null", "A4": "null_length", "A5": "length", "A6": "disconnect",
             "A7": "400image", "A8": "slow"}
    answers = list(rules)
    with JudgeServer(rules=rules, slow_seconds=2.0) as server:  # timeout 0.6: margin for a loaded machine
        out, m = score(spec_for(server.base_url, max_retries=0, timeout=0.6), answers)
    assert out.components["judge"] == [0.0] + [None] * 7  # "A1" != "red": a verdict of 0.0
    assert out.failures["judge"] == 7 and m["reward/judge/failures"] == 7 and out.failed.sum() == 7
    assert outcomes(m) == {"verdicts": 1, "http_failures": 4, "no_verdict": 1, "cut_at_max_tokens": 2}
    assert (m["reward/judge/server_errors"], m["reward/judge/connection_errors"], m["reward/judge/refused"],
            m["reward/judge/timeouts"], m["reward/judge/malformed"]) == (1, 1, 1, 1, 0)
    # the server saw no more than the 8 attempts (on a loaded machine the one that timed out after 0.6 s may not have
    # been read by the server before it shut down: the default suite once saw 7)
    assert m["reward/judge/requests"] == 8 and m["reward/judge/retries"] == 0 and len(server.requests) <= 8
    errors = {answers[i]: d["error"] for i, d in enumerate(out.details["judge"])}
    assert all(e.startswith(f"judge {server.base_url}/chat/completions: ") for e in list(errors.values())[1:])
    assert "no content (content: null" in errors["A3"]
    assert "reply cut at max_tokens=256" in errors["A4"] and "reply cut at max_tokens=256" in errors["A5"]
    assert "connection broken" in errors["A6"] and "not a multimodal model" in errors["A7"]
    assert out.errors["judge"].startswith(f"sample 1: judge {server.base_url}")  # not "judge: judge http://..."


def test_replies_without_a_verdict_are_not_retried():
    """content: null and finish_reason: length are valid replies: the same request would be cut the same way."""
    with JudgeServer(rules={"NULL1": "null", "CUT1": "null_length"}) as server:
        out, m = score(spec_for(server.base_url, max_retries=3), ["NULL1", "CUT1"])
    assert len(server.requests) == 2 and m["reward/judge/retries"] == 0 and m["reward/judge/malformed"] == 0
    assert outcomes(m) == {"no_verdict": 1, "cut_at_max_tokens": 1} and out.failures["judge"] == 2
    assert [d["attempts"] for d in out.details["judge"]] == [1, 1]


def test_attempts_count_the_attempts_made():
    with JudgeServer(rules={"": "500"}) as server:
        out, m = score(spec_for(server.base_url, max_retries=3), ["a"])
    assert out.details["judge"][0]["attempts"] == 4 and len(server.requests) == 4
    assert "gave up after 4 attempts" in out.details["judge"][0]["error"]
    assert outcomes(m) == {"http_failures": 1} and m["reward/judge/server_errors"] == 4 and out.failures["judge"] == 1


def test_429_waits_for_retry_after_then_succeeds():
    with JudgeServer(script=["429", "429"], retry_after="0.3") as server:
        start = time.monotonic()
        out, m = score(spec_for(server.base_url, max_retries=2, concurrency=1), ["red"])
        elapsed = time.monotonic() - start
    assert out.components["judge"] == [1.0] and out.failures["judge"] == 0 and elapsed >= 0.6
    assert m["reward/judge/rate_limited"] == 2 and m["reward/judge/retries"] == 2 and outcomes(m) == {"verdicts": 1}


def test_slow_replies_beyond_the_timeout_fail_as_timeouts():
    with JudgeServer(rules={"": "slow"}, slow_seconds=1.0) as server:
        start = time.monotonic()
        out, m = score(spec_for(server.base_url, max_retries=1, timeout=0.2, concurrency=3), ["a", "b", "c"])
        elapsed = time.monotonic() - start
    assert out.failures["judge"] == 3 and outcomes(m) == {"http_failures": 3}
    assert m["reward/judge/timeouts"] == 6 and m["reward/judge/requests"] == 6 and elapsed < 1.5


def test_a_body_cut_mid_read_fails_its_request_only_and_is_retried():
    with JudgeServer(script=["disconnect"]) as server:  # the first request's body is cut, its retry succeeds
        out, m = score(spec_for(server.base_url, max_retries=1, concurrency=1), ["red", "blue"])
    assert out.components["judge"] == [1.0, 0.0] and out.failures["judge"] == 0
    assert m["reward/judge/connection_errors"] == 1 and m["reward/judge/retries"] == 1
    assert out.details["judge"][0]["attempts"] == 2 and outcomes(m) == {"verdicts": 2}


def test_a_refused_connection_is_retried_until_the_server_is_up():
    port = free_port()
    servers = []

    def start_late():  # vLLM-like: nothing listens for a while, then the server answers
        time.sleep(0.6)
        servers.append(JudgeServer(port=port).__enter__())

    threading.Thread(target=start_late, daemon=True).start()
    spec = spec_for(f"http://127.0.0.1:{port}/v1", max_retries=0, connect_window=10.0, backoff_base=0.05)
    try:
        out, m = score(spec, ["red"])
    finally:
        for s in servers:
            s.__exit__(None, None, None)
    assert out.components["judge"] == [1.0] and out.failures["judge"] == 0 and outcomes(m) == {"verdicts": 1}
    attempts = out.details["judge"][0]["attempts"]  # max_retries=0, yet retried: inside the connect window
    assert attempts >= 2 and m["reward/judge/connection_errors"] == attempts - 1 == m["reward/judge/retries"]


def test_the_connect_window_ends_and_the_deadline_bounds_it():
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing will ever listen here
    client = JudgeClient(url, "m", cache_dir=None, backoff_base=0.01, backoff_max=0.1, max_retries=1,
                         connect_window=0.3)
    start = time.monotonic()
    result = client.judge_many([client.messages("q", "a", "r")])[0]
    elapsed = time.monotonic() - start
    assert result.outcome == "http_failure" and "connection failed" in result.error and 0.3 <= elapsed < 1.0
    assert client.stats["http_failures"] == 1 and client.stats["connection_errors"] == result.attempts
    # the window ran from the first refusal for the whole client: a later request does not wait it out again
    start = time.monotonic()
    again = client.judge_many([client.messages("q", "b", "r")])[0]
    assert again.attempts == 2 and time.monotonic() - start < 0.3 and client.stats["http_failures"] == 2
    # a long window is still bounded by the batch deadline, backoff included (its first wait is 1-2 s)
    patient = JudgeClient(url, "m", cache_dir=None, backoff_base=2.0, connect_window=60.0)
    start = time.monotonic()
    late = patient.judge_many([patient.messages("q", "a", "r")], deadline=time.monotonic() + 0.3)[0]
    assert late.outcome == "deadline" and time.monotonic() - start < 0.8
    assert patient.stats["deadline_misses"] == 1 and patient.stats["http_failures"] == 0


def test_an_image_refusal_that_repeats_stops_training_with_one_message():
    answers = [f"answer {i}" for i in range(6)]
    with JudgeServer(rules={"": "400image"}) as server:
        spec = spec_for(server.base_url, concurrency=1, refusal_limit=3)
        with pytest.raises(JudgeRefusedError) as err:
            score(spec, answers, images=True)
        assert len(server.requests) == 3  # not retried, and not paid again for the other 3 answers
        with pytest.raises(JudgeRefusedError):  # the next step stops at once, without the network
            score(spec, ["other"], images=True)
        assert len(server.requests) == 3
    message = str(err.value)
    assert "3 requests in a row were refused with the same HTTP 400: Qwen2ForCausalLM is not a multimodal model" \
        in message and "set send_images: false" in message and message.startswith(f"judge {server.base_url}")


def test_a_refusal_that_does_not_repeat_is_a_counted_failure():
    with JudgeServer(script=["400image", "ok", "400image", "ok", "400image"]) as server:
        out, m = score(spec_for(server.base_url, concurrency=1, refusal_limit=2), [f"a{i}" for i in range(5)], True)
    assert out.failures["judge"] == 3 and outcomes(m) == {"verdicts": 2, "http_failures": 3}
    assert m["reward/judge/refused"] == 3 and len(server.requests) == 5  # a refusal is not retried


@pytest.mark.parametrize("case", ["model", "path"])
def test_a_wrong_model_or_path_stops_with_what_to_change(case):
    with JudgeServer(rules={"": "404"}, served=("judge-model", "other")) as server:
        base = server.base_url if case == "model" else server.base_url.removesuffix("/v1")
        client = JudgeClient(base, "wrong-model" if case == "model" else "judge-model", cache_dir=None,
                             concurrency=1, refusal_limit=2)
        with pytest.raises(JudgeRefusedError) as err:
            client.judge_many([client.messages("q", f"a{i}", "r") for i in range(4)])
    assert client.stats["refused"] == 2 and client.stats["requests"] == 2
    if case == "model":
        assert "does not exist" in str(err.value)
        assert "the server serves ['judge-model', 'other'], not model='wrong-model'" in str(err.value)
    else:  # the server's own 404 for an unknown route, and GET /models is not there either
        assert "HTTP 404: Not Found" in str(err.value) and "check base_url" in str(err.value)


def test_a_loopback_judge_never_goes_through_a_proxy(monkeypatch):
    dead_proxy = f"http://127.0.0.1:{free_port()}"
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.setenv(name, dead_proxy)
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    with JudgeServer() as server:
        out, m = score(spec_for(server.base_url, max_retries=0), ["red"])
    assert out.components["judge"] == [1.0] and len(server.requests) == 1 and m["reward/judge/connection_errors"] == 0
