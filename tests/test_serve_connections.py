"""Slow and many clients against uvicorn as `vlmrl serve` runs it (vlmrl.serve.connections): raw sockets that send
headers or bodies slowly, or nothing, and a real SIGTERM to a server process while a client holds a body."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel

from vlmrl.serve.connections import fit_open_files, server_config
from vlmrl.serve.gate import MemoryBudget, RequestGate
from vlmrl.serve.guard import ServeLimits, install_errors

LIMITS = ServeLimits(header_timeout=0.5, body_timeout=0.5, max_connections=8)


class Echo(BaseModel):
    text: str
    delay: float = 0.0


def echo_app(limits: ServeLimits) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.sleep(0.2)  # shutting down takes a moment, as the chat app's does (its batcher stops)

    app = FastAPI(lifespan=lifespan)
    app.state.limits = limits
    install_errors(app)
    app.add_middleware(RequestGate, budget=MemoryBudget(limits.max_queue_bytes), max_bytes=limits.max_body_bytes,
                       body_timeout=limits.body_timeout)

    @app.post("/echo")
    async def echo(body: Echo):
        await asyncio.sleep(body.delay)
        return {"text": body.text}

    return app


@contextlib.contextmanager
def serving(limits: ServeLimits = LIMITS):
    server = uvicorn.Server(server_config(echo_app(limits), "127.0.0.1", 0, limits, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield server.servers[0].sockets[0].getsockname()[1], server
    finally:
        server.should_exit = True
        thread.join(30)


def request(text: str = "hi", delay: float = 0.0) -> bytes:
    body = json.dumps({"text": text, "delay": delay}).encode()
    return (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: " +
            str(len(body)).encode() + b"\r\n\r\n" + body)


def closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """(whether the server closed `sock` within `seconds`, what it sent before)."""
    sock.settimeout(seconds)
    got = b""
    try:
        while chunk := sock.recv(4096):
            got += chunk
    except TimeoutError:
        return False, got
    except ConnectionResetError:
        pass
    return True, got


def ask(port: int, text: str = "hi") -> tuple[int, dict]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request(text))
        head, _, body = b"", b"", b""
        while b"\r\n\r\n" not in head:
            head += sock.recv(4096)
        head, _, body = head.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(
            b"content-length")))
        while len(body) < length:
            body += sock.recv(4096)
        return int(head.split()[1]), json.loads(body)


def test_headers_sent_slowly_are_cut_at_the_header_deadline():
    with serving() as (port, server):
        drip = socket.create_connection(("127.0.0.1", port))
        started = time.monotonic()
        drip.sendall(b"POST /echo HTTP/1.1\r\n")
        for _ in range(3):  # a header line now and then, never the blank line that ends them
            time.sleep(0.2)
            with contextlib.suppress(OSError):
                drip.sendall(b"X-Drip: 1\r\n")
        closed, _ = closed_within(drip, 3)
        assert closed and time.monotonic() - started < 1.5
        silent = socket.create_connection(("127.0.0.1", port))  # connects and never sends a byte
        assert closed_within(silent, 3)[0]
        assert server.config.http.cut["slow_headers"] == 2
        assert ask(port) == (200, {"text": "hi"})


def test_the_next_request_on_a_kept_alive_connection_has_the_deadline_too():
    with serving() as (port, _):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(request())
        time.sleep(0.1)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        sock.sendall(b"POST /echo HTTP/1.1\r\n")  # the second request's first byte stops the keep-alive timer
        started = time.monotonic()
        closed, _ = closed_within(sock, 3)
        assert closed and time.monotonic() - started < 1.5


def test_a_request_that_runs_past_the_header_deadline_is_not_cut():
    """The deadline is for headers only: pipelined requests that each take longer than it are all answered."""
    with serving() as (port, _):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(request("one", delay=0.8) + request("two", delay=0.8))
        sock.settimeout(5)
        got = b""
        while got.count(b"HTTP/1.1 200") < 2 or not got.endswith(b"}"):
            chunk = sock.recv(4096)
            assert chunk, f"the connection was closed after {got!r}"
            got += chunk
        assert b'"one"' in got and b'"two"' in got


def test_a_body_sent_slowly_is_a_408_at_the_body_deadline():
    with serving() as (port, _):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n"
                     b"\r\n{\"text\": ")
        started = time.monotonic()
        closed, got = closed_within(sock, 3)
        assert got.startswith(b"HTTP/1.1 408") and b"--body-timeout" in got
        assert closed and time.monotonic() - started < 1.5


def test_past_the_connection_cap_a_connection_gets_a_503_at_once():
    with serving() as (port, server):
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(8)]
        time.sleep(0.1)
        extra = socket.create_connection(("127.0.0.1", port))
        closed, got = closed_within(extra, 1)
        assert closed and got.startswith(b"HTTP/1.1 503") and b"--max-connections" in got
        assert server.config.http.cut["over_cap"] == 1
        idle.pop().close()
        time.sleep(0.1)
        assert ask(port) == (200, {"text": "hi"})
        for sock in idle:
            sock.close()


def test_a_request_is_answered_while_many_slow_clients_hold_connections():
    limits = ServeLimits(header_timeout=5, body_timeout=5, max_connections=256)
    with serving(limits) as (port, _):
        slow = []
        for i in range(200):
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(b"POST /echo HTTP/1.1\r\n" if i % 2 else request()[:-3])  # half in headers, half in body
            slow.append(sock)
        started = time.monotonic()
        assert ask(port, "still here") == (200, {"text": "still here"})
        assert time.monotonic() - started < 2
        for sock in slow:
            sock.close()


def test_the_open_files_limit_is_raised_to_fit_the_cap():
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        fits = fit_open_files(1024)
        now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if hard == resource.RLIM_INFINITY or hard >= 1024 + 128:
            assert fits == 1024 and now == 1024 + 128
        else:
            assert fits == hard - 128 and now == hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


SERVER = textwrap.dedent("""
    import sys
    from tests.test_serve_connections import echo_app
    from vlmrl.serve.connections import run
    from vlmrl.serve.guard import ServeLimits
    limits = ServeLimits(shutdown_timeout=2.0, body_timeout=300.0, header_timeout=300.0)
    run(echo_app(limits), "127.0.0.1", int(sys.argv[1]), limits)
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("holding", ["body", "headers"])
def test_sigterm_finishes_within_its_deadline_while_a_client_holds_a_request(holding):
    port = free_port()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], cwd=root, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            try:
                holder = socket.create_connection(("127.0.0.1", port))
                break
            except ConnectionRefusedError:
                time.sleep(0.1)
        holder.sendall(request()[:-3] if holding == "body" else b"POST /echo HTTP/1.1\r\n")
        time.sleep(0.3)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=10)
        took = time.monotonic() - started
        assert proc.returncode in (0, -signal.SIGTERM), out  # uvicorn re-raises the signal once it has stopped
        assert took < 2.0 + 3.0, f"SIGTERM took {took:.1f} s with a {holding} held"
        assert "Traceback" not in out, out
        holder.close()
    finally:
        if proc.poll() is None:
            proc.kill()
