"""Samples written the way user data is read: JSON lines with images as PNG files beside them (the Visual-RFT
format `vlmrl.data.files` loads), so a built-in task, a labelled set or a rollout can be inspected and read back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _plain(value: Any) -> Any:
    """numpy scalars (a task's metadata) as Python numbers; anything else JSON cannot hold as its str."""
    return value.item() if hasattr(value, "item") else str(value)


def write_rows(rows: list[dict], out: str | Path, image_prefix: str | None = None) -> Path:
    """`rows` (samples: in-memory `images` plus any columns) as JSONL at `out`, each image saved once as
    images/PREFIX-ROW-K.png beside the file (PREFIX: the file's stem; rows sharing an image object share its file)
    and named by `image` (one path, or a list for several)."""
    out = Path(out)
    (out.parent / "images").mkdir(parents=True, exist_ok=True)
    prefix = image_prefix or out.stem
    written: dict[int, str] = {}
    with open(out, "w") as f:
        for k, row in enumerate(rows):
            names = []
            for j, image in enumerate(row.get("images") or []):
                if id(image) not in written:
                    name = f"images/{prefix}-{k}-{j}.png"
                    image.save(out.parent / name)
                    written[id(image)] = name
                names.append(written[id(image)])
            record = {key: v for key, v in row.items() if key != "images"}
            if names:
                record["image"] = names[0] if len(names) == 1 else names
            f.write(json.dumps(record, default=_plain) + "\n")
    return out
