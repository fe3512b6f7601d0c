"""`vlmrl serve STUDENT --index INDEX` over HTTP (uvicorn on 127.0.0.1, an ephemeral port, in a thread): embeddings
equal to the student's own encoders (the official openai client for texts), search that finds a caption's image
first with a trained student (and not with the same student untrained), images served by table id only, the API
key, body and request limits, and the search page in a headless Chromium."""

from __future__ import annotations

import base64
import copy
import http.client
import io
import re
import shutil
import socket
import subprocess
import threading
import time

import httpx
import numpy as np
import pytest
import torch

from vlmrl.errors import ConfigError
from vlmrl.reclip.embedded import EmbeddedConfig, EmbeddedStudent
from vlmrl.reclip.losses import info_nce
from vlmrl.reclip.scenes import make_scenes
from vlmrl.serve.embed import EmbedModel, embed_app, load_embed_model
from vlmrl.serve.guard import ServeLimits
from vlmrl.serve.index import SearchIndex, build_index, student_fingerprint

N = 24  # indexed scenes, all with distinct captions
LIMITS = ServeLimits(max_batch=4, max_inputs=12, max_images=3, max_top_k=30, max_body_bytes=2**20)
KEY = "sekret-key"
SECRET = "TOP-SECRET-CONTENT"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--hide-scrollbars"]


class Server:
    """An app on uvicorn, 127.0.0.1, a free port, in a daemon thread; `http` is a client of it (one client for
    all requests: each new httpx client loads its TLS certificates, a quarter second on a busy machine)."""

    def __init__(self, app):
        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=1))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def __enter__(self) -> Server:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        self.http = httpx.Client(base_url=self.url, timeout=60)
        return self

    def __exit__(self, *exc):
        self.http.close()
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png(image)).decode()


def top1_fraction(student, pixels, texts) -> float:
    with torch.no_grad():
        sim = student.embed_texts(texts) @ student.embed_images(pixels).T
    return sim.argmax(1).eq(torch.arange(sim.shape[0])).float().mean().item()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A trained student (the embedded towers, frozen; 60 InfoNCE steps on its two heads) saved and reloaded as
    `vlmrl serve` loads it, an image folder of its N training scenes (half in a subfolder), and their index."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("serve")
    items = make_scenes(N, "train", 0)
    assert len({it.caption for it in items}) == N
    student = EmbeddedStudent.build(EmbeddedConfig(embed_dim=32, image_trainable_blocks=0, text_trainable_layers=0))
    pixels, texts = student.image_inputs([it.image for it in items]), student.text_inputs([it.caption for it in items])
    untrained = top1_fraction(student, pixels, texts)
    optimizer = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.0)
    for _ in range(60):
        loss = info_nce(student.embed_images(pixels) @ student.embed_texts(texts).T, student.logit_scale.exp())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    folder = student.save_pretrained(root / "student")
    image_dir = root / "images"
    paths = []
    for i, it in enumerate(items):
        rel = f"{'more/' if i % 2 else ''}scene-{i:02d}.png"
        (image_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (image_dir / rel).write_bytes(png(it.image))
        paths.append(rel)
    (root / "secret.txt").write_text(SECRET)
    summary = build_index(image_dir, student, root / "index")  # the in-memory student; served by the reloaded one
    assert summary["size"] == N and summary["added"] == N
    model = load_embed_model(folder)
    index = SearchIndex.load(root / "index")
    return {"root": root, "items": items, "paths": paths, "model": model, "index": index, "untrained": untrained,
            "image_dir": image_dir}


@pytest.fixture(scope="module")
def server(world):
    with Server(embed_app(world["model"], world["index"], LIMITS)) as s:
        yield s


@pytest.fixture(scope="module")
def keyed(world):
    with Server(embed_app(world["model"], world["index"], LIMITS, api_key=KEY)) as s:
        yield s


def post(server: Server, path: str, **kwargs) -> httpx.Response:
    return server.http.post(path, **kwargs)


def test_embeddings_are_what_the_students_own_encoders_return(world, server):
    from openai import OpenAI

    student, name = world["model"].student, world["model"].name
    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    texts = [it.caption for it in world["items"][:10]]
    calls = server.server.config.app.state.encoder.calls
    reply = client.embeddings.create(model=name, input=texts)  # the client asks for base64 and decodes it
    got = np.array([d.embedding for d in reply.data])
    assert got.shape == (10, 32)
    assert np.allclose(got, student.encode_text(texts).numpy(), atol=1e-6)
    assert server.server.config.app.state.encoder.calls - calls == 3  # 10 texts, max_batch 4: 4 + 4 + 2
    one = client.embeddings.create(model=name, input="a red circle", encoding_format="float")
    assert np.allclose(one.data[0].embedding, student.encode_text(["a red circle"])[0].numpy(), atol=1e-6)
    assert one.usage.prompt_tokens == 5  # [CLS] a red circle [SEP]

    images = [it.image for it in world["items"][:3]]
    mixed = post(server, "/v1/embeddings", json={"model": name, "input": [
        {"image": data_url(images[0])}, "a red circle", {"image": data_url(images[1])}]}).json()["data"]
    assert [d["index"] for d in mixed] == [0, 1, 2]
    reference = student.encode_image(images[:2]).numpy()
    assert np.allclose(mixed[0]["embedding"], reference[0], atol=1e-6)
    assert np.allclose(mixed[1]["embedding"], student.encode_text(["a red circle"])[0].numpy(), atol=1e-6)
    assert np.allclose(mixed[2]["embedding"], reference[1], atol=1e-6)

    files = [("files", (f"im{i}.png", png(im), "image/png")) for i, im in enumerate(images)]
    uploaded = post(server, "/v1/embeddings/images", files=files, data={"model": name}).json()["data"]
    assert np.allclose([d["embedding"] for d in uploaded], student.encode_image(images).numpy(), atol=1e-6)


def test_concurrent_requests_share_model_calls(world):
    import asyncio

    limits = ServeLimits(max_batch=8, batch_wait_ms=500)
    texts = [it.caption for it in world["items"][:8]]

    async def together(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await asyncio.gather(*(client.post("/v1/embeddings", json={"model": "student", "input": t})
                                          for t in texts))

    with Server(embed_app(world["model"], None, limits)) as s:
        replies = asyncio.run(together(s.url))
        encoder = s.server.config.app.state.encoder
    assert encoder.calls < 8 and max(encoder.batch_inputs) > 1, encoder.batch_inputs  # 8 requests, fewer calls
    assert sum(encoder.batch_inputs) == 8
    for text, reply in zip(texts, replies, strict=True):  # each still gets its own text's embedding
        own = world["model"].student.encode_text([text])[0].numpy()
        assert np.allclose(reply.json()["data"][0]["embedding"], own, atol=1e-6)


def test_a_caption_finds_its_own_image_first(world, server):
    # the check can fail: the same student before training ranks most captions' images elsewhere
    assert world["untrained"] < 0.5
    for it, rel in zip(world["items"], world["paths"], strict=True):
        results = post(server, "/v1/search", json={"text": it.caption, "top_k": 5}).json()["results"]
        assert len(results) == 5 and results[0]["path"] == rel, (it.caption, results[:2])
        assert results[0]["score"] >= results[1]["score"] and results[0]["url"] == f"/v1/images/{results[0]['id']}"
    query = world["items"][7]
    results = post(server, "/v1/search", json={"image": data_url(query.image), "top_k": 30}).json()["results"]
    assert len(results) == N  # top_k over the index size gives all of it
    assert results[0]["path"] == world["paths"][7] and results[0]["score"] == pytest.approx(1.0, abs=1e-4)
    info = server.http.get("/v1/info").json()
    assert info["dimension"] == 32 and info["index"] == {"size": N, "kind": "flat", "name": "index"}
    assert info["model"] == "student" and info["student_kind"] == "embedded"


def test_images_are_served_by_table_id_only(world, server, tmp_path):
    table = world["index"].table
    r = server.http.get(f"/v1/images/{table[3]['id']}")
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"
    assert r.content == (world["image_dir"] / table[3]["path"]).read_bytes()
    attempts = ["../secret.txt", "..%2Fsecret.txt", "%2e%2e/secret.txt", "%2e%2e%2fsecret.txt", "%2e%2e",
                "..%2F..%2Fsecret.txt", "0/../../secret.txt", "/etc/passwd", "%2Fetc%2Fpasswd", str(world["root"] /
                "secret.txt"), "-1", "99999999999999999999", str(N), "1e3", "0x1", "+1", "%201", "%D9%A3",
                "scene-00.png", "more/scene-01.png", "1%00", "1;rm"]
    for attempt in attempts:
        conn = http.client.HTTPConnection("127.0.0.1", int(server.url.rsplit(":", 1)[1]), timeout=30)
        conn.request("GET", "/v1/images/" + attempt)  # sent as written: no client-side normalisation
        reply = conn.getresponse()
        body = reply.read().decode(errors="replace")
        conn.close()
        assert reply.status in (400, 404), (attempt, reply.status)
        assert SECRET not in body and "root:" not in body
    # a file of the table that turns into a link out of the image folder after the build is not served
    images = tmp_path / "few"
    images.mkdir()
    for rel in world["paths"][:2]:
        shutil.copy(world["image_dir"] / rel, images / rel.replace("/", "-"))
    build_index(images, world["model"].student, tmp_path / "few.index")
    (images / "scene-00.png").unlink()
    (images / "scene-00.png").symlink_to(world["root"] / "secret.txt")
    with Server(embed_app(world["model"], SearchIndex.load(tmp_path / "few.index"), LIMITS)) as few:
        names = [row["path"] for row in SearchIndex.load(tmp_path / "few.index").table]
        linked = few.http.get(f"/v1/images/{names.index('scene-00.png')}")
        assert linked.status_code == 404 and SECRET not in linked.text
        assert few.http.get(f"/v1/images/{names.index('more-scene-01.png')}").status_code == 200


def test_an_index_is_served_only_by_the_student_that_built_it(world):
    other = copy.deepcopy(world["model"].student)
    with torch.no_grad():
        other.text_head.weight.mul_(-1.0)  # a different text tower, same dimension
    refused = EmbedModel(other, "other", student_fingerprint(other, "other-student"))
    with pytest.raises(ConfigError, match="embeds the fixed probe text differently"):
        embed_app(refused, world["index"], LIMITS)
    other.text_head = torch.nn.Linear(384, 16)
    other.image_head[-1] = torch.nn.Linear(other.image_head[-1].in_features, 16)
    smaller = EmbedModel(other, "other", student_fingerprint(other, "other-student"))
    with pytest.raises(ConfigError, match="it embeds in 32 dimensions and other-student in 16"):
        embed_app(smaller, world["index"], LIMITS)


def test_api_key_body_limit_and_request_checks(world, server, keyed):
    from openai import AuthenticationError, OpenAI

    name, image = world["model"].name, world["items"][0].image
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=keyed.url + "/v1", api_key="wrong").embeddings.create(model=name, input="x")
    good = {"Authorization": f"Bearer {KEY}"}
    for method, path, body in [("POST", "/v1/embeddings", {"model": name, "input": "x"}),
                               ("POST", "/v1/search", {"text": "x"}), ("GET", "/v1/info", None),
                               ("GET", "/v1/images/0", None), ("GET", "/v1/models", None)]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = keyed.http.request(method, path, json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, headers)
        assert keyed.http.request(method, path, json=body, headers=good).status_code == 200, path
    assert keyed.http.get("/").status_code == 200 and keyed.http.get("/healthz").status_code == 200

    big = "data:image/png;base64," + base64.b64encode(np.random.default_rng(0).bytes(1_200_000)).decode()
    r = post(server, "/v1/embeddings", json={"model": name, "input": [{"image": big}]})
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    r = post(server, "/v1/embeddings/images", files=[("files", ("big.png", b"\0" * 1_100_000, "image/png"))])
    assert r.status_code == 413

    bad = [({"model": name, "input": ["x"] * 13}, "input (items per request)=13"),
           ({"model": name, "input": [{"image": data_url(image)}] * 4}, "4 images in one request"),
           ({"model": name, "input": []}, "non-empty list"),
           ({"model": name, "input": [[1, 2, 3]]}, "token ids are not accepted"),
           ({"model": name, "input": [{"image": "data:text/plain;base64,aGVsbG8="}]}, "is not an image"),
           ({"model": name, "input": [{"image": "data:image/png;base64,@@@"}]}, "base64 does not decode"),
           ({"model": name, "input": [{"image": "data:image/png;base64,aGVsbG8="}]}, "not a readable image"),
           ({"model": name, "input": [{"image": "/etc/passwd"}]}, "file paths are never read"),
           ({"model": name, "input": "x", "dimensions": 7}, "embeds in 32 dimensions"),
           ({"model": name, "inputs": "x"}, "input")]
    for body, message in bad:
        r = post(server, "/v1/embeddings", json=body)
        assert r.status_code == 400 and message in r.json()["error"]["message"], (body, r.text)
    assert post(server, "/v1/embeddings", json={"model": "gpt-4", "input": "x"}).status_code == 404
    for body, message in [({"text": "x", "top_k": 0}, "top_k=0"), ({"text": "x", "top_k": 31}, "top_k=31"),
                          ({"text": "x", "image": data_url(image)}, "exactly one"), ({"top_k": 3}, "exactly one"),
                          ({"image": "data:image/png;base64,aGVsbG8="}, "image: not a readable image")]:
        r = post(server, "/v1/search", json=body)
        assert r.status_code == 400 and message in r.json()["error"]["message"], (body, r.text)
    with Server(embed_app(world["model"], None, LIMITS)) as bare:
        r = post(bare, "/v1/search", json={"text": "x"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "no_index"
        assert post(bare, "/v1/embeddings", json={"model": name, "input": "x"}).status_code == 200


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(_chromium() is None, reason="chromium is not installed (.ci/run installs Debian's chromium)")
def test_search_page_in_a_headless_browser(world, server, keyed, tmp_path):
    """The page from the running server runs `?q=` and shows the top-k with every image decoded; the caption's
    image is first. With a key, the page asks for it. A screenshot is taken (benchmarks/serve_search_load.py
    --screenshot writes docs/search_page.png the same way)."""
    base = [_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"]
    query = world["items"][5].caption
    url = f"{server.url}/?q={query.replace(' ', '+')}&k=6"
    dom = subprocess.run([*base, "--virtual-time-budget=20000", "--dump-dom", url], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    body = re.search(r"<body[^>]*>", dom).group(0)
    assert 'data-state="results"' in body and 'data-results="6"' in body, body
    assert 'data-images-loaded="6/6"' in body, body
    assert re.findall(r'<figure class="result" data-id="\d+" data-path="([^"]+)"', dom)[0] == world["paths"][5]
    shot = tmp_path / "shot.png"
    subprocess.run([*base, "--virtual-time-budget=20000", "--window-size=1100,800", f"--screenshot={shot}", url],
                   capture_output=True, timeout=120, check=True)
    from PIL import Image

    image = Image.open(shot).convert("L")
    assert image.size == (1100, 800) and image.getextrema()[0] < 100  # not a blank page
    locked = subprocess.run([*base, "--virtual-time-budget=10000", "--dump-dom", f"{keyed.url}/?q=red"],
                            capture_output=True, text=True, timeout=120, check=True).stdout
    assert 'data-state="needs-key"' in re.search(r"<body[^>]*>", locked).group(0)
    assert re.search(r'<div id="key-form"(?! hidden)[^>]*>', locked) and 'data-results="0"' in locked
    csp = server.http.get("/").headers["content-security-policy"]
    assert csp.startswith("default-src 'self'")
