"""The model side of a model family: `VLFamily`, the hooks between a Hugging Face VLM and vlmrl's loop.

A family is one small module that subclasses `VLProcessor` (the text side, vlmrl.models.families.processor) and
`VLFamily` and overrides what differs on the model side: the image features in placeholder order
(`image_features`), the position ids (`positions`, 1-D cumsum of the attention mask by default), and anything the
language model needs besides embeddings (`forward_hidden`). Prompt embeddings with the image features in place, the
frozen tower's feature cache and the KV cache are shared here.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from vlmrl.errors import DataError
from vlmrl.models.attention import use_decode_attention
from vlmrl.models.batch import PromptBatch, PromptEmbeds
from vlmrl.models.vision_cache import VisionFeatureCache, cached_image_features


def unwrap_peft(model):
    """The transformers model inside a PEFT wrapper (LoRA layers are injected in place, so hooks see them)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


class VLFamily:
    """Model-side hooks: prompt embeddings with image features in place, positions, the language model body."""

    language_attr = "language_model"  # the decoder, an attribute of model.model
    vision_prefixes: tuple[str, ...] = ()  # parameter-name prefixes of the vision tower (projector excluded)
    projector_prefixes: tuple[str, ...] = ()  # parameter-name prefixes of the vision-to-text projector
    # image_features gives one row per placeholder token, image by image, each from its own image, and no extras: a
    # frozen tower's rows can be kept per image (vlmrl.models.vision_cache)
    features_cacheable = False

    def __init__(self, model):
        self.model = unwrap_peft(model)
        self.vision_calls = 0  # images run through the vision tower (one pass per prompt image)
        self.vision_cache = VisionFeatureCache()  # a frozen tower's features per image (model.vision_cache_mb)
        # forwards on CUDA run under bf16 autocast (model.autocast: false turns it off); CPU runs in the weights' dtype
        self.autocast_dtype: torch.dtype | None = torch.bfloat16
        # FSDP2: a one-image batch that text-only forwards run through the vision tower with weight 0, so every rank
        # gathers and reduces the vision units in every forward and backward (set by trainer.distributed.wrap)
        self.dummy_vision: PromptBatch | None = None
        use_decode_attention(self.language_model.config)  # CPU decoding steps: vlmrl/models/attention.py

    @property
    def inner(self):
        return self.model.model

    @property
    def language_model(self):
        return getattr(self.inner, self.language_attr)

    def lm_head(self, hidden: Tensor) -> Tensor:
        """Next-token logits from final hidden states (under the same autocast as the body)."""
        with self.autocast():
            return self.model.lm_head(hidden)

    @property
    def device(self) -> torch.device:
        return self.inner.get_input_embeddings().weight.device

    def autocast(self):
        if self.autocast_dtype is None or self.device.type != "cuda":
            return contextlib.nullcontext()
        return torch.autocast("cuda", dtype=self.autocast_dtype)

    def embed_tokens(self, ids: Tensor) -> Tensor:
        return self.inner.get_input_embeddings()(ids)

    def image_features(self, batch: PromptBatch) -> tuple[Tensor, dict[str, Tensor]]:
        """Rows [n_placeholder_tokens, ...] of all images, in placeholder order (the features, unless
        `finish_features` makes them from the rows), and per-prompt extras."""
        raise NotImplementedError

    def finish_features(self, batch: PromptBatch, rows: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """(features [n_placeholder_tokens, H], per-prompt extras) from `image_features`' rows, one per placeholder
        token. By default the rows are the features and there are no extras; Gemma 3 adds its image-token mask,
        Qwen3-VL unpacks its deepstack features. Kept apart from `image_features` so that its rows, which depend on
        each image alone, can be kept per image for a frozen tower (vlmrl.models.vision_cache)."""
        return rows, {}

    @property
    def uniform_calls(self) -> bool:
        """Every training forward runs the same modules in the same order whatever its rows (FSDP2's collectives
        need it on every rank): text-only batches run the vision tower on `dummy_vision`, and the shared-prompt
        forward always runs its prefill and its tail (vlmrl.models.forward.sequence_logprobs)."""
        return self.dummy_vision is not None

    def zero_vision_term(self) -> Tensor:
        """0 x (the vision tower's output on `dummy_vision`): a text-only batch's forward still runs every vision
        parameter (its gradient is 0), as FSDP2's per-unit collectives need on every rank."""
        feats, extras = self.image_features(self.dummy_vision)
        term = feats.float().sum() * 0.0
        for value in extras.values():
            if value.is_floating_point():
                term = term + value.float().sum() * 0.0
        return term

    def positions(self, batch: PromptBatch, ids: Tensor, mask: Tensor) -> Tensor:
        """[3, P, L] positions: the cumulative count of real tokens (left padding gets 0), the same in all rows."""
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        return pos.unsqueeze(0).expand(3, -1, -1)

    def text_positions(self, position_ids: Tensor) -> Tensor:
        """What the language model takes as position_ids: row 0 for 1-D families."""
        return position_ids[0]

    def prompt_embeds(self, batch: PromptBatch) -> PromptEmbeds:
        device = self.device
        ids = batch.input_ids.to(device)
        mask = batch.attention_mask.to(device)
        place = batch.mm_token_type_ids.to(device).bool()
        with self.autocast():
            # placeholder ids may lie outside the text vocabulary (Gemma 3): their embeddings are overwritten anyway
            embeds = self.embed_tokens(ids.masked_fill(place, 0))
            extras: dict[str, Tensor] = {}
            if batch.vision:
                rows, extras, computed = cached_image_features(self, batch)
                feats, more = self.finish_features(batch, rows)
                extras = {**extras, **more}
                self.vision_calls += computed
                if int(place.sum()) != feats.shape[0]:
                    raise DataError(f"prompts {batch.sample_ids[:3]}...: {int(place.sum())} image placeholder "
                                     f"tokens but {feats.shape[0]} image features")
                embeds = embeds.masked_scatter(place.unsqueeze(-1), feats.to(embeds.device, embeds.dtype))
            elif self.dummy_vision is not None and torch.is_grad_enabled():
                embeds = embeds + self.zero_vision_term().to(embeds.dtype)
        position_ids = self.positions(batch, ids, mask)
        next_position = position_ids.amax(dim=(0, 2)) + 1
        return PromptEmbeds(embeds, mask, position_ids, next_position, extras)

    def forward_hidden(self, embeds: Tensor, attention_mask: Tensor, position_ids: Tensor, cache=None,
                       extras: dict[str, Tensor] | None = None) -> Tensor:
        """Final hidden states [N, S, H]. `extras` (from PromptEmbeds) covers the first columns when the call
        includes the prompt (prefill, training forward); decoding steps pass none."""
        with self.autocast():
            out = self.language_model(inputs_embeds=embeds, attention_mask=attention_mask,
                                      position_ids=self.text_positions(position_ids), cache=cache,
                                      use_cache=cache is not None)
        return out.last_hidden_state

    def new_cache(self, reserve: int = 0):
        """An empty KV cache; `reserve` > 0 (generation: the answer budget) keeps that many columns free after the
        prompt, so decoding writes in place instead of concatenating (vlmrl/models/kv_cache.py)."""
        from vlmrl.models.kv_cache import generation_cache

        return generation_cache(self.language_model.config, reserve)
