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
text that is settled to the job's queue. A tokenizer's decode may rewrite text it already gave when one more token
comes (transformers' `clean_up_tokenization_spaces` turns "It '" into "It's" once the "s" arrives), so an answer's
text is sent only as far as the decodes of its last few tokens agree (`stable_window`), and its end event carries the
final decode of all its tokens: the non-streamed reply is that text, and a stream ends by sending what it adds. A job
whose client went away or timed out is cancelled: its rows end at the next token, the batch goes on for the others.

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
from dataclasses import dataclass, field, fields

import torch
from torch import Tensor

from vlmrl.models.batch import PromptBatch, concat_prompt_batches
from vlmrl.models.policy import Policy
from vlmrl.rollout.generate import generate
from vlmrl.serve.guard import RequestError, ServeLimits

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


@dataclass(eq=False)
class Job:
    """One chat request's answers. Events on `events`: ("delta", choice, text, logprobs), ("end", choice,
    finish_reason, completion_tokens, text, logprobs) once per choice (`text`: the answer's final decode), or
    ("error", exception) once. `logprobs` is None unless the job asked for them: a delta's are the entries of the
    tokens generated since the previous delta, an end's are all of the answer's (`Decoder` says what an entry is)."""

    prompt: PromptBatch  # one row
    n: int
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: no log-probs; k >= 0: each token's, with its k most likely alternatives
    token_ids: bool = False  # log-prob entries name tokens "token_id:ID" (vLLM's return_tokens_as_token_ids)
    created: float = field(default_factory=time.monotonic)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False

    @property
    def rows(self) -> int:
        """Answers generated: greedy answers are all equal, so n > 1 at temperature 0 generates one and copies it."""
        return 1 if self.temperature <= 0 else self.n

    @property
    def key(self) -> tuple[float, float]:
        """Jobs with equal keys can share a generate call (it takes one temperature and top_p)."""
        return (0.0, 1.0) if self.temperature <= 0 else (float(self.temperature), float(self.top_p))

    @property
    def prompt_tokens(self) -> int:
        return int(self.prompt.attention_mask.sum())

    def cancel(self) -> None:
        """Stop generating for this job (its rows end at the next token); safe to call when it finished."""
        self.cancelled = True


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


@dataclass
class _Answer:
    job: Job
    choices: list[int]  # the job's choice indices this row feeds (all n for a greedy job)
    window: int  # the decodes that must agree before text is sent (`stable_window` + 1)
    ids: list[int] = field(default_factory=list)  # generated tokens, the end token excluded
    generated: int = 0  # generated tokens, the end token included (usage.completion_tokens)
    sent: str = ""  # text already sent
    logprobs: list[dict] | None = None  # one entry per token of `ids` (when the job asked for log-probs)
    logprobs_sent: int = 0  # entries already sent with a delta
    recent: deque = field(default_factory=deque)  # the decodes after each of the last `window` tokens
    done: bool = False

    def settled(self, text: str) -> str:
        """Remember `text` (the decode of all tokens so far); the part of it the last `window` decodes agree on."""
        self.recent.append(text)
        if len(self.recent) > self.window:
            self.recent.popleft()
        return common_prefix(self.recent) if len(self.recent) == self.window else ""


class Decoder:
    """generate's `on_token` for one batch: per-row text, stop strings, max_tokens, events to the jobs' queues.

    For the jobs that ask for log-probs, also generate's `on_logits`: every token of `ids` gets an entry in OpenAI's
    format, `{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}`, under the model's
    own distribution (softmax of the logits, before temperature and top_p, as vLLM's default), the alternatives most
    likely first. `token` is the token's decode on its own (a byte-level piece of a character decodes as
    "\ufffd"), or "token_id:ID" for a job with `token_ids`; `bytes` are the decode's UTF-8 bytes. The end token has
    no entry (it is not in the text)."""

    def __init__(self, batch: list[Job], policy: Policy, loop: asyncio.AbstractEventLoop,
                 on_cancel: Callable[[], None] = lambda: None):
        self.tokenizer, self.loop, self.on_cancel = policy.processor.tokenizer, loop, on_cancel
        self.eos = set(policy.eos_token_ids)
        window = stable_window(self.tokenizer) + 1
        self.answers = [_Answer(job, list(range(job.n)) if job.rows == 1 else [r], window,
                                logprobs=None if job.logprobs is None else [])
                        for job in batch for r in range(job.rows)]
        self.wanted = [i for i, a in enumerate(self.answers) if a.logprobs is not None]
        self._step_logprobs: Tensor | None = None  # [len(wanted), vocab] float32, this step's
        self._pieces: dict[int, str] = {}

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.wanted)

    def see_logits(self, logits: Tensor, rows: Tensor) -> None:
        """generate's `on_logits`: the log-softmax of the rows the answers that asked for log-probs read."""
        self._step_logprobs = torch.log_softmax(logits[rows[self.wanted]].float(), -1).cpu()

    def step(self, tokens: Tensor, alive: Tensor) -> Tensor:
        ended, step_logprobs = [], self._step_logprobs
        self._step_logprobs = None
        at = {i: k for k, i in enumerate(self.wanted)} if step_logprobs is not None else {}
        for i, (answer, token, live) in enumerate(zip(self.answers, tokens.tolist(), alive.tolist(), strict=True)):
            if live and not answer.done:
                row = step_logprobs[at[i]] if i in at else None
                self._advance(answer, token, row)
            ended.append(answer.done)
        return torch.tensor(ended)

    def _piece(self, token: int, as_id: bool) -> dict:
        text = self._pieces.get(token)
        if text is None:
            text = self._pieces[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return {"token": f"token_id:{token}" if as_id else text, "bytes": list(text.encode("utf-8"))}

    def _entry(self, token: int, row: Tensor, job: Job) -> dict:
        entry = {**self._piece(token, job.token_ids), "logprob": float(row[token])}
        values, ids = row.topk(min(job.logprobs, row.numel())) if job.logprobs else (row[:0], row[:0].long())
        entry["top_logprobs"] = [{**self._piece(t, job.token_ids), "logprob": v}
                                 for t, v in zip(ids.tolist(), values.tolist(), strict=True)]
        return entry

    def _advance(self, answer: _Answer, token: int, logprobs: Tensor | None = None) -> None:
        job = answer.job
        if job.cancelled:
            answer.done = True  # nobody reads it any more
            self.on_cancel()
            return
        answer.generated += 1
        if token in self.eos:
            return self._finish(answer, self._text(answer), "stop")
        answer.ids.append(token)
        if answer.logprobs is not None and logprobs is not None:
            answer.logprobs.append(self._entry(token, logprobs, job))
        text = self._text(answer)
        cut = min((i for i in (text.find(s) for s in job.stop) if i >= 0), default=-1)
        if cut >= 0:
            return self._finish(answer, text[:cut], "stop")
        if len(answer.ids) >= job.max_tokens:
            return self._finish(answer, text, "length")
        stable = answer.settled(text)
        self._send(answer, stable[:len(stable) - held_back(stable, job.stop)])

    def _text(self, answer: _Answer) -> str:
        return self.tokenizer.decode(answer.ids, skip_special_tokens=True)

    def _send(self, answer: _Answer, text: str) -> None:
        """Send what `text` adds to what was sent (only ever a continuation of it)."""
        if len(text) > len(answer.sent) and text.startswith(answer.sent):
            for choice in answer.choices:
                self._put(answer.job, ("delta", choice, text[len(answer.sent):], self._new_logprobs(answer)))
            answer.sent = text
            answer.logprobs_sent = len(answer.ids)

    @staticmethod
    def _new_logprobs(answer: _Answer) -> list[dict] | None:
        return None if answer.logprobs is None else answer.logprobs[answer.logprobs_sent:]

    def _finish(self, answer: _Answer, text: str, reason: str) -> None:
        """End the answer with its final text: a stream gets what the text adds to what it was sent, the end event
        carries all of it (the non-streamed reply's content)."""
        if not text.startswith(answer.sent):  # a rewrite reached further back than `stable_window` tokens
            log.warning("a streamed answer's text changed after it was sent (the tokenizer's decode rewrote it "
                        "%d tokens later); the stream's text differs from the final text there", answer.window)
            for choice in answer.choices:
                self._put(answer.job, ("delta", choice, text[len(answer.sent):], self._new_logprobs(answer)))
            answer.sent = text
            answer.logprobs_sent = len(answer.ids)
        self._send(answer, text)
        answer.done = True
        for choice in answer.choices:
            self._put(answer.job, ("end", choice, reason, answer.generated, text, answer.logprobs))

    def close(self) -> None:
        """After generate returned: a row still open (none should be) ends at its length."""
        for answer in self.answers:
            if not answer.done and not answer.job.cancelled:
                self._finish(answer, self._text(answer), "length")

    def fail(self, exc: Exception) -> None:
        for job in dict.fromkeys(a.job for a in self.answers):
            self._put(job, ("error", exc))

    def _put(self, job: Job, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(job.events.put_nowait, event)
        except RuntimeError:  # the event loop closed (server shutting down): nobody to tell
            pass


REWRITE_PROBES = ("It 's", "do n't", "I 've", "a , b .", "you 're")


def stable_window(tokenizer) -> int:
    """How many tokens later an answer's text may still change under `tokenizer.decode`. 0 for a decode that only
    ever extends its text (byte-level BPE, SentencePiece: a character split over tokens shows as a trailing
    "\ufffd", which `held_back` holds); 4 for one that rewrites spaces before punctuation (transformers'
    `clean_up_tokenization_spaces`: "It '" becomes "It's" when the "s" comes; its longest pattern, " n't", spans up
    to 4 tokens). Probed once per batch on the strings that rule rewrites, so only such tokenizers delay streams.
    A rewrite no probe foresaw still ends with the final text, with a logged warning (`Decoder._finish`)."""
    for probe in REWRITE_PROBES:
        if tokenizer.decode(tokenizer.encode(probe, add_special_tokens=False), skip_special_tokens=True) != probe:
            return 4
    return 0


def common_prefix(texts) -> str:
    """The longest string every one of `texts` starts with (a binary search over `startswith`, which runs in C:
    answers are decoded again at every token, so this runs once per token per answer)."""
    texts = list(texts)
    if not texts:
        return ""
    shortest = min(texts, key=len)
    lo, hi = 0, len(shortest)  # shortest[:lo] is common to all; shortest[:hi + 1] is not (or hi is its length)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if all(t.startswith(shortest[:mid]) for t in texts):
            lo = mid
        else:
            hi = mid - 1
    return shortest[:lo]


def held_back(text: str, stop: tuple[str, ...]) -> int:
    """How many trailing characters of `text` may not be sent yet: the longest end of it that begins a stop string
    (it may yet become one, and stop strings are never sent), and an incomplete UTF-8 character ("\\ufffd")."""
    hold = len(text) - len(text.rstrip("\ufffd"))
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return hold
