"""`vlmrl serve` under hostile clients (issue 43): a running server takes a bounded mix of valid requests and abuse,
refuses what it must, never fails with a 5xx other than 503, keeps its memory bounded, and still answers correctly.

    python benchmarks/serve_hostile_load.py [--requests 2000] [--concurrency 16] [--max-seconds 300] [--out F.json]
    python benchmarks/serve_hostile_load.py --smoke    # seconds: the smallest mode tests/test_benchmarks.py runs

Builds the quickstart's embedded model (default TinyModelConfig, untrained; --model DIR serves a folder instead),
starts `vlmrl serve` on it as a subprocess on 127.0.0.1 (with a small --max-queue, so the 503 path is loaded too) and
sends `--requests` requests, `--concurrency` at a time, for at most `--max-seconds`; only loopback is ever loaded.
Each request is one of these kinds, drawn with a fixed seed (weights in KINDS), and has the statuses it may get:

  valid, valid_stream    a shapes_count image and its question, sampled, non-streamed and streamed: 200 (or 503)
  long_text              1 MB of text: 400, refused before it is tokenised
  long_prompt            ~3,000 words, under the character bound but over max_prompt_length tokens: 400
  oversized_image        a 6500x6500 PNG (42 M pixels, 70 kB compressed; over the 40 M pixel limit): 400
  oversized_body         a body over --max-upload-mb, with Content-Length and chunked (no length) in turn: 413
  corrupt_image          a truncated PNG, or base64 that does not decode: 400
  bad_json               a body cut mid-JSON: 400
  wrong_keys             `mesages` for `messages`, or a string for the message list: 400
  disconnect_body        sends half its body and closes the connection
  disconnect_wait        sends a whole request (max_tokens 48) and closes before the answer
  disconnect_stream      a streamed request that closes after its first event

Every kind is first sent once alone, on an idle server, where it must get its own status (never 503); then the mix
(where 503 is also allowed for every kind the handler reaches before the queue is checked). It reports, per kind,
the outcome alone, the requests sent and the statuses received; the 5xx other than 503 (goal 0) and any status a
kind may not get; the server's peak RSS (the kernel's VmHWM) against its RSS after warm-up and the bound
--max-rss-mb; and whether the server, after the load, answers a greedy request exactly as it did before it. Exit
status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlparse

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from load_driver import LOOPBACK  # noqa: E402
from serve_chat_load import start_server  # noqa: E402

MODEL = "tiny"  # the --model-name the server is started with
KINDS = {"valid": 6, "valid_stream": 2, "long_text": 1, "long_prompt": 1, "oversized_image": 1, "oversized_body": 1,
         "corrupt_image": 1, "bad_json": 1, "wrong_keys": 1, "disconnect_body": 1, "disconnect_wait": 1,
         "disconnect_stream": 1}
ALLOWED = {"valid": {200, 503}, "valid_stream": {200, 503}, "long_text": {400, 503}, "long_prompt": {400, 503},
           "oversized_image": {400, 503}, "oversized_body": {413}, "corrupt_image": {400, 503}, "bad_json": {400},
           "wrong_keys": {400}, "disconnect_body": {"closed"}, "disconnect_wait": {"closed", 503},
           "disconnect_stream": {"closed", 503}}


def png_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def message(text: str, url: str | None = None) -> list[dict]:
    content = [{"type": "text", "text": text}]
    if url is not None:
        content.append({"type": "image_url", "image_url": {"url": url}})
    return [{"role": "user", "content": content}]


class Payloads:
    """The bodies of every kind, made once (the large ones are shared by every request of their kind)."""

    def __init__(self, max_body_bytes: int):
        from PIL import Image

        from vlmrl.data import make_task

        samples = make_task("shapes_count", 32, "test", seed=0)
        self.valid = [message(s["problem"], png_url(s["images"][0])) for s in samples]
        self.long_text = message("many words " * 100_000)  # 1.1 MB
        self.long_prompt = message(" ".join(f"circle{i % 7} red" for i in range(1_500)))
        big = png_url(Image.new("L", (6500, 6500), 128))
        self.oversized_image = message("how many?", big)
        png = base64.b64decode(self.valid[0][0]["content"][1]["image_url"]["url"].split(",", 1)[1])
        self.corrupt = [message("how many?", "data:image/png;base64," + base64.b64encode(png[:len(png) // 2]).decode()),
                        message("how many?", "data:image/png;base64,!!not*base64!!")]
        self.oversized_body = json.dumps({"model": MODEL, "messages": message("x" * (max_body_bytes + 1024))}).encode()

    def body(self, i: int, **extra) -> dict:
        return {"model": MODEL, "messages": self.valid[i % len(self.valid)], "temperature": 1.0, "seed": i,
                "max_tokens": 12, **extra}


async def raw_post(host: str, port: int, body: bytes, send: int, then: str, wait: float) -> str:
    """POST /v1/chat/completions over a bare socket, sending only `send` bytes of `body`; then close at once
    (`then`="close"), after `wait` seconds ("wait"), or after the first streamed event ("event")."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:send])
        await writer.drain()
        if then == "wait":
            await asyncio.sleep(wait)
        elif then == "event":
            status = (await asyncio.wait_for(reader.readline(), 60)).split()
            if len(status) > 1 and status[1] != b"200":
                return int(status[1])
            while not (await asyncio.wait_for(reader.readline(), 60)).startswith(b"data:"):
                pass
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:  # the server may have closed first
            pass
    return "closed"


async def send_one(client: httpx.AsyncClient, host: str, port: int, p: Payloads, kind: str, i: int):
    """One request of `kind`: its status code, or "closed" for a client that left on purpose."""
    post = "/v1/chat/completions"
    if kind == "valid":
        return (await client.post(post, json=p.body(i))).status_code
    if kind == "valid_stream":
        async with client.stream("POST", post, json=p.body(i, stream=True)) as r:
            async for _ in r.aiter_bytes():
                pass
            return r.status_code
    if kind in ("long_text", "long_prompt", "oversized_image"):
        return (await client.post(post, json={"model": MODEL, "messages": getattr(p, kind)})).status_code
    if kind == "corrupt_image":
        return (await client.post(post, json={"model": MODEL, "messages": p.corrupt[i % 2]})).status_code
    if kind == "oversized_body":
        if i % 2:
            async def chunks():
                for k in range(0, len(p.oversized_body), 1 << 20):
                    yield p.oversized_body[k:k + (1 << 20)]
            content = chunks()
        else:
            content = p.oversized_body
        try:
            return (await client.post(post, content=content, headers={"Content-Type": "application/json"})).status_code
        except (httpx.WriteError, httpx.RemoteProtocolError):  # the 413 came, and the socket closed, mid-upload
            return 413
    if kind == "bad_json":
        body = json.dumps(p.body(i))[:200].encode()
        return (await client.post(post, content=body, headers={"Content-Type": "application/json"})).status_code
    if kind == "wrong_keys":
        body = {"model": MODEL, "mesages": p.valid[0]} if i % 2 else {"model": MODEL, "messages": "how many?"}
        return (await client.post(post, json=body)).status_code
    body = json.dumps(p.body(i, max_tokens=48, stream=kind == "disconnect_stream")).encode()
    if kind == "disconnect_body":
        return await raw_post(host, port, body, len(body) // 2, "close", 0)
    if kind == "disconnect_wait":
        return await raw_post(host, port, body, len(body), "wait", 0.05 + 0.3 * (i % 4) / 3)
    return await raw_post(host, port, body, len(body), "event", 0)


async def idle(client: httpx.AsyncClient, seconds: float = 30) -> None:
    """Until /healthz says no request waits (a connection the server dropped after an error is retried)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if not (await client.get("/healthz")).json()["waiting"]:
                return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.02)


async def hostile(url: str, p: Payloads, requests: int, concurrency: int, max_seconds: float,
                  seed: int) -> tuple[dict, dict]:
    """First every kind once, alone on an idle server (so each reaches the check that must refuse it, whatever the
    queue does under load), then the mix. Per kind: the outcome alone, and a Counter of the mix's outcomes (status
    codes, "closed", or an exception's name)."""
    host, port = urlparse(url).hostname, urlparse(url).port
    if host not in LOOPBACK:
        raise SystemExit(f"serve_hostile_load: {url} is not loopback; this benchmark only loads a server it starts")
    rng = random.Random(seed)
    kinds = rng.choices(list(KINDS), weights=list(KINDS.values()), k=requests)
    outcomes: dict[str, Counter] = {k: Counter() for k in KINDS}
    alone: dict[str, object] = {}
    issued, deadline = 0, time.monotonic() + max_seconds
    async with httpx.AsyncClient(base_url=url, timeout=120, trust_env=False,
                                 limits=httpx.Limits(max_connections=concurrency)) as client:
        async def attempt(kind: str, i: int):
            try:
                return await send_one(client, host, port, p, kind, i)
            except (httpx.HTTPError, OSError, asyncio.TimeoutError) as exc:
                return type(exc).__name__

        for i, kind in enumerate(KINDS):
            alone[kind] = await attempt(kind, i)
            await idle(client)  # a client that left: its job ends first

        async def worker():
            nonlocal issued
            while issued < requests and time.monotonic() < deadline:
                i, kind = issued, kinds[issued]
                issued += 1
                outcomes[kind][await attempt(kind, i)] += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return alone, outcomes


class RssWatch:
    """The server's resident memory (/proc/PID/status), sampled every 0.1 s, and the kernel's high-water mark."""

    def __init__(self, pid: int):
        self.pid, self.samples, self._stop = pid, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def read(self, field: str) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB -> MiB
        return float("nan")

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            try:
                self.samples.append(self.read("VmRSS"))
            except OSError:
                return

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.read("VmHWM")


def greedy_answer(url: str, p: Payloads) -> tuple[int, str]:
    r = httpx.post(f"{url}/v1/chat/completions", json=p.body(0, temperature=0, max_tokens=12), trust_env=False,
                   timeout=120)
    return r.status_code, r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.text[:200]


def report(alone: dict, outcomes: dict[str, Counter], rss: dict, before: tuple, after: tuple, health: dict,
           wall: float, max_rss_mb: float, tracebacks: int) -> tuple[str, bool]:
    lines = [f"{'kind':<18} {'alone':>6} {'sent':>5}  outcomes in the mix"]
    unexpected = 0
    wrong_alone = [kind for kind, got in alone.items() if got not in ALLOWED[kind] - {503}]
    server_errors = sum(isinstance(got, int) and got >= 500 and got != 503 for got in alone.values())
    for kind, c in outcomes.items():
        lines.append(f"{kind:<18} {alone[kind]!s:>6} {sum(c.values()):>5}  "
                     + ", ".join(f"{k}: {n}" for k, n in sorted(c.items(), key=str)))
        unexpected += sum(n for k, n in c.items() if k not in ALLOWED[kind])
        server_errors += sum(n for k, n in c.items() if isinstance(k, int) and k >= 500 and k != 503)
    total = Counter()
    for c in outcomes.values():
        total.update(c)
    refused = {kind: sum(n for k, n in c.items() if isinstance(k, int) and 400 <= k < 600) for kind, c in
               outcomes.items()}
    same = before[0] == after[0] == 200 and before[1] == after[1]
    lines += ["", f"sent {sum(total.values())} in the mix ({len(alone)} alone before it), {wall:.1f} s: answered (200) {total[200]}, refused "
                  f"{sum(refused.values())} (400: {total[400]}, 413: {total[413]}, 503 queue full: {total[503]}), "
                  f"client left on purpose {total['closed']}",
              f"5xx other than 503: {server_errors} (goal 0); outcomes a kind may not get: {unexpected}, alone: "
              f"{', '.join(wrong_alone) or 'none'}; server tracebacks logged: {tracebacks}",
              f"server RSS: {rss['warm']:.0f} MiB after warm-up, peak {rss['peak']:.0f} MiB (VmHWM; bound "
              f"{max_rss_mb:.0f}), {rss['end']:.0f} MiB at the end",
              f"after the load: /healthz waiting {health['waiting']}, answers cancelled {health['answers_cancelled']},"
              f" refused busy {health['refused_busy']}; greedy answer {after[1]!r} "
              + ("== before" if same else f"!= before ({before[1]!r})")]
    ok = server_errors == 0 and unexpected == 0 and not wrong_alone and tracebacks == 0 and same \
        and rss["peak"] <= max_rss_mb and health["waiting"] == 0
    lines.append("all checks pass" if ok else "A CHECK FAILED")
    return "\n".join(lines), ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a model folder to serve (default: build the quickstart's tiny model)")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-seconds", type=float, default=300.0, help="time bound of the load")
    p.add_argument("--max-queue", type=int, default=8, help="the server's --max-queue (small: 503s are loaded too)")
    p.add_argument("--max-upload-mb", type=float, default=20.0, help="the server's --max-upload-mb")
    p.add_argument("--max-rss-mb", type=float, default=2048.0, help="the bound on the server's peak RSS")
    p.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true",
                   help="the smallest mode: 60 requests, 6 at a time, --max-queue 1, 2 MB bodies")
    p.add_argument("--out", help="also write the outcomes and memory as JSON here")
    args = p.parse_args(argv)
    if args.smoke:
        args.requests, args.concurrency, args.max_seconds, args.max_queue, args.max_upload_mb = 60, 6, 60.0, 1, 2.0
    payloads = Payloads(int(args.max_upload_mb * 2**20))
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from vlmrl.config import TinyModelConfig
            from vlmrl.data import vocabulary_texts
            from vlmrl.models import build_tiny_vlm

            model = str(build_tiny_vlm(Path(tmp) / "tiny", vocabulary_texts(0), TinyModelConfig(), seed=0))
        log = Path(tmp) / "serve.log"
        proc, url = start_server(model, 8, 5.0, args.threads, ("--max-queue", str(args.max_queue),
                                                               "--max-upload-mb", str(args.max_upload_mb)), log)
        try:
            before = greedy_answer(url, payloads)  # also the warm-up: the first call allocates
            watch = RssWatch(proc.pid)
            warm = watch.read("VmRSS")
            t0 = time.monotonic()
            alone, outcomes = asyncio.run(hostile(url, payloads, args.requests, args.concurrency,
                                                  args.max_seconds, args.seed))
            wall = time.monotonic() - t0
            deadline = time.monotonic() + 30  # cancelled answers leave the queue at their next token
            while (health := httpx.get(f"{url}/healthz", trust_env=False).json())["waiting"] and \
                    time.monotonic() < deadline:
                time.sleep(0.1)
            after = greedy_answer(url, payloads)
            rss = {"warm": warm, "peak": watch.stop(), "end": watch.read("VmRSS")}
        finally:
            proc.terminate()
            proc.wait(30)
        tracebacks = log.read_text().count("Traceback")
    text, ok = report(alone, outcomes, rss, before, after, health, wall, args.max_rss_mb, tracebacks)
    print(text)
    if args.out:
        Path(args.out).write_text(json.dumps({"alone": alone, "outcomes": {k: {str(s): n for s, n in c.items()} for k, c in
                                                           outcomes.items()}, "rss_mib": rss, "health": health,
                                              "before": before, "after": after, "seconds": wall, "ok": ok,
                                              "args": vars(args)}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
