"""Qwen2-VL / Qwen2.5-VL family: prompt text, image preprocessing, prompt embeddings and 3-D (M-RoPE) positions.

One preprocessing path feeds generation and the training forward (DESIGN.md invariant 2): `QwenVLProcessor` turns
samples into a `PromptBatch`; `QwenVLFamily.prompt_embeds` runs the vision tower once per prompt image and scatters
the features into the placeholder tokens. Completions are appended as text tokens whose positions continue each
prompt's M-RoPE positions, so generation and the training forward see the same positions (invariant 3).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

IMAGE_PAD = "<|image_pad|>"
VISION_BLOCK = "<|vision_start|><|image_pad|><|vision_end|>"


@dataclass
class PromptBatch:
    """Processed prompts, left-padded. Row p holds prompt p; `pixel_values` stacks the images of all prompts in order."""

    sample_ids: list[str]
    input_ids: Tensor  # [P, L]
    attention_mask: Tensor  # [P, L]
    mm_token_type_ids: Tensor  # [P, L] 1 on image placeholder tokens
    pixel_values: Tensor | None  # [n_patches, patch_dim]
    image_grid_thw: Tensor | None  # [n_images, 3]
    images_per_prompt: list[int]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def subset(self, prompts: list[int]) -> PromptBatch:
        """The prompts at positions `prompts` (their images too), with left padding common to all rows removed."""
        rows = torch.tensor(prompts, dtype=torch.long)
        mask = self.attention_mask[rows]
        first = int((mask.cumsum(-1) == 0).sum(-1).min())  # columns that are padding in every kept row
        pixel_values = grid = None
        if self.image_grid_thw is not None:
            image_start = [0]
            for n in self.images_per_prompt:
                image_start.append(image_start[-1] + n)
            patches = self.image_grid_thw.prod(-1)
            patch_start = torch.cat([patches.new_zeros(1), patches.cumsum(0)]).tolist()
            images = [i for p in prompts for i in range(image_start[p], image_start[p + 1])]
            if images:
                grid = self.image_grid_thw[images]
                pixel_values = torch.cat([self.pixel_values[patch_start[i]:patch_start[i + 1]] for i in images])
        return PromptBatch([self.sample_ids[p] for p in prompts], self.input_ids[rows, first:], mask[:, first:],
                           self.mm_token_type_ids[rows, first:], pixel_values, grid,
                           [self.images_per_prompt[p] for p in prompts])


@dataclass
class PromptEmbeds:
    """Prompt input embeddings with image features in place, and their positions."""

    embeds: Tensor  # [P, L, H]
    attention_mask: Tensor  # [P, L]
    position_ids: Tensor  # [3, P, L]
    next_position: Tensor  # [P] position of the first completion token

    def select(self, index: Tensor) -> PromptEmbeds:
        """Rows `index` (e.g. each prompt repeated G times for its group), without recomputing anything."""
        return PromptEmbeds(self.embeds[index], self.attention_mask[index], self.position_ids[:, index],
                            self.next_position[index])


def concat_prompt_batches(batches: list[PromptBatch], pad_token_id: int) -> PromptBatch:
    """One PromptBatch from several (rows in order), re-padded on the left to the longest prompt."""
    width = max(b.input_ids.shape[1] for b in batches)

    def left_pad(x: Tensor, value: int) -> Tensor:
        return torch.nn.functional.pad(x, (width - x.shape[1], 0), value=value)

    grids = [b.image_grid_thw for b in batches if b.image_grid_thw is not None]
    pixels = [b.pixel_values for b in batches if b.pixel_values is not None]
    return PromptBatch([i for b in batches for i in b.sample_ids],
                       torch.cat([left_pad(b.input_ids, pad_token_id) for b in batches]),
                       torch.cat([left_pad(b.attention_mask, 0) for b in batches]),
                       torch.cat([left_pad(b.mm_token_type_ids, 0) for b in batches]),
                       torch.cat(pixels) if pixels else None, torch.cat(grids) if grids else None,
                       [n for b in batches for n in b.images_per_prompt])


class PromptTooLongError(ValueError):
    pass


class QwenVLProcessor:
    """Image-only processor for the Qwen2-VL family (tokenizer + image processor).

    transformers' `Qwen2VLProcessor` needs torchvision for its video slot (DESIGN.md); prompts here are images and
    text, so this class does the same placeholder expansion without it, and works for the real Qwen tokenizers too.
    """

    def __init__(self, tokenizer, image_processor, system_prompt: str | None = None):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.system_prompt = system_prompt
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.merge_size = getattr(image_processor, "merge_size", 2)
        self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)

    @classmethod
    def from_pretrained(cls, path: str | Path, **kwargs) -> QwenVLProcessor:
        from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        image_processor = Qwen2VLImageProcessorPil.from_pretrained(path, **kwargs)
        return cls(tokenizer, image_processor)

    def save_pretrained(self, path: str | Path) -> None:
        self.tokenizer.save_pretrained(path)
        self.image_processor.save_pretrained(path)
        (Path(path) / "vlmrl_processor.json").write_text(json.dumps({"family": "qwen2_vl"}))

    def set_pixel_budget(self, min_pixels: int | None, max_pixels: int | None) -> None:
        """The same budget applies to generation and training, since both go through this processor."""
        size = dict(self.image_processor.size)
        if min_pixels:
            size["shortest_edge"] = min_pixels
        if max_pixels:
            size["longest_edge"] = max_pixels
        self.image_processor.size = size

    def prompt_text(self, problem: str, n_images: int) -> str:
        system = f"<|im_start|>system\n{self.system_prompt}<|im_end|>\n" if self.system_prompt else ""
        return f"{system}<|im_start|>user\n{VISION_BLOCK * n_images}{problem}<|im_end|>\n<|im_start|>assistant\n"

    def __call__(self, problems: list[str], images: list[list], sample_ids: list[str],
                 max_prompt_length: int | None = None) -> PromptBatch:
        flat = [im for ims in images for im in ims]
        pixel_values = grid = None
        texts = [self.prompt_text(p, len(ims)) for p, ims in zip(problems, images, strict=True)]
        if flat:
            out = self.image_processor(images=flat, return_tensors="pt")
            pixel_values, grid = out["pixel_values"], out["image_grid_thw"]
            counts = (grid.prod(-1) // self.merge_size**2).tolist()
            it = iter(counts)
            texts = [t.replace(IMAGE_PAD, "\0") for t in texts]
            texts = ["".join(part + (IMAGE_PAD * next(it) if i < t.count("\0") else "")
                             for i, part in enumerate(t.split("\0"))) for t in texts]
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        input_ids, mask = enc["input_ids"], enc["attention_mask"]
        lengths = mask.sum(-1)
        if max_prompt_length is not None:
            for sid, n in zip(sample_ids, lengths.tolist(), strict=True):
                if n > max_prompt_length:
                    # Never truncate: a cut inside an image placeholder span misaligns features and tokens.
                    raise PromptTooLongError(
                        f"sample {sid!r}: prompt is {n} tokens (images included), over max_prompt_length="
                        f"{max_prompt_length}; raise max_prompt_length or lower the pixel budget (model.max_pixels)")
        mm = (input_ids == self.image_token_id).long()
        if grid is not None:
            expected = int((grid.prod(-1) // self.merge_size**2).sum())
            if int(mm.sum()) != expected:
                raise ValueError(f"image placeholder tokens ({int(mm.sum())}) != image features ({expected}) in batch "
                                 f"{sample_ids[:3]}...: does a problem text contain '{IMAGE_PAD}'?")
        return PromptBatch(list(sample_ids), input_ids, mask, mm, pixel_values, grid, [len(i) for i in images])


class QwenVLFamily:
    """Model-side hooks for Qwen2-VL-style models: embeddings with image features, M-RoPE positions, the LM body."""

    def __init__(self, model):
        self.model = model
        self.vision_calls = 0  # images run through the vision tower; issue 8 asks for one pass per prompt

    @property
    def language_model(self):
        return self.model.model.language_model

    @property
    def lm_head(self):
        return self.model.lm_head

    def embed_tokens(self, ids: Tensor) -> Tensor:
        return self.model.model.get_input_embeddings()(ids)

    def prompt_embeds(self, batch: PromptBatch) -> PromptEmbeds:
        inner = self.model.model
        device = inner.get_input_embeddings().weight.device
        ids = batch.input_ids.to(device)
        mask = batch.attention_mask.to(device)
        embeds = self.embed_tokens(ids)
        if batch.pixel_values is not None:
            grid = batch.image_grid_thw.to(device)
            feats = inner.get_image_features(batch.pixel_values.to(device), grid, return_dict=True).pooler_output
            self.vision_calls += len(feats)
            feats = torch.cat(feats, dim=0).to(embeds.dtype)
            image_mask = (ids == inner.config.image_token_id).unsqueeze(-1)
            if int(image_mask.sum()) != feats.shape[0]:
                raise ValueError(f"{int(image_mask.sum())} image tokens but {feats.shape[0]} image features")
            embeds = embeds.masked_scatter(image_mask, feats)
            position_ids, _ = inner.get_rope_index(ids, batch.mm_token_type_ids.to(device), grid, None, mask)
        else:
            pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
            position_ids = pos.unsqueeze(0).expand(3, -1, -1)
        next_position = position_ids.amax(dim=(0, 2)) + 1
        return PromptEmbeds(embeds, mask, position_ids, next_position)

    def forward_hidden(self, embeds: Tensor, attention_mask: Tensor, position_ids: Tensor, cache=None) -> Tensor:
        out = self.language_model(inputs_embeds=embeds, attention_mask=attention_mask, position_ids=position_ids,
                                  cache=cache, use_cache=cache is not None)
        return out.last_hidden_state

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.language_model.config)
