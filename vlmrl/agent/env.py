"""Environments: what answers the policy between its turns, in the style of the reward contract (plain callables).

An environment is created per sample by a factory, `make_env(sample, tools, context) -> Environment`, that gets the
sample's columns. Each turn it receives the policy's message (its decoded text) and returns an `Observation`: the
next user-side content as blocks (`{"type": "text", "text"}`, `{"type": "image", "image": PIL.Image}`), whether the
episode is done, and optionally a reward. The built-in `ToolEnvironment` runs the tool calls of the message
(vlmrl.agent.tools) and ends the episode on a message without any; a user environment (a game, a simulator, a
checker that gives feedback) is any object with a `step(message) -> Observation` method, named in a recipe as
`agent.env: path/to/file.py:make_env`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from vlmrl.agent.tools import Tool, ToolContext, ToolResult, run_calls


@dataclass
class Observation:
    """What the policy sees next (empty when done), whether the episode ended, and the environment's reward."""

    content: list[dict] = field(default_factory=list)
    done: bool = False
    reward: float | None = None
    tool_results: list[ToolResult] = field(default_factory=list)
    # what the environment knows about this turn, kept with the turn (e.g. `on_target`: the zoom box covers the
    # sample's `target_box`); the agent metrics report the share of episodes whose first value is true
    info: dict = field(default_factory=dict)


class Environment(Protocol):
    def step(self, message: str) -> Observation: ...


EnvFactory = Callable[[dict, dict[str, Tool], ToolContext], Environment]


class ToolEnvironment:
    """The policy's tool calls run and their results come back as a tool response; a message with no tool call is
    the final answer and ends the episode (the rewards then score it)."""

    def __init__(self, sample: dict, tools: dict[str, Tool], context: ToolContext):
        self.sample, self.tools, self.context = sample, tools, context

    def step(self, message: str) -> Observation:
        results = run_calls(message, self.tools, self.context)
        if not results:
            return Observation(done=True)
        content: list[dict] = []
        for r in results:
            content += r.content
        return Observation(content, tool_results=results, info=target_info(self.sample, results))


def target_info(sample: dict, results: list[ToolResult]) -> dict:
    """`{"on_target": bool}` for a turn whose first working call looks at a region (`box`) of a sample that names
    its `target_box` (the zoom task): the region's IoU with the target is at least 0.5. Empty otherwise."""
    target = sample.get("target_box")
    box = next((r.arguments["box"] for r in results if r.ok and r.arguments and "box" in r.arguments), None)
    if target is None or box is None:
        return {}
    from vlmrl.rewards.boxes import box_iou
    from vlmrl.rewards.parsing import parse_boxes

    truth = parse_boxes(target) if isinstance(target, str) else [tuple(float(v) for v in target)]
    return {"on_target": bool(truth) and box_iou(tuple(float(v) for v in box), truth[0]) >= 0.5}


def tool_environment(sample: dict, tools: dict[str, Tool], context: ToolContext) -> ToolEnvironment:
    return ToolEnvironment(sample, tools, context)


ENVIRONMENTS: dict[str, EnvFactory] = {"tools": tool_environment}


def resolve_env(ref: str) -> EnvFactory:
    from vlmrl.references import resolve_reference

    return resolve_reference(ref, "environment", ENVIRONMENTS)
