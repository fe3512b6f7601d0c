"""Prompt log-probs for `vlmrl serve`: the model's log-prob of every token of a request's prompt, as vLLM's
`prompt_logprobs` returns them, so a served model can score text it did not write (a served teacher for on-policy
distillation, vlmrl.trainer.served_teacher).

The prompt (images in place) goes through the model once, teacher-forced; position t's entry is the log-softmax of
the logits at t - 1, in float32, at temperature 1, for the token at t and the `top` most likely tokens there. The
first token has no entry (None), as in vLLM. An entry is `{token_id: {"logprob", "rank", "decoded_token"}}` (ids as
JSON keys; `rank` 1 for the most likely token), the prompt's own token first. The logits are made `chunk` positions
at a time, so a long prompt never holds [length, vocabulary] floats at once.
"""

from __future__ import annotations

import torch

from vlmrl.models.batch import PromptBatch
from vlmrl.models.policy import Policy


@torch.no_grad()
def prompt_logprobs(policy: Policy, prompt: PromptBatch, top: int = 0, chunk: int = 64) -> list[dict | None]:
    """vLLM-style prompt log-probs of the one-row `prompt` (module docstring)."""
    family, tokenizer = policy.family, policy.processor.tokenizer
    pe = family.prompt_embeds(prompt)
    hidden = family.forward_hidden(pe.embeds, pe.attention_mask, pe.position_ids, None, pe.extras)[0]
    keep = prompt.attention_mask[0].bool().to(hidden.device)  # a one-row prompt has no padding; kept for safety
    hidden, ids = hidden[keep], prompt.input_ids[0].to(hidden.device)[keep]
    out: list[dict | None] = [None]
    for start in range(0, len(ids) - 1, chunk):
        logp = torch.log_softmax(family.lm_head(hidden[start:start + chunk]).float(), -1)
        targets = ids[start + 1:start + 1 + len(logp)]
        logp = logp[:len(targets)]
        chosen = logp.gather(1, targets[:, None]).squeeze(1)
        ranks = (logp > chosen[:, None]).sum(1) + 1
        best = logp.topk(min(top, logp.shape[1]), -1) if top else None
        for i, token in enumerate(targets.tolist()):
            entry = {str(token): {"logprob": float(chosen[i]), "rank": int(ranks[i]),
                                  "decoded_token": tokenizer.decode([token])}}
            if best is not None:
                for rank, (t, v) in enumerate(zip(best.indices[i].tolist(), best.values[i].tolist(), strict=True)):
                    entry.setdefault(str(t), {"logprob": float(v), "rank": rank + 1,
                                              "decoded_token": tokenizer.decode([t])})
            out.append(entry)
    return out
