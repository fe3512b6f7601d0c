"""Dynamic batching for the chat server: concurrent requests become one `generate` call.

A request is a `Job`: its processed prompt (one row), how many answers it needs, its temperature and top_p, its own
max_tokens, stop strings and seed, and a queue its HTTP handler reads. The `Batcher` lives on the server's event loop.
When the model is free it takes the oldest waiting job and, waiting at most `batch_wait_ms` after that job arrived,
every waiting job with the same temperature and top_p, up to `max_batch` answers and `max_batch_tokens` (answers x
(longest prompt + largest max_tokens), what the KV cache holds). It runs them as ONE `generate` call in its worker
thread, so the event loop goes on accepting requests; they form the next batch.

Each job's answers draw from their own random stream (`generate`'s `prompt_seeds`), so an answer depends on its seed,
not on which jobs share its batch. During the call, `Decoder.step` (generate's `on_token`) decodes every answer as it
grows, cuts it at its first stop string or at its job's max_tokens (ending that row; the others go on) and sends the
text that is settled to the job's queue (vlmrl.serve.decoder). A tokenizer's decode may rewrite text it already gave
when one more token comes (transformers' `clean_up_tokenization_spaces` turns "It '" into "It's" once the "s"
arrives), so an answer's text is sent only as far as the decodes of its last few tokens agree (`stable_window`), and
its end event carries the final decode of all its tokens: the non-streamed reply is that text, and a stream ends by
sending what it adds. A job whose client went away or timed out is cancelled: its rows end at the next token, the
batch goes on for the others.

The queue is bounded at `ServeLimits.max_queue` requests: past it `submit` refuses with 503 and Retry-After, and
nothing already queued is touched. What the requests hold in bytes (bodies, images, processed inputs) is bounded by
the server's memory budget (vlmrl.serve.gate), which the handler pays from before it submits.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields

from torch import Tensor

from vlmrl.models.batch import PromptBatch, concat_prompt_batches
from vlmrl.models.policy import Policy
from vlmrl.rollout.generate import generate
from vlmrl.serve.decoder import Decoder
from vlmrl.serve.guard import RequestError, ServeLimits
from vlmrl.serve.job import Job

log = logging.getLogger(__name__)


def prompt_bytes(prompt: PromptBatch) -> int:
    """Bytes of every tensor a processed prompt holds (ids, masks, image tensors): what a waiting request pins."""
    total = 0
    for f in fields(prompt):
        value = getattr(prompt, f.name)
        for t in value.values() if isinstance(value, dict) else (value,):
            if isinstance(t, Tensor):
                total += t.numel() * t.element_size()
    return total


def batch_tokens(jobs: list[Job]) -> int:
    """What one generate call over `jobs` holds in its KV cache: answers x (longest prompt + largest max_tokens)."""
    return sum(j.rows for j in jobs) * (max(j.prompt_tokens for j in jobs) + max(j.max_tokens for j in jobs))


class Batcher:
    """Collects jobs on the event loop and runs compatible ones together in one worker thread (module docstring).
    `calls` counts generate calls, `batch_answers` the answers of each of the last 1,024, `cancelled_answers` the answers ended early
    because their client left or timed out (/healthz reports them; the tests and benchmarks read them)."""

    def __init__(self, policy: Policy, limits: ServeLimits):
        self.policy, self.limits = policy, limits
        self.pending: list[Job] = []
        self.calls = 0
        self.batch_answers: deque[int] = deque(maxlen=1024)  # the latest calls' only: a server runs for weeks
        self.cancelled_answers = 0
        self.refused_busy = 0  # requests answered 503 because the queue was full
        self.last_call_seconds = 0.0  # how long the latest generate call took (Retry-After's estimate)
        self._arrived: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="vlmrl-generate")
        self._running: list[Job] = []

    # -- the event-loop side -------------------------------------------------------------------------------------
    @property
    def waiting(self) -> list[Job]:
        return [j for j in self.pending if not j.cancelled]

    def check_room(self) -> None:
        """503 with Retry-After when `max_queue` requests wait. The handler asks before it decodes a request's
        images, and `submit` again."""
        waiting = len(self.waiting)
        if waiting < self.limits.max_queue:
            return
        self.refused_busy += 1
        retry = max(1, math.ceil(self.last_call_seconds))
        raise RequestError(503, f"the server is busy: {waiting} requests wait (--max-queue {self.limits.max_queue}); "
                                f"retry after {retry} s", code="server_busy", retry_after=retry)

    def submit(self, job: Job) -> None:
        """Queue `job`. A job that could never fit one generate call is a 400 naming the limit; a full queue is a
        503 with Retry-After (`check_room`)."""
        if job.rows > self.limits.max_batch:
            raise RequestError(400, f"n={job.n}: more answers than the server generates in one call "
                                    f"(max_batch={self.limits.max_batch})", "n")
        if batch_tokens([job]) > self.limits.max_batch_tokens:
            raise RequestError(400, f"n x (prompt tokens + max_tokens) = {job.rows} x ({job.prompt_tokens} + "
                                    f"{job.max_tokens}) is over the server's limit of {self.limits.max_batch_tokens} "
                                    "tokens per generation call; lower max_tokens or n", "max_tokens")
        self.check_room()
        self.pending.append(job)
        self._arrived.set()

    async def start(self) -> None:
        self._arrived = asyncio.Event()
        self._task = asyncio.create_task(self._serve(), name="vlmrl-batcher")

    async def stop(self) -> None:
        """Shutting down: running answers end at their next token; every unfinished request gets a 503."""
        for job in self.pending + self._running:
            job.cancel()
            job.events.put_nowait(("error", RequestError(503, "the server is shutting down")))
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True)

    def select(self) -> list[Job]:
        """The next batch, oldest job first: waiting jobs with its key, in arrival order, while they fit."""
        live = [j for j in self.pending if not j.cancelled]
        if not live:
            return []
        batch = [live[0]]
        for job in live[1:]:
            if job.key == live[0].key and sum(j.rows for j in batch) + job.rows <= self.limits.max_batch \
                    and batch_tokens(batch + [job]) <= self.limits.max_batch_tokens:
                batch.append(job)
        return batch

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        wait = self.limits.batch_wait_ms / 1000
        while True:
            await self._arrived.wait()
            self._arrived.clear()
            self.pending = [j for j in self.pending if not j.cancelled]
            if not self.pending:
                continue
            deadline = self.pending[0].created + wait  # a job waits at most batch_wait_ms for company
            while sum(j.rows for j in self.select()) < self.limits.max_batch \
                    and (left := deadline - time.monotonic()) > 0:
                try:
                    await asyncio.wait_for(self._arrived.wait(), left)
                except asyncio.TimeoutError:
                    break
                self._arrived.clear()
            batch = self.select()
            taken = set(map(id, batch))
            self.pending = [j for j in self.pending if id(j) not in taken and not j.cancelled]
            if self.pending:
                self._arrived.set()  # the jobs left over form the next batch
            if batch:
                self._running = batch
                try:
                    await loop.run_in_executor(self._executor, self._generate, batch, loop)
                except RuntimeError:  # the executor is shut down: the server is stopping
                    return
                finally:
                    self._running = []

    async def run_exclusive(self, fn: Callable[[], object]) -> object:
        """`fn()` in the generation thread, between generate calls (a forward of its own: prompt log-probs)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    # -- the worker-thread side ----------------------------------------------------------------------------------
    def _generate(self, batch: list[Job], loop: asyncio.AbstractEventLoop) -> None:
        started = time.monotonic()
        try:
            self._generate_batch(batch, loop)
        finally:
            self.last_call_seconds = time.monotonic() - started

    def _generate_batch(self, batch: list[Job], loop: asyncio.AbstractEventLoop) -> None:
        self.calls += 1
        self.batch_answers.append(sum(j.rows for j in batch))
        decoder = Decoder(batch, self.policy, loop, on_cancel=self._count_cancelled)
        try:
            prompts = batch[0].prompt if len(batch) == 1 else \
                concat_prompt_batches([j.prompt for j in batch], self.policy.pad_token_id)
            temperature, top_p = batch[0].key
            generate(self.policy, prompts, [j.rows for j in batch], max(j.max_tokens for j in batch), temperature,
                     top_p=top_p, prompt_seeds=[j.seed for j in batch], on_token=decoder.step,
                     on_logits=decoder.see_logits if decoder.wants_logprobs else None)
            decoder.close()
        except Exception as exc:  # the whole call failed: every job of it gets the error, the server goes on
            log.exception("generation failed for a batch of %d requests", len(batch))
            decoder.fail(exc)

    def _count_cancelled(self) -> None:
        self.cancelled_answers += 1  # as it happens (only the worker thread writes it), so /healthz sees it live
