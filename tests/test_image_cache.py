"""Speed-ups that must not change what the model sees: the processed-image cache, the patch embedding as a matrix
product and the vision attention batched over images of one size."""

import torch
from PIL import Image

from vlmrl.models.families.processor import ImageCache
from vlmrl.models.families.qwen_vl import batched_vision_attention, patch_embed_as_linear


def test_cached_images_give_exactly_what_processing_gives(policy, count_samples):
    proc = policy.processor
    images = [s["images"][0] for s in count_samples[:6]]
    proc.image_cache.clear()
    fresh = proc.process_images(images)
    first = proc.processed_images(images[:3])  # fills the cache for three images
    mixed = proc.processed_images(images)  # three from the cache, three processed now
    assert proc.image_cache.hits >= 3
    for out in (mixed,):
        assert out.vision.keys() == fresh.vision.keys()
        for k in fresh.vision:
            assert torch.equal(out.vision[k], fresh.vision[k]), k
        assert out.vision_rows == fresh.vision_rows and out.placeholders == fresh.placeholders
        assert out.tokens == fresh.tokens
    assert first.tokens == fresh.tokens[:3]


def test_a_new_pixel_budget_empties_the_cache(policy, count_samples):
    proc = policy.processor
    image = count_samples[0]["images"][0]
    before = proc.processed_images([image]).tokens
    size = dict(proc.image_processor.size)
    try:
        proc.set_pixel_budget(112 * 112, 112 * 112)
        after = proc.processed_images([image]).tokens
    finally:
        proc.image_processor.size = size
    assert after != before  # not the cached tensors of the old budget
    assert proc.processed_images([image]).tokens == before


def test_cache_is_bounded_and_forgets_collected_images():
    cache = ImageCache(max_bytes=3 * 400)
    images = [Image.new("RGB", (4, 4)) for _ in range(4)]
    for i in range(4):
        cache.put(images[i], ({"pixel_values": torch.zeros(100)}, "<p>", 1))  # 400 bytes each
    assert cache.bytes == 1200 and cache.get(images[0]) is None  # the least recently used went first
    assert cache.get(images[3]) is not None
    del images[3]  # collected: its entry goes with it
    assert cache.bytes == 800


def test_patch_embedding_as_a_matrix_product_equals_the_convolution():
    conv = torch.nn.Conv3d(3, 32, (2, 14, 14), (2, 14, 14), bias=True)
    x = torch.randn(50, 3, 2, 14, 14)
    expected = conv(x)
    patch_embed_as_linear(conv)
    out = conv(x)
    assert out.shape == expected.shape and torch.allclose(out, expected, atol=1e-5)
    out.sum().backward()  # the gradient reaches the convolution's own weight
    assert conv.weight.grad is not None and conv.weight.grad.shape == conv.weight.shape
    padded = torch.nn.Conv3d(3, 8, 3, 1, padding=1)
    patch_embed_as_linear(padded)  # not a patchify convolution: left alone
    assert "forward" not in vars(padded)


def copy_module(module, patched: bool):
    import copy

    out = copy.deepcopy(module)
    if patched:
        batched_vision_attention(out)
    elif "forward" in vars(out):
        del out.forward
    return out


def test_vision_attention_batched_over_equal_images_equals_transformers_per_image_loop(policy, count_samples):
    from transformers.models.qwen2_vl.modeling_qwen2_vl import VisionAttention

    blocks = policy.model.model.visual.blocks
    assert all("forward" in vars(b.attn) for b in blocks)  # the family batched every Qwen2-VL vision attention
    attn = blocks[0].attn
    x = torch.randn(3 * 64, attn.dim, requires_grad=True)
    angles = torch.randn(3 * 64, attn.head_dim)
    rope = (angles.cos(), angles.sin())

    def run(cu_seqlens, batched):
        fresh = VisionAttention(attn.config)
        fresh.load_state_dict(attn.state_dict())
        if batched:
            batched_vision_attention(fresh)
        x.grad = None
        out = fresh(x, cu_seqlens=torch.tensor(cu_seqlens, dtype=torch.int32), position_embeddings=rope)
        out.pow(2).sum().backward()
        return out.detach(), x.grad.clone(), fresh.qkv.weight.grad.clone()

    for cu in ([0, 64, 128, 192], [0, 64, 192]):  # three equal images (one call); two of different sizes (the loop)
        for ref, got in zip(run(cu, False), run(cu, True), strict=True):
            assert torch.allclose(ref, got, atol=1e-5), cu
    copy = copy_module(attn, patched=True)  # a deep copy (the frozen reference) patched again by its family
    alone = copy_module(attn, patched=False)
    with torch.no_grad():
        attn.qkv.weight.add_(1.0)  # the policy moves on; the copy must not follow, on either path
        for cu in ([0, 64, 128, 192], [0, 64, 192]):
            cu = torch.tensor(cu, dtype=torch.int32)
            expected = alone(x, cu_seqlens=cu, position_embeddings=rope)
            assert torch.allclose(copy(x, cu_seqlens=cu, position_embeddings=rope), expected, atol=1e-5)
        attn.qkv.weight.sub_(1.0)
    spread = run([0, 64, 128, 192], True)[0]
    assert not torch.allclose(spread, run([0, 192], True)[0], atol=1e-3)  # the images do not attend to each other


def test_the_recipe_sets_the_cache_bound(policy):
    from vlmrl.config import ModelConfig
    from vlmrl.models.trainable import configure_training

    try:
        configure_training(policy, ModelConfig(image_cache_mb=3))
        assert policy.processor.image_cache.max_bytes == 3 * 2**20
        configure_training(policy, ModelConfig(image_cache_mb=0))
        policy.processor.image_cache.clear()
        policy.processor.processed_images([Image.new("RGB", (56, 56))])
        assert policy.processor.image_cache.bytes == 0  # 0: nothing is kept
    finally:
        configure_training(policy, ModelConfig())
