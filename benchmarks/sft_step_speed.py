"""What the patch embedding as a matrix product, the batched vision attention and the processed-image cache save in an
SFT step, side by side.

    python benchmarks/sft_step_speed.py --threads 1 --reps 4 --steps 15

Two measurements, each alternating the two variants in one process so that machine noise hits both alike:

1. Qwen2-VL's patch embedding on the quickstart's 1,024 patches (16 images of 64 patches), forward and backward:
   the Conv3d as transformers runs it against `patch_embed_as_linear` (one GEMM on the same weight).
2. Qwen2-VL's vision self-attention over 16 images of 64 patches, forward and backward: transformers' loop (one
   attention call per image) against `batched_vision_attention` (one call for the equal-sized images).
3. SFT steps of the embedded model on the quickstart's labelled scenes (batch 16): transformers' path (Conv3d, the
   per-image attention loop, every image processed again at every step) against vlmrl's (the linear patch embedding,
   the batched attention, processed images cached).

Prints milliseconds per call or step for each variant and their ratio (vlmrl / transformers).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def timed(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def patch_embed(reps: int) -> tuple[float, float]:
    from vlmrl.models.families.qwen_vl import patch_embed_as_linear

    conv = torch.nn.Conv3d(3, 96, (2, 14, 14), (2, 14, 14), bias=False)
    fast = torch.nn.Conv3d(3, 96, (2, 14, 14), (2, 14, 14), bias=False)
    fast.weight.data.copy_(conv.weight.data)
    patch_embed_as_linear(fast)
    x = torch.randn(1024, 3, 2, 14, 14)
    assert torch.allclose(conv(x), fast(x), atol=1e-4)

    def step(module):
        module.weight.grad = None
        module(x).sum().backward()

    a, b = [], []
    for _ in range(reps):
        a.append(timed(lambda: step(conv), 20))
        b.append(timed(lambda: step(fast), 20))
    return statistics.median(a), statistics.median(b)


def vision_attention(reps: int) -> tuple[float, float]:
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import VisionAttention

    from vlmrl.models.families.qwen_vl import batched_vision_attention

    config = Qwen2VLConfig(vision_config={"embed_dim": 96, "num_heads": 4}).vision_config
    config._attn_implementation = "sdpa"
    loop, fast = VisionAttention(config), VisionAttention(config)
    fast.load_state_dict(loop.state_dict())
    batched_vision_attention(fast)
    x = torch.randn(16 * 64, 96, requires_grad=True)
    cu = torch.arange(0, 16 * 64 + 1, 64, dtype=torch.int32)
    angles = torch.randn(16 * 64, 24)
    rope = (angles.cos(), angles.sin())
    assert torch.allclose(loop(x, cu, rope), fast(x, cu, rope), atol=1e-5)

    def step(module):
        module(x, cu, rope).sum().backward()

    a, b = [], []
    for _ in range(reps):
        a.append(timed(lambda: step(loop), 20))
        b.append(timed(lambda: step(fast), 20))
    return statistics.median(a), statistics.median(b)


def sft_steps(reps: int, steps: int) -> tuple[float, float]:
    from vlmrl.config import Config
    from vlmrl.models.families.processor import ImageCache
    from vlmrl.trainer.inputs import load_datasets
    from vlmrl.trainer.run import build_policy
    from vlmrl.trainer.sft import sft_step

    cfg = Config()
    data = load_datasets(cfg)
    policy = build_policy(cfg, Path(tempfile.mkdtemp(prefix="vlmrl-sft-speed-")), None, data)
    opt = torch.optim.AdamW([p for p in policy.model.parameters() if p.requires_grad], lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    conv = policy.model.model.visual.patch_embed.proj
    attentions = [block.attn for block in policy.model.model.visual.blocks]
    fast_forwards = [(m, m.forward) for m in (conv, *attentions)]  # the family's patched forwards
    policy.model.train()

    def variant(fast: bool) -> None:
        policy.processor.image_cache.max_bytes = ImageCache().max_bytes if fast else 0
        policy.processor.image_cache.clear()
        for module, forward in fast_forwards:
            if fast:
                module.forward = forward
            elif "forward" in vars(module):
                del module.forward  # back to the class's own forward (transformers')

    def step() -> None:
        idx = torch.randint(len(data.sft), (16,), generator=generator).tolist()
        sft_step(policy, opt, [data.sft[i] for i in idx], cfg.sft.target_template)

    a, b = [], []
    for _ in range(reps):
        variant(False)
        a.append(timed(step, steps))
        variant(True)
        timed(step, len(data.sft) // 16)  # one pass fills the cache, as the first SFT epoch does
        b.append(timed(step, steps))
    return statistics.median(a), statistics.median(b)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--steps", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    conv, linear = patch_embed(args.reps)
    loop, batched = vision_attention(args.reps)
    hf, ours = sft_steps(args.reps, args.steps)
    print(f"| {args.threads} thread(s), median of {args.reps} | transformers | vlmrl | ratio |\n|---|---|---|---|")
    print(f"| patch embedding, 1,024 patches, forward + backward | {1000 * conv:.1f} ms | {1000 * linear:.1f} ms | "
          f"{linear / conv:.2f} |")
    print(f"| vision attention, 16 images x 64 patches, forward + backward | {1000 * loop:.1f} ms | "
          f"{1000 * batched:.1f} ms | {batched / loop:.2f} |")
    print(f"| SFT step, batch 16 (embedded model) | {1000 * hf:.0f} ms | {1000 * ours:.0f} ms | {ours / hf:.2f} |")


if __name__ == "__main__":
    main()
