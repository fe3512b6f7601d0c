"""Rewards of multi-turn episodes (vlmrl.agent): how the policy used its tools, from the episode's columns."""

from __future__ import annotations

from typing import Any

from vlmrl.rewards.registry import register_reward


@register_reward("tool_use", inline=True, grades=())
def tool_use_reward(completions: list[str], *, tool_calls: list[int] | None = None,
                    tool_failures: list[int] | None = None, max_calls: int = 2, **_: Any) -> list[float | None]:
    """The tool-use format: 1.0 for an episode that made 1 to `max_calls` tool calls, every one valid (parsed, a
    known tool, arguments matching its schema, no error or time-out), else 0.0. None (not applicable) for every row
    when the rollout has no tool columns (a single-turn run)."""
    if tool_calls is None or tool_failures is None:
        return [None] * len(completions)
    return [1.0 if 1 <= calls <= max_calls and failed == 0 else 0.0
            for calls, failed in zip(tool_calls, tool_failures, strict=True)]
