"""A local OpenAI-compatible `/v1/chat/completions` server for tests, on 127.0.0.1 (ephemeral port), in a thread,
with scripted faults.

    with JudgeServer(script=["429", "ok"]) as server:
        client = JudgeClient(server.base_url, "judge-model", cache_dir=None)

Faults: "ok", "429" (with `Retry-After: retry_after`), "500", "slow" (sleeps `slow_seconds` before answering),
"malformed" (a body that is not JSON), "noverdict" (a reply without a verdict tag), "401", "404" (vLLM's reply for
a model it does not serve), "400image" (vLLM's reply when a text-only model is sent an image), "null"
(`content: null`, finish_reason "stop"), "null_length" (`content: null` and the reasoning so far, finish_reason
"length": a reasoning parser cut before `</think>`), "length" (text without a verdict, finish_reason "length"),
"disconnect" (the headers and half the body, then the connection closes). `script` is consumed one fault per
request, in arrival order; then `rules` apply ({substring of the prompt: fault}, every time); else "ok".
The default judge answers [RELEVANT] when the graded answer equals the reference, else [IRRELEVANT]; a `reply`
function may return (content, log-prob entries), sent as `logprobs.content` when the request asks for log-probs.
GET /v1/models lists `served` (the model names). `port=0` takes a free port.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def default_reply(prompt: str) -> str:
    answer = re.search(r"Answer to grade: (.*)", prompt)
    reference = re.search(r"Reference answer: (.*)", prompt)
    same = answer and reference and answer.group(1).strip().lower() == reference.group(1).strip().lower()
    if same:
        return "+ the answer matches the reference\n+ it addresses the question\n[RELEVANT]"
    return "- the answer differs from the reference\n[IRRELEVANT]"


class JudgeServer:
    def __init__(self, script: list[str] | None = None, rules: dict[str, str] | None = None, retry_after: str = "1",
                 slow_seconds: float = 2.0, delay: float = 0.0, reply=default_reply, port: int = 0,
                 served: tuple[str, ...] = ("judge-model",)):
        self.script, self.rules = list(script or []), dict(rules or {})
        self.retry_after, self.slow_seconds, self.delay, self.reply = retry_after, slow_seconds, delay, reply
        self.served = served
        self.requests: list[dict] = []  # every request body received (also the failed ones)
        self.headers: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self._server.daemon_threads = True
        self._server.block_on_close = False
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def prompts(self) -> list[str]:
        return [_prompt(body) for body in self.requests]

    def __enter__(self) -> JudgeServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def _fault(self, prompt: str) -> str:
        with self._lock:
            if self.script:
                return self.script.pop(0)
        return next((fault for key, fault in self.rules.items() if key in prompt), "ok")

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            _counted = False  # a POST counted in server.in_flight that has not answered yet

            def log_message(self, *args) -> None:  # quiet
                pass

            def _send(self, status: int, body: bytes, headers: dict | None = None) -> None:
                self._leave()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    for key, value in (headers or {}).items():
                        self.send_header(key, value)
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout)
                    pass

            def do_GET(self) -> None:
                if self.path != "/v1/models":
                    self._send(404, b'{"detail": "Not Found"}')
                    return
                models = [{"id": name, "object": "model"} for name in server.served]
                self._send(200, json.dumps({"object": "list", "data": models}).encode())

            def _disconnect(self) -> None:  # promise a body, send half of it, close
                self._leave()
                body = json.dumps(completion("model", "[RELEVANT]")).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)

            def do_POST(self) -> None:
                if self.path != "/v1/chat/completions":
                    self._send(404, b'{"detail": "Not Found"}')
                    return
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server._lock:
                    server.requests.append(body)
                    server.headers.append(dict(self.headers))
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                self._counted = True
                try:
                    self._answer(body)
                finally:
                    self._leave()

            def _leave(self) -> None:
                """The request stops counting as in flight before its answer is written: once the client has the
                answer it may send the next request, which can arrive before this thread gets to run again."""
                if self._counted:
                    self._counted = False
                    with server._lock:
                        server.in_flight -= 1

            def _answer(self, body: dict) -> None:
                prompt = _prompt(body)
                fault = server._fault(prompt)
                if server.delay:
                    time.sleep(server.delay)
                if fault == "429":
                    self._send(429, b'{"error": "rate limited"}', {"Retry-After": server.retry_after})
                elif fault == "500":
                    self._send(500, b'{"error": "internal"}')
                elif fault == "401":
                    self._send(401, b'{"error": "invalid api key"}')
                elif fault == "404":
                    self._send(404, _error(f"The model `{body.get('model')}` does not exist.", "NotFoundError", 404))
                elif fault == "400image":
                    self._send(400, _error("Qwen2ForCausalLM is not a multimodal model", "BadRequestError", 400))
                elif fault == "malformed":
                    self._send(200, b'{"choices": [{"message": {"content": "[RELEV')
                elif fault == "disconnect":
                    self._disconnect()
                elif fault == "null":
                    self._send(200, json.dumps(completion(body.get("model"), None)).encode())
                elif fault == "null_length":
                    reply = completion(body.get("model"), None, "length", reasoning="The answer says red, so")
                    self._send(200, json.dumps(reply).encode())
                elif fault == "length":
                    reply = completion(body.get("model"), "+ the answer names a colour\n- but", "length")
                    self._send(200, json.dumps(reply).encode())
                else:
                    if fault == "slow":
                        time.sleep(server.slow_seconds)
                    text = "I cannot decide." if fault == "noverdict" else server.reply(prompt)
                    logprobs = None
                    if isinstance(text, tuple):  # (content, the choice's logprobs.content entries)
                        text, logprobs = text
                    reply = completion(body.get("model"), text)
                    if logprobs is not None and body.get("logprobs"):
                        reply["choices"][0]["logprobs"] = {"content": logprobs}
                    self._send(200, json.dumps(reply).encode())

        return Handler


def completion(model, content: str | None, finish_reason: str = "stop", reasoning: str | None = None) -> dict:
    """A chat.completion body as vLLM sends it (`reasoning_content` beside `content` under a reasoning parser)."""
    message = {"role": "assistant", "content": content, **({"reasoning_content": reasoning} if reasoning else {})}
    return {"id": "x", "object": "chat.completion", "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}]}


def _error(message: str, kind: str, code: int) -> bytes:
    """An error body as vLLM's OpenAI server sends it."""
    return json.dumps({"object": "error", "message": message, "type": kind, "param": None, "code": code}).encode()


def _prompt(body: dict) -> str:
    content = body["messages"][-1]["content"]
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if part.get("type") == "text")
    return content
