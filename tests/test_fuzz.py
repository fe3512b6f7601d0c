"""Fuzzing (hypothesis): the data loaders and the reward parsers on random and adversarial input.

Loaders raise only DataError (an ImportError for a missing optional package); every image of a loaded sample decodes
or raises DataError naming the sample's file and line. Reward functions return, per completion, None or a finite
float in their documented range; parsers return None/values, never raise. Nothing takes long: adversarial inputs of
20,000 characters (what regexes with nested or adjacent quantifiers blow up on) finish well under a second.
"""

from __future__ import annotations

import io
import json
import math
import re
import time

import pytest
import scipy.optimize  # noqa: F401  (imported here, not inside a timed example: it takes seconds on a busy machine)
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from PIL import Image

from vlmrl.data import DataError, check_sample, load_file
from vlmrl.data.images import CHECKS, IMAGE_CACHE
from vlmrl.rewards import boxes, classification, parsing, textmatch, verifiable

FUZZ = settings(max_examples=80, deadline=2000, suppress_health_check=[HealthCheck.too_slow])

# --- data ---------------------------------------------------------------------------------------------------------


def _image_bytes(fmt: str, mode: str = "RGB") -> bytes:
    buffer = io.BytesIO()
    Image.effect_noise((24, 16), 40).convert(mode).save(buffer, format=fmt)
    return buffer.getvalue()


VALID_IMAGES = [_image_bytes("PNG"), _image_bytes("JPEG"), _image_bytes("GIF", "P"), _image_bytes("BMP"),
                _image_bytes("TIFF"), _image_bytes("WEBP"), _image_bytes("PNG", "RGBA"), _image_bytes("PNG", "I;16")]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz")
    (folder / "a.png").write_bytes(VALID_IMAGES[0])
    (folder / "cut.png").write_bytes(VALID_IMAGES[0][:120])  # the header decodes, the pixels do not
    (folder / "junk.png").write_bytes(b"<html>not an image</html>")
    (folder / "empty.png").write_bytes(b"")
    (folder / "img").mkdir()
    return folder


JSON_LEAVES = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)


def _json_values():
    return st.recursive(JSON_LEAVES, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)


PATHS = ["a.png", "cut.png", "junk.png", "empty.png", "missing.png", "", ".", "..", "/", "img", "img/", "x" * 300,
         "a" * 255 + "/b.png", "a\x00b.png", "\ud800.png", "~/a.png", "file:///a.png", "a.png\n"]
IMAGE_REFS = st.one_of(st.sampled_from(PATHS), st.lists(st.sampled_from(PATHS), max_size=3), _json_values(),
                       st.fixed_dictionaries({}, optional={"bytes": _json_values(), "path": st.sampled_from(PATHS)}))
SOLUTIONS = st.one_of(st.text(max_size=20), _json_values(), st.lists(st.integers() | st.floats(), min_size=4,
                      max_size=4), st.sampled_from(["<answer>3</answer>", "<answer>", " <answer> [1,2,3,4] </answer>"]))
ROWS = st.fixed_dictionaries({}, optional={
    "image": IMAGE_REFS, "images": IMAGE_REFS, "problem": st.text(max_size=10) | _json_values(), "solution": SOLUTIONS,
    "id": st.sampled_from(["x", "y", 1]) | _json_values(), "task": _json_values(), "prompt": st.text(max_size=5),
    "chosen": st.text(max_size=5), "answer_type": st.sampled_from(["number", "text", "box", "count"]) | _json_values(),
})
ADVERSARIAL_LINES = [
    b"[" * 100_000, b'{"a":' * 50_000, b'{"problem": "p", "solution": ' + b"1" * 5000 + b"}",
    b'{"problem": "p", "solution": 1e400}', b'{"problem": "p", "solution": [1e400, 0, 1, 1]}',
    b'{"problem": "p", "solution": NaN}', b'{"problem": "p", "solution": [-Infinity, 0, 1, 2]}',
    b'{"problem": "p", "solution": "1", "image": {"bytes": "abc"}}', b'\xef\xbb\xbf{"problem": "p", "solution": 2}',
    b"\xff\xfe\x00", b'{"problem": "p", "solution": "1", "image": "a.png", "images": "a.png"}', b"\x00" * 20,
    b'{"problem": "p", "solution": "<answer>' + b" " * 5000 + b'x</answer>' + b" " * 5000 + b'y"}', b"   \t  ",
    b'{"problem": "p", "solution": "1", "image": "' + b"\\ud800" + b'"}', b"\x1c\x1d\x1e\x85",
    b'{"problem": "p", "solution": [' + b"9" * 400 + b", 0, 1, 1]}",
    b'{"problem": "p", "solution": ' + b"9" * 400 + b"}",
]


def _line(row) -> bytes:
    return json.dumps(row, ensure_ascii=False).encode("utf-8", "surrogatepass")


LINES = st.one_of(ROWS.map(_line), _json_values().map(_line), st.binary(max_size=40), st.text(max_size=40).map(
    lambda t: t.encode("utf-8", "surrogatepass")), st.sampled_from(ADVERSARIAL_LINES))


FOUND = {  # what fuzzing found in the loader, as one line each
    "deep nesting": (ADVERSARIAL_LINES[0], "line 1: not usable JSON"),
    "int of 5000 digits": (ADVERSARIAL_LINES[2], "line 1: not usable JSON"),
    "inf solution": (ADVERSARIAL_LINES[3], "line 1: 'solution' must be a finite number"),
    "NaN solution": (ADVERSARIAL_LINES[5], "line 1: 'solution' must be a finite number"),
    "inf in a box": (ADVERSARIAL_LINES[4], "line 1: 'solution' box must hold 4 finite numbers"),
    "int box beyond float": (ADVERSARIAL_LINES[-2], "line 1: 'solution' box must hold 4 finite numbers"),
    "str image bytes": (ADVERSARIAL_LINES[7], "line 1: image struct 'bytes' must be bytes, got str"),
    "name too long": (b'{"problem": "p", "solution": "1", "image": "' + b"x" * 300 + b'"}', "line 1: image 'xxxx"),
}


@pytest.mark.parametrize("line, expected", FOUND.values(), ids=FOUND)
def test_loader_crashes_found_by_fuzzing_are_data_errors(workdir, line, expected):
    """Before: RecursionError, ValueError (int of > 4300 digits), OverflowError (int box), TypeError (str bytes),
    OSError (a name too long); NaN/inf solutions loaded as the text "nan"/"inf"."""
    path = workdir / "regression.jsonl"
    path.write_bytes(line + b"\n")
    with pytest.raises(DataError, match=re.escape(expected)):
        load_file(path)


def _check_loaded(samples, report, n) -> None:
    """Loaded samples follow the contract; each image decodes (RGB) or raises DataError naming its file and line."""
    assert report.loaded == len(samples) > 0 or (n == 0 and samples == [])
    assert n is None or len(samples) <= n
    assert report.skipped == len(report.problems)
    assert len({s["id"] for s in samples}) == len(samples)
    for sample in samples:
        assert isinstance(sample["solution"], str) and isinstance(sample["problem"], str)
        try:
            check_sample(sample)
        except DataError as error:
            assert str(error).startswith(sample["images"].where + ": image")


@FUZZ
@given(lines=st.lists(LINES, max_size=6), on_error=st.sampled_from(["raise", "skip"]),
       n=st.none() | st.integers(0, 4), check=st.sampled_from(CHECKS), suffix=st.sampled_from([".jsonl", ".json"]))
def test_json_lines_load_or_raise_data_errors(workdir, lines, on_error, n, check, suffix):
    path = workdir / f"data{suffix}"
    path.write_bytes(b"\n".join(lines))
    try:
        samples, report = load_file(path, on_error=on_error, n=n, check_images=check)
    except DataError:
        return
    _check_loaded(samples, report, n)


def _blank(line: bytes) -> bool:
    try:
        return not line.decode("utf-8-sig").strip()
    except UnicodeDecodeError:
        return False


@FUZZ
@given(st.lists(st.sampled_from(ADVERSARIAL_LINES) | ROWS.map(_line), min_size=1, max_size=8))
def test_every_line_is_loaded_or_skipped_and_counted(workdir, lines):
    path = workdir / "skip.jsonl"
    path.write_bytes(b"\n".join(lines))
    rows = sum(not _blank(line) for line in lines)
    try:
        samples, report = load_file(path, on_error="skip")
    except DataError as error:
        assert f"all {rows} rows are bad" in str(error) or (rows == 0 and "no rows" in str(error))
        return
    assert report.loaded + report.skipped == rows
    _check_loaded(samples, report, None)


@FUZZ
@given(items=st.lists(ROWS | _json_values(), max_size=6), on_error=st.sampled_from(["raise", "skip"]))
def test_json_arrays_load_or_raise_data_errors(workdir, items, on_error):
    path = workdir / "array.json"
    path.write_bytes(b" \n" + _line(items))
    try:
        samples, report = load_file(path, on_error=on_error)
    except DataError:
        return
    _check_loaded(samples, report, None)


def _mutated(data: bytes, draw) -> bytes:
    data = bytearray(data)
    for _ in range(draw(st.integers(1, 6))):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    return bytes(data)


@pytest.mark.filterwarnings("ignore::UserWarning")  # PIL's "Corrupt EXIF data" of a damaged TIFF
@FUZZ
@given(st.data(), st.sampled_from(VALID_IMAGES), st.sampled_from(CHECKS), st.booleans())
def test_any_image_content_decodes_or_names_file_and_line(workdir, data, valid, check, inline):
    content = data.draw(st.binary(max_size=64)) if data.draw(st.booleans()) else _mutated(valid, data.draw)
    IMAGE_CACHE.clear()
    if inline:  # parquet-style bytes in the row
        pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
        path = workdir / "images.parquet"
        pq.write_table(pa.table({"image": [content], "problem": ["p"], "solution": ["1"]}), path)
    else:
        (workdir / "img" / "fuzz.img").write_bytes(content)
        path = workdir / "images.jsonl"
        path.write_bytes(_line({"image": "img/fuzz.img", "problem": "p", "solution": "1"}))
    try:
        samples, report = load_file(path, check_images=check)
    except DataError as error:
        assert "row 0: image bytes" in str(error) or "line 1: image 'img/fuzz.img'" in str(error)
        return
    _check_loaded(samples, report, None)


COLUMN_TYPES = {
    "string": (st.text(max_size=8), "string"), "int": (st.integers(-(2**63), 2**63 - 1), "int64"),
    "float": (st.floats(), "float64"), "bool": (st.booleans(), "bool"), "binary": (st.binary(max_size=30), "binary"),
    "image_struct": (st.fixed_dictionaries({"bytes": st.none() | st.binary(max_size=30) | st.sampled_from(VALID_IMAGES),
                                            "path": st.none() | st.sampled_from(PATHS[:8])}), "struct"),
    "strings": (st.lists(st.sampled_from(PATHS[:8]), max_size=3), "list<string>"),
    "floats": (st.lists(st.floats() | st.integers(-5, 5).map(float), max_size=5), "list<double>"),
}


@FUZZ
@given(st.data(), st.integers(1, 5), st.sampled_from(["raise", "skip"]), st.none() | st.integers(0, 3))
def test_parquet_tables_load_or_raise_data_errors(workdir, data, rows, on_error, n):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    names = data.draw(st.lists(st.sampled_from(["image", "images", "problem", "solution", "id", "answer_type", "x"]),
                               unique=True, max_size=5))
    types = {"string": pa.string(), "int64": pa.int64(), "float64": pa.float64(), "bool": pa.bool_(),
             "binary": pa.binary(), "struct": pa.struct([("bytes", pa.binary()), ("path", pa.string())]),
             "list<string>": pa.list_(pa.string()), "list<double>": pa.list_(pa.float64())}
    columns = {}
    for name in names:
        values, kind = COLUMN_TYPES[data.draw(st.sampled_from(sorted(COLUMN_TYPES)))]
        cells = data.draw(st.lists(st.none() | values, min_size=rows, max_size=rows))
        columns[name] = pa.array(cells, type=types[kind])
    path = workdir / "table.parquet"
    pq.write_table(pa.table(columns) if columns else pa.table({"x": [None] * rows}), path)
    try:
        samples, report = load_file(path, on_error=on_error, n=n)
    except DataError:
        return
    _check_loaded(samples, report, n)


@settings(max_examples=40, deadline=2000)
@given(st.data())
def test_damaged_parquet_files_raise_data_errors(workdir, data):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    buffer = io.BytesIO()
    pq.write_table(pa.table({"problem": ["p"] * 40, "solution": ["1"] * 40, "image": [VALID_IMAGES[0]] * 40}), buffer)
    path = workdir / "damaged.parquet"
    path.write_bytes(_mutated(buffer.getvalue(), data.draw))
    try:
        samples, report = load_file(path, on_error="skip")
    except DataError:
        return
    _check_loaded(samples, report, None)


# --- reward parsers -----------------------------------------------------------------------------------------------

TOKENS = ["<think>", "</think>", "<answer>", "</answer>", "\\boxed{", "\\boxed", "{", "}", "\\frac", "\\dfrac{",
          "\\sqrt", "[", "]", "(", ")", ",", " ", "   ", "\n", "\t", "$", "1", "2.5", "-3", "1e5", "1,000", "3/4", "/",
          ".", "x", "a", "the", "red", "cat", "and", "or", "\u0663", "\uff13", "\u2212", "```json", "```",
          '{"bbox_2d": ',
          '"Position": ', "<|box_start|>", "<|box_end|>", "to", "-", "e", "E", "nan", "inf", "1e999", "9" * 40, "'",
          '"', "\\text{", "\\left(", "^", "**", "__import__", ".__class__", "\x00", "\ud800", "\u00e9", "A", "B)",
          "(C)", ";", "|", "=", "pi", "\\pi", "sqrt(", "\\cdot", "0", "1000", "-1e308", "1e308", "5e-324", ":",
          "9" * 400, "[1e308, 0, 1e308, 1e308]"]
TEXTS = st.one_of(st.text(max_size=200), st.lists(st.sampled_from(TOKENS), max_size=50).map("".join))


@FUZZ
@given(TEXTS, st.sampled_from(parsing.EXTRACT_MODES), st.sampled_from(["answer", "a+", "think"]), st.booleans())
def test_answer_extraction_never_raises(text, mode, tag, strict):
    conversational = [{"role": "assistant", "content": text}]
    for value in (parsing.strip_think(text), parsing.completion_text(text), parsing.completion_text(conversational)):
        assert isinstance(value, str)
    for value in (parsing.extract_tag(text, tag), parsing.extract_boxed(text), parsing.extract_last_line(text),
                  parsing.extract_answer(text, mode), parsing.match_answer_block(text, None, ("think", tag), strict),
                  parsing.match_answer_block(text, True), parsing.match_answer_block(text, False, strict=strict)):
        assert value is None or isinstance(value, str)


@FUZZ
@given(TEXTS, st.booleans())
def test_number_and_text_parsing_never_raises(text, exact):
    value = parsing.parse_number(text, exact)
    assert value is None or (isinstance(value, float) and math.isfinite(value))
    assert isinstance(parsing.normalize_text(text), str) and isinstance(parsing.to_ascii_digits(text), str)


COORDS = st.floats(allow_nan=False, allow_infinity=False) | st.integers(-10, 300).map(float)


@FUZZ
@given(TEXTS, st.sampled_from(["absolute", "normalized"]), st.none() | st.floats(0, 1e6),
       st.none() | st.integers(0, 999))
@example("[" + "9" * 400 + ", 0, 1, 1]", "absolute", None, None)  # a JSON int beyond float's range
def test_box_parsing_never_raises(text, coords, width, height):
    for box in parsing.parse_boxes(text, width, height, coords):
        assert len(box) == 4 and all(isinstance(v, float) for v in box)
        assert isinstance(parsing.box_is_valid(box, width, height, coords), bool)


@FUZZ
@given(st.lists(COORDS, min_size=4, max_size=4), st.lists(COORDS, min_size=4, max_size=4))
@example([0.0, 0.0, 1e308, 1e308], [0.0, 0.0, 1e308, 1e308])  # areas overflow: inf - inf gave a NaN GIoU
@example([0.0, 0.0, 1e-200, 1e-200], [0.0, 0.0, 1e-200, 2e-200])  # areas underflow to 0
def test_box_overlaps_are_finite_and_in_range(a, b):
    a, b = tuple(a), tuple(b)
    if not (parsing.box_is_valid(a) and parsing.box_is_valid(b)):
        return
    iou, giou = boxes.box_iou(a, b), boxes.box_giou(a, b)
    assert 0.0 <= iou <= 1.0 and -1.0 <= giou <= 1.0 and iou == boxes.box_iou(b, a)
    assert boxes.box_iou(a, a) == pytest.approx(1.0) or (a[2] - a[0]) * (a[3] - a[1]) in (0.0, math.inf)
    for matching in boxes.MATCHING:
        for score in boxes.DETECTION_SCORES:
            assert 0.0 <= boxes.detection_score([a, b], [b], 0.5, matching, score) <= 1.0


@settings(max_examples=3, deadline=None)
@given(st.lists(st.tuples(TEXTS.map(lambda t: t[:60]), st.sampled_from(["x+1", "\\frac{1}{2}", "2", "x^2"])),
                min_size=1, max_size=8))
def test_symbolic_checks_return_a_verdict_or_a_counted_failure(pairs):
    from vlmrl.rewards.mathcheck import _CACHE, symbolic_equal_many
    from vlmrl.rewards.registry import RewardFailure
    from vlmrl.rewards.safe import close_pools

    if ("x+1", "1+x", 1e-6) not in _CACHE:  # first example: a cold pool (sympy's import takes seconds) and a tight budget
        close_pools()  # they start again on use
        assert symbolic_equal_many([("x+1", "1+x")], timeout=2.0, budget=0.5) == [True]  # was: a timeout, always
    for verdict in symbolic_equal_many(pairs, timeout=2.0, budget=4.0):
        assert isinstance(verdict, (bool, RewardFailure))


SOLUTION_VALUES = st.one_of(TEXTS, st.integers(), st.floats(), st.none(), st.lists(COORDS, min_size=4, max_size=4),
                            st.lists(st.sampled_from(["3", "red", "[1, 2, 3, 4]", "x+1"]), max_size=3))
REWARDS = [  # (function, options, lowest, highest)
    (verifiable.accuracy_reward, {"symbolic": False}, 0.0, 1.0),
    (verifiable.accuracy_reward, {"symbolic": False, "strict": False, "extract": "auto"}, 0.0, 1.0),
    (verifiable.counting_reward, {"strict": False}, 0.0, 1.0),
    (boxes.iou_reward, {}, 0.0, 1.0), (boxes.giou_reward, {"coords": "normalized", "threshold": 0.5}, 0.0, 1.0),
    (boxes.detection_reward, {"matching": "hungarian", "score": "ap", "soft": True}, 0.0, 1.0),
    (boxes.detection_reward, {"strict": True}, 0.0, 1.0),
    (classification.classification_reward, {"labels": ["cat", "dog", "dark red"], "strict": False}, 0.0, 1.0),
    (classification.classification_reward, {"synonyms": {"car": ["auto"]}}, 0.0, 1.0),
    (textmatch.exact_match_reward, {}, 0.0, 1.0), (textmatch.token_f1_reward, {"strict": False}, 0.0, 1.0),
    (textmatch.bleu_reward, {"extract": "auto", "strict": False}, 0.0, 1.0), (textmatch.rouge_l_reward, {}, 0.0, 1.0),
]


@FUZZ
@given(st.data(), st.integers(1, 4))
def test_rewards_return_none_or_a_finite_score_in_range(data, n):
    completions = data.draw(st.lists(TEXTS | TEXTS.map(lambda t: [{"role": "assistant", "content": t}]),
                                     min_size=n, max_size=n))
    columns = {
        "solution": data.draw(st.lists(SOLUTION_VALUES, min_size=n, max_size=n)),
        "answer_type": data.draw(st.lists(st.sampled_from(["number", "text", "box", "math", "choice"]), min_size=n,
                                          max_size=n)),
        "width": data.draw(st.lists(st.none() | st.integers(0, 500), min_size=n, max_size=n)),
        "height": data.draw(st.lists(st.none() | st.integers(0, 500) | st.floats(0, 1e9), min_size=n, max_size=n)),
        "completion_truncated": data.draw(st.lists(st.booleans(), min_size=n, max_size=n)),
    }
    if data.draw(st.booleans()):
        columns["options"] = data.draw(st.lists(st.none() | st.lists(TEXTS, max_size=3), min_size=n, max_size=n))
    for fn, options, low, high in REWARDS:
        scores = fn(completions, **{**columns, **options})
        assert len(scores) == n, fn.__name__
        for score, solution in zip(scores, columns["solution"], strict=True):
            assert score is None or (isinstance(score, float) and low <= score <= high), (fn.__name__, score)
            if verifiable.is_missing(solution):
                assert score is None, (fn.__name__, solution, score)  # no ground truth: nothing to pay
    assert verifiable.format_reward(completions, think=data.draw(st.booleans())) != [None] * n
    assert all(-1.0 <= s <= 0.0 for s in verifiable.length_penalty(completions, max_length=50, cache_length=20,
                                                                    min_length=10))


def test_a_missing_solution_pays_nothing():
    """Regressions found by the property above: a missing solution was read as the text "None" (accuracy,
    classification) or as "no objects" (detection, also for a text or number solution), paying an answer for it."""
    assert verifiable.accuracy_reward(["<answer>None</answer>", "<answer>nan</answer>"], [None, math.nan]) == [None] * 2
    assert classification.classification_reward(["<answer>none</answer>"], [None]) == [None]
    empty = ["<answer></answer>"] * 4
    assert boxes.detection_reward(empty, [None, "red", 5, {"note": 1}]) == [None] * 4
    assert boxes.detection_reward(empty, ["", "[]", [], ()]) == [1.0] * 4  # "no objects" still pays no box


ADVERSARIAL = [  # (what, function, input): nested/adjacent quantifiers over a long run of one character
    ("frac, spaces", parsing.parse_number, "\\frac{" + " " * 1500),  # the old regex: cubic, ~10 s
    ("frac, spaces in both groups", parsing.parse_number, "\\frac{ " + " " * 1500 + "}{" + " " * 1500),
    ("point pair, spaces", parsing.parse_boxes, "(1,2)" + " " * 20000 + "x"),
    ("json fence, spaces", parsing.parse_boxes, "a" + " " * 20000 + "b"),
    ("json fence, newlines", parsing.parse_boxes, "[" + "\n" * 20000 + "x"),
    ("qwen box", lambda t: parsing.parse_boxes(t, 9, 9), "<|box_start|>(1, " + " " * 20000),
    ("number, spaces", parsing.parse_number, "1" + " " * 20000 + "/x"),
    ("number, commas", parsing.parse_number, "1," * 10000),
    ("answer tags", parsing.extract_tag, "<answer>" * 2500),
    ("answer block", lambda t: parsing.match_answer_block(t, None, strict=False), "<think>" + " " * 20000),
    ("answer block strict", parsing.match_answer_block, " " * 20000 + "<answer>"),
    ("boxed", parsing.extract_boxed, "\\boxed" + " " * 20000),
    ("normalize, dollars", parsing.normalize_text, "$" * 20000),
    ("normalize, wrappers", parsing.normalize_text, "\\boxed{" * 2500 + "}" * 2500),
    ("classification", lambda t: classification.classification_reward([t], ["cat"], labels=["cat"], strict=False),
     "cat " + " ,  " * 5000),
    ("choice", lambda t: verifiable.choice_index(t, ["a", "b"]), "(A)" + " " * 20000 + "."),
]


@pytest.mark.parametrize("what, fn, text", ADVERSARIAL, ids=[a[0] for a in ADVERSARIAL])
def test_adversarial_inputs_take_well_under_a_second(what, fn, text):
    start = time.perf_counter()
    fn(text)
    assert time.perf_counter() - start < 1.0, what
