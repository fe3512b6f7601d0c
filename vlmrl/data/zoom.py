"""A task where the tool is necessary: name a small shape on a large canvas, readable only after zooming in.

The canvas is a `grid` x `grid` board of `cell`-px cells (default 3 x 3 of 112 px: 336 px). Every cell holds one
dark shape (circle, square or triangle) of 24-36 px; one cell, the target, is tinted blue, which stays visible at
any resolution. "What shape is in the blue cell?" At the tiny model's pixel budget (112 x 112) the whole canvas
shrinks threefold and a shape is 8-12 px, under one 14-px patch; the `zoom` tool on the target cell returns it at
the full budget, where the shape is 24-36 px.

Each sample carries `target_box` (the target cell, `[x1, y1, x2, y2]`) and a `demonstration`: the policy's messages
of a correct episode (zoom on the target cell, then answer), which SFT replays through the environment
(vlmrl.agent.demos). Train and held-out scenes never coincide (`is_held_out` of the scene's content).
"""

from __future__ import annotations

import json
from typing import Any

from PIL import Image, ImageDraw

from .sample import DataError, Sample, check_split, format_box, is_held_out, option_tag, resolve_options, task_rng

ZOOM_OPTIONS: dict[str, Any] = {"grid": 3, "cell": 112, "shape_px": (24, 36), "demo_on_target": 1.0}
SHAPES = ("circle", "square", "triangle")
PROBLEM = "What shape is in the blue cell?"
BACKGROUND, TINT, INK = (255, 255, 255), (90, 150, 255), (20, 20, 20)  # the tint far from white in luminance


def tool_call(name: str, arguments: dict) -> str:
    """A tool call in the Qwen/Hermes convention, spelled the one way demonstrations spell it (compact JSON: a
    few tokens for a small byte-level BPE, which cannot merge across the spaces of the default spelling)."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments}, separators=(',', ':'))}</tool_call>"


def cell_box(index: int, grid: int, cell: int) -> list[int]:
    row, col = divmod(index, grid)
    return [col * cell, row * cell, (col + 1) * cell, (row + 1) * cell]


def render_board(grid: int, cell: int, target: int, shapes: list[tuple[str, list[int]]]) -> Image.Image:
    image = Image.new("RGB", (grid * cell, grid * cell), BACKGROUND)
    draw = ImageDraw.Draw(image)
    x1, y1, x2, y2 = cell_box(target, grid, cell)
    draw.rectangle([x1, y1, x2 - 1, y2 - 1], fill=TINT)
    for shape, (a, b, c, d) in shapes:
        if shape == "circle":
            draw.ellipse([a, b, c - 1, d - 1], fill=INK)
        elif shape == "square":
            draw.rectangle([a, b, c - 1, d - 1], fill=INK)
        else:
            draw.polygon([(a, d - 1), (c - 1, d - 1), ((a + c - 1) / 2, b)], fill=INK)
    return image


def vocabulary(grid: int = 3, cell: int = 112) -> list[str]:
    """The task's text for the tiny tokenizer: the question, every demonstration message, the tool response."""
    texts = [PROBLEM, "<tool_response>\n", "\n</tool_response>"] + [f"<answer>{s}</answer>" for s in SHAPES]
    texts += [tool_call("zoom", {"box": cell_box(i, grid, cell)}) for i in range(grid * grid)]
    return texts * 200  # frequent enough that the BPE merges the calls' JSON into a few tokens


def zoom_shape(n: int, split: str, seed: int = 0, **options: Any) -> list[Sample]:
    """ "What shape is in the blue cell?" -> ``"triangle"`` (answer_type text); see the module docstring.

    Options: ``grid`` (cells per side), ``cell`` (px), ``shape_px`` ([min, max] shape size in px),
    ``demo_on_target`` (the share of demonstrations that zoom on the target cell; the others zoom on another cell,
    drawn uniformly, and name the shape that cell shows: an SFT start that reads a zoomed cell but finds the target
    only by chance, for RL to teach where to look). The boards do not depend on ``demo_on_target``: the same seed
    gives the same boards for every share."""
    task = "zoom_shape"
    check_split(task, split)
    opts = resolve_options(task, options, ZOOM_OPTIONS)
    grid, cell, (lo, hi) = int(opts["grid"]), int(opts["cell"]), opts["shape_px"]
    on_target = float(opts["demo_on_target"])
    if not 0.0 <= on_target <= 1.0:
        raise DataError(f"task {task!r}: demo_on_target is a share in [0, 1], got {on_target}")
    if grid < 2 or not 2 <= lo <= hi <= cell - 4:
        raise DataError(f"task {task!r}: need grid >= 2 and 2 <= shape_px[0] <= shape_px[1] <= cell - 4; got "
                        f"grid={grid}, cell={cell}, shape_px={list(opts['shape_px'])}")
    tag = option_tag(options, ZOOM_OPTIONS)
    board_tag = option_tag({k: v for k, v in options.items() if k != "demo_on_target"}, ZOOM_OPTIONS)
    samples = []
    for index in range(n):
        rng = task_rng(task, split, seed, board_tag, index)
        for _ in range(1000):
            target = rng.randrange(grid * grid)
            shapes = []
            for i in range(grid * grid):
                size = rng.randint(lo, hi)
                x0, y0, _, _ = cell_box(i, grid, cell)
                a, b = x0 + rng.randint(2, cell - size - 2), y0 + rng.randint(2, cell - size - 2)
                shapes.append((rng.choice(SHAPES), [a, b, a + size, b + size]))
            key = json.dumps([grid, cell, target, shapes], separators=(",", ":"))
            if is_held_out(key) == (split != "train"):
                break
        else:  # pragma: no cover - the held-out side holds 20% of boards
            raise DataError(f"task {task!r}: found no {split} board in 1000 draws")
        box = cell_box(target, grid, cell)
        answer = shapes[target][0]
        looked = target
        if on_target < 1.0:  # a demonstration that zooms elsewhere, from a stream of its own (boards unchanged)
            demo_rng = task_rng(task, split, seed, f"{tag}/demo", index)
            if demo_rng.random() >= on_target:
                looked = demo_rng.choice([i for i in range(grid * grid) if i != target])
        samples.append({
            "id": f"{task}{tag}/{split}/{index}", "images": [render_board(grid, cell, target, shapes)],
            "problem": PROBLEM, "solution": answer, "answer_type": "text", "task": task,
            "target_box": format_box(box), "width": grid * cell, "height": grid * cell,
            # (zoom on a cell, name the shape the zoom shows: the target's, unless demo_on_target sent it elsewhere)
            "demonstration": [tool_call("zoom", {"box": cell_box(looked, grid, cell)}),
                              f"<answer>{shapes[looked][0]}</answer>"],
        })
    return samples
