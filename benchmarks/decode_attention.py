"""One decoding step's attention on the CPU: PyTorch's SDPA kernel against vlmrl's grouped products (decode_sdpa).

    python benchmarks/decode_attention.py [--threads 2] [--repeats 300]

Shapes of the quickstart's embedded model (4 query heads on 2 KV heads of 24 dims), one query token per row over a
cache of 37 columns with 3 left-padding columns masked, for rollout calls of 16 and 64 prompts x 8 answers. The two
run alternately in one process; prints median microseconds per call, their ratio, and the largest difference of the
outputs (vlmrl/models/attention.py).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vlmrl.models.attention import decode_sdpa


def median_us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def compare(module: torch.nn.Module, rows: int, repeats: int) -> tuple[list[float], list[float], float]:
    """Median microseconds of SDPA and of decode_sdpa (three alternating rounds each) and their largest difference."""
    q, k, v = torch.randn(rows, 4, 1, 24), torch.randn(rows, 2, 37, 24), torch.randn(rows, 2, 37, 24)
    mask = torch.ones(rows, 1, 1, 37, dtype=torch.bool)
    mask[:, :, :, :3] = False

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def ours():
        return decode_sdpa(module, q, k, v, mask)[0]

    with torch.no_grad():
        diff = (sdpa().transpose(1, 2) - ours()).abs().max().item()
        for fn in (sdpa, ours):  # warm-up
            median_us(fn, 20)
        a, b = [], []
        for _ in range(3):  # alternate, so load on a shared machine hits both alike
            a.append(median_us(sdpa, repeats // 3))
            b.append(median_us(ours, repeats // 3))
    return a, b, diff


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=300)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    print(f"{args.threads} thread(s), median of {args.repeats} calls\n")
    print("| rows (prompts x answers) | SDPA us | decode_sdpa us | ratio | max abs difference |")
    print("|---|---|---|---|---|")
    for rows in (16 * 8, 64 * 8):
        a, b, diff = compare(module, rows, args.repeats)
        sa, sb = statistics.median(a), statistics.median(b)
        print(f"| {rows} ({rows // 8} x 8) | {sa:.0f} | {sb:.0f} | {sa / sb:.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
