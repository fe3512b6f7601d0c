"""Held-out metrics of a two-tower student: retrieval R@k both ways, compositional accuracy, zero-shot accuracy.

- `t2i/R@k`: for each caption, is its own image among the k most similar eval images; `i2t/R@k` the reverse. A
  candidate ranks above the target only with a strictly higher similarity, so identical captions of two items tie
  instead of hiding each other. `t2i/semantic_R@1` counts a retrieved image as right when it means the same as the
  query (same scene description), for data that has descriptions.
- `comp/<kind>`: how often an image is closer to its true caption than to a hard negative of that kind (relation,
  binding, color, shape, count); `comp/acc` over all (image, negative) pairs; `comp/all` images closer to the true
  caption than to every one of their negatives.
- `zeroshot/<set>`: classification by the closest class prompt (text embeddings of the templates, averaged and
  re-normalised, CLIP's prompt ensembling); `zeroshot/mean` over the sets.

Image folders and caption files on disk (`zeroshot.py`, `retrieval.py`) are embedded here too, a batch at a time
(`embed_image_files`, `embed_texts`), through the same `Encoder`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vlmrl.data.images import DECODE_ERRORS, decode
from vlmrl.eval.metrics import wilson_interval
from vlmrl.reclip.data import ZeroShotSet
from vlmrl.reclip.scenes import CaptionItem
from vlmrl.reclip.store import InputStore
from vlmrl.reclip.students import TwoTower


class Encoder:
    """Embeds a fixed list of images (by index) and any texts, through an InputStore so the frozen stage of each
    tower runs once per image and text across repeated evaluations."""

    def __init__(self, student: TwoTower, images, batch_size: int = 128):
        self.student, self.batch_size = student, batch_size
        self.store = InputStore(student, images, chunk=batch_size)

    def images(self) -> torch.Tensor:
        n = len(self.store.source)
        return torch.cat([self.student.embed_images(self.store.images(range(i, min(n, i + self.batch_size))))
                          for i in range(0, n, self.batch_size)])

    def texts(self, texts: Sequence[str]) -> torch.Tensor:
        return torch.cat([self.student.embed_texts(self.store.texts(texts[i:i + self.batch_size]))
                          for i in range(0, len(texts), self.batch_size)])


def recall_at_k(sim: torch.Tensor, ks: Sequence[int]) -> dict[int, float]:
    """Rows are queries, columns candidates, the target of row i is column i: the fraction of rows whose target has
    fewer than k candidates with a strictly higher similarity."""
    target = sim.diagonal().unsqueeze(1)
    above = (sim > target).sum(1)
    return {k: (above < k).float().mean().item() for k in ks}


@torch.no_grad()
def evaluate_student(student: TwoTower, items: Sequence[CaptionItem], zero_shot: Sequence[ZeroShotSet] = (),
                     ks: Sequence[int] = (1, 5, 10), templates: Sequence[str] = ("{}",), batch_size: int = 128,
                     encoders: list[Encoder] | None = None) -> dict[str, float]:
    """Every metric of the module docstring for `items` (and the zero-shot sets); keys as listed there.
    `encoders` (from `make_encoders`, for the same student) keep the frozen inputs between calls."""
    was_training = student.training
    student.eval()
    encoders = encoders or make_encoders(student, items, zero_shot, batch_size)
    main = encoders[0]
    images = main.images()
    texts = main.texts([it.caption for it in items])
    sim = texts @ images.T  # [captions, images]
    out: dict[str, float] = {}
    for k, v in recall_at_k(sim, ks).items():
        out[f"t2i/R@{k}"] = v
    for k, v in recall_at_k(sim.T, ks).items():
        out[f"i2t/R@{k}"] = v
    if all(it.description is not None for it in items):
        keys = [it.description.key() for it in items]
        best = sim.argmax(1).tolist()
        out["t2i/semantic_R@1"] = sum(keys[j] == keys[i] for i, j in enumerate(best)) / len(items)
    out.update(compositional_accuracy(main, items, images))
    accs = []
    for zs, encoder in zip(zero_shot, encoders[1:], strict=True):
        acc = zero_shot_accuracy(encoder, zs, templates)
        out[f"zeroshot/{zs.name}"] = acc
        accs.append(acc)
    if accs:
        out["zeroshot/mean"] = sum(accs) / len(accs)
    student.train(was_training)
    return out


def make_encoders(student: TwoTower, items: Sequence[CaptionItem], zero_shot: Sequence[ZeroShotSet] = (),
                  batch_size: int = 128) -> list[Encoder]:
    """One Encoder for the held-out items, then one per zero-shot set (sets sharing an image list share one)."""
    main = Encoder(student, [it.image for it in items], batch_size)
    shared: dict[int, Encoder] = {}
    for zs in zero_shot:
        shared.setdefault(id(zs.images), Encoder(student, zs.images, batch_size))
    return [main] + [shared[id(zs.images)] for zs in zero_shot]


def compositional_accuracy(encoder: Encoder, items: Sequence[CaptionItem], images: torch.Tensor) -> dict[str, float]:
    """`comp/*` metrics (module docstring) for items with hard negatives; {} when none has any."""
    rows = [(i, neg) for i, it in enumerate(items) for neg in it.negatives]
    if not rows:
        return {}
    true_emb = encoder.texts([items[i].caption for i, _ in rows])
    neg_emb = encoder.texts([neg.caption for _, neg in rows])
    img = images[[i for i, _ in rows]]
    wins = ((img * true_emb).sum(-1) > (img * neg_emb).sum(-1)).float()
    out = {"comp/acc": wins.mean().item()}
    kinds = sorted({neg.kind for _, neg in rows})
    for kind in kinds:
        mask = torch.tensor([neg.kind == kind for _, neg in rows])
        out[f"comp/{kind}"] = wins[mask].mean().item()
    per_item: dict[int, bool] = {}
    for (i, _), w in zip(rows, wins.tolist(), strict=True):
        per_item[i] = per_item.get(i, True) and bool(w)
    out["comp/all"] = sum(per_item.values()) / len(per_item)
    return out


def class_text_embeddings(encoder: Encoder, phrases: Sequence[str], templates: Sequence[str]) -> torch.Tensor:
    """[classes, d]: per class, the mean of its templates' L2-normalised text embeddings, re-normalised (CLIP's prompt
    ensembling, as open_clip's zero-shot classifier builds it)."""
    prompts = [t.format(phrase) for phrase in phrases for t in templates]
    text = encoder.texts(prompts).view(len(phrases), len(templates), -1).mean(1)
    return F.normalize(text, dim=-1)


def zero_shot_accuracy(encoder: Encoder, zs: ZeroShotSet, templates: Sequence[str]) -> float:
    """Accuracy of argmax_c cos(image, mean_t text(template_t(class_c))) (renormalised) against the labels."""
    text = class_text_embeddings(encoder, zs.class_phrases, templates)
    images = encoder.images()
    pred = (images @ text.T).argmax(1)
    return (pred == torch.tensor(zs.labels)).float().mean().item()


# --- files on disk: embedded a batch at a time, through the same Encoder -----------------------------------------


@dataclass
class Skipped:
    """An image that could not be loaded: its path and why."""

    path: str
    error: str


def embed_image_files(student: TwoTower, paths: Sequence[str], batch_size: int = 128
                      ) -> tuple[torch.Tensor, list[int], list[Skipped]]:
    """Embeddings of the images at `paths` that load ([kept, d]), the indices of those (into `paths`), and the rest
    with their errors. Images are decoded and embedded `batch_size` at a time through an `Encoder` each, so memory
    holds one batch of images and inputs, never the whole set."""
    chunks, kept, skipped = [], [], []
    for start in range(0, len(paths), batch_size):
        images = []
        for i in range(start, min(len(paths), start + batch_size)):
            try:
                images.append(decode(str(paths[i])))
            except DECODE_ERRORS as error:  # OSError covers a missing or unreadable file
                skipped.append(Skipped(str(paths[i]), f"{type(error).__name__}: {error}"))
                continue
            kept.append(i)
        if images:
            chunks.append(Encoder(student, images, batch_size).images())
    return (torch.cat(chunks) if chunks else torch.empty(0)), kept, skipped


def embed_texts(student: TwoTower, texts: Sequence[str], batch_size: int = 128) -> torch.Tensor:
    """[len(texts), d], `batch_size` texts at a time, each batch through a fresh `Encoder` (no cache kept)."""
    return torch.cat([Encoder(student, [], batch_size).texts(list(texts[i:i + batch_size]))
                      for i in range(0, len(texts), batch_size)])


def rates_with_intervals(ranks: torch.Tensor, ks: Sequence[int], prefix: str) -> dict[str, float]:
    """`{prefix}{k}` = the fraction of `ranks` (one per query: the items ranked above its target) below k, with its
    95% Wilson interval as `{prefix}{k}_ci_low` / `_ci_high` (queries are the independent draws)."""
    n = len(ranks)
    out: dict[str, float] = {}
    for k in ks:
        hits = int((ranks < k).sum())
        out[f"{prefix}{k}"] = hits / n
        out[f"{prefix}{k}_ci_low"], out[f"{prefix}{k}_ci_high"] = wilson_interval(hits, n)
    return out
