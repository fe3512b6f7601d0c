"""LLM judge (generative reward model) over any OpenAI-compatible `/v1/chat/completions` endpoint.

vLLM's and llama.cpp's servers, and hosted APIs, speak the same protocol. `JudgeClient` sends one chat request per
graded answer (the prompt from a template in `feedback.py`, images as base64 data URLs under a size cap), parses
the reply with `parse_feedback`, and is careful about everything that goes wrong over a network:

- bounded concurrency (a thread pool of `concurrency` requests in flight) and a `timeout` per attempt;
- retries, at most `max_retries`, on 429 (after its Retry-After, when given), 5xx, timeouts, refused connections
  and malformed JSON, with exponential backoff and jitter; none on other 4xx;
- 401/403, or an unset key variable, raise `JudgeAuthError` (a FatalRewardError): training stops with a message
  naming the key variable, instead of counting a failure on every sample for hours;
- an on-disk cache keyed by (model, messages with the images, generation settings): a rerun does not pay twice;
- a deadline for a whole batch (`judge_many(..., deadline=)`): no attempt starts, and no attempt or backoff runs,
  past it; what is not judged by then fails (counted in `deadline_misses`);
- a circuit breaker: after `circuit_failures` requests in a row failed for good, the circuit opens for
  `circuit_cooldown` seconds, and requests fail at once without touching the network (`short_circuited`); then
  requests go through again, and the next failure reopens it at once. A down endpoint costs one batch of timeouts,
  not every step's.

    client = JudgeClient("http://127.0.0.1:8000/v1", "qwen2.5-vl-7b", api_key_env="JUDGE_API_KEY")
    feedback = client.judge(question="How many circles?", prediction="3", reference="3", images=[image])
    feedback.score, feedback.reasons  # 1.0, ["+ ..."]; None when the call failed (see client.last_error)
"""

from __future__ import annotations

import base64
import email.utils
import hashlib
import io
import json
import os
import random
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from vlmrl.rewards.feedback import TEMPLATES, Feedback, fill_template, parse_feedback
from vlmrl.rewards.registry import FatalRewardError

__all__ = ["Feedback", "JudgeAuthError", "JudgeClient", "JudgeError", "JudgeResult", "encode_image", "parse_feedback"]
DEFAULT_CACHE_DIR = "~/.cache/vlmrl/judge"
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


class JudgeError(RuntimeError):
    """One judge request failed for good (retries spent, or a 4xx that retrying cannot fix)."""


class JudgeAuthError(FatalRewardError):
    """The endpoint refused the key (401/403) or the key variable is unset: stop, nothing later can succeed."""


class _DeadlinePassed(JudgeError):
    """The batch's deadline passed before the request got a reply (not the endpoint's fault: no circuit count)."""


@dataclass
class JudgeResult:
    """One request's outcome: `feedback` (None when the request failed; see `error`), whether it came from the
    cache, and how many HTTP attempts it took (0 for a cache hit)."""

    feedback: Feedback | None
    error: str | None = None
    cached: bool = False
    attempts: int = 0


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


class JudgeCache:
    """Replies on disk, one JSON file per key under `folder` (written atomically), plus an in-memory copy."""

    def __init__(self, folder: str | Path | None):
        self.folder = Path(folder).expanduser() if folder else None
        self._memory: dict[str, str] = {}

    @staticmethod
    def key(model: str, messages: list[dict], settings: dict) -> str:
        blob = json.dumps({"model": model, "messages": messages, "settings": settings}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()

    def get(self, key: str) -> str | None:
        if key in self._memory or self.folder is None:
            return self._memory.get(key)
        path = self.folder / key[:2] / f"{key}.json"
        try:
            text = json.loads(path.read_text())["content"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        self._memory[key] = text
        return text

    def put(self, key: str, model: str, content: str) -> None:
        self._memory[key] = content
        if self.folder is None:
            return
        path = self.folder / key[:2] / f"{key}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps({"model": model, "content": content}))
        os.replace(tmp, path)


class JudgeClient:
    """A client for one judge (endpoint + model). Thread-safe; `judge_many` runs `concurrency` requests at once.

    base_url: e.g. "http://127.0.0.1:8000/v1" (the client posts to base_url + "/chat/completions").
    api_key_env: the name of the environment variable that holds the key (None: send no key).
    template: a prompt with {question}, {prediction}, {reference}, {max_reasons}; default by `mode` ("verdict":
        [RELEVANT]/[IRRELEVANT]; "score": Score: N/10). cache_dir: None disables the disk cache.
    circuit_failures: requests in a row that failed for good before the circuit opens (0: never opens);
        circuit_cooldown: seconds it stays open.
    stats: counters of requests (HTTP attempts), retries, cache_hits, failures, rate_limited, server_errors,
        timeouts, malformed, no_verdict, deadline_misses, circuit_opens, short_circuited, since the client was made."""

    def __init__(self, base_url: str, model: str, *, api_key_env: str | None = None, template: str | None = None,
                 mode: str = "verdict", max_reasons: int = 3, timeout: float = 30.0, max_retries: int = 3,
                 concurrency: int = 8, cache_dir: str | Path | None = DEFAULT_CACHE_DIR,
                 image_max_bytes: int = 512_000, max_tokens: int = 256, temperature: float = 0.0,
                 backoff_base: float = 0.5, backoff_max: float = 30.0, retry_after_max: float = 60.0,
                 system_prompt: str | None = None, circuit_failures: int = 8, circuit_cooldown: float = 60.0):
        if mode not in TEMPLATES:
            raise ValueError(f"judge mode={mode!r}: expected one of {sorted(TEMPLATES)}")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.mode, self.max_reasons = model, mode, max_reasons
        self.template = template or TEMPLATES[mode]
        self.timeout, self.max_retries = timeout, max_retries
        self.image_max_bytes, self.system_prompt = image_max_bytes, system_prompt
        self.settings = {"max_tokens": max_tokens, "temperature": temperature}
        self.backoff_base, self.backoff_max, self.retry_after_max = backoff_base, backoff_max, retry_after_max
        self.api_key_env = api_key_env
        self.api_key = os.environ.get(api_key_env) if api_key_env else None
        if api_key_env and not self.api_key:
            raise JudgeAuthError(f"judge {self.url}: the environment variable {api_key_env} that should hold the API "
                                 "key is not set; export it, or remove api_key_env for a server without a key")
        self.cache = JudgeCache(cache_dir)
        self.stats = dict.fromkeys(("requests", "retries", "cache_hits", "failures", "rate_limited",
                                    "server_errors", "timeouts", "malformed", "no_verdict", "deadline_misses",
                                    "circuit_opens", "short_circuited"), 0)
        self.last_error: str | None = None
        self.circuit_failures, self.circuit_cooldown = circuit_failures, circuit_cooldown
        self._failed_in_a_row = 0
        self._open_until = 0.0  # time.monotonic() until which the circuit is open
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="vlmrl-judge")
        handlers = [urllib.request.ProxyHandler({})] if urlparse(self.url).hostname in _LOOPBACK else []
        self._opener = urllib.request.build_opener(*handlers)

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

    def judge_many(self, requests: list[list[dict]], deadline: float | None = None) -> list[JudgeResult]:
        """One JudgeResult per list of messages, `concurrency` requests in flight. `deadline` (a `time.monotonic()`
        value) bounds the whole batch: what is not judged by then is a failed result. JudgeAuthError propagates."""
        futures = [self._pool.submit(self._judge_one, msgs, deadline) for msgs in requests]
        if deadline is not None:  # attempts stop at the deadline; the grace covers a reply being read
            wait_futures(futures, timeout=max(0.0, deadline - time.monotonic()) + 2.0)
        results = []
        for f in futures:
            if f.done() or deadline is None:
                results.append(f.result())
            else:
                f.cancel()
                self._count("deadline_misses")
                results.append(JudgeResult(None, "not judged before the batch deadline"))
        return results

    def _judge_one(self, messages: list[dict], deadline: float | None = None) -> JudgeResult:
        key = JudgeCache.key(self.model, messages, self.settings)
        cached = self.cache.get(key)
        if cached is not None:
            self._count("cache_hits")
            return JudgeResult(parse_feedback(cached, self.max_reasons), cached=True)
        if deadline is not None and time.monotonic() >= deadline:
            self._count("deadline_misses")
            return JudgeResult(None, "not judged before the batch deadline")
        wait = self._open_until - time.monotonic()
        if wait > 0:
            self._count("short_circuited")
            return JudgeResult(None, f"circuit open after {self._failed_in_a_row} failed requests in a row "
                                     f"(retrying in {wait:.0f} s)")
        try:
            content, attempts = self.complete(messages, deadline)
        except _DeadlinePassed as exc:
            self._count("deadline_misses")
            return JudgeResult(None, str(exc))
        except JudgeError as exc:
            self._count("failures")
            self._circuit(failed=True)
            return JudgeResult(None, str(exc))
        self._circuit(failed=False)
        feedback = parse_feedback(content, self.max_reasons)
        if feedback.score is None:
            self._count("no_verdict")
            return JudgeResult(feedback, feedback.error, attempts=attempts)
        self.cache.put(key, self.model, content)
        return JudgeResult(feedback, attempts=attempts)

    def _circuit(self, failed: bool) -> None:
        """Count a request that failed for good (or reset on one that got a reply); open the circuit at the limit."""
        with self._lock:
            self._failed_in_a_row = self._failed_in_a_row + 1 if failed else 0
            if failed and self.circuit_failures and self._failed_in_a_row >= self.circuit_failures:
                if self._open_until <= time.monotonic():
                    self.stats["circuit_opens"] += 1
                self._open_until = time.monotonic() + self.circuit_cooldown

    def complete(self, messages: list[dict], deadline: float | None = None) -> tuple[str, int]:
        """The reply text for `messages` and the number of HTTP attempts, retrying as the module docstring says.
        Raises JudgeError when the retries are spent or the request is refused (a subclass of it when `deadline`
        passed first), JudgeAuthError on 401/403."""
        body = json.dumps({"model": self.model, "messages": messages, **self.settings}).encode()
        error = "no attempt"
        for attempt in range(self.max_retries + 1):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise _DeadlinePassed(f"judge {self.url}: the batch deadline passed after {attempt} attempts; "
                                      f"last: {error}")
            if attempt:
                self._count("retries")
            self._count("requests")
            delay = self._backoff(attempt)
            try:
                status, headers, raw = self._post(body, self.timeout if left is None else min(self.timeout, left))
            except TimeoutError:
                self._count("timeouts")
                error = f"no reply within {self.timeout:g} s"
            except urllib.error.URLError as exc:
                if isinstance(exc.reason, TimeoutError):
                    self._count("timeouts")
                error = f"connection failed: {exc.reason}"
            except (ConnectionError, OSError) as exc:
                error = f"connection failed: {exc}"
            else:
                if status in (401, 403):
                    where = f"the key in ${self.api_key_env}" if self.api_key_env else "api_key_env (no key was sent)"
                    raise JudgeAuthError(f"judge {self.url}: HTTP {status} (key refused); check {where}")
                if status == 429:
                    self._count("rate_limited")
                    wait = _retry_after(headers.get("retry-after"))
                    delay = min(wait, self.retry_after_max) if wait is not None else delay
                    error = "HTTP 429 (rate limited)"
                elif status >= 500:
                    self._count("server_errors")
                    error = f"HTTP {status}: {raw[:200].decode(errors='replace')}"
                elif status >= 400:
                    raise JudgeError(f"judge {self.url}: HTTP {status}: {raw[:300].decode(errors='replace')}")
                else:
                    content = _reply_text(raw)
                    if content is not None:
                        return content, attempt + 1
                    self._count("malformed")
                    error = f"malformed reply: {raw[:120].decode(errors='replace')!r}"
            if attempt < self.max_retries:
                time.sleep(delay if deadline is None else max(0.0, min(delay, deadline - time.monotonic())))
        raise JudgeError(f"judge {self.url}: gave up after {self.max_retries + 1} attempts; last: {error}")

    def _post(self, body: bytes, timeout: float | None = None) -> tuple[int, dict[str, str], bytes]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with self._opener.open(request, timeout=timeout or self.timeout) as response:
                return response.status, {k.lower(): v for k, v in response.headers.items()}, response.read()
        except urllib.error.HTTPError as exc:
            try:
                raw = exc.read()
            except (OSError, TimeoutError):
                raw = b""
            return exc.code, {k.lower(): v for k, v in (exc.headers or {}).items()}, raw

    def _backoff(self, attempt: int) -> float:
        """Exponential backoff with jitter: d = min(backoff_max, backoff_base * 2**attempt), then d/2 + U(0, d/2)."""
        d = min(self.backoff_max, self.backoff_base * 2**attempt)
        return d / 2 + random.uniform(0, d / 2)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.stats[name] += n

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _retry_after(value: str | None) -> float | None:
    """Seconds to wait from a Retry-After header: a number of seconds or an HTTP date; None if absent or bad."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _reply_text(raw: bytes) -> str | None:
    """choices[0].message.content of a chat-completions reply (text parts joined), or None if it is malformed."""
    try:
        content = json.loads(raw)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else None
