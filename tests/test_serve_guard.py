"""What makes a vlmrl server safe on a network, without a model: image decoding that names each problem and never
reads a path, remote images only when allowed, the body limit, the API key, OpenAI-shaped errors, the limits."""

from __future__ import annotations

import base64
import http.server
import io
import socket
import threading
import time
import warnings

import pytest
from fastapi import Depends, FastAPI
from fastapi.testclient import TestClient
from PIL import Image
from pydantic import BaseModel

from vlmrl.errors import ConfigError
from vlmrl.serve import images as guard
from vlmrl.serve.gate import MemoryBudget, RequestGate
from vlmrl.serve.guard import (
    RequestError,
    ServeLimits,
    api_key_dependency,
    check_bind,
    check_limit,
    install_errors,
    read_api_key,
)
from vlmrl.serve.images import decode_image


def png(size=(20, 10), mode="RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, (255, 0, 0, 255) if mode == "RGBA" else (255, 0, 0)).save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


DEFAULT = ServeLimits()


def refused(source, limits=DEFAULT, status=400) -> str:
    with pytest.raises(RequestError) as err:
        decode_image(source, limits, "image_url")
    assert err.value.status == status and err.value.param == "image_url"
    return err.value.message


def test_decode_image_takes_data_urls_and_bytes_and_names_each_problem():
    image = decode_image(data_url(png(mode="RGBA")), ServeLimits())
    assert image.mode == "RGB" and image.size == (20, 10) and image.getpixel((0, 0)) == (255, 0, 0)
    assert decode_image(png(), ServeLimits()).size == (20, 10)
    assert "base64,<data>" in refused("data:image/png,abc")  # not base64
    assert "does not decode" in refused("data:image/png;base64,@@@")
    assert "not an image" in refused(data_url(b"hello", "text/plain"))
    assert "not a readable image" in refused(data_url(b"hello"))
    assert "does not decode" in refused(data_url(png()[:50]))  # a truncated PNG
    assert "20x10 pixels is over the server's limit of 100" in refused(data_url(png()), ServeLimits(max_image_pixels=100))
    assert "expected a data URL string" in refused(12)


def _encoded(fmt: str, size=(8, 8)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (200, 30, 30)).save(buf, fmt)
    return buf.getvalue()


EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n0 0 moveto 10 10 lineto stroke\nshowpage\n"


def test_only_the_listed_formats_are_opened_and_only_as_declared(monkeypatch):
    """PostScript sent as image/png would go to PIL's EPS plugin, which runs Ghostscript on the client's bytes; a
    TIFF, PPM or GIF labelled image/png was accepted. Now a data URL's bytes are opened only as the type it declares,
    raw bytes only as one of the listed types, and every failure is a 400."""
    from PIL import EpsImagePlugin

    ran = []
    monkeypatch.setattr(EpsImagePlugin, "Ghostscript", lambda *a, **k: ran.append(a))
    monkeypatch.setattr(EpsImagePlugin, "gs_binary", "gs", raising=False)
    assert "not a readable image" in refused(data_url(EPS))
    assert "not a readable image" in refused(EPS) and not ran
    for fmt in ("TIFF", "PPM", "GIF", "JPEG"):
        assert "read as PNG only" in refused(data_url(_encoded(fmt))), fmt
    assert decode_image(data_url(_encoded("GIF"), "image/gif"), DEFAULT).size == (8, 8)
    assert decode_image(data_url(_encoded("JPEG"), "image/jpeg"), DEFAULT).size == (8, 8)
    assert decode_image(_encoded("WEBP"), DEFAULT).size == (8, 8)  # raw bytes: any listed format


def test_an_image_the_processor_cannot_resize_is_a_400():
    """Qwen-VL's resize raises past an aspect ratio of 200 (a 500 with a traceback before)."""
    assert "aspect ratio over 200" in refused(data_url(png((1, 201))))
    assert decode_image(data_url(png((1, 200))), DEFAULT).size == (1, 200)


def test_a_decompression_bomb_is_refused_before_it_is_decoded():
    big = png((2000, 2000))  # 4 Mpx of one colour: a few kB of PNG
    assert len(big) < 100_000
    assert "over the server's limit" in refused(data_url(big), ServeLimits(max_image_pixels=1_000_000))


def test_paths_are_never_read(tmp_path):
    real = tmp_path / "real.png"  # a readable image: a decoder that followed paths would return it
    real.write_bytes(png())
    for source in (str(real), f"file://{real}", "../../etc/passwd", "/etc/passwd", "file:///etc/passwd", "~/x.png",
                   "real.png"):
        assert "file paths are never read" in refused(source)
        assert "file paths are never read" in refused(source, ServeLimits(allow_remote_images=True))


@pytest.fixture
def image_host():
    """A loopback HTTP server: /ok.png is an image, anything else 404."""
    body = png()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path in ("/ok.png", "/text.png"):
                data = body if self.path == "/ok.png" else b"not an image"
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            else:
                self.send_error(404)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_remote_images_only_when_allowed(image_host):
    assert "remote image URLs are off" in refused(f"{image_host}/ok.png")
    allowed = ServeLimits(allow_remote_images=True, allow_private_image_hosts=True)  # the test host is loopback
    assert decode_image(f"{image_host}/ok.png", allowed).size == (20, 10)


def test_every_remote_failure_gets_one_answer_at_the_deadline(image_host):
    """Whatever the target does (a private address, a 404, no listener, too many bytes, not an image, a drip), the
    client gets the same 400 text at the same time, the fetch deadline: nothing tells what is there."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens on it: connection refused
    loopback = dict(allow_remote_images=True, allow_private_image_hosts=True, image_fetch_timeout=0.6)
    cases = {"private": (f"{image_host}/ok.png", ServeLimits(allow_remote_images=True, image_fetch_timeout=0.6)),
             "404": (f"{image_host}/missing.png", ServeLimits(**loopback)),
             "refused": (f"http://127.0.0.1:{port}/x.png", ServeLimits(**loopback)),
             "too big": (f"{image_host}/ok.png", ServeLimits(**loopback, max_body_bytes=50)),
             "not an image": (f"{image_host}/text.png", ServeLimits(**loopback))}
    answers = {}
    for kind, (url, limits) in cases.items():
        started = time.monotonic()
        with pytest.raises(RequestError) as err:
            decode_image(url, limits, "image_url")
        answers[kind] = (err.value.status, err.value.message.replace("of at most 50 bytes", "of at most 20971520 "
                                                                     "bytes"), time.monotonic() - started)
    assert {(status, text) for status, text, _ in answers.values()} == {(400, answers["404"][1])}, answers
    assert "could not fetch the image" in answers["404"][1] and "404" not in answers["404"][1]
    assert all(0.55 < took < 1.0 for _, _, took in answers.values()), answers


REMOTE = ServeLimits(allow_remote_images=True, image_fetch_timeout=0.05)


@pytest.mark.parametrize("addresses", [["127.0.0.1"], ["10.1.2.3"], ["169.254.169.254"], ["192.168.1.1"],
                                       ["172.16.0.1"], ["100.64.0.1"], ["0.0.0.0"], ["224.0.0.1"], ["240.0.0.1"],
                                       ["::1"], ["fe80::1"], ["fd00::1"], ["::ffff:10.0.0.1"], ["2002:a00:1::"],
                                       ["93.184.216.34", "10.0.0.1"]])  # one private address among public ones
def test_a_remote_image_on_a_private_address_is_refused_without_contacting_it(monkeypatch, addresses):
    """The host is resolved first (here: a resolver that answers `addresses`) and no connection is ever made."""
    asked = []
    monkeypatch.setattr(guard, "resolve", lambda host, port: asked.append((host, port)) or addresses)

    def never(*args, **kwargs):
        raise AssertionError(f"the server connected to {args[0]}")

    monkeypatch.setattr(socket, "create_connection", never)
    for url in ("http://images.example/cat.png", "https://images.example:8443/cat.png?x=1"):
        message = refused(url, REMOTE)
        assert "could not fetch the image" in message and not any(a in message for a in addresses)
    assert asked == [("images.example", 80), ("images.example", 8443)]


def test_a_public_host_is_fetched_from_the_address_that_was_checked(monkeypatch):
    """The connection goes to the checked address (a second lookup could answer a private one: DNS rebinding),
    and a failure says nothing of what happened there."""
    monkeypatch.setattr(guard, "resolve", lambda host, port: ["93.184.216.34"])
    tried = []

    def refuse_connection(address, timeout=None, *args):
        tried.append((address, timeout))
        raise ConnectionRefusedError("connection refused (planted)")

    monkeypatch.setattr(socket, "create_connection", refuse_connection)
    message = refused("http://images.example:8080/cat.png", ServeLimits(allow_remote_images=True,
                                                                       image_fetch_timeout=3.0))
    assert tried == [(("93.184.216.34", 8080), 3.0)]
    assert "could not fetch the image" in message and "refused" not in message and "8080" not in message
    assert "port is not a number" in refused("http://images.example:99999/x.png", REMOTE)
    assert "no host" in refused("http:///x.png", REMOTE)


@pytest.fixture
def slow_drip():
    """A loopback host that answers 200 and then drips its body (and, on /headers, its headers) one byte every
    0.25 s, for 4 s at most: a per-read timeout never fires."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                request = conn.recv(4096)
                head = b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: 16\r\n\r\n"
                drip = head + b"x" * 16 if b"/headers" in request else b"x" * 16
                if b"/headers" not in request:
                    conn.sendall(head)
                for byte in drip:
                    if stop.wait(0.25):
                        break
                    try:
                        conn.sendall(bytes([byte]))
                    except OSError:
                        break

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    listener.close()
    thread.join(10)


@pytest.mark.parametrize("path", ["/body.png", "/headers.png"])
def test_a_slow_drip_host_hits_the_overall_deadline(slow_drip, path):
    limits = ServeLimits(allow_remote_images=True, allow_private_image_hosts=True, image_fetch_timeout=1.0)
    started = time.monotonic()
    message = refused(slow_drip + path, limits)
    took = time.monotonic() - started
    assert "could not fetch the image" in message and "within 1 s" in message
    assert 0.9 < took < 2.0, f"the fetch took {took:.2f} s against a deadline of 1 s"


# ---------------------------------------------------------------------------------------------------------- HTTP
class Echo(BaseModel):
    text: str
    count: int = 1


def app_with(key: str | None = None, max_bytes: int = 1000) -> TestClient:
    app = FastAPI()
    install_errors(app)
    app.add_middleware(RequestGate, budget=MemoryBudget(2**30), max_bytes=max_bytes, body_timeout=60.0)

    @app.post("/v1/echo", dependencies=[Depends(api_key_dependency(key))])
    async def echo(body: Echo):
        check_limit(body.count, 3, "count")
        return {"text": body.text}

    return TestClient(app)


def test_body_limit_is_413_by_length_and_while_streaming():
    client = app_with(max_bytes=100)
    assert client.post("/v1/echo", json={"text": "x" * 50}).status_code == 200
    r = client.post("/v1/echo", json={"text": "x" * 200})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"

    def chunks():  # no Content-Length: chunked transfer, cut off once past the limit
        yield b'{"text": "'
        for _ in range(20):
            yield b"x" * 10
        yield b'"}'

    r = client.post("/v1/echo", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "limit of 100 bytes" in r.json()["error"]["message"]


def test_api_key_needs_a_bearer_header_with_the_key():
    client = app_with(key="s3cret")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"},
                    {"Authorization": "Bearer s3cre"}):
        r = client.post("/v1/echo", json={"text": "a"}, headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", headers
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert client.post("/v1/echo", json={"text": "a"}, headers={"Authorization": "bearer s3cret"}).status_code == 200
    assert app_with(key=None).post("/v1/echo", json={"text": "a"}).status_code == 200


def test_errors_have_openais_shape():
    client = app_with()
    r = client.post("/v1/echo", json={"count": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text" and "text: Field required" in \
        r.json()["error"]["message"]
    r = client.post("/v1/echo", json={"text": "a", "count": 4})
    assert r.status_code == 400 and r.json()["error"] == {
        "message": "count=4: expected an integer from 1 to 3 (the server's limit)", "type": "invalid_request_error",
        "param": "count", "code": None}
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_read_api_key_and_check_bind(monkeypatch):
    assert read_api_key(None) is None
    monkeypatch.delenv("VLMRL_TEST_KEY", raising=False)
    with pytest.raises(ConfigError, match="VLMRL_TEST_KEY: the environment variable is not set"):
        read_api_key("VLMRL_TEST_KEY")
    monkeypatch.setenv("VLMRL_TEST_KEY", "k")
    assert read_api_key("VLMRL_TEST_KEY") == "k"
    with pytest.warns(UserWarning, match="without an API key"):
        check_bind("0.0.0.0", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_bind("0.0.0.0", "k")
        check_bind("127.0.0.1", None)


def test_limits_are_checked():
    with pytest.raises(ConfigError, match="max_batch=0"):
        ServeLimits(max_batch=0)
    with pytest.raises(ConfigError, match="batch_wait_ms=-1"):
        ServeLimits(batch_wait_ms=-1)
    for bad in (True, 0, 4, 2.0, "2"):
        with pytest.raises(RequestError, match="expected an integer from 1 to 3"):
            check_limit(bad, 3, "n")
    check_limit(3, 3, "n")
    check_limit(0, 3, "images", low=0)


def test_serve_without_the_serve_extra_is_one_line(monkeypatch, capsys, tmp_path):
    """No fastapi/uvicorn installed: `vlmrl serve` says which extra to install, exit 2, no traceback."""
    import importlib.util

    from vlmrl.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    assert main(["serve", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: vlmrl serve needs uvicorn: pip install 'vlmrl[serve]'"]
