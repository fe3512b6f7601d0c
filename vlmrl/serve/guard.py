"""What makes a vlmrl server safe to put on a network, shared by the chat, embedding and reward-model servers.

- `ServeLimits`: every bound a request and a connection are checked against; a value past a limit is a 400 (413 for
  the body, 503 with Retry-After for a server that holds too much already) that names the field and the limit.
- `api_key_dependency`: with `api_key_env` set, every `/v1` route needs `Authorization: Bearer <key>` (401 otherwise);
  the key is read from that environment variable once, at start-up, and compared in constant time.
- `install_errors`: every error leaves as OpenAI's shape `{"error": {"message", "type", "param", "code"}}`, which
  the official client turns into its exceptions; a message never echoes more than a few hundred characters of input.

The rest of the guard: vlmrl.serve.gate (what a request may hold, checked before it is paid for), vlmrl.serve.images
(images, opened only as declared and paid for before they are decoded), vlmrl.serve.connections (slow and many
clients, shutdown).
"""

from __future__ import annotations

import hmac
import itertools
import os
import warnings
from dataclasses import dataclass
from typing import Any

from vlmrl.errors import ConfigError

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class ServeLimits:
    """Bounds on what one request may ask for. The defaults suit one CPU or GPU serving a small model."""

    max_body_bytes: int = 20 * 2**20  # a request body (JSON with data URLs, or a multipart upload)
    max_image_pixels: int = 40_000_000  # width x height of one decoded image
    max_images: int = 8  # images in one request
    max_batch: int = 16  # answers in one generation call (dynamic batching) / inputs in one embedding call
    max_batch_tokens: int = 65_536  # chat: answers x (longest prompt + largest max_tokens) in one generation call
    batch_wait_ms: float = 5.0  # how long the batcher waits for more requests before it generates
    max_n: int = 8  # chat: answers per request
    max_tokens: int = 512  # chat: new tokens per answer
    max_inputs: int = 256  # embeddings: texts or images per request
    max_top_k: int = 100  # search: results per query
    request_timeout: float = 300.0  # seconds a request may wait for its result before it fails with 504
    max_queue: int = 64  # chat: requests waiting for the model; past it a 503 with Retry-After
    max_queue_bytes: int = 512 * 2**20  # bytes every request in the server holds together: bodies, images being
    # decoded and decoded, processed inputs (vlmrl.serve.gate); past it a 503 with Retry-After
    allow_remote_images: bool = False  # http(s) image URLs (fetched by the server) instead of data URLs only
    allow_private_image_hosts: bool = False  # remote images from loopback/private/link-local addresses too
    image_fetch_timeout: float = 10.0  # seconds for one remote image, connection to last byte
    header_timeout: float = 10.0  # seconds a connection may take to send a request's headers (then it is closed)
    body_timeout: float = 60.0  # seconds a request may take to send its body (then a 408)
    max_connections: int = 1024  # open connections; one more is answered 503 and closed at once
    shutdown_timeout: float = 5.0  # seconds SIGTERM waits for requests in flight before it cancels them

    def __post_init__(self):
        for name in ("max_body_bytes", "max_image_pixels", "max_images", "max_batch", "max_batch_tokens", "max_n",
                     "max_tokens", "max_inputs", "max_top_k", "max_queue", "max_queue_bytes", "max_connections"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"serve limit {name}={getattr(self, name)!r}: expected an integer >= 1")
        if self.batch_wait_ms < 0:
            raise ConfigError(f"serve limit batch_wait_ms={self.batch_wait_ms}: expected >= 0")
        for name in ("request_timeout", "image_fetch_timeout", "header_timeout", "body_timeout", "shutdown_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"serve limit {name}={getattr(self, name)!r}: expected a number of seconds > 0")


class RequestError(Exception):
    """A request that cannot be served as sent: `status` (400, 401, 404, 413, 504...) and a message naming the
    field (`param`) and the problem. Raised anywhere in a handler; `install_errors` turns it into the reply."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after  # seconds, sent as Retry-After (a 503 of a full queue)


def check_limit(value: Any, limit: int, param: str, low: int = 1) -> None:
    """400 unless `value` is an integer in [low, limit]."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= limit:
        raise RequestError(400, f"{param}={value!r}: expected an integer from {low} to {limit} (the server's limit)",
                           param)


# ---------------------------------------------------------------------------------------------------------- errors
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          408: "timeout", 413: "request_too_large", 422: "invalid_request_error", 503: "service_unavailable", 504: "timeout"}


def clip(value: Any, limit: int) -> str:
    """`str(value)`, cut to `limit` characters (ending "...") when longer: how a client's input appears in an error."""
    text = str(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param, "code": code}}


def install_errors(app: Any) -> None:
    """OpenAI-shaped JSON for RequestError, FastAPI's HTTP errors and request validation errors (as 400)."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    @app.exception_handler(RequestError)
    async def _request_error(request, exc: RequestError):
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else {}
        if exc.retry_after is not None:
            headers["Retry-After"] = str(exc.retry_after)
        return JSONResponse(error_body(exc.status, exc.message, exc.param, exc.code), exc.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def _http_error(request, exc: HTTPException):
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        problems = []  # never echoes much input: a location part (a client's key) or a problem is cut short
        locs = [[clip(p, 40) for p in e.get("loc", ()) if p != "body"] for e in exc.errors()[:5]]
        for e, loc in zip(exc.errors()[:5], locs, strict=True):
            problems.append(clip(f"{'.'.join(loc) or 'body'}: {e.get('msg', 'invalid')}", 200))
        param = None
        if locs:  # the field the first problem is in: one union's branches (stop.str, stop.list[str]) -> stop
            same = [loc for loc in locs if loc[:1] == locs[0][:1]]
            common = locs[0]
            for loc in same[1:]:
                pairs = zip(common, loc, strict=False)
                common = [a for a, _ in itertools.takewhile(lambda ab: ab[0] == ab[1], pairs)]
            param = ".".join(common) or None
        return JSONResponse(error_body(400, "; ".join(problems) or "invalid request", param), 400)


# ---------------------------------------------------------------------------------------------------------- auth
def read_api_key(api_key_env: str | None) -> str | None:
    """The key from `api_key_env` (None: no key needed). A named variable that is unset is a ConfigError: a server
    meant to need a key never starts without one."""
    if not api_key_env:
        return None
    key = os.environ.get(api_key_env)
    if not key:
        raise ConfigError(f"--api-key-env {api_key_env}: the environment variable is not set; export "
                          f"{api_key_env}=<key>, or leave out --api-key-env to serve without a key (loopback only)")
    return key


def api_key_dependency(key: str | None):
    """A FastAPI dependency that needs `Authorization: Bearer <key>` when `key` is set (401 otherwise)."""
    from fastapi import Header

    # (a plain `str` annotation: under `from __future__ import annotations` FastAPI resolves annotations in this
    # module's globals, where a `Request` imported here is not, and would take `request` for a query parameter)
    async def check(authorization: str = Header("")) -> None:
        if key is None:
            return
        scheme, _, given = authorization.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise RequestError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")

    return check


def check_bind(host: str, key: str | None) -> None:
    """Warn when a server without a key listens beyond loopback (allowed: a trusted network is the user's call)."""
    if host not in LOOPBACK and key is None:
        warnings.warn(f"serving on {host} without an API key: anyone who can reach this port can use the model; "
                      "set --api-key-env", stacklevel=2)
