"""Tools that take time: environment steps one after another after each turn, against steps started as each turn
ends and run beside each other (`agent.env_workers`, vlmrl/agent/steps.py).

    python benchmarks/agent_env_overlap.py START --latency 0 0.02 0.1 --rounds 3 [--threads 1] [KEY=VALUE ...]

START is an SFT start of `recipes/agentic_zoom.yaml` (a policy that calls `zoom`: `vlmrl train
recipes/agentic_zoom.yaml trainer.steps=0`, then RUN/checkpoint-0). The zoom tool is wrapped to wait `latency`
seconds before it answers, standing in for a tool that calls a service (a search, an OCR or code-execution server, a
simulator): the zoom itself takes about a millisecond. Every round times stage I of one RL step of the recipe
(`rollout.prompts_per_step` x `rollout.group_size` trajectories, the same prompts and seeds) with `env_workers=1`
and with the recipe's workers, in turn, and checks that the two give the same trajectories, bit for bit. Prints a
markdown table: seconds per rollout (mean over rounds), the ratio, tool calls per rollout.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "agentic_zoom.yaml"


def slowed(tool, latency: float):
    def fn(context, **arguments):
        time.sleep(latency)
        return tool.fn(context, **arguments)

    return dataclasses.replace(tool, fn=fn)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("start", help="an SFT start of recipes/agentic_zoom.yaml (RUN/checkpoint-0)")
    p.add_argument("--latency", type=float, nargs="+", default=[0.0, 0.02, 0.1], help="seconds each tool call waits")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("overrides", nargs="*")
    args = p.parse_intermixed_args()
    torch.set_num_threads(args.threads)

    from vlmrl.agent import AgentSpec
    from vlmrl.config import load_config
    from vlmrl.data import make_task
    from vlmrl.models import load_policy
    from vlmrl.rollout.batch import make_prompts
    from vlmrl.trainer.rl import prompt_seed

    cfg = load_config(RECIPE, args.overrides)
    policy = load_policy(args.start, min_pixels=cfg.model.min_pixels, max_pixels=cfg.model.max_pixels)
    spec = AgentSpec.from_config(cfg.agent, policy.processor)
    samples = make_task("zoom_shape", cfg.rollout.prompts_per_step, "train", cfg.data.seed)
    seeds = [prompt_seed(cfg.trainer.seed, 1, 0, i) for i in range(len(samples))]
    workers = max(cfg.agent.env_workers, 2)
    rows = [f"| tool latency | env_workers=1 (s per rollout) | env_workers={workers} | speed-up | tool calls per "
            f"rollout | trajectories equal |", "|---|---|---|---|---|---|"]
    for latency in args.latency:
        tools = {name: slowed(t, latency) for name, t in spec.tools.items()}
        times: dict[int, list[float]] = {1: [], workers: []}
        outs = {}
        for _ in range(args.rounds + 1):  # the first round warms up, untimed
            for w in (1, workers):
                run = dataclasses.replace(spec, tools=tools, env_workers=w)
                t0 = time.perf_counter()
                out = run.rollout(policy, make_prompts(policy, samples), samples, cfg.rollout.group_size,
                                  cfg.rollout.temperature, prompt_seeds=seeds).rollout
                times[w].append(time.perf_counter() - t0)
                outs[w] = out
        a, b = outs[1], outs[workers]
        equal = torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logprobs, b.logprobs) \
            and a.texts == b.texts
        calls = sum(a.columns["tool_calls"])
        one, many = statistics.mean(times[1][1:]), statistics.mean(times[workers][1:])
        rows.append(f"| {1000 * latency:.0f} ms | {one:.2f} | {many:.2f} | {one / many:.2f}x | {calls} | "
                    f"{'yes' if equal else 'NO'} |")
        print(rows[-1], flush=True)
        if not equal:
            sys.exit("the trajectories differ between env_workers=1 and the overlapped steps")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
