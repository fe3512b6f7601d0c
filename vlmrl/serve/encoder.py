"""Dynamic batching for the embedding server: concurrent requests share the student's model calls.

A request's texts (or images) are cut into pieces of at most `max_batch` inputs. The `Encoder` lives on the server's
event loop. When the model is free it takes the oldest waiting piece and, waiting at most `batch_wait_ms` after that
piece arrived, the waiting pieces of the same kind (text or image), in arrival order, while they fit in `max_batch`
inputs. It embeds them in ONE `encode_text` / `encode_image` call in its worker thread, so the event loop goes on
accepting requests, and hands each request its rows. The student and its tokenizer (which is not safe to share
between threads) are only ever used in that thread.

A row does not depend on the rows it shares a call with: each tower embeds every input on its own (padding is
masked), so a request gets what `encode_text` / `encode_image` give for its inputs alone, up to float rounding.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vlmrl.serve.guard import RequestError, ServeLimits

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Piece:
    """Up to max_batch inputs of one request; `future` gets (rows [n, d], tokens, truncated texts)."""

    kind: str  # "text" or "image"
    inputs: list
    future: asyncio.Future
    created: float = field(default_factory=time.monotonic)
    cancelled: bool = False


def to_numpy(embeddings: Any) -> np.ndarray:
    """A float32 numpy copy of a tensor (on any device) or array."""
    if hasattr(embeddings, "detach"):
        return embeddings.detach().float().cpu().numpy().astype(np.float32)
    return np.asarray(embeddings, dtype=np.float32)


class Encoder:
    """The student behind a queue (module docstring). `calls` counts model calls, `batch_inputs` the inputs of each
    (/healthz reports them; the tests and benchmarks read them)."""

    def __init__(self, student: Any, limits: ServeLimits):
        self.student, self.limits = student, limits
        self.pending: list[Piece] = []
        self.calls = 0
        self.batch_inputs: list[int] = []
        self.tokenizer = getattr(student, "tokenizer", None)
        self.max_length = getattr(student, "max_text_length", None) or getattr(getattr(student, "cfg", None),
                                                                               "max_text_length", None)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="vlmrl-embed")
        self._arrived: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False

    # -- the event-loop side -------------------------------------------------------------------------------------
    async def texts(self, texts: list[str]) -> tuple[np.ndarray, int, int]:
        """Embeddings [n, d], the tokens the student reads, and how many texts it cuts at its max_text_length."""
        parts = await self._submit("text", texts)
        return self._rows(parts), sum(p[1] for p in parts), sum(p[2] for p in parts)

    async def images(self, images: list) -> np.ndarray:
        return self._rows(await self._submit("image", images))

    @staticmethod
    def _rows(parts: list[tuple]) -> np.ndarray:
        return np.concatenate([p[0] for p in parts]) if parts else np.zeros((0, 0), dtype=np.float32)

    async def _submit(self, kind: str, inputs: list) -> list[tuple]:
        if not inputs:
            return []
        if self._task is None:
            self._arrived = asyncio.Event()
            self._task = asyncio.create_task(self._serve(), name="vlmrl-encoder")
        loop, step = asyncio.get_running_loop(), self.limits.max_batch
        pieces = [Piece(kind, inputs[i:i + step], loop.create_future()) for i in range(0, len(inputs), step)]
        self.pending.extend(pieces)
        self._arrived.set()
        try:
            return await asyncio.wait_for(asyncio.gather(*(p.future for p in pieces)), self.limits.request_timeout)
        except asyncio.TimeoutError:
            for p in pieces:
                p.cancelled = True
            raise RequestError(504, f"embedding took over the server's limit of {self.limits.request_timeout} s "
                                    "(--timeout)") from None

    async def stop(self) -> None:
        """Shutting down: every waiting request gets a 503."""
        self._stopping = True
        for piece in self.pending:
            if not piece.future.done():
                piece.future.set_exception(RequestError(503, "the server is shutting down"))
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True)

    def select(self) -> list[Piece]:
        """The next call: the oldest piece, then waiting pieces of its kind in arrival order while they fit."""
        live = [p for p in self.pending if not p.cancelled]
        if not live:
            return []
        batch, size = [live[0]], len(live[0].inputs)
        for piece in live[1:]:
            if piece.kind == live[0].kind and size + len(piece.inputs) <= self.limits.max_batch:
                batch.append(piece)
                size += len(piece.inputs)
        return batch

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        wait = self.limits.batch_wait_ms / 1000
        while True:
            await self._arrived.wait()
            self._arrived.clear()
            self.pending = [p for p in self.pending if not p.cancelled]
            if not self.pending:
                continue
            deadline = self.pending[0].created + wait  # a piece waits at most batch_wait_ms for company
            while sum(len(p.inputs) for p in self.select()) < self.limits.max_batch \
                    and (left := deadline - time.monotonic()) > 0:
                try:
                    await asyncio.wait_for(self._arrived.wait(), left)
                except asyncio.TimeoutError:
                    break
                self._arrived.clear()
            batch = self.select()
            taken = set(map(id, batch))
            self.pending = [p for p in self.pending if id(p) not in taken and not p.cancelled]
            if self.pending:
                self._arrived.set()  # the pieces left over form the next call
            try:
                results = await loop.run_in_executor(self._executor, self._encode, batch)
            except Exception as exc:  # the whole call failed: every request of it gets the error, the server goes on
                if not self._stopping:
                    log.exception("embedding failed for a call of %d pieces", len(batch))
                results = exc
            for i, piece in enumerate(batch):
                if not piece.future.done():
                    if isinstance(results, Exception):
                        piece.future.set_exception(results)
                    else:
                        piece.future.set_result(results[i])

    # -- the worker-thread side ----------------------------------------------------------------------------------
    def _encode(self, batch: list[Piece]) -> list[tuple]:
        inputs = [x for piece in batch for x in piece.inputs]
        encode = self.student.encode_text if batch[0].kind == "text" else self.student.encode_image
        rows = to_numpy(encode(inputs, batch_size=len(inputs)))
        self.calls += 1
        self.batch_inputs.append(len(inputs))
        lengths = self._lengths(inputs) if batch[0].kind == "text" else None
        out, start = [], 0
        for piece in batch:
            n = len(piece.inputs)
            tokens = truncated = 0
            if lengths is not None:  # usage: the tokens the student reads, the texts it cuts
                own = lengths[start:start + n]
                limit = self.max_length or max(own)
                tokens, truncated = sum(min(k, limit) for k in own), sum(k > limit for k in own)
            out.append((rows[start:start + n], tokens, truncated))
            start += n
        return out

    def _lengths(self, texts: list[str]) -> list[int] | None:
        """Each text's token count before the student cuts it (None without a tokenizer)."""
        if self.tokenizer is None:
            return None
        return [len(ids) for ids in self.tokenizer(texts)["input_ids"]]
