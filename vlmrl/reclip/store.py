"""Cached student inputs: the frozen stage of each tower runs once per image and once per distinct text.

`InputStore` memoises `student.image_inputs` by item index and `student.text_inputs` by string, computing what is
missing in chunks. For the embedded student the cached value is the frozen tower prefix (a few KB per item); for HF
students it is the processed pixels and token ids. Text rows of different lengths are zero-padded when stacked
(the padding is masked).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from PIL import Image

from vlmrl.cache import BoundedLRU
from vlmrl.reclip.students import TwoTower


def _pad_rows(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack per-text input rows ({name: [L_i, ...]}), zero-padding dim 0 to the longest."""
    out = {}
    for name in rows[0]:
        length = max(r[name].shape[0] for r in rows)
        padded = []
        for r in rows:
            t = r[name]
            if t.shape[0] < length:
                pad = [0, 0] * (t.dim() - 1) + [0, length - t.shape[0]]
                t = F.pad(t, pad)
            padded.append(t)
        out[name] = torch.stack(padded)
    return out


MADE_BYTES = 512 << 20  # made images' inputs kept, least recently used dropped first (a HF student's: ~0.6 MB each)


class InputStore:
    """Memoised frozen inputs of one student for a list of images (by index) and any texts (by string)."""

    def __init__(self, student: TwoTower, images: Sequence[Image.Image], chunk: int = 128):
        self.student, self.source, self.chunk = student, list(images), chunk
        self._images: dict[int, torch.Tensor] = {}
        self._texts: dict[str, dict[str, torch.Tensor]] = {}
        self._made: BoundedLRU[str, torch.Tensor] = BoundedLRU(MADE_BYTES, 1 << 20,
                                                                lambda _, v: v.numel() * v.element_size())

    def images(self, indices: Sequence[int]) -> torch.Tensor:
        """Inputs of images `indices` of the source list, stacked [len(indices), ...]."""
        indices = [int(i) for i in indices]
        missing = sorted({i for i in indices if i not in self._images})
        for start in range(0, len(missing), self.chunk):
            part = missing[start:start + self.chunk]
            values = self.student.image_inputs([self.source[i] for i in part])
            self._images.update(zip(part, values, strict=True))
        return torch.stack([self._images[i] for i in indices])

    def rendered(self, images: Sequence[tuple[str, Callable[[], Image.Image]]]) -> torch.Tensor:
        """Inputs of images made on demand (counterfactual scenes), stacked: each (key, make) is made and processed
        once while its inputs stay in the bounded cache (a key must always make the same image)."""
        found = {key: self._made.get(key) for key, _ in images}
        missing = [key for key in dict.fromkeys(found) if found[key] is None]
        makers = dict(images)
        for start in range(0, len(missing), self.chunk):
            part = missing[start:start + self.chunk]
            for key, value in zip(part, self.student.image_inputs([makers[k]() for k in part]), strict=True):
                found[key] = value
                self._made.put(key, value)
        return torch.stack([found[key] for key, _ in images])

    def texts(self, texts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Inputs of `texts`, stacked; rows cached by string (a caption shared by items is computed once)."""
        missing = sorted({t for t in texts if t not in self._texts})
        for start in range(0, len(missing), self.chunk):
            part = missing[start:start + self.chunk]
            batch = self.student.text_inputs(part)
            mask = batch.get("attention_mask") if self.student.trim_text_rows else None
            for row, text in enumerate(part):
                keep = int(mask[row].sum()) if mask is not None else None
                self._texts[text] = {k: v[row, :keep] if keep is not None else v[row] for k, v in batch.items()}
        return _pad_rows([self._texts[t] for t in texts])

    def warm(self, texts: Sequence[str] = ()) -> None:
        """Compute every image's and the given texts' inputs now (so the training steps time only training)."""
        self.images(range(len(self.source)))
        if texts:
            self.texts(list(dict.fromkeys(texts)))
