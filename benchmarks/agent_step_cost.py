"""What one agentic RL step costs, and what it processes, against the same recipe without tools.

    python benchmarks/agent_step_cost.py TOOL_START --no-tool-start NO_TOOL_START --steps 10 --threads 1 [KEY=VALUE]

Runs `vlmrl train recipes/agentic_zoom.yaml` (no SFT, no evaluation) twice in this process: the tool arm from
TOOL_START and the same recipe with `agent.tools=[]` (single-turn) from NO_TOOL_START (default TOOL_START; an SFT
start of the no-tool arm answers in a few tokens, as that arm does). Each arm's first step is a warm-up; then, per RL step:
wall seconds, and what the step processed in each stage — tokens prefilled (every row's columns of a multi-token
language-model call, padding included), tokens decoded (one-column calls), images through the vision tower — for
collect (sampling: no gradient) and update (the training forward, with gradient; old/reference log-prob passes
without gradient are counted under collect when they run). The per-unit cost compares the arms' seconds per step
against the work each did. Prints a markdown table.

    python benchmarks/agent_step_cost.py TOOL_START ... --code BEFORE_DIR --code AFTER_DIR --rounds 3

compares code versions side by side (each DIR holds a `vlmrl` package, e.g. `git archive <commit> vlmrl | tar -x -C
DIR`): every round runs both arms once per DIR, one process each (PYTHONPATH=DIR), the DIRs in turn, so load from
other jobs falls on every version alike; prints seconds per step per round, and the means, counts and ratios.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_rl_step import run_steps, step_args  # noqa: E402

RECIPE = str(Path(__file__).resolve().parents[1] / "recipes" / "agentic_zoom.yaml")


class Counts:
    def __init__(self):
        self.seconds, self.cpu_seconds, self.steps = 0.0, 0.0, 0
        self.work = dict.fromkeys(("prefill/collect", "decode/collect", "images/collect", "prefill/update",
                                   "images/update"), 0)


CURRENT: list[Counts | None] = [None]  # the arm being measured, while its step runs


def install_counters() -> None:
    """Wrap the families' forward and image-feature calls (once) to count into CURRENT[0]."""
    from vlmrl.models.families import base

    forward, embeds_of = base.VLFamily.forward_hidden, base.VLFamily.prompt_embeds

    def stage() -> str:
        return "update" if torch.is_grad_enabled() else "collect"

    def counted_forward(self, embeds, *a, **kw):
        counts = CURRENT[0]
        if counts is not None:
            n, s = embeds.shape[0], embeds.shape[1]
            key = ("decode/" if s == 1 else "prefill/") + stage()
            counts.work[key if key in counts.work else "prefill/update"] += n * s
        return forward(self, embeds, *a, **kw)

    def counted_embeds(self, batch):
        before = self.vision_calls
        out = embeds_of(self, batch)
        if CURRENT[0] is not None:
            CURRENT[0].work[f"images/{stage()}"] += self.vision_calls - before
        return out

    base.VLFamily.forward_hidden, base.VLFamily.prompt_embeds = counted_forward, counted_embeds


def measure(args, overrides: list[str]) -> Counts:
    counts = Counts()

    @contextmanager
    def timed():
        CURRENT[0] = counts
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            counts.seconds += time.perf_counter() - t0
            counts.cpu_seconds += time.process_time() - c0
            counts.steps += 1
            CURRENT[0] = None

    args.overrides = overrides
    run_steps(args, 1, timed)
    return counts


def take_option(name: str, repeated: bool = False) -> list[str]:
    """Remove `name VALUE` (each occurrence) from sys.argv (step_args knows the shared options only)."""
    values, argv, i = [], [sys.argv[0]], 1
    while i < len(sys.argv):
        if sys.argv[i] == name and i + 1 < len(sys.argv) and (repeated or not values):
            values.append(sys.argv[i + 1])
            i += 2
        else:
            argv.append(sys.argv[i])
            i += 1
    sys.argv = argv
    return values


def compare(codes: list[str], rounds: int, more: list[str]) -> None:
    """Both arms under each code version, `rounds` times, the versions in turn (module docstring)."""
    runs: dict[str, list[dict]] = {c: [] for c in codes}
    stamp = time.strftime("%Y%m%d-%H%M%S")

    def per_step(v: dict, clock: str) -> float:
        return v[clock] / v["steps"]

    for r in range(rounds):
        for code in codes:
            out = Path(f"/tmp/vlmrl-bench/agent-step-{stamp}-{Path(code).name}-{r}.json")
            env = {**os.environ, "PYTHONPATH": str(Path(code).resolve())}
            subprocess.run([sys.executable, __file__, *sys.argv[1:], *more, "--json", str(out)], env=env, check=True,
                           cwd="/tmp", stdout=subprocess.DEVNULL)
            runs[code].append(json.loads(out.read_text()))
            print(f"round {r}, {code}: " + ", ".join(
                f"{arm} {per_step(v, 'seconds'):.2f} s/step ({per_step(v, 'cpu_seconds'):.2f} CPU)"
                for arm, v in runs[code][-1].items()), flush=True)
    keys = list(next(iter(runs[codes[0]][0].values()))["work"])
    print(f"\n{rounds} rounds, the versions in turn; seconds per step: mean of the rounds (lowest)\n")
    print("| code | arm | wall s / step | CPU s / step | " + " | ".join(f"{k} / step" for k in keys) + " |")
    print("|---|---|---|---|" + "---|" * len(keys))
    for code in codes:
        for arm in runs[code][0]:
            wall = [per_step(v[arm], "seconds") for v in runs[code]]
            cpu = [per_step(v[arm], "cpu_seconds") for v in runs[code]]
            work = runs[code][0][arm]
            print(f"| {Path(code).name} | {arm} | {sum(wall) / rounds:.2f} ({min(wall):.2f}) | "
                  f"{sum(cpu) / rounds:.2f} ({min(cpu):.2f}) | "
                  + " | ".join(f"{work['work'][k] / work['steps']:.0f}" for k in keys) + " |")
    for clock in ("seconds", "cpu_seconds"):
        for code in codes:
            ratios = [per_step(v["tool"], clock) / per_step(v["no tool"], clock) for v in runs[code]]
            print(f"{clock}: {Path(code).name}: tool / no tool per round " + ", ".join(f"{x:.2f}x" for x in ratios))
        first, last = codes[0], codes[-1]
        ratios = [per_step(a["tool"], clock) / per_step(b["tool"], clock)
                  for a, b in zip(runs[first], runs[last], strict=True)]
        print(f"{clock}: tool step, {Path(first).name} / {Path(last).name} per round: "
              + ", ".join(f"{x:.2f}x" for x in ratios))


def main() -> None:
    no_tool_start = (take_option("--no-tool-start") or [None])[0]
    codes, rounds = take_option("--code", repeated=True), int((take_option("--rounds") or [1])[0])
    json_out = (take_option("--json") or [None])[0]
    if codes:
        compare(codes, rounds, ["--no-tool-start", no_tool_start] if no_tool_start else [])
        return
    args = step_args(__doc__, 10, "agent-step")
    args.recipe = args.recipe or RECIPE
    install_counters()
    extra, out, rows, tool_start = list(args.overrides), args.out, [], args.start
    for arm, overrides, start in (("tool", extra, tool_start),
                                  ("no tool", [*extra, "agent.tools=[]"], no_tool_start or tool_start)):
        args.out, args.start = f"{out}-{arm.replace(' ', '_')}", start
        rows.append((arm, measure(args, overrides)))
    keys = list(rows[0][1].work)
    print(f"\n{args.steps} measured steps per arm (after 1 warm-up), {args.threads} thread(s)\n")
    print("| arm | s / step | " + " | ".join(f"{k} / step" for k in keys) + " |")
    print("|---|---|" + "---|" * len(keys))
    for arm, c in rows:
        per = [c.work[k] / c.steps for k in keys]
        print(f"| {arm} | {c.seconds / c.steps:.2f} | " + " | ".join(f"{v:.0f}" for v in per) + " |")
    tool, plain = rows[0][1], rows[1][1]
    print(f"\nstep time ratio tool / no tool: {tool.seconds / tool.steps / (plain.seconds / plain.steps):.2f}x")
    if json_out:
        Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(json_out).write_text(json.dumps({arm: vars(c) for arm, c in rows}))


if __name__ == "__main__":
    main()
