"""`vlmrl index build`: embed every image of a folder with a two-tower student into a faiss index, resumably;
`SearchIndex.load` reads it back for `vlmrl serve STUDENT --index INDEX`.

The index folder:

    build.json         the student that builds it (its fingerprint, see below) and IMAGE_DIR; written first
    chunks/NNNNNN.npz  one batch: the embeddings, and each file's path, size and mtime (or why it was skipped);
                       each written to a temporary name and renamed, so a kill loses at most the batch in flight
    table.jsonl        id -> path (relative to IMAGE_DIR), size, mtime; ids are the embedded files in sorted order
    index.faiss        the faiss index, row i = id i (flat: exact inner product; ivf, hnsw: approximate)
    skipped.jsonl      the files that are not readable images, and why
    meta.json          written last: kind, size, dimension, the student's fingerprint, checksums of the table and
                       the index (a folder whose files do not match it is an unfinished build)

A rerun embeds only the files that no chunk holds with the same size and mtime, then writes table, index and meta
again from all chunks; the result equals one uninterrupted build. Changing `--kind` re-indexes without embedding.

A student's *fingerprint* is its embedding dimension and its embeddings of one fixed text and one fixed image.
Embeddings of different students are not comparable, so an index is only searched (or extended) by the student whose
probe embeddings match (cosine >= 0.999, which allows a GPU's rounding and nothing else).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vlmrl.errors import ConfigError, DataError, PathError
from vlmrl.serve.encoder import to_numpy
from vlmrl.serve.guard import RequestError, ServeLimits
from vlmrl.serve.images import decode_image

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff")
KINDS = ("flat", "ivf", "hnsw")
FORMAT = 1
PROBE_TEXT = "a red circle to the left of a blue square"
SAME_STUDENT = 0.999  # probe cosine at or above which two students are taken to be the same
MAX_FILE_BYTES = 256 * 2**20
HNSW_M, HNSW_EF_CONSTRUCTION, HNSW_EF_SEARCH = 32, 80, 64


# ---------------------------------------------------------------------------------------------------------- student
def probe_image():
    """A fixed 64 x 64 RGB gradient: the image half of a student's fingerprint."""
    from PIL import Image

    ramp = np.arange(64, dtype=np.uint8) * 4
    pixels = np.stack(np.broadcast_arrays(ramp[None, :], ramp[:, None], 255 - ramp[None, :]), axis=-1)
    return Image.fromarray(np.ascontiguousarray(pixels))


def student_fingerprint(student: Any, name: str) -> dict:
    """Kind, dimension and probe embeddings of a loaded student; `name` says where it came from (for messages)."""
    import torch

    with torch.no_grad():  # the two stages, not encode_*: callers may count (or wrap) the encode calls
        text = to_numpy(student.embed_texts(student.text_inputs([PROBE_TEXT])))[0]
        image = to_numpy(student.embed_images(student.image_inputs([probe_image()])))[0]
    return {"name": name, "kind": student.kind, "dimension": int(text.shape[0]), "probe_text": text.tolist(),
            "probe_image": image.tolist()}


def student_mismatch(recorded: dict, given: dict) -> str | None:
    """Why `given` is not the student `recorded` built the index with, or None when it is."""
    if recorded["dimension"] != given["dimension"]:
        return (f"it embeds in {recorded['dimension']} dimensions and {given['name']} in {given['dimension']}")
    for part in ("probe_text", "probe_image"):
        a, b = np.asarray(recorded[part]), np.asarray(given[part])
        if float(a @ b) / max(float(np.linalg.norm(a) * np.linalg.norm(b)), 1e-12) < SAME_STUDENT:
            return (f"{given['name']} embeds the fixed probe {'text' if part == 'probe_text' else 'image'} "
                    "differently (another student, or the same one trained further)")
    return None


def _load(student: Any) -> tuple[Any, str]:
    if isinstance(student, (str, Path)):
        from vlmrl.reclip.students import load_student

        return load_student(student), str(Path(student).resolve())
    return student, f"the {student.kind} student given in code"


# ---------------------------------------------------------------------------------------------------------- files
def list_images(image_dir: Path, skip: Path | None = None) -> tuple[list[str], int]:
    """Relative POSIX paths of the files under `image_dir` with an image extension, sorted; and how many other files
    there are. Hidden files and folders, folders that are links (not entered), and `skip` (the index folder when it
    sits inside IMAGE_DIR) are left out."""
    found, others = [], 0
    for root, dirs, names in os.walk(image_dir):
        here = Path(root)
        dirs[:] = [d for d in dirs if not d.startswith(".") and (skip is None or (here / d).resolve() != skip)]
        for name in names:
            if name.startswith("."):
                continue
            if Path(name).suffix.lower() in IMAGE_EXTENSIONS:
                found.append((here / name).relative_to(image_dir).as_posix())
            else:
                others += 1
    return sorted(found), others


def inside(root: Path, rel: str) -> Path | None:
    """`root / rel` resolved (links followed) when it stays inside `root` (itself resolved), else None."""
    root = root.resolve()
    path = (root / rel).resolve()
    return path if path.is_relative_to(root) and path != root else None


def read_image(image_dir: Path, rel: str, max_pixels: int):
    """(RGB image, None) or (None, why it is skipped)."""
    path = inside(image_dir, rel)
    if path is None:
        return None, "a link to outside IMAGE_DIR (never read)"
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            return None, f"{size} bytes is over {MAX_FILE_BYTES}"
        data = path.read_bytes()
    except OSError as exc:
        return None, f"cannot be read ({exc.strerror or exc})"
    try:
        return decode_image(data, ServeLimits(max_image_pixels=max_pixels), param="file"), None
    except RequestError as exc:
        return None, exc.message.removeprefix("file: ")


# ---------------------------------------------------------------------------------------------------------- chunks
@dataclass
class Entry:
    """What a chunk holds for one file: its embedding, or why it was skipped."""

    size: int
    mtime_ns: int
    vector: np.ndarray | None = None
    reason: str | None = None


def _stat(image_dir: Path, rel: str) -> tuple[int, int]:
    """Size and mtime (links followed, like the read); (-1, -1) for a file that cannot be stat'ed (a dangling
    link), which the read then reports."""
    try:
        st = (image_dir / rel).stat()
    except OSError:
        return -1, -1
    return st.st_size, st.st_mtime_ns


def _atomic_write(path: Path, write) -> None:
    """`write(file)` into a temporary sibling, flushed to disk, then renamed over `path`: readers see the old file or
    the whole new one."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_chunks(folder: Path, note=lambda text: None) -> dict[str, Entry]:
    """Every file the chunks hold (a later chunk wins); a chunk that does not read is reported and left out."""
    entries: dict[str, Entry] = {}
    for chunk in sorted((folder / "chunks").glob("[0-9]*.npz")):
        try:
            with np.load(chunk, allow_pickle=False) as z:
                records, vectors = json.loads(str(z["records"])), z["embeddings"]
        except (OSError, ValueError, KeyError) as exc:
            note(f"{chunk}: unreadable ({exc}); its files are embedded again")
            continue
        row = 0
        for r in records:
            entry = Entry(r["size"], r["mtime_ns"], reason=r.get("reason"))
            if entry.reason is None:
                entry.vector, row = vectors[row], row + 1
            entries[r["path"]] = entry
    return entries


def write_chunk(folder: Path, number: int, records: list[dict], vectors: np.ndarray) -> None:
    def write(f):
        np.savez(f, records=np.array(json.dumps(records)), embeddings=vectors.astype(np.float32))

    _atomic_write(folder / "chunks" / f"{number:06d}.npz", write)


# ---------------------------------------------------------------------------------------------------------- faiss
def _faiss():
    try:
        import faiss
    except ImportError:
        raise ConfigError("vlmrl index needs faiss: pip install 'vlmrl[serve]' (faiss-cpu)") from None
    return faiss


def ivf_lists(n: int) -> int:
    """IVF list count: 4 * sqrt(n), at most n / 39 (faiss wants 39 training points per list), at least 1."""
    return max(1, min(int(4 * math.sqrt(n)), n // 39))


def make_faiss(vectors: np.ndarray, kind: str) -> tuple[Any, dict]:
    """A faiss index over `vectors` [n, d] (inner product) and its search parameters.

    flat: exact (IndexFlatIP). ivf: IndexIVFFlat with `ivf_lists(n)` lists trained on the vectors, searched in
    nprobe = max(8, nlist / 4) of them. hnsw: IndexHNSWFlat, M = 32, efConstruction = 80, efSearch = 64."""
    if kind not in KINDS:
        raise ConfigError(f"--kind {kind!r}: expected one of {', '.join(KINDS)}")
    faiss = _faiss()
    n, d = vectors.shape
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    if kind == "flat":
        index, params = faiss.IndexFlatIP(d), {}
    elif kind == "ivf":
        nlist = ivf_lists(n)
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(d), d, nlist, faiss.METRIC_INNER_PRODUCT)
        index.train(vectors)
        params = {"nlist": nlist, "nprobe": min(nlist, max(8, nlist // 4))}
    else:
        index = faiss.IndexHNSWFlat(d, HNSW_M, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
        params = {"M": HNSW_M, "efConstruction": HNSW_EF_CONSTRUCTION, "efSearch": HNSW_EF_SEARCH}
    index.add(vectors)
    _set_search_params(index, kind, params)
    return index, params


def _set_search_params(index: Any, kind: str, params: dict) -> None:
    if kind == "ivf":
        _faiss().extract_index_ivf(index).nprobe = params["nprobe"]
    elif kind == "hnsw":
        index.hnsw.efSearch = params["efSearch"]


# ---------------------------------------------------------------------------------------------------------- build
def build_index(image_dir: str | Path, student: str | Path | Any, out: str | Path, kind: str = "flat",
                batch_size: int = 64, progress: Any = None, max_image_pixels: int = ServeLimits.max_image_pixels
                ) -> dict:
    """Embed the images under `image_dir` with `student` (a folder, or a loaded TwoTower) into the index folder
    `out`, resuming what an earlier run left there (module docstring). Unreadable files are skipped and reported.
    Returns {size, added, kept, skipped, ignored, problems, kind, dimension, path}."""
    from vlmrl.progress import Progress

    progress = progress or Progress()
    if kind not in KINDS:
        raise ConfigError(f"--kind {kind!r}: expected one of {', '.join(KINDS)}")
    if batch_size < 1:
        raise ConfigError(f"--batch-size {batch_size}: expected an integer >= 1")
    image_dir, out = Path(image_dir), Path(out)
    if not image_dir.is_dir():
        raise PathError(f"IMAGE_DIR {image_dir}: not a folder")
    (out / "chunks").mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"--out {out}: another `vlmrl index build` is writing this index") from None
        model, name = _load(student)
        fingerprint = student_fingerprint(model, name)
        _claim(out, image_dir, fingerprint)
        for stale in (out / "chunks").glob(".*.tmp"):  # a chunk a kill cut short
            stale.unlink()
        return _build(image_dir, model, out, kind, batch_size, progress, max_image_pixels, fingerprint)


def _claim(out: Path, image_dir: Path, fingerprint: dict) -> None:
    """Write build.json on the first run; on a rerun check that it is the same student and IMAGE_DIR."""
    claim = out / "build.json"
    record = {"format": FORMAT, "image_dir": str(image_dir.resolve()), "student": fingerprint}
    if not claim.exists():
        _atomic_write(claim, lambda f: f.write(json.dumps(record).encode()))
        return
    old = json.loads(claim.read_text())
    problem = student_mismatch(old["student"], fingerprint)
    if problem:
        raise ConfigError(f"--out {out}: this index was built by {old['student']['name']}, and {problem}; build "
                          "into a new --out folder, or use that student")
    if old["image_dir"] != record["image_dir"]:
        raise ConfigError(f"--out {out}: this index holds the images of {old['image_dir']}, not {record['image_dir']}; "
                          "build into a new --out folder")


def _batches(items: list[str], size: int) -> Iterator[list[str]]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


def _build(image_dir: Path, model: Any, out: Path, kind: str, batch_size: int, progress: Any, max_pixels: int,
           fingerprint: dict) -> dict:
    files, ignored = list_images(image_dir, skip=out.resolve())
    entries = read_chunks(out, progress.message)
    stats = {rel: _stat(image_dir, rel) for rel in files}
    todo = [rel for rel in files if rel not in entries or (entries[rel].size, entries[rel].mtime_ns) != stats[rel]]
    kept = len(files) - len(todo)
    if kept:
        progress.message(f"resuming {out}: {kept} files already done, {len(todo)} to embed")
    number = max((int(p.stem) for p in (out / "chunks").glob("[0-9]*.npz")), default=-1) + 1
    progress.start("embedding images", len(todo))
    try:
        for batch in _batches(todo, batch_size):
            records, images = [], []
            for rel in batch:
                image, reason = read_image(image_dir, rel, max_pixels)
                size, mtime_ns = stats[rel]
                records.append({"path": rel, "size": size, "mtime_ns": mtime_ns, **({"reason": reason} if reason else {})})
                if image is not None:
                    images.append(image)
            dim = fingerprint["dimension"]
            vectors = to_numpy(model.encode_image(images, batch_size=batch_size)) if images else np.zeros((0, dim))
            write_chunk(out, number, records, vectors)
            number += 1
            rows = iter(vectors)
            for r in records:
                entries[r["path"]] = Entry(r["size"], r["mtime_ns"], reason=r.get("reason"),
                                           vector=None if "reason" in r else next(rows))
            progress.advance(len(batch))
    finally:
        progress.end()
    return _finish(image_dir, out, kind, files, entries, stats, fingerprint,
                   {"added": sum(entries[rel].vector is not None for rel in todo), "kept": kept, "ignored": ignored})


def _finish(image_dir: Path, out: Path, kind: str, files: list[str], entries: dict[str, Entry],
            stats: dict[str, tuple[int, int]], fingerprint: dict, counts: dict) -> dict:
    table, vectors, skipped = [], [], []
    for rel in files:
        entry = entries[rel]
        if entry.vector is None:
            skipped.append({"path": rel, "reason": entry.reason})
        else:
            table.append({"id": len(table), "path": rel, "size": entry.size, "mtime_ns": entry.mtime_ns})
            vectors.append(entry.vector)
    _atomic_write(out / "skipped.jsonl", lambda f: f.write("".join(json.dumps(s) + "\n" for s in skipped).encode()))
    if not table:
        raise DataError(f"IMAGE_DIR {image_dir}: no readable image among {len(files)} files with an image extension "
                        f"({', '.join(IMAGE_EXTENSIONS)}); see {out / 'skipped.jsonl'}")
    index, params = make_faiss(np.stack(vectors), kind)
    table_text = "".join(json.dumps(row) + "\n" for row in table).encode()
    index_bytes = _faiss().serialize_index(index).tobytes()
    _atomic_write(out / "table.jsonl", lambda f: f.write(table_text))
    _atomic_write(out / "index.faiss", lambda f: f.write(index_bytes))
    meta = {"format": FORMAT, "kind": kind, "params": params, "size": len(table), "dimension": fingerprint["dimension"],
            "image_dir": str(image_dir.resolve()), "student": fingerprint,
            "table_sha256": hashlib.sha256(table_text).hexdigest(), "index_sha256": hashlib.sha256(index_bytes).hexdigest()}
    _atomic_write(out / "meta.json", lambda f: f.write(json.dumps(meta).encode()))
    problems = [f"{s['path']}: {s['reason']}" for s in skipped]
    return {"size": len(table), **counts, "skipped": len(skipped), "problems": problems, "kind": kind,
            "dimension": fingerprint["dimension"], "path": str(out)}


# ---------------------------------------------------------------------------------------------------------- search
@dataclass
class SearchIndex:
    """A built index: `search` embeddings, resolve an id to its image with `image_path`."""

    folder: Path
    image_dir: Path
    kind: str
    dimension: int
    student: dict
    table: list[dict]
    index: Any

    @classmethod
    def load(cls, path: str | Path) -> SearchIndex:
        folder = Path(path)
        meta_file = folder / "meta.json"
        if not meta_file.is_file():
            hint = (" (an unfinished build: rerun `vlmrl index build` to finish it)" if (folder / "build.json").exists()
                    else " (write one with `vlmrl index build IMAGE_DIR --student S --out INDEX`)")
            raise PathError(f"--index {folder}: no meta.json, so not a finished vlmrl index{hint}")
        meta = json.loads(meta_file.read_text())
        table_bytes, index_bytes = (folder / "table.jsonl").read_bytes(), (folder / "index.faiss").read_bytes()
        if (hashlib.sha256(table_bytes).hexdigest() != meta["table_sha256"]
                or hashlib.sha256(index_bytes).hexdigest() != meta["index_sha256"]):
            raise PathError(f"--index {folder}: table.jsonl or index.faiss does not match meta.json (a build was "
                            "stopped while it wrote them); rerun `vlmrl index build` with the same --out")
        index = _faiss().deserialize_index(np.frombuffer(index_bytes, dtype=np.uint8))
        _set_search_params(index, meta["kind"], meta["params"])
        table = [json.loads(line) for line in table_bytes.decode().splitlines()]
        return cls(folder, Path(meta["image_dir"]), meta["kind"], meta["dimension"], meta["student"], table, index)

    @property
    def size(self) -> int:
        return len(self.table)

    def check_student(self, fingerprint: dict) -> None:
        """ConfigError unless `fingerprint` is the student that built the index."""
        problem = student_mismatch(self.student, fingerprint)
        if problem:
            raise ConfigError(f"--index {self.folder}: built by {self.student['name']} ({self.student['kind']}, "
                              f"{self.student['dimension']} dimensions), and {problem}; serve the index with the "
                              "student that built it, or rebuild it with this one")

    def search(self, queries: np.ndarray, k: int) -> list[list[dict]]:
        """The `k` nearest images of each query row (inner product of L2-normalised embeddings: cosine)."""
        scores, ids = self.index.search(np.ascontiguousarray(queries, dtype=np.float32), min(k, self.size))
        return [[{"id": int(i), "path": self.table[i]["path"], "score": float(s)} for s, i in
                 zip(row_s, row_i, strict=True) if i >= 0] for row_s, row_i in zip(scores, ids, strict=True)]

    def image_path(self, image_id: int) -> Path | None:
        """The file of table row `image_id`, resolved, when it exists and stays inside IMAGE_DIR; else None."""
        if not 0 <= image_id < self.size:
            return None
        path = inside(self.image_dir, self.table[image_id]["path"])
        return path if path is not None and path.is_file() else None
