"""Wall time of vlmrl RL steps, per stage, without a profiler's overhead: the named functions are wrapped with a clock.

    python benchmarks/rl_step_walltime.py START_CHECKPOINT --steps 150 --threads 1 [KEY=VALUE ...]

Runs `vlmrl train model.name_or_path=START sft.steps=0 trainer.steps=N+2 trainer.eval_every=0` in this process and
times only the RL steps after two warm-up steps. Prints wall milliseconds per step of each stage (a stage's time
includes what it calls: `generate` holds its `prompt_embeds` and decoding) and the whole step. To compare two
commits, run it from each commit's tree at the same time, one thread each, from the same start: the runs are
bit-identical when the change is, so the step ratio is the speed-up. benchmarks/profile_rl_step.py gives the CPU-time
breakdown under cProfile instead.
"""

from __future__ import annotations

import importlib
import time
from collections import Counter, defaultdict
from contextlib import contextmanager

from profile_rl_step import run_steps, step_args

# (module, attribute, label): wrapped while a measured step runs; classes are patched on the class itself
STAGES = [
    ("vlmrl.trainer.rl", "make_prompts", "I collect: prompts (processor)"),
    ("vlmrl.trainer.rl", "generate", "I collect: generate"),
    ("vlmrl.models.families.base:VLFamily", "prompt_embeds", "    prompt embeddings (vision tower, positions)"),
    ("vlmrl.models.families.qwen_vl:QwenVLFamily", "image_features", "    vision tower"),
    ("vlmrl.trainer.rl", "compute_rewards", "II score: rewards"),
    ("vlmrl.trainer.rl", "correctness", "II score: correctness"),
    ("vlmrl.trainer.rl", "reward_columns", "II score: dataset columns per answer"),
    ("vlmrl.trainer.rl", "dynamic_sampling", "I+II resampling rounds"),
    ("vlmrl.trainer.rl", "build_trajectories", "III trajectories"),
    ("vlmrl.trainer.rl", "update", "IV update"),
    ("torch:Tensor", "backward", "    backward"),
    ("vlmrl.trainer.rl", "rollout_metrics", "step metrics: reasoning, markers, compute"),
]


def main() -> None:
    args = step_args(__doc__, 150, "walltime")
    spent, calls, measuring, total = defaultdict(float), Counter(), [False], [0.0]

    def timed(fn, label):
        def wrapper(*a, **kw):
            if not measuring[0]:
                return fn(*a, **kw)
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[label] += time.perf_counter() - t0
                calls[label] += 1
        return wrapper

    for where, name, label in STAGES:
        module, _, cls = where.partition(":")
        owner = importlib.import_module(module)
        owner = getattr(owner, cls) if cls else owner
        setattr(owner, name, timed(getattr(owner, name), label))

    @contextmanager
    def clocked():
        measuring[0], t0 = True, time.perf_counter()
        try:
            yield
        finally:
            total[0] += time.perf_counter() - t0
            measuring[0] = False

    run_steps(args, 2, clocked)
    n = args.steps
    print(f"\n{n} measured steps (after 2 warm-up), {args.threads} thread(s), wall time:\n")
    print("| stage | wall ms / step | calls / step | share of step |\n|---|---|---|---|")
    for _, _, label in STAGES:
        ms = 1000 * spent[label] / n
        print(f"| {label} | {ms:.1f} | {calls[label] / n:.1f} | {100 * spent[label] / total[0]:.0f}% |")
    print(f"| **whole step** | **{1000 * total[0] / n:.1f}** | | 100% |")


if __name__ == "__main__":
    main()
