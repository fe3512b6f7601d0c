"""Text embedding and search under load: `vlmrl serve STUDENT --index INDEX` on loopback.

The embedded student with frozen towers and its two heads trained for `--steps` InfoNCE steps on the cached tower
outputs of `--train` built-in scenes (so that search finds something), saved as a student folder; an index of
`--images` held-out scenes built with `build_index` (flat); then the real command, `python -m vlmrl serve STUDENT
--index INDEX --port P`, in its own process on 127.0.0.1, twice: with dynamic batching (`--max-batch 16`: concurrent
requests share model calls) and without (`--max-batch 1`). benchmarks/load_driver.py keeps C requests in flight for
C = 1, 8, 32: POST /v1/embeddings (one caption each) and POST /v1/search (one caption, top_k 10), the two servers
back to back at each C, zero errors required. Also printed: how long the index build took, and how often a held-out
caption finds its own image first.

    python benchmarks/serve_search_load.py [--images 300] [--requests 200] [--screenshot docs/search_page.png]

`--screenshot` writes the search page (headless Chromium, `/?q=--query`) from the same server: docs/search_page.png.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_driver import measure, table  # noqa: E402

from vlmrl.reclip.embedded import EmbeddedConfig, EmbeddedStudent  # noqa: E402
from vlmrl.reclip.losses import info_nce  # noqa: E402
from vlmrl.reclip.scenes import make_scenes  # noqa: E402
from vlmrl.serve.index import SearchIndex, build_index  # noqa: E402

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--hide-scrollbars"]


def train_student(n: int, steps: int, seed: int) -> EmbeddedStudent:
    """Frozen towers; InfoNCE on the two heads over cached tower outputs (the towers run once per scene)."""
    student = EmbeddedStudent.build(EmbeddedConfig(image_trainable_blocks=0, text_trainable_layers=0), seed=seed)
    items = make_scenes(n, "train", seed)
    pixels = torch.cat([student.image_inputs([it.image for it in items[i:i + 64]]) for i in range(0, n, 64)])
    texts = student.text_inputs([it.caption for it in items])
    optimizer = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randperm(n, generator=generator)[:128]
        sim = student.embed_images(pixels[idx]) @ student.embed_texts({k: v[idx] for k, v in texts.items()}).T
        loss = info_nce(sim, student.logit_scale.exp())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return student


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(student: Path, index: Path, port: int, max_batch: int, threads: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "vlmrl", "serve", str(student), "--index", str(index), "--port",
                             str(port), "--max-batch", str(max_batch), "--threads", str(threads)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not answer /healthz within 300 s")


def screenshot(url: str, path: Path, profile: Path) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("--screenshot needs chromium (Debian: apt-get install chromium)")
    subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=20000",
                    "--window-size=1200,860", f"--screenshot={path}", url], capture_output=True, timeout=180, check=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=300, help="held-out scenes in the index")
    p.add_argument("--train", type=int, default=800, help="training scenes for the heads")
    p.add_argument("--steps", type=int, default=300, help="InfoNCE steps on the heads")
    p.add_argument("--requests", type=int, default=200, help="requests per (endpoint, concurrency)")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--max-seconds", type=float, default=120.0, help="time bound per (endpoint, concurrency)")
    p.add_argument("--threads", type=int, default=0, help="the servers' torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--query", default="two red circles to the left of a blue square")
    p.add_argument("--screenshot", type=Path, help="write the search page for --query here (e.g. docs/search_page.png)")
    p.add_argument("--json", type=Path, help="write the numbers here")
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="vlmrl-serve-bench-"))
    try:
        t0 = time.perf_counter()
        student = train_student(args.train, args.steps, args.seed)
        trained_s = time.perf_counter() - t0
        folder = student.save_pretrained(work / "student")
        scenes = make_scenes(args.images, "test", args.seed)
        (work / "images").mkdir()
        for i, it in enumerate(scenes):
            it.image.save(work / "images" / f"scene-{i:04d}.png")
        t0 = time.perf_counter()
        summary = build_index(work / "images", student, work / "index", batch_size=64)
        index_s = time.perf_counter() - t0
        index = SearchIndex.load(work / "index")
        captions = [it.caption for it in scenes]
        with torch.no_grad():
            hits = index.search(student.encode_text(captions).numpy(), 1)
        top1 = sum(h[0]["path"] == f"scene-{i:04d}.png" for i, h in enumerate(hits)) / len(scenes)
        del student

        servers = {b: (start_server(folder, work / "index", port, b, args.threads), f"http://127.0.0.1:{port}")
                   for b in (16, 1) for port in [free_port()]}
        try:
            levels = [int(c) for c in args.concurrency.split(",")]
            results = {}
            for name, make in [
                ("text embedding (POST /v1/embeddings, 1 caption)",
                 lambda i: ("/v1/embeddings", {"model": "student", "input": captions[i % len(captions)]})),
                ("search (POST /v1/search, 1 caption, top_k 10)",
                 lambda i: ("/v1/search", {"text": captions[i % len(captions)], "top_k": 10})),
            ]:
                rows = {b: [] for b in servers}
                for _, url in servers.values():
                    measure(url, make, 1, 10, args.max_seconds)  # warm-up
                for c in levels:  # the two servers back to back at each level: the same load on the machine
                    for b, (_, url) in servers.items():
                        rows[b].append(measure(url, make, c, args.requests, args.max_seconds))
                for b in servers:
                    print(table(rows[b], f"{name}, --max-batch {b}"), flush=True)
                results[name] = {f"max_batch_{b}": r for b, r in rows.items()}
                bad = [r for b in rows for r in rows[b] if r["errors"]]
                if bad:
                    raise SystemExit(f"{name}: errors, first: {bad[0]['first_error']}")
            if args.screenshot:
                query = args.query.replace(" ", "+")
                screenshot(f"{servers[16][1]}/?q={query}&k=12", args.screenshot.resolve(), work / "profile")
                print(f"wrote {args.screenshot}")
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(30)
        info = {"images": summary["size"], "index_build_s": index_s, "index_images_per_s": summary["size"] / index_s,
                "train_heads_s": trained_s, "caption_top1": top1, "server_threads": args.threads or torch.get_num_threads(),
                "cpus": os.cpu_count(), "load": os.getloadavg()[0], "results": results}
        print(f"index: {summary['size']} images in {index_s:.1f} s ({summary['size'] / index_s:.1f} images/s); "
              f"a held-out caption finds its own image first for {100 * top1:.1f}% of them")
        if args.json:
            args.json.write_text(json.dumps(info, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
