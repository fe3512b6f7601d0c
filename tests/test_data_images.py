"""Tests for lazy images of user data: loading decodes nothing, `n` stops reading, bad images name file and line,
the decode cache is bounded."""

from __future__ import annotations

import gc
import io
import json
import pickle
import sys
import types
import weakref
from pathlib import Path

import pytest
from PIL import Image, ImageFile

from vlmrl.data import IMAGE_CACHE, DataError, LazyImages, build_dataset, check_sample, load_file
from vlmrl.data.images import image_cache


@pytest.fixture
def decodes(monkeypatch):
    """Counts pixel decodes (PIL's `ImageFile.load`, which every PNG/JPEG decode goes through); empties the cache."""
    calls = []
    original = ImageFile.ImageFile.load

    def counting(self):
        if self.tile:  # not decoded yet (a loaded image's later load() calls, e.g. from copy(), do nothing)
            calls.append(getattr(self, "filename", None) or "bytes")
        return original(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", counting)
    IMAGE_CACHE.clear()
    yield calls
    IMAGE_CACHE.clear()


def _dataset(folder: Path, rows: int, images: int | None = None) -> Path:
    """`rows` JSONL rows over `images` distinct 8x8 PNGs (default: one per row)."""
    images = images or rows
    (folder / "img").mkdir(parents=True, exist_ok=True)
    for i in range(images):
        Image.new("RGB", (8, 8), (i % 256, i // 256 % 256, 7)).save(folder / "img" / f"{i}.png")
    lines = [json.dumps({"image": f"img/{i % images}.png", "problem": "n?", "solution": str(i)}) for i in range(rows)]
    path = folder / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _truncated_png(path: Path) -> Path:
    """A PNG whose header is intact but whose pixel data is cut off: it opens, it does not decode."""
    buffer = io.BytesIO()
    Image.effect_noise((64, 64), 50).convert("RGB").save(buffer, format="PNG")
    path.write_bytes(buffer.getvalue()[:300])
    return path


def test_loading_decodes_no_image_and_use_decodes_once(tmp_path, decodes):
    path = _dataset(tmp_path, 3000, images=1000)
    samples, report = load_file(path)
    assert report.loaded == 3000 and decodes == []
    assert all(isinstance(s["images"], LazyImages) and len(s["images"]) == 1 for s in samples)  # len: no decode
    assert decodes == []
    first = samples[5]["images"][0]
    assert first.mode == "RGB" and first.getpixel((0, 0)) == (5, 0, 7) and len(decodes) == 1
    assert samples[5]["images"][0] is first and samples[1005]["images"][0] is first  # same file: one decode
    assert len(decodes) == 1
    [s["images"][0] for s in samples[:10]]
    assert len(decodes) == 10
    load_file(path, check_images="decode")  # decodes every distinct image once, keeps none
    assert len(decodes) == 10 + 3000 and len(IMAGE_CACHE) == 10


def test_n_stops_reading_early(tmp_path, decodes):
    Image.new("RGB", (4, 4)).save(tmp_path / "a.png")
    good = json.dumps({"image": "a.png", "problem": "p", "solution": "1"})
    rows = [good, "not json", good, good] + ["{broken"] * 50 + [json.dumps({"image": "gone.png", "problem": "p",
                                                                           "solution": "1"})]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(rows) + "\n")
    with pytest.raises(DataError, match="line 2"):
        load_file(path, n=2)
    samples, report = load_file(path, on_error="skip", n=2)
    assert [s["id"] for s in samples] == [f"{path}:1", f"{path}:3"]
    assert (report.loaded, report.skipped) == (2, 1)  # only the lines read: 1-3
    samples, report = load_file(path, on_error="skip", n=3)
    assert (report.loaded, report.skipped) == (3, 1)  # lines 5-55 (bad, and a missing image) never read
    assert load_file(path, n=1)[1].loaded == 1 and load_file(path, n=0)[0] == []
    samples, report = build_dataset({"path": str(path), "n": 3, "on_error": "skip"}, "train", 0)
    assert (len(samples), report.loaded, report.skipped) == (3, 3, 1)
    _, report = load_file(path, on_error="skip")
    assert (report.loaded, report.skipped) == (3, 52)
    with pytest.raises(DataError, match="n must be a non-negative int"):
        load_file(path, n=-1)
    assert decodes == []


def test_n_stops_reading_a_parquet_file_early(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    solutions = ["1"] * 600 + [None] * 10  # rows 600+ are bad, in a later batch than the first n rows
    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"problem": ["p"] * 610, "solution": solutions}), path, row_group_size=100)
    with pytest.raises(DataError, match="row 600: missing field 'solution'"):
        load_file(path)
    samples, report = load_file(path, n=300)
    assert len(samples) == report.loaded == 300 and report.skipped == 0


def test_corrupt_image_is_reported_with_file_and_line(tmp_path, decodes):
    Image.new("RGB", (4, 4)).save(tmp_path / "a.png")
    _truncated_png(tmp_path / "cut.png")
    rows = [{"image": "a.png", "problem": "p", "solution": "1"}, {"image": "cut.png", "problem": "p", "solution": "2"}]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    samples, report = load_file(path)  # the header is fine: loading (cheap checks) passes it
    assert report.loaded == 2
    assert samples[0]["images"][0].size == (4, 4)
    with pytest.raises(DataError) as error:  # first use, e.g. mid-training: stops with file, line and image
        samples[1]["images"][0]
    assert str(error.value).startswith(f"{path} line 2: image '{tmp_path / 'cut.png'}' could not be decoded (")
    with pytest.raises(DataError, match=f"{path} line 2"):
        list(samples[1]["images"])
    with pytest.raises(DataError, match=f"{path} line 2"):
        check_sample(samples[1])
    with pytest.raises(DataError, match="line 2: image 'cut.png' could not be decoded"):
        load_file(path, check_images="decode")
    samples, report = load_file(path, on_error="skip", check_images="decode")
    assert len(samples) == 1 and report.skipped == 1 and "line 2: image 'cut.png'" in report.problems[0]
    samples, _ = load_file(path, n=1)
    IMAGE_CACHE.clear()
    (tmp_path / "a.png").unlink()  # gone after loading
    with pytest.raises(DataError, match=rf"{path} line 1: image .*a.png' not found \(it was there"):
        samples[0]["images"][0]


def test_corrupt_image_bytes_in_parquet(tmp_path, decodes):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    cut = _truncated_png(tmp_path / "cut.png").read_bytes()
    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"image": [cut, b"not an image"], "problem": ["p", "q"], "solution": ["1", "2"]}), path)
    with pytest.raises(DataError, match="row 1: image bytes could not be decoded"):
        load_file(path)
    samples, report = load_file(path, on_error="skip")
    assert report.skipped == 1 and isinstance(samples[0]["images"].refs[0], bytes) and decodes == []
    with pytest.raises(DataError, match=f"{path} row 0: image bytes could not be decoded"):
        samples[0]["images"][0]


def test_image_cache_is_bounded_by_count_and_bytes():
    cache = image_cache(max_bytes=10**9, max_entries=3)
    for i in range(10):
        cache.get_or_make(i, lambda: Image.new("RGB", (10, 10)))
        cache.get_or_make(0, lambda: pytest.fail("0 is the most recently used: never evicted"))
    assert len(cache) == 3 and cache.misses == 10 and cache.hits == 10
    small = image_cache(max_bytes=3 * (100 * 100 * 3 + 1024), max_entries=100)
    for i in range(10):
        small.get_or_make(i, lambda: Image.new("RGB", (100, 100)))
    assert len(small) == 3 and small.bytes <= small.max_bytes
    huge = image_cache(max_bytes=1000)
    assert huge.get_or_make("big", lambda: Image.new("RGB", (100, 100))).size == (100, 100) and len(huge) == 0


def test_a_pass_over_a_dataset_keeps_only_the_cache_s_images(tmp_path, decodes, monkeypatch):
    samples, _ = load_file(_dataset(tmp_path, 400))
    monkeypatch.setattr(IMAGE_CACHE, "max_entries", 16)
    alive = []
    for sample in samples:
        for image in sample["images"]:
            alive.append(weakref.ref(image))
    del image
    gc.collect()
    assert len(decodes) == 400 and len(IMAGE_CACHE) == 16
    assert sum(ref() is not None for ref in alive) == 16  # the rest were freed: memory does not grow with the data


def test_lazy_images_behave_like_a_read_only_list(tmp_path, decodes):
    samples, _ = load_file(_dataset(tmp_path, 3))
    images = samples[0]["images"]
    assert bool(images) and not LazyImages() and LazyImages() == [] and images != []
    assert images == [Image.open(tmp_path / "img" / "0.png").convert("RGB")]
    assert images[:1] == images[-1:] == list(images) and images.index(images[0]) == 0
    assert images != samples[1]["images"] and images == LazyImages(images.refs, "elsewhere")
    assert "0.png" in repr(images) and "line 1" in repr(images)
    blob = pickle.dumps(images)
    assert len(blob) < 300 and pickle.loads(blob) == images  # a reward worker gets the paths, not the pixels
    with pytest.raises(TypeError):
        hash(images)
    with pytest.raises(IndexError):
        images[1]
    check_sample(samples[0])


def test_datasets_image_columns_are_read_undecoded(tmp_path, monkeypatch, decodes):
    png = io.BytesIO()
    Image.new("RGB", (3, 2), (1, 2, 3)).save(png, format="PNG")

    class FakeImage:
        def __init__(self, decode=True):
            self.decode = decode

    class FakeDataset(list):
        features = {"image": FakeImage(), "problem": "string"}

        def cast_column(self, name, feature):
            assert name == "image" and feature.decode is False
            return [{**row, name: {"bytes": png.getvalue(), "path": "x.png"}} for row in self]

    rows = FakeDataset([{"image": "decoded PIL image", "problem": "p", "solution": "2"}])
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_from_disk=lambda p: rows, Image=FakeImage))
    (tmp_path / "hf").mkdir()
    samples, _ = load_file(tmp_path / "hf")
    assert samples[0]["images"].refs == (png.getvalue(),) and decodes == []
    assert samples[0]["images"][0].getpixel((0, 0)) == (1, 2, 3)


def test_real_datasets_folder_loads_without_decoding(tmp_path, decodes):
    datasets = pytest.importorskip("datasets")
    Image.new("RGB", (5, 4), (9, 8, 7)).save(tmp_path / "a.png")
    features = datasets.Features({"image": datasets.Image(), "images": datasets.Sequence(datasets.Image()),
                                  "problem": datasets.Value("string"), "solution": datasets.Value("string")})
    table = {"image": [str(tmp_path / "a.png")] * 3, "images": [[str(tmp_path / "a.png")]] * 3,
             "problem": ["p"] * 3, "solution": ["1", "2", "3"]}
    datasets.Dataset.from_dict(table, features=features).remove_columns("images").save_to_disk(tmp_path / "one")
    samples, _ = load_file(tmp_path / "one")
    assert len(samples) == 3 and decodes == [] and isinstance(samples[0]["images"].refs[0], bytes)
    assert samples[2]["images"][0].getpixel((0, 0)) == (9, 8, 7)
    datasets.Dataset.from_dict(table, features=features).remove_columns("image").save_to_disk(tmp_path / "many")
    before = len(decodes)
    samples, _ = load_file(tmp_path / "many")
    assert len(samples[0]["images"]) == 1 and len(decodes) == before and isinstance(samples[0]["images"].refs[0], bytes)
    assert samples[0]["images"][0].size == (5, 4)
