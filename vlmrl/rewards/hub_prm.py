"""A published process reward model served by vLLM, as a `reward_model` member: Qwen2.5-Math-PRM and others of
vLLM's `*ForProcessRewardModel` (`vllm serve Qwen/Qwen2.5-Math-PRM-7B --runner pooling`).

    rewards:
      - {name: reward_model, path: http://rm-host:8000/v1,
         kwargs: {server: vllm, process: {step_token: "<extra_0>", aggregate: min},
                  system: "Please reason step by step, and put your final answer within \\\\boxed{}."}}

Each answer is split into steps as the `process` reward splits it (`split`, `think_tag`: the think block's lines by
default); what follows the last step (the answer) joins it. The assistant turn is the steps, each followed
by `step_token`, as the model card builds it ("<extra_0>".join(steps) + "<extra_0>"); vLLM's step pooling returns,
for each step token, the classifier's [wrong, right] probabilities, and the step's score is the second. An answer's
reward aggregates its steps (`aggregate`: min, product, last, mean, as vlmrl's own PRMs). An answer without steps,
an answer or prompt that writes `step_token` itself, or a reply with another number of steps than were sent (a
server whose step tag is not `step_token`: vLLM's `--pooler-config '{"step_tag_id": ID}'`) is a RewardFailure that
says so, never a guess.
"""

from __future__ import annotations

import json
import re
from typing import Any

from vlmrl.errors import ConfigError
from vlmrl.rewards.hub_rm import CONTROL_TOKENS, VllmRewardModel, conversations
from vlmrl.rewards.reasoning import NO_STEPS
from vlmrl.rewards.registry import RewardFailure

PROCESS_KEYS = ("step_token", "aggregate", "split", "think_tag")


def pooling_reply(raw: bytes, attempts: int) -> list[float] | None:
    """The per-step probabilities of "right" in a vLLM /pooling reply of a process RM (None for another body)."""
    try:
        data = json.loads(raw)["data"]
        steps = data[0]["data"]
        if len(data) != 1 or not all(len(p) == 2 for p in steps):
            return None
        return [float(p[1]) for p in steps]
    except (ValueError, KeyError, IndexError, TypeError):
        return None


def step_texts(completion: str, split: str, think_tag: str) -> list[str]:
    """The answer's steps as text (the `process` reward's split); what follows the last step (the answer, its think
    tags dropped) joins it."""
    from vlmrl.rewards.reasoning import step_spans

    spans = step_spans(completion, split, think_tag)
    steps = [s for s in (completion[a:b].strip() for a, b in spans) if s]
    tail = re.sub(rf"</?{re.escape(think_tag)}>", "", completion[spans[-1][1]:]).strip() if spans else ""
    if steps and tail:
        steps[-1] = f"{steps[-1]}\n{tail}"
    return steps


class VllmProcessRewardModel(VllmRewardModel):
    """The client of a process RM served by vLLM: POST /pooling per answer (chat form), one probability per step."""

    kind = "process"
    route = "/pooling"

    def parse(self, raw: bytes, attempts: int) -> Any:
        return pooling_reply(raw, attempts)

    def scores(self, completions: list[str], samples: list[dict], truncated: list[bool],
               template: str = "{problem}", system: str | None = None, process: dict | None = None) -> list[Any]:
        """Each answer's aggregated step score, or a RewardFailure saying why it has none."""
        from vlmrl.models.reward_model import AGGREGATES, aggregate_steps

        cfg = {"step_token": "<extra_0>", "aggregate": "min", "split": "lines", "think_tag": "think",
               **(process or {})}
        unknown = sorted(set(cfg) - set(PROCESS_KEYS))
        if unknown or cfg["aggregate"] not in AGGREGATES:
            raise ConfigError(f"reward_model process: {unknown or cfg['aggregate']!r}; keys are {PROCESS_KEYS}, "
                              f"aggregate one of {AGGREGATES}")
        token = cfg["step_token"]
        special = re.compile(f"{CONTROL_TOKENS.pattern}|{re.escape(token)}")
        values: list[Any] = conversations(completions, samples, template, system, special,
                                          f"reward_model {self.endpoint.url}")
        steps: dict[int, int] = {}
        for i, messages in enumerate(values):
            if isinstance(messages, RewardFailure):
                continue
            texts = step_texts(str(completions[i]), cfg["split"], cfg["think_tag"])
            if not texts:
                values[i] = RewardFailure(NO_STEPS)
                continue
            messages[-1]["content"] = "".join(f"{t}{token}" for t in texts)
            steps[i] = len(texts)
        todo = sorted(steps)
        bodies = [{"model": self.model, "messages": values[i], "continue_final_message": bool(truncated[i])}
                  for i in todo]
        for i, reply in zip(todo, self._pool.map(self._post, bodies), strict=True):
            if isinstance(reply, RewardFailure):
                values[i] = reply
            elif len(reply) != steps[i]:
                values[i] = RewardFailure(f"reward model {self.endpoint.url}: {len(reply)} step scores for "
                                          f"{steps[i]} steps; is its step tag {token!r} (vLLM's pooler step_tag_id)?")
            else:
                values[i] = aggregate_steps(reply, cfg["aggregate"])
        return values
