"""User data: JSON lines, parquet and Hugging Face ``datasets`` folders, turned into samples.

Rows follow the Visual-RFT format ``{"image": "a.png", "problem": ..., "solution": ...}``: ``image`` (or its synonym
``images``) is a path or a list of paths, relative to the data file's folder (or ``image_root``), or absent for a
text-only row. Parquet and ``datasets`` image columns may also hold HF-style ``{"bytes", "path"}`` structs, raw bytes
or PIL images. Other keys pass through unchanged. Every bad row is either an error naming file, line/row and what to
do (``on_error="raise"``), or skipped and counted in the ``LoadReport`` (``on_error="skip"``); never silently dropped.

Image paths in a JSON lines or parquet file (the user's own rows) may be absolute or climb out of its folder with
``..``. The rows of a ``datasets`` folder or a hub dataset were written by someone else: their path strings must be
relative and name a file inside the image root once ``..`` and symlinks are resolved (``confine``), or any image the
process can read could become a sample and be written out (eval samples, the rollout gallery). Images that
``datasets`` itself stores (``datasets.Image`` structs: the bytes, or a path it wrote into its cache) are the
dataset's own and are read as before.

Images are not decoded while loading: a sample's ``images`` is a ``LazyImages`` holding absolute paths or encoded bytes
that decodes each image when it is used, through a bounded cache (``vlmrl.data.images``). Loading checks that each
image exists and that its header is an image (``check_images``); an image that still fails to decode stops the run
with a DataError naming its file and line when it is first used. Reading stops after ``n`` good rows.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from PIL import Image

from .images import CHECKS, LazyImages, Ref, check_image
from .sample import ANSWER_TYPES, DataError, LoadReport, Sample, format_box, format_number, infer_answer_type

ON_ERROR = ("raise", "skip")
JSON_SUFFIXES = (".jsonl", ".json")
_WRAPPED_ANSWER = re.compile(r"\s*<answer>(.*)</answer>\s*", re.DOTALL)

RowSource = Iterator[tuple[str, str, Callable[[], Any]]]  # (where, default id, thunk returning the raw row)


class _RowError(Exception):
    """A problem with one row; the caller adds where it happened and raises or skips."""


RowError = _RowError  # what a row transform (vlmrl.data.hub, a benchmark's adapter) raises for one bad row


def load_file(
    path: str | Path, on_error: str = "raise", image_root: str | Path | None = None,
    required: tuple[str, ...] = ("problem", "solution"), n: int | None = None, check_images: str = "header",
) -> tuple[list[Sample], LoadReport]:
    """Load a data file into samples, dispatching on its suffix (``.jsonl``/``.json``, ``.parquet``) or on a folder
    written by ``datasets.Dataset.save_to_disk``.

    ``on_error="raise"`` raises DataError at the first bad row; ``"skip"`` skips bad rows and lists each in the report.
    A file with no good row is always an error. Sample ids are the row's ``id`` if it has one, else ``"{path}:{n}"``
    (n: the 1-based line for JSON lines, the 0-based row for parquet and ``datasets``, as in ``table[n]``).
    ``required`` names the fields every row must have; a ``problem`` or ``solution`` left out of it may be absent and
    becomes ``""`` (image-caption rows ``{"image", "caption"}`` for ReCLIP pass ``required=("caption",)``).
    ``n``: stop reading after n good rows (the report counts only the rows read); None reads the whole file.
    ``check_images``: what loading checks of each image, "exists" (the file is there), "header" (also, its header is
    an image's; the default, cheap) or "decode" (also, it decodes; slow, nothing is kept). Images decode on use.
    """
    if on_error not in ON_ERROR:
        raise DataError(f"on_error must be one of {list(ON_ERROR)}, got {on_error!r}")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
        raise DataError(f"{path}: n must be a non-negative int, got {n!r}")
    if check_images not in CHECKS:
        raise DataError(f"check_images must be one of {list(CHECKS)}, got {check_images!r}")
    file = Path(path)
    if not file.exists():
        raise DataError(f"{path}: no such file or folder; check the path (relative paths start at {Path.cwd()})")
    base = (Path(image_root) if image_root is not None else file.parent).absolute()
    confine = None  # the user's own file: its image paths may be absolute or leave the folder
    if file.is_dir():
        confine = base  # a datasets folder: written by someone else (a hub copy); its image paths stay in the root
        rows = _dataset_rows(file, str(path))
    elif file.suffix.lower() in JSON_SUFFIXES:
        rows = _json_rows(file, str(path))
    elif file.suffix.lower() == ".parquet":
        rows = _parquet_rows(file, str(path))
    else:
        raise DataError(
            f"{path}: unsupported file type {file.suffix!r}; use .jsonl/.json (JSON lines), .parquet, "
            "or a folder saved with datasets' save_to_disk"
        )
    if n == 0:
        return [], LoadReport(path=str(path))
    try:
        return _collect(rows, str(path), file.stem, base, on_error, required, n, check_images, confine)
    finally:
        rows.close()  # n reached: the file is closed, the rest never read


def _collect(rows: RowSource, path: str, stem: str, base: Path, on_error: str,
             required: tuple[str, ...] = ("problem", "solution"), n: int | None = None,
             check_images: str = "header", confine: Path | None = None) -> tuple[list[Sample], LoadReport]:
    """Turn raw rows into samples, raising or skipping-and-counting bad ones, until ``n`` good ones; unique ids.
    ``confine``: for rows someone else wrote, the folder their image path strings must stay inside (None: any path)."""
    report = LoadReport(path=path)
    samples: list[Sample] = []
    seen: dict[str, str] = {}
    total = 0
    for where, default_id, fetch in rows:
        total += 1
        try:
            sample = _row_to_sample(fetch(), where, default_id, stem, base, required, check_images, confine)
            if sample["id"] in seen:
                raise _RowError(f"id {sample['id']!r} already used at {seen[sample['id']]}; ids must be unique")
        except _RowError as error:
            message = f"{where}: {error}"
            if on_error == "raise":
                raise DataError(message) from None
            report.skipped += 1
            report.problems.append(message)
            continue
        seen[sample["id"]] = where
        samples.append(sample)
        if n is not None and len(samples) >= n:
            break
    report.loaded = len(samples)
    if total == 0:
        raise DataError(f"{path}: no rows; a dataset needs at least one row with 'problem' and 'solution'")
    if not samples:
        shown = "\n  ".join(report.problems[:5])
        raise DataError(f"{path}: all {total} rows are bad, nothing loaded; first problems:\n  {shown}")
    return samples, report


collect_rows = _collect  # turning a RowSource into samples, for the other loaders (vlmrl.data.hub, benchmarks)


def _row_to_sample(row: Any, where: str, default_id: str, stem: str, base: Path,
                   required: tuple[str, ...] = ("problem", "solution"), check_images: str = "header",
                   confine: Path | None = None) -> Sample:
    """One raw row (a mapping) to a sample: check fields, normalise the solution, check images, infer answer_type."""
    if not isinstance(row, dict):
        raise _RowError(f'expected a JSON object like {{"problem": ..., "solution": ...}}, got {type(row).__name__}')
    if row.get("problem") is None and isinstance(row.get("prompt"), str) and row.get("chosen") is not None:
        # a preference row {image, prompt, chosen, rejected} (offline DPO): the prompt is the problem and the
        # preferred answer its solution; "chosen" and "rejected" pass through as columns
        row = {**row, "problem": row["prompt"], "solution": row.get("solution", row["chosen"])}
    missing = [key for key in required if row.get(key) is None]
    if missing:
        raise _RowError(
            f"missing field {' and '.join(repr(k) for k in missing)} (fields present: {sorted(row)}); "
            f"every row needs {' and '.join(repr(k) for k in required)}"
        )
    row = {**row, **{key: "" for key in ("problem", "solution") if row.get(key) is None}}  # optional here
    if not isinstance(row["problem"], str):
        raise _RowError(f"'problem' must be a string, got {type(row['problem']).__name__}")
    solution = _solution_text(row["solution"])
    if "image" in row and "images" in row and row["image"] is not None and row["images"] is not None:
        raise _RowError("has both 'image' and 'images'; give the image(s) in one of them")
    refs = row.get("image") if row.get("image") is not None else row.get("images")
    images = LazyImages([_image_ref(ref, base, check_images, confine) for ref in _as_list(refs)], where)
    answer_type = row.get("answer_type")
    if answer_type is None:
        answer_type = infer_answer_type(solution)
    elif answer_type not in ANSWER_TYPES:
        raise _RowError(f"answer_type {answer_type!r} is not one of {list(ANSWER_TYPES)}; fix it or leave it out")
    extra = {k: v for k, v in row.items() if k not in ("image", "images")}
    return {
        **extra,
        "id": str(row["id"]) if row.get("id") is not None else default_id,
        "images": images,
        "problem": row["problem"],
        "solution": solution,
        "answer_type": answer_type,
        "task": str(row["task"]) if row.get("task") is not None else stem,
    }


def _solution_text(value: Any) -> str:
    """The solution as text: numbers via str, a list of 4 numbers as a box, ``<answer>x</answer>`` unwrapped to x."""
    if isinstance(value, bool):
        raise _RowError("'solution' must be a string, number or [x1, y1, x2, y2] box, got a boolean")
    if isinstance(value, (int, float)):
        if not _finite(value):
            raise _RowError(f"'solution' must be a finite number, got {value!r:.40}")
        return format_number(value)
    if isinstance(value, (list, tuple)):
        if len(value) == 4 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            if not all(_finite(v) for v in value):
                raise _RowError(f"'solution' box must hold 4 finite numbers, got {value!r:.80}")
            return format_box(value)
        raise _RowError(f"'solution' list must be a box of 4 numbers [x1, y1, x2, y2], got {value!r}")
    if not isinstance(value, str):
        raise _RowError(f"'solution' must be a string, number or box, got {type(value).__name__}")
    wrapped = _WRAPPED_ANSWER.fullmatch(value)
    return wrapped.group(1).strip() if wrapped else value


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond float's range
        return False


def _as_list(refs: Any) -> list[Any]:
    if refs is None:
        return []
    if isinstance(refs, (list, tuple)):
        return list(refs)
    return [refs]


def _image_ref(ref: Any, base: Path, check: str, confine: Path | None = None) -> Ref:
    """One image reference (path, HF ``{"bytes", "path"}`` struct, raw bytes or PIL image) checked at level
    ``check`` and kept undecoded: an absolute path, the bytes, or the (RGB) image itself. With ``confine``, a path
    string must be relative and stay inside that folder (``_check_inside``); a struct's path is what ``datasets``
    wrote for its own image (a file of its cache, absolute), so it is read as before."""
    if isinstance(ref, Image.Image):
        return ref if ref.mode == "RGB" else ref.convert("RGB")  # already in memory
    if isinstance(ref, dict):
        if ref.get("bytes") is not None:
            if not isinstance(ref["bytes"], (bytes, bytearray, memoryview)):
                raise _RowError(f"image struct 'bytes' must be bytes, got {type(ref['bytes']).__name__}")
            what = f"image bytes of {ref.get('path') or 'an image struct'!r}"
            return _checked_bytes(bytes(ref["bytes"]), what, check)
        if ref.get("path") is not None:
            return _image_ref(str(ref["path"]), base, check)  # datasets' own file: not confined
        raise _RowError("image struct has neither 'bytes' nor 'path'")
    if isinstance(ref, (bytes, bytearray, memoryview)):
        return _checked_bytes(bytes(ref), "image bytes", check)
    if not isinstance(ref, str):
        raise _RowError(f"image must be a path string (or a list of them), got {type(ref).__name__}")
    if confine is not None:
        _check_inside(ref, base, confine)
    absolute = os.path.isabs(ref)
    file = ref if absolute else os.path.join(base, ref)
    problem = check_image(file, check)
    if problem == "not found":
        relative = "" if absolute else f" (relative to {base}/)"
        raise _RowError(f"image {ref!r} not found{relative}; fix the path or pass image_root")
    if problem:
        raise _RowError(f"image {ref!r} {problem}; re-save it as PNG or JPEG")
    return file


def _check_inside(ref: str, base: Path, root: Path) -> None:
    """RowError unless image path ``ref`` is relative and, joined to ``base`` with ``..`` and symlinks resolved,
    names something strictly inside ``root`` (``sub/../a.png`` is fine; ``../a.png`` or a link out of it is not)."""
    if os.path.isabs(ref):
        problem = "is an absolute path"
    else:
        real_root = os.path.realpath(root)
        real = os.path.realpath(os.path.join(base, ref))
        if real != real_root and os.path.commonpath([real, real_root]) == real_root:
            return
        problem = f"leads outside the image root {root}/ (to {real})"
    raise _RowError(
        f"image {ref!r} {problem}; a dataset's rows may only name image files inside its image root, relative to "
        f"{base}/. Set image_root to the folder that holds the images, or, if you trust these rows, write them to a "
        f"JSONL file of your own (its image paths may be absolute)"
    )


def _checked_bytes(data: bytes, what: str, check: str) -> bytes:
    problem = check_image(data, check)
    if problem:
        raise _RowError(f"{what} {problem}; store PNG or JPEG bytes")
    return data


def _raiser(message: str) -> Callable[[], Any]:
    def fail() -> Any:
        raise _RowError(message)

    return fail


def _json_rows(file: Path, path: str) -> RowSource:
    """JSON lines (blank lines ignored), read line by line; a ``.json`` file holding one array is read as its items."""
    if file.suffix.lower() == ".json":
        with file.open("rb") as handle:
            head = b""
            while not head and (chunk := handle.read(4096)):
                head = chunk.lstrip(b"\xef\xbb\xbf \t\r\n")
            is_array = head.startswith(b"[")
        if is_array:
            try:
                items = json.loads(file.read_bytes().decode("utf-8-sig"))
            except (ValueError, RecursionError) as error:  # bad UTF-8, bad JSON, nesting or an int too deep/long
                raise DataError(
                    f"{path}: not valid JSON ({error}); write one JSON array or one object per line"
                ) from None
            for number, item in enumerate(items, start=1):
                yield f"{path} item {number}", f"{path}:{number}", (lambda item=item: item)
            return
    with file.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            where = f"{path} line {number}"
            try:
                text = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError:
                yield where, f"{path}:{number}", _raiser("not UTF-8 text; save the file as UTF-8")
                continue
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as error:
                message = f"not valid JSON ({error.msg} at column {error.colno}); each line must be one JSON object"
                yield where, f"{path}:{number}", _raiser(message)
                continue
            except (ValueError, RecursionError) as error:  # an int of over 4300 digits, nesting too deep
                yield where, f"{path}:{number}", _raiser(f"not usable JSON ({str(error)[:100]}); each line must be "
                                                         "one JSON object")
                continue
            yield where, f"{path}:{number}", (lambda row=row: row)


def _parquet_rows(file: Path, path: str) -> RowSource:
    """Rows of a parquet file, read in batches (only as many as are used); numbered from 0 like the table's rows."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"reading {path} needs pyarrow: pip install 'vlmrl[parquet]'") from None
    try:
        parquet = pq.ParquetFile(file)
    except Exception as error:  # pyarrow raises several types for a bad file
        raise DataError(f"{path}: not a readable parquet file ({error})") from None
    number = 0
    batches = parquet.iter_batches(batch_size=256)
    while True:
        try:
            batch = next(batches, None)
            rows = batch.to_pylist() if batch is not None else []
        except Exception as error:  # a corrupt page: OSError, ArrowInvalid, ... (pyarrow's types vary)
            raise DataError(f"{path}: unreadable after row {number - 1} ({error}); the file is damaged, "
                            "write it again") from None
        if batch is None:
            return
        for row in rows:
            yield f"{path} row {number}", f"{path}:{number}", (lambda row=row: row)
            number += 1


def _dataset_rows(folder: Path, path: str) -> RowSource:
    """Rows of a folder saved by ``datasets`` (``save_to_disk``); numbered from 0 like ``dataset[n]``. Image columns
    are read undecoded (``datasets.Image(decode=False)``: ``{"bytes", "path"}``), so only used images decode."""
    datasets = import_datasets(f"reading the datasets folder {path}")
    try:
        dataset = datasets.load_from_disk(str(folder))
    except Exception as error:  # datasets raises FileNotFoundError and others for a folder it did not write
        raise DataError(
            f"{path}: a folder must be written by datasets' save_to_disk ({error}); "
            "for other files pass the .jsonl or .parquet file itself"
        ) from None
    if isinstance(dataset, dict):  # a DatasetDict
        splits = list(dataset.keys())
        raise DataError(f"{path}: holds several splits {splits}; pass one split's folder, e.g. {path}/{splits[0]}, "
                        f"or name it as {{hub: {path}, split: {splits[0]}}}")
    yield from dataset_rows(dataset, path)


def import_datasets(what: str) -> Any:
    """The ``datasets`` package, or ImportError saying how to install it."""
    try:
        import datasets
    except ImportError:
        raise ImportError(f"{what} needs the datasets package: pip install 'vlmrl[datasets]'") from None
    return datasets


def dataset_rows(dataset: Any, path: str, transform: Callable[[dict], Any] | None = None) -> RowSource:
    """Rows of a ``datasets.Dataset`` with its image columns read undecoded, numbered from 0 like ``dataset[n]``.

    ``transform`` maps a raw row to the row (or list of rows: one dataset row can make several samples) that
    ``_row_to_sample`` reads; a ``RowError`` it raises is that row's problem (raised or skipped, with the row's
    place). Rows are read one at a time, only as many as are used."""
    import datasets

    image_type = getattr(datasets, "Image", None)
    for name, feature in dict(getattr(dataset, "features", None) or {}).items():
        if image_type is not None and isinstance(feature, image_type) and feature.decode:
            dataset = quietly(dataset.cast_column, name, image_type(decode=False))
        elif image_type is not None and _holds_images(feature, image_type):
            dataset = quietly(dataset.cast_column, name, _undecoded(feature, image_type))
    for number, row in enumerate(dataset):
        where, default_id = f"{path} row {number}", f"{path}:{number}"
        if transform is None:
            yield where, default_id, (lambda row=row: row)
            continue
        try:
            made = transform(row)
        except RowError as error:
            yield where, default_id, _raiser(str(error))
            continue
        if isinstance(made, list):
            for part, one in enumerate(made):
                yield f"{where} item {part}", f"{default_id}:{part}", (lambda one=one: one)
        else:
            yield where, default_id, (lambda made=made: made)


def quietly(fn: Callable[..., Any], *args: Any) -> Any:
    """Call a ``datasets`` method without its progress bar (the CLI owns the console)."""
    try:
        from datasets.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    except ImportError:  # a stand-in module in tests, or an old datasets
        return fn(*args)
    was_disabled = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        return fn(*args)
    finally:
        if not was_disabled:
            enable_progress_bars()


def _holds_images(feature: Any, image_type: type) -> bool:
    inner = feature[0] if isinstance(feature, list) and len(feature) == 1 else getattr(feature, "feature", None)
    return isinstance(inner, image_type) and inner.decode


def _undecoded(feature: Any, image_type: type) -> Any:
    """A list-of-images feature (``[Image()]`` or ``Sequence(Image())``) with decoding turned off."""
    if isinstance(feature, list):
        return [image_type(decode=False)]
    import copy

    plain = copy.copy(feature)
    plain.feature = image_type(decode=False)
    return plain
