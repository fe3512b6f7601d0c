"""Idefics3 and SmolVLM: images split into square tiles plus a global view, `<image>` tokens between tile markers.

An image resized to at most `size.longest_edge` is cut into rows x cols tiles of `max_image_size` px plus one global
tile; each tile gives `image_seq_len` = (tile/patch)^2 / scale_factor^2 tokens, framed by `<fake_token_around_image>`
and `<row_r_col_c>` (or `<global-img>`) tokens exactly as transformers' Idefics3Processor writes them. Positions are
1-D. The pixel budget: `model.max_pixels` bounds the resized image (longest edge = the largest whole number of tiles
whose square fits), which bounds the number of tiles.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from vlmrl.errors import ConfigError
from vlmrl.models.batch import PromptBatch
from vlmrl.models.families.base import VLFamily
from vlmrl.models.families.processor import ImageInputs, VLProcessor

FAKE = "<fake_token_around_image>"
GLOBAL = "<global-img>"
IMAGE = "<image>"
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def image_prompt_string(rows: int, cols: int, seq_len: int) -> str:
    """The placeholder span of one image (transformers' Idefics3/SmolVLM `replace_image_token`)."""
    single = f"{FAKE}{GLOBAL}{IMAGE * seq_len}{FAKE}"
    if rows == 0 and cols == 0:
        return single
    text = ""
    for r in range(rows):
        for c in range(cols):
            text += f"{FAKE}<row_{r + 1}_col_{c + 1}>{IMAGE * seq_len}"
        text += "\n"
    return text + "\n" + single


class Idefics3Processor(VLProcessor):
    family = "idefics3"
    image_marker = IMAGE
    image_token = IMAGE
    end_tokens = ("<end_of_utterance>",)
    builtin_template = CHAT_TEMPLATE
    image_processor_class = "Idefics3ImageProcessorPil"

    def options_from_config(self, config) -> dict:
        v = config.vision_config
        return {"image_seq_len": int((v.image_size // v.patch_size) ** 2 / config.scale_factor**2)}

    def set_pixel_budget(self, min_pixels: int | None, max_pixels: int | None) -> None:
        if min_pixels:
            raise ConfigError(f"model.min_pixels: the {self.family} family has no minimum (images are resized to "
                             f"whole tiles); remove the key")
        if max_pixels:
            tile = self.image_processor.max_image_size["longest_edge"]
            self.image_processor.size = {"longest_edge": max(tile, math.isqrt(max_pixels) // tile * tile)}

    def process_images(self, images: list) -> ImageInputs:
        out = self.image_processor(images=[[im] for im in images], return_tensors="pt", return_row_col_info=True)
        rows = [r[0] for r in out["rows"]]
        cols = [c[0] for c in out["cols"]]
        tiles = [r * c + 1 for r, c in zip(rows, cols, strict=True)]
        pixels = torch.cat([out["pixel_values"][i, :t] for i, t in enumerate(tiles)])
        masks = torch.cat([out["pixel_attention_mask"][i, :t] for i, t in enumerate(tiles)])
        seq = self.options["image_seq_len"]
        return ImageInputs({"pixel_values": pixels, "pixel_attention_mask": masks},
                           {"pixel_values": tiles, "pixel_attention_mask": tiles},
                           [image_prompt_string(r, c, seq) for r, c in zip(rows, cols, strict=True)],
                           [t * seq for t in tiles])


class SmolVLMProcessor(Idefics3Processor):
    family = "smolvlm"
    image_processor_class = "SmolVLMImageProcessorPil"


class Idefics3Family(VLFamily):
    language_attr = "text_model"
    vision_prefixes = ("model.vision_model.",)
    projector_prefixes = ("model.connector.",)
    features_cacheable = True  # each image's features from that image alone (vlmrl.models.vision_cache)

    def image_features(self, batch: PromptBatch) -> tuple[Tensor, dict[str, Tensor]]:
        pixels = batch.vision["pixel_values"].to(self.device).unsqueeze(0)  # [1, tiles, C, S, S]
        masks = batch.vision["pixel_attention_mask"].to(self.device).unsqueeze(0)
        out = self.inner.get_image_features(pixels, masks, return_dict=True)
        return torch.cat(out.pooler_output, dim=0), {}
