"""How many of a policy's sampled answers a served teacher can score: an answer is scored over HTTP only where the
teacher, reading the answer's text, gets back the very ids the student wrote (vlmrl/trainer/served_teacher.py), so
this counts the sampled answers whose ids are what the tokenizer makes of their text.

    python benchmarks/canonical_answers.py RUN [RUN ...] [--prompts 64] [--answers 4]

Each RUN (a run directory or checkpoint) answers --prompts held-out prompts of its recipe's task --answers times at
temperature 1 with its recipe's rollout.max_new_tokens; prints a table of the share spelt canonically.
"""

from __future__ import annotations

import argparse

import torch


def canonical_share(run: str, prompts: int, answers: int, seed: int) -> tuple[int, int, str]:
    from vlmrl.config import load_config
    from vlmrl.data import make_task
    from vlmrl.models import load_policy
    from vlmrl.models.preflight import resolve_model
    from vlmrl.rollout.batch import make_prompts
    from vlmrl.rollout.generate import generate

    checkpoint = resolve_model(run, "RUN")
    cfg = load_config(checkpoint / "config.yaml", [])
    policy = load_policy(checkpoint)
    tokenizer, eos = policy.processor.tokenizer, set(policy.eos_token_ids)
    task = cfg.data.train.get("task") if isinstance(cfg.data.train, dict) else getattr(cfg.data.train, "task", None)
    if not task:
        raise SystemExit(f"{run}: its recipe trains on {cfg.data.train!r}, not a built-in task; this script draws "
                         "held-out prompts of built-in tasks only")
    samples = make_task(task, prompts, "test", seed=seed)
    rollout = generate(policy, make_prompts(policy, samples, cfg.data.prompt_template), answers,
                       cfg.rollout.max_new_tokens, 1.0, generator=torch.Generator().manual_seed(seed))
    canonical = 0
    for ids, mask in zip(rollout.completion_ids, rollout.completion_mask, strict=True):
        ids = ids[mask.bool()].tolist()
        body = ids[:-1] if ids and ids[-1] in eos else ids
        canonical += tokenizer.encode(tokenizer.decode(body), add_special_tokens=False) == body
    return canonical, len(rollout.completion_ids), task


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--answers", type=int, default=4)
    p.add_argument("--seed", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    print("| run | task | answers spelt as the tokenizer would (a served teacher scores them) |\n|---|---|---|")
    for run in args.runs:
        canonical, total, task = canonical_share(run, args.prompts, args.answers, args.seed)
        print(f"| {run} | {task} | {canonical} / {total} ({100 * canonical / total:.1f}%) |")


if __name__ == "__main__":
    main()
