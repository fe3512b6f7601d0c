"""RL with the zoom tool against RL without tools on the same task, seeds and pixel budget (docs/agentic.md).

    python benchmarks/agentic_zoom.py --seeds 0 1 2 --jobs 2 [KEY=VALUE ...]

Each (seed, arm) runs `vlmrl train recipes/agentic_zoom.yaml` in its own process at 1 thread, exactly as a user
would: the tool arm as written, the no-tool arm with `agent.tools=[]` (single-turn answers from the whole board at
the same 112 x 112 budget; its SFT trains on the labelled answer instead of the demonstration). Both arms get the
same tokenizer, data, SFT steps, RL steps and evaluation. Prints a markdown table for BENCHMARKS.md (held-out greedy
accuracy after SFT and after RL with 95% intervals, the tool-call rate over training, wall time) and writes the raw
numbers to benchmarks/results/<--results>.

    python benchmarks/agentic_zoom.py --seeds 0 1 2 3 --results agentic_zoom_noisy.json \
        data.sft.demo_on_target=0.5 data.sft.n=2000 sft.steps=3000 trainer.steps=200

is the noisy-demonstration variant: half of the SFT demonstrations zoom on another cell, so the SFT start finds the
blue cell only part of the time and RL has the tool-use policy to learn (the table's "zoom on target" columns,
greedy and sampled).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from quickstart_seeds import ci, mean_std, metrics, timed_run

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "agentic_zoom.yaml"
ARMS = {"tool": [], "no tool": ["agent.tools=[]"]}


def run_one(seed: int, arm: str, overrides: list[str], out_root: Path) -> dict:
    out = out_root / f"{arm.replace(' ', '_')}-seed{seed}"
    cmd = [sys.executable, "-m", "vlmrl", "train", str(RECIPE), f"trainer.seed={seed}", "trainer.threads=1",
           f"trainer.output_dir={out}", *ARMS[arm], *overrides]
    wall, usage = timed_run(cmd, f"seed {seed}, {arm}", out.with_suffix(".stdout"))
    rows = metrics(out)
    evals = [r for r in rows if r["phase"] == "eval"]
    train = [r for r in rows if r["phase"] == "train"]
    calls = [r.get("tool/call_rate", 0.0) for r in train]
    quarter = max(1, -(-len(calls) // 4))  # four windows, the last one shorter when steps do not divide by 4
    print(f"seed {seed}, {arm}: {100 * evals[0]['greedy/accuracy']:.1f} -> {100 * evals[-1]['greedy/accuracy']:.1f} "
          f"in {wall:.0f} s", flush=True)
    return {"seed": seed, "arm": arm, "run_dir": str(out), "wall_seconds": wall,
            "cpu_seconds": usage.ru_utime + usage.ru_stime, "start": evals[0], "final": evals[-1],
            "curve": [(r["step"], r["greedy/accuracy"]) for r in evals],
            "tool_call_rate": [statistics.mean(calls[i:i + quarter]) for i in range(0, len(calls), quarter)]}


def diagnose(checkpoint: str, n: int = 200) -> str:
    """Greedy episodes on the first `n` held-out boards: how often the first zoom is on the target cell, and how
    often the shape is named right given that (what limits the tool arm: finding the cell, or reading it)."""
    import re

    from vlmrl.agent import AgentSpec
    from vlmrl.config import load_config
    from vlmrl.data import make_task
    from vlmrl.models import load_policy
    from vlmrl.rollout.batch import make_prompts

    cfg = load_config(RECIPE)
    policy = load_policy(checkpoint, min_pixels=cfg.model.min_pixels, max_pixels=cfg.model.max_pixels)
    agent = AgentSpec.from_config(cfg.agent, policy.processor)
    samples = make_task("zoom_shape", n, "test", cfg.data.seed)
    hits = right = right_on_hit = 0
    for start in range(0, n, 50):
        chunk = samples[start:start + 50]
        out = agent.rollout(policy, make_prompts(policy, chunk), chunk, 1, 0.0).rollout
        for s, turns, text in zip(chunk, out.columns["turns"], out.texts, strict=True):
            found = re.search(r'"box":\[([^\]]*)\]', turns[0]["text"])
            hit = found is not None and "[" + ", ".join(found.group(1).split(",")) + "]" == s["target_box"]
            ok = text == f"<answer>{s['solution']}</answer>"
            hits, right, right_on_hit = hits + hit, right + ok, right_on_hit + (hit and ok)
    return (f"{checkpoint}: zoom on the target cell {hits}/{n}; named right {right}/{n}; named right when the zoom "
            f"was on target {right_on_hit}/{max(hits, 1)}")


def before_after(start: dict, final: dict, key: str) -> str:
    """`key` of the held-out evaluation before -> after RL, in percent, and the change in points."""
    if start.get(key) is None or final.get(key) is None:
        return ""
    return f"{100 * start[key]:.1f}% -> {100 * final[key]:.1f}% ({100 * (final[key] - start[key]):+.1f})"


def on_target(start: dict, final: dict, mode: str = "greedy") -> str:
    """Held-out episodes whose first zoom covered the target cell (`agent/on_target`), before -> after RL; `mode`:
    greedy, or sampled at the training temperature (the policy's own share, the one RL trains)."""
    return before_after(start, final, f"{mode}/agent/on_target")


def table(results: list[dict]) -> str:
    head = ["arm", "seed", "greedy after SFT", "greedy after RL", "RL - SFT", "zoom on target: SFT -> RL",
            "sampled (T = 1): accuracy", "sampled: zoom on target", "tool-call rate over training (quarters)",
            "eval tool calls / invalid", "wall time"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm in ARMS:
        rows = [r for r in results if r["arm"] == arm]
        for r in rows:
            s, f = r["start"], r["final"]
            lines.append("| " + " | ".join([
                arm, str(r["seed"]), ci(s), ci(f), f"{100 * (f['greedy/accuracy'] - s['greedy/accuracy']):+.1f}",
                on_target(s, f), before_after(s, f, "sampled/accuracy"), on_target(s, f, "sampled"),
                " / ".join(f"{100 * q:.0f}%" for q in r["tool_call_rate"]),
                f"{100 * f.get('greedy/tool/call_rate', 0):.0f}% / {100 * f.get('greedy/tool/invalid_rate', 0):.0f}%",
                f"{r['wall_seconds']:.0f} s"]) + " |")
        if rows:
            start = [r["start"]["greedy/accuracy"] for r in rows]
            final = [r["final"]["greedy/accuracy"] for r in rows]
            gains = [b - a for a, b in zip(start, final, strict=True)]
            lines.append("| " + " | ".join([f"**{arm}: mean ± std**", "", mean_std(start), mean_std(final),
                                            mean_std(gains), "", "", "", "", "",
                                            f"{statistics.mean(r['wall_seconds'] for r in rows):.0f} s"]) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--jobs", type=int, default=2, help="runs at once (each at 1 thread)")
    p.add_argument("--out", default="/tmp/vlmrl-bench/agentic_zoom")
    p.add_argument("--results", default="agentic_zoom.json", help="file name under benchmarks/results/")
    p.add_argument("--tables-only", action="store_true", help="print the table of the saved results")
    p.add_argument("--diagnose", nargs="+", metavar="CHECKPOINT", help="where the tool arm's errors come from")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    if args.diagnose:
        for checkpoint in args.diagnose:
            print(diagnose(checkpoint))
        return
    saved = ROOT / "benchmarks/results" / args.results
    if args.tables_only:
        print(table(json.loads(saved.read_text())))
        return
    pairs = [(s, a) for a in args.arms for s in args.seeds]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda sa: run_one(*sa, args.overrides, Path(args.out)), pairs))
    print(table(results))
    saved.parent.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
