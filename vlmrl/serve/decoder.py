"""Per-token decoding for the chat server's generate calls (`Decoder`, generate's `on_token` and `on_logits`): each
answer's text as it grows, stop strings, per-request max_tokens, what may be streamed yet, and the token log-probs a
request asks for; events go to each job's queue (vlmrl.serve.batcher says what a job is and how batches form).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from vlmrl.models.policy import Policy
from vlmrl.serve.job import Job

log = logging.getLogger(__name__)


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
            answer.logprobs_sent = len(answer.logprobs or [])

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
            answer.logprobs_sent = len(answer.logprobs or [])
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
