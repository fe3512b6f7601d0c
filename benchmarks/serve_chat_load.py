"""`vlmrl serve` under load: chat requests/s and p50/p99 latency at concurrency 1, 8 and 32, with dynamic batching
(--max-batch 32) against one request at a time (--max-batch 1), side by side in one run.

    python benchmarks/serve_chat_load.py [--requests 40 160 320] [--max-seconds 60] [--max-tokens 12]

Builds the quickstart's embedded model (default TinyModelConfig, untrained) in a temporary folder, starts
`vlmrl serve` on it twice, as subprocesses on 127.0.0.1 (one server per mode; the levels alternate between them so
load from other work on the machine hits both alike), and loads each with benchmarks/load_driver.py: every request is one held-out shapes_count image (a PNG data URL) and its question, sampled
at temperature 1 with its own seed, max_tokens 12 (the quickstart's answer length). The driver stops each level after
its number of requests or --max-seconds. It prints one table per mode, the answers per generate call (from /healthz)
and the speed-up of batching; every request is expected to succeed (the errors column).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from load_driver import measure  # noqa: E402

LEVELS = (1, 8, 32)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: str, max_batch: int, wait_ms: float, threads: int, extra: tuple[str, ...] = (),
                 log: Path | None = None) -> tuple[subprocess.Popen, str]:
    """`vlmrl serve` on 127.0.0.1 and a free port, once /healthz answers; its stderr goes to `log` when given (a
    long run's log must not fill an unread pipe), else to a pipe read when it fails to start."""
    port = free_port()
    stderr = log.open("w") if log is not None else subprocess.PIPE
    proc = subprocess.Popen([sys.executable, "-m", "vlmrl", "serve", model_dir, "--port", str(port),
                             "--model-name", "tiny", "--max-batch", str(max_batch), "--batch-wait-ms", str(wait_ms),
                             "--threads", str(threads), *extra], stdout=subprocess.DEVNULL, stderr=stderr, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            output = log.read_text() if log is not None else proc.stderr.read()
            raise SystemExit(f"vlmrl serve exited with {proc.returncode}:\n{output}")
        try:
            if httpx.get(f"{url}/healthz", trust_env=False, timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.terminate()
    raise SystemExit("vlmrl serve did not answer /healthz within 300 s")


def requests_for(max_tokens: int):
    from vlmrl.data import make_task

    samples = make_task("shapes_count", 64, "test", seed=0)
    bodies = []
    for s in samples:
        buf = io.BytesIO()
        s["images"][0].save(buf, "PNG")
        url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        bodies.append([{"role": "user", "content": [{"type": "text", "text": s["problem"]},
                                                    {"type": "image_url", "image_url": {"url": url}}]}])

    def make(i: int) -> tuple[str, dict]:
        return "/v1/chat/completions", {"model": "tiny", "messages": bodies[i % len(bodies)], "temperature": 1.0,
                                        "seed": i, "max_tokens": max_tokens}

    return make


def run_level(url: str, make, level: int, n: int, max_seconds: float) -> dict:
    before = httpx.get(f"{url}/healthz", trust_env=False).json()["generate_calls"]
    row = measure(url, make, level, n, max_seconds)
    calls = httpx.get(f"{url}/healthz", trust_env=False).json()["generate_calls"] - before
    row["answers_per_call"] = row["ok"] / calls if calls else float("nan")
    return row


def table(rows: list[dict], title: str) -> str:
    lines = [title, f"{'concurrency':>11} {'requests':>8} {'errors':>6} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
                    f"{'answers/call':>12}"]
    for r in rows:
        lines.append(f"{r['concurrency']:>11} {r['requests']:>8} {r['errors']:>6} {r['rps']:>8.1f} "
                     f"{r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} {r['answers_per_call']:>12.1f}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, nargs=3, default=[40, 160, 320],
                   help="requests at concurrency 1, 8 and 32")
    p.add_argument("--max-seconds", type=float, default=60.0, help="time bound of each level")
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--batch-wait-ms", type=float, default=5.0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per server (vlmrl serve --threads); on a shared 2-core machine 2 spin")
    p.add_argument("--out", help="also write the rows as JSON here")
    args = p.parse_args()
    from vlmrl.config import TinyModelConfig
    from vlmrl.data import vocabulary_texts
    from vlmrl.models import build_tiny_vlm

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    make = requests_for(args.max_tokens)
    batched, single, servers = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_vlm(tmp, vocabulary_texts(0), TinyModelConfig(), seed=0)
        try:  # both servers up at once; the levels alternate between them, so load on a shared machine hits both
            for max_batch, wait in ((32, args.batch_wait_ms), (1, 0.0)):
                servers.append(start_server(tmp, max_batch, wait, args.threads))
            for _, url in servers:
                measure(url, make, 4, 8, args.max_seconds)  # warm-up: first calls allocate
            for level, n in zip(LEVELS, args.requests, strict=True):
                for rows, (_, url) in zip((batched, single), servers, strict=True):
                    rows.append(run_level(url, make, level, n, args.max_seconds))
                    print(f"done: concurrency {level}, {rows[-1]['rps']:.1f} req/s", file=sys.stderr)
        finally:
            for proc, _ in servers:
                proc.terminate()
                proc.wait(30)
    print(table(batched, f"dynamic batching (--max-batch 32, --batch-wait-ms {args.batch_wait_ms:g})"))
    print()
    print(table(single, "one request at a time (--max-batch 1)"))
    print()
    for b, s in zip(batched, single, strict=True):
        print(f"concurrency {b['concurrency']:>2}: batching {b['rps'] / s['rps']:.2f}x the requests/s, "
              f"p50 {b['p50_ms']:.0f} vs {s['p50_ms']:.0f} ms")
    errors = sum(r["errors"] for r in batched + single)
    if errors:
        print(f"errors: {errors}; first: {next(r['first_error'] for r in batched + single if r['errors'])}")
    if args.out:
        Path(args.out).write_text(json.dumps({"batched": batched, "single": single}, indent=2))


if __name__ == "__main__":
    main()
