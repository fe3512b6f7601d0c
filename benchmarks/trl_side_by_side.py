"""vlmrl vs TRL's GRPOTrainer, side by side in one run: same tiny Qwen2-VL start, data, reward and hyper-parameters.

    pip install -e '.[bench]'
    python benchmarks/trl_side_by_side.py --steps 100 --repeats 2 --threads 1 [--image-cache-mb 0]
    python benchmarks/trl_side_by_side.py --smoke      # ~1 min: every stage on a very small model (the test's mode)

1. SFT start: `vlmrl train trainer.steps=0` (the quickstart's SFT warm-start) gives RUN/checkpoint-0.
2. RL from that checkpoint, `--repeats` times each, alternating vlmrl, TRL, TRL, vlmrl, ... (ABBA, so drift in a
   shared machine's load cancels), repeat r with seed r, both sides on the quickstart recipe less what TRL's
   GRPOTrainer lacks (`MATCHED`: no dynamic sampling, no solved-prompt filter, the accuracy reward alone; 16
   prompts x G=8, max_new_tokens 12, temperature 1, lr 3e-4 constant, beta 0, clip 0.2/0.28, truncated answers
   masked, GRPO + clipped token-mean loss):
   - vlmrl: `vlmrl train model.name_or_path=START sft.steps=0 trainer.steps=N trainer.threads=T trainer.seed=r
     MATCHED... model.image_cache_mb=0`;
   - TRL: benchmarks/trl_grpo_worker.py, a `GRPOTrainer` with the settings of START/config.yaml plus the same
     overrides (it refuses any setting it cannot match).
   Each run is its own process (peak resident memory from `wait4`, OMP_NUM_THREADS=T).
3. Held-out accuracy after the same number of steps: `vlmrl eval CKPT --temperatures 0 1` on every final model and
   on the start (the same held-out scenes, decoding and evaluator).

Throughput = rollouts (prompts x G x steps) / seconds inside the RL steps (generation, reward, update; not model
loading, data loading or evaluation), timed from outside the same way for both: vlmrl's `RLJob.step` (wrapped in the
worker process), TRL's `on_step_begin` -> `on_step_end` callback. A forward hook on the vision tower counts the
images it encodes per step, in the rollout and in the rest of the step. CPU seconds of the same steps are measured
too (`time.process_time`): on a shared machine they are less disturbed by other jobs than wall time. Memory: TRL
processes every image anew and keeps none, so vlmrl runs with `model.image_cache_mb=0` too (`--image-cache-mb`): the
quickstart's 1600 holds all 4,000 processed scenes and made vlmrl's peak exceed TRL's, and the library's 256 fills
with the 600 held-out scenes of the start's evaluation; in a 100-step run of 1,600 random draws from 4,000 prompts
the cache has few hits to give.
Prints a markdown table for BENCHMARKS.md and writes the raw numbers to benchmarks/results/trl_side_by_side.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from smoke import SMOKE  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks/results"
# what TRL's GRPOTrainer lacks, turned off in vlmrl (trl_grpo_worker.unmatched refuses a recipe that keeps any):
# DAPO's dynamic sampling, the curriculum's solved-prompt filter and the soft overlong (length) reward; the rest of
# the quickstart's RL (clip-higher 0.2/0.28, truncated answers masked, token-mean, beta 0) both sides have
MATCHED = ["algorithm.dynamic_sampling=false", "curriculum.filter_solved=false", "curriculum.filter_unsolved=false",
           "rewards=[{name: accuracy, weight: 1.0}]"]


def run_measured(cmd: list[str], log: Path, threads: int) -> dict:
    """Run `cmd` in its own process (output to `log`); its wall seconds, CPU seconds and peak resident memory (MB)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"command failed with exit code {code}; see {log}:\n  {' '.join(cmd)}")
    return {"wall_seconds": wall, "cpu_seconds": usage.ru_utime + usage.ru_stime,
            "peak_rss_mb": usage.ru_maxrss / 1024, "command": " ".join(cmd)}


def vlmrl_worker(argv: list[str]) -> None:
    """`vlmrl train ARGV`, with each RL step timed from outside (wall and CPU seconds of `RLJob.step`, the trainer's
    one step: generation, reward, update) and the images that really enter the vision tower counted by a forward
    hook, split into the rollout (inside `policy.sampling()`, stage I) and the rest of the step. Nothing in vlmrl
    changes: the class's method and the policy's are wrapped in this process. Writes RUN_DIR/steps.json."""
    import contextlib

    from vlmrl.cli import main
    from vlmrl.trainer.job import RLJob

    steps: list[dict] = []
    images = {"rollout": 0, "update": 0}
    phase: dict = {"now": None}
    hooked: set[int] = set()

    def pre_hook(_module, args, kwargs):
        grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
        if phase["now"] is not None and grid is not None:
            images[phase["now"]] += int(grid.shape[0])

    def hook(policy) -> None:
        if id(policy) in hooked:
            return
        hooked.add(id(policy))
        policy.model.model.visual.register_forward_pre_hook(pre_hook, with_kwargs=True)
        sampling = policy.sampling

        @contextlib.contextmanager
        def sampling_counted(*args, **kwargs):
            phase["now"] = "rollout"
            try:
                with sampling(*args, **kwargs) as value:
                    yield value
            finally:
                phase["now"] = "update"

        policy.sampling = sampling_counted

    def timed_step(self, *args, **kwargs):
        hook(self.ctx.policy)
        before = dict(images)
        phase["now"] = "update"
        t0, c0 = time.perf_counter(), time.process_time()
        out = step(self, *args, **kwargs)
        steps.append({"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0,
                      **{f"vision_images_{k}": images[k] - before[k] for k in images}})
        phase["now"] = None
        return out

    step = RLJob.step
    RLJob.step = timed_step
    code = main(["train", *argv])
    out_dir = next(a.split("=", 1)[1] for a in argv if a.startswith("trainer.output_dir="))
    Path(out_dir, "steps.json").write_text(json.dumps(steps))
    sys.exit(code)


def matched(image_cache_mb: float) -> list[str]:
    """The overrides both sides run with: the quickstart recipe less what TRL's GRPOTrainer lacks (dynamic sampling,
    the solved-prompt filter, the soft overlong reward), and vlmrl's processed-image cache at `image_cache_mb`."""
    return [*MATCHED, f"model.image_cache_mb={image_cache_mb:g}"]


def run_vlmrl(start: Path, steps: int, threads: int, seed: int, out: Path, overrides: list[str]) -> dict:
    run_dir = out / f"vlmrl-seed{seed}"
    if run_dir.exists():  # left by a killed run: `vlmrl train` would otherwise write to a numbered sibling
        shutil.rmtree(run_dir)
    argv = [f"model.name_or_path={start}", "sft.steps=0", f"trainer.steps={steps}", f"trainer.threads={threads}",
            f"trainer.seed={seed}", "trainer.eval_every=0", f"trainer.output_dir={run_dir}", *overrides]
    proc = run_measured([sys.executable, __file__, "_vlmrl_worker", *argv], out / f"vlmrl-seed{seed}.log", threads)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["phase"] == "train"]
    steps_timed = json.loads((run_dir / "steps.json").read_text())
    rollouts = len(train) * round(train[0]["rollouts_per_second"] * (train[0]["time/collect_score"]
                                                                      + train[0]["time/update"]))
    wall, cpu = (sum(s[k] for s in steps_timed) for k in ("seconds", "cpu_seconds"))
    own = sum(r["time/collect_score"] + r["time/update"] for r in train)
    return {**proc, "system": "vlmrl", "seed": seed, "final": str(run_dir / f"checkpoint-{steps}"),
            "steps": len(train), "rollouts": rollouts, "step_seconds": wall, "step_cpu_seconds": cpu,
            "rollouts_per_second": rollouts / wall, "rollouts_per_cpu_second": rollouts / cpu,
            "rollouts_per_second_logged": rollouts / own,  # vlmrl's own metric (collect..update), aggregated
            "vision_forward_calls_rollout_logged": sorted({r["vision_forward_calls_rollout"] for r in train}),
            "vision_images_rollout_per_step": sorted({s["vision_images_rollout"] for s in steps_timed}),
            "vision_images_train_per_step": sorted({s["vision_images_update"] for s in steps_timed}),
            "train_accuracy_last50": statistics.mean(r["accuracy"] for r in train[-50:])}


def run_trl(start: Path, steps: int, threads: int, seed: int, out: Path, overrides: list[str]) -> dict:
    run_dir = out / f"trl-seed{seed}"
    cmd = [sys.executable, str(ROOT / "benchmarks/trl_grpo_worker.py"), "--checkpoint", str(start), "--steps",
           str(steps), "--threads", str(threads), "--seed", str(seed), "--out", str(run_dir), "--set", *overrides]
    proc = run_measured(cmd, out / f"trl-seed{seed}.log", threads)
    res = json.loads((run_dir / "result.json").read_text())
    s = res["steps"]
    return {**proc, "system": "trl", "seed": seed, "final": res["final"], "steps": len(s), "rollouts": res["rollouts"],
            "step_seconds": res["step_seconds"], "step_cpu_seconds": res["step_cpu_seconds"],
            "rollouts_per_second": res["rollouts_per_second"],
            "rollouts_per_cpu_second": res["rollouts"] / res["step_cpu_seconds"],
            "vision_images_rollout_per_step": sorted({x["vision_images_rollout"] for x in s}),
            "vision_images_train_per_step": sorted({x["vision_images_train"] for x in s}),
            "train_accuracy_last50": statistics.mean(x["rewards/accuracy/mean"] for x in s[-50:]),
            "trl": res["trl"]}


def evaluate(ckpt: str, out: Path, name: str, threads: int) -> dict:
    """Greedy and T=1 held-out accuracy of `ckpt` with `vlmrl eval` (the start's eval data: 300 held-out scenes)."""
    path = out / f"eval-{name}.json"
    run_measured([sys.executable, "-m", "vlmrl", "eval", ckpt, "--temperatures", "0", "1", "--out", str(path)],
                 out / f"eval-{name}.log", threads)
    res = json.loads(path.read_text())
    return {"greedy": res["T=0.0"]["accuracy"], "sampled": res["T=1.0"]["accuracy"], "n": res["T=0.0"]["n"]}


def git_state() -> str:
    """The commit the code was run from, with "+dirty" when the working tree had uncommitted changes."""
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return git("rev-parse", "--short", "HEAD") + ("+dirty" if git("status", "--porcelain", "--", "vlmrl") else "")


def pct(xs: list[float]) -> str:
    sd = f" ± {100 * statistics.stdev(xs):.1f}" if len(xs) > 1 else ""
    return f"{100 * statistics.mean(xs):.1f}{sd} ({', '.join(f'{100 * x:.1f}' for x in xs)})"


def walls(runs: list[dict]) -> str:
    return ", ".join(f"{r['wall_seconds']:.0f}" for r in runs)


def images(runs: list[dict]) -> str:
    """The distinct per-step image counts seen over all runs of one system, e.g. "16 + 16"."""
    def values(key: str) -> str:
        return "/".join(str(v) for v in sorted({x for r in runs for x in r[key]}))
    return f"{values('vision_images_rollout_per_step')} + {values('vision_images_train_per_step')}"


def table(runs: list[dict], start_eval: dict, args) -> str:
    by = {s: [r for r in runs if r["system"] == s] for s in ("vlmrl", "trl")}

    def total(s: str, key: str) -> float:
        return sum(r[key] for r in by[s])

    rps = {s: total(s, "rollouts") / total(s, "step_seconds") for s in by}
    rpc = {s: total(s, "rollouts") / total(s, "step_cpu_seconds") for s in by}
    per_rep = [v["rollouts_per_second"] / t["rollouts_per_second"] for v, t in zip(by["vlmrl"], by["trl"], strict=True)]
    lines = [
        f"| {args.steps} RL steps x {args.repeats} seeds, {args.threads} thread(s), vlmrl's image cache "
        f"{args.image_cache_mb:g} MB | vlmrl | TRL GRPOTrainer | vlmrl / TRL |",
        "|---|---|---|---|",
        f"| rollouts / s (wall, RL steps only) | {rps['vlmrl']:.1f} | {rps['trl']:.1f} | **{rps['vlmrl'] / rps['trl']:.2f}x**"
        f" (per seed: {', '.join(f'{x:.2f}' for x in per_rep)}) |",
        f"| rollouts / CPU-second (same steps) | {rpc['vlmrl']:.1f} | {rpc['trl']:.1f} | "
        f"{rpc['vlmrl'] / rpc['trl']:.2f}x |",
        f"| seconds per step (wall) | {total('vlmrl', 'step_seconds') / total('vlmrl', 'steps'):.2f} | "
        f"{total('trl', 'step_seconds') / total('trl', 'steps'):.2f} | |",
    ]
    for mode, label in (("greedy", "greedy"), ("sampled", "T=1")):
        lines.append(f"| held-out accuracy, {label} (start: {100 * start_eval[mode]:.1f}) | "
                     f"{pct([r['eval'][mode] for r in by['vlmrl']])} | {pct([r['eval'][mode] for r in by['trl']])} | |")
    lines += [
        f"| training accuracy, last 50 steps | {pct([r['train_accuracy_last50'] for r in by['vlmrl']])} | "
        f"{pct([r['train_accuracy_last50'] for r in by['trl']])} | |",
        f"| vision-tower images per step: rollout + training forward (hook) | {images(by['vlmrl'])} | "
        f"{images(by['trl'])} | |",
        f"| vlmrl's logged `vision_forward_calls_rollout` | "
        f"{sorted({x for r in by['vlmrl'] for x in r['vision_forward_calls_rollout_logged']})} | | |",
        f"| peak resident memory (MB) | {max(r['peak_rss_mb'] for r in by['vlmrl']):.0f} | "
        f"{max(r['peak_rss_mb'] for r in by['trl']):.0f} | |",
        f"| process wall time (s, incl. load and vlmrl's own evals) | "
        f"{walls(by['vlmrl'])} | {walls(by['trl'])} | |",
    ]
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_vlmrl_worker":
        return vlmrl_worker(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="RL steps per run")
    p.add_argument("--repeats", type=int, default=2, help="runs per system (seeds 0..R-1), in ABBA order")
    p.add_argument("--threads", type=int, default=1, help="torch threads of every process")
    p.add_argument("--start", help="reuse this vlmrl checkpoint as the start instead of running the SFT")
    p.add_argument("--quickstart-memory", action="store_true",
                   help="also run the full quickstart (`vlmrl train`) and record its peak resident memory")
    p.add_argument("--resume", action="store_true",
                   help="--out already holds some finished runs (e.g. after the job was killed): keep them")
    p.add_argument("--image-cache-mb", type=float, default=0,
                   help="vlmrl's model.image_cache_mb: 0 (default) keeps no processed image, as TRL keeps none; the "
                        "quickstart's 1600 keeps all 4,000 scenes, the library's 256 the held-out ones")
    p.add_argument("--smoke", action="store_true",
                   help="the smallest mode (tests/test_benchmarks.py): a very small model and batch, 2 steps, 1 seed")
    p.add_argument("--out", default=f"/tmp/vlmrl-bench/trl-{time.strftime('%Y%m%d-%H%M%S')}")
    p.add_argument("--results", default=str(RESULTS / "trl_side_by_side.json"))
    args = p.parse_args()
    if args.smoke:
        args.steps, args.repeats, args.quickstart_memory = 2, 1, False
    overrides = matched(args.image_cache_mb) + (SMOKE if args.smoke else [])
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.resume:
        raise SystemExit(f"--out {out} is not empty; give a new folder, or --resume to keep its finished runs")
    out.mkdir(parents=True, exist_ok=True)
    import torch
    import transformers
    import trl

    report: dict = {"args": vars(args), "overrides": overrides, "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                                                      "trl": trl.__version__, "python": sys.version.split()[0]},
                    "cpus": os.cpu_count(), "load_average_start": os.getloadavg(), "git": git_state()}
    if args.start:
        start = Path(args.start)
    elif (out / "sft/checkpoint-0").exists():
        start = out / "sft/checkpoint-0"
        report["sft"] = json.loads((out / "sft.json").read_text())
    else:
        print("SFT start ...", flush=True)
        report["sft"] = run_measured([sys.executable, "-m", "vlmrl", "train", "trainer.steps=0",
                                      f"trainer.threads={args.threads}", f"trainer.output_dir={out / 'sft'}",
                                      *(SMOKE if args.smoke else [])], out / "sft.log", args.threads)
        (out / "sft.json").write_text(json.dumps(report["sft"]))
        start = out / "sft/checkpoint-0"
    runs = []
    for r in range(args.repeats):
        order = (run_vlmrl, run_trl) if r % 2 == 0 else (run_trl, run_vlmrl)
        for fn in order:
            done = out / f"{fn.__name__}-seed{r}.json"  # a finished run, kept when the benchmark is resumed
            print(f"seed {r}: {fn.__name__} ...", flush=True)
            if done.exists():
                res = json.loads(done.read_text())
                print("  (finished earlier in this --out, not re-run)")
            else:
                res = fn(start, args.steps, args.threads, r, out, overrides)
                done.write_text(json.dumps(res, indent=1))
            print(f"  {res['rollouts_per_second']:.1f} rollouts/s, {res['rollouts_per_cpu_second']:.1f} per CPU-s, "
                  f"peak {res['peak_rss_mb']:.0f} MB", flush=True)
            runs.append(res)
    print("held-out evaluation ...", flush=True)
    report["start_eval"] = evaluate(str(start), out, "start", args.threads)
    for res in runs:
        res["eval"] = evaluate(res["final"], out, f"{res['system']}-seed{res['seed']}", args.threads)
    if args.quickstart_memory:
        print("quickstart (vlmrl train) ...", flush=True)
        report["quickstart"] = run_measured([sys.executable, "-m", "vlmrl", "train", f"trainer.threads={args.threads}",
                                             f"trainer.output_dir={out / 'quickstart'}"], out / "quickstart.log",
                                            args.threads)
    report["runs"], report["load_average_end"] = runs, os.getloadavg()
    report["table"] = table(runs, report["start_eval"], args)
    print("\n" + report["table"])
    if "quickstart" in report:
        q = report["quickstart"]
        print(f"\nquickstart `vlmrl train` ({args.threads} thread(s)): peak resident memory {q['peak_rss_mb']:.0f} MB, "
              f"wall {q['wall_seconds']:.0f} s")
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(json.dumps(report, indent=1))
    print(f"\nwrote {args.results}; run folders under {out}")


if __name__ == "__main__":
    main()
