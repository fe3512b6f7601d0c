"""The `judge` reward: an LLM judge's verdict on each answer, through a `JudgeClient` kept for the whole run."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from vlmrl.rewards.judge import DEFAULT_CACHE_DIR, JudgeCache, JudgeClient
from vlmrl.rewards.parsing import completion_text, strip_think
from vlmrl.rewards.registry import RewardBatch, RewardFailure, register_reward
from vlmrl.rewards.verifiable import _select_answer, per_sample

_CLIENTS: dict[str, JudgeClient] = {}
_CLIENTS_LOCK = threading.Lock()


def get_client(**options: Any) -> JudgeClient:
    """The process-wide JudgeClient for these options (made once: its threads, counters and cache persist)."""
    key = json.dumps(options, sort_keys=True, default=str)
    with _CLIENTS_LOCK:
        if key not in _CLIENTS:
            _CLIENTS[key] = JudgeClient(**options)
        return _CLIENTS[key]


@register_reward("judge", inline=True, grades=("number", "text", "math", "choice", "box"))
def judge_reward(
    completions: list[str],
    *,
    base_url: str,
    model: str,
    api_key_env: str | None = None,
    template: str | None = None,
    mode: str = "verdict",
    max_reasons: int = 3,
    timeout: float = 30.0,
    max_retries: int = 3,
    concurrency: int = 8,
    cache_dir: str | None = DEFAULT_CACHE_DIR,
    image_max_bytes: int = 512_000,
    max_tokens: int = 256,
    temperature: float = 0.0,
    backoff_base: float = 0.5,
    batch_timeout: float | None = 300.0,
    connect_window: float = 180.0,
    refusal_limit: int = 3,
    circuit_failures: int = 8,
    circuit_cooldown: float = 60.0,
    graded: bool = False,
    send_images: bool = True,
    prediction: str = "answer",
    strict: bool = True,
    question_column: str = "problem",
    reference_column: str = "solution",
    images: list[Any] | None = None,
    completion_truncated: list[bool] | None = None,
    **columns: Any,
) -> list[float | None]:
    """The judge's score in [0, 1] for each answer: 1.0 for [RELEVANT], 0.0 for [IRRELEVANT] (mode "verdict"; with
    `graded`, the judge's probability of [RELEVANT] read from the reply's token log-probs), or N/10 (mode "score"),
    from the model `model` at the OpenAI-compatible `base_url` (see `JudgeClient` for every
    option; `cache_dir: null` turns the disk cache off).

    What is graded: prediction="answer" (default) sends the answer block, selected as in `accuracy` (`strict`: the
    completion must be exactly [think] + one answer block and not truncated); an answer that is missing or empty
    pays 0.0 without a request, so the judge cannot be asked to grade a blank. prediction="completion" sends the
    whole completion outside think blocks. The question and reference come from the `question_column` and
    `reference_column` columns, the sample's images (send_images) as data URLs of at most `image_max_bytes`.
    A request that fails after its retries, a reply without a verdict (or cut at `max_tokens`), a request not
    judged within `batch_timeout` seconds of the call (the whole batch's deadline; None: none), and every request
    while the circuit is open (after `circuit_failures` requests in a row failed for good, for `circuit_cooldown`
    seconds) give a `RewardFailure`: the sample is left out of training (advantage 0), never scored 0, and counted in
    reward/judge/failures. A refused connection is retried for `connect_window` seconds (a restarting server);
    `refusal_limit` identical 4xx refusals in a row (a wrong model or path, a text-only model sent images) stop
    training with the server's message (0: never).
    Logged per step: reward/judge/failures (samples whose value failed) and the client's counters for this batch
    (`JudgeClient`: verdicts, cache_hits, http_failures, no_verdict, cut_at_max_tokens, deadline_misses,
    short_circuited, one per distinct request; ungraded, graded verdicts whose reply showed no decision; requests, retries, timeouts, ... per HTTP attempt). Identical
    requests in a batch (a group's repeated answers) are sent once."""
    if prediction not in ("answer", "completion"):
        raise ValueError(f"prediction={prediction!r}: expected 'answer' or 'completion'")
    client = get_client(base_url=base_url, model=model, api_key_env=api_key_env, template=template, mode=mode,
                        max_reasons=max_reasons, timeout=timeout, max_retries=max_retries, concurrency=concurrency,
                        cache_dir=cache_dir, image_max_bytes=image_max_bytes, max_tokens=max_tokens,
                        temperature=temperature, backoff_base=backoff_base, connect_window=connect_window,
                        refusal_limit=refusal_limit, circuit_failures=circuit_failures,
                        circuit_cooldown=circuit_cooldown, graded=graded)
    deadline = None if batch_timeout is None else time.monotonic() + batch_timeout
    n = len(completions)
    questions = per_sample(columns.get(question_column), n, "")
    references = per_sample(columns.get(reference_column), n, "")
    image_lists = per_sample(images, n, None) if send_images else [None] * n
    truncated = per_sample(completion_truncated, n, False)
    before = dict(client.stats)
    values: list[Any] = [0.0] * n
    details: list[Any] = [{"skipped": "no answer to judge"}] * n
    encoded: dict[int, str] = {}
    unique: dict[str, list[dict]] = {}
    owner: dict[int, str] = {}
    for i, completion in enumerate(completions):
        text = completion_text(completion)
        answer = (_select_answer(text, bool(truncated[i]), "tag", strict) if prediction == "answer"
                  else strip_think(text).strip())
        if not answer:
            continue
        imgs = list(image_lists[i]) if image_lists[i] else None
        messages = client.messages(str(questions[i]), answer, str(references[i]), imgs, encoded)
        key = JudgeCache.key(model, messages, client.settings)
        unique.setdefault(key, messages)
        owner[i] = key
    results = dict(zip(unique, client.judge_many(list(unique.values()), deadline), strict=True))
    for i, key in owner.items():
        result = results[key]
        feedback = result.feedback
        details[i] = {**(feedback.to_dict() if feedback else {}), "error": result.error, "cached": result.cached,
                      "attempts": result.attempts, "outcome": result.outcome}
        if result.failed:
            values[i] = RewardFailure(result.error or f"judge {client.url}: no verdict")
        else:
            values[i] = feedback.score
    metrics = {k: float(client.stats[k] - before[k]) for k in client.stats}
    return RewardBatch(values, metrics, details)
