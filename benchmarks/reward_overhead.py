"""Per-step cost of the score stage on a quickstart-sized rollout batch (16 prompts x G=8 = 128 completions):
built-in rewards in the trainer's process (the default) vs the same rewards forced into a worker process
(isolate=True: the batch's columns are pickled to the worker and the values back), and a user reward file.

    python benchmarks/reward_overhead.py [--reps 50]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from vlmrl.data import build_dataset
from vlmrl.rewards import RewardSpec, compute_rewards
from vlmrl.rollout.batch import reward_columns

USER = "def score(completions, solution, **_):\n    return [float(c.endswith(s)) for c, s in zip(completions, solution)]\n"


def batch(prompts: int = 16, group: int = 8) -> tuple[list[str], dict]:
    samples, _ = build_dataset({"task": "shapes_count", "n": prompts}, "train", 0)
    index = torch.arange(prompts).repeat_interleave(group)
    columns = reward_columns(samples, index)
    texts = [f"<think>I count them.</think><answer>{(i * 7) % 5}</answer>" for i in range(prompts * group)]
    columns["completion_truncated"] = [False] * len(texts)
    columns["completion_lengths"] = [len(t) // 3 for t in texts]
    return texts, columns


def timed(specs: list[RewardSpec], texts: list[str], columns: dict, reps: int) -> float:
    compute_rewards(specs, texts, columns)  # start workers, warm caches
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        compute_rewards(specs, texts, columns)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    texts, columns = batch()
    names = ["accuracy", "format", "length"]
    inline = [RewardSpec(n) for n in names]
    isolated = [RewardSpec(n, isolate=True) for n in names]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "user_rewards.py"
        path.write_text(USER)
        user = [RewardSpec(f"{path}:score")]
        rows = [("accuracy+format+length, in process (default)", timed(inline, texts, columns, args.reps)),
                ("accuracy+format+length, isolate=True (worker)", timed(isolated, texts, columns, args.reps)),
                ("user reward file (worker, default)", timed(user, texts, columns, args.reps))]
    print(f"{len(texts)} completions per step, median of {args.reps} steps")
    for label, ms in rows:
        print(f"{label:<50}{ms:8.2f} ms/step")


if __name__ == "__main__":
    main()
