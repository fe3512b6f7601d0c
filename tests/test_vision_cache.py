"""A frozen vision tower's features kept per image: the same embeddings as running the tower, fewer tower passes, and
never a stale feature once a weight changes."""

import pytest
import torch

from vlmrl.models.batch import concat_prompt_batches
from vlmrl.models.trainable import freeze


def prompts(policy, samples):
    return policy.processor([s["problem"] for s in samples], [s["images"] for s in samples],
                            [s["id"] for s in samples])


def embeds_without_cache(policy, batch):
    cache = policy.family.vision_cache
    size, cache.max_bytes = cache.max_bytes, 0
    try:
        return policy.family.prompt_embeds(batch).embeds
    finally:
        cache.max_bytes = size


@pytest.fixture
def frozen(policy):
    freeze(policy, vision=True, projector=True)
    policy.processor.image_cache.clear()
    return policy


def test_frozen_tower_runs_once_per_image_and_gives_the_same_embeddings(frozen, count_samples):
    fam = frozen.family
    first = prompts(frozen, count_samples[:4])
    before = fam.vision_calls
    a = fam.prompt_embeds(first).embeds
    assert fam.vision_calls - before == 4
    again = fam.prompt_embeds(first).embeds  # every image from the cache
    assert fam.vision_calls - before == 4
    assert torch.equal(a, again)
    mixed = prompts(frozen, count_samples[2:7])  # two cached images, three new ones
    b = fam.prompt_embeds(mixed).embeds
    assert fam.vision_calls - before == 7
    torch.testing.assert_close(b, embeds_without_cache(frozen, mixed), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a, embeds_without_cache(frozen, first), rtol=1e-5, atol=1e-6)


def test_subsets_and_joined_batches_keep_their_image_keys(frozen, count_samples):
    fam = frozen.family
    whole = prompts(frozen, count_samples[:6])
    assert len(whole.image_keys) == 6 and None not in whole.image_keys
    fam.prompt_embeds(whole)
    part = whole.subset([4, 1])
    assert part.image_keys == [whole.image_keys[4], whole.image_keys[1]]
    joined = concat_prompt_batches([part, whole.subset([0])], frozen.processor.tokenizer.pad_token_id)
    before = fam.vision_calls
    out = fam.prompt_embeds(joined).embeds
    assert fam.vision_calls == before  # all three from the cache
    torch.testing.assert_close(out, embeds_without_cache(frozen, joined), rtol=1e-5, atol=1e-6)


def test_a_changed_weight_is_never_served_stale_features(frozen, count_samples):
    fam = frozen.family
    batch = prompts(frozen, count_samples[:3])
    old = fam.prompt_embeds(batch).embeds
    weight = next(p for n, p in fam.model.named_parameters() if n.startswith(fam.vision_prefixes))
    with torch.no_grad():
        weight.mul_(1.5)  # in place, as a loaded checkpoint or an optimizer step would change it
    before = fam.vision_calls
    new = fam.prompt_embeds(batch).embeds
    assert fam.vision_calls - before == 3
    assert not torch.allclose(new, old)
    torch.testing.assert_close(new, embeds_without_cache(frozen, batch), rtol=1e-5, atol=1e-6)


def test_no_cache_while_the_tower_trains_or_without_keys(policy, count_samples):
    fam = policy.family
    batch = prompts(policy, count_samples[:3])
    before = fam.vision_calls
    fam.prompt_embeds(batch)
    fam.prompt_embeds(batch)
    assert fam.vision_calls - before == 6  # trainable tower: its features change with every step
    freeze(policy, vision=True, projector=False)  # the projector still trains
    fam.prompt_embeds(batch)
    assert fam.vision_calls - before == 9
    freeze(policy, vision=True, projector=True)
    batch.image_keys = []  # a batch built without keys
    fam.prompt_embeds(batch)
    fam.prompt_embeds(batch)
    assert fam.vision_calls - before == 15


def test_processor_cache_off_means_no_keys(frozen, count_samples):
    frozen.processor.image_cache.max_bytes = 0
    batch = prompts(frozen, count_samples[:2])
    assert batch.image_keys == [None, None]
    before = frozen.family.vision_calls
    frozen.family.prompt_embeds(batch)
    frozen.family.prompt_embeds(batch)
    assert frozen.family.vision_calls - before == 4


def test_the_cache_is_bounded(frozen, count_samples):
    cache = frozen.family.vision_cache
    one = frozen.family.prompt_embeds(prompts(frozen, count_samples[:1]))
    del one
    size = cache.bytes
    cache.max_bytes = 2 * size
    frozen.family.prompt_embeds(prompts(frozen, count_samples[:5]))
    assert len(cache) == 2 and cache.bytes == 2 * size


def test_lora_keeps_the_base_tower_frozen_so_its_features_are_kept(tiny_model_dir, count_samples):
    pytest.importorskip("peft")
    from vlmrl.config import LoraConfig
    from vlmrl.models import load_policy
    from vlmrl.models.trainable import add_lora

    policy = add_lora(load_policy(tiny_model_dir), LoraConfig(r=4), tiny_model_dir)
    batch = prompts(policy, count_samples[:3])
    before = policy.family.vision_calls
    policy.family.prompt_embeds(batch)
    policy.family.prompt_embeds(batch)
    assert policy.family.vision_calls - before == 3
    vision = add_lora(load_policy(tiny_model_dir), LoraConfig(r=4, include_vision=True), tiny_model_dir)
    batch = prompts(vision, count_samples[:3])
    before = vision.family.vision_calls
    vision.family.prompt_embeds(batch)
    vision.family.prompt_embeds(batch)
    assert vision.family.vision_calls - before == 6  # adapters in the tower train: no cache


def test_a_repeated_image_runs_the_tower_once_per_call_trainable_or_not(policy, count_samples):
    """A multi-turn batch holds its prompt's image once per trajectory: within one call the tower runs once per
    distinct image (by key), and the embeddings and the tower's gradients are those of running it on every copy.
    Other batches (an SFT batch that drew a sample twice) run every image, bit for bit as before."""
    from vlmrl.agent.render import conversation_batch

    fam = policy.family
    one = prompts(policy, count_samples[:2])
    tail = policy.processor.tokenizer("a", add_special_tokens=False)["input_ids"]
    rows = [0, 1, 0, 1, 0, 1]  # three trajectories per prompt: every image three times
    batch = conversation_batch(policy.processor, one, rows, [tail] * 6, [[]] * 6, [[1] * len(tail)] * 6)
    assert batch.keys_of_images() == [one.keys_of_images()[r] for r in rows] and None not in batch.keys_of_images()
    keyless = conversation_batch(policy.processor, one, rows, [tail] * 6, [[]] * 6, [[1] * len(tail)] * 6)
    keyless.image_keys = []

    def run(b):
        policy.model.zero_grad(set_to_none=True)
        before = fam.vision_calls
        embeds = fam.prompt_embeds(b).embeds
        (embeds.float() ** 2).sum().backward()
        grads = {k: p.grad.clone() for k, p in policy.model.named_parameters()
                 if p.grad is not None and k.startswith(fam.vision_prefixes)}
        return embeds.detach(), grads, fam.vision_calls - before

    shared, shared_grads, calls = run(batch)
    plain, plain_grads, plain_calls = run(keyless)
    assert (calls, plain_calls) == (2, 6)
    repeated = concat_prompt_batches([one, one, one], policy.pad_token_id)  # not a multi-turn batch: as before
    assert run(repeated)[2] == 6
    assert torch.equal(shared, plain)  # the same rows (each image's features depend on it alone)
    assert shared_grads.keys() == plain_grads.keys() and shared_grads
    for k in shared_grads:  # the copies' gradients summed before the tower instead of after: float32 rounding only
        scale = plain_grads[k].abs().max().item()
        assert scale > 0 and (shared_grads[k] - plain_grads[k]).abs().max().item() <= 1e-5 * scale, k
