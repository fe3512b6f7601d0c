"""Preference pairs for an outcome reward model: from a run's own rollouts, and split into training and held-out
pairs by prompt.

A run's rollout gallery (RUN/rollouts.jsonl: one logged prompt every `trainer.log_rollouts_every` steps, with its G
answers and each answer's verdict `correct` from the run's verifiable reward, `solved.reward`) gives pairs
(chosen = a right answer, rejected = a wrong one to the same prompt). Set `trainer.log_rollouts_every: 1` on the run
to log every step, and `trainer.log_rollouts_prompts` to log more than its first prompt.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from vlmrl.errors import DataError, PathError


@dataclass
class RolloutPairsReport:
    """What `pairs_from_rollouts` read: entries (logged prompts), those that gave pairs, and why the others gave
    none (every answer right, every answer wrong, or no verdicts)."""

    entries: int = 0
    with_pairs: int = 0
    all_right: int = 0
    all_wrong: int = 0
    no_verdicts: int = 0


def rollouts_file(path: str | Path) -> Path:
    """RUN/rollouts.jsonl for a run directory, or the file itself."""
    path = Path(path)
    file = path / "rollouts.jsonl" if path.is_dir() else path
    if not file.is_file():
        raise PathError(f"{path}: no rollouts.jsonl (the rollout gallery `vlmrl train` writes into its run "
                        "directory every trainer.log_rollouts_every steps)")
    return file


def pairs_from_rollouts(path: str | Path, max_pairs_per_prompt: int = 4, seed: int = 0
                        ) -> tuple[list[dict], RolloutPairsReport]:
    """Preference pairs from a run's rollout gallery: for each logged prompt, every (right, wrong) pair of its
    distinct answers (right = its `correct` verdict), at most `max_pairs_per_prompt` of them drawn at random
    (0 = all). Each pair is a sample {id, group, problem, solution, images, chosen, rejected} (group: the prompt's
    sample id, so a prompt logged at several steps stays on one side of the held-out split)."""
    file = rollouts_file(path)
    rng = random.Random(seed)
    report, pairs = RolloutPairsReport(), []
    for line_no, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{file} line {line_no}: not JSON ({e.msg})") from None
        report.entries += 1
        answers, verdicts = entry.get("answers"), entry.get("correct")
        if not answers or not verdicts or len(answers) != len(verdicts):
            report.no_verdicts += 1
            continue
        distinct = dict(zip(answers, verdicts, strict=True))  # the same text has the same verdict
        right = [a for a, ok in distinct.items() if ok]
        wrong = [a for a, ok in distinct.items() if not ok]
        if not wrong:
            report.all_right += 1
            continue
        if not right:
            report.all_wrong += 1
            continue
        report.with_pairs += 1
        chosen = [(r, w) for r in right for w in wrong]
        if max_pairs_per_prompt and len(chosen) > max_pairs_per_prompt:
            chosen = rng.sample(chosen, max_pairs_per_prompt)
        images = []
        if entry.get("image"):
            image_path = file.parent / entry["image"]
            if not image_path.is_file():
                raise DataError(f"{file} line {line_no}: image {entry['image']!r} not found (relative to "
                                f"{file.parent})")
            with Image.open(image_path) as im:
                images = [im.convert("RGB")]
        group = str(entry.get("id", f"line{line_no}"))
        for k, (r, w) in enumerate(chosen):
            pairs.append({"id": f"{group}@step{entry.get('step', 0)}#{k}", "group": group,
                          "problem": entry.get("problem", ""), "solution": entry.get("solution", ""),
                          "images": images, "chosen": r, "rejected": w})
    return pairs, report


def prompt_key(pair: dict) -> str:
    """What identifies a pair's prompt for the held-out split: its `group`, else its problem and its images' files
    (a file row's images are read lazily: their paths, never their pixels; a built-in task's: the sample id)."""
    if "group" in pair:
        return str(pair["group"])
    refs = getattr(pair.get("images"), "refs", None)
    if refs is None:
        return json.dumps([pair.get("problem", ""), str(pair.get("id"))])
    names = [str(r) if isinstance(r, (str, Path)) else f"{pair.get('id')}/{k}" for k, r in enumerate(refs)]
    return json.dumps([pair.get("problem", ""), names])


def split_by_prompt(pairs: list[dict], heldout: float, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(training pairs, held-out pairs): a `heldout` share of the distinct prompts (at least one when heldout > 0)
    and all their pairs are held out, so no prompt is on both sides."""
    keys = sorted({prompt_key(p) for p in pairs})
    random.Random(seed).shuffle(keys)
    n = min(len(keys) - 1, max(1, round(heldout * len(keys)))) if heldout > 0 else 0
    if heldout > 0 and n < 1:
        raise DataError(f"{len(pairs)} preference pairs over {len(keys)} prompt(s): holding out a share of the "
                        "prompts needs at least two; add pairs or set data.heldout=0")
    held = set(keys[:n])
    return [p for p in pairs if prompt_key(p) not in held], [p for p in pairs if prompt_key(p) in held]
