"""What the colocated vLLM engine (vlmrl.rollout.vllm_engine) is sent and what it answers, as plain data: one
`EngineRequest` per prompt or per live trajectory, built from the rows of a `PromptBatch` (or the `ConversationBatch`
of whole trajectories) exactly as the training forward sees them, and vLLM's outputs turned back into a `Rollout`.

A request carries the row's token ids (its prompt, and for a trajectory every sampled id and every observation id
after it, never re-tokenised text), all its images in order, its own seed, its own token budget and its number of
answers. Before anything is sent, each row's image placeholder tokens are counted against its images' features
(the batch's `image_tokens`): vLLM fills every placeholder token with image features, so a row whose count differs
(an image lost on the way, or a placeholder id the policy sampled itself) is a `DataError` naming the sample and
the turn.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vlmrl.errors import DataError
from vlmrl.models.batch import PromptBatch
from vlmrl.models.policy import Policy
from vlmrl.rollout.generate import Rollout


@dataclass
class EngineRequest:
    """One prompt or one live trajectory: `n` answers of at most `max_tokens` tokens each after `ids`."""

    ids: list[int]  # the whole row's token ids as the trainer scores them, image placeholders expanded
    images: list = field(default_factory=list)  # every image of the row, in order (PIL)
    image_tokens: list[int] = field(default_factory=list)  # each image's features (its placeholders in `ids`)
    seed: int | None = None  # the row's own random stream (None: vLLM's)
    max_tokens: int = 1  # this row's budget
    n: int = 1  # answers (a prompt's group at turn 0; 1 for a trajectory's next turn)
    sample_id: str = ""
    turn: int | str = 0


def batch_requests(policy: Policy, batch: PromptBatch, images: list[list], seeds: list[int | None] | None,
                   budgets: list[int], n: int = 1, turn: int | str = 0) -> list[EngineRequest]:
    """One request per row of `batch`: its unpadded ids, `images[i]` (the row's PIL images: the prompt's, then each
    observation's), `seeds[i]`, `budgets[i]` tokens, `n` answers. Checks every row's placeholder tokens against its
    images (module docstring)."""
    image_token = policy.processor.image_token_id
    requests, at = [], 0
    for i in range(len(batch)):
        ids = batch.input_ids[i][batch.attention_mask[i].bool()]
        count = batch.images_per_prompt[i] if batch.images_per_prompt else 0
        features = sum(batch.image_tokens[at:at + count])
        at += count
        placeholders = int((ids == image_token).sum()) if image_token is not None else 0
        name = batch.sample_ids[i]
        if len(images[i]) != count or placeholders != features:
            raise DataError(f"sample {name!r}, turn {turn}: the request to vLLM has {placeholders} image placeholder "
                            f"tokens and {len(images[i])} image(s), but the trajectory's {count} image(s) give "
                            f"{features} features")
        requests.append(EngineRequest(ids.tolist(), list(images[i]), list(batch.image_tokens[at - count:at]),
                                      None if seeds is None else seeds[i], int(budgets[i]), n, name, turn))
    return requests


def to_rollout(policy: Policy, outputs, group_size: int, max_new_tokens: int) -> Rollout:
    """vLLM's RequestOutputs (one per request, `group_size` completions each) as a `Rollout`: ids right-padded to
    max_new_tokens, mask 1 on generated tokens (the end token included), sampling log-probs, truncation flags."""
    n = len(outputs) * group_size
    ids = torch.full((n, max_new_tokens), policy.pad_token_id, dtype=torch.long)
    mask = torch.zeros((n, max_new_tokens), dtype=torch.long)
    logps = torch.zeros((n, max_new_tokens))
    truncated = torch.zeros(n, dtype=torch.bool)
    eos = set(policy.eos_token_ids)
    row = 0
    for out in outputs:
        if len(out.outputs) != group_size:
            raise RuntimeError(f"vLLM returned {len(out.outputs)} answers for a prompt, expected {group_size}")
        for completion in out.outputs:
            tokens = list(completion.token_ids)[:max_new_tokens]
            ids[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            mask[row, :len(tokens)] = 1
            for t, (token, entry) in enumerate(zip(tokens, completion.logprobs or [], strict=False)):
                logps[row, t] = entry[token].logprob
            truncated[row] = not tokens or tokens[-1] not in eos
            row += 1
    clean = ids.masked_fill(torch.isin(ids, torch.tensor(sorted(eos))), policy.pad_token_id)
    texts = policy.processor.tokenizer.batch_decode(clean, skip_special_tokens=True)
    index = torch.arange(len(outputs)).repeat_interleave(group_size)
    return Rollout(index, ids, mask, logps, truncated, texts)
