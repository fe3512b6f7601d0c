"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: dynamic-resolution patches, `<|image_pad|>` placeholders, 3-D M-RoPE positions.

Each image becomes (h/14 x w/14) patches (16 px for Qwen3-VL) merged 2x2 into one token each, so the token count
follows the pixel budget (`model.min_pixels` / `model.max_pixels`). Positions come from the model's own
`get_rope_index` over the prompt; completion tokens continue at `next_position + t` in all three rows, which is what
the model's generation does (text after the last image advances all three rows together). Qwen3-VL also adds
"deepstack" features of early vision layers to the hidden states of image tokens in the first decoder layers; they are
carried in `PromptEmbeds.extras` so the prefill and the training forward both add them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vlmrl.models.batch import PromptBatch
from vlmrl.models.families.base import VLFamily
from vlmrl.models.families.processor import ImageInputs, VLProcessor

IMAGE_PAD = "<|image_pad|>"
VISION_BLOCK = "<|vision_start|><|image_pad|><|vision_end|>"
# A minimal Qwen chat template (image placeholders inline, no default system prompt), used by the tiny model and
# whenever a checkpoint ships none. Real checkpoints use their own (Qwen2-VL's adds "You are a helpful assistant.").
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class QwenVLProcessor(VLProcessor):
    """Image-only processor for the Qwen-VL families (tokenizer + `Qwen2VLImageProcessorPil`).

    transformers' `Qwen2VLProcessor` needs torchvision for its video slot (docs/models.md); prompts here are images and
    text, so this class does the same placeholder expansion without it, and works for the real Qwen tokenizers too.
    """

    family = "qwen2_vl"
    image_marker = IMAGE_PAD
    image_token = IMAGE_PAD
    end_tokens = ("<|im_end|>",)
    builtin_template = CHAT_TEMPLATE
    image_processor_class = "Qwen2VLImageProcessorPil"

    @property
    def merge_size(self) -> int:
        return getattr(self.image_processor, "merge_size", 2)

    def set_pixel_budget(self, min_pixels: int | None, max_pixels: int | None) -> None:
        """min/max pixels per image: images are resized (aspect kept) so that h*w lies in [min_pixels, max_pixels]."""
        size = dict(self.image_processor.size)
        if min_pixels:
            size["shortest_edge"] = min_pixels
        if max_pixels:
            size["longest_edge"] = max_pixels
        self.image_processor.size = size

    def max_image_pixels(self) -> int | None:
        return self.image_processor.size.get("longest_edge")

    def process_images(self, images: list) -> ImageInputs:
        out = self.image_processor(images=images, return_tensors="pt")
        grid = out["image_grid_thw"]
        patches = grid.prod(-1)
        tokens = (patches // self.merge_size**2).tolist()
        return ImageInputs({"pixel_values": out["pixel_values"], "image_grid_thw": grid},
                           {"pixel_values": patches.tolist(), "image_grid_thw": [1] * len(images)},
                           [IMAGE_PAD * n for n in tokens], tokens)


def patch_embed_as_linear(conv: torch.nn.Conv3d) -> None:
    """Run the patch embedding as the matrix product it is. Its input is one patch per row ([N, C, T, P, P], kernel =
    stride = the patch), so the Conv3d is x.flatten(1) @ W.flatten(1).T: the same weights and the same math (up to
    float summation order), but one GEMM instead of a 3-D convolution, which on CPU took ~20% of a training step of
    the embedded model (oneDNN's conv3d is slow for a 1x1x1 output). The weight stays the Conv3d's parameter, so
    checkpoints, LoRA and FSDP2 see the module unchanged."""
    if conv.padding not in ((0, 0, 0), "valid") or conv.groups != 1 or tuple(conv.kernel_size) != tuple(conv.stride):
        return  # not a patchify conv: keep the convolution

    def forward(x: Tensor) -> Tensor:
        if tuple(x.shape[2:]) != tuple(conv.kernel_size):
            return torch.nn.Conv3d.forward(conv, x)
        out = torch.nn.functional.linear(x.flatten(1), conv.weight.flatten(1), conv.bias)
        return out.view(*out.shape, 1, 1, 1)

    conv.forward = forward


def batched_vision_attention(attn: torch.nn.Module) -> None:
    """Run Qwen2-VL's vision self-attention in one call when every image has the same number of patches.

    transformers splits the patch sequence at `cu_seqlens` and calls attention once per image (outside flash
    attention); with the quickstart's 16 images of 64 patches that is 16 small kernels per layer, each mostly
    overhead on CPU. Equal-length images are independent rows of one [images, heads, patches, dim] attention: the
    same math in one kernel. Anything else (images of different sizes, another attention implementation, dropout)
    takes transformers' own path: the class's forward on this module. (Not a captured `attn.forward`: a deep copy of
    the model, such as the frozen reference, carries this closure of the original module until its family patches
    the copy again, and a captured bound method would run the original's weights.)"""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb_vision

    def forward(hidden_states: Tensor, cu_seqlens: Tensor, position_embeddings=None, **kwargs) -> Tensor:
        lengths = cu_seqlens.diff()
        if (attn.config._attn_implementation != "sdpa" or position_embeddings is None or len(lengths) < 2
                or (attn.training and attn.attention_dropout) or not bool((lengths == lengths[0]).all())):
            return type(attn).forward(attn, hidden_states, cu_seqlens=cu_seqlens,
                                      position_embeddings=position_embeddings, **kwargs)
        s, images = hidden_states.shape[0], len(lengths)
        q, k, v = attn.qkv(hidden_states).reshape(s, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        q, k = apply_rotary_pos_emb_vision(q, k, *position_embeddings)
        q, k, v = (x.reshape(images, s // images, attn.num_heads, -1).transpose(1, 2) for x in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=attn.scaling)
        return attn.proj(out.transpose(1, 2).reshape(s, -1))

    attn.forward = forward


class QwenVLFamily(VLFamily):
    """Qwen2-VL / Qwen2.5-VL: vision features into `<|image_pad|>` tokens, M-RoPE positions from `get_rope_index`."""

    vision_prefixes = ("model.visual.",)
    projector_prefixes = ("model.visual.merger.",)
    features_cacheable = True

    def __init__(self, model):
        super().__init__(model)
        self.rope_rows: dict[tuple[bytes, tuple[int, ...]], Tensor] = {}  # see `positions`
        self.vision_rows: dict[tuple[int, ...], Tensor] = {}  # see `vision_positions`
        patch_embed_as_linear(self.inner.visual.patch_embed.proj)
        from transformers.models.qwen2_vl.modeling_qwen2_vl import VisionAttention
        for block in getattr(self.inner.visual, "blocks", []):
            if type(block.attn) is VisionAttention:  # Qwen2-VL's (Qwen2.5-VL's windows differ in length)
                batched_vision_attention(block.attn)

    def vision_output(self, batch: PromptBatch):
        grid = batch.vision["image_grid_thw"]
        return self.inner.get_image_features(batch.vision["pixel_values"].to(self.device), grid.to(self.device),
                                             image_position_ids=self.vision_positions(grid), return_dict=True)

    def vision_positions(self, grid: Tensor) -> Tensor:
        """The vision tower's rotary position ids of every patch, as transformers computes them (a Python loop over
        the images, ~2-4 ms of a 16-image call), joined from one remembered entry per image grid; the tower takes
        them precomputed (`image_position_ids`)."""
        from transformers.vision_utils import get_vision_position_ids

        merge = self.inner.visual.spatial_merge_size
        parts = []
        for thw in map(tuple, grid.tolist()):
            ids = self.vision_rows.get(thw)
            if ids is None:
                if len(self.vision_rows) >= 1024:
                    self.vision_rows.clear()
                ids = self.vision_rows[thw] = get_vision_position_ids(torch.tensor([thw]), merge).to(self.device)
            parts.append(ids)
        return torch.cat(parts)

    def image_features(self, batch: PromptBatch) -> tuple[Tensor, dict[str, Tensor]]:
        return torch.cat(self.vision_output(batch).pooler_output, dim=0), {}

    def positions(self, batch: PromptBatch, ids: Tensor, mask: Tensor) -> Tensor:
        """`get_rope_index` row by row, remembered by what it reads: a row's positions are a function of its real
        tokens' types (text or image) and its images' grids only, so prompts of one layout share one entry
        (transformers' Python loop cost ~0.4 ms per row, ~7 ms of a 16-prompt rollout call). Padding gets 0."""
        if not batch.vision:
            return super().positions(batch, ids, mask)
        grids = batch.vision["image_grid_thw"].cpu()
        real_rows, types = mask.bool().cpu(), batch.mm_token_type_ids.cpu()
        out = torch.zeros(3, *ids.shape, dtype=ids.dtype)
        first = 0
        for row, count in enumerate(batch.images_per_prompt):
            real = real_rows[row]
            row_types, row_grids = types[row][real], grids[first:first + count]
            first += count
            key = (row_types.numpy().tobytes(), tuple(row_grids.flatten().tolist()))
            pos = self.rope_rows.get(key)
            if pos is None:
                pos = self.inner.get_rope_index(input_ids=ids[row:row + 1, real.to(ids.device)].cpu(),
                                                mm_token_type_ids=row_types[None],
                                                image_grid_thw=row_grids)[0][:, 0]
                if len(self.rope_rows) >= 1024:  # bounded: a dataset of many layouts starts over
                    self.rope_rows.clear()
                self.rope_rows[key] = pos
            out[:, row, real] = pos
        if len(batch.images_per_prompt) != len(ids) or first != len(grids):  # every row and every image placed
            raise ValueError(f"prompt batch {batch.sample_ids[:3]}...: images_per_prompt {batch.images_per_prompt} "
                             f"does not match its {len(ids)} rows and {len(grids)} images")
        return out.to(ids.device)

    def text_positions(self, position_ids: Tensor) -> Tensor:
        return position_ids  # all three M-RoPE rows


class Qwen3VLProcessor(QwenVLProcessor):
    family = "qwen3_vl"


class Qwen3VLFamily(QwenVLFamily):
    """Qwen3-VL: Qwen2-VL's layout plus deepstack features added to image tokens in the first decoder layers."""

    projector_prefixes = ("model.visual.merger.", "model.visual.deepstack_merger_list.")

    def image_features(self, batch: PromptBatch) -> tuple[Tensor, dict[str, Tensor]]:
        """Rows [n_tokens, 1 + layers, H]: each placeholder token's feature, then its deepstack features."""
        out = self.vision_output(batch)
        feats = torch.cat(out.pooler_output, dim=0)
        deep = torch.stack([torch.cat(layer, dim=0) for layer in out.deepstack_features], dim=1)
        return torch.cat([feats[:, None], deep], dim=1), {}

    def finish_features(self, batch: PromptBatch, rows: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        feats, deep = rows[:, 0], rows[:, 1:]
        # deepstack [n_tokens, layers, H] in placeholder order, packed per prompt row: [P, V_max, layers, H]
        place = batch.mm_token_type_ids.to(feats.device).bool()
        counts = place.sum(-1)
        packed = deep.new_zeros(len(batch), int(counts.max()), *deep.shape[1:])
        valid = torch.arange(packed.shape[1], device=deep.device) < counts[:, None]
        packed[valid] = deep
        return feats, {"visual_mask": place, "deepstack": packed}

    def forward_hidden(self, embeds: Tensor, attention_mask: Tensor, position_ids: Tensor, cache=None,
                       extras: dict[str, Tensor] | None = None) -> Tensor:
        kwargs = {}
        if extras and "deepstack" in extras:
            visual = extras["visual_mask"]
            visual = torch.nn.functional.pad(visual, (0, embeds.shape[1] - visual.shape[1]), value=False)
            packed = extras["deepstack"]
            valid = torch.arange(packed.shape[1], device=packed.device) < visual.sum(-1)[:, None]
            kwargs = {"visual_pos_masks": visual,
                      "deepstack_visual_embeds": [packed[:, :, k][valid] for k in range(packed.shape[2])]}
        with self.autocast():
            out = self.language_model(inputs_embeds=embeds, attention_mask=attention_mask, position_ids=position_ids,
                                      cache=cache, use_cache=cache is not None, **kwargs)
        return out.last_hidden_state
