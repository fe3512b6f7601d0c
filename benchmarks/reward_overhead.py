"""Per-step cost of the score stage on a quickstart-sized rollout batch (16 prompts x G=8 = 128 completions):
built-in rewards in the trainer's process (the default) vs the same rewards forced into a worker process
(isolate=True: the batch's columns are pickled to the worker and the values back), and a user reward file.

Then the math check on a batch of the same size whose answers are LaTeX (the quickstart's answers are numbers, so
the math check never runs there): the hand-written sympy parser vlmrl had until math-verify replaced it (its file
at commit OLD_PARSER, read with `git show` into a temporary module, run in its own worker pool) against
math-verify, side by side: per-step time with the per-pair cache emptied every step (a new step brings new
answers), agreement with labels worked by hand, and the start of a math worker (imports and warm-up).

    python benchmarks/reward_overhead.py [--reps 50] [--math-reps 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from vlmrl.data import build_dataset
from vlmrl.rewards import RewardSpec, accuracy_reward, compute_rewards, mathcheck
from vlmrl.rewards.safe import close_pools
from vlmrl.rollout.batch import reward_columns

OLD_PARSER = "e31af8f"  # the last commit with the hand-written LaTeX-to-sympy parser in vlmrl/rewards/mathcheck.py
# 16 problems x 8 answers: (solution, [(answer, equal?) ...]), each label worked by hand
MATH = [
    ("\\frac{1}{2}", [("\\frac{1}{2}", 1), ("0.5", 1), ("\\dfrac{1}{2}", 1), ("1/2", 1), ("\\frac{2}{4}", 1),
                      ("\\frac{1}{3}", 0), ("0.25", 0), ("\\frac12 \\text{ or } \\frac13", 0)]),
    ("(x+1)^2", [("(x+1)^2", 1), ("x^2+2x+1", 1), ("(1+x)^2", 1), ("x^2+2x+2", 0), ("(x+1)^3", 0),
                 ("x^2 + 2x + 1", 1), ("(x+1)(x+1)", 1), ("x+1", 0)]),
    ("2\\sqrt{2}", [("2\\sqrt{2}", 1), ("\\sqrt{8}", 1), ("2\\sqrt2", 1), ("2.828427", 1), ("\\sqrt{2}", 0),
                    ("4", 0), ("2 \\sqrt{2}", 1), ("\\sqrt{6}", 0)]),
    ("(1, 2]", [("(1, 2]", 1), ("(1,2]", 1), ("[1,2]", 0), ("(1,2)", 0), ("x \\in (1, 2]", 1), ("(1, 2)", 0),
                ("[1, 2)", 0), ("1 < x \\le 2", 1)]),
    ("\\{1, 2, 3\\}", [("\\{1,2,3\\}", 1), ("\\{3,2,1\\}", 1), ("1, 2, 3", 1), ("\\{1,2\\}", 0),
                         ("\\{1,2,3,4\\}", 0), ("3, 2, 1", 1), ("\\{1, 2, 3\\}", 1), ("\\{0,1,2\\}", 0)]),
    ("\\pm 2", [("\\pm 2", 1), ("\\pm2", 1), ("-2, 2", 1), ("2", 0), ("-2", 0), ("x = \\pm 2", 1),
                 ("2, -2", 1), ("\\pm 4", 0)]),
    ("50\\%", [("50\\%", 1), ("50%", 1), ("0.5", 1), ("\\frac{1}{2}", 1), ("5\\%", 0), ("0.05", 0),
                ("50 \\%", 1), ("25\\%", 0)]),
    ("5\\text{ cm}", [("5\\text{ cm}", 1), ("5", 1), ("5 cm", 1), ("5\\,\\text{cm}", 1), ("6\\text{ cm}", 0),
                      ("10", 0), ("5.0", 1), ("4", 0)]),
    ("\\sin^2 x", [("\\sin^2 x", 1), ("1-\\cos^2 x", 1), ("\\sin^2(x)", 1), ("(\\sin x)^2", 1),
                    ("\\cos^2 x", 0), ("\\sin x", 0), ("\\sin^2 x + 1", 0), ("1 - \\cos^2(x)", 1)]),
    ("\\frac{\\pi}{3}", [("\\frac{\\pi}{3}", 1), ("\\pi/3", 1), ("\\frac{1}{3}\\pi", 1), ("60", 0),
                          ("\\frac{\\pi}{6}", 0), ("1.047198", 1), ("\\frac{2\\pi}{6}", 1), ("\\pi", 0)]),
    ("3", [("3", 1), ("3.0", 1), ("\\frac{6}{2}", 1), ("\\sqrt{9}", 1), ("3 or 4", 0), ("4", 0), ("x = 3", 1),
           ("2+1", 1)]),
    ("x = 5", [("x = 5", 1), ("5", 1), ("x=5", 1), ("5.0", 1), ("x = 6", 0), ("10/2", 1), ("x = 5 or x = 6", 0),
               ("-5", 0)]),
    ("x+1", [("x+1", 1), ("1+x", 1), ("\\frac{x^2-1}{x-1}", 1), ("x + 1", 1), ("x-1", 0), ("x+2", 0),
             ("(x^2-1)/(x-1)", 1), ("2x+2", 0)]),
    ("e^{2}", [("e^{2}", 1), ("e^2", 1), ("\\exp(2)", 1), ("7.389056", 1), ("2e", 0), ("e^{3}", 0),
               ("e \\cdot e", 1), ("2", 0)]),
    ("10^{-3}", [("10^{-3}", 1), ("0.001", 1), ("\\frac{1}{1000}", 1), ("1/1000", 1), ("10^{3}", 0), ("0.01", 0),
                 ("1 \\times 10^{-3}", 1), ("-1000", 0)]),
    ("\\sqrt[3]{2}", [("\\sqrt[3]{2}", 1), ("2^{1/3}", 1), ("2^{\\frac{1}{3}}", 1), ("1.259921", 1),
                      ("\\sqrt{2}", 0), ("\\sqrt[3]{3}", 0), ("\\sqrt[3]{2} \\text{ or } \\sqrt{2}", 0),
                      ("2^{3}", 0)]),
]

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


def math_batch() -> tuple[list[str], list[str], list[int]]:
    """128 completions (a short reasoning, then the answer block), their solutions and hand labels."""
    texts, solutions, labels = [], [], []
    for solution, answers in MATH:
        for answer, label in answers:
            texts.append(f"<think>Simplify step by step, then check the result.</think><answer>{answer}</answer>")
            solutions.append(solution)
            labels.append(label)
    return texts, solutions, labels


def old_checker(tmp: Path):
    """The old `symbolic_equal_many` and its cache, from git, pointed at its own file and its own "math_old" worker
    pool."""
    source = subprocess.run(["git", "show", f"{OLD_PARSER}:vlmrl/rewards/mathcheck.py"], check=True,
                            capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1]).stdout
    path = tmp / "old_mathcheck.py"
    path.write_text(source.replace('"vlmrl.rewards.mathcheck:', f'"{path}:').replace('get_pool("math"',
                                                                                      'get_pool("math_old"'))
    spec = importlib.util.spec_from_file_location("old_mathcheck", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.symbolic_equal_many, module._CACHE


def time_math(checker, cache, reps: int) -> tuple[float, float, int, int]:
    """(pool start s, median ms per step, answers graded as labelled, failures) for one checker."""
    texts, solutions, labels = math_batch()
    original = mathcheck.symbolic_equal_many
    mathcheck.symbolic_equal_many = checker  # accuracy_reward imports it from mathcheck at each call
    try:
        start = time.perf_counter()
        checker([("1", "1")])  # starts the pool: imports, warm-up
        started = time.perf_counter() - start
        times, scores = [], []
        for _ in range(reps):
            cache.clear()
            start = time.perf_counter()
            scores = accuracy_reward(texts, solutions, answer_type="math")
            times.append(time.perf_counter() - start)
    finally:
        mathcheck.symbolic_equal_many = original
    agree = sum(score == float(label) for score, label in zip(scores, labels, strict=True))
    failures = sum(score is not None and score != score for score in scores)  # a RewardFailure is a NaN
    return started, statistics.median(times) * 1000, agree, failures


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--math-reps", type=int, default=5)
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

    close_pools()  # both math pools start from cold below
    with tempfile.TemporaryDirectory() as tmp:
        checkers = [(f"hand-written sympy parser ({OLD_PARSER})", *old_checker(Path(tmp))),
                    ("math-verify", mathcheck.symbolic_equal_many, mathcheck._CACHE)]
        results = [(label, *time_math(fn, cache, args.math_reps)) for label, fn, cache in checkers]
        close_pools()
    texts, _, labels = math_batch()
    print(f"\nmath answers: {len(texts)} completions ({sum(labels)} equal to their solution by hand labels), "
          f"median of {args.math_reps} steps, cache emptied each step")
    print(f"{'checker':<44}{'ms/step':>10}{'as labelled':>13}{'failures':>10}{'worker start':>14}")
    for label, started, ms, agree, failures in results:
        print(f"{label:<44}{ms:10.0f}{agree:>9}/{len(texts)}{failures:>10}{started:>12.1f} s")


if __name__ == "__main__":
    main()
