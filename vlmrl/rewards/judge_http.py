"""One chat-completions request to an OpenAI-compatible server, with the judge's retries, over httpx.

`ChatEndpoint.post(payload, deadline)` sends `payload` to `base_url + "/chat/completions"` and returns the reply's
`choices[0].message.content` and `finish_reason` (a `Reply`), retrying what a retry can fix (another route, such as a
served reward model's `/rewards`, gives its `path` and the `parse` that reads its replies):

- 429 after its Retry-After (seconds or an HTTP date, capped at `retry_after_max`), else after the backoff;
  5xx, 408, 409, timeouts, broken connections (a body cut mid-read included) and replies that are not a
  chat completion: exponential backoff with jitter; at most `max_retries` retries;
- a refused connection (the server is not up: vLLM takes 1-2 minutes to start or restart) is retried without using
  up `max_retries` while the endpoint has refused connections for less than `connect_window` seconds; the window
  runs from the first refusal after the last reply, for the whole client, so a server that stays down costs one
  window per outage, not one per request;
- nothing runs past `deadline` (a `time.monotonic()` value): no attempt starts, no backoff sleeps beyond it, and an
  attempt's timeout is cut to the time left.

Not retried: 401/403 (`JudgeAuthError`, fatal), other 4xx and redirects (`JudgeRefused`: the caller decides
whether a refusal that repeats is fatal). A reply with `content: null` (a reasoning parser that got no `</think>`
before max_tokens) is a valid reply, returned as such. Attempt-level counters go to the `count(name)` callback.
"""

from __future__ import annotations

import email.utils
import json
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from vlmrl.rewards.registry import FatalRewardError

if TYPE_CHECKING:  # httpx is imported where a client is made: importing it costs ~0.5 s, and reward workers
    import httpx  # import this package without ever judging

LOOPBACK = ("127.0.0.1", "localhost", "::1")
RETRIED_STATUS = (408, 409, 429)  # and every 5xx


class JudgeError(RuntimeError):
    """One judge request failed for good (retries spent, or a 4xx that retrying cannot fix); `attempts` is the
    number of HTTP attempts it made."""

    def __init__(self, message: str, attempts: int = 0):
        super().__init__(message)
        self.attempts = attempts


class JudgeRefused(JudgeError):
    """The server refused the request with a 4xx other than 401/403/408/409/429; `status` and `message` (the
    server's own error text) say how, and repeat identically when every request is refused the same way."""

    def __init__(self, text: str, attempts: int, status: int, message: str):
        super().__init__(text, attempts)
        self.status, self.message = status, message


class DeadlinePassed(JudgeError):
    """The batch's deadline passed before the request got a reply (not the endpoint's fault: no circuit count)."""


class JudgeAuthError(FatalRewardError):
    """The endpoint refused the key (401/403) or the key variable is unset: stop, nothing later can succeed."""


@dataclass
class Reply:
    """A chat completion: `content` (None when the server sent `content: null`), `finish_reason` ("stop",
    "length", ...; None if absent), the HTTP attempts it took, and the per-token log-prob entries
    (`choices[0].logprobs.content`) and vLLM's `prompt_logprobs` when the server sent them."""

    content: str | None
    finish_reason: str | None
    attempts: int
    logprobs: list[dict] | None = None
    prompt_logprobs: list[dict | None] | None = None


class ChatEndpoint:
    """The HTTP side of a judge: one httpx client (a connection pool of `concurrency`, no proxy for a loopback
    host), the retry loop of the module docstring, and the key header. Thread-safe."""

    def __init__(self, base_url: str, *, api_key: str | None, api_key_env: str | None, timeout: float,
                 max_retries: int, backoff_base: float, backoff_max: float, retry_after_max: float,
                 connect_window: float, concurrency: int, count: Callable[[str], None],
                 path: str = "/chat/completions", parse: Callable[[bytes, int], Any] | None = None,
                 what: str = "judge"):
        import httpx

        self.base_url = base_url.rstrip("/")
        self.url = self.base_url + path
        self.parse, self.what = parse or chat_reply, what  # another route: its reply parser (None: malformed)
        self.api_key_env, self.timeout, self.max_retries = api_key_env, timeout, max_retries
        self.backoff_base, self.backoff_max, self.retry_after_max = backoff_base, backoff_max, retry_after_max
        self.connect_window, self.count = connect_window, count
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        loopback = urlparse(self.url).hostname in LOOPBACK  # never through a proxy (HTTP(S)_PROXY) to this machine
        limits = httpx.Limits(max_connections=max(1, concurrency), max_keepalive_connections=max(1, concurrency))
        self._http = httpx.Client(headers=headers, timeout=timeout, limits=limits, trust_env=not loopback)
        self._refused_since: float | None = None  # time.monotonic() of the first refused connection since a reply
        self._lock = threading.Lock()

    def models(self) -> list[str]:
        """The model ids `GET base_url/models` lists (raises httpx's errors, or KeyError/TypeError on another body)."""
        return [m["id"] for m in self.get_json("/models")["data"]]

    def get_json(self, route: str, timeout: float | None = None) -> Any:
        """`GET base_url + route`'s JSON body, once (raises httpx's errors, or ValueError on another body)."""
        response = self._http.get(self.base_url + route, timeout=timeout or self.timeout)
        response.raise_for_status()
        return response.json()

    def post(self, payload: dict, deadline: float | None = None) -> Any:
        """The reply to `payload`, retrying as the module docstring says. Raises JudgeError when the retries are
        spent, JudgeRefused on a 4xx, DeadlinePassed when `deadline` came first, JudgeAuthError on 401/403."""
        import httpx

        error, attempts, spent = "no attempt", 0, 0  # spent: failed attempts that use up max_retries
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise DeadlinePassed(f"{self.what} {self.url}: the batch deadline passed after {attempts} attempts; "
                                     f"last: {error}", attempts)
            if attempts:
                self.count("retries")
            attempts += 1
            self.count("requests")
            delay = self._backoff(attempts - 1)
            timeout = self.timeout if left is None else min(self.timeout, left)
            refused = False
            try:
                response = self._http.post(self.url, json=payload, timeout=timeout)
            except httpx.TimeoutException:
                self.count("timeouts")
                error = f"no reply within {timeout:.3g} s"
            except httpx.ConnectError as exc:  # nothing listens (yet), or the host is unreachable
                self.count("connection_errors")
                error, refused = f"connection failed: {exc or type(exc).__name__}", True
            except httpx.TransportError as exc:  # the connection broke, e.g. the body was cut mid-read
                self.count("connection_errors")
                error = f"connection broken: {exc or type(exc).__name__}"
            else:
                self._replied()
                reply, error, delay = self._read(response, attempts, delay)
                if reply is not None:
                    return reply
            if not (refused and self._in_connect_window()):
                spent += 1
                if spent > self.max_retries:
                    raise JudgeError(f"{self.what} {self.url}: gave up after {attempts} attempts; last: {error}",
                                     attempts)
            if deadline is not None:
                delay = min(delay, max(0.0, deadline - time.monotonic()))
            time.sleep(delay)

    def _read(self, response: httpx.Response, attempts: int, delay: float) -> tuple[Any, str, float]:
        """(the reply, "", delay) for a chat completion (what `parse` reads), else (None, why, the delay before the
        next attempt); raises for what is not retried."""
        status = response.status_code
        if status in (401, 403):
            where = f"the key in ${self.api_key_env}" if self.api_key_env else "api_key_env (no key was sent)"
            raise JudgeAuthError(f"{self.what} {self.url}: HTTP {status} (key refused); check {where}")
        if status == 429:
            self.count("rate_limited")
            wait = retry_after(response.headers.get("retry-after"))
            return None, "HTTP 429 (rate limited)", min(wait, self.retry_after_max) if wait is not None else delay
        if status >= 500 or status in RETRIED_STATUS:
            self.count("server_errors")
            return None, f"HTTP {status}: {error_message(response.content)}", delay
        if status >= 300:  # a 4xx, or a redirect (not followed: base_url should name the server itself)
            self.count("refused")
            message = (f"redirected to {response.headers.get('location')}" if status < 400
                       else error_message(response.content))
            raise JudgeRefused(f"{self.what} {self.url}: HTTP {status}: {message}", attempts, status, message)
        reply = self.parse(response.content, attempts)
        if reply is None:
            self.count("malformed")
            return None, f"malformed reply: {response.content[:120].decode(errors='replace')!r}", delay
        return reply, "", delay

    def _replied(self) -> None:
        with self._lock:
            self._refused_since = None

    def _in_connect_window(self) -> bool:
        """Whether a refused connection may be retried for free: the endpoint has refused connections (with no
        reply between) for less than `connect_window` seconds."""
        now = time.monotonic()
        with self._lock:
            if self._refused_since is None:
                self._refused_since = now
            return now - self._refused_since < self.connect_window

    def _backoff(self, attempt: int) -> float:
        """Exponential backoff with jitter: d = min(backoff_max, backoff_base * 2**attempt), then d/2 + U(0, d/2)."""
        d = min(self.backoff_max, self.backoff_base * 2 ** min(attempt, 60))  # (a long connect window: many)
        return d / 2 + random.uniform(0, d / 2)

    def served_models(self) -> list[str] | None:
        """The model names the server lists at GET base_url/models (None when it lists none or cannot be asked)."""
        import httpx

        try:
            response = self._http.get(self.base_url + "/models", timeout=min(5.0, self.timeout))
            names = [m["id"] for m in response.json()["data"]] if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None
        return names or None

    def close(self) -> None:
        self._http.close()


def retry_after(value: str | None) -> float | None:
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


def error_message(raw: bytes, limit: int = 300) -> str:
    """The server's error text: `error.message`, `message` or `detail` of a JSON body (OpenAI, vLLM, FastAPI), else
    the body itself, at most `limit` characters."""
    try:
        body: Any = json.loads(raw)
    except ValueError:
        body = None
    text = None
    if isinstance(body, dict):
        inner = body.get("error")
        text = inner.get("message") if isinstance(inner, dict) else inner
        text = text or body.get("message") or body.get("detail")
    if not isinstance(text, str):
        text = raw.decode(errors="replace") if text is None else json.dumps(text)
    return text.strip()[:limit]


def chat_reply(raw: bytes, attempts: int) -> Reply | None:
    """choices[0].message.content (text parts joined) and finish_reason of a chat completion, or None when the body
    is not one. `content: null` is a reply without text, not a malformed one."""
    try:
        body = json.loads(raw)
        choice = body["choices"][0]
        message = choice["message"]
        content = message.get("content")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if content is not None and not isinstance(content, str):
        return None
    finish = choice.get("finish_reason") if isinstance(choice, dict) else None
    logprobs = choice.get("logprobs") if isinstance(choice, dict) else None
    entries = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(entries, list) or not all(isinstance(e, dict) and "logprob" in e for e in entries):
        entries = None
    scored = body.get("prompt_logprobs") if isinstance(body, dict) else None
    return Reply(content, finish if isinstance(finish, str) else None, attempts, entries,
                 scored if isinstance(scored, list) else None)
