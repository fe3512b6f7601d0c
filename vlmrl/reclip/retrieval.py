"""Image-text retrieval on COCO/Flickr30k-style caption files (several captions per image): R@k both ways, 95% intervals.

Two layouts are read (image paths relative to `image_root`, by default the caption file's folder):

- Karpathy's split JSON (`dataset_coco.json`, `dataset_flickr30k.json`): `{"images": [{"filepath": "val2014",
  "filename": "COCO_val2014_000000391895.jpg", "split": "test", "sentences": [{"raw": "A man ..."}, ...]}, ...]}`
  (`filepath` optional; a sentence's `tokens` joined by spaces when it has no `raw`);
- JSONL (or a JSON list) of `{"image": "a.jpg", "captions": ["...", "..."]}`, an optional `split` per row.

Entries with a `split` are kept when it equals the split asked for (`all` keeps every one); entries without one are
always kept.

- `i2t/R@k`: over images; a hit when any of the image's captions is among the k captions most similar to it.
- `t2i/R@k`: over captions; a hit when the caption's own image is among the k images most similar to it.

A candidate ranks above the target only with a strictly higher similarity (as `evaluate.recall_at_k`). Intervals are
Wilson's, over images for i2t and over captions for t2i. Images that fail to load are skipped with their captions
and reported, never dropped silently.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from vlmrl.errors import DataError
from vlmrl.reclip.evaluate import embed_image_files, embed_texts, rates_with_intervals
from vlmrl.reclip.students import TwoTower


@dataclass
class CaptionSet:
    """Image paths and, per image, its captions (at least one each)."""

    source: str
    paths: list[str]
    captions: list[list[str]]

    def flat(self) -> tuple[list[str], list[int]]:
        """All captions in order, and the index of each one's image."""
        texts = [c for caps in self.captions for c in caps]
        owners = [i for i, caps in enumerate(self.captions) for _ in caps]
        return texts, owners


def read_caption_file(path: str | Path, image_root: str | Path | None = None, split: str = "test") -> CaptionSet:
    """A Karpathy split JSON or a JSONL / JSON list of image + captions rows (module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such caption file (relative paths start at {Path.cwd()})")
    base = Path(image_root) if image_root is not None else path.parent
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".jsonl":
        rows = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append((f"{path} line {number}", json.loads(line)))
                except json.JSONDecodeError as error:
                    raise DataError(f"{path} line {number}: not JSON ({error})") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise DataError(f"{path}: not JSON ({error}); give a Karpathy split JSON or a .jsonl of rows") from None
        if isinstance(data, dict) and isinstance(data.get("images"), list):
            rows = [(f"{path} images[{i}]", _karpathy_row(r, f"{path} images[{i}]")) for i, r in enumerate(data["images"])]
        elif isinstance(data, list):
            rows = [(f"{path} [{i}]", r) for i, r in enumerate(data)]
        else:
            raise DataError(f"{path}: expected Karpathy's {{\"images\": [...]}} or a list of {{\"image\", \"captions\"}} "
                            "rows")
    paths, captions, splits = [], [], set()
    for where, row in rows:
        image, caps, row_split = _row(row, where)
        splits.add(row_split)
        if row_split is not None and split != "all" and row_split != split:
            continue
        paths.append(str(Path(image) if Path(image).is_absolute() else base / image))
        captions.append(caps)
    if not paths:
        seen = sorted(s for s in splits if s is not None)
        raise DataError(f"{path}: no images in split {split!r} (splits in the file: {seen}); pass --caption-split "
                        "with one of them, or all")
    return CaptionSet(str(path), paths, captions)


def _karpathy_row(row, where: str) -> dict:
    if not isinstance(row, dict) or "filename" not in row or not isinstance(row.get("sentences"), list):
        raise DataError(f"{where}: a Karpathy image needs 'filename' and a 'sentences' list")
    captions = []
    for j, sentence in enumerate(row["sentences"]):
        raw = sentence.get("raw") if isinstance(sentence, dict) else None
        if raw is None and isinstance(sentence, dict) and isinstance(sentence.get("tokens"), list):
            raw = " ".join(map(str, sentence["tokens"]))
        if not isinstance(raw, str):
            raise DataError(f"{where} sentences[{j}]: needs 'raw' text or a 'tokens' list")
        captions.append(raw)
    image = str(Path(row.get("filepath") or "") / str(row["filename"]))
    return {"image": image, "captions": captions, "split": row.get("split")}


def _row(row, where: str) -> tuple[str, list[str], str | None]:
    if not isinstance(row, dict) or not isinstance(row.get("image"), str) or not row["image"]:
        raise DataError(f"{where}: a row needs 'image' (a path) and 'captions' (a list of texts)")
    caps = row.get("captions")
    if not isinstance(caps, list) or not caps:
        raise DataError(f"{where}: 'captions' must be a non-empty list of texts, got {caps!r}")
    if not all(isinstance(c, str) and c.strip() for c in caps):
        raise DataError(f"{where}: every caption must be a non-empty text, got {caps!r}")
    split = row.get("split")
    return row["image"], [c.strip() for c in caps], None if split is None else str(split)


def multi_caption_ranks(images: torch.Tensor, texts: torch.Tensor, owners: torch.Tensor, chunk: int = 1024
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Ranks for retrieval with several captions per image, from L2-normalised `images` [N, d], `texts` [M, d] and
    `owners` [M] (caption j describes image owners[j]; every image has one or more):

        i2t[i] = #{captions j : s(i, j) > max over own captions j' of s(i, j')}     (over images)
        t2i[j] = #{images i : s(i, j) > s(owners[j], j)}                          (over captions)

    A query is a hit at k when its rank is below k. Computed `chunk` queries at a time."""
    t2i = []
    for s in range(0, len(texts), chunk):
        sim = texts[s:s + chunk] @ images.T  # [chunk, N]
        own = sim.gather(1, owners[s:s + chunk, None])  # from the same matrix: no rounding gap to itself
        t2i.append((sim > own).sum(1))
    i2t = []
    for s in range(0, len(images), chunk):
        sim = images[s:s + chunk] @ texts.T  # [chunk, M]
        own = owners[None, :] == torch.arange(s, s + len(sim))[:, None]
        best = sim.masked_fill(~own, float("-inf")).max(1, keepdim=True).values
        i2t.append((sim > best).sum(1))
    return torch.cat(i2t), torch.cat(t2i)


@torch.no_grad()
def caption_retrieval(student: TwoTower, data: CaptionSet, ks: Sequence[int] = (1, 5, 10), batch_size: int = 128
                      ) -> dict:
    """`i2t/R@k`, `t2i/R@k` (with `_ci_low` / `_ci_high`), the images and captions counted, and the images that
    failed to load (their captions are left out of both directions and counted as `skipped_captions`)."""
    was_training = student.training
    student.eval()
    try:
        images, kept, skipped = embed_image_files(student, data.paths, batch_size)
        if not kept:
            raise DataError(f"{data.source}: none of its {len(data.paths)} images could be loaded; first: "
                            f"{skipped[0].path}: {skipped[0].error}")
        kept_set = CaptionSet(data.source, [data.paths[i] for i in kept], [data.captions[i] for i in kept])
        captions, owners = kept_set.flat()
        texts = embed_texts(student, captions, batch_size)
    finally:
        student.train(was_training)
    i2t, t2i = multi_caption_ranks(images, texts, torch.tensor(owners))
    out: dict = {"images": len(kept), "captions": len(captions)}
    out.update(rates_with_intervals(i2t, ks, "i2t/R@"))
    out.update(rates_with_intervals(t2i, ks, "t2i/R@"))
    kept_ids = set(kept)
    out["skipped_images"] = len(skipped)
    out["skipped_captions"] = sum(len(c) for i, c in enumerate(data.captions) if i not in kept_ids)
    out["skipped"] = [vars(s) for s in skipped]
    return out
