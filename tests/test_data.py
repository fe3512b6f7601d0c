"""Tests for vlmrl.data: synthetic tasks, user files, specs, the tokenizer corpus."""

from __future__ import annotations

import io
import json
import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from vlmrl.data import (
    SPLITS,
    TASKS,
    DataError,
    build_dataset,
    check_sample,
    format_box,
    infer_answer_type,
    load_file,
    make_task,
    parse_box,
    vocabulary_texts,
    zoom,
)
from vlmrl.data.digits import CELL_PX, FONT_PX, STROKE_PX, _load_digits, digit_pools
from vlmrl.data.sample import is_held_out
from vlmrl.data.shapes import COLORS, GAP_PX, MIN_OBJECT_PX, scene_key

SHAPE_TASKS = ["shapes_count", "shapes_color", "shapes_shape", "shapes_box"]


def _pixels(samples: list[dict]) -> list[list[bytes]]:
    return [[image.tobytes() for image in s["images"]] for s in samples]


def _columns(samples: list[dict]) -> list[dict]:
    return [{k: v for k, v in s.items() if k != "images"} for s in samples]


# --- synthetic tasks ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(TASKS))
def test_same_seed_same_samples_and_other_seed_differs(name):
    first, again = make_task(name, 6, "train", seed=3), make_task(name, 6, "train", seed=3)
    assert _columns(first) == _columns(again) and _pixels(first) == _pixels(again)
    assert _pixels(make_task(name, 6, "train", seed=4)) != _pixels(first)
    # sample i does not depend on n
    assert _columns(make_task(name, 3, "train", seed=3)) == _columns(first[:3])


@pytest.mark.parametrize("name", sorted(TASKS))
@pytest.mark.parametrize("split", SPLITS)
def test_samples_follow_the_contract(name, split):
    samples = make_task(name, 12, split, seed=1)
    assert len(samples) == len({s["id"] for s in samples}) == 12
    for s in samples:
        check_sample(s)
        assert s["task"] == name and s["answer_type"] == TASKS[name].answer_type
        assert s["id"].startswith(f"{name}/{split}/")
        assert infer_answer_type(s["solution"]) == s["answer_type"]
        (image,) = s["images"]
        assert image.mode == "RGB" and image.size == (s["width"], s["height"])
        assert image.width % 28 == 0 and image.height % 28 == 0
        json.dumps(_columns([s]))  # extra columns are JSON-able


def test_size_option_gives_the_requested_size():
    assert {s["images"][0].size for s in make_task("shapes_color", 10, "train", size=84)} == {(84, 84)}
    sizes = {s["width"] for s in make_task("shapes_color", 40, "train", size=[56, 112])}
    assert sizes == {56, 84, 112}
    for bad in (60, [20, 56], "big"):
        with pytest.raises(DataError, match="size"):
            make_task("shapes_color", 1, "train", size=bad)


@pytest.mark.parametrize("name", SHAPE_TASKS)
def test_shape_train_and_held_out_scenes_are_disjoint(name):
    keys = {}
    for split in SPLITS:
        samples = make_task(name, 100, split, seed=0)
        keys[split] = {scene_key(s["width"], s["objects"]) for s in samples}
        # the guarantee: every scene is on its split's side of the fixed hash partition
        assert all(is_held_out(k) == (split != "train") for k in keys[split])
    assert not keys["train"] & keys["test"] and not keys["train"] & keys["ood"]
    other_seed = {scene_key(s["width"], s["objects"]) for s in make_task(name, 100, "test", seed=1)}
    assert not keys["train"] & other_seed


def test_digit_train_and_held_out_images_are_disjoint():
    images, _ = _load_digits()
    pools = digit_pools()
    assert not set(pools["train"]) & set(pools["held_out"])
    assert len(pools["train"]) + len(pools["held_out"]) == len(images)
    train_pixels = {images[i].tobytes() for i in pools["train"]}
    assert not any(images[i].tobytes() in train_pixels for i in pools["held_out"])
    used = {split: {i for s in make_task("digits_sum", 100, split) for i in s["digit_indices"]} for split in SPLITS}
    assert used["train"] <= set(pools["train"].tolist())
    assert used["test"] | used["ood"] <= set(pools["held_out"].tolist())


def _hits(sample: dict) -> list[dict]:
    """The objects that match the sample's target attributes."""
    return [o for o in sample["objects"] if all(o[k] == v for k, v in sample["target"].items())]


def _check_scene(sample: dict) -> None:
    """Boxes inside the canvas, at least MIN_OBJECT_PX, apart; each object's centre pixel has its colour."""
    image = np.asarray(sample["images"][0])
    boxes = [o["bbox"] for o in sample["objects"]]
    for obj in sample["objects"]:
        x1, y1, x2, y2 = obj["bbox"]
        assert 0 <= x1 < x2 <= sample["width"] and 0 <= y1 < y2 <= sample["height"]
        assert x2 - x1 >= MIN_OBJECT_PX and y2 - y1 >= MIN_OBJECT_PX
        cy = (y1 + 2 * y2) // 3 if obj["shape"] == "triangle" else (y1 + y2) // 2
        assert tuple(image[cy, (x1 + x2) // 2]) == COLORS[obj["color"]]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            assert a[0] >= b[2] + GAP_PX or b[0] >= a[2] + GAP_PX or a[1] >= b[3] + GAP_PX or b[1] >= a[3] + GAP_PX


@pytest.mark.parametrize("target", ["color", "shape", "both"])
def test_count_answers_recount_the_scene(target):
    for split, counts, totals in (("train", range(0, 5), range(1, 7)), ("ood", range(5, 8), range(7, 10))):
        samples = make_task("shapes_count", 60, split, seed=2, target=target)
        assert {int(s["solution"]) for s in samples} <= set(counts)
        for s in samples:
            _check_scene(s)
            assert len(s["objects"]) in totals
            assert s["solution"] == str(len(_hits(s)))
            assert all(str(v) in s["problem"] for v in s["target"].values())
    assert len({s["solution"] for s in make_task("shapes_count", 60, "train", target=target)}) == 5


def test_color_shape_and_box_answers_match_the_unique_target():
    for split in ("train", "ood"):
        for s in make_task("shapes_color", 30, split):
            _check_scene(s)
            (hit,) = _hits(s)
            assert s["solution"] == hit["color"] and hit["shape"] in s["problem"]
        for s in make_task("shapes_shape", 30, split):
            (hit,) = _hits(s)
            assert s["solution"] == hit["shape"] and hit["color"] in s["problem"]
        for s in make_task("shapes_box", 30, split):
            _check_scene(s)
            (hit,) = _hits(s)
            assert parse_box(s["solution"]) == hit["bbox"]
            assert re.fullmatch(r"\[\d+, \d+, \d+, \d+\]", s["solution"])
    assert max(len(s["objects"]) for s in make_task("shapes_box", 30, "train")) <= 4
    assert min(len(s["objects"]) for s in make_task("shapes_box", 30, "ood")) >= 6


def test_digit_sums_match_the_labels():
    _, labels = _load_digits()
    for split, lengths in (("train", {2, 3}), ("test", {2, 3}), ("ood", {4})):
        samples = make_task("digits_sum", 40, split)
        assert {len(s["digits"]) for s in samples} == lengths
        for s in samples:
            assert s["digits"] == [int(labels[i]) for i in s["digit_indices"]]
            assert s["solution"] == str(sum(s["digits"]))
            assert s["width"] == 28 * max(2, len(s["digits"])) and s["height"] == 56
    assert {len(s["digits"]) for s in make_task("digits_sum", 20, "ood", num_digits=[2, 5])} == {6}


def _ink(image: np.ndarray) -> np.ndarray:
    """The inked part of a grayscale image, cropped to its bounding box."""
    rows, cols = np.nonzero(image < 255)
    return image[rows.min():rows.max() + 1, cols.min():cols.max() + 1]


def test_printed_digits_show_the_digits_they_are_labelled_with():
    """style=printed: column k holds exactly the glyph of digit k (the same ink as that digit printed alone), inside
    its column; the sum is the labels'; the default (handwritten) samples are unchanged by the option's existence."""
    from PIL import ImageDraw, ImageFont

    def glyph(d: int) -> np.ndarray:  # the digit in Pillow's font, drawn here, not by the task's code
        canvas = Image.new("L", (40, 40), 255)
        ImageDraw.Draw(canvas).text((5, 5), str(d), font=ImageFont.load_default(size=FONT_PX), fill=0,
                                     stroke_width=STROKE_PX, stroke_fill=0)
        return _ink(np.asarray(canvas))

    glyphs = {d: glyph(d) for d in range(10)}
    assert len({g.tobytes() for g in glyphs.values()}) == 10
    samples = make_task("digits_sum", 40, "test", seed=3, style="printed", num_digits=[4, 6])
    assert {len(s["digits"]) for s in samples} == {4, 5, 6}
    for s in samples:
        assert s["id"].startswith("digits_sum[num_digits=[4,6],style=printed]/test/")
        assert s["solution"] == str(sum(s["digits"])) and "digit_indices" not in s
        image = np.asarray(s["images"][0].convert("L"))
        assert image.shape == (56, CELL_PX * len(s["digits"]))
        for k, digit in enumerate(s["digits"]):
            assert np.array_equal(_ink(image[:, k * CELL_PX:(k + 1) * CELL_PX]), glyphs[digit]), (s["id"], k)
    handwritten = make_task("digits_sum", 2, "train", style="handwritten")
    assert handwritten[0]["id"] == "digits_sum/train/0" and "digit_indices" in handwritten[0]


TASK_ERRORS = [
    (("nope", 1, "train"), {}, "unknown task 'nope'"),
    (("shapes_count", 1, "val"), {}, "unknown split 'val'"),
    (("shapes_count", 1, "train"), {"colour": "red"}, "unknown option 'colour'.*'colors'"),
    (("shapes_count", 1, "train"), {"target": "size"}, "option 'target' must be one of"),
    (("shapes_shape", 1, "train"), {"colors": ["red", "pink"]}, "unknown name 'pink'"),
    (("digits_sum", -1, "train"), {}, "n must be a non-negative int"),
    (("digits_sum", 1, "train"), {"style": "cursive"}, "option 'style' must be one of.*'printed'"),
]


@pytest.mark.parametrize("args, options, pattern", TASK_ERRORS)
def test_task_errors_name_the_problem(args, options, pattern):
    with pytest.raises(DataError, match=pattern):
        make_task(*args, **options)


def test_vocabulary_covers_every_task_problem_and_answer():
    vocabulary = vocabulary_texts()
    assert 100 < len(vocabulary) < 5000
    # the zoom task's text joins the corpus only in runs that use it (vlmrl.trainer.limits.user_texts), so the
    # other tasks' tokenizer does not change with it
    words = {w for text in vocabulary + zoom.vocabulary() for w in text.split()}
    variants = [(name, {}) for name in sorted(TASKS)]
    variants += [("shapes_count", {"target": "shape"}), ("shapes_count", {"target": "both"})]
    variants += [("shapes_box", {"colors": list(COLORS)}), ("shapes_count", {"colors": list(COLORS), "target": "both"})]
    for name, options in variants:
        for split in ("train", "ood"):
            n = 200 if split == "train" else 20
            for s in make_task(name, n, split, **options):
                assert set(s["problem"].split()) <= words, s["problem"]
                assert set(re.findall(r"\w+", s["solution"])) <= words, s["solution"]
    assert vocabulary_texts(seed=0) == vocabulary
    assert vocabulary_texts(seed=1) != vocabulary


def test_infer_answer_type():
    numbers, texts = ("3", " -2.5 ", "1e3"), ("nan", "red", "3 apples", "[1, 2, 3]", "1,000")
    boxes = ("[1, 2, 3, 4]", "(1,2,3,4.5)", "1 2 3 4")
    maths = ("\\frac{1}{2}", "(1, 2]", "x+1", "2*pi", "50%", "x^2", "\\{1, 2\\}", "3 \\pm 1")
    texts += ("well-known", "a-b", "3 apples")
    expected = {**dict.fromkeys(numbers, "number"), **dict.fromkeys(texts, "text"), **dict.fromkeys(boxes, "box"),
                **dict.fromkeys(maths, "math")}
    assert {text: infer_answer_type(text) for text in expected} == expected


def test_math_solutions_in_a_file_reach_the_math_check(tmp_path):
    """A user file's LaTeX solution is inferred as math (or declared so), and accuracy checks it for equivalence."""
    from vlmrl.rewards import REWARDS

    _png(tmp_path / "a.png")
    rows = [{"image": "a.png", "problem": "Half?", "solution": "\\frac{1}{2}"},
            {"image": "a.png", "problem": "Root?", "solution": "x^2", "answer_type": "math"}]
    samples, _ = load_file(_write_jsonl(tmp_path / "math.jsonl", rows))
    assert [s["answer_type"] for s in samples] == ["math", "math"]
    columns = {k: [s[k] for s in samples] for k in ("solution", "answer_type")}
    assert REWARDS["accuracy"](["<answer>0.5</answer>", "<answer>x \\cdot x</answer>"], **columns) == [1.0, 1.0]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(-10_000, 10_000), min_size=4, max_size=4), st.integers(-(10**9), 10**9))
def test_formatted_boxes_and_numbers_parse_back(box, number):
    assert parse_box(format_box(box)) == box and infer_answer_type(format_box(box)) == "box"
    assert infer_answer_type(str(number)) == "number"


# --- user files ---------------------------------------------------------------------------------------------------


def _png(path: Path, color=(255, 0, 0), mode: str = "RGB", size=(8, 6)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).convert(mode).save(path)
    return path


def _write_jsonl(path: Path, rows: list) -> Path:
    lines = [row if isinstance(row, str) else json.dumps(row) for row in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = {"image": "a.png", "problem": "How many?", "solution": "3"}


def test_jsonl_happy_path(tmp_path):
    _png(tmp_path / "a.png")
    _png(tmp_path / "sub" / "b.png", color=(0, 0, 255), mode="L")
    absolute = _png(tmp_path / "elsewhere" / "c.png", mode="RGBA")
    two = {"images": ["a.png", "sub/b.png"], "problem": "Which colour?", "solution": "red", "source": "me"}
    text_only, absolute = {"problem": "Where?", "solution": "[1, 2, 3, 4]"}, str(absolute)
    wrapped = {"image": ["a.png"], "problem": "Box?", "solution": "<answer>[0, 0, 4.5, 4]</answer>"}
    custom = {"id": "custom", "image": absolute, "problem": "Sum?", "solution": 7}
    path = _write_jsonl(tmp_path / "train.jsonl", [GOOD, two, "", text_only, custom, wrapped])
    samples, report = load_file(path)
    assert (report.loaded, report.skipped, report.problems) == (5, 0, [])
    assert [s["id"] for s in samples] == [f"{path}:1", f"{path}:2", f"{path}:4", "custom", f"{path}:6"]
    assert [len(s["images"]) for s in samples] == [1, 2, 0, 1, 1]
    assert [s["answer_type"] for s in samples] == ["number", "text", "box", "number", "box"]
    assert samples[3]["solution"] == "7" and samples[4]["solution"] == "[0, 0, 4.5, 4]"
    assert samples[1]["source"] == "me" and "image" not in samples[0]
    assert all(check_sample(s) is None and s["task"] == "train" for s in samples)
    assert samples[1]["images"][1].size == (8, 6) and samples[1]["images"][1].getpixel((0, 0))[2] > 0


def test_jsonl_image_root_and_json_array(tmp_path):
    _png(tmp_path / "pics" / "a.png")
    (tmp_path / "data").mkdir()
    path = _write_jsonl(tmp_path / "data" / "rows.jsonl", [GOOD])
    samples, _ = load_file(path, image_root=tmp_path / "pics")
    assert samples[0]["images"][0].size == (8, 6)
    array = tmp_path / "pics" / "rows.json"
    array.write_text(json.dumps([GOOD, GOOD]))
    assert [s["id"] for s in load_file(array)[0]] == [f"{array}:1", f"{array}:2"]


BAD_ROWS = {
    "not_json": ('{"problem": "p", ', "not valid JSON"),
    "not_object": ("[1, 2]", "expected a JSON object"),
    "no_solution": ({"problem": "p", "image": None}, "missing field 'solution' (fields present: ['image', 'problem'])"),
    "missing_both": ({"question": "p"}, "missing field 'problem' and 'solution'"),
    "image_not_found": ({**GOOD, "image": "nope.png"}, "image 'nope.png' not found (relative to"),
    "image_not_decodable": ({**GOOD, "image": "broken.png"}, "image 'broken.png' could not be decoded"),
    "bad_answer_type": ({**GOOD, "answer_type": "count"}, "answer_type 'count'"),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_bad_row_raises_with_file_line_and_problem(tmp_path, case):
    _png(tmp_path / "a.png")
    (tmp_path / "broken.png").write_bytes(b"this is not a png")
    row, expected = BAD_ROWS[case]
    path = _write_jsonl(tmp_path / "data.jsonl", [GOOD, "", row])
    with pytest.raises(DataError) as error:
        load_file(path)
    message = str(error.value)
    assert str(path) in message and "line 3" in message and expected in message


def test_skip_counts_bad_rows_and_all_bad_raises(tmp_path):
    _png(tmp_path / "a.png")
    rows = [GOOD, "oops", {"problem": "p"}, GOOD, {**GOOD, "image": "gone.png"}]
    path = _write_jsonl(tmp_path / "data.jsonl", rows)
    samples, report = load_file(path, on_error="skip")
    assert (len(samples), report.loaded, report.skipped) == (2, 2, 3)
    assert [re.search(r"line \d+", p).group() for p in report.problems] == ["line 2", "line 3", "line 5"]
    with pytest.raises(DataError, match="line 2"):
        load_file(path)
    all_bad = _write_jsonl(tmp_path / "bad.jsonl", ["oops", {"problem": "p"}])
    with pytest.raises(DataError, match="all 2 rows are bad"):
        load_file(all_bad, on_error="skip")
    with pytest.raises(DataError, match="no rows"):
        load_file(_write_jsonl(tmp_path / "empty.jsonl", ["", ""]), on_error="skip")


def test_file_level_errors(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_file(tmp_path / "missing.jsonl")
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported file type '.csv'"):
        load_file(tmp_path / "data.csv")
    path = _write_jsonl(tmp_path / "dup.jsonl", [{**GOOD, "image": None, "id": "x"}] * 2)
    with pytest.raises(DataError, match="line 2: id 'x' already used at .*line 1"):
        load_file(path)
    with pytest.raises(DataError, match="on_error"):
        load_file(path, on_error="ignore")


def _png_bytes(color) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (5, 4), color).save(buffer, format="PNG")
    return buffer.getvalue()


def test_parquet_round_trip_with_image_bytes(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    _png(tmp_path / "a.png", color=(0, 255, 0))
    red, green = {"bytes": _png_bytes((255, 0, 0)), "path": "r.png"}, {"bytes": None, "path": "a.png"}
    images, problems = [[red], [green, red], []], ["What colour?", "And here?", "Text only?"]
    path = tmp_path / "train.parquet"
    table = pa.table({"images": images, "problem": problems, "solution": ["red", "green", "4"], "note": list("xyz")})
    pq.write_table(table, path)
    samples, report = load_file(path)
    assert report.loaded == 3 and [s["id"] for s in samples] == [f"{path}:{i}" for i in range(3)]
    assert samples[0]["images"][0].getpixel((0, 0)) == (255, 0, 0)
    assert [im.getpixel((0, 0)) for im in samples[1]["images"]] == [(0, 255, 0), (255, 0, 0)]
    assert samples[2]["images"] == [] and samples[2]["answer_type"] == "number" and samples[2]["note"] == "z"

    raw = pa.table({"image": [_png_bytes((0, 0, 255)), b"garbage"], "problem": ["p", "q"], "solution": ["1", None]})
    pq.write_table(raw, tmp_path / "raw.parquet")
    with pytest.raises(DataError, match="raw.parquet row 1: missing field 'solution'"):
        load_file(tmp_path / "raw.parquet")
    samples, report = load_file(tmp_path / "raw.parquet", on_error="skip")
    assert samples[0]["images"][0].getpixel((0, 0)) == (0, 0, 255) and report.skipped == 1


def test_datasets_folder_missing_package_and_fake_module(tmp_path, monkeypatch):
    folder = tmp_path / "hf"
    folder.mkdir()
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match=r"pip install 'vlmrl\[datasets\]'"):
        load_file(folder)
    rows = [{"image": Image.new("L", (4, 4), 9), "problem": "p", "solution": "2"}]
    fake = types.SimpleNamespace(load_from_disk=lambda path: rows)
    monkeypatch.setitem(sys.modules, "datasets", fake)
    samples, _ = load_file(folder)
    assert samples[0]["images"][0].mode == "RGB" and samples[0]["id"] == f"{folder}:0"
    fake.load_from_disk = lambda path: {"train": rows, "test": rows}
    with pytest.raises(DataError, match="several splits"):
        load_file(folder)


# --- image paths of rows someone else wrote -------------------------------------------------------------------------


def _someone_elses(tmp_path: Path, images: list) -> Path:
    """A `datasets` folder root/ds whose rows name `images` (one string each); root/img.png and root/sub/ are inside
    the image root, outside/photo.png is not."""
    datasets = pytest.importorskip("datasets")
    _png(tmp_path / "root" / "img.png")
    (tmp_path / "root" / "sub").mkdir()
    _png(tmp_path / "outside" / "photo.png", color=(1, 2, 3))
    folder = tmp_path / "root" / "ds"
    table = {"image": images, "problem": ["p"] * len(images), "solution": ["1"] * len(images)}
    datasets.Dataset.from_dict(table).save_to_disk(folder)
    return folder


def _load(how: str, folder: Path, on_error: str = "raise"):
    """A saved `datasets` folder as a file spec (image root: its parent) or as a hub spec with that image_root."""
    if how == "path":
        return build_dataset({"path": str(folder), "on_error": on_error}, "train", 0)
    return build_dataset({"hub": str(folder), "image_root": str(folder.parent), "on_error": on_error}, "train", 0)


def _refused(how: str, folder: Path, image: str, problem: str) -> None:
    """Loading refuses row 1 (row 0 is a good one) naming the dataset, the row, the path, the problem and the fix;
    with on_error: skip the row is skipped and counted."""
    with pytest.raises(DataError) as error:
        _load(how, folder)
    message = str(error.value)
    assert f"{folder} row 1: image {image!r} {problem}" in message, message
    assert "Set image_root to the folder that holds the images" in message and "JSONL file of your own" in message
    samples, report = _load(how, folder, on_error="skip")
    assert len(samples) == 1 and report.skipped == 1 and f"row 1: image {image!r}" in report.problems[0]


@pytest.mark.parametrize("how", ["path", "hub"])
def test_a_datasets_absolute_image_path_is_refused(tmp_path, how):
    folder = _someone_elses(tmp_path, ["img.png", str(tmp_path / "outside" / "photo.png")])
    _refused(how, folder, str(tmp_path / "outside" / "photo.png"), "is an absolute path")


@pytest.mark.parametrize("how", ["path", "hub"])
def test_a_datasets_image_path_climbing_out_with_dot_dot_is_refused(tmp_path, how):
    folder = _someone_elses(tmp_path, ["img.png", "sub/../../outside/photo.png"])
    _refused(how, folder, "sub/../../outside/photo.png", f"leads outside the image root {tmp_path / 'root'}/")


@pytest.mark.parametrize("how", ["path", "hub"])
@pytest.mark.parametrize("link", ["file", "folder"])
def test_a_datasets_image_path_through_a_symlink_out_is_refused(tmp_path, how, link):
    name = "link.png" if link == "file" else "linked/photo.png"
    folder = _someone_elses(tmp_path, ["img.png", name])
    target = tmp_path / "outside" / ("photo.png" if link == "file" else "")
    (tmp_path / "root" / name.split("/")[0]).symlink_to(target)
    _refused(how, folder, name, f"leads outside the image root {tmp_path / 'root'}/ (to {tmp_path / 'outside'}")


@pytest.mark.parametrize("how", ["path", "hub"])
def test_a_datasets_image_path_that_stays_inside_loads(tmp_path, how):
    folder = _someone_elses(tmp_path, ["img.png", "sub/../img.png", "inside.png"])
    (tmp_path / "root" / "inside.png").symlink_to(tmp_path / "root" / "img.png")  # a link that stays inside
    samples, report = _load(how, folder)
    assert report.skipped == 0 and [s["images"][0].size for s in samples] == [(8, 6)] * 3


def test_datasets_image_features_with_paths_of_datasets_own_still_load(tmp_path, monkeypatch):
    """A `datasets.Image` column of files (an imagefolder in the hub cache) holds absolute paths outside any image
    root, and PIL images; both are the dataset's own images."""
    datasets = pytest.importorskip("datasets")
    from vlmrl.data import hub

    cached = _png(tmp_path / "hf_cache" / "downloads" / "extracted" / "a.png", color=(0, 9, 0))
    features = datasets.Features({"image": datasets.Image(), "problem": datasets.Value("string"),
                                  "solution": datasets.Value("string")})
    in_cache = datasets.Dataset.from_dict({"image": [str(cached)], "problem": ["p"], "solution": ["1"]}, features)
    assert in_cache.cast_column("image", datasets.Image(decode=False))[0]["image"] == {"bytes": None,
                                                                                      "path": str(cached)}
    monkeypatch.setattr(hub, "open_dataset", lambda *args, **kwargs: in_cache)
    samples, _ = build_dataset({"hub": "someone/images", "image_root": str(tmp_path / "root")}, "train", 0)
    assert samples[0]["images"].refs == (str(cached),) and samples[0]["images"][0].getpixel((0, 0)) == (0, 9, 0)
    decoded = datasets.Dataset.from_dict({"image": [Image.new("RGB", (3, 2), (4, 5, 6))], "problem": ["p"],
                                          "solution": ["1"]}, features)
    decoded.save_to_disk(tmp_path / "saved")
    samples, _ = build_dataset({"path": str(tmp_path / "saved")}, "train", 0)
    assert samples[0]["images"][0].getpixel((0, 0)) == (4, 5, 6)


def test_a_users_own_jsonl_may_name_any_image_path(tmp_path):
    """The user's own rows: absolute paths, `..` out of the folder and links out all load (it is their data)."""
    outside = _png(tmp_path / "outside" / "photo.png", color=(1, 2, 3))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "link.png").symlink_to(outside)
    rows = [{**GOOD, "image": str(outside)}, {**GOOD, "image": "../outside/photo.png"}, {**GOOD, "image": "link.png"}]
    samples, report = load_file(_write_jsonl(tmp_path / "data" / "mine.jsonl", rows))
    assert report.skipped == 0 and [s["images"][0].getpixel((0, 0)) for s in samples] == [(1, 2, 3)] * 3


# --- specs ----------------------------------------------------------------------------------------------------------


def test_build_dataset_from_task_file_and_list_specs(tmp_path):
    samples, report = build_dataset({"task": "shapes_count", "n": 4, "target": "shape"}, "test", seed=5)
    assert report is None and len(samples) == 4
    assert samples[0]["id"] == "shapes_count[target=shape]/test/0"
    assert _pixels(samples) == _pixels(make_task("shapes_count", 4, "test", seed=5, target="shape"))
    own_seed, _ = build_dataset({"task": "shapes_count", "n": 4, "target": "shape", "seed": 9}, "test", seed=5)
    assert _pixels(own_seed) == _pixels(make_task("shapes_count", 4, "test", seed=9, target="shape"))

    _png(tmp_path / "a.png")
    path = _write_jsonl(tmp_path / "mine.jsonl", [GOOD, "bad line", GOOD])
    file_spec = {"path": str(path), "on_error": "skip", "n": 1}
    samples, report = build_dataset(
        [{"task": "digits_sum", "n": 2}, file_spec, {"task": "shapes_box", "n": 1}], "train", 0
    )
    assert [s["task"] for s in samples] == ["digits_sum", "digits_sum", "mine", "shapes_box"]
    assert (report.loaded, report.skipped) == (1, 0)  # n=1: reading stopped at line 1, "bad line" never read


SPEC_ERRORS = [
    ({"task": "shapes_count", "n": 3, "colour": 1}, r"unknown key 'colour'; allowed keys: \['task', 'n', 'seed', 'c"),
    ({"path": "x.jsonl", "limit": 3}, r"unknown key 'limit'; allowed keys: \['path', 'on_error', 'image_root', 'n', "),
    ({"path": "x.jsonl", "check_images": "all"}, r"check_images must be one of \['exists', 'header', 'decode'\]"),
    ({"n": 3}, "exactly one of 'task'"),
    ({"task": "shapes_count"}, "needs 'n'"),
    ({"path": "x.jsonl", "on_error": "ignore"}, "on_error"),
    ([{"task": "shapes_color", "n": 2}] * 2, r"data spec \[1\]: sample id 'shapes_color/train/0' is also produced"),
]


@pytest.mark.parametrize("spec, pattern", SPEC_ERRORS)
def test_build_dataset_spec_errors(spec, pattern):
    with pytest.raises(DataError, match=pattern):
        build_dataset(spec, "train", 0)
