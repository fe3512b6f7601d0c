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
"""

from __future__ import annotations

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
        self.seconds, self.steps = 0.0, 0
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
        t0 = time.perf_counter()
        try:
            yield
        finally:
            counts.seconds += time.perf_counter() - t0
            counts.steps += 1
            CURRENT[0] = None

    args.overrides = overrides
    run_steps(args, 1, timed)
    return counts


def main() -> None:
    extra = [a for a in sys.argv[1:]]
    no_tool_start = None
    if "--no-tool-start" in extra:  # (step_args knows the shared options only)
        at = extra.index("--no-tool-start")
        no_tool_start = extra[at + 1]
        sys.argv = [sys.argv[0], *extra[:at], *extra[at + 2:]]
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


if __name__ == "__main__":
    main()
