"""Gemma 3: a SigLIP tower at a fixed size, average-pooled to `mm_tokens_per_image` soft tokens per image.

The chat template writes `<start_of_image>`; it becomes "\\n\\n<start_of_image>" + `<image_soft_token>` x N +
"<end_of_image>\\n\\n" as in transformers' Gemma3Processor (pan-and-scan crops are not used). Positions are 1-D.
Gemma 3 attends bidirectionally among the soft tokens of one image (causally everywhere else): the prompt's
soft-token mask travels in `PromptEmbeds.extras`, and the prefill and the training forward both build that mask;
decoding steps are plain causal, as in the model's own generation.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vlmrl.models.batch import PromptBatch
from vlmrl.models.families.base import VLFamily
from vlmrl.models.families.processor import ImageInputs, VLProcessor

BOI, EOI, SOFT = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{% if message['role'] == 'assistant' %}model{% else %}{{ message['role'] }}{% endif %}{{ '\\n' }}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<start_of_image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


class Gemma3Processor(VLProcessor):
    family = "gemma3"
    image_marker = BOI
    image_token = SOFT
    end_tokens = ("<end_of_turn>",)
    builtin_template = CHAT_TEMPLATE
    image_processor_class = "Gemma3ImageProcessorPil"

    def options_from_config(self, config) -> dict:
        return {"image_seq_len": config.mm_tokens_per_image}

    def process_images(self, images: list) -> ImageInputs:
        pixels = self.image_processor(images=images, return_tensors="pt", do_pan_and_scan=False)["pixel_values"]
        n = self.options["image_seq_len"]
        span = f"\n\n{BOI}{SOFT * n}{EOI}\n\n"
        return ImageInputs({"pixel_values": pixels}, {"pixel_values": [1] * len(images)}, [span] * len(images),
                           [n] * len(images))


class Gemma3Family(VLFamily):
    vision_prefixes = ("model.vision_tower.",)
    projector_prefixes = ("model.multi_modal_projector.",)
    features_cacheable = True  # each image's features from that image alone (vlmrl.models.vision_cache)

    def image_features(self, batch: PromptBatch) -> tuple[Tensor, dict[str, Tensor]]:
        out = self.inner.get_image_features(batch.vision["pixel_values"].to(self.device), return_dict=True)
        feats = out.pooler_output
        return feats.reshape(-1, feats.shape[-1]), {}

    def finish_features(self, batch: PromptBatch, rows: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        return rows, {"image_mask": batch.mm_token_type_ids.to(self.device)}  # image blocks attend bidirectionally

    def forward_hidden(self, embeds: Tensor, attention_mask: Tensor, position_ids: Tensor, cache=None,
                       extras: dict[str, Tensor] | None = None) -> Tensor:
        mask = attention_mask
        positions = self.text_positions(position_ids)
        if extras and "image_mask" in extras:
            from transformers.models.gemma3.modeling_gemma3 import (
                create_masks_for_vision_model,
                get_block_sequence_ids_for_mask,
            )

            types = extras["image_mask"]
            types = torch.nn.functional.pad(types, (0, embeds.shape[1] - types.shape[1]), value=0)
            mask = create_masks_for_vision_model(
                config=self.language_model.config, inputs_embeds=embeds, attention_mask=attention_mask, cache=cache,
                position_ids=positions, block_sequence_ids=get_block_sequence_ids_for_mask(types, embeds.device))
        with self.autocast():
            out = self.language_model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions, cache=cache,
                                      use_cache=cache is not None)
        return out.last_hidden_state
