"""What scoring with a served reward model costs against scoring in the trainer's own process, side by side.

An outcome RM from the quickstart's start (`vlmrl rm train data.pairs.task=shapes_count`, --rm-steps steps), then a
quickstart-sized rollout batch (16 prompts x G=8 = 128 answers, each prompt's image shared by its 8 answers)
scored --reps times by the `reward_model` reward (with new image objects each time, as a new step's are): with the RM
folder (in this process), and with the URL of the same RM served by the real command (`python -m vlmrl serve RM --threads T`, its own process on loopback), with
`concurrency` 1 and 4. Each arm alternates with the others rep by rep. Printed: seconds per batch (median), the
ratio to in-process, the request body per batch, and the largest score difference from the in-process scores.

On one CPU shared by both processes the server cannot be faster: what this measures is the price of the HTTP hop
(PNG and JSON encoding, the request, parsing, images decoded again). What it buys is on another machine: the RM on a
device of its own, the trainer's device free of it.

    python benchmarks/served_rm.py [--reps 10] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from vlmrl.data import make_task
from vlmrl.rewards import RewardSpec, compute_rewards

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(rm: Path, threads: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "vlmrl", "serve", str(rm), "--port", str(port), "--threads",
                             str(threads), "--model-name", "rm"], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/healthz", trust_env=False).status_code == 200:
                return proc, f"{url}/v1"
        except httpx.HTTPError:
            time.sleep(0.3)
        if proc.poll() is not None:
            sys.exit(f"vlmrl serve exited: {proc.stderr.read()[-2000:]}")
    proc.kill()
    sys.exit("vlmrl serve did not start within 120 s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="torch threads, here and in the server")
    p.add_argument("--rm-steps", type=int, default=20)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "rm"
        done = subprocess.run([sys.executable, "-m", "vlmrl", "rm", "train", "data.pairs.task=shapes_count",
                               "data.pairs.n=200", f"trainer.steps={args.rm_steps}", f"trainer.output_dir={run}",
                               f"trainer.threads={args.threads}"], cwd=ROOT, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"vlmrl rm train failed: {done.stderr[-2000:]}")
        samples = make_task("shapes_count", args.prompts, "test", seed=0)
        columns = {k: [s[k] for s in samples for _ in range(args.group)] for k in ("id", "problem", "solution",
                                                                                  "images")}
        answers = [f"<answer>{(i * 7) % 9}</answer>" for i in range(len(columns["id"]))]
        proc, url = start_server(run, args.threads)
        try:
            from vlmrl.rewards.served_rm import served_reward_model

            client = served_reward_model(url)
            sent: list[int] = []
            post = client.endpoint._http.post
            client.endpoint._http.post = lambda u, **kw: sent.append(len(json.dumps(kw["json"]))) or post(u, **kw)
            arms = {"in the trainer's process": {"path": str(run)},
                    "served, concurrency 1": {"path": url, "concurrency": 1},
                    "served, concurrency 4": {"path": url, "concurrency": 4}}
            times = {name: [] for name in arms}
            scores, body = {}, {}
            for rep in range(args.reps + 1):  # rep 0 warms every arm up (model load, first connection)
                for name, kwargs in arms.items():
                    sent.clear()
                    # new image objects, as a new step's prompts are: no arm is served from the processor's
                    # per-image cache of the rep before (the server decodes new objects every request anyway)
                    fresh = {}
                    step = {**columns, "images": [fresh.setdefault(id(ims), [im.copy() for im in ims])
                                                  for ims in columns["images"]]}
                    t0 = time.perf_counter()
                    out = compute_rewards([RewardSpec("reward_model", kwargs=kwargs)], answers, step)
                    if rep:
                        times[name].append(time.perf_counter() - t0)
                    assert out.failures["reward_model"] == 0, out.errors
                    scores[name], body[name] = out.components["reward_model"], sum(sent)
        finally:
            proc.terminate()
            proc.wait(30)
    base = statistics.median(times["in the trainer's process"])
    reference = scores["in the trainer's process"]
    print(f"{args.prompts} prompts x {args.group} answers, {args.reps} reps, {args.threads} thread(s) each side, "
          f"{os.cpu_count()} CPUs\n")
    print("| scoring | s per batch (median) | / in-process | request bodies per batch | max abs score difference |")
    print("|---|---|---|---|---|")
    for name in arms:
        t = statistics.median(times[name])
        diff = max(abs(a - b) for a, b in zip(scores[name], reference, strict=True))
        print(f"| {name} | {t:.3f} | {t / base:.2f}x | {body[name] / 1024:.0f} KiB | {diff:.1e} |")


if __name__ == "__main__":
    main()
