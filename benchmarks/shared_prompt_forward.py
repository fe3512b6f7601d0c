"""The training forward with the prompt's KV cache shared by its G answers, against the plain forward over
prompt + answer rows: CPU time of forward + backward, side by side in one process.

    python benchmarks/shared_prompt_forward.py [--prompts 16] [--group 8] [--new-tokens 12] [--repeats 20]

Builds the quickstart's embedded model (default TinyModelConfig, 112 px scenes = 16 image tokens), samples G answers
per prompt once, then alternates the two paths `--repeats` times on the same batch (so load on a shared machine hits
both alike) and prints the median CPU milliseconds (time.process_time) of log-probs + backward for each and their
ratio. Both paths give the same log-probs and gradients (tests/test_families.py).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from vlmrl.config import TinyModelConfig
from vlmrl.data import make_task, vocabulary_texts
from vlmrl.models import build_tiny_vlm, load_policy
from vlmrl.models.forward import completion_logprobs, sequence_logprobs
from vlmrl.rollout.batch import make_prompts
from vlmrl.rollout.generate import generate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=12)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        policy = load_policy(build_tiny_vlm(tmp, vocabulary_texts(0), TinyModelConfig(), seed=0))
    samples = make_task("shapes_count", args.prompts, "train", 0)
    prompts = make_prompts(policy, samples, "{problem}")
    r = generate(policy, prompts, args.group, args.new_tokens, 1.0, generator=torch.Generator().manual_seed(0))
    family = policy.family

    def shared():
        return sequence_logprobs(policy, prompts, r.prompt_index, r.completion_ids, r.completion_mask, 1.0)

    def full():
        pe = family.prompt_embeds(prompts).select(r.prompt_index)  # the vision tower still runs once per prompt
        return completion_logprobs(family, pe, r.completion_ids, r.completion_mask, 1.0)

    times = {"shared": [], "full": []}
    for i in range(args.repeats + 1):
        for name, fn in (("shared", shared), ("full", full)) if i % 2 else (("full", full), ("shared", shared)):
            policy.model.zero_grad(set_to_none=True)
            t0 = time.process_time()
            fn().logprobs.sum().backward()
            if i:  # the first round warms up
                times[name].append(time.process_time() - t0)
    prompt_tokens = int(prompts.attention_mask.sum(-1).float().mean())
    print(f"{args.prompts} prompts x G={args.group}, ~{prompt_tokens} prompt tokens, {args.new_tokens} new tokens, "
          f"{args.threads} thread(s), median of {args.repeats}\n")
    print("| training forward + backward | CPU ms |\n|---|---|")
    for name, label in (("full", "plain: prompt + answer per row"), ("shared", "prompt once, KV cache shared")):
        print(f"| {label} | {1000 * statistics.median(times[name]):.0f} |")
    print(f"\nspeed-up: {statistics.median(times['full']) / statistics.median(times['shared']):.2f}x")


if __name__ == "__main__":
    main()
