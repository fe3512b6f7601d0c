"""SFT on demonstrations of tool use: a sample's `demonstration` (the policy's messages, in order) replayed through
its own environment, so the observations a demonstration trains on are exactly those a rollout would see.

Each message is tokenised with the end-of-turn token appended and masked in; each observation between two messages
is rendered as in a rollout (vlmrl.agent.render) and masked out. A demonstration whose environment ends early or
whose tool call fails is a `DataError` naming the sample and the turn: it would teach a call that does not work.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vlmrl.agent.render import TurnRenderer, conversation_batch
from vlmrl.agent.tools import ToolContext
from vlmrl.errors import DataError
from vlmrl.models.batch import ConversationBatch, PromptBatch


def demonstration_batch(policy, agent, prompts: PromptBatch, samples: list[dict]
                        ) -> tuple[ConversationBatch, Tensor, Tensor]:
    """(conversations, completion ids [N, T], loss mask [N, T]) of each sample's demonstration after its prompt."""
    tok, eos = policy.processor.tokenizer, policy.eos_token_ids[0]
    renderer = TurnRenderer(policy.processor)
    tails, masks, images = [], [], []
    for s in samples:
        sid, messages = str(s.get("id")), s["demonstration"]
        if not isinstance(messages, list) or not messages or not all(isinstance(m, str) for m in messages):
            raise DataError(f"sample {sid!r}: `demonstration` must be a non-empty list of the policy's messages")
        context = ToolContext(list(s.get("images") or []), agent.max_pixels, s)
        env = agent.make_env(s, agent.tools, context)
        ids, mask, seen = [], [], []
        for turn, message in enumerate(messages):
            own = tok(message, add_special_tokens=False)["input_ids"] + [eos]
            ids, mask = ids + own, mask + [1] * len(own)
            if turn == len(messages) - 1:
                break
            obs = env.step(message)
            failed = [r for r in obs.tool_results if not r.ok]
            if failed:
                raise DataError(f"sample {sid!r}, demonstration turn {turn}: the tool call failed: "
                                f"{failed[0].content[0]['text']}")
            if obs.done:
                raise DataError(f"sample {sid!r}: the environment ended the episode after demonstration turn {turn} "
                                f"of {len(messages)}; does that message make a tool call?")
            obs_ids, obs_images, _ = renderer.observation(obs.content, sid, turn + 1)
            ids, mask = ids + obs_ids, mask + [0] * len(obs_ids)
            seen += obs_images
        tails.append(ids)
        masks.append(mask)
        images.append(seen)
    batch = conversation_batch(policy.processor, prompts, list(range(len(samples))), tails, images, masks)
    width = max(len(t) for t in tails)
    ids = torch.full((len(tails), width), policy.pad_token_id, dtype=torch.long)
    loss_mask = torch.zeros((len(tails), width), dtype=torch.long)
    for i, (t, m) in enumerate(zip(tails, masks, strict=True)):
        ids[i, :len(t)] = torch.tensor(t)
        loss_mask[i, :len(m)] = torch.tensor(m)
    return batch, ids, loss_mask
