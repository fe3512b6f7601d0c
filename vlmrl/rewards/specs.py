"""A recipe's `rewards` list as `RewardSpec`s, with the options that follow other recipe keys filled in.

The soft overlong penalty (`length`) is about the generation budget, so unless a recipe sets them its `max_length`
is that budget (`rollout.max_new_tokens`; with an agent, the policy tokens an episode may spend) and its
`cache_length` a third of `max_length` (the quickstart's 12 and 4). The label-length check tells a user whose labels
do not fit to raise `rollout.max_new_tokens`; the penalty then moves with it instead of punishing the answers the
new budget allows. A `max_length` a recipe writes below the budget is kept, and `budget_warnings` names it.

Every command that scores answers builds its rewards here (`vlmrl train`, `vlmrl eval`, the control run,
`vlmrl inspect-reward`), so they all score with the same options.
"""

from __future__ import annotations

from typing import Any

from vlmrl.rewards.registry import RewardSpec

CACHE_SHARE = 3  # cache_length = max_length // CACHE_SHARE unless set: the quickstart's 12 -> 4


def generation_budget(cfg: Any) -> tuple[str, int]:
    """(key, tokens): the most tokens an answer can have, as `completion_lengths` counts them. Single-turn:
    `rollout.max_new_tokens`; multi-turn: the policy's tokens over an episode, at most `agent.max_turns x
    agent.turn_tokens` and `agent.max_total_tokens`."""
    agent = getattr(cfg, "agent", None)
    if agent is not None and agent.enabled:
        return "agent.max_total_tokens", min(agent.max_total_tokens, agent.max_turns * agent.turn_tokens)
    return "rollout.max_new_tokens", cfg.rollout.max_new_tokens


def length_kwargs(kwargs: dict[str, Any], budget: int) -> dict[str, Any]:
    """The `length` reward's options with `max_length` (default: `budget`) and `cache_length` (default:
    max_length // 3, at least 1) filled in where the recipe left them out."""
    out = dict(kwargs)
    out.setdefault("max_length", budget)
    if isinstance(out["max_length"], int):
        out.setdefault("cache_length", max(1, out["max_length"] // CACHE_SHARE))
    return out


def reward_specs(cfg: Any) -> list[RewardSpec]:
    """The recipe's reward components (`cfg.rewards`), `length`'s limits following the generation budget."""
    _, budget = generation_budget(cfg)
    specs = [RewardSpec.from_config(r) for r in cfg.rewards]
    for spec in specs:
        if spec.name == "length":
            spec.kwargs = length_kwargs(spec.kwargs, budget)
    return specs


def budget_warnings(cfg: Any) -> list[str]:
    """One sentence per `length` reward whose recipe sets `max_length` below the generation budget: answers the
    budget allows are then penalised (to -1 past max_length), so a raised `rollout.max_new_tokens` never pays."""
    key, budget = generation_budget(cfg)
    out = []
    for i, r in enumerate(cfg.rewards):
        limit = r.kwargs.get("max_length") if r.name == "length" else None
        if isinstance(limit, int) and limit < budget:
            cache = length_kwargs(r.kwargs, budget)["cache_length"]
            out.append(f"rewards[{i}] ({r.label or r.name}): max_length={limit} is below {key}={budget}, so answers "
                       f"longer than {limit - cache} tokens are penalised (-1 from {limit} tokens on) although "
                       f"generation allows {budget}; remove max_length and cache_length from the recipe to "
                       f"follow {key}, or set max_length={budget}")
    return out
