"""Generation with the reserved KV cache against transformers' concatenating DynamicCache, side by side in one process.

    python benchmarks/generate_cache.py [--checkpoint DIR] [--prompts 16] [--group 8] [--threads 1]

Builds the embedded tiny model (or loads --checkpoint), then times `generate` on the same prompts and seeds with
`ReservedLayer` (vlmrl/models/kv_cache.py, the default) and with `DynamicCache` (`new_cache(reserve=0)`), the two
interleaved, for answer budgets of 16, 64 and 256 tokens. End tokens are disabled so every answer runs to its budget
(the copy a concatenating cache makes grows with the cache). Prints the median wall time of each and checks that
both sampled the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=None, help="a vlmrl checkpoint (default: the embedded tiny model)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from vlmrl.data import make_task, vocabulary_texts
    from vlmrl.models import load_policy
    from vlmrl.models.tiny import build_tiny_vlm
    from vlmrl.rollout.batch import make_prompts
    from vlmrl.rollout.generate import generate

    if args.checkpoint:
        policy = load_policy(args.checkpoint)
    else:
        with tempfile.TemporaryDirectory() as tmp:  # loaded into memory, then the folder goes
            policy = load_policy(build_tiny_vlm(tmp, vocabulary_texts(0)))
    policy.model.eval()
    policy.eos_token_ids = [len(policy.processor.tokenizer) + 1]  # an id never sampled: answers run to the budget
    prompts = make_prompts(policy, make_task("shapes_count", args.prompts, "train", seed=0))
    seeds = list(range(args.prompts))
    reserved, plain = policy.family.new_cache, lambda reserve=0: reserved()
    print("| new tokens | reserved cache ms | DynamicCache ms | ratio | same tokens |\n|---|---|---|---|---|")
    for budget in (16, 64, 256):
        times, outs = {"reserved": [], "dynamic": []}, {}
        for _ in range(args.repeats):
            for name, cache in (("reserved", reserved), ("dynamic", plain)):
                policy.family.new_cache = cache
                t0 = time.perf_counter()
                outs[name] = generate(policy, prompts, args.group, budget, 1.0, prompt_seeds=seeds)
                times[name].append(time.perf_counter() - t0)
        policy.family.new_cache = reserved
        r, d = (statistics.median(times[k]) * 1e3 for k in ("reserved", "dynamic"))
        same = torch.equal(outs["reserved"].completion_ids, outs["dynamic"].completion_ids)
        print(f"| {budget} | {r:.0f} | {d:.0f} | {r / d:.2f} | {same} |")


if __name__ == "__main__":
    main()
