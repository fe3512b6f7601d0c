"""Peak resident memory and seconds of loading a user dataset (JSONL + PNG files), side by side for code versions.

    git worktree add /tmp/vlmrl_data_before ac92422      # the code before lazy images
    python benchmarks/data_memory.py --code before=/tmp/vlmrl_data_before --code after=. --rows 20000

Writes `--rows` Visual-RFT rows `{"image": "img/i.png", "problem": ..., "solution": ...}` and as many PNG files
(`--side` px squares, a few shapes each, ~1 KB on disk, side*side*3 bytes decoded) to a temporary folder. Then for
each code version (a checkout of vlmrl, put first on PYTHONPATH), in a fresh process each, it runs

    load:        build_dataset({"path": FILE}, "train", 0)                   the whole file
    load n=N:    build_dataset({"path": FILE, "n": N}, "train", 0)           a file spec's n (--n)
    load + use:  the whole file, then every sample's images read once        (what one epoch touches)

Peak RSS is the process's own (`os.wait4`), minus its RSS after importing vlmrl.data ("data MB": what the dataset
costs). Versions alternate run by run, so machine noise hits them alike.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, sys, time
from vlmrl.data import build_dataset
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
path, n, use = sys.argv[1], (None if sys.argv[2] == "-" else int(sys.argv[2])), sys.argv[3] == "use"
base = rss()
start = time.perf_counter()
samples, report = build_dataset({"path": path, **({"n": n} if n is not None else {})}, "train", 0)
load_s = time.perf_counter() - start
pixels = 0
if use:
    for sample in samples:
        for image in sample["images"]:
            pixels += image.width * image.height
print(json.dumps({"base_mb": base, "load_s": load_s, "total_s": time.perf_counter() - start, "samples": len(samples),
                  "pixels": pixels}))
"""


def build(folder: Path, rows: int, side: int, seed: int = 0) -> Path:
    """`rows` JSONL rows and PNG files under `folder`; the PNGs cycle through 256 distinct drawings."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    blobs = []
    for _ in range(256):
        image = Image.new("RGB", (side, side), tuple(rng.randrange(256) for _ in range(3)))
        draw = ImageDraw.Draw(image)
        for _ in range(3):
            x, y, r = rng.randrange(side), rng.randrange(side), rng.randrange(4, side // 3)
            draw.ellipse((x - r, y - r, x + r, y + r), fill=tuple(rng.randrange(256) for _ in range(3)))
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        blobs.append(buffer.getvalue())
    (folder / "img").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(rows):
        (folder / "img" / f"{i}.png").write_bytes(blobs[i % len(blobs)])
        lines.append(json.dumps({"image": f"img/{i}.png", "problem": "How many circles are there?", "solution": "3"}))
    path = folder / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_load(code: Path, data: Path, n: int | None, use: bool) -> dict:
    """One load in a fresh process on `code`: its peak RSS (MB), its RSS after the import, seconds."""
    env = {**os.environ, "PYTHONPATH": str(code)}
    cmd = [sys.executable, "-c", CHILD, str(data), "-" if n is None else str(n), "use" if use else "load"]
    with tempfile.TemporaryFile() as errors:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=errors, cwd=code)
        out = proc.stdout.read().decode()
        _, status, usage = os.wait4(proc.pid, 0)
        errors.seek(0)
        err = errors.read().decode(errors="replace").strip()
    if os.waitstatus_to_exitcode(status) != 0:
        return {"ok": False, "error": err.splitlines()[-1] if err else f"exit status {status}"}
    result = json.loads(out.strip().splitlines()[-1])
    result["peak_mb"] = usage.ru_maxrss / 1024
    return {"ok": True, **result, "data_mb": result["peak_mb"] - result["base_mb"]}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--code", action="append", required=True, help="NAME=DIR of a vlmrl checkout (repeatable)")
    p.add_argument("--rows", type=int, default=20_000)
    p.add_argument("--side", type=int, default=112, help="image side in pixels")
    p.add_argument("--n", type=int, default=1000, help="the file spec's n of the 'load n=N' run")
    p.add_argument("--repeats", type=int, default=1, help="runs of each (code, case); the table shows the median")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args(argv)
    codes = [(c.split("=", 1)[0], Path(c.split("=", 1)[1]).resolve()) for c in a.code]
    with tempfile.TemporaryDirectory(prefix="data_memory_") as work:
        start = time.perf_counter()
        data = build(Path(work), a.rows, a.side)
        print(f"wrote {a.rows} rows + PNGs ({a.side} px) in {time.perf_counter() - start:.1f} s", flush=True)
        cases = [("load", None, False), (f"load n={a.n}", a.n, False), ("load + use", None, True)]
        results = []
        for case, n, use in cases:
            for _ in range(a.repeats):
                for name, code in codes:
                    r = run_load(code, data, n, use)
                    results.append({"code": name, "case": case, **r})
                    print(json.dumps(results[-1]), flush=True)
    print(f"\n{a.rows:,} rows, one {a.side}x{a.side} PNG each ({a.side * a.side * 3 / 1024:.0f} KB decoded), "
          f"median of {a.repeats}")
    print(f"{'case':14s} {'code':10s} {'samples':>8s} {'seconds':>8s} {'peak RSS MB':>12s} {'data MB':>8s}")
    for case, _, _ in cases:
        for name, _ in codes:
            runs = [r for r in results if r["code"] == name and r["case"] == case and r["ok"]]
            if not runs:
                print(f"{case:14s} {name:10s} {'failed':>8s}")
                continue
            median = {key: sorted(r[key] for r in runs)[len(runs) // 2] for key in ("total_s", "peak_mb", "data_mb")}
            print(f"{case:14s} {name:10s} {runs[0]['samples']:8d} {median['total_s']:8.2f} {median['peak_mb']:12.0f} "
                  f"{median['data_mb']:8.0f}")
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
