"""Zero-shot classification of an image folder by prompts over class names: top-1/top-5 accuracy with 95% intervals.

The folder is laid out like torchvision's ImageFolder: `root/<class folder>/<image>` with image files ending in one
of `IMAGE_SUFFIXES`; other files are counted as ignored. Classes are the sub-folders in sorted order, named by the
folder (underscores read as spaces: `golden_retriever` -> "golden retriever") or by a `--classes` file mapping folder
-> name (YAML or JSON: `n02099601: golden retriever`). A class with no images is still a candidate.

Each class is embedded as the mean of its templates' normalised text embeddings, re-normalised (CLIP's prompt
ensembling: `class_text_embeddings`); an image is scored against every class by cosine similarity. A class ranks
above the true one when its score is higher, or equal with a lower index (argmax's first-index tie rule, so a
constant model scores one class's share, not 100%). top-k: the true class ranks below k. Intervals are Wilson's,
over images.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vlmrl.errors import DataError
from vlmrl.reclip.evaluate import Encoder, class_text_embeddings, embed_image_files, rates_with_intervals
from vlmrl.reclip.students import TwoTower

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp", ".gif")
# photo templates from CLIP's 80 ImageNet prompts (github.com/openai/CLIP, notebooks/Prompt_Engineering_for_ImageNet)
DEFAULT_TEMPLATES = ("a photo of a {}.", "a bad photo of a {}.", "a good photo of a {}.", "a close-up photo of a {}.",
                     "a bright photo of a {}.", "a dark photo of a {}.", "a cropped photo of a {}.")
KS = (1, 5)


@dataclass
class ImageFolderSet:
    """Image paths with one class index each; `folders[c]` is class c's folder, `names[c]` its name in the prompts."""

    root: str
    paths: list[str]
    labels: list[int]
    folders: list[str]
    names: list[str]
    ignored_files: list[str] = field(default_factory=list)


def read_templates(path: str | Path) -> list[str]:
    """One template per line, `{}` where the class name goes; blank lines and lines starting with '#' are skipped."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such templates file; write one template per line, such as 'a photo of a {{}}.'")
    templates = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.count("{}") != 1 or line.replace("{}", "").count("{") or line.replace("{}", "").count("}"):
            raise DataError(f"{path} line {number}: template {line!r} needs exactly one '{{}}' (where the class name "
                            "goes) and no other braces")
        templates.append(line)
    if not templates:
        raise DataError(f"{path}: no templates; write one per line, such as 'a photo of a {{}}.'")
    return templates


def read_classes(path: str | Path) -> dict[str, str]:
    """A YAML or JSON mapping of class folder -> class name."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such classes file; write one 'folder: class name' line per class (YAML or JSON)")
    try:
        mapping = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        raise DataError(f"{path}: not YAML or JSON ({error}); write one 'folder: class name' line per class") from None
    if not isinstance(mapping, dict) or not mapping:
        raise DataError(f"{path}: expected a mapping of class folder -> class name, got {type(mapping).__name__}")
    bad = [k for k, v in mapping.items() if not isinstance(v, (str, int, float)) or not str(v).strip()]
    if bad:
        raise DataError(f"{path}: class folder {bad[0]!r} has no usable name ({mapping[bad[0]]!r})")
    return {str(k): str(v).strip() for k, v in mapping.items()}


def image_folder(root: str | Path, classes: dict[str, str] | None = None) -> ImageFolderSet:
    """The images of an ImageFolder layout (module docstring), labelled by their class folder's sorted index."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"{root}: no such folder; zero-shot classification reads root/<class folder>/<image files>")
    folders = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not folders:
        raise DataError(f"{root}: no class folders; lay images out as {root}/<class name>/<image files>")
    if classes is not None:
        missing = [f for f in folders if f not in classes]
        if missing:
            raise DataError(f"{root}: class folder {missing[0]!r} has no name in the classes file "
                            f"({len(missing)} of {len(folders)} folders missing); add '{missing[0]}: <name>'")
        names = [classes[f] for f in folders]
    else:
        names = [f.replace("_", " ") for f in folders]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise DataError(f"{root}: two class folders share the name {repeated[0]!r}; give each class its own name")
    paths, labels, ignored = [], [], [p.name for p in root.iterdir() if p.is_file()]
    for label, folder in enumerate(folders):
        for path in sorted((root / folder).rglob("*")):
            if not path.is_file():
                continue
            if path.suffix.lower() in IMAGE_SUFFIXES:
                paths.append(str(path))
                labels.append(label)
            else:
                ignored.append(str(path.relative_to(root)))
    if not paths:
        raise DataError(f"{root}: no image files ({', '.join(IMAGE_SUFFIXES)}) in its class folders")
    return ImageFolderSet(str(root), paths, labels, folders, names, ignored)


def class_ranks(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[images]: how many classes rank above each image's true class: a higher score, or an equal score and a lower
    class index (argmax's tie rule). `scores` is [images, classes]."""
    target = scores.gather(1, labels[:, None])
    lower = torch.arange(scores.shape[1])[None, :] < labels[:, None]
    return ((scores > target) | ((scores == target) & lower)).sum(1)


@torch.no_grad()
def zero_shot_classification(student: TwoTower, data: ImageFolderSet, templates: Sequence[str] = DEFAULT_TEMPLATES,
                             batch_size: int = 128) -> dict:
    """top-1 / top-5 accuracy (with `_ci_low` / `_ci_high`), the mean per-class top-1, per-class accuracy, counts and
    the images that failed to load. top-5 is left out with 5 classes or fewer (it would be 100% by construction)."""
    was_training = student.training
    student.eval()
    try:
        text = torch.cat([class_text_embeddings(Encoder(student, [], batch_size), data.names[i:i + batch_size],
                                                templates) for i in range(0, len(data.names), batch_size)])
        images, kept, skipped = embed_image_files(student, data.paths, batch_size)
    finally:
        student.train(was_training)
    if not kept:
        raise DataError(f"{data.root}: none of its {len(data.paths)} images could be loaded; first: "
                        f"{skipped[0].path}: {skipped[0].error}")
    labels = torch.tensor([data.labels[i] for i in kept])
    ranks = class_ranks(images @ text.T, labels)
    ks = [k for k in KS if k == 1 or k < len(data.names)]
    out: dict = {"n": len(kept), "classes": len(data.names), "templates": list(templates)}
    out.update(rates_with_intervals(ranks, ks, "top"))
    per_class = {}
    for c, (folder, name) in enumerate(zip(data.folders, data.names, strict=True)):
        mine = ranks[labels == c]
        row: dict = {"folder": folder, "n": len(mine)}
        for k in ks:
            row[f"top{k}"] = (mine < k).float().mean().item() if len(mine) else None
        per_class[name] = row
    seen = [row["top1"] for row in per_class.values() if row["n"]]
    out["per_class_mean_top1"] = sum(seen) / len(seen)  # balanced accuracy, over classes with images
    out["skipped_images"] = len(skipped)
    out["skipped"] = [vars(s) for s in skipped]
    out["ignored_files"] = data.ignored_files
    out["per_class"] = per_class
    return out
