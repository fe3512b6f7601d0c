"""Generation with one decoding row per distinct answer prefix against one row per answer, in one process.

    python benchmarks/decode_sharing.py CHECKPOINT [--prompts 112] [--group 8] [--threads 1] [--repeats 5]

Loads CHECKPOINT (e.g. RUN_DIR/checkpoint-0 of a quickstart run: its SFT start, or its final checkpoint), draws
`--prompts` quickstart scenes, and times `generate` on the same prompts and seeds with `share_prefixes=True` (the
default) and `False`, the two interleaved. Prints the median wall time of each call, the rows each decoding step ran,
and whether both sampled the same tokens (and the largest log-prob difference).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint")
    p.add_argument("--prompts", type=int, default=112, help="the quickstart's cap: 7 x 16 prompts in one call")
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from vlmrl.data import make_task
    from vlmrl.models import load_policy
    from vlmrl.rollout.batch import make_prompts
    from vlmrl.rollout.generate import generate

    policy = load_policy(args.checkpoint)
    prompts = make_prompts(policy, make_task("shapes_count", args.prompts, "train", seed=3))
    rows, forward = [], policy.family.forward_hidden

    def counted(embeds, *a, **k):
        if embeds.shape[1] == 1:  # a decoding step (the prefill's rows are whole prompts)
            rows.append(embeds.shape[0])
        return forward(embeds, *a, **k)

    policy.family.forward_hidden = counted
    times, steps, last = {True: [], False: []}, {}, {}
    for rep in range(args.repeats):
        seeds = list(range(rep * args.prompts, (rep + 1) * args.prompts))
        for share in (True, False):
            rows.clear()
            t0 = time.perf_counter()
            last[share] = generate(policy, prompts, args.group, args.max_new_tokens, 1.0, prompt_seeds=seeds,
                                   share_prefixes=share)
            times[share].append(time.perf_counter() - t0)
            steps[share] = list(rows)
    same = torch.equal(last[True].completion_ids, last[False].completion_ids)
    gap = (last[True].logprobs - last[False].logprobs).abs().max().item()
    print(f"{args.prompts} prompts x {args.group} answers, {args.threads} thread(s), median of {args.repeats}:\n")
    print("| decoding rows | ms per call | rows per decoding step (last call) |\n|---|---|---|")
    for share, label in ((True, "one per distinct prefix"), (False, "one per answer")):
        print(f"| {label} | {1000 * statistics.median(times[share]):.1f} | {steps[share]} |")
    print(f"\nsame tokens: {same}; largest log-prob difference: {gap:.2e}")


if __name__ == "__main__":
    main()
