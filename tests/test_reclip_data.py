"""Captioned scenes (captions from scene graphs, hard negatives, held-out split) and user image-caption files."""

import json

import pytest
from PIL import Image

from vlmrl.data import DataError
from vlmrl.reclip.data import build_items, zero_shot_sets
from vlmrl.reclip.judge import compare_descriptions
from vlmrl.reclip.scenes import Description, Group, caption, describe, make_scenes, negatives_of


def test_captions_are_written_from_the_scene_graph():
    items = make_scenes(60, "train", 0)
    for it in items:
        assert describe(it.extra["objects"]) == it.description.canonical()  # the image shows what the caption says
        assert it.caption in (caption(it.description), caption(it.description, flip=True))
        assert it.image.size == (112, 112) and it.image.mode == "RGB"
    assert caption(Description((Group(2, "red", "circle"), Group(1, "blue", "square")), "left of"), flip=True) == \
        "a blue square to the right of two red circles"


def test_negatives_change_exactly_one_thing():
    desc = Description((Group(2, "red", "circle"), Group(1, "blue", "square")), "left of")
    import random

    negs = {n.kind: n for n in negatives_of(desc, random.Random(0), ["red", "blue", "green"],
                                            ["circle", "square", "triangle"], 3)}
    assert set(negs) == {"relation", "binding", "color", "shape", "count"}
    assert negs["relation"].caption == "two red circles to the right of a blue square"
    assert negs["binding"].caption == "two blue circles to the left of a red square"
    for kind, neg in negs.items():
        reasons = compare_descriptions(desc, neg.description)
        assert reasons, kind  # a negative never means the same as the truth
        expected = {"relation": {"relation"}, "binding": {"colour"}, "color": {"colour"}, "shape": {"shape"},
                    "count": {"count"}}[kind]
        assert {r.attribute for r in reasons} == expected


def test_split_is_by_caption_and_deterministic():
    train, test = make_scenes(300, "train", 0), make_scenes(100, "test", 0)
    assert not {it.description.key() for it in train} & {it.description.key() for it in test}
    again = make_scenes(5, "train", 0)
    assert [it.caption for it in again] == [it.caption for it in train[:5]]  # item i does not depend on n
    assert again[0].image.tobytes() == train[0].image.tobytes()


def test_zero_shot_sets_label_one_group_scenes():
    sets = {s.name: s for s in zero_shot_sets(12, 0)}
    assert set(sets) == {"colour", "shape", "count"}
    assert sets["colour"].class_phrases == ["red shapes", "green shapes", "blue shapes", "yellow shapes"]
    assert all(0 <= label < 3 for label in sets["count"].labels) and len(sets["shape"].images) == 12


def test_spec_errors_name_the_problem():
    with pytest.raises(DataError, match="unknown key 'colour'"):
        build_items({"task": "reclip_scenes", "n": 3, "colour": "red"}, "train", 0)
    with pytest.raises(DataError, match="exactly one of 'task'"):
        build_items({"n": 3}, "train", 0)
    items, report = build_items([{"task": "reclip_scenes", "n": 2, "max_count": 2},
                                 {"task": "reclip_scenes", "n": 2, "seed": 5}], "train", 0)
    assert len(items) == 4 and report is None


def write_rows(tmp_path, rows):
    Image.new("RGB", (20, 20), "red").save(tmp_path / "a.png")
    path = tmp_path / "caps.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_user_caption_file(tmp_path):
    path = write_rows(tmp_path, [{"image": "a.png", "caption": "a red square"},
                                 {"image": "a.png", "caption": "red", "id": "x"}])
    items, report = build_items({"path": str(path)}, "train", 0)
    assert [it.caption for it in items] == ["a red square", "red"] and items[1].id == "x"
    assert items[0].description is None and items[0].negatives == [] and report.loaded == 2


def test_visual_rft_rows_with_caption_field(tmp_path):
    path = write_rows(tmp_path, [{"image": "a.png", "problem": "Describe it.", "solution": "a red square"}])
    items, _ = build_items({"path": str(path), "caption_field": "solution"}, "train", 0)
    assert items[0].caption == "a red square"


def test_bad_caption_rows_raise_with_file_and_line_or_are_skipped(tmp_path):
    path = write_rows(tmp_path, [{"image": "a.png", "caption": "ok"}, {"image": "a.png", "text": "no caption"},
                                 "{broken", {"caption": "no image"}])
    with pytest.raises(DataError, match=r"caps.jsonl line 2: missing field 'caption'"):
        build_items({"path": str(path)}, "train", 0)
    items, report = build_items({"path": str(path), "on_error": "skip"}, "train", 0)
    assert len(items) == 1 and report.skipped == 3
    assert any("line 3" in p for p in report.problems) and any("exactly one image" in p for p in report.problems)


def test_parquet_rows_with_image_bytes(tmp_path):
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), "blue").save(buffer, format="PNG")
    table = pa.table({"image": [{"bytes": buffer.getvalue(), "path": "b.png"}], "caption": ["a blue square"]})
    pq.write_table(table, tmp_path / "caps.parquet")
    items, report = build_items({"path": str(tmp_path / "caps.parquet")}, "train", 0)
    assert items[0].caption == "a blue square" and items[0].image.getpixel((0, 0)) == (0, 0, 255)
    assert items[0].id.endswith("caps.parquet:0") and report.loaded == 1
