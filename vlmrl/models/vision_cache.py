"""A frozen vision tower's image features, kept per image.

With `model.freeze_vision` and `model.freeze_projector` (or under LoRA without `include_vision`, where PEFT freezes
every base weight) the features of an image never change during training, yet every generation call, every training
forward and every evaluation runs the vision tower on each of its images again. This cache keeps each image's
features the first time they are computed and hands them back after that, exactly as the tower would compute them
again (the tower processes images independently: a feature row depends on its own image only).

An image's key is its processor-cache serial (`PromptBatch.image_keys`, vlmrl.models.image_cache.ImageCache):
a batch built without keys or with the processor cache off runs the tower as before. Within one call of a multi-turn
batch (a `ConversationBatch`, which carries its prompt's image once per trajectory) the same key twice runs the tower
once, whether the tower trains or not: the copies reuse its rows, and their gradients add up in them. Other batches
run every image they hold (an SFT batch that drew a sample twice stays bit-identical to before).
The cache checks the tower's weights on every call (the storage and in-place version counter of each vision and
projector parameter) and starts over when any changed: a loaded checkpoint or an optimizer step on a weight that was
unfrozen is never served stale features. It applies only where every vision and projector weight is frozen, the
family declares its rows cacheable (`image_features` gives one row per placeholder token, each from its own image, and
no extras; what depends on the prompt comes after, from `finish_features`), and no FSDP2 dummy image is in use
(FSDP2 needs the tower in every forward).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from vlmrl.cache import BoundedLRU
from vlmrl.models.batch import ConversationBatch, PromptBatch


def _feature_bytes(key: int, features: Tensor) -> int:
    return features.numel() * features.element_size()


class VisionFeatureCache(BoundedLRU[int, Tensor]):
    """Image features by image key, least recently used evicted past `max_bytes` (0 = off) or `max_entries`."""

    def __init__(self, max_bytes: int = 256 * 2**20, max_entries: int = 65_536):
        super().__init__(max_bytes, max_entries, _feature_bytes)
        self.weights: tuple | None = None  # the fingerprint of the weights the entries were computed with

    def check_weights(self, params: list[Tensor]) -> None:
        """Start over unless `params` are the same tensors, unmodified, as when the entries were computed."""
        fingerprint = tuple((p.data_ptr(), p._version) for p in params)
        if fingerprint != self.weights:
            self.clear()
            self.weights = fingerprint

    def get(self, key: int | None, default: Tensor | None = None) -> Tensor | None:
        return default if key is None else super().get(key, default)

    def put(self, key: int | None, features: Tensor) -> bool:
        return key is not None and super().put(key, features.detach())


def frozen_vision_params(family) -> list[Tensor] | None:
    """The vision tower's and projector's parameters when none of them trains, else None."""
    prefixes, params = family.vision_prefixes + family.projector_prefixes, []
    for name, p in family.model.named_parameters():
        if name.startswith(prefixes):
            if p.requires_grad:  # (a training tower, the quickstart's: every generation call asks, so stop here)
                return None
            params.append(p)
    return params or None


def cached_image_features(family, batch: PromptBatch) -> tuple[Tensor, dict[str, Tensor], int]:
    """`family.image_features(batch)`, from `family.vision_cache` where it applies (see the module docstring), and
    with each distinct image run through the tower once per call where the family's rows are per image (a
    multi-turn batch holds its prompt's image once per trajectory: G copies of the same key); returns (rows,
    extras, images run through the tower)."""
    cache, keys = family.vision_cache, batch.keys_of_images()
    if not family.features_cacheable:
        feats, extras = family.image_features(batch)
        return feats, extras, len(keys)
    params = frozen_vision_params(family) if (cache.max_bytes and family.dummy_vision is None
                                              and any(k is not None for k in keys)) else None
    if params is not None:
        cache.check_weights(params)
    found = [cache.get(k) for k in keys] if params is not None else [None] * len(keys)
    # within a call each key once where copies are structural (a multi-turn batch: its prompt's image once per
    # trajectory); elsewhere (an SFT batch that drew one sample twice) every image runs as before, bit for bit
    shared = isinstance(batch, ConversationBatch)
    first: dict[int, int] = {}  # each key's first image still to compute; its copies reuse those rows
    missing = [i for i, k in enumerate(keys)
               if found[i] is None and (k is None or not shared or first.setdefault(k, i) == i)]
    if len(missing) == len(keys):  # nothing cached, nothing repeated: the plain call
        feats, extras = family.image_features(batch)
        if params is not None:
            for k, part in zip(keys, feats.split(batch.image_tokens), strict=True):
                cache.put(k, part.clone())  # a copy: a kept view would keep the whole call's features alive
        return feats, extras, len(keys)
    if missing:
        vision, vision_rows = batch.select_images(missing)
        # image_features reads the image tensors only (`vision`), so a batch of just the missing images will do
        sub = dataclasses.replace(batch, vision=vision, vision_rows=vision_rows, images_per_prompt=[len(missing)],
                                  image_tokens=[batch.image_tokens[i] for i in missing],
                                  image_keys=[keys[i] for i in missing])
        feats, extras = family.image_features(sub)
        if extras:
            raise ValueError(f"{type(family).__name__}: features_cacheable is set but image_features returns "
                             f"per-prompt extras {sorted(extras)}")
        for i, part in zip(missing, feats.split(sub.image_tokens), strict=True):
            found[i] = part
            if params is not None:
                cache.put(keys[i], part.clone())
    found = [f if f is not None else found[first[k]] for f, k in zip(found, keys, strict=True)]  # (copies only)
    return (found[0] if len(found) == 1 else torch.cat(found)), {}, len(missing)
