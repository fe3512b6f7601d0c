"""Automatic step labels (Math-Shepherd): a step is as good as the answers that continue from it.

For an answer whose reasoning splits into steps s_1..s_K (`vlmrl.rewards.reasoning.step_spans`), to a prompt with a
verifiable solution, the policy continues M times from the prompt plus the answer up to the end of step k, and each
continuation's final answer is checked (the `accuracy` reward):

    soft label_k = (right continuations from step k) / M        hard label_k = 1 if any of them is right, else 0

as Wang et al. (2024, "Math-Shepherd") estimate them: a step after which the policy can no longer reach the answer is
wrong, whatever its text. `vlmrl rm label` writes the answers and their labels as a step-labelled file that
`vlmrl rm train data.steps={path: FILE}` fits a process RM on.
"""

from __future__ import annotations

from collections import Counter

import torch

from vlmrl.models.batch import concat_prompt_batches
from vlmrl.models.policy import Policy
from vlmrl.rewards.reasoning import step_spans
from vlmrl.rewards.verifiable import accuracy_reward
from vlmrl.rollout.batch import make_prompts
from vlmrl.rollout.generate import generate

VERDICT_COLUMNS = ("answer_type", "width", "height", "options", "choices")


def estimate_labels(verdicts: list[list[bool]], hard: bool = False) -> list[float]:
    """Step labels from the verdicts of each step's continuations: the share that is right (soft), or whether any
    is (hard)."""
    if hard:
        return [float(any(v)) for v in verdicts]
    return [sum(v) / len(v) for v in verdicts]


def verdicts(samples: list[dict], texts: list[str], truncated: list[bool]) -> list[bool]:
    """Whether each text's final answer is right for its sample (the `accuracy` reward, strict)."""
    columns = {k: [s.get(k) for s in samples] for k in VERDICT_COLUMNS if any(k in s for s in samples)}
    scores = accuracy_reward(texts, [s["solution"] for s in samples], completion_truncated=truncated, **columns)
    return [bool(v) for v in scores]


def continuation_prompts(policy: Policy, samples: list[dict], prefixes: list[str], template: str = "{problem}",
                         max_prompt_length: int | None = None) -> object:
    """Prompts that end inside the answer: each sample's chat-formatted prompt followed by its answer's prefix, so
    generation continues the answer from there."""
    proc = policy.processor
    batches = []
    for s, prefix in zip(samples, prefixes, strict=True):
        images = list(s.get("images") or [])
        text = proc.prompt_text(template.format(**s), len(images)) + prefix
        batches.append(proc.build([text], [images], [str(s["id"])], max_prompt_length))
    return concat_prompt_batches(batches, policy.pad_token_id)


@torch.no_grad()
def sample_answers(policy: Policy, samples: list[dict], answers: int, max_new_tokens: int, temperature: float = 1.0,
                   template: str = "{problem}", seed: int = 0, chunk: int = 32) -> list[list[tuple[str, bool]]]:
    """`answers` sampled answers (text, truncated) per sample, from the policy."""
    out: list[list[tuple[str, bool]]] = []
    generator = torch.Generator().manual_seed(seed)
    for start in range(0, len(samples), chunk):
        part = samples[start:start + chunk]
        with policy.sampling():
            r = generate(policy, make_prompts(policy, part, template), answers, max_new_tokens, temperature,
                         generator=generator)
        for i in range(len(part)):
            out.append([(r.texts[i * answers + g], bool(r.truncated[i * answers + g])) for g in range(answers)])
    return out


@torch.no_grad()
def label_steps(policy: Policy, samples: list[dict], answers: list[list[str]], continuations: int = 8,
                max_new_tokens: int = 32, temperature: float = 1.0, split: str = "lines", think_tag: str = "think",
                hard: bool = False, template: str = "{problem}", seed: int = 0, chunk: int = 32) -> list[dict]:
    """Step-labelled rows for each sample's answers that have reasoning steps: {**sample, id (the sample's, #k for
    its k-th answer), group (the sample's id: its answers stay on one side of a held-out split), completion, labels,
    continuations (right ones per step), correct (the answer's own verdict)}. Every step of every answer is continued
    `continuations` times from the prefix ending with it."""
    jobs = []  # (sample index, answer text, step spans)
    for i, texts in enumerate(answers):
        for text in texts:
            spans = step_spans(text, split, think_tag)
            if spans:
                jobs.append((i, text, spans))
    prefixes = [(i, j, text[:end]) for i, (s_i, text, spans) in enumerate(jobs) for j, (_, end) in enumerate(spans)]
    right: dict[tuple[int, int], list[bool]] = {}
    generator = torch.Generator().manual_seed(seed)
    for start in range(0, len(prefixes), chunk):
        part = prefixes[start:start + chunk]
        part_samples = [samples[jobs[i][0]] for i, _, _ in part]
        prompts = continuation_prompts(policy, part_samples, [p for _, _, p in part], template)
        with policy.sampling():
            r = generate(policy, prompts, continuations, max_new_tokens, temperature, generator=generator)
        rows = r.prompt_index.tolist()
        texts = [part[k][2] + t for k, t in zip(rows, r.texts, strict=True)]
        ok = verdicts([part_samples[k] for k in rows], texts, r.truncated.tolist())
        for k, v in zip(rows, ok, strict=True):
            right.setdefault(part[k][:2], []).append(v)
    outcome = verdicts([samples[s_i] for s_i, _, _ in jobs], [text for _, text, _ in jobs], [False] * len(jobs))
    out, count = [], Counter()
    for i, (s_i, text, spans) in enumerate(jobs):
        steps = [right[(i, j)] for j in range(len(spans))]
        sample_id = str(samples[s_i]["id"])
        count[sample_id] += 1
        out.append({**samples[s_i], "id": f"{sample_id}#{count[sample_id]}", "group": sample_id, "completion": text,
                    "labels": estimate_labels(steps, hard), "continuations": [sum(v) for v in steps],
                    "correct": outcome[i]})
    return out
