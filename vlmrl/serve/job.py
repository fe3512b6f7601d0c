"""One chat request's answers as the server's batcher and decoder see them (`Job`)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from vlmrl.models.batch import PromptBatch


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
