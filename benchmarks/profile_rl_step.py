"""Where one vlmrl RL step spends its time: cProfile (CPU-time clock) inside `rl_step` only, grouped by stage.

    python benchmarks/profile_rl_step.py START_CHECKPOINT --steps 20 --threads 1 [KEY=VALUE ...]

Runs `vlmrl train model.name_or_path=START sft.steps=0 trainer.steps=N trainer.eval_every=0` in this process and
profiles only the RL steps (not loading or evaluation); the first step is skipped as warm-up. The clock is
`time.process_time`, so other jobs on a shared machine inflate the numbers less than wall time would. Prints CPU
milliseconds per step for each stage (cumulative time of the named functions; nested entries are part of their
parent) and writes the full profile to RUN_DIR/rl_step.prof (open with `python -m pstats` or snakeviz).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

# (label, a substring of the function's file path, function name, only the time reached from this caller or None):
# cumulative CPU time of these functions inside rl_step. Matched by name, so a module moving inside vlmrl still counts.
STAGES = [
    ("I collect: prompts (processor)", "vlmrl/", "make_prompts", None),
    ("I collect: generate (total)", "vlmrl/rollout/", "generate", None),
    ("    vision tower + prompt embeds", "vlmrl/", "prompt_embeds", "generate"),
    ("    LM forward (prefill + decode)", "vlmrl/", "forward_hidden", "generate"),
    ("    sampling (softmax, multinomial)", "vlmrl/", "sample_tokens", "generate"),
    ("    decode to text", "transformers/", "batch_decode", "generate"),
    ("II score: rewards", "vlmrl/rewards/", "compute_rewards", None),
    ("III trajectories", "vlmrl/trainer/", "build_trajectories", None),
    ("IV update (total)", "vlmrl/trainer/update.py", "update", None),
    ("    training forward (log-probs)", "vlmrl/", "sequence_logprobs", None),
    ("        vision tower + prompt embeds", "vlmrl/", "prompt_embeds", "sequence_logprobs"),
    ("        LM forward", "vlmrl/", "forward_hidden", "completion_logprobs"),
    ("    backward", "torch/_tensor.py", "backward", None),
    ("    clip grad norm", "torch/nn/utils/clip_grad.py", "clip_grad_norm_", None),
    ("    optimizer step", "torch/optim/", "step", "_use_grad"),
    ("step metrics (accuracy etc.)", "vlmrl/eval/", "correctness", None),
]


def stage_table(stats: pstats.Stats, steps: int, total_cpu: float) -> str:
    """CPU ms per step of each stage, and its share of the whole step."""
    entries = stats.stats  # {(file, line, name): (cc, nc, tt, ct, callers)}; callers: {(file, line, name): (.., ct)}

    def cumulative(path: str, name: str, caller: str | None) -> float:
        total = 0.0
        for (file, _, func), (_, _, _, ct, callers) in entries.items():
            if func == name and path in file:
                total += ct if caller is None else sum(v[3] for (_, _, cn), v in callers.items() if cn == caller)
        return total

    step_ms = 1000 * total_cpu / steps
    lines = ["| stage | CPU ms / step | share of step |", "|---|---|---|"]
    for label, path, name, caller in STAGES:
        ms = 1000 * cumulative(path, name, caller) / steps
        lines.append(f"| {label} | {ms:.0f} | {100 * ms / step_ms:.0f}% |")
    lines.append(f"| **whole step** | **{step_ms:.0f}** | 100% |")
    return "\n".join(lines)


def step_args(doc: str, steps: int, name: str) -> argparse.Namespace:
    """The command line of the RL-step benchmarks: START, --steps, --threads, --out, KEY=VALUE overrides."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("start", help="vlmrl checkpoint to start RL from")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=f"/tmp/vlmrl-bench/{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    p.add_argument("--recipe", default=None, help="the recipe to run (default: the quickstart's)")
    p.add_argument("overrides", nargs="*")
    return p.parse_intermixed_args()  # overrides may come after --steps and --threads, as the usage line shows


def run_steps(args: argparse.Namespace, warmup: int, around: Callable[[], AbstractContextManager]) -> None:
    """`vlmrl train` from START with no SFT and no evaluation, in this process: `warmup` RL steps, then
    `args.steps` more, each run inside `around()` (what the benchmark measures). Exits on a failed run."""
    import vlmrl.trainer.job as job
    from vlmrl.cli import main as vlmrl_main

    step, seen = job.rl_step, [0]

    def measured_step(*a, **kw):
        seen[0] += 1
        if seen[0] <= warmup:
            return step(*a, **kw)
        with around():
            return step(*a, **kw)

    job.rl_step = measured_step
    recipe = [args.recipe] if getattr(args, "recipe", None) else []
    try:
        code = vlmrl_main(["train", *recipe, f"model.name_or_path={args.start}", "sft.steps=0",
                           f"trainer.steps={args.steps + warmup}", f"trainer.threads={args.threads}",
                           "trainer.eval_every=0", f"trainer.output_dir={args.out}", *args.overrides])
    finally:
        job.rl_step = step  # a second run in this process measures itself only
    if code:
        sys.exit(code)


def main() -> None:
    args = step_args(__doc__, 20, "profile")
    profiler = cProfile.Profile(time.process_time)
    cpu = [0.0]

    @contextmanager
    def profiled():
        c0 = time.process_time()
        profiler.enable()
        try:
            yield
        finally:
            profiler.disable()
            cpu[0] += time.process_time() - c0

    run_steps(args, 1, profiled)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    profiler.dump_stats(Path(args.out) / "rl_step.prof")
    print(f"\n{args.steps} profiled steps (after 1 warm-up), {args.threads} thread(s), CPU time:\n")
    print(stage_table(pstats.Stats(profiler), args.steps, cpu[0]))
    print(f"\nfull profile: {Path(args.out) / 'rl_step.prof'}")


if __name__ == "__main__":
    main()
