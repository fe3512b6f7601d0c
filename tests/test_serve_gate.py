"""What a request may hold in a server (vlmrl.serve.gate) and what its images cost (vlmrl.serve.images): every cost
is bounded before it is paid. Numbers worked by hand; the app-level tests use a FastAPI echo app behind the gate."""

from __future__ import annotations

import base64
import io
import json
import time
import tracemalloc

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from PIL import Image
from pydantic import BaseModel

from vlmrl.serve.gate import JSON_PER_BYTE, MAX_DEPTH, MAX_STRUCTURE, Ledger, MemoryBudget, RequestGate, check_structure
from vlmrl.serve.guard import RequestError, ServeLimits, install_errors
from vlmrl.serve.images import decode_cost, decode_image, reduction

MiB = 2**20


def test_budget_takes_and_gives_back_with_hand_numbers():
    budget = MemoryBudget(100)
    a, b = Ledger(budget), Ledger(budget)
    a.take(60, "a")
    b.take(30, "b")
    assert (budget.used, budget.peak) == (90, 90)
    with pytest.raises(RequestError) as busy:  # 90 + 20 > 100, but b alone would hold 50: the server is busy
        b.take(20, "b")
    assert busy.value.status == 503 and busy.value.retry_after == 1 and budget.refused == 1
    with pytest.raises(RequestError) as never:  # a alone would hold 60 + 41 > 100: it can never be served
        a.take(41, "a")
    assert never.value.status == 400 and "more than this server holds" in never.value.message
    a.give(25)
    assert (a.held, budget.used) == (35, 65)
    a.close()
    b.close()
    assert (budget.used, budget.peak, a.held, b.held) == (0, 90, 0, 0)


def test_json_structure_is_measured_with_strings_emptied():
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "a [{ ] } \\\" quoted"}]}).encode()
    # {"":"","":[{"":"","":""}]} is what is left: 26 bytes
    assert check_structure(body) == len(b'{"":"","":[{"":"","":""}]}')
    big_string = json.dumps({"text": "{[" * 2 * MAX_STRUCTURE}).encode()  # brackets inside a string are text
    assert check_structure(big_string) == len(b'{"":""}')
    with pytest.raises(RequestError, match="JSON structure"):
        check_structure(b'{"messages": [' + b"{}, " * (MAX_STRUCTURE // 3) + b"{}]}")
    deep = b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1)
    with pytest.raises(RequestError, match=f"nested {MAX_DEPTH + 1} deep"):
        check_structure(deep)
    assert check_structure(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH) == 2 * MAX_DEPTH


def test_the_largest_request_the_schema_takes_passes_the_structure_check():
    """256 messages of 64 parts each (the schema's bounds), every part an image: well inside MAX_STRUCTURE."""
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "auto"}}
    body = json.dumps({"model": "m", "n": 1, "temperature": 0.5, "max_tokens": 512,
                       "messages": [{"role": "user", "content": [part] * 64}] * 256}).encode()
    assert check_structure(body) < MAX_STRUCTURE / 2


class Echo(BaseModel):
    items: list[int]


def echo_app(limit: int = 64 * MiB, max_bytes: int = 20 * MiB) -> tuple[FastAPI, MemoryBudget, list]:
    """An app behind the gate that records what its request's ledger held when the handler ran."""
    app, budget, seen = FastAPI(), MemoryBudget(limit), []
    install_errors(app)
    app.add_middleware(RequestGate, budget=budget, max_bytes=max_bytes, body_timeout=60.0)

    @app.post("/echo")
    async def echo(body: Echo, request: Request):
        seen.append(request.state.ledger.held)
        return {"n": len(body.items)}

    return app, budget, seen


def test_the_gate_charges_the_body_twice_and_its_structure_and_gives_all_back():
    app, budget, seen = echo_app()
    body = json.dumps({"items": [1, 2, 3]}).encode()  # structure {"":[1,2,3]} = 12 bytes
    with TestClient(app) as client:
        r = client.post("/echo", content=body, headers={"content-type": "application/json"})
    assert r.json() == {"n": 3}
    assert seen == [2 * len(body) + 12 * JSON_PER_BYTE]
    assert budget.used == 0 and budget.peak == seen[0]


def test_a_body_of_empty_objects_is_refused_before_it_is_parsed():
    """8 MiB of `{}` (2.8 million objects): refused by the structure check, never parsed or validated, so what
    Python allocates is about the body itself, and the error is one short line."""
    app, budget, _ = echo_app()
    body = b'{"items": [' + b"{}," * (8 * MiB // 3) + b"{}]}"
    with TestClient(app) as client:
        tracemalloc.start()
        started = time.monotonic()
        r = client.post("/echo", content=body, headers={"content-type": "application/json"})
        took = time.monotonic() - started
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert r.status_code == 400 and "JSON structure" in r.json()["error"]["message"]
    assert len(r.text) < 500
    assert peak < 6 * len(body), f"{peak / MiB:.0f} MiB allocated for a {len(body) / MiB:.0f} MiB body"
    assert took < 10 and budget.used == 0


def test_a_body_over_the_budget_is_503_while_it_arrives_and_a_body_alone_too_large_is_400():
    app, budget, _ = echo_app(limit=2000)
    with TestClient(app) as client:
        r = client.post("/echo", content=json.dumps({"items": [0] * 300}).encode(),  # 300 values: 60 kB alone
                        headers={"content-type": "application/json"})
        assert r.status_code == 400 and "more than this server holds" in r.json()["error"]["message"]
        other = Ledger(budget)
        other.take(1500, "another request")
        r = client.post("/echo", content=b'{"items": [1]}',  # 2 x 14 + 8 x 100 = 828 alone, and 1,500 are held
                        headers={"content-type": "application/json"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        other.close()
        assert client.post("/echo", json={"items": [1]}).status_code == 200
    assert budget.used == 0


# ---------------------------------------------------------------------------------------------------------- images
def png(size, mode="P") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, 0).save(buf, "PNG", optimize=True)
    return buf.getvalue()


def url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def test_decode_cost_and_reduction_with_hand_numbers():
    assert reduction(6000, 6000, 250_000) == 6  # sqrt(36e6 / 1e6): keeps 1000x1000 = 4x the budget
    assert reduction(1000, 1000, 250_000) == 1 and reduction(6000, 6000, None) == 1
    assert decode_cost(100, 50, "RGB", 1) == (100 * 50 * 4 * 2, 100 * 50 * 4)  # decoded + its RGB copy
    assert decode_cost(100, 50, "P", 1) == (100 * 50 * 1 + 100 * 50 * 4, 100 * 50 * 4)
    # a palette image cannot be reduced as it is: it is converted to RGB at full size first
    assert decode_cost(100, 50, "P", 2) == (100 * 50 * 1 + 100 * 50 * 4 + 50 * 25 * 4, 50 * 25 * 4)
    assert decode_cost(101, 51, "L", 2) == (101 * 51 + 51 * 26 * 4, 51 * 26 * 4)


def test_an_image_is_paid_for_before_it_is_decoded():
    """A 5 KB palette PNG of 6300x6300 decodes to 160 MB: a ledger with less room refuses it from its header
    (nothing decoded), one with room pays the decode and keeps holding only the image it returns."""
    data = png((6300, 6300))
    assert len(data) < 10_000
    small = Ledger(MemoryBudget(100 * MiB))
    started = time.monotonic()
    with pytest.raises(RequestError) as err:
        decode_image(url(data), ServeLimits(), "image", small)
    assert err.value.status == 400 and time.monotonic() - started < 0.5 and small.held == 0
    budget = MemoryBudget(512 * MiB)
    ledger = Ledger(budget)
    image = decode_image(url(data), ServeLimits(), "image", ledger, fit_pixels=250_000)
    assert image.size == (1050, 1050) and image.mode == "RGB"  # reduced by 6, toward the budget
    full, kept = decode_cost(6300, 6300, "P", 6)
    assert ledger.held == kept == 1050 * 1050 * 4 and budget.peak >= full


def test_a_jpeg_decodes_at_a_smaller_scale_toward_the_budget():
    buf = io.BytesIO()
    Image.new("RGB", (4000, 3000), (10, 200, 30)).save(buf, "JPEG")
    budget = MemoryBudget(512 * MiB)
    image = decode_image(url(buf.getvalue(), "image/jpeg"), ServeLimits(), "image", Ledger(budget),
                         fit_pixels=100_000)
    # reduction 5 (sqrt(12e6 / 4e5)): drafted at 1/4, the JPEG scale below it, then no whole reduction is left
    assert image.size == (1000, 750)
    assert budget.peak == decode_cost(1000, 750, "RGB", 1)[0] + len(buf.getvalue())  # the small decode + the bytes
    assert image.getpixel((10, 10)) == pytest.approx((10, 200, 30), abs=3)


def test_an_image_without_a_budget_is_decoded_whole():
    image = decode_image(url(png((300, 200), "RGB")), ServeLimits(), "image", Ledger(MemoryBudget(64 * MiB)))
    assert image.size == (300, 200)


def test_memory_is_handed_back_when_a_burst_is_over(monkeypatch):
    """The budget trims the heap when it empties after holding more than TRIM_AFTER, and not for small requests."""
    from vlmrl.serve import gate

    trims = []
    monkeypatch.setattr(gate, "trim_memory", lambda: trims.append(1))
    budget = MemoryBudget(1024 * MiB)
    small, big = Ledger(budget), Ledger(budget)
    small.take(MiB, "small")
    small.close()
    assert trims == []
    big.take(gate.TRIM_AFTER + 1, "big")
    small.take(MiB, "small")
    big.close()
    assert trims == []  # not while a request still holds memory
    small.close()
    assert trims == [1]
    if gate._LIBC is not None:  # glibc: large buffers become their own mappings (mallopt answers 1)
        assert gate.give_back_memory()
