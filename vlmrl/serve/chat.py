"""`vlmrl serve CHECKPOINT` for a generative model: an OpenAI-compatible chat API over the trained policy.

- `POST /v1/chat/completions`: text and `image_url` parts (data URLs), n, temperature (0 = greedy), top_p,
  max_tokens, stop, seed, stream (server-sent events in OpenAI's chunk format, ending `data: [DONE]`), usage counts,
  logprobs and top_logprobs (the model's own distribution: vlmrl.serve.decoder.Decoder); vLLM's prompt_logprobs,
  add_generation_prompt and continue_final_message, to score a conversation's last answer (vlmrl.serve.scoring);
- `GET /v1/models`, `GET /v1/models/{id}`, `GET /healthz`, and FastAPI's schema at `/openapi.json` and `/docs`.

The model loads as `vlmrl eval` loads it: `resolve_model` (a run directory -> its newest complete checkpoint), then
`load_policy` with the checkpoint's config.yaml for dtype, device, pixel budget, prompt template, prompt length and
the default max_tokens (eval.max_new_tokens). Weights come through transformers' `from_pretrained`: safetensors, or a
`.bin` through `torch.load(weights_only=True)`; no remote code. Prompts go through the policy's processor
(vlmrl.serve.messages) and concurrent requests through one generation call (vlmrl.serve.batcher).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

try:
    from fastapi import Depends, Request
    from fastapi.responses import StreamingResponse
    from starlette.concurrency import run_in_threadpool
except ImportError as exc:  # pragma: no cover - the serve extra is missing
    raise ImportError("vlmrl serve needs fastapi and uvicorn: pip install 'vlmrl[serve]'") from exc

from vlmrl.errors import ConfigError
from vlmrl.models.policy import Policy
from vlmrl.serve.batcher import Batcher, Job, prompt_bytes
from vlmrl.serve.gate import guarded_app
from vlmrl.serve.guard import (
    RequestError,
    ServeLimits,
    api_key_dependency,
    check_limit,
    clip,
    error_body,
)
from vlmrl.serve.messages import ChatRequest, build_prompt
from vlmrl.serve.scoring import prompt_logprobs


@dataclass
class ChatModel:
    """A loaded policy and the recipe values that shape its prompts and answers."""

    policy: Policy
    name: str  # the id clients send as `model`
    prompt_template: str = "{problem}"
    max_prompt_length: int | None = None
    default_max_tokens: int = 12
    source: str = ""  # the folder (or hub name) the weights came from


def load_chat_model(model_ref: str | Path, model_name: str | None = None, device: str | None = None,
                    dtype: str | None = None, prompt_template: str | None = None) -> ChatModel:
    """Load `model_ref` the way `vlmrl eval` does (module docstring); explicit arguments win over the recipe."""
    from vlmrl.config import load_config
    from vlmrl.models import load_policy
    from vlmrl.models.preflight import check_device, resolve_model

    ckpt = resolve_model(model_ref, "vlmrl serve MODEL")
    recipe = ckpt / "config.yaml" if isinstance(ckpt, Path) and (ckpt / "config.yaml").exists() else None
    cfg = load_config(recipe, [])
    device = device or cfg.model.device
    check_device(device, "--device")
    template = prompt_template or cfg.data.prompt_template
    try:
        template.format(problem="")
    except (KeyError, IndexError, ValueError) as exc:
        raise ConfigError(f"prompt template {template!r} ({recipe or 'default'}): the server fills only "
                          f"{{problem}} and this template needs {exc}; pass --prompt-template '{{problem}}' or one "
                          "that uses {problem} only") from None
    policy = load_policy(ckpt, dtype or cfg.model.dtype, device, cfg.model.min_pixels, cfg.model.max_pixels,
                         cfg.model.autocast)
    policy.model.eval()
    path = Path(model_ref)
    name = model_name or (path.resolve().name if path.exists() else str(model_ref))
    return ChatModel(policy, name, template, cfg.data.max_prompt_length, cfg.eval.max_new_tokens, str(ckpt))


def build_chat_app(model_ref: str | Path, limits: ServeLimits | None = None, api_key: str | None = None,
                   model_name: str | None = None, device: str | None = None, dtype: str | None = None,
                   prompt_template: str | None = None):
    """The FastAPI app `vlmrl serve` runs for a generative checkpoint."""
    return chat_app(load_chat_model(model_ref, model_name, device, dtype, prompt_template), limits, api_key)


def chat_app(model: ChatModel, limits: ServeLimits | None = None, api_key: str | None = None):
    """The app around an already loaded model (tests and benchmarks build several around one)."""
    limits = limits or ServeLimits()
    batcher = Batcher(model.policy, limits)
    fit_pixels = model.policy.processor.fit_pixels()

    app = guarded_app("vlmrl chat", f"OpenAI-compatible chat completions for {model.name} ({model.source})", limits,
                      start=batcher.start, stop=batcher.stop)
    app.state.batcher, app.state.model = batcher, model
    budget = app.state.budget
    auth = [Depends(api_key_dependency(api_key))]
    created = int(time.time())
    card = {"id": model.name, "object": "model", "created": created, "owned_by": "vlmrl"}

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok", "model": model.name, "waiting": len(batcher.waiting), "held_bytes": budget.used,
                "held_peak_bytes": budget.peak, "refused_busy": batcher.refused_busy + budget.refused,
                "generate_calls": batcher.calls, "answers_cancelled": batcher.cancelled_answers}

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}", dependencies=auth)
    async def model_card(model_id: str) -> dict:
        _check_model(model_id, model.name)
        return card

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(body: ChatRequest, request: Request):
        _check_model(body.model, model.name)
        check_limit(body.n, limits.max_n, "n")
        given = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = getattr(body, given)
        if max_tokens is None:  # the recipe's eval.max_new_tokens, within the server's limit
            max_tokens = min(model.default_max_tokens, limits.max_tokens)
        check_limit(max_tokens, limits.max_tokens, given)
        stop, logprobs = body.stops(), body.logprob_count()
        if body.prompt_logprobs is not None and body.stream:
            raise RequestError(400, "prompt_logprobs are sent with the whole reply, not streamed: set stream false",
                               "prompt_logprobs")
        request_id = f"chatcmpl-{secrets.token_hex(12)}"
        batcher.check_room()  # a full queue refuses before the images are decoded and processed
        ledger = request.state.ledger
        images_from = ledger.held
        prompt = await run_in_threadpool(build_prompt, model.policy.processor, body, limits, model.prompt_template,
                                         request_id, model.max_prompt_length, ledger, fit_pixels)
        ledger.give(ledger.held - images_from)  # the decoded images are gone; the processed inputs stay until the end
        ledger.take(prompt_bytes(prompt), "messages")
        temperature = 1.0 if body.temperature is None else body.temperature
        job = Job(prompt, body.n, max_tokens, temperature, 1.0 if body.top_p is None else body.top_p,
                  secrets.randbits(63) if body.seed is None else body.seed, stop, logprobs,
                  body.return_tokens_as_token_ids)
        head = {"id": request_id, "created": int(time.time()), "model": model.name}
        if body.prompt_logprobs is not None:  # scored before the answer is queued, in the generation thread
            head["prompt_logprobs"] = await batcher.run_exclusive(
                lambda: prompt_logprobs(model.policy, prompt, body.prompt_logprobs))
        batcher.submit(job)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return await _stream(job, head, limits.request_timeout, include_usage)
        watcher = asyncio.create_task(_cancel_when_gone(request, job))
        try:
            return await _complete(job, head, limits.request_timeout)
        finally:
            watcher.cancel()

    return app


def _check_model(model_id: str, name: str) -> None:
    if model_id != name:
        raise RequestError(404, f"model {clip(repr(model_id), 80)} not found: this server serves {name!r} (GET "
                                "/v1/models)",
                           "model", "model_not_found")


async def _next(job: Job, deadline: float, timeout: float) -> tuple:
    """The job's next event, or 504 (the job cancelled) when the request's time is up."""
    try:
        event = await asyncio.wait_for(job.events.get(), max(0.0, deadline - time.monotonic()))
    except asyncio.TimeoutError:
        job.cancel()
        raise RequestError(504, f"no answer within the server's request timeout of {timeout:g} s (--timeout); "
                                "the server is busy or max_tokens is large") from None
    if event[0] == "error":
        job.cancel()
        exc = event[1]
        if isinstance(exc, RequestError):
            raise exc
        raise RequestError(500, f"generation failed: {type(exc).__name__}: {exc}") from exc
    return event


def _logprobs(entries: list[dict] | None) -> dict | None:
    return None if entries is None else {"content": entries}


def _usage(job: Job, tokens: dict[int, int]) -> dict:
    completion = sum(tokens.values())
    return {"prompt_tokens": job.prompt_tokens, "completion_tokens": completion,
            "total_tokens": job.prompt_tokens + completion}


async def _cancel_when_gone(request: Request, job: Job) -> None:
    """Cancel a non-streamed job when its client disconnects (a stream's job is cancelled by `_JobStream`): its rows
    end at the next token instead of running to max_tokens for nobody."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancel()
    job.events.put_nowait(("error", RequestError(499, "the client closed the request")))


async def _complete(job: Job, head: dict, timeout: float) -> dict:
    """The whole reply: each choice's content is its end event's text, the final decode of all its tokens (deltas
    are for streams; a tokenizer may rewrite text after it was decoded, and the reply must not lose any)."""
    deadline = job.created + timeout
    texts, reasons, tokens, logprobs = {}, {}, {}, {}
    while len(reasons) < job.n:
        event = await _next(job, deadline, timeout)
        if event[0] == "end":
            reasons[event[1]], tokens[event[1]], texts[event[1]], logprobs[event[1]] = event[2:6]
    choices = [{"index": i, "message": {"role": "assistant", "content": texts[i]},
                "logprobs": _logprobs(logprobs[i]), "finish_reason": reasons[i]} for i in range(job.n)]
    return {**head, "object": "chat.completion", "choices": choices, "usage": _usage(job, tokens)}


async def _stream(job: Job, head: dict, timeout: float, include_usage: bool):
    """Server-sent events as answers grow. The response and its first chunk (the assistant role) go out at once,
    before the job is generated, so a client waiting behind a busy server sees it was accepted; a failure or a
    time-out later ends the stream with an error event; a client gone cancels the job's rows."""
    deadline = job.created + timeout

    def chunk(choices: list[dict], **extra) -> str:
        return f"data: {json.dumps({**head, 'object': 'chat.completion.chunk', 'choices': choices, **extra})}\n\n"

    async def events():
        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for i in range(job.n)])
        ended, tokens, sent = set(), {}, {}
        while True:
            try:
                event = await _next(job, deadline, timeout)
            except RequestError as exc:
                yield f"data: {json.dumps(error_body(exc.status, exc.message))}\n\n"
                return
            if event[0] == "delta":
                if event[3] is not None:
                    sent[event[1]] = sent.get(event[1], 0) + len(event[3])
                yield chunk([{"index": event[1], "delta": {"content": event[2]}, "logprobs": _logprobs(event[3]),
                              "finish_reason": None}])
            else:  # the end: with the entries of tokens whose text was never sent (a stop string's)
                ended.add(event[1])
                tokens[event[1]] = event[3]
                rest = None if event[5] is None else event[5][sent.get(event[1], 0):]
                yield chunk([{"index": event[1], "delta": {}, "logprobs": _logprobs(rest),
                              "finish_reason": event[2]}])
            if len(ended) == job.n:
                break
        if include_usage:
            yield chunk([], usage=_usage(job, tokens))
        yield "data: [DONE]\n\n"

    return _JobStream(job, events(), media_type="text/event-stream",
                      headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class _JobStream(StreamingResponse):
    """A stream whose job is cancelled however the response ends: done, client gone, or server stopping."""

    def __init__(self, job: Job, content, **kwargs):
        super().__init__(content, **kwargs)
        self.job = job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()
            await self.body_iterator.aclose()
