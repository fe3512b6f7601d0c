"""`vlmrl index build`: a build killed half-way resumes to the index one full build gives, embedding nothing twice;
unreadable files are skipped and reported; IVF and HNSW find the exact top-1; another student or folder is refused;
the command line; an index whose files do not match its meta.json does not load."""

from __future__ import annotations

import copy
import io
import json
import os

import numpy as np
import pytest
import torch

from vlmrl.cli import main
from vlmrl.errors import ConfigError, DataError, PathError
from vlmrl.reclip.embedded import EmbeddedConfig, EmbeddedStudent
from vlmrl.reclip.scenes import make_scenes
from vlmrl.serve import index as index_module
from vlmrl.serve.index import SearchIndex, build_index, ivf_lists, make_faiss, student_fingerprint

N = 10


@pytest.fixture(scope="module")
def student():
    torch.set_num_threads(1)
    return EmbeddedStudent.build(EmbeddedConfig(embed_dim=16, image_trainable_blocks=0, text_trainable_layers=0))


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def scenes():
    return make_scenes(N + 1, "train", 0)


@pytest.fixture
def image_dir(tmp_path, scenes):
    folder = tmp_path / "images"
    (folder / "sub").mkdir(parents=True)
    for i, it in enumerate(scenes[:N]):
        (folder / ("sub" if i % 3 == 0 else "") / f"s{i:02d}.png").write_bytes(png(it.image))
    return folder


class Counter:
    """Wraps a student's encode_image: counts the images it embeds; raises KeyboardInterrupt (a kill) on call
    `kill_on`."""

    def __init__(self, student, monkeypatch, kill_on: int | None = None):
        self.encode, self.images, self.calls, self.kill_on = student.encode_image, 0, 0, kill_on
        monkeypatch.setattr(student, "encode_image", self)

    def __call__(self, images, batch_size=64):
        self.calls += 1
        if self.calls == self.kill_on:
            raise KeyboardInterrupt
        self.images += len(images)
        return self.encode(images, batch_size=batch_size)


def vectors(folder) -> np.ndarray:
    index = SearchIndex.load(folder).index
    return index.reconstruct_n(0, index.ntotal)


def test_a_killed_build_resumes_to_the_full_build_embedding_nothing_twice(student, image_dir, tmp_path, monkeypatch):
    out = tmp_path / "resumed"
    first = Counter(student, monkeypatch, kill_on=3)
    with pytest.raises(KeyboardInterrupt):  # killed while it embeds the third batch of 3
        build_index(image_dir, student, out, batch_size=3)
    assert first.images == 6 and len(list((out / "chunks").glob("*.npz"))) == 2
    (out / "chunks" / ".000009.npz.tmp").write_bytes(b"PK\x03\x04 half")  # a kill while a chunk was written
    with pytest.raises(PathError, match="unfinished build"):
        SearchIndex.load(out)

    again = Counter(student, monkeypatch)
    summary = build_index(image_dir, student, out, batch_size=3)
    assert again.images == 4 and (summary["added"], summary["kept"], summary["size"]) == (4, 6, N)
    assert not list((out / "chunks").glob(".*.tmp"))

    full = Counter(student, monkeypatch)
    build_index(image_dir, student, tmp_path / "full", batch_size=64)
    assert full.images == N
    resumed, whole = SearchIndex.load(out), SearchIndex.load(tmp_path / "full")
    assert resumed.table == whole.table
    assert [row["path"] for row in resumed.table] == sorted(row["path"] for row in resumed.table)
    assert np.allclose(vectors(out), vectors(tmp_path / "full"), atol=1e-6)

    nothing = Counter(student, monkeypatch)
    assert build_index(image_dir, student, out)["added"] == 0 and nothing.calls == 0
    (image_dir / "s01.png").write_bytes(png(make_scenes(N + 1, "train", 0)[N].image))  # a file changed...
    os.utime(image_dir / "s01.png", ns=(1, 1))
    (image_dir / "s02.png").unlink()  # ...and one removed
    changed = Counter(student, monkeypatch)
    summary = build_index(image_dir, student, out)
    assert changed.images == 1 and (summary["added"], summary["kept"], summary["size"]) == (1, N - 2, N - 1)
    assert "s02.png" not in [row["path"] for row in SearchIndex.load(out).table]


def test_unreadable_files_are_skipped_and_reported(student, image_dir, tmp_path, scenes, monkeypatch):
    good = png(scenes[0].image)
    (image_dir / "text.png").write_text("not an image")
    (image_dir / "truncated.png").write_bytes(good[: len(good) // 2])
    (image_dir / "empty.jpg").write_bytes(b"")
    from PIL import Image

    Image.new("RGB", (200, 200), "red").save(image_dir / "huge.png")  # 40,000 pixels, over the 20,000 allowed (a scene: 12,544)
    (tmp_path / "outside.png").write_bytes(good)
    (image_dir / "link.png").symlink_to(tmp_path / "outside.png")
    (image_dir / "dangling.png").symlink_to(image_dir / "gone.png")  # inside, but to nothing
    (image_dir / "notes.txt").write_text("not even an image extension")
    (image_dir / ".hidden.png").write_bytes(good)
    out = image_dir / "the-index"  # inside IMAGE_DIR: its own files are never indexed
    summary = build_index(image_dir, student, out, max_image_pixels=20_000)
    assert (summary["size"], summary["skipped"], summary["ignored"]) == (N, 6, 1)
    reasons = {row["path"]: row["reason"] for row in map(json.loads, (out / "skipped.jsonl").read_text().splitlines())}
    assert set(reasons) == {"text.png", "truncated.png", "empty.jpg", "huge.png", "link.png", "dangling.png"}
    assert "not a readable image" in reasons["text.png"] and "not a readable image" in reasons["empty.jpg"]
    assert "does not decode" in reasons["truncated.png"] and "200x200 pixels is over" in reasons["huge.png"]
    assert "outside IMAGE_DIR" in reasons["link.png"] and "cannot be read" in reasons["dangling.png"]
    assert summary["problems"] == [f"{p}: {reasons[p]}" for p in sorted(reasons)]
    assert not any(row["path"].startswith(("the-index", ".")) for row in SearchIndex.load(out).table)
    reads = []  # the skipped files are remembered, not read again
    read = index_module.read_image
    monkeypatch.setattr(index_module, "read_image", lambda *args: reads.append(args) or read(*args))
    assert build_index(image_dir, student, out, max_image_pixels=20_000)["skipped"] == 6 and reads == []
    (image_dir / "text.png").unlink()
    for name in ("truncated.png", "empty.jpg", "huge.png", "link.png", "dangling.png"):
        (image_dir / name).unlink()
    for p in sorted(image_dir.rglob("s*.png")):
        p.write_text("corrupt")
    with pytest.raises(DataError, match="no readable image"):
        build_index(image_dir, student, tmp_path / "none")


def test_ivf_and_hnsw_find_the_exact_top1(student, image_dir, tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    base = rng.standard_normal((3000, 32)).astype(np.float32)
    base /= np.linalg.norm(base, axis=1, keepdims=True)
    queries = base[:200] + 0.02 * rng.standard_normal((200, 32)).astype(np.float32)
    exact = make_faiss(base, "flat")[0].search(queries, 1)[1][:, 0]
    assert (exact == np.arange(200)).all()
    for kind in ("ivf", "hnsw"):
        index, params = make_faiss(base, kind)
        assert (index.search(queries, 1)[1][:, 0] == exact).all(), kind
    assert params == {"M": 32, "efConstruction": 80, "efSearch": 64}
    assert ivf_lists(3000) == 76 and ivf_lists(100) == 2 and ivf_lists(10) == 1  # min(4 sqrt(n), n / 39)

    out = tmp_path / "idx"
    build_index(image_dir, student, out)
    stored = vectors(out)
    for kind in ("ivf", "hnsw"):
        counter = Counter(student, monkeypatch)
        assert build_index(image_dir, student, out, kind=kind)["kind"] == kind and counter.calls == 0  # no re-embed
        index = SearchIndex.load(out)
        assert index.kind == kind
        assert [hits[0]["id"] for hits in index.search(stored, 3)] == list(range(N))


def test_another_student_or_folder_is_refused(student, image_dir, tmp_path):
    out = tmp_path / "idx"
    build_index(image_dir, student, out)
    other = copy.deepcopy(student)
    with torch.no_grad():
        other.image_head[-1].weight.mul_(-1.0)
    with pytest.raises(ConfigError, match="built by the embedded student given in code, and .* probe image"):
        build_index(image_dir, other, out)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with pytest.raises(ConfigError, match="holds the images of"):
        build_index(elsewhere, student, out)
    with pytest.raises(ConfigError, match="embeds the fixed probe image differently"):
        SearchIndex.load(out).check_student(student_fingerprint(other, "other"))
    table = out / "table.jsonl"
    table.write_text(table.read_text().replace("s00.png", "s99.png"))
    with pytest.raises(PathError, match="does not match meta.json"):
        SearchIndex.load(out)


def test_index_build_command(student, image_dir, tmp_path, capsys):
    folder = student.save_pretrained(tmp_path / "run" / "student")
    (image_dir / "broken.png").write_text("x")
    out = tmp_path / "cli.index"
    assert main(["index", "build", str(image_dir), "--student", str(tmp_path / "run"), "--out", str(out),
                 "--kind", "hnsw", "--batch-size", "4"]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}: {N} images indexed ({N} new, 0 already there), 1 skipped" in printed
    assert "skipped broken.png: not a readable image" in printed
    index = SearchIndex.load(out)
    assert (index.size, index.kind, index.dimension) == (N, "hnsw", 16)
    assert index.student["name"] == str(folder.resolve())
    assert main(["index", "build", str(image_dir), "--student", str(tmp_path / "nothing"), "--out", str(out)]) == 2
    assert "not a two-tower student folder" in capsys.readouterr().err
    other = copy.deepcopy(student)
    with torch.no_grad():
        other.text_head.bias.add_(1.0)
    other.save_pretrained(tmp_path / "other")
    assert main(["serve", str(tmp_path / "other"), "--index", str(out)]) == 2  # refused before it listens
    err = capsys.readouterr().err
    assert f"--index {out}: built by {folder.resolve()}" in err and "embeds the fixed probe text differently" in err
