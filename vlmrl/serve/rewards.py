"""`vlmrl serve RM` for a reward model trained by `vlmrl rm train`: the RM on its own device, process or machine,
scoring answers for any number of trainer processes (`{name: reward_model, url: http://HOST:8000/v1}`).

- `POST /v1/rewards`: `{"model": NAME, "prompts": [{"sample": {"problem": ..., other text columns}, "images":
  [data URLs]}, ...], "items": [{"prompt": INDEX, "completion": TEXT, "finished": true}, ...]}` (a prompt sent once
  for all of its answers) -> `{"object": "list", "model", "kind", "data": [{"index": i, "score": float or null,
  "steps": [floats] (a process RM's step probabilities) or null, "error": why the item has no score, or null}]}`. An item is scored exactly as the `reward_model` reward scores it in the
  trainer's own process: the prompt is the sample through the RM's own template (`reward_model.json`), the answer
  is tokenised with special tokens split (a client's `<|im_end|>` is text), and `finished` says whether it ended
  with the end-of-turn token. An item the RM cannot score (too long, no reasoning steps for a process RM, a sample
  without a column its template needs) gets its `error`; the others are scored.
- `GET /v1/info` (the RM's kind, aggregate, tokenizer fingerprint and limits: what a client checks before a run),
  `GET /v1/models`, `GET /healthz`.

Requests are scored one at a time in one worker thread, each in chunks of `max_batch` items (the RM and its
tokenizer are only ever used in that thread); at most `max_queue` requests wait, and one more gets a 503 with
Retry-After. Limits (body size, answers per request, images per prompt, memory), the API key and errors are the other
servers' (vlmrl.serve.guard, vlmrl.serve.gate).
"""

from __future__ import annotations

import asyncio
import math
import string
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

try:
    from fastapi import Depends, Request
    from pydantic import BaseModel, ConfigDict, Field
    from starlette.concurrency import run_in_threadpool
except ImportError as exc:  # pragma: no cover - the serve extra is missing
    raise ImportError("vlmrl serve needs fastapi and uvicorn: pip install 'vlmrl[serve]'") from exc

from vlmrl.models.families.processor import client_text
from vlmrl.serve.gate import guarded_app
from vlmrl.serve.guard import RequestError, ServeLimits, api_key_dependency, check_limit, clip
from vlmrl.serve.images import decode_image

MAX_COLUMNS = 32  # text columns of one prompt's sample
MAX_LIST = 4096  # prompts, answers or images in the schema: a longer list is refused at its length, before any of
# its items is validated (300,000 `{}` prompts took 3 s of validation); --max-inputs and --max-images bound them below


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RewardPrompt(_Strict):
    sample: dict[str, str] = Field(max_length=MAX_COLUMNS, description="the prompt's text columns: problem, ...")
    images: list[str] = Field(default_factory=list, max_length=MAX_LIST,
                              description="data:image/png;base64,... (PNG scores exactly)")


class RewardItem(_Strict):
    prompt: int = Field(ge=0, description="the index of the prompt this answer answers, in `prompts`")
    completion: str
    finished: bool = True


class RewardRequest(_Strict):
    model: str
    prompts: list[RewardPrompt] = Field(min_length=1, max_length=MAX_LIST)
    items: list[RewardItem] = Field(min_length=1, max_length=MAX_LIST)


def is_reward_model(path: str | Path) -> bool:
    """A folder `vlmrl rm train` wrote (its reward_model.json), or a run directory of them."""
    from vlmrl.models.preflight import resolve_model

    try:
        return (Path(resolve_model(path, "model")) / "reward_model.json").is_file()
    except Exception:  # noqa: BLE001 - anything that is not a local RM folder is another kind of model
        return False


def build_reward_app(folder: str | Path, limits: ServeLimits | None = None, api_key: str | None = None,
                     model_name: str | None = None, device: str | None = None, dtype: str | None = None):
    """The FastAPI app `vlmrl serve` runs for an RM folder (or a run directory: its newest checkpoint)."""
    from vlmrl.rewards.reward_model import get_reward_model

    rm = get_reward_model(folder, device or "cpu", dtype or "float32")
    return reward_app(rm, model_name or Path(folder).resolve().name, limits, api_key)


class Scorer:
    """The RM behind a queue of requests, scored one at a time in one worker thread (module docstring)."""

    def __init__(self, rm: Any, limits: ServeLimits):
        self.rm, self.limits = rm, limits
        self.waiting = 0
        self.calls = 0
        self.last_seconds = 1.0
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="vlmrl-reward")

    def check_room(self) -> None:
        if self.waiting >= self.limits.max_queue:
            retry = max(1, math.ceil(self.last_seconds))
            raise RequestError(503, f"the server is busy: {self.waiting} requests wait (--max-queue "
                                    f"{self.limits.max_queue}); retry after {retry} s", code="server_busy",
                               retry_after=retry)

    async def score(self, samples: list[dict], completions: list[str], finished: list[bool]) -> list[dict]:
        self.check_room()
        self.waiting += 1
        try:
            work = asyncio.get_running_loop().run_in_executor(self._executor, self._score, samples, completions,
                                                              finished)
            return await asyncio.wait_for(work, self.limits.request_timeout)
        except asyncio.TimeoutError:
            raise RequestError(504, f"no score within {self.limits.request_timeout:g} s (--timeout); the server is "
                                    "busier than that, or the request is too large", code="timeout") from None
        finally:
            self.waiting -= 1

    def _score(self, samples: list[dict], completions: list[str], finished: list[bool]) -> list[dict]:
        from vlmrl.rewards.registry import RewardFailure
        from vlmrl.rewards.reward_model import member_scores

        t0 = time.perf_counter()
        self.calls += 1
        steps: list = [None] * len(completions)
        values = member_scores(self.rm, "this server's reward model", completions, samples,
                               [not f for f in finished], self.limits.max_batch, steps)
        self.last_seconds = time.perf_counter() - t0
        return [{"index": i, "score": None if isinstance(v, RewardFailure) else float(v),
                 "steps": steps[i], "error": v.reason if isinstance(v, RewardFailure) else None}
                for i, v in enumerate(values)]

    async def stop(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def reward_app(rm: Any, name: str, limits: ServeLimits | None = None, api_key: str | None = None):
    """The app around an already loaded RM (tests build several around one)."""
    limits = limits or ServeLimits()
    scorer = Scorer(rm, limits)
    info = {"model": name, "kind": rm.kind, "aggregate": (rm.info.get("process") or {}).get("aggregate"),
            "vocabulary": rm.info["vocabulary"], "prompt_template": rm.info["prompt_template"],
            "max_answer_tokens": rm.info["max_answer_tokens"], "max_prompt_length": rm.info["max_prompt_length"],
            "limits": {"max_inputs": limits.max_inputs, "max_images": limits.max_images,
                       "max_body_bytes": limits.max_body_bytes}}
    app = guarded_app("vlmrl reward model", f"Scores answers with the {rm.kind} reward model {name}", limits,
                      stop=scorer.stop)
    app.state.scorer = scorer
    auth = [Depends(api_key_dependency(api_key))]
    needs = sorted({field for _, field, _, _ in string.Formatter().parse(rm.info["prompt_template"]) if field})

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok", "model": name, "waiting": scorer.waiting, "score_calls": scorer.calls}

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "vlmrl"}]}

    @app.get("/v1/info", dependencies=auth)
    async def get_info() -> dict:
        return info

    @app.post("/v1/rewards", dependencies=auth)
    async def rewards(body: RewardRequest, request: Request) -> dict:
        if body.model != name:
            raise RequestError(404, f"model {clip(repr(body.model), 80)} not found: this server serves {name!r} "
                                    "(GET /v1/models)", "model", "model_not_found")
        check_limit(len(body.items), limits.max_inputs, "items (answers per request)")
        check_limit(len(body.prompts), len(body.items), "prompts (at most one per answer)")
        for i, item in enumerate(body.items):
            if item.prompt >= len(body.prompts):
                raise RequestError(400, f"items[{i}].prompt={item.prompt}: there are {len(body.prompts)} prompts",
                                   f"items[{i}].prompt")
        scorer.check_room()  # before any image is decoded
        prompts = await run_in_threadpool(_samples, body.prompts, limits, request, needs)
        scored = await scorer.score([prompts[item.prompt] for item in body.items],
                                    [item.completion for item in body.items], [item.finished for item in body.items])
        return {"object": "list", "model": name, "kind": rm.kind, "data": scored}

    return app


def _samples(prompts: list[RewardPrompt], limits: ServeLimits, request: Request, needs: list[str]) -> list[dict]:
    """Each prompt's sample as the RM's template reads it (400 for one without a column the template names): the
    client's texts marked as a client's (never special tokens), its images decoded once (whatever the number of
    answers to it) under the request's memory account."""
    samples = []
    for i, prompt in enumerate(prompts):
        missing = [k for k in needs if k not in prompt.sample]
        if missing:
            raise RequestError(400, f"prompts[{i}].sample: no {missing} column; this reward model's prompt template "
                                    f"names {needs} (GET /v1/info)", f"prompts[{i}].sample")
        check_limit(len(prompt.images), limits.max_images, f"prompts[{i}].images", low=0)
        try:
            sample: dict[str, Any] = {k: client_text(v) for k, v in prompt.sample.items()}
        except ValueError as exc:
            raise RequestError(400, f"prompts[{i}].sample: {exc}", f"prompts[{i}].sample") from None
        sample["images"] = [decode_image(url, limits, f"prompts[{i}].images[{j}]", request.state.ledger)
                            for j, url in enumerate(prompt.images)]
        samples.append(sample)
    return samples
