"""Every evaluated sample as one JSON line, for a person to read: `vlmrl eval --samples-out answers.jsonl`, and
RUN_DIR/eval_samples.jsonl from a training run's final evaluation (the report's worst-task section reads it).

A line is one sample at one temperature:

    {"id", "task", "problem", "solution", "temperature", "images": [paths], "accuracy": share of its answers right,
     "answers": [{"text", "correct", "truncated", "length", "reward", "components": {name: value},
                  "reasoning_tokens", "reflection", "backtracking"}, ...], ...extra fields (e.g. "step")}

`reward` is the total (null when a weighted component failed), a component's value is null when it failed or does not
apply; `reasoning_tokens` is null without a reasoning block. Images given as files are referenced by their path;
images held in memory (built-in tasks) are saved once as PNGs in `<stem>_images/` beside the file, referenced
relative to the file's folder.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

from vlmrl.errors import DataError

EVAL_SAMPLES = "eval_samples.jsonl"  # in a run directory: the final evaluation's samples
SAMPLE_FIELDS = ("id", "task", "problem", "solution", "temperature", "images", "accuracy", "answers")
ANSWER_FIELDS = ("text", "correct", "truncated", "length", "reward", "components", "reasoning_tokens")


def _safe(name) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", str(name))[:80]


def image_paths(samples: Sequence[dict], path: Path) -> list[list[str]]:
    """Per sample, the paths of its images as the samples file at `path` names them: a file's own path, or a PNG
    written to `<stem>_images/` for an image in memory (named by position and id, so every sample has its own)."""
    folder = path.parent / f"{path.stem}_images"
    out = []
    for i, s in enumerate(samples):
        images = s.get("images") or []
        refs = getattr(images, "refs", None)  # vlmrl.data.LazyImages: paths (or bytes) not decoded yet
        names = []
        for j in range(len(images)):
            ref = refs[j] if refs is not None else images[j]
            if isinstance(ref, (str, Path)):
                names.append(str(ref))
                continue
            rel = f"{folder.name}/{i}-{_safe(s.get('id', i))}-{j}.png"
            folder.mkdir(parents=True, exist_ok=True)
            (images[j] if refs is not None else ref).save(path.parent / rel)
            names.append(rel)
        out.append(names)
    return out


def sample_lines(records: Sequence[dict], temperature: float, images: Sequence[list[str]], **extra) -> list[dict]:
    """The lines of one evaluation (`evaluate(...)["records"]`, in sample order), with each sample's image paths."""
    if len(records) != len(images):
        raise ValueError(f"sample lines: {len(records)} records for {len(images)} samples' images")
    lines = []
    for r, paths in zip(records, images, strict=True):
        n = len(r["answers"])
        answers = [{"text": r["answers"][j], "correct": bool(r["answers_correct"][j]),
                    "truncated": bool(r["truncated"][j]), "length": int(r["lengths"][j]),
                    "reward": None if r.get("rewards") is None else r["rewards"][j],
                    "components": {k: v[j] for k, v in r.get("components", {}).items()},
                    "reasoning_tokens": r["reasoning_tokens"][j],
                    **{name: bool(flags[j]) for name, flags in r.get("markers", {}).items()}} for j in range(n)]
        lines.append({"id": r["id"], "task": r["task"], "problem": r["problem"], "solution": r["solution"],
                      "temperature": temperature, "images": paths,
                      "accuracy": sum(a["correct"] for a in answers) / n, "answers": answers, **extra})
    return lines


def write_samples(path: str | Path, evaluations: Sequence[tuple[float, dict]], samples: Sequence[dict],
                  **extra) -> int:
    """Write one line per sample and temperature of `evaluations` ((temperature, evaluate(...) output) pairs over
    `samples`) to `path`, replacing it; `extra` fields go on every line. Returns the number of lines."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    images = image_paths(samples, path)
    lines = [line for temperature, res in evaluations
             for line in sample_lines(res["records"], temperature, images, **extra)]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(line, default=str) + "\n" for line in lines), encoding="utf-8")
    tmp.replace(path)
    return len(lines)


def read_samples(path: str | Path) -> list[dict]:
    """The lines of a samples file; a line that is not JSON or lacks a field is a DataError naming file and line."""
    path = Path(path)
    out = []
    for i, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path} line {i}: not JSON ({e.msg}); write it again with vlmrl eval --samples-out") from None
        missing = [f for f in SAMPLE_FIELDS if f not in line]
        if missing:
            raise DataError(f"{path} line {i}: no {', '.join(missing)}; not a vlmrl samples file")
        out.append(line)
    return out


def worst_tasks(lines: Sequence[dict], k: int = 3) -> list[tuple[str, float, list[dict]]]:
    """The `k` tasks with the lowest accuracy (right answers / answers) at the lowest temperature in `lines` (the
    greedy pass when there is one): (task, accuracy, its lines with the least accurate samples first). Ties: by name."""
    if not lines:
        return []
    coolest = min(line["temperature"] for line in lines)
    by_task: dict[str, list[dict]] = {}
    for line in lines:
        if line["temperature"] == coolest:
            by_task.setdefault(line["task"], []).append(line)
    accuracy = {t: sum(a["correct"] for x in ls for a in x["answers"]) / sum(len(x["answers"]) for x in ls)
                for t, ls in by_task.items()}
    ranked = sorted(by_task, key=lambda t: (accuracy[t], t))[:k]
    return [(t, accuracy[t], sorted(by_task[t], key=lambda x: x["accuracy"])) for t in ranked]
