"""Every supported model family, built tiny in code: generation and the training forward agree, our hooks reproduce the
transformers model's own forward, placeholders match transformers' processors, and image tokens are counted.

The batch mixes a one-image prompt, a two-image prompt, a text-only prompt and a wide image (tiling / anyres), so it
needs left padding; each family's tiny model is built once per session (nothing is downloaded).
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from vlmrl.data import make_task, vocabulary_texts
from vlmrl.models import PromptTooLongError, load_policy
from vlmrl.models.forward import completion_logprobs, sequence_logprobs
from vlmrl.models.tiny_families import TINY_FAMILIES, build_tiny_family
from vlmrl.rollout.batch import make_prompts
from vlmrl.rollout.generate import generate

# transformers' own processor constructs here (no torchvision) for these; Qwen's need torchvision (docs/models.md)
HF_PROCESSORS = {"idefics3": "Idefics3Processor", "llava": "LlavaProcessor", "llava_next": "LlavaNextProcessor",
                 "gemma3": "Gemma3Processor"}
GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory):
    torch.set_num_threads(1)
    texts = vocabulary_texts(0)
    return {f: build_tiny_family(f, tmp_path_factory.mktemp(f), texts) for f in TINY_FAMILIES}


@pytest.fixture(scope="session")
def mixed_samples():
    """One image, two images, no image, a wide image: every kind of row in one left-padded batch."""
    shapes = make_task("shapes_count", 4, "train", seed=3)
    wide = Image.new("RGB", (100, 36), (30, 160, 220))
    return [
        {**shapes[0], "id": "one"},
        {**shapes[1], "id": "two", "images": shapes[1]["images"] + shapes[2]["images"],
         "problem": "How many shapes are in the two pictures together?"},
        {"id": "text", "images": [], "problem": "What is two plus three?", "solution": "5"},
        {**shapes[3], "id": "wide", "images": [wide]},
    ]


def hf_inputs(family: str, batch) -> dict:
    """What the transformers model's forward takes for one processed prompt."""
    v = batch.vision
    if not v:
        return {}
    if family.startswith("qwen"):
        return {**v, "mm_token_type_ids": batch.mm_token_type_ids}
    if family in ("idefics3", "smolvlm"):
        return {"pixel_values": v["pixel_values"][None], "pixel_attention_mask": v["pixel_attention_mask"][None]}
    if family == "gemma3":
        return {**v, "token_type_ids": batch.mm_token_type_ids}
    return dict(v)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_generation_logprobs_match_training_forward(family, family_dirs, mixed_samples):
    """Invariant 3 (docs/concepts.md) for every family: batch > 1, left padding, one image, two images and no image."""
    policy = load_policy(family_dirs[family])
    prompts = make_prompts(policy, mixed_samples)
    assert (prompts.attention_mask == 0).any(), "the batch should need left padding"
    assert prompts.images_per_prompt == [1, 2, 0, 1]
    r = generate(policy, prompts, group_size=2, max_new_tokens=6, temperature=1.0,
                 generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logp = sequence_logprobs(policy, prompts, r.prompt_index, r.completion_ids, r.completion_mask, 1.0).logprobs
    assert r.completion_mask.sum() > len(mixed_samples)
    assert torch.allclose(logp, r.logprobs, atol=1e-4), (logp - r.logprobs).abs().max()
    # each row recomputed with its prompt alone (no padding, no neighbours): padding bugs shared by both paths show
    for p, sample in enumerate(mixed_samples):
        alone = make_prompts(policy, [sample])
        rows = (r.prompt_index == p).nonzero().flatten()
        with torch.no_grad():
            single = completion_logprobs(policy.family, policy.family.prompt_embeds(alone).select(torch.zeros_like(rows)),
                                         r.completion_ids[rows], r.completion_mask[rows]).logprobs
        assert torch.allclose(single, r.logprobs[rows], atol=1e-4), (sample["id"], (single - r.logprobs[rows]).abs().max())


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_reserved_kv_cache_samples_exactly_what_the_concatenating_one_does(family, family_dirs, mixed_samples,
                                                                              monkeypatch):
    """generate() writes the answer's keys and values into reserved columns (vlmrl/models/kv_cache.py); with
    transformers' concatenating DynamicCache the same seeds give bit-identical answers and log-probs."""
    policy = load_policy(family_dirs[family])
    prompts = make_prompts(policy, mixed_samples)

    def sample():
        return generate(policy, prompts, group_size=3, max_new_tokens=7, temperature=1.0, prompt_seeds=[5, 6, 7, 8])

    reserved = sample()
    plain = policy.family.new_cache
    monkeypatch.setattr(policy.family, "new_cache", lambda reserve=0: plain())
    concatenated = sample()
    assert reserved.completion_mask.sum() > 3 * len(mixed_samples)  # answers longer than one token were decoded
    assert torch.equal(reserved.completion_ids, concatenated.completion_ids)
    assert torch.equal(reserved.completion_mask, concatenated.completion_mask)
    assert torch.equal(reserved.logprobs, concatenated.logprobs)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_shared_prompt_forward_has_the_full_forwards_gradients(family, family_dirs, mixed_samples):
    """The training forward runs each prompt once and shares its KV cache with its G answers: log-probs, entropies
    and every parameter's gradient equal those of the plain forward over prompt + answer rows."""
    policy = load_policy(family_dirs[family])
    prompts = make_prompts(policy, mixed_samples)
    r = generate(policy, prompts, group_size=3, max_new_tokens=6, temperature=1.0,
                 generator=torch.Generator().manual_seed(2))
    params = [p for p in policy.model.parameters() if p.requires_grad]

    def grads(out):
        loss = (out.logprobs * torch.linspace(0.5, 1.5, out.logprobs.numel()).view_as(out.logprobs)).sum() \
            + out.entropy.sum()
        return torch.autograd.grad(loss, params, allow_unused=True)

    shared = sequence_logprobs(policy, prompts, r.prompt_index, r.completion_ids, r.completion_mask, 1.0,
                               with_entropy=True, entropy_grad=True)
    full = completion_logprobs(policy.family, policy.family.prompt_embeds(prompts).select(r.prompt_index),
                               r.completion_ids, r.completion_mask, 1.0, with_entropy=True, entropy_grad=True)
    assert torch.allclose(shared.logprobs, full.logprobs, atol=1e-5)
    assert torch.allclose(shared.entropy, full.entropy, atol=1e-5)
    for p, a, b in zip(params, grads(shared), grads(full), strict=True):
        if a is None or b is None:
            assert a is None and b is None
            continue
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), (p.shape, (a - b).abs().max())


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_consistency_check_can_fail(family, family_dirs, mixed_samples):
    """The tiny models are sensitive enough for the test above to catch wrong positions or lost image features."""
    policy = load_policy(family_dirs[family])
    prompts = make_prompts(policy, mixed_samples[:2])
    r = generate(policy, prompts, 2, 6, 1.0, generator=torch.Generator().manual_seed(1))
    pe = policy.family.prompt_embeds(prompts).select(r.prompt_index)
    shifted = type(pe)(pe.embeds, pe.attention_mask, pe.position_ids, pe.next_position + 1, pe.extras)
    blind = type(pe)(torch.where(prompts.mm_token_type_ids[r.prompt_index, :, None].bool(), 0.0, pe.embeds),
                     pe.attention_mask, pe.position_ids, pe.next_position, pe.extras)
    wrongs = {"shifted positions": shifted, "no image features": blind}
    if pe.extras:  # Qwen3-VL deepstack, Gemma 3 image-block attention
        wrongs["no extras"] = type(pe)(pe.embeds, pe.attention_mask, pe.position_ids, pe.next_position, {})
    with torch.no_grad():
        for name, wrong in wrongs.items():
            logp = completion_logprobs(policy.family, wrong, r.completion_ids, r.completion_mask).logprobs
            assert (logp - r.logprobs).abs().max() > 1e-3, name


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_hooks_reproduce_the_models_own_forward(family, family_dirs, mixed_samples):
    """Our prompt embeddings + positions + extras give the logits of transformers' forward (one unpadded prompt)."""
    policy = load_policy(family_dirs[family])
    for sample in mixed_samples:
        batch = make_prompts(policy, [sample])
        with torch.no_grad():
            pe = policy.family.prompt_embeds(batch)
            ours = policy.family.lm_head(policy.family.forward_hidden(pe.embeds, pe.attention_mask, pe.position_ids,
                                                                      extras=pe.extras))
            theirs = policy.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                  **hf_inputs(family, batch)).logits
        assert torch.allclose(ours, theirs, atol=1e-4), (sample["id"], (ours - theirs).abs().max())


@pytest.mark.parametrize("family", [f for f in TINY_FAMILIES if f.startswith("qwen")])
def test_remembered_mrope_positions_are_transformers_batched_ones(family, family_dirs, mixed_samples):
    """The positions computed row by row and remembered per layout equal `get_rope_index` over the padded batch,
    on a first call, on a call that hits every entry, and with the rows reordered (other padding, other neighbours)."""
    policy = load_policy(family_dirs[family])
    family_hooks = policy.family
    family_hooks.rope_rows.clear()
    for order in ([0, 1, 2, 3], [0, 1, 2, 3], [3, 2, 0, 1], [1, 3]):
        batch = make_prompts(policy, [mixed_samples[i] for i in order])
        ours = family_hooks.positions(batch, batch.input_ids, batch.attention_mask)
        theirs, _ = family_hooks.inner.get_rope_index(
            input_ids=batch.input_ids, mm_token_type_ids=batch.mm_token_type_ids,
            image_grid_thw=batch.vision["image_grid_thw"], attention_mask=batch.attention_mask)
        assert torch.equal(ours, theirs), (order, (ours != theirs).nonzero()[:5])
    assert len(family_hooks.rope_rows) == 4  # one entry per layout: repeated layouts are computed once


@pytest.mark.parametrize("family", [f for f in TINY_FAMILIES if f.startswith("qwen")])
def test_vision_tower_with_remembered_position_ids_equals_transformers_own(family, family_dirs, mixed_samples):
    """The vision tower given its rotary position ids precomputed per image grid (`image_position_ids`) returns
    exactly what it returns computing them itself, for images of different grids, on a first call and on a hit."""
    policy = load_policy(family_dirs[family])
    hooks = policy.family
    hooks.vision_rows.clear()
    batch = make_prompts(policy, mixed_samples)
    grid = batch.vision["image_grid_thw"]
    assert len({tuple(g) for g in grid.tolist()}) > 1, "the batch should hold images of different grids"
    with torch.no_grad():
        theirs = torch.cat(hooks.inner.get_image_features(batch.vision["pixel_values"], grid,
                                                          return_dict=True).pooler_output)
        for _ in range(2):
            ours, _ = hooks.finish_features(batch, hooks.image_features(batch)[0])  # Qwen3-VL: rows carry deepstack
            assert torch.equal(ours, theirs), (ours - theirs).abs().max()
    assert len(hooks.vision_rows) == len({tuple(g) for g in grid.tolist()})


@pytest.mark.parametrize("family", sorted(HF_PROCESSORS))
def test_placeholders_match_transformers_processor(family, family_dirs, mixed_samples):
    import transformers

    d = family_dirs[family]
    policy = load_policy(d)
    ours_proc = policy.processor
    if family == "gemma3":
        tok = transformers.AutoTokenizer.from_pretrained(d, extra_special_tokens=GEMMA3_TOKENS)
        hf = transformers.Gemma3Processor(ours_proc.image_processor, tok, image_seq_length=4)
    elif family.startswith("llava"):
        hf = getattr(transformers, HF_PROCESSORS[family])(ours_proc.image_processor, ours_proc.tokenizer,
                                                          patch_size=8, vision_feature_select_strategy="default",
                                                          num_additional_image_tokens=1)
    else:
        hf = transformers.Idefics3Processor(ours_proc.image_processor, ours_proc.tokenizer, image_seq_len=4)
    for sample in mixed_samples:
        if not sample["images"]:
            continue
        ours = make_prompts(policy, [sample])
        text = ours_proc.prompt_text(sample["problem"], len(sample["images"]))
        theirs = hf(images=[sample["images"]], text=[text], return_tensors="pt", add_special_tokens=False)
        assert ours.input_ids.tolist() == theirs["input_ids"].tolist(), sample["id"]


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_image_tokens_are_counted_and_prompts_never_truncated(family, family_dirs, mixed_samples):
    policy = load_policy(family_dirs[family])
    batch = make_prompts(policy, mixed_samples)
    assert batch.mm_token_type_ids.sum(-1).tolist() == [
        sum(batch.image_tokens[i] for i in batch.image_range([p])) for p in range(len(batch))]
    before = policy.family.vision_calls
    policy.family.prompt_embeds(batch)
    assert policy.family.vision_calls - before == 4  # one vision pass per image
    image_token = policy.processor.image_token
    bad = {**mixed_samples[0], "id": "sneaky", "problem": f"count {image_token} please"}
    with pytest.raises(ValueError, match="sneaky"):
        make_prompts(policy, [mixed_samples[2], bad])
    limit = int(batch.attention_mask[0].sum())  # fits "one"; "two" (two images) is longer
    assert make_prompts(policy, mixed_samples[:1], max_prompt_length=limit).input_ids.shape[1] == limit
    with pytest.raises(PromptTooLongError, match=f"'two'.*max_prompt_length={limit}"):
        make_prompts(policy, mixed_samples[:2], max_prompt_length=limit)


def test_pixel_budget_is_per_family(family_dirs, mixed_samples):
    qwen = load_policy(family_dirs["qwen2_vl"], max_pixels=28 * 28)
    assert make_prompts(qwen, mixed_samples[:1]).image_tokens == [1]  # 28x28 px = 2x2 patches = one merged token
    smol = load_policy(family_dirs["smolvlm"], max_pixels=32 * 32)  # one tile: no splitting
    assert make_prompts(smol, mixed_samples[:1]).image_tokens == [4]
    with pytest.raises(ValueError, match="llava.*no pixel budget"):
        load_policy(family_dirs["llava"], max_pixels=10_000)


def test_tiny_qwen_prompt_is_the_chat_template(family_dirs):
    proc = load_policy(family_dirs["qwen2_vl"]).processor
    assert proc.prompt_text("How many?", 2) == ("<|im_start|>user\n" + "<|vision_start|><|image_pad|><|vision_end|>" * 2
                                                + "How many?<|im_end|>\n<|im_start|>assistant\n")


def test_saved_processor_keeps_its_chat_template(family_dirs, tmp_path):
    """A checkpoint's image-aware template wins over the tokenizer's, and survives save + load."""
    policy = load_policy(family_dirs["llava"])
    policy.processor.chat_template = ("{% for m in messages %}Q: {% for p in m['content'] %}{% if p['type'] == 'image' %}"
                                      "<image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endfor %} A:")
    policy.save_pretrained(tmp_path)
    assert load_policy(tmp_path).processor.prompt_text("hi", 1) == "Q: <image>hi A:"


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_prompt_lengths_without_images_equal_the_built_prompts(family, family_dirs, mixed_samples):
    """The load-time length check counts what the processor builds, image placeholders and BOS included."""
    policy = load_policy(family_dirs[family])
    batch = make_prompts(policy, mixed_samples)
    lengths = policy.processor.prompt_lengths([s["problem"] for s in mixed_samples],
                                              [s["images"] for s in mixed_samples], [s["id"] for s in mixed_samples])
    assert lengths == batch.attention_mask.sum(-1).tolist()


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_a_frozen_tower_runs_once_per_image_with_the_same_embeddings(family, family_dirs, mixed_samples):
    from vlmrl.models.trainable import freeze

    policy = load_policy(family_dirs[family])
    freeze(policy, vision=True, projector=True)
    fam = policy.family
    batch = make_prompts(policy, mixed_samples)

    def plain(b):
        size, fam.vision_cache.max_bytes = fam.vision_cache.max_bytes, 0
        try:
            return fam.prompt_embeds(b)
        finally:
            fam.vision_cache.max_bytes = size

    with torch.no_grad():
        first = fam.prompt_embeds(batch)  # fills the cache
        before = fam.vision_calls
        part = batch.subset([3, 1, 0])  # the wide image, the two-image prompt, the one-image prompt
        again = fam.prompt_embeds(part)
        assert fam.vision_calls - before == (0 if fam.features_cacheable else 4)
        for ours, theirs in ((first, plain(batch)), (again, plain(part))):
            torch.testing.assert_close(ours.embeds, theirs.embeds, rtol=1e-5, atol=1e-6)
            assert ours.extras.keys() == theirs.extras.keys()
            for key in ours.extras:
                torch.testing.assert_close(ours.extras[key], theirs.extras[key], rtol=1e-5, atol=1e-6)
