"""LLM judge (generative reward model) over any OpenAI-compatible `/v1/chat/completions` endpoint.

vLLM's and llama.cpp's servers, `vlmrl serve`-style apps and hosted APIs speak the same protocol. `JudgeClient` sends
one chat request per graded answer (the prompt from a template in `feedback.py`, images as base64 data URLs under a
size cap), parses the reply with `parse_feedback`, and is careful about everything that goes wrong over a network:

- bounded concurrency (a thread pool of `concurrency` requests in flight) and a `timeout` per attempt;
- retries over httpx (`vlmrl.rewards.judge_http`): at most `max_retries`, on 429 (after its Retry-After), 5xx,
  timeouts, broken connections and malformed JSON, with exponential backoff and jitter; a refused connection is
  retried for up to `connect_window` seconds, so a server that is restarting is waited for;
- 401/403, or an unset key variable, raise `JudgeAuthError` (a FatalRewardError): training stops with a message
  naming the key variable, instead of counting a failure on every sample for hours;
- a refusal that repeats (`refusal_limit` identical 4xx in a row with no reply between: a wrong model or path, a
  text-only model sent images) raises `JudgeRefusedError` (a FatalRewardError), once, with what to change;
- a reply with `content: null` or cut at max_tokens is a reply without a verdict, not a malformed one: it is not
  retried (the same request would be cut the same way) and its error says so;
- an on-disk cache keyed by (model, messages with the images, generation settings): a rerun does not pay twice;
- a deadline for a whole batch (`judge_many(..., deadline=)`): no attempt starts, and no attempt or backoff runs,
  past it; what is not judged by then fails;
- a circuit breaker: after `circuit_failures` requests in a row failed for good, the circuit opens for
  `circuit_cooldown` seconds, and requests fail at once without touching the network; then requests go through
  again, and the next failure reopens it at once. A down endpoint costs one batch of timeouts, not every step's.

Every request ends in exactly one outcome, counted in `stats`: verdicts, cache_hits, http_failures, no_verdict,
cut_at_max_tokens, deadline_misses or short_circuited (all but the first two are failed requests). The attempt
counters (requests, retries, rate_limited, server_errors, timeouts, connection_errors, malformed, refused) count
HTTP attempts; circuit_opens counts openings.

    client = JudgeClient("http://127.0.0.1:8000/v1", "qwen2.5-vl-7b", api_key_env="JUDGE_API_KEY")
    feedback = client.judge(question="How many circles?", prediction="3", reference="3", images=[image])
    feedback.score, feedback.reasons  # 1.0, ["+ ..."]; None when the call failed (see client.last_error)
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmrl.cache import BoundedLRU
from vlmrl.rewards.feedback import TEMPLATES, Feedback, fill_template, parse_feedback, verdict_probability
from vlmrl.rewards.judge_http import ChatEndpoint, DeadlinePassed, JudgeAuthError, JudgeError, JudgeRefused, Reply
from vlmrl.rewards.registry import FatalRewardError

__all__ = ["Feedback", "JudgeAuthError", "JudgeClient", "JudgeError", "JudgeRefusedError", "JudgeResult",
           "encode_image", "parse_feedback"]
DEFAULT_CACHE_DIR = "~/.cache/vlmrl/judge"
GRADED_TOP_LOGPROBS = 5  # alternatives a graded judge asks for at each token
# a request's outcome -> the counter it adds to (one each)
OUTCOMES = {"verdict": "verdicts", "cached": "cache_hits", "http_failure": "http_failures",
            "no_verdict": "no_verdict", "cut": "cut_at_max_tokens", "deadline": "deadline_misses",
            "short_circuited": "short_circuited"}
ATTEMPT_COUNTERS = ("requests", "retries", "rate_limited", "server_errors", "timeouts", "connection_errors",
                    "malformed", "refused")
_IMAGES_REFUSED = re.compile(r"image|multi-?modal|vision", flags=re.I)


class JudgeRefusedError(FatalRewardError):
    """The endpoint refused `refusal_limit` requests in a row the same way (same 4xx, same message): every later
    request would be refused too, so training stops with the server's message and what to change."""


@dataclass
class JudgeResult:
    """One request's outcome: `feedback` (None when the request failed; see `error`), whether it came from the
    cache, how many HTTP attempts it took (0 for a cache hit or a request that never went out), and `outcome` (a key
    of OUTCOMES). `failed`: no score came of it."""

    feedback: Feedback | None
    error: str | None = None
    cached: bool = False
    attempts: int = 0
    outcome: str = "verdict"

    @property
    def failed(self) -> bool:
        return self.feedback is None or self.feedback.score is None


def encode_image(image: Any, max_bytes: int = 512_000) -> str:
    """A `data:image/...;base64,` URL of `image` (a PIL image, raw bytes or a file path) whose encoded file is at
    most `max_bytes`: PNG if it fits, else JPEG, downscaled step by step until it fits."""
    from PIL import Image

    if isinstance(image, (str, Path)):
        image = Image.open(image)
    elif isinstance(image, (bytes, bytearray)):
        image = Image.open(io.BytesIO(image))
    image = image.convert("RGB")
    for _ in range(12):
        for fmt in ("PNG", "JPEG"):
            buffer = io.BytesIO()
            image.save(buffer, format=fmt, **({"quality": 85} if fmt == "JPEG" else {}))
            data = buffer.getvalue()
            if len(data) <= max_bytes:
                return f"data:image/{fmt.lower()};base64,{base64.b64encode(data).decode()}"
        scale = max(0.1, min(0.9, (max_bytes / len(data)) ** 0.5))
        image = image.resize((max(1, int(image.width * scale)), max(1, int(image.height * scale))))
    raise ValueError(f"could not encode an image under image_max_bytes={max_bytes}")


def _reply_bytes(key: str, reply: tuple[str, float | None]) -> int:
    return sys.getsizeof(key) + sys.getsizeof(reply[0]) + 24


class JudgeCache:
    """Replies on disk, one JSON file per key under `folder` (written atomically), plus an in-memory copy of the
    recent ones (a BoundedLRU of `memory_mb` MiB: a long run's replies would otherwise all stay in memory). A reply
    is its text and, for a graded judge, its verdict's probability (None otherwise)."""

    def __init__(self, folder: str | Path | None, memory_mb: float = 64):
        self.folder = Path(folder).expanduser() if folder else None
        self._memory: BoundedLRU[str, tuple[str, float | None]] = BoundedLRU(int(memory_mb * 2**20), 65_536,
                                                                              _reply_bytes)

    @staticmethod
    def key(model: str, messages: list[dict], settings: dict) -> str:
        blob = json.dumps({"model": model, "messages": messages, "settings": settings}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()

    def get(self, key: str) -> tuple[str, float | None] | None:
        reply = self._memory.get(key)
        if reply is not None or self.folder is None:
            return reply
        path = self.folder / key[:2] / f"{key}.json"
        try:
            saved = json.loads(path.read_text())
            reply = (str(saved["content"]), None if saved.get("probability") is None else float(saved["probability"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        self._memory.put(key, reply)
        return reply

    def put(self, key: str, model: str, content: str, probability: float | None = None) -> None:
        self._memory.put(key, (content, probability))
        if self.folder is None:
            return
        path = self.folder / key[:2] / f"{key}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps({"model": model, "content": content, "probability": probability}))
        os.replace(tmp, path)


class JudgeClient:
    """A client for one judge (endpoint + model). Thread-safe; `judge_many` runs `concurrency` requests at once.

    base_url: e.g. "http://127.0.0.1:8000/v1" (the client posts to base_url + "/chat/completions").
    api_key_env: the name of the environment variable that holds the key (None: send no key).
    template: a prompt with {question}, {prediction}, {reference}, {max_reasons}; default by `mode` ("verdict":
        [RELEVANT]/[IRRELEVANT]; "score": Score: N/10). cache_dir: None disables the disk cache.
    connect_window: seconds a refused connection is retried for (from the first refusal after the last reply),
        besides `max_retries`. refusal_limit: identical 4xx refusals in a row that stop training (0: never).
    circuit_failures: requests in a row that failed for good before the circuit opens (0: never opens);
        circuit_cooldown: seconds it stays open.
    graded: ask for the reply's token log-probs (`logprobs`, `top_logprobs` 5) and make a verdict's score the
        judge's probability of [RELEVANT] at the token that decides the tag (`verdict_probability`), not 1 or 0.
        A reply whose log-probs do not show that decision keeps its tag's 1 or 0 and counts as `ungraded`.
    stats: the counters of the module docstring, since the client was made."""

    def __init__(self, base_url: str, model: str, *, api_key_env: str | None = None, template: str | None = None,
                 mode: str = "verdict", max_reasons: int = 3, timeout: float = 30.0, max_retries: int = 3,
                 concurrency: int = 8, cache_dir: str | Path | None = DEFAULT_CACHE_DIR,
                 image_max_bytes: int = 512_000, max_tokens: int = 256, temperature: float = 0.0,
                 backoff_base: float = 0.5, backoff_max: float = 30.0, retry_after_max: float = 60.0,
                 connect_window: float = 180.0, refusal_limit: int = 3, system_prompt: str | None = None,
                 circuit_failures: int = 8, circuit_cooldown: float = 60.0, graded: bool = False):
        if mode not in TEMPLATES:
            raise ValueError(f"judge mode={mode!r}: expected one of {sorted(TEMPLATES)}")
        if graded and mode != "verdict":
            raise ValueError(f"judge graded=true reads the probability of a verdict tag; mode={mode!r} asks for a "
                             "score: use mode verdict, or leave graded off")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.mode, self.max_reasons = model, mode, max_reasons
        self.template = template or TEMPLATES[mode]
        self.image_max_bytes, self.system_prompt = image_max_bytes, system_prompt
        self.settings = {"max_tokens": max_tokens, "temperature": temperature}
        self.graded = graded
        if graded:  # part of the cache key: a graded reply is not a plain one
            self.settings.update(logprobs=True, top_logprobs=GRADED_TOP_LOGPROBS)
        self.api_key_env = api_key_env
        api_key = os.environ.get(api_key_env) if api_key_env else None
        if api_key_env and not api_key:
            raise JudgeAuthError(f"judge {self.url}: the environment variable {api_key_env} that should hold the API "
                                 "key is not set; export it, or remove api_key_env for a server without a key")
        self.cache = JudgeCache(cache_dir)
        self.stats = dict.fromkeys((*OUTCOMES.values(), *ATTEMPT_COUNTERS, "circuit_opens", "ungraded"), 0)
        self.last_error: str | None = None
        self.refusal_limit = refusal_limit
        self.circuit_failures, self.circuit_cooldown = circuit_failures, circuit_cooldown
        self._failed_in_a_row = 0
        self._open_until = 0.0  # time.monotonic() until which the circuit is open
        self._refusal: tuple[int, str] | None = None  # the last refusal (status, message) and how often in a row
        self._refusals = 0
        self._fatal: FatalRewardError | None = None  # once set, every request raises it
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="vlmrl-judge")
        self.endpoint = ChatEndpoint(base_url, api_key=api_key, api_key_env=api_key_env, timeout=timeout,
                                     max_retries=max_retries, backoff_base=backoff_base, backoff_max=backoff_max,
                                     retry_after_max=retry_after_max, connect_window=connect_window,
                                     concurrency=concurrency, count=self._count)

    # ------------------------------------------------------------------------------------------------ requests
    def messages(self, question: str, prediction: str, reference: str, images: list[Any] | None = None,
                 _encoded: dict[int, tuple[Any, str]] | None = None) -> list[dict]:
        """The chat messages for one answer: the filled template, then the images as data URLs."""
        text = fill_template(self.template, question=question, prediction=prediction, reference=reference,
                             max_reasons=self.max_reasons)
        content: Any = text
        if images:
            parts: list[dict] = [{"type": "text", "text": text}]
            for image in images:
                memo = _encoded if _encoded is not None else {}
                # the memo holds the image itself beside its URL: while it is alive no other image can take its id
                # (images may come from a bounded decode cache that frees them mid-batch)
                if id(image) not in memo:
                    memo[id(image)] = (image, encode_image(image, self.image_max_bytes))
                parts.append({"type": "image_url", "image_url": {"url": memo[id(image)][1]}})
            content = parts
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": content}]

    def judge(self, messages: list[dict] | None = None, *, question: str = "", prediction: str = "",
              reference: str = "", images: list[Any] | None = None) -> Feedback | None:
        """Feedback for one answer (given as chat `messages`, or as question/prediction/reference/images), or None
        when the request failed (the reason is in `last_error`). A reply without a verdict is a Feedback whose
        `score` is None (its `error` says why)."""
        msgs = messages if messages is not None else self.messages(question, prediction, reference, images)
        result = self.judge_many([msgs])[0]
        self.last_error = result.error
        return result.feedback

    def judge_many(self, requests: list[list[dict]], deadline: float | None = None,
                   raw: bool = False) -> list[JudgeResult]:
        """One JudgeResult per list of messages, `concurrency` requests in flight. `deadline` (a `time.monotonic()`
        value) bounds the whole batch: what is not judged by then is a failed result. FatalRewardError
        (JudgeAuthError, JudgeRefusedError) propagates. raw=True: the reply is not a verdict but text to read
        (a benchmark's answer extraction): any non-empty reply succeeds, its text in `feedback.raw`."""
        futures = [self._pool.submit(self._judge_one, msgs, deadline, raw) for msgs in requests]
        if deadline is not None:  # attempts stop at the deadline; the grace covers a reply being read
            wait_futures(futures, timeout=max(0.0, deadline - time.monotonic()) + 2.0)
        results = []
        for f in futures:
            if f.done() or deadline is None:
                results.append(f.result())
            else:
                f.cancel()
                results.append(JudgeResult(None, f"judge {self.url}: not judged before the batch deadline",
                                           outcome="deadline"))
        for result in results:
            self._count(OUTCOMES[result.outcome])
        return results

    def _parse(self, text: str, raw: bool, probability: float | None = None) -> Feedback:
        if not raw:
            feedback = parse_feedback(text, self.max_reasons)
            if probability is not None and feedback.verdict is not None:
                feedback.score = feedback.probability = probability
            return feedback
        return Feedback(None, 1.0 if text.strip() else None, raw=text, error=None if text.strip() else "empty reply")

    def _judge_one(self, messages: list[dict], deadline: float | None = None, raw: bool = False) -> JudgeResult:
        if self._fatal is not None:
            raise type(self._fatal)(str(self._fatal))
        key = JudgeCache.key(self.model, messages, self.settings)
        cached = self.cache.get(key)
        if cached is not None:
            return JudgeResult(self._parse(cached[0], raw, cached[1]), cached=True, outcome="cached")
        if deadline is not None and time.monotonic() >= deadline:
            return JudgeResult(None, f"judge {self.url}: not judged before the batch deadline", outcome="deadline")
        wait = self._open_until - time.monotonic()
        if wait > 0:
            return JudgeResult(None, f"judge {self.url}: circuit open after {self._failed_in_a_row} failed requests "
                                     f"in a row (retrying in {wait:.0f} s)", outcome="short_circuited")
        try:
            reply = self.complete(messages, deadline)
        except DeadlinePassed as exc:
            return JudgeResult(None, str(exc), attempts=exc.attempts, outcome="deadline")
        except JudgeError as exc:
            if isinstance(exc, JudgeRefused):
                self._refused(exc, messages)
            self._circuit(failed=True)
            return JudgeResult(None, str(exc), attempts=exc.attempts, outcome="http_failure")
        except FatalRewardError:
            raise
        except Exception as exc:  # anything else fails this request, never the whole batch
            self._circuit(failed=True)
            return JudgeResult(None, f"judge {self.url}: {type(exc).__name__}: {exc}", outcome="http_failure")
        self._circuit(failed=False)
        return self._verdict(key, reply, raw)

    def _verdict(self, key: str, reply: Reply, raw: bool = False) -> JudgeResult:
        """The result of a reply: a verdict (cached), or a reply without one, saying why."""
        probability = None
        if self.graded and not raw:
            probability = verdict_probability(reply.logprobs)
        feedback = self._parse(reply.content or "", raw, probability)
        if feedback.score is not None:
            if self.graded and not raw and probability is None:
                self._count("ungraded")
            self.cache.put(key, self.model, reply.content or "", probability)
            return JudgeResult(feedback, attempts=reply.attempts)
        outcome, why = "no_verdict", feedback.error
        if reply.finish_reason == "length":
            outcome = "cut"
            why = (f"reply cut at max_tokens={self.settings['max_tokens']} before a verdict (finish_reason: "
                   f"length); raise the judge's max_tokens")
        elif reply.content is None:
            why = (f"the reply has no content (content: null, finish_reason: {reply.finish_reason}); a server-side "
                   "reasoning parser may have taken it all")
        feedback.error = f"judge {self.url}: {why}"
        return JudgeResult(feedback, feedback.error, attempts=reply.attempts, outcome=outcome)

    def complete(self, messages: list[dict], deadline: float | None = None) -> Reply:
        """The reply to `messages` (content, finish_reason, attempts), retrying as `vlmrl.rewards.judge_http`
        says. Raises JudgeError (JudgeRefused for a 4xx), DeadlinePassed, JudgeAuthError."""
        return self.endpoint.post({"model": self.model, "messages": messages, **self.settings}, deadline)

    def _circuit(self, failed: bool) -> None:
        """Count a request that failed for good (or reset on one that got a reply); open the circuit at the limit."""
        with self._lock:
            self._failed_in_a_row = self._failed_in_a_row + 1 if failed else 0
            if not failed:
                self._refusal, self._refusals = None, 0
            if failed and self.circuit_failures and self._failed_in_a_row >= self.circuit_failures:
                if self._open_until <= time.monotonic():
                    self.stats["circuit_opens"] += 1
                self._open_until = time.monotonic() + self.circuit_cooldown

    def _refused(self, exc: JudgeRefused, messages: list[dict]) -> None:
        """Count a refusal; at `refusal_limit` identical ones in a row, stop (JudgeRefusedError, raised from now on)."""
        with self._lock:
            if self._fatal is not None:
                raise type(self._fatal)(str(self._fatal))
            same = self._refusal == (exc.status, exc.message)
            self._refusal, self._refusals = (exc.status, exc.message), self._refusals + 1 if same else 1
            if not self.refusal_limit or self._refusals < self.refusal_limit:
                return
        sent_images = any(isinstance(m.get("content"), list) and any(p.get("type") == "image_url"
                                                                     for p in m["content"]) for m in messages)
        error = JudgeRefusedError(f"judge {self.url}: {self.refusal_limit} requests in a row were refused with the "
                                  f"same HTTP {exc.status}: {exc.message}; {self._refusal_hint(exc, sent_images)} "
                                  f"(refusal_limit={self.refusal_limit}: a refusal that repeats would fail every "
                                  "sample of every step)")
        with self._lock:
            self._fatal = self._fatal or error
        raise self._fatal

    def _refusal_hint(self, exc: JudgeRefused, sent_images: bool) -> str:
        if exc.status == 404:
            served = self.endpoint.served_models()
            if served and self.model not in served:
                return f"the server serves {served}, not model={self.model!r}: set the judge's model to one of them"
            return (f"check base_url: {self.url} should be the server's chat route (OpenAI-compatible servers put "
                    f"it under /v1), and model={self.model!r}")
        if sent_images and _IMAGES_REFUSED.search(exc.message):
            return ("the served model does not take these images: serve a vision-language model as the judge, or "
                    "set send_images: false")
        return "the server's message says what it refuses in these requests"

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.stats[name] += n

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.endpoint.close()
