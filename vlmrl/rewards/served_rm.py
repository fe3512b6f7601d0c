"""A reward model served by `vlmrl serve RM` on another device, process or machine, as a `reward_model` member:

    rewards:
      - {name: reward_model, path: http://rm-host:8000/v1}        # `vlmrl serve runs/rm --host 0.0.0.0 ...`

Each batch of answers goes to the server's `POST /v1/rewards` in requests of `batch_size` answers, up to
`concurrency` at a time, with the judge's retries (vlmrl.rewards.judge_http: backoff, Retry-After, a server still
starting); an answer is scored as the in-process `reward_model` scores it (the sample's text columns and its images
as PNG data URLs travel with it). The client asks `GET /v1/info` once: the RM's kind and tokenizer fingerprint, so
`vlmrl train` refuses an RM whose tokenizer is not the policy's before any step, as it does for a folder.

An answer the server could not score (its `error`), or every answer of a request whose retries are spent or that
was refused (a 4xx), is a RewardFailure that says why: counted in reward/reward_model/failures, it trains nothing.
A refused key (401/403), or the same refusal REFUSAL_LIMIT times in a row, stops the run.
"""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vlmrl.errors import ConfigError
from vlmrl.rewards.registry import FatalRewardError, RewardFailure

REFUSAL_LIMIT = 3  # identical 4xx refusals in a row that stop training, as the judge's refusal_limit
_CLIENTS: dict[tuple[str, str | None], ServedRewardModel] = {}
_LOCK = threading.Lock()


def is_served(path: Any) -> bool:
    return isinstance(path, str) and path.startswith(("http://", "https://"))


def rewards_reply(raw: bytes, attempts: int) -> list[dict] | None:
    """The `data` of a /v1/rewards reply (None for another body: retried as malformed)."""
    try:
        data = json.loads(raw)["data"]
        return data if isinstance(data, list) and all(isinstance(d, dict) and "score" in d for d in data) else None
    except (ValueError, KeyError, TypeError):
        return None


class ServedRewardModelRefused(FatalRewardError):
    """The served RM refused REFUSAL_LIMIT requests in a row the same way: training stops with its message."""


def rm_endpoint(base_url: str, route: str, parse, api_key_env: str | None, timeout: float, concurrency: int,
                max_retries: int):
    """The HTTP side of a served RM's client (vlmrl's or vLLM's): `route` under `base_url`, its reply `parse`r, the
    key from `api_key_env` (a ConfigError when that variable is unset), and the judge's retries."""
    from vlmrl.rewards.judge_http import ChatEndpoint

    api_key = os.environ.get(api_key_env) if api_key_env else None
    if api_key_env and not api_key:
        raise ConfigError(f"reward_model api_key_env={api_key_env}: that environment variable is not set")
    return ChatEndpoint(base_url, api_key=api_key, api_key_env=api_key_env, timeout=timeout, max_retries=max_retries,
                        backoff_base=0.5, backoff_max=10.0, retry_after_max=30.0, connect_window=120.0,
                        concurrency=concurrency, count=lambda _name: None, path=route, parse=parse,
                        what="reward model")


class ServedRewardModel:
    """The client of one served RM (module docstring); `info` is its GET /v1/info."""

    def __init__(self, base_url: str, model: str | None = None, api_key_env: str | None = None,
                 timeout: float = 120.0, concurrency: int = 4, max_retries: int = 3):
        self.endpoint = rm_endpoint(base_url, "/rewards", rewards_reply, api_key_env, timeout, concurrency,
                                    max_retries)
        try:
            self.info = self.endpoint.get_json("/info", timeout=min(30.0, timeout))
            served = self.info["model"]
        except Exception as exc:  # noqa: BLE001 - any failure is reported the same way
            raise ConfigError(f"reward_model path {base_url}: GET /info failed ({exc}); is an RM served there "
                              "(`vlmrl serve RM_FOLDER`), and does the URL end in /v1?") from None
        if model is not None and model != served:
            raise ConfigError(f"reward_model path {base_url} serves {served!r}, not model={model!r}")
        self.model, self.concurrency = served, max(1, concurrency)
        self._pool = ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="vlmrl-rm-client")
        self.refusals = Refusals(self.endpoint.url)

    def scores(self, completions: list[str], samples: list[dict], truncated: list[bool],
               request_size: int | None = None) -> list[Any]:
        """Each answer's score, or a RewardFailure saying why it has none. The answers go in `concurrency` requests
        (as few round trips as the connections allow; the server cuts each into model calls of its --max-batch),
        of at most `request_size` answers when given, and at most the server's --max-inputs."""
        from vlmrl.rewards.judge import encode_image

        per_request = max(1, -(-len(completions) // self.concurrency))
        per_request = min(per_request, request_size or per_request, int(self.info["limits"]["max_inputs"]))

        encoded: dict[int, str] = {}  # an image shared by a prompt's answers is encoded once

        def url(image) -> str:
            if id(image) not in encoded:
                encoded[id(image)] = encode_image(image, max_bytes=2**30)  # PNG: the trainer's pixels exactly
            return encoded[id(image)]

        bodies = []
        for start in range(0, len(completions), per_request):
            prompts: dict[str, int] = {}  # a prompt's text columns and images -> its index in this request
            body: dict[str, Any] = {"model": self.model, "prompts": [], "items": []}
            end = start + per_request
            for c, s, t in zip(completions[start:end], samples[start:end], truncated[start:end], strict=True):
                prompt = {"sample": {k: v for k, v in s.items() if isinstance(v, str)},
                          "images": [url(im) for im in s.get("images") or []]}
                key = json.dumps(prompt, sort_keys=True)
                if key not in prompts:
                    prompts[key] = len(body["prompts"])
                    body["prompts"].append(prompt)
                body["items"].append({"prompt": prompts[key], "completion": str(c), "finished": not t})
            bodies.append(body)
        values: list[Any] = []
        for body, reply in zip(bodies, self._pool.map(self._post, bodies), strict=True):
            values += reply if isinstance(reply, list) else [reply] * len(body["items"])
        return values

    def _post(self, body: dict) -> list[Any] | RewardFailure:
        from vlmrl.rewards.judge_http import JudgeError, JudgeRefused

        items = body["items"]
        try:
            data = self.endpoint.post(body)
        except JudgeRefused as exc:  # a 4xx: these answers have no score; the same one again and again stops
            self.refusals.refused(exc)
            return RewardFailure(str(exc))
        except JudgeError as exc:  # retries spent: these answers have no score
            return RewardFailure(str(exc))
        self.refusals.replied()
        if len(data) != len(items):
            return RewardFailure(f"reward model {self.endpoint.url}: {len(data)} scores for {len(items)} answers")
        return [RewardFailure(f"reward model {self.endpoint.url}: {d.get('error') or 'no score'}")
                if d["score"] is None else float(d["score"]) for d in data]


class Refusals:
    """A served RM's refusals in a row: at REFUSAL_LIMIT identical ones (no reply between) the run stops, since every
    later request would be refused the same way (a sample without a column the RM's template needs, a body too big,
    a model name the server does not serve)."""

    def __init__(self, url: str):
        self.url = url
        self._lock = threading.Lock()
        self._last: tuple[int, str] | None = None  # the last refusal (status, message)
        self._count = 0  # ... and how often in a row

    def refused(self, exc) -> None:
        """Count a JudgeRefused; raises ServedRewardModelRefused at the REFUSAL_LIMIT-th identical one in a row."""
        with self._lock:
            same = self._last == (exc.status, exc.message)
            self._last, self._count = (exc.status, exc.message), self._count + 1 if same else 1
            if self._count < REFUSAL_LIMIT:
                return
        raise ServedRewardModelRefused(f"reward model {self.url}: {REFUSAL_LIMIT} requests in a row were "
                                       f"refused with the same HTTP {exc.status}: {exc.message}")

    def replied(self) -> None:
        with self._lock:
            self._last, self._count = None, 0


def served_reward_model(url: str, model: str | None = None, api_key_env: str | None = None,
                        timeout: float = 120.0, concurrency: int = 4) -> ServedRewardModel:
    """The process-wide client of the RM served at `url` (made once: it asks /info)."""
    key = (url.rstrip("/"), model)
    with _LOCK:
        if key not in _CLIENTS:
            _CLIENTS[key] = ServedRewardModel(url, model, api_key_env, timeout, concurrency)
        return _CLIENTS[key]
