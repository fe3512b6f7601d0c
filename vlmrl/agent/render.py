"""From turns to tokens: what the chat template writes between the policy's turns, and whole trajectories as one
`ConversationBatch` row each.

A trajectory is kept as token ids, never as text to re-tokenise: the prompt's ids, then each turn's sampled ids
verbatim (its end-of-turn token included), then each observation's ids. An observation's ids are the text the
family's chat template writes after an assistant turn for the tool-response message (Qwen and Hermes:
`\\n<|im_start|>user\\n<tool_response>\\n...\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n`), found as the
difference between the template's rendering of a conversation with and without that message, with each image's
placeholder expanded exactly as in a prompt. Tool results go in the user role with the `<tool_response>` wrapper:
every family's template renders a user turn's images (some render no images, or no turn at all, for a `tool` role).

Image placeholders, image tokens and image features are counted at every turn: the observation's placeholder
tokens against its images' token counts here, every row of a `ConversationBatch` against all of its images in
`conversation_batch`, and features against tokens in the family's `prompt_embeds`. A mismatch is a `DataError`
naming the sample and the turn.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re

import torch
from PIL import Image

from vlmrl.errors import DataError
from vlmrl.models.batch import ConversationBatch, PromptBatch
from vlmrl.models.families.processor import ImageInputs, VLProcessor
from vlmrl.models.image_cache import ImageCache

_PROBE = [{"role": "user", "content": [{"type": "text", "text": "q"}]},
          {"role": "assistant", "content": [{"type": "text", "text": "a"}]}]


def tool_message(content: list[dict], text: list[str] | None = None) -> dict:
    """The message a tool response is rendered as: a user turn wrapped in `<tool_response>`, images in place.
    `text`: what to write for the text blocks, in order (default: their own text)."""
    texts = iter(text if text is not None else [b["text"] for b in content if b["type"] != "image"])
    parts = [{"type": "text", "text": "<tool_response>\n"}]
    for block in content:
        parts.append({"type": "image"} if block["type"] == "image" else {"type": "text", "text": next(texts)})
    parts.append({"type": "text", "text": "\n</tool_response>"})
    return {"role": "user", "content": parts}


def _slot(i: int) -> str:
    """A stand-in for text block i while the template renders (private-use characters no template writes)."""
    return f"\ue000{i}\ue001"


_SLOT = re.compile("\ue000(\\d+)\ue001")


def pixels_key(image) -> tuple | None:
    """What a PIL image's processing depends on: its mode, size and a digest of its pixels (None for other image
    types and for palette images, which are never matched)."""
    if not isinstance(image, Image.Image) or image.mode in ("P", "PA"):
        return None
    return image.mode, image.size, hashlib.blake2b(image.tobytes(), digest_size=20).digest()


class TurnRenderer:
    """Observation ids for one processor (one family's template, tokenizer and image processor).

    One renderer serves one rollout call, and remembers what repeats in it, each exactly what it replaces: the
    template's suffix per sequence of block kinds (the texts are slots), the ids of each scaffold text, and the
    processed tensors of an image whose pixels equal an earlier image's (a group's trajectories that zoom on the
    same cell get equal images as distinct objects: preprocessing took ~1.6 ms per image, the template ~0.4 ms per
    observation). An image matched that way still gets its own image key, so what runs through the vision tower in
    training, and how its gradients add up, is what it was; `same_pixels` maps its key to the first image's, which
    the turns' generation batches use instead (no gradient there: the tower runs once for both, and gives each
    image the features it would give it alone)."""

    def __init__(self, processor: VLProcessor):
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.end = processor.end_tokens[0] if processor.end_tokens else self.tokenizer.eos_token
        self.suffixes: dict[tuple[bool, ...], str] = {}  # per observation shape (which blocks are images)
        self.scaffold_ids: dict[str, list[int]] = {}
        self.first_with_pixels: dict[tuple, object] = {}  # pixels_key -> the first image seen with those pixels
        self.same_pixels: dict[int, int] = {}  # image key -> the key of the first image with its pixels

    def suffix(self, message: dict) -> str:
        """What the template writes after the policy's end-of-turn token for `message`, generation prompt on."""
        render = lambda messages, gen: self.tokenizer.apply_chat_template(  # noqa: E731
            messages, chat_template=self.processor.chat_template, tokenize=False, add_generation_prompt=gen)
        before, after = render(_PROBE, False), render([*_PROBE, message], True)
        cut = before.rfind(self.end)
        if cut < 0 or not after.startswith(before[:cut + len(self.end)]):
            raise DataError(f"the {self.processor.family} chat template does not end an assistant turn with "
                            f"{self.end!r} or renders earlier turns differently once a later turn is added; "
                            "multi-turn rollouts need a template that appends turns")
        return after[cut + len(self.end):]

    def observation(self, content: list[dict], sample_id: str, turn: int) -> tuple[list[int], list, list[int]]:
        """(ids, images, image tokens of each image) of an observation's content blocks.

        Only the template's scaffold and vlmrl's `<tool_response>` wrapper may yield special tokens: the text of a
        tool or environment (which can echo the policy's own words, or an OCR'd page) is tokenised with special
        tokens split, so `<|im_end|>` in it is plain text, never a forged turn boundary, and `<|image_pad|>` never
        an image slot. Image placeholders come from image blocks only. The text blocks stand in as slots while the
        template renders; the scaffold between them is tokenised as usual."""
        images = [b["image"] for b in content if b["type"] == "image"]
        texts = [b["text"] for b in content if b["type"] != "image"]
        shape = tuple(b["type"] == "image" for b in content)
        rendered = self.suffixes.get(shape)
        if rendered is None:
            rendered = self.suffixes[shape] = self.suffix(tool_message(content, [_slot(i) for i in range(len(texts))]))
        inputs = self.processed_images(images) if images else ImageInputs({}, {}, [], [])
        rendered = self.processor.expand(rendered, inputs.placeholders, f"{sample_id}, turn {turn}")
        ids: list[int] = []
        pieces = _SLOT.split(rendered)  # scaffold, slot index, scaffold, ...
        for k, piece in enumerate(pieces):
            if k % 2:
                ids += self.processor.literal_tokenizer(texts[int(piece)], add_special_tokens=False)["input_ids"]
            elif piece:
                known = self.scaffold_ids.get(piece)
                if known is None:
                    known = self.scaffold_ids[piece] = self.tokenizer(piece, add_special_tokens=False)["input_ids"]
                ids += known
        found = sum(1 for i in ids if i == self.processor.image_token_id)
        if found != sum(inputs.tokens):
            raise DataError(f"sample {sample_id!r}, turn {turn}: the observation has {found} image placeholder "
                            f"tokens for {len(images)} image(s) of {sum(inputs.tokens)} features")
        return ids, images, inputs.tokens

    def processed_images(self, images: list) -> ImageInputs:
        """The processor's `processed_images`, an image whose pixels equal an image this renderer saw before taking
        that image's processed tensors (the processor's image cache holds them) under a key of its own."""
        cache = self.processor.image_cache
        for image in images:
            key = pixels_key(image) if cache.get(image) is None else None
            if key is None:
                continue
            twin = self.first_with_pixels.setdefault(key, image)
            entry = cache.get(twin) if twin is not image else None
            if entry is not None and entry[3] is not None:
                serial = next(ImageCache.serials)
                if cache.put(image, (*entry[:3], serial)):
                    self.same_pixels[serial] = entry[3]
        return self.processor.processed_images(images)


def conversation_batch(processor: VLProcessor, prompts: PromptBatch, rows: list[int], tails: list[list[int]],
                       images: list[list], policy_masks: list[list[int]], turn: int | str = "end",
                       same_key: dict[int, int] | None = None) -> ConversationBatch:
    """One row per trajectory i: prompt `rows[i]` of `prompts`, then `tails[i]` (every token after the prompt), with
    the prompt's images and then `images[i]` (the observations' images, in order), left-padded. `policy_masks[i]`
    is 1 on the policy's own tokens of the tail: an image placeholder token the policy sampled is text, never a
    place for image features (only the prompt's and the observations' placeholders are). `same_key`: image keys
    to give as another's (`TurnRenderer.same_pixels`: for generation, which runs the tower once per key)."""
    sub = dataclasses.replace(prompts, vision={}, vision_rows={}).subset(rows)  # (its images are taken below)
    flat = [im for ims in images for im in ims]
    extra = processor.processed_images(flat) if flat else ImageInputs({}, {}, [], [])
    keys = list(dict.fromkeys([*prompts.vision, *extra.vision]))

    def per_image(vision: dict, vision_rows: dict) -> list[dict]:
        """The tensors of each image, image by image."""
        splits = {k: vision[k].split(vision_rows[k]) for k in vision}
        count = len(next(iter(vision_rows.values()))) if vision_rows else 0
        return [{k: splits[k][i] for k in splits} for i in range(count)]

    # each row's prompt images as views of `prompts`' tensors: the G rows of a group share them until the one copy below
    every_prompt_image = per_image(prompts.vision, prompts.vision_rows)
    prompt_images = [every_prompt_image[i] for i in prompts.image_range(rows)]
    tail_images = per_image(extra.vision, extra.vision_rows)
    prompt_keys, tail_keys = sub.keys_of_images(), extra.keys or [None] * len(extra.tokens)
    if same_key:
        tail_keys = [same_key.get(k, k) for k in tail_keys]
    seqs, places, ordered, tokens, counts, keys_of = [], [], [], [], [], []
    p_at = t_at = 0
    for i, tail in enumerate(tails):
        real = sub.attention_mask[i].bool()
        seqs.append(sub.input_ids[i][real].tolist() + list(tail))
        places.append(sub.mm_token_type_ids[i][real].tolist()
                      + [int(t == processor.image_token_id and not own) for t, own in zip(tail, policy_masks[i],
                                                                                          strict=True)])
        n_prompt, n_tail = sub.images_per_prompt[i], len(images[i])
        ordered += prompt_images[p_at:p_at + n_prompt] + tail_images[t_at:t_at + n_tail]
        tokens += sub.image_tokens[p_at:p_at + n_prompt] + extra.tokens[t_at:t_at + n_tail]
        keys_of += prompt_keys[p_at:p_at + n_prompt] + tail_keys[t_at:t_at + n_tail]
        counts.append(n_prompt + n_tail)
        p_at, t_at = p_at + n_prompt, t_at + n_tail
    width = max(len(s) for s in seqs)
    pad = processor.tokenizer.pad_token_id
    input_ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    mm = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, place) in enumerate(zip(seqs, places, strict=True)):
        input_ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s):] = 1
        mm[i, width - len(s):] = torch.tensor(place, dtype=torch.long)
    start = 0
    for i, n in enumerate(counts):
        expected = sum(tokens[start:start + n])
        start += n
        if int(mm[i].sum()) != expected:
            raise DataError(f"sample {sub.sample_ids[i]!r}, turn {turn}: {int(mm[i].sum())} image placeholder tokens "
                            f"in the trajectory but its {n} image(s) give {expected} features")
    vision = {k: torch.cat([im[k] for im in ordered]) for k in keys} if ordered else {}
    vision_rows = {k: [len(im[k]) for im in ordered] for k in keys} if ordered else {}
    return ConversationBatch(list(sub.sample_ids), input_ids, mask, mm, vision, vision_rows, counts, tokens, keys_of,
                             completion_tokens=[len(t) for t in tails])
