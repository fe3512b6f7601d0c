"""What makes a vlmrl server safe to put on a network, shared by the chat and the embedding servers.

- `ServeLimits`: every bound a request is checked against (body size, image pixels, batch, n, max_tokens, inputs per
  request, top-k, request time); a value past a limit is a 400 (413 for the body) that names the field and the limit.
- `api_key_dependency`: with `api_key_env` set, every `/v1` route needs `Authorization: Bearer <key>` (401 otherwise);
  the key is read from that environment variable once, at start-up, and compared in constant time.
- `BodyLimit`: an ASGI middleware that refuses a body over `max_body_bytes` with 413, from its Content-Length or
  while it streams in, before anything parses it.
- `decode_image`: a data URL (or, only when allowed, an http(s) URL) or raw bytes -> an RGB PIL image, after checks
  of the media type, the base64, the decoder and the pixel count (no decompression bombs); 400 naming the input.
  A remote URL's host is resolved first and refused when any of its addresses is loopback, private, link-local,
  reserved or multicast (unless `allow_private_image_hosts`); the fetch connects to the address it checked, has one
  deadline for the whole transfer, and its errors never tell the client what the target answered.
- `install_errors`: every error leaves as OpenAI's shape `{"error": {"message", "type", "param", "code"}}`, which
  the official client turns into its exceptions.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import http.client
import io
import ipaddress
import itertools
import os
import socket
import ssl
import threading
import warnings
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

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
    max_queue_bytes: int = 2**30  # chat: bytes of processed inputs (image tensors) the waiting requests hold
    allow_remote_images: bool = False  # http(s) image URLs (fetched by the server) instead of data URLs only
    allow_private_image_hosts: bool = False  # remote images from loopback/private/link-local addresses too
    image_fetch_timeout: float = 10.0  # seconds for one remote image, connection to last byte

    def __post_init__(self):
        for name in ("max_body_bytes", "max_image_pixels", "max_images", "max_batch", "max_batch_tokens", "max_n",
                     "max_tokens", "max_inputs", "max_top_k", "max_queue", "max_queue_bytes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"serve limit {name}={getattr(self, name)!r}: expected an integer >= 1")
        if self.batch_wait_ms < 0 or self.request_timeout <= 0 or self.image_fetch_timeout <= 0:
            raise ConfigError(f"serve limits: batch_wait_ms={self.batch_wait_ms} must be >= 0, "
                              f"request_timeout={self.request_timeout} and image_fetch_timeout="
                              f"{self.image_fetch_timeout} > 0")


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
          413: "request_too_large", 422: "invalid_request_error", 503: "service_unavailable", 504: "timeout"}


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
        problems = []
        for e in exc.errors()[:5]:
            where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
            problems.append(f"{where or 'body'}: {e.get('msg', 'invalid')}")
        param = None
        locs = [[str(p) for p in e.get("loc", ()) if p != "body"] for e in exc.errors()[:5]]
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


# ---------------------------------------------------------------------------------------------------------- body size
class BodyLimit:
    """ASGI middleware: 413 for a request body over `max_bytes`, judged by Content-Length when given and by the bytes
    received otherwise (a chunked upload is cut off as soon as it passes the limit).

    The body is read here, up to the limit, before the app runs, and then handed to it: an app never sees part of an
    oversized body (FastAPI would turn an error raised while it reads the body into its own 400)."""

    def __init__(self, app: Any, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await self._refuse(send)
        chunks, received = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before its body arrived
                return
            chunks.append(message.get("body", b""))
            received += len(chunks[-1])
            if received > self.max_bytes:
                return await self._refuse(send)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, for streaming responses

        await self.app(scope, replay, send)

    async def _refuse(self, send) -> None:
        import json

        body = json.dumps(error_body(413, f"request body over the server's limit of {self.max_bytes} bytes "
                                          "(--max-upload-mb)")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


# ---------------------------------------------------------------------------------------------------------- images
IMAGE_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif", "image/bmp")
# the PIL formats those types are: nothing else is ever opened (PIL would open PostScript and run Ghostscript on it)
FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP", "image/gif": "GIF",
           "image/bmp": "BMP"}
MAX_ASPECT = 200  # the Qwen-VL processors' limit on the longer side over the shorter (their resize raises past it)


def decode_image(source: str | bytes, limits: ServeLimits, param: str = "image"):
    """An RGB PIL image from a `data:image/...;base64,` URL, raw bytes, or (with limits.allow_remote_images) an
    http(s) URL fetched under the body limit. RequestError(400) names `param` and the problem otherwise."""
    if isinstance(source, (bytes, bytearray)):
        return _open(bytes(source), limits, param)
    if not isinstance(source, str):
        raise RequestError(400, f"{param}: expected a data URL string, got {type(source).__name__}", param)
    if source.startswith("data:"):
        header, sep, payload = source[5:].partition(",")
        media, _, encoding = header.partition(";")
        if not sep or encoding != "base64":
            raise RequestError(400, f"{param}: a data URL must read data:image/<type>;base64,<data>", param)
        if media.lower() not in IMAGE_TYPES:
            raise RequestError(400, f"{param}: media type {media!r} is not an image ({', '.join(IMAGE_TYPES)})", param)
        if len(payload) * 3 // 4 > limits.max_body_bytes:
            raise RequestError(413, f"{param}: image over the server's limit of {limits.max_body_bytes} bytes", param)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise RequestError(400, f"{param}: the data URL's base64 does not decode", param) from None
        return _open(data, limits, param, FORMATS[media.lower()])
    if source.startswith(("http://", "https://")):
        if not limits.allow_remote_images:
            raise RequestError(400, f"{param}: remote image URLs are off on this server; send the image as a data "
                                    "URL (data:image/png;base64,...), or start the server with --allow-remote-images",
                               param)
        return _open(_fetch(source, limits, param), limits, param)
    raise RequestError(400, f"{param}: expected a data:image/...;base64 URL" +
                       (" or an http(s) URL" if limits.allow_remote_images else "") +
                       " (file paths are never read)", param)


def resolve(host: str, port: int) -> list[str]:
    """Every address `host` resolves to (the system resolver; tests replace it)."""
    return list(dict.fromkeys(info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)))


def is_public(address: str) -> bool:
    """False for loopback, private (RFC 1918, unique-local), link-local (169.254.169.254, the cloud metadata
    service), shared (CGNAT), reserved, multicast and unspecified addresses, IPv4 ones written inside IPv6 too."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    embedded = [ip]
    if ip.version == 6:
        embedded += [a for a in (ip.ipv4_mapped, ip.sixtofour, *(ip.teredo or ())) if a is not None]
    return all(a.is_global and not (a.is_multicast or a.is_reserved or a.is_loopback or a.is_link_local
                                    or a.is_private or a.is_unspecified) for a in embedded)


class _PinnedConnection(http.client.HTTPConnection):
    """HTTP(S) to `address`, the one checked, whatever `host` resolves to by the time it connects (no DNS
    rebinding; `host` still names the server for TLS: SNI and the certificate check), with one deadline: at
    `timeout` seconds `expire` shuts the socket, whatever phase the transfer is in, which wakes a blocked read."""

    def __init__(self, host: str, port: int, address: str, tls: bool, timeout: float):
        super().__init__(host, port, timeout=timeout)
        self.address, self.tls = address, tls
        self.raw: socket.socket | None = None
        self.expired = threading.Event()

    def connect(self) -> None:
        self.raw = socket.create_connection((self.address, self.port), self.timeout)
        if self.expired.is_set():  # the deadline passed while it connected
            self.expire()
        self.sock = ssl.create_default_context().wrap_socket(self.raw, server_hostname=self.host) if self.tls \
            else self.raw

    def expire(self) -> None:
        self.expired.set()
        if self.raw is not None:
            try:
                self.raw.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _fetch(url: str, limits: ServeLimits, param: str) -> bytes:
    """The body of `url` under the body limit and one deadline (`image_fetch_timeout`) for the whole transfer, so a
    host that drips a byte now and then holds a worker thread no longer than that. Errors say what the client can
    fix, never what the target answered (a status code or a connection error would make the server a port
    scanner of whatever it can reach)."""
    failed = RequestError(400, f"{param}: could not fetch the image (remote images must be public http(s) URLs that "
                               f"answer 200 with the image within {limits.image_fetch_timeout:g} s)", param)
    parts = urlsplit(url)
    try:
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise RequestError(400, f"{param}: the image URL's port is not a number from 0 to 65535", param) from None
    if not host:
        raise RequestError(400, f"{param}: the image URL has no host", param)
    try:
        addresses = resolve(host, port)
    except (OSError, UnicodeError):
        raise failed from None
    if not addresses or not (limits.allow_private_image_hosts or all(map(is_public, addresses))):
        raise RequestError(400, f"{param}: the image URL's host is not a public address; this server fetches images "
                                "only from public hosts", param)
    connection = _PinnedConnection(host, port, addresses[0], parts.scheme == "https", limits.image_fetch_timeout)
    watchdog = threading.Timer(limits.image_fetch_timeout, connection.expire)
    watchdog.daemon = True
    watchdog.start()
    try:
        connection.request("GET", (parts.path or "/") + (f"?{parts.query}" if parts.query else ""),
                           headers={"Host": parts.netloc.rpartition("@")[2], "Accept": "image/*",
                                    "User-Agent": "vlmrl-serve"})
        response = connection.getresponse()
        if response.status != 200:
            raise failed
        data = bytearray()
        while not connection.expired.is_set() and (chunk := response.read1(65536)):
            data += chunk
            if len(data) > limits.max_body_bytes:
                raise RequestError(413, f"{param}: the image is over the server's limit of {limits.max_body_bytes} "
                                        "bytes", param)
        if connection.expired.is_set():
            raise failed
        return bytes(data)
    except (OSError, http.client.HTTPException, ValueError):
        raise failed from None
    finally:
        watchdog.cancel()
        connection.close()


def _open(data: bytes, limits: ServeLimits, param: str, declared: str | None = None):
    """The image in `data`, opened only as one of the listed formats (`FORMATS`; `declared`: the one the data URL
    names, which the bytes must be), its size checked against the server's limits before it is decoded. Every
    failure is a 400 naming `param`."""
    from PIL import Image

    formats = [declared] if declared else sorted(set(FORMATS.values()))
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data), formats=formats)
        except Exception as exc:  # noqa: BLE001  any failure of the decoder is the image's, never a 500
            raise RequestError(400, f"{param}: not a readable image (read as {'/'.join(formats)} only: the type it "
                                    f"declares, or those the server takes; {type(exc).__name__})", param) from None
        w, h = image.size
        if w * h > limits.max_image_pixels:
            raise RequestError(400, f"{param}: {w}x{h} pixels is over the server's limit of {limits.max_image_pixels}",
                               param)
        if min(w, h) < 1 or max(w, h) > MAX_ASPECT * min(w, h):
            raise RequestError(400, f"{param}: {w}x{h} has an aspect ratio over {MAX_ASPECT}, which the model's image "
                                    "processor cannot take", param)
        try:
            image.load()
            return image.convert("RGB")
        except Exception as exc:  # noqa: BLE001
            raise RequestError(400, f"{param}: the image does not decode ({type(exc).__name__}: "
                                    f"{str(exc)[:200]})", param) from None
