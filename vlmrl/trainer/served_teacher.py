"""A served teacher for on-policy distillation: `distill.teacher: http://HOST:PORT/v1`, any server that scores a
conversation's prompt tokens the way vLLM does (`vllm serve`, or `vlmrl serve` of a checkpoint).

For every answer, one chat request: the student's system prompt, the user turn it saw (its images as lossless PNG
data URLs, then the problem through the recipe's `data.prompt_template`), and the answer as the last assistant
turn, closed when the answer ended with an end token (the template's end of turn then scores that token) and left
open when it was cut at max_new_tokens; `add_generation_prompt: false`, `prompt_logprobs: 0`, `max_tokens: 1`. The
reply's `prompt_logprobs` hold the teacher's id and log-prob at every prompt token.

An answer is scored only where the teacher read exactly what the student read: the ids of the teacher's prompt,
up to the end of the answer, must equal the student's prompt ids followed by its answer ids. Otherwise (another
tokenizer, a chat template that rewrites the answer, an answer the student spelt with ids the tokenizer would not
choose, which an untrained model often does) the answer gets no distillation term (its teacher log-probs are set to
the student's) and counts in `distill/unscored`, as does an answer whose request failed after the endpoint's
retries. The log-probs are the teacher's at temperature 1 (a server returns no other), so the recipe samples at
rollout.temperature 1 (config validation says so).
"""

from __future__ import annotations

import base64
import io
import logging
import os
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor

from vlmrl.errors import ConfigError

log = logging.getLogger(__name__)


def is_served(teacher: str | None) -> bool:
    return bool(teacher) and str(teacher).startswith(("http://", "https://"))


def png_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


class ServedTeacher:
    """The teacher behind an OpenAI-compatible endpoint (module docstring); `logprobs` as a local teacher's, plus
    `stats` of the last call: distill/unscored (the share of answers without a teacher score)."""

    def __init__(self, base_url: str, policy, template: str, coef: float, model: str | None = None,
                 api_key_env: str | None = None, concurrency: int = 8, timeout: float = 120.0):
        from vlmrl.rewards.judge_http import ChatEndpoint

        api_key = os.environ.get(api_key_env) if api_key_env else None
        if api_key_env and not api_key:
            raise ConfigError(f"distill.teacher_api_key_env={api_key_env}: that environment variable is not set")
        self.policy, self.template, self.coef = policy, template, coef
        self.endpoint = ChatEndpoint(base_url, api_key=api_key, api_key_env=api_key_env, timeout=timeout,
                                     max_retries=3, backoff_base=0.5, backoff_max=10.0, retry_after_max=30.0,
                                     connect_window=60.0, concurrency=concurrency, count=lambda _name: None)
        self.model = model or self._only_model()
        self._pool = ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="vlmrl-teacher")
        self.stats: dict[str, float] = {}
        self._warned = False

    def _only_model(self) -> str:
        try:
            served = self.endpoint.models()
        except Exception as exc:  # noqa: BLE001 - any failure is reported the same way
            raise ConfigError(f"distill.teacher {self.endpoint.base_url}: GET /models failed ({exc}); is the "
                              "teacher served there? Name its model with distill.teacher_model") from None
        if len(served) != 1:
            raise ConfigError(f"distill.teacher {self.endpoint.base_url} serves {served}: name one with "
                              "distill.teacher_model")
        return served[0]

    def messages(self, sample: dict, answer: str) -> list[dict]:
        system = self.policy.processor.system_prompt
        parts = [{"type": "image_url", "image_url": {"url": png_url(im)}} for im in sample.get("images") or []]
        parts.append({"type": "text", "text": self.template.format(**sample)})
        return [*([{"role": "system", "content": system}] if system else []), {"role": "user", "content": parts},
                {"role": "assistant", "content": answer}]

    def score(self, sample: dict, prompt_ids: list[int], answer_ids: list[int], ended: bool
              ) -> tuple[list[float] | None, str | None]:
        """The teacher's log-probs of `answer_ids` after the student's `prompt_ids`, or None (module docstring),
        and why not."""
        tokenizer = self.policy.processor.tokenizer
        text = tokenizer.decode(answer_ids[:-1] if ended else answer_ids, skip_special_tokens=False)
        payload = {"model": self.model, "messages": self.messages(sample, text), "max_tokens": 1,
                   "temperature": 0, "prompt_logprobs": 0, "add_generation_prompt": False,
                   "continue_final_message": not ended}
        try:
            entries = self.endpoint.post(payload).prompt_logprobs
        except Exception as exc:  # noqa: BLE001 - a failed request leaves this answer unscored, counted
            return None, f"the request failed: {exc}"
        if not entries:
            return None, "the reply has no prompt_logprobs (a server that does not score prompts)"
        expected = prompt_ids + answer_ids
        try:
            ids = [int(next(iter(e))) for e in entries[1:len(expected)]]
            if ids != expected[1:]:
                return None, "the teacher read other ids than the student (another spelling, tokenizer or template)"
            return [float(entries[len(prompt_ids) + j][str(t)]["logprob"]) for j, t in enumerate(answer_ids)], None
        except (KeyError, TypeError, ValueError, StopIteration, IndexError):
            return None, "the reply's prompt_logprobs are not vLLM's {id: {logprob, ...}} entries"

    def logprobs(self, prompts, prompt_index: Tensor, completion_ids: Tensor, completion_mask: Tensor,
                 temperature: float, *, samples: list[dict], student: Tensor, **_chunks) -> Tensor:
        """Per-token teacher log-probs [N, T]: where an answer is unscored, the student's (no distillation term)."""
        from vlmrl.models.batch import ConversationBatch

        if isinstance(prompts, ConversationBatch):
            raise ConfigError("distill.teacher as a URL scores single-turn answers; an agent's trajectories need a "
                              "local teacher (a checkpoint folder)")
        eos = set(self.policy.eos_token_ids)
        rows = []
        for n, p in enumerate(prompt_index.tolist()):
            prompt = prompts.input_ids[p][prompts.attention_mask[p].bool()].tolist()
            answer = completion_ids[n][completion_mask[n].bool()].tolist()
            rows.append((samples[p], prompt, answer, bool(answer) and answer[-1] in eos))
        results = list(self._pool.map(lambda r: self.score(*r), rows))
        scored = [values for values, _ in results]
        out = student.detach().clone()
        for n, values in enumerate(scored):
            if values is not None:
                cols = completion_mask[n].bool().nonzero().squeeze(1)
                out[n, cols] = torch.tensor(values, dtype=out.dtype, device=out.device)
        unscored = sum(v is None for v in scored)
        self.stats = {"distill/unscored": unscored / max(1, len(scored))}
        if unscored and not self._warned:  # once per run; distill/unscored shows every step
            self._warned = True
            why = next(error for _, error in results if error)
            log.warning("distill.teacher %s: %d of %d answers got no teacher score this step (the first: %s); "
                        "they carry no distillation term (distill/unscored)", self.endpoint.base_url, unscored,
                        len(scored), why)
        return out
