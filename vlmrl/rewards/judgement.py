"""`judgement`: the reward of a model that learns to judge (ReCLIP's generative reward model, vlmrl.reclip.grm).

The solution is a judge's reply (`- attribute: expected != got` lines, then `[RELEVANT]` or `[IRRELEVANT]`, as
`vlmrl reclip grm-data` writes the programmatic judge's); the completion is read as ReCLIP reads any LLM judge's
reply (`vlmrl.reclip.grm.read_reply`). Value: half for the verdict, half for the reasons' F1 over
(attribute, expected, got), 1 when neither has a reason; 0 for a reply without a verdict. 1.0 means full agreement,
so `solved: {reward: judgement, threshold: 1.0}` counts the judgements that agree exactly. A solution that is not a
judge reply is a failure of that sample (fix the data), never a silent 0.
"""

from __future__ import annotations

from vlmrl.rewards.parsing import completion_text
from vlmrl.rewards.registry import RewardFailure, register_reward


@register_reward("judgement", inline=True, grades=("text",))
def judgement_reward(completions, solution, **_) -> list[float]:
    from vlmrl.reclip.grm import agreement_score, read_reply

    out: list[float] = []
    for completion, gold_text in zip(completions, solution, strict=True):
        gold = read_reply(gold_text or "")
        if gold is None:
            out.append(RewardFailure(f"judgement: the solution {str(gold_text)[:80]!r} is not a judge reply (reasons, "
                                     "then [RELEVANT] or [IRRELEVANT]); write it as vlmrl reclip grm-data does"))
            continue
        out.append(agreement_score(read_reply(completion_text(completion)), gold))
    return out
