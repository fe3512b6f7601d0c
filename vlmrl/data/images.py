"""Images of user data, decoded on use: ``LazyImages`` holds paths or encoded bytes and decodes through a bounded cache.

A user dataset keeps what its file names (an absolute path, or the encoded bytes of a parquet/``datasets`` cell),
never the pixels, so loading 100,000 rows costs their paths, not 100,000 decoded images, and every rank pays only for
the images it uses. Indexing or iterating a ``LazyImages`` decodes (RGB PIL images); ``len()`` and truth never do.

Decoded images go through ``IMAGE_CACHE``, a least-recently-used cache bounded by bytes (``VLMRL_IMAGE_CACHE_MB``,
default 256) and by count (4096), shared by every dataset of the process: a prompt's images decode once for its
generation and training forward, an evaluation set small enough to fit decodes once per run. Treat a returned image
as read-only: it may be the cached object.

Loading checks each image cheaply (``check_images``: the file exists, and its header names a format and a size); an
image that passes that and still fails to decode (a truncated file) raises DataError naming its file and line when
it is first used, mid-training: the run stops with that message, nothing is skipped silently. Pass
``check_images="decode"`` to find every such image while loading instead.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator, Sequence
from typing import Any

from PIL import Image, UnidentifiedImageError

from vlmrl.cache import BoundedLRU
from vlmrl.errors import DataError

CHECKS: tuple[str, ...] = ("exists", "header", "decode")
DECODE_ERRORS = (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError)
_ENTRY_OVERHEAD = 1024  # bytes a cached PIL image costs beyond its pixels (objects, the key)

Ref = str | bytes | Image.Image  # an absolute path, encoded image bytes, or an image already in memory (RGB)


def _decoded_bytes(key: Any, image: Image.Image) -> int:
    """What a decoded image holds: its pixels, plus the objects around them."""
    return image.width * image.height * len(image.getbands()) + _ENTRY_OVERHEAD


def image_cache(max_bytes: int, max_entries: int = 4096) -> BoundedLRU[Any, Image.Image]:
    """A thread-safe LRU of decoded images (vlmrl.cache), bounded by pixel bytes and by entry count."""
    return BoundedLRU(max_bytes, max_entries, _decoded_bytes)


def _cache_bytes(text: str) -> int:
    try:
        megabytes = float(text)
    except ValueError:
        megabytes = -1.0
    if not 0 <= megabytes < float("inf"):  # also NaN
        raise DataError(f"VLMRL_IMAGE_CACHE_MB must be a number of megabytes >= 0 (0: no cache), got {text!r}")
    return int(megabytes * 2**20)


IMAGE_CACHE = image_cache(_cache_bytes(os.environ.get("VLMRL_IMAGE_CACHE_MB", "256")))


class LazyImages(Sequence):
    """A sample's images as a read-only sequence that decodes each one (RGB) when it is indexed or iterated.

    ``refs`` are absolute paths, encoded bytes, or RGB PIL images already in memory; ``where`` (``"data.jsonl line
    17"``) starts the DataError raised when one does not decode. Equal to a list of the same images; pickles as
    its references (a reward worker decodes its own copy).
    """

    __slots__ = ("refs", "where")

    def __init__(self, refs: Sequence[Ref] = (), where: str = "sample"):
        self.refs: tuple[Ref, ...] = tuple(refs)
        self.where = where

    def __len__(self) -> int:
        return len(self.refs)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self.refs)))]
        return load_image(self.refs[index], self.where)

    def __iter__(self) -> Iterator[Image.Image]:
        for ref in self.refs:
            yield load_image(ref, self.where)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LazyImages):
            return self.refs == other.refs or list(self) == list(other)
        if isinstance(other, (list, tuple)):
            return len(other) == len(self.refs) and list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable-looking like a list: not hashable

    def __repr__(self) -> str:
        shown = [r if isinstance(r, str) else f"<{type(r).__name__} {_size(r)}>" for r in self.refs]
        return f"LazyImages({shown}, where={self.where!r})"

    def __reduce__(self):
        return (LazyImages, (self.refs, self.where))


def image_sizes(images: Sequence) -> list[tuple[int, int]]:
    """(width, height) of each image of a sample, read from headers for LazyImages (nothing is decoded or cached):
    what a prompt's length depends on."""
    if not isinstance(images, LazyImages):
        return [im.size for im in images]
    out = []
    for ref in images.refs:
        if isinstance(ref, Image.Image):
            out.append(ref.size)
            continue
        try:
            with Image.open(ref if isinstance(ref, str) else io.BytesIO(ref)) as image:
                out.append(image.size)
        except DECODE_ERRORS as error:
            raise DataError(f"{images.where}: {describe(ref)} could not be read ({error})") from None
    return out


def _size(ref: Ref) -> str:
    return f"{len(ref)} bytes" if isinstance(ref, bytes) else f"{ref.width}x{ref.height}"


def load_image(ref: Ref, where: str = "sample") -> Image.Image:
    """One reference decoded to RGB (through ``IMAGE_CACHE``); DataError naming ``where`` and the image if it fails."""
    if isinstance(ref, Image.Image):
        return ref
    key = ref if isinstance(ref, str) else ("bytes", ref)  # bytes hash once (CPython caches it on the object)
    return IMAGE_CACHE.get_or_make(key, lambda: _decode_or_raise(ref, where))


def describe(ref: Ref) -> str:
    """How messages name an image: "image '/its/path.png'", or "image bytes"."""
    return f"image {ref!r}" if isinstance(ref, str) else "image bytes"


def decode(ref: str | bytes) -> Image.Image:
    """Decode a path or encoded bytes to an RGB image, without the cache; raises one of ``DECODE_ERRORS``."""
    with Image.open(ref if isinstance(ref, str) else io.BytesIO(ref)) as image:
        return image.convert("RGB")


def _decode_or_raise(ref: str | bytes, where: str) -> Image.Image:
    if isinstance(ref, str) and not os.path.isfile(ref):
        raise DataError(f"{where}: image {ref!r} not found (it was there when the data loaded); restore the file")
    try:
        return decode(ref)
    except DECODE_ERRORS as error:
        raise DataError(
            f"{where}: {describe(ref)} could not be decoded ({error}); re-save it as PNG or JPEG, or load with "
            "check_images='decode' to find every such image before training"
        ) from None


def check_image(ref: str | bytes, level: str) -> str | None:
    """What is wrong with one image at check ``level`` (see ``CHECKS``), or None when it passes.

    "exists": a path names a file (bytes always pass); "header": also, the header names a format and a size
    (PIL reads the first bytes only); "decode": also, the whole image decodes (slow; nothing is kept)."""
    if isinstance(ref, str) and not os.path.isfile(ref):  # never raises: a name too long or with NUL is no file
        return "not found"
    if level == "exists":
        return None
    try:
        if level == "decode":
            decode(ref)
        else:
            with Image.open(ref if isinstance(ref, str) else io.BytesIO(ref)) as image:
                if image.width <= 0 or image.height <= 0:
                    return "has no pixels"
    except DECODE_ERRORS as error:
        return f"could not be decoded ({error})"
    return None
