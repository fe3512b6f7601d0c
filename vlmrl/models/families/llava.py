"""LLaVA (1.5) and LLaVA-NeXT: a CLIP/SigLIP tower, a projector, any decoder; `<image>` expanded to one token per
feature. Positions are 1-D.

LLaVA resizes and centre-crops every image to the tower's size: (size/patch)^2 tokens (+1 with a CLS token when
`vision_feature_select_strategy` is "full"). LLaVA-NeXT ("anyres") also tiles the image at the best of
`image_grid_pinpoints` and unpads the tiles' features with one newline token per row: the count depends on the
original image size, computed here exactly as transformers' LlavaNextProcessor does. Neither has a pixel budget.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vlmrl.models.batch import PromptBatch
from vlmrl.models.families.base import VLFamily
from vlmrl.models.families.processor import ImageInputs, VLProcessor

IMAGE = "<image>"
# llava-hf/llava-1.5 style; real checkpoints ship their own template
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}USER: {% elif message['role'] == 'assistant' %}"
    "ASSISTANT: {% endif %}{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %} {% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def extra_tokens(config) -> int:
    """Tokens besides the patch grid: the CLS token a CLIP tower adds, dropped by the "default" strategy."""
    cls_token = 1 if config.vision_config.model_type == "clip_vision_model" else 0
    return cls_token - (1 if config.vision_feature_select_strategy == "default" else 0)


class LlavaProcessor(VLProcessor):
    family = "llava"
    image_marker = IMAGE
    image_token = IMAGE
    builtin_template = CHAT_TEMPLATE
    image_processor_class = "LlavaImageProcessorPil"

    def options_from_config(self, config) -> dict:
        return {"patch_size": config.vision_config.patch_size, "extra_tokens": extra_tokens(config)}

    def process_images(self, images: list) -> ImageInputs:
        pixels = self.image_processor(images=images, return_tensors="pt")["pixel_values"]
        p = self.options["patch_size"]
        n = (pixels.shape[-2] // p) * (pixels.shape[-1] // p) + self.options["extra_tokens"]
        return ImageInputs({"pixel_values": pixels}, {"pixel_values": [1] * len(images)}, [IMAGE * n] * len(images),
                           [n] * len(images))


class LlavaFamily(VLFamily):
    vision_prefixes = ("model.vision_tower.",)
    projector_prefixes = ("model.multi_modal_projector.",)
    features_cacheable = True  # each image's features from that image alone (vlmrl.models.vision_cache)

    def image_features(self, batch: PromptBatch) -> tuple[Tensor, dict[str, Tensor]]:
        cfg = self.model.config
        out = self.inner.get_image_features(batch.vision["pixel_values"].to(self.device),
                                            vision_feature_layer=cfg.vision_feature_layer,
                                            vision_feature_select_strategy=cfg.vision_feature_select_strategy,
                                            return_dict=True)
        return torch.cat([f.reshape(-1, f.shape[-1]) for f in out.pooler_output]), {}


def anyres_features(orig_h: int, orig_w: int, tile: int, patch: int, pinpoints: list) -> int:
    """Feature count of one LLaVA-NeXT image before strategy adjustments (transformers'
    LlavaNextProcessor._get_number_of_features): the base tile's grid, the unpadded grid of the best-resolution tiles
    and one newline per unpadded row."""
    from transformers.image_processing_utils import select_best_resolution

    best_h, best_w = select_best_resolution([orig_h, orig_w], pinpoints)
    side = tile // patch
    cur_h, cur_w = side * (best_h // tile), side * (best_w // tile)
    if orig_w / orig_h > cur_w / cur_h:
        new_h = int(round(orig_h * (cur_w / orig_w), 7))
        cur_h -= 2 * ((cur_h - new_h) // 2)
    else:
        new_w = int(round(orig_w * (cur_h / orig_h), 7))
        cur_w -= 2 * ((cur_w - new_w) // 2)
    return cur_h * cur_w + cur_h + side * side


class LlavaNextProcessor(LlavaProcessor):
    family = "llava_next"
    image_processor_class = "LlavaNextImageProcessorPil"

    def options_from_config(self, config) -> dict:
        return {**super().options_from_config(config), "tile": config.vision_config.image_size,
                "pinpoints": [list(p) for p in config.image_grid_pinpoints]}

    def process_images(self, images: list) -> ImageInputs:
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        out = self.image_processor(images=images, return_tensors="pt")
        o = self.options
        sizes = out["image_sizes"]
        tiles = [image_size_to_num_patches(s.tolist(), o["pinpoints"], o["tile"]) for s in sizes]
        pixels = torch.cat([out["pixel_values"][i, :t] for i, t in enumerate(tiles)])
        tokens = [anyres_features(int(h), int(w), o["tile"], o["patch_size"], o["pinpoints"]) + o["extra_tokens"]
                  for h, w in sizes.tolist()]
        return ImageInputs({"pixel_values": pixels, "image_sizes": sizes},
                           {"pixel_values": tiles, "image_sizes": [1] * len(images)}, [IMAGE * n for n in tokens],
                           tokens)


class LlavaNextFamily(LlavaFamily):
    projector_prefixes = ("model.multi_modal_projector.", "model.image_newline")

    def image_features(self, batch: PromptBatch) -> tuple[Tensor, dict[str, Tensor]]:
        cfg = self.model.config
        out = self.inner.get_image_features(batch.vision["pixel_values"].to(self.device),
                                            batch.vision["image_sizes"].to(self.device),
                                            vision_feature_layer=cfg.vision_feature_layer,
                                            vision_feature_select_strategy=cfg.vision_feature_select_strategy,
                                            return_dict=True)
        return torch.cat(list(out.pooler_output)), {}
