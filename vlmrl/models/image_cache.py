"""`ImageCache`: a processor's processed image tensors, per image object, in one `BoundedLRU` (vlmrl.cache)."""

from __future__ import annotations

import itertools
import weakref

from torch import Tensor

from vlmrl.cache import BoundedLRU


def _processed_bytes(key: int, entry: tuple) -> int:
    """What one processed image holds: its tensors' bytes (the weak reference, placeholder text and counts are
    small beside them)."""
    return sum(t.numel() * t.element_size() for t in entry[1][0].values() if isinstance(t, Tensor))


class ImageCache:
    """Processed image tensors by image object, in a `BoundedLRU` (least recently used evicted past `max_bytes`,
    0 = off; 256 MiB by default, `model.image_cache_mb` in a recipe: the quickstart's 300 SFT and 600 held-out scenes
    take 270 MB, its 4,000 RL prompts 1.2 GB more; and past `max_entries`). Thread-safe: the server's thread pool
    builds prompts through it while its generation thread runs.

    The SFT labels and the held-out set show the same images every few steps and every evaluation; preprocessing
    (resize, normalise, patchify) took ~3 ms per image on CPU, about a tenth of an SFT step of the embedded model.
    Entries are keyed by the image object and dropped when it is garbage-collected (a weak reference), so images
    decoded on use from files are never served stale. Values are each image's slice of every vision tensor, its
    placeholder text and its token count: exactly what `process_images` gives for that image alone, since every
    family processes images independently and concatenates them along dim 0 (`ImageInputs.vision_rows`).

    Each stored entry also gets a serial number, never reused (`serials`): an image's key for as long as its entry
    lives, which lets the model side keep what it computes from the image (a frozen vision tower's features,
    vlmrl.models.vision_cache) without holding or comparing the image itself."""

    serials = itertools.count(1)  # shared by all caches, so two processors never hand out the same key

    def __init__(self, max_bytes: int = 256 * 2**20, max_entries: int = 65_536):
        self.lru: BoundedLRU[int, tuple] = BoundedLRU(max_bytes, max_entries, _processed_bytes)

    @property
    def max_bytes(self) -> int:
        return self.lru.max_bytes

    @max_bytes.setter
    def max_bytes(self, value: int) -> None:  # evicts down to the new bound now
        self.lru.max_bytes = value

    @property
    def bytes(self) -> int:
        return self.lru.bytes

    @property
    def hits(self) -> int:
        return self.lru.hits

    @property
    def misses(self) -> int:
        return self.lru.misses

    def __len__(self) -> int:
        return len(self.lru)

    def stats(self) -> dict[str, int]:
        return self.lru.stats()

    def clear(self) -> None:
        self.lru.clear()

    def get(self, image):
        entry = self.lru.get(id(image))
        if entry is None:
            return None
        if entry[0]() is not image:  # another object under a reused id (its entry's callback is still to run)
            self.lru.pop(id(image))
            return None
        return entry[1]

    def put(self, image, value: tuple[dict[str, Tensor], str, int, int | None]) -> bool:
        """Keep `value` (tensors, placeholder, tokens, serial) for `image`; False when it is not kept."""
        key = id(image)
        try:
            ref = weakref.ref(image, lambda dead, key=key: self._forget(key, dead))
        except TypeError:  # an image type without weak references: not cached
            return False
        return self.lru.put(key, (ref, value))

    def _forget(self, key: int, dead: weakref.ref) -> None:
        self.lru.pop_if(key, lambda entry: entry[0] is dead)
