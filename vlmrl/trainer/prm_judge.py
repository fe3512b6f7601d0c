"""Step labels from an LLM judge: each reasoning step of an answer is shown to a judge (any OpenAI-compatible
endpoint, through `vlmrl.rewards.judge.JudgeClient`) with the question, the image(s), the reference answer and the
steps before it, and the judge says whether that step is right.

    answer ──► steps s_1..s_K ──► for each k: judge(question, reference, "Step 1: s_1 ... Step k: s_k") ──► label_k

label_k is 1.0 for [RELEVANT] (the step is right) and 0.0 for [IRRELEVANT]; a graded judge (`graded=True`) gives
its probability of [RELEVANT] instead, a soft label. This is the other way PRMs are labelled (PRM800K's labels are
human judgements; a strong model's are the usual stand-in): where Math-Shepherd's continuations
(`vlmrl.trainer.prm_labels`) ask what the policy can still reach from a step, a judge reads the step itself, so the
labels can be as good as a model stronger than the policy. An answer with a step the judge did not grade (a failed
request, a reply without a verdict) cannot be a training row: it is left out and counted, never labelled 0.
"""

from __future__ import annotations

from collections import Counter

from vlmrl.rewards.judge import JudgeCache, JudgeClient
from vlmrl.rewards.reasoning import step_spans
from vlmrl.trainer.prm_labels import verdicts

STEP_TEMPLATE = """You check one step of a worked answer to a question about the attached image(s).

Question: {question}
Reference answer: {reference}
The answer's reasoning so far:
{prediction}

Is the last step above correct, given the question, the image(s) and the steps before it? Give at most \
{max_reasons} short reasons, one per line, each starting with "+" if it supports the step or "-" if it counts \
against it. Then end with one line that holds exactly one verdict tag: [RELEVANT] if the last step is correct, \
[IRRELEVANT] if it is not."""


def steps_so_far(steps: list[str], k: int) -> str:
    """The reasoning shown to the judge for step k (0-based): steps 1..k+1, one numbered line each."""
    return "\n".join(f"Step {j + 1}: {s.strip()}" for j, s in enumerate(steps[:k + 1]))


def judge_steps(client: JudgeClient, samples: list[dict], answers: list[list[str]], split: str = "lines",
                think_tag: str = "think", question_column: str = "problem", send_images: bool = True,
                ) -> tuple[list[dict], dict]:
    """Step-labelled rows (as `vlmrl.trainer.prm_labels.label_steps` writes them: {**sample, id, group,
    completion, labels, correct}) for each sample's answers that have reasoning steps, every step's label the
    judge's verdict; and counts: answers, with_steps, judged (rows), ungraded (answers left out: a step without a
    verdict), requests (distinct step prompts sent; identical ones are sent once), and `error`: why the first
    ungraded step was not graded (None when all were)."""
    jobs = []  # (sample index, answer, its steps)
    count: dict = {"answers": 0, "ungraded": 0, "error": None}
    for i, texts in enumerate(answers):
        for text in texts:
            count["answers"] += 1
            spans = step_spans(text, split, think_tag)
            if spans:
                jobs.append((i, text, [text[a:b] for a, b in spans]))
    count["with_steps"] = len(jobs)
    encoded: dict = {}
    unique: dict[str, list[dict]] = {}
    keys: list[list[str]] = []  # per job, per step: the request's text key
    for s_i, _, steps in jobs:
        s = samples[s_i]
        images = list(s.get("images") or []) if send_images else None
        row_keys = []
        for k in range(len(steps)):
            messages = client.messages(str(s[question_column]), steps_so_far(steps, k), str(s["solution"]), images,
                                       encoded)
            key = JudgeCache.key(client.model, messages, client.settings)
            unique.setdefault(key, messages)
            row_keys.append(key)
        keys.append(row_keys)
    count["requests"] = len(unique)
    results = dict(zip(unique, client.judge_many(list(unique.values())), strict=True))
    outcome = verdicts([samples[s_i] for s_i, _, _ in jobs], [text for _, text, _ in jobs], [False] * len(jobs))
    out, per_sample = [], Counter()
    for (s_i, text, _), row_keys, right in zip(jobs, keys, outcome, strict=True):
        labels = [None if results[k].failed or results[k].feedback is None else results[k].feedback.score
                  for k in row_keys]
        if any(v is None for v in labels):
            count["ungraded"] += 1
            count["error"] = count["error"] or next(results[k].error or "a reply without a verdict"
                                                    for k, v in zip(row_keys, labels, strict=True) if v is None)
            continue
        sample_id = str(samples[s_i]["id"])
        per_sample[sample_id] += 1
        out.append({**samples[s_i], "id": f"{sample_id}#{per_sample[sample_id]}", "group": sample_id,
                    "completion": text, "labels": [float(v) for v in labels], "correct": right})
    count["judged"] = len(out)
    return out, count
