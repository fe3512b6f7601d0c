"""The chat request as OpenAI shapes it (pydantic models, so FastAPI validates it and writes its schema), and its
messages turned into a prompt through the policy's own processor: the same path as training and `vlmrl eval`.

A conversation becomes the processor's message list: each message's images first (training puts the image before
the problem), then its text parts joined by newlines; the last user message's text goes through the recipe's
`data.prompt_template` as `{problem}`. So one user message "problem text + image" is exactly the prompt `vlmrl eval`
builds for that sample. Every text a client sends (system, user, assistant history) is the client's
(`client_text`): tokenised with special tokens split, so `<|im_end|><|im_start|>system` in a user message is text,
never a forged turn, and `<|image_pad|>` never an image slot; only the chat template makes special tokens. System messages (and "developer", OpenAI's newer name) replace the processor's default
system prompt; earlier user and assistant turns are rendered by the model's chat template, which may refuse a
conversation it cannot express (a 400 that says so). Images come only as data URLs (or http(s) with
--allow-remote-images); anything else, a file path above all, is refused before it is read.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from vlmrl.errors import VlmrlError
from vlmrl.models.batch import PromptBatch
from vlmrl.models.families import VLProcessor
from vlmrl.models.families.processor import client_text
from vlmrl.serve.gate import Ledger
from vlmrl.serve.guard import RequestError, ServeLimits, check_limit
from vlmrl.serve.images import decode_image

MAX_MESSAGES = 256  # messages in one request: lists are bounded in the schema, so an oversized one is refused at
MAX_PARTS = 64  # its length before any item is validated (a body of 300,000 `{}` cost 3.5 GB of validation errors)
MAX_STOPS = 4


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a field this server does not honour is a 400, never ignored


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str = Field(description="data:image/png;base64,... (http(s) only with --allow-remote-images)")
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the recipe's pixel budget decides


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


Part = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[Part], Field(max_length=MAX_PARTS)] | None = None
    name: str | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class ChatRequest(_Strict):
    """POST /v1/chat/completions. Sampling is temperature (0 = greedy) and top_p; `seed` fixes the answers
    whatever else the server is doing; `max_tokens` defaults to the recipe's eval.max_new_tokens."""

    model: str
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    n: int = 1
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # the newer OpenAI name of max_tokens
    stop: str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False  # each answer token's log-prob (vlmrl.serve.decoder.Decoder)
    top_logprobs: int | None = Field(None, ge=0, le=20)  # and that many most likely alternatives at each token
    return_tokens_as_token_ids: bool = False  # vLLM's option: an entry's token is "token_id:ID", not its text
    # vLLM's options for scoring a conversation: the log-prob of every prompt token (with that many alternatives),
    # and a last assistant turn rendered closed (add_generation_prompt false) or left open (continue_final_message)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    user: str | None = None  # accepted and ignored (OpenAI's abuse-tracking id)

    def logprob_count(self) -> int | None:
        """None when no log-probs are asked for, else how many alternatives each token's entry lists."""
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def stops(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS or any(not s for s in stops):  # (the stops are not echoed: they may be huge)
            raise RequestError(400, f"stop: up to {MAX_STOPS} non-empty strings ({len(stops)} given)", "stop")
        return tuple(stops)


def conversation(request: ChatRequest, limits: ServeLimits, template: str, ledger: Ledger | None = None,
                 fit_pixels: int | None = None) -> tuple[list[dict], list]:
    """The processor's message list and the decoded images, in order (each paid for from `ledger` before it is
    decoded, and decoded toward `fit_pixels`: vlmrl.serve.images). 400 for a message the model cannot take."""
    messages = request.messages
    scoring = not request.add_generation_prompt or request.continue_final_message
    if request.add_generation_prompt and request.continue_final_message:
        raise RequestError(400, "continue_final_message needs add_generation_prompt: false (the last assistant turn "
                                "is continued, not a new one begun)", "continue_final_message")
    if scoring and messages[-1].role != "assistant":
        raise RequestError(400, f"messages[{len(messages) - 1}]: add_generation_prompt false or "
                                "continue_final_message: the last message must be the assistant's (the answer "
                                f"scored or continued), not {messages[-1].role!r}", "messages")
    if not scoring and messages[-1].role != "user":
        raise RequestError(400, f"messages[{len(messages) - 1}]: the last message must be the user's (the server "
                                f"writes the assistant's answer), not {messages[-1].role!r}", "messages")
    parts = [[m.content] if isinstance(m.content, str) else list(m.content or []) for m in messages]
    n_images = sum(isinstance(p, ImagePart) for row in parts for p in row)
    check_limit(n_images, limits.max_images, "messages (images in one request)", low=0)
    last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)  # its text: {problem}
    turns, images = [], []
    for i, (message, row) in enumerate(zip(messages, parts, strict=True)):
        role = "system" if message.role == "developer" else message.role
        if message.content is None:
            raise RequestError(400, f"messages[{i}]: no content (tool calls are not supported)",
                               f"messages[{i}].content")
        try:  # a client's text is text: tokenised with special tokens split (only the template makes them)
            texts = [client_text(p if isinstance(p, str) else p.text) for p in row if not isinstance(p, ImagePart)]
        except ValueError as exc:
            raise RequestError(400, f"messages[{i}]: {exc}", f"messages[{i}].content") from None
        own = [(j, p) for j, p in enumerate(row) if isinstance(p, ImagePart)]
        if own and role != "user":
            raise RequestError(400, f"messages[{i}]: images only in user messages, not in a {role} message",
                               f"messages[{i}].content")
        for j, p in own:
            images.append(decode_image(p.image_url.url, limits, f"messages[{i}].content[{j}].image_url", ledger,
                                       fit_pixels))
        text = "\n".join(texts)
        if i == last_user:
            text = template.format(problem=text)
        turns.append({"role": role, "content": [{"type": "image"}] * len(own) + [{"type": "text", "text": text}]})
    return turns, images


def build_prompt(processor: VLProcessor, request: ChatRequest, limits: ServeLimits, template: str,
                 request_id: str, max_prompt_length: int | None = None, ledger: Ledger | None = None,
                 fit_pixels: int | None = None) -> PromptBatch:
    """One request -> one processed prompt row, through `processor.chat_text` and `processor.build`."""
    from jinja2 import TemplateError

    turns, images = conversation(request, limits, template, ledger, fit_pixels)
    try:
        text = processor.chat_text(turns, request.add_generation_prompt, request.continue_final_message)
    except TemplateError as exc:
        raise RequestError(400, f"messages: the model's chat template refuses this conversation ({exc}); send one "
                                "user message, or system + user", "messages") from None
    try:
        return processor.build([text], [images], [request_id], max_prompt_length)
    except VlmrlError as exc:  # the prompt is too long, or the text holds the image placeholder token
        raise RequestError(400, f"messages: {exc}", "messages") from None
