"""The real vLLM engine against the built-in sampler, side by side, on the same recipe and the same SFT start:
held-out accuracy after the same RL steps (with its 95% interval), step time, and the sampler–trainer gap per step
(`rollout/logprob_gap_max`, `mismatch/k3`). Run it in the vLLM-on-CPU environment (scripts/vllm_cpu_env.sh):

    .venv-vllm/bin/python benchmarks/vllm_side_by_side.py --recipe quickstart --seeds 0 [--steps 1500]
    .venv-vllm/bin/python benchmarks/vllm_side_by_side.py --recipe agentic_zoom --seeds 0
    .venv-vllm/bin/python benchmarks/vllm_side_by_side.py --smoke     # seconds: a very small model, a few steps

vLLM's CPU attention needs a head dimension of at least 32, and the embedded model's default is 24 (96 wide, 4
heads), so both arms run it with 3 heads of 32 (`model.tiny.num_heads=3 model.tiny.num_kv_heads=1`); nothing else
in the recipe changes. Per seed the SFT warm-start runs once (`trainer.steps=0`); both arms start RL from its
checkpoint-0, in their own process, one after the other, at 1 thread (vLLM's CPU backend takes the process to one
thread when it starts, so the built-in arm gets the same). The engine runs in float32 (the trainer's precision).

Prints a markdown table for BENCHMARKS.md and writes the raw numbers to benchmarks/results/<--results>.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from off_policy import rows, vlmrl  # noqa: E402  (one `vlmrl train` run in its own process; its metrics)
from smoke import SMALL_RUN  # noqa: E402

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache for the CPU engine (the runs inherit it)

PLAIN = ["trainer.eval_every=0", "trainer.log_rollouts_every=0", "trainer.save_every=0", "trainer.save_every_minutes=0",
         "trainer.threads=1"]
HEADS_32 = ["model.tiny.num_heads=3", "model.tiny.num_kv_heads=1"]  # vLLM's CPU attention: head_dim >= 32
# the smallest mode (tests/test_vllm_real.py runs it): a model of head_dim 32, a few short steps
SMOKE = ["model.tiny.hidden_size=64", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1",
         "model.tiny.intermediate_size=128", "model.tiny.vision_dim=32", "model.tiny.vision_heads=2",
         "model.tiny.vocab_size=400", *SMALL_RUN, "rollout.max_new_tokens=6", "eval.max_new_tokens=6",
         "trainer.steps=3", "model.image_cache_mb=64", "algorithm.overlong_filter=false"]
ARMS = {"built-in sampler": ["rollout.engine=hf"], "vLLM": ["rollout.engine=vllm"]}


def result(run_dir: Path, seconds: float) -> dict:
    log = rows(run_dir)
    final = [r for r in log if r["phase"] == "eval"][-1]
    train = [r for r in log if r["phase"] == "train"]
    out = {"seconds": seconds, "accuracy": final["greedy/accuracy"], "low": final.get("greedy/accuracy_ci_low"),
           "high": final.get("greedy/accuracy_ci_high"), "steps": len(train),
           "step_seconds": statistics.fmean(r["time/collect_score"] + r["time/update"] for r in train),
           "collect_seconds": statistics.fmean(r["time/collect_score"] for r in train)}
    for key, reduce in (("rollout/logprob_gap_max", max), ("rollout/logprob_gap_mean", statistics.fmean),
                        ("mismatch/k3", statistics.fmean)):
        values = [r[key] for r in train if key in r]
        out[key] = reduce(values) if values else None
    k3 = [abs(r["mismatch/k3"]) for r in train if "mismatch/k3" in r]
    out["max_abs_k3"] = max(k3) if k3 else None
    return out


def fmt(x, spec=".2g"):
    return "-" if x is None else format(x, spec)


def table(results: dict, starts: dict, seeds: list[int]) -> str:
    lines = ["| arm | seed | held-out acc. [95%] | step s | generate+score s | gap max | gap mean | k3 mean | |k3| max "
             "| wall s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, per_seed in results.items():
        for s in seeds:
            r = per_seed[str(s)]
            ci = f" [{100 * r['low']:.1f}, {100 * r['high']:.1f}]" if r.get("low") is not None else ""
            lines.append(f"| {name} | {s} | {100 * r['accuracy']:.1f}%{ci} | {r['step_seconds']:.3f} | "
                         f"{r['collect_seconds']:.3f} | {fmt(r['rollout/logprob_gap_max'])} | "
                         f"{fmt(r['rollout/logprob_gap_mean'])} | {fmt(r['mismatch/k3'])} | {fmt(r['max_abs_k3'])} | "
                         f"{r['seconds']:.0f} |")
    base, other = list(results)
    ratios = [results[other][str(s)]["step_seconds"] / results[base][str(s)]["step_seconds"] for s in seeds]
    lines.append(f"(SFT start: {', '.join(f'seed {s} {100 * starts[str(s)]:.1f}%' for s in seeds)}; {other} step time "
                 f"x{statistics.fmean(ratios):.2f} the {base}'s)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="quickstart", choices=["quickstart", "agentic_zoom"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--steps", type=int, default=None, help="RL steps (default: the recipe's)")
    ap.add_argument("--out", default="runs/vllm_side_by_side")
    ap.add_argument("--results", default=None, help="default: vllm_side_by_side_<recipe>.json")
    ap.add_argument("--smoke", action="store_true", help="a few steps of a very small model, 1 seed")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    out = Path(a.out) / a.recipe
    out.mkdir(parents=True, exist_ok=True)
    recipe = [str(ROOT / "recipes" / f"{a.recipe}.yaml")]
    base = [*recipe, *PLAIN, *(SMOKE if a.smoke else HEADS_32), *a.overrides]
    if a.steps is not None and not a.smoke:
        base.append(f"trainer.steps={a.steps}")
    seeds = a.seeds[:1] if a.smoke else a.seeds
    results: dict[str, dict[str, dict]] = {}
    for seed in seeds:  # the SFT start, once per seed
        start = out / f"seed{seed}-sft"
        if not (start / "checkpoint-0").exists():
            vlmrl([*base, f"trainer.seed={seed}", "trainer.steps=0", f"trainer.output_dir={start}"],
                  out / f"seed{seed}-sft.log")
        for name, extra in ARMS.items():
            run_dir = out / f"seed{seed}-{extra[0].split('=')[1]}"
            seconds = vlmrl([*base, f"trainer.seed={seed}", f"model.name_or_path={start / 'checkpoint-0'}",
                             "sft.steps=0", f"trainer.output_dir={run_dir}", *extra], run_dir.with_suffix(".log"))
            results.setdefault(name, {})[str(seed)] = res = result(run_dir, seconds)
            print(f"seed {seed} {name}: {100 * res['accuracy']:.1f}% ({seconds:.0f} s)", flush=True)
    starts = {str(s): [r for r in rows(out / f"seed{s}-sft") if r["phase"] == "eval"][-1]["greedy/accuracy"]
              for s in seeds}
    print(table(results, starts, seeds))
    if a.smoke:  # numbers that mean nothing are not kept
        return
    name = a.results or f"vllm_side_by_side_{a.recipe}.json"
    (ROOT / "benchmarks/results").mkdir(exist_ok=True)
    (ROOT / "benchmarks/results" / name).write_text(json.dumps({"args": vars(a), "starts": starts,
                                                                "results": results}, indent=1))


if __name__ == "__main__":
    main()
