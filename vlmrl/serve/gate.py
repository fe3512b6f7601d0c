"""What a request may hold in a vlmrl server, checked before it is paid for.

One `MemoryBudget` per server (`ServeLimits.max_queue_bytes`, `--max-queue-mb`) counts the bytes every request in
it holds together; each request keeps its share in a `Ledger`, which `RequestGate` opens when the request arrives
and closes, giving everything back, when its response has been sent (a stream's last byte included). What is taken:

  the body            twice its size (the bytes received, then what parsing makes of them), as it arrives
  its JSON            100 bytes for every byte of structure outside strings (a value in Python costs about that)
  an image            what decoding holds (vlmrl.serve.images.decode_cost) before it is decoded, then the image kept
  processed inputs    the prompt's tensors, while the request waits and generates (vlmrl.serve.chat)

A take that would pass the budget is a 503 with Retry-After; a request that alone needs more than the whole budget
is a 400. So what requests hold is at most `max_queue_bytes`, and the server's peak memory is its resident size
after start-up plus that plus one generation call's working memory (`max_batch_tokens`).

`RequestGate` is the ASGI middleware that reads the body before the app runs: 413 over `max_body_bytes` (by
Content-Length, or as it streams), 408 when the body takes longer than `body_timeout`, and 400 for JSON whose
structure (what is left with every string emptied) is larger or deeper than any request the server takes, before it
is parsed: a body of 300,000 `{}` never reaches the JSON parser or the validator.

When the budget empties after it held more than `TRIM_AFTER`, freed memory is handed back to the system
(`malloc_trim`), and `give_back_memory` makes large buffers their own mappings, so a burst does not leave the server
big.

`guarded_app` is the FastAPI app every server (chat, embeddings, reward model) starts from, with all of this and
vlmrl.serve.guard's errors in place.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import json
import logging
import re
import threading
from typing import Any

from vlmrl.serve.guard import RequestError, ServeLimits, error_body, install_errors

JSON_PER_BYTE = 100  # bytes of Python objects per byte of JSON structure (a dict is 64 bytes for its 3 in "{},")
MAX_STRUCTURE = 2**20  # bytes of JSON outside strings: 256 messages of 64 image parts each take 420 KB
MAX_DEPTH = 32  # nesting of JSON objects and arrays (a chat request nests 5 deep)
TRIM_AFTER = 64 * 2**20  # a budget that held this much gives freed memory back when it empties
log = logging.getLogger(__name__)
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


class MemoryBudget:
    """The bytes every request in a server may hold together (module docstring). Thread-safe: images are decoded
    in worker threads."""

    def __init__(self, limit: int, flag: str = "--max-queue-mb"):
        self.limit, self.flag = limit, flag
        self.used = self.peak = self.refused = 0
        self._high = 0  # the most held since memory was last given back
        self._lock = threading.Lock()

    def take(self, n: int, what: str, alone: int | None = None) -> None:
        """Take `n` bytes: 503 when the requests would hold more than the limit, 400 when the one taking them would
        alone (`alone`: all it holds with them; `n` when not given)."""
        alone = n if alone is None else alone
        if alone > self.limit:
            raise RequestError(400, f"{what}: needs {alone / 2**20:.1f} MiB, more than this server holds for all its "
                                    f"requests together ({self.limit / 2**20:g} MiB, {self.flag}); send fewer or "
                                    "smaller images or less text", what)
        with self._lock:
            if self.used + n > self.limit:
                self.refused += 1
                used = self.used
            else:
                self.used += n
                self.peak, self._high = max(self.peak, self.used), max(self._high, self.used)
                return
        raise RequestError(503, f"the server is busy: its requests hold {used / 2**20:.0f} MiB of its "
                                f"{self.limit / 2**20:g} MiB ({self.flag}); retry after 1 s", code="server_busy",
                           retry_after=1)

    def give(self, n: int) -> None:
        with self._lock:
            self.used -= n
            trim = self.used == 0 and self._high > TRIM_AFTER
            if trim:
                self._high = 0
        if trim:
            trim_memory()


class Ledger:
    """One request's share of the budget: what it took, all given back by `close` (the gate calls it when the
    response has been sent)."""

    def __init__(self, budget: MemoryBudget):
        self.budget, self.held = budget, 0

    def take(self, n: int, what: str) -> None:
        self.budget.take(n, what, alone=self.held + n)
        self.held += n

    def give(self, n: int) -> None:
        n = min(n, self.held)
        self.held -= n
        self.budget.give(n)

    def close(self) -> None:
        self.give(self.held)


def check_structure(body: bytes) -> int:
    """The bytes of `body`'s JSON structure (every string emptied, whitespace dropped); 400 when it is larger than
    `MAX_STRUCTURE` or nests deeper than `MAX_DEPTH`. Runs at regular-expression speed (20 MB in ~0.1 s)."""
    skeleton = _STRING.sub(b'""', body).translate(None, b" \t\r\n")
    if len(skeleton) > MAX_STRUCTURE:
        raise RequestError(400, f"request body: {len(skeleton)} bytes of JSON structure (brackets, keys, numbers) is "
                                f"more than any request this server takes ({MAX_STRUCTURE}); send fewer messages, "
                                "parts or items")
    depth = deepest = 0
    for byte in skeleton.translate(None, _NOT_BRACKETS):
        if byte in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif byte in b"]}":
            depth -= 1
    if deepest > MAX_DEPTH:
        raise RequestError(400, f"request body: JSON nested {deepest} deep, more than any request this server takes "
                                f"({MAX_DEPTH})")
    return len(skeleton)


class RequestGate:
    """ASGI middleware: opens each HTTP request's `Ledger` (`request.state.ledger`), reads its body under the size
    limit, the body deadline and the budget, checks a JSON body's structure, then runs the app on it, and closes the
    ledger when the response has been sent (module docstring). An app never sees part of a refused body."""

    def __init__(self, app, budget: MemoryBudget, max_bytes: int, body_timeout: float):
        self.app, self.budget, self.max_bytes, self.body_timeout = app, budget, max_bytes, body_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await self._refuse(send, 413, f"request body over the server's limit of {self.max_bytes} bytes "
                                                 "(--max-upload-mb)")
        ledger = Ledger(self.budget)
        scope.setdefault("state", {})["ledger"] = ledger
        try:
            try:
                body = await self._read(receive, ledger)
                if body is None:  # the client left before its body arrived
                    return
                if not headers.get(b"content-type", b"").startswith(b"multipart/"):
                    ledger.take(check_structure(body) * JSON_PER_BYTE, "request body")
            except RequestError as exc:
                return await self._refuse(send, exc.status, exc.message, exc.retry_after)
            except asyncio.TimeoutError:
                return await self._refuse(send, 408, f"the request body did not arrive within the server's "
                                                     f"{self.body_timeout:g} s (--body-timeout)")
            replayed = False

            async def replay():
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()  # after the body: the disconnect, for streaming responses

            await self.app(scope, replay, send)
        except asyncio.CancelledError:  # only a stopping server cancels a request (its drain deadline passed):
            log.info("a request was cancelled: the server is stopping")  # one line, not a traceback
        finally:
            ledger.close()

    async def _read(self, receive, ledger: Ledger) -> bytes | None:
        """The whole body, each chunk taken from the ledger as it arrives (and its joined copy once whole); None
        when the client disconnected. Raises asyncio.TimeoutError past the body deadline, RequestError past a limit."""
        chunks, received = [], 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout
        while True:
            message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            if message["type"] != "http.request":
                return None
            chunk = message.get("body", b"")
            received += len(chunk)
            if received > self.max_bytes:
                raise RequestError(413, f"request body over the server's limit of {self.max_bytes} bytes "
                                        "(--max-upload-mb)")
            ledger.take(len(chunk), "request body")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        ledger.take(received, "request body")  # what parsing makes of it
        return b"".join(chunks)

    async def _refuse(self, send, status: int, message: str, retry_after: int | None = None) -> None:
        body = json.dumps(error_body(status, message)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if retry_after is not None:
            headers.append((b"retry-after", str(retry_after).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


# ---------------------------------------------------------------------------------------------------------- memory
def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _libc()
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def give_back_memory(threshold: int = 2**20) -> bool:
    """Make every allocation of `threshold` bytes or more its own mapping, returned to the system when freed (glibc
    otherwise raises the threshold after each large free, up to 32 MiB, and keeps such buffers in its heap). False
    where the C library is not glibc."""
    return bool(_LIBC is not None and _LIBC.mallopt(M_MMAP_THRESHOLD, threshold))


def trim_memory() -> None:
    """Hand freed heap memory back to the system (glibc's malloc_trim; nothing elsewhere)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def guarded_app(title: str, description: str, limits: ServeLimits, start: Any = None, stop: Any = None) -> Any:
    """A FastAPI app with every server's guard in place: OpenAI-shaped errors (`install_errors`), the memory budget
    and `RequestGate` (the body read and checked before the app runs), `app.state.limits` and
    `app.state.budget`; `start` and `stop` (coroutine functions) run at start-up and shutdown."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI

    import vlmrl

    @asynccontextmanager
    async def lifespan(app):
        give_back_memory()
        if start is not None:
            await start()
        yield
        if stop is not None:
            await stop()

    app = FastAPI(title=title, version=vlmrl.__version__, lifespan=lifespan, description=description)
    app.state.limits, app.state.budget = limits, MemoryBudget(limits.max_queue_bytes)
    install_errors(app)
    app.add_middleware(RequestGate, budget=app.state.budget, max_bytes=limits.max_body_bytes,
                       body_timeout=limits.body_timeout)
    return app
