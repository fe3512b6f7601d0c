"""A bounded, loopback-only HTTP load generator for the serving benchmarks (benchmarks/serve_*.py).

`measure(url, make_request, concurrency, requests, max_seconds)` keeps `concurrency` requests in flight (asyncio +
httpx) until `requests` have finished or `max_seconds` have passed, and returns requests/s, p50/p99 latency and the
errors. Only 127.0.0.1/localhost/::1 targets are accepted: these scripts never load anything they do not own.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from urllib.parse import urlparse

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation between order statistics (numpy's default)."""
    if not values:
        return float("nan")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


async def _run(url: str, make_request: Callable[[int], tuple[str, dict]], concurrency: int, requests: int,
               max_seconds: float, headers: dict | None) -> dict:
    import httpx

    latencies: list[float] = []
    errors: list[str] = []
    issued = 0
    deadline = time.perf_counter() + max_seconds
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=max_seconds + 30, limits=limits, headers=headers,
                                 trust_env=False) as client:

        async def worker():
            nonlocal issued
            while issued < requests and time.perf_counter() < deadline:
                i = issued
                issued += 1
                path, body = make_request(i)
                t0 = time.perf_counter()
                try:
                    r = await client.post(path, json=body)
                    if r.status_code != 200:
                        errors.append(f"HTTP {r.status_code}: {r.text[:120]}")
                        continue
                except httpx.HTTPError as exc:
                    errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                latencies.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return {"concurrency": concurrency, "requests": len(latencies) + len(errors), "ok": len(latencies),
            "errors": len(errors), "first_error": errors[0] if errors else None, "seconds": wall,
            "rps": len(latencies) / wall if wall > 0 else float("nan"),
            "p50_ms": 1000 * percentile(latencies, 50), "p99_ms": 1000 * percentile(latencies, 99),
            "mean_ms": 1000 * statistics.fmean(latencies) if latencies else float("nan")}


def measure(url: str, make_request: Callable[[int], tuple[str, dict]], concurrency: int, requests: int,
            max_seconds: float = 60.0, headers: dict | None = None) -> dict:
    """Load `url` (loopback only) with `requests` POSTs, `concurrency` at a time, for at most `max_seconds`.
    `make_request(i)` gives the i-th request's (path, JSON body)."""
    host = urlparse(url).hostname
    if host not in LOOPBACK:
        raise SystemExit(f"load_driver: {url} is not loopback; these benchmarks only load servers they start")
    return asyncio.run(_run(url, make_request, concurrency, requests, max_seconds, headers))


def table(rows: list[dict], title: str) -> str:
    lines = [title, f"{'concurrency':>11} {'requests':>8} {'errors':>6} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8}"]
    for r in rows:
        lines.append(f"{r['concurrency']:>11} {r['requests']:>8} {r['errors']:>6} {r['rps']:>8.1f} "
                     f"{r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f}")
    return "\n".join(lines)
