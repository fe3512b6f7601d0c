"""Agentic RL: multi-turn rollouts where tools return images (docs/agentic.md).

`AgentSpec.from_config` turns a recipe's `agent` section into what stage I needs; `vlmrl.agent.rollout` runs the
turns, `vlmrl.agent.render` turns them into tokens, `vlmrl.agent.env` and `vlmrl.agent.tools` are the user-facing
contracts.
"""

from __future__ import annotations

from dataclasses import dataclass

from vlmrl.agent.env import EnvFactory, resolve_env
from vlmrl.agent.rollout import AgentLimits, AgentRollout, agent_rollout
from vlmrl.agent.tools import Tool, resolve_tools, tools_system_prompt


@dataclass
class AgentSpec:
    """The tools, the per-sample environment factory and the budgets of a run's multi-turn rollouts."""

    limits: AgentLimits
    tools: dict[str, Tool]
    make_env: EnvFactory
    max_pixels: int | None  # the pixel budget images come back at (the processor's)
    env_workers: int = 8  # environment steps at once (vlmrl.agent.steps)

    @classmethod
    def from_config(cls, cfg, processor) -> AgentSpec | None:
        """None when the recipe's `agent` section is off (no tools, the built-in environment).

        Sets the processor's system prompt from the recipe: the tools' descriptions when the agent is on with
        `system_prompt`, else none, whatever a loaded checkpoint saved (an agentic checkpoint restores its tool
        prompt for serving; a run from it follows its own recipe)."""
        tools = resolve_tools(cfg.tools) if cfg.enabled else {}
        processor.system_prompt = tools_system_prompt(tools) if cfg.enabled and cfg.system_prompt and tools else None
        if not cfg.enabled:
            return None
        limits = AgentLimits(cfg.max_turns, cfg.turn_tokens, cfg.max_total_tokens, cfg.max_images)
        return cls(limits, tools, resolve_env(cfg.env), processor.max_image_pixels(), cfg.env_workers)

    def rollout(self, policy, prompts, samples, group_size, temperature, top_k=0, top_p=1.0,
                prompt_seeds=None, engine=None) -> AgentRollout:
        """`engine`: a `VLLMEngine` (rollout.engine=vllm) to sample every turn on; None: the built-in sampler."""
        return agent_rollout(policy, prompts, samples, group_size, self.limits, self.tools, self.make_env, temperature,
                             top_k, top_p, prompt_seeds, self.max_pixels, engine, self.env_workers)


__all__ = ["AgentLimits", "AgentRollout", "AgentSpec", "agent_rollout"]
