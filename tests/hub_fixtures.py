"""Small datasets in the published schema of each hub dataset vlmrl's benchmarks and seed recipes read (column names,
feature types, image encoding, split names), saved with `save_to_disk` by the tests themselves: no hub access.

Each builder returns the folder of a DatasetDict with the dataset's split names; the rows are made up, the schema is
the published one (the docstring of each builder names the dataset card it copies).
"""

from __future__ import annotations

import io
from pathlib import Path

from PIL import Image, ImageDraw


def png(width: int = 64, height: int = 48, seed: int = 0, box: tuple | None = None) -> bytes:
    """A small PNG: a coloured background, and a filled rectangle at `box` (x1, y1, x2, y2) if given."""
    image = Image.new("RGB", (width, height), ((40 * seed) % 256, (90 + 30 * seed) % 256, 160))
    if box is not None:
        ImageDraw.Draw(image).rectangle(box, fill=(250, 20, 20))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _save(folder: Path, splits: dict, features) -> Path:
    import datasets

    dd = datasets.DatasetDict({name: datasets.Dataset.from_dict(rows, features=features)
                               for name, rows in splits.items()})
    dd.save_to_disk(str(folder))
    return folder


def image_struct(data: bytes, name: str) -> dict:
    return {"bytes": data, "path": name}


def mathvista(root: Path) -> Path:
    """AI4Math/MathVista: splits testmini and test; `decoded_image` an Image, `image` its path, `choices` a list of
    strings (null for free-form), `precision` a float (null unless a float answer), `metadata` a struct."""
    import datasets as ds

    meta = ds.Features({"category": ds.Value("string"), "context": ds.Value("string"), "grade": ds.Value("string"),
                        "img_height": ds.Value("int64"), "img_width": ds.Value("int64"),
                        "language": ds.Value("string"), "skills": ds.Sequence(ds.Value("string")),
                        "source": ds.Value("string"), "split": ds.Value("string"), "task": ds.Value("string")})
    features = ds.Features({"pid": ds.Value("string"), "question": ds.Value("string"), "image": ds.Value("string"),
                            "decoded_image": ds.Image(), "choices": ds.Sequence(ds.Value("string")),
                            "unit": ds.Value("string"), "precision": ds.Value("float64"), "answer": ds.Value("string"),
                            "question_type": ds.Value("string"), "answer_type": ds.Value("string"),
                            "metadata": meta, "query": ds.Value("string")})
    rows = [  # (question, choices, unit, precision, answer, qtype, atype, task, skills)
        ("Which is larger?", ["larger than", "equal to", "smaller than"], None, None, "equal to", "multi_choice",
         "text", "figure question answering", ["algebraic reasoning"]),
        ("How many red blocks?", None, None, None, "3", "free_form", "integer", "math word problem",
         ["arithmetic reasoning"]),
        ("Find the length.", None, "cm", 1.0, "2.5", "free_form", "float", "geometry problem solving",
         ["geometry reasoning", "algebraic reasoning"]),
        ("Pick the angle.", ["30", "45", "60", "90"], None, None, "45", "multi_choice", "text",
         "geometry problem solving", ["geometry reasoning"]),
    ]
    table: dict[str, list] = {k: [] for k in features}
    for i, (q, choices, unit, precision, answer, qtype, atype, task, skills) in enumerate(rows):
        hint = ("Hint: Please answer the question and provide the correct option letter, e.g., A, B, C, D, at the "
                "end." if qtype == "multi_choice" else "Hint: Please answer the question requiring an integer "
                "answer and provide the final value, e.g., 1, 2, 3, at the end.")
        choice_text = "\nChoices:\n" + "\n".join(f"({chr(65 + j)}) {c}" for j, c in enumerate(choices)) \
            if choices else ""
        table["pid"].append(str(i + 1))
        table["question"].append(q)
        table["image"].append(f"images/{i + 1}.jpg")
        table["decoded_image"].append(image_struct(png(seed=i), f"{i + 1}.png"))
        table["choices"].append(choices)
        table["unit"].append(unit)
        table["precision"].append(precision)
        table["answer"].append(answer)
        table["question_type"].append(qtype)
        table["answer_type"].append(atype)
        table["metadata"].append({"category": "math-targeted-vqa", "context": "synthetic scene", "grade": "daily life",
                                  "img_height": 48, "img_width": 64, "language": "english", "skills": skills,
                                  "source": "fixture", "split": "testmini", "task": task})
        table["query"].append(f"{hint}\nQuestion: {q}{choice_text}")
    return _save(root / "mathvista", {"testmini": table, "test": table}, features)


def mathverse(root: Path) -> Path:
    """AI4Math/MathVerse, config testmini: split testmini (3,940 rows); `image` an Image; `metadata` {split, source,
    subject, subfield}; `query_wo`, `query_cot`, `question_for_eval` strings (MathVerse's README and
    output_templates/output_testmini.json; `question_for_eval` added on the hub in April 2024)."""
    import datasets as ds

    features = ds.Features({"sample_index": ds.Value("string"), "problem_index": ds.Value("string"),
                            "problem_version": ds.Value("string"), "question": ds.Value("string"),
                            "image": ds.Image(), "answer": ds.Value("string"), "question_type": ds.Value("string"),
                            "metadata": {"split": ds.Value("string"), "source": ds.Value("string"),
                                         "subject": ds.Value("string"), "subfield": ds.Value("string")},
                            "query_wo": ds.Value("string"), "query_cot": ds.Value("string"),
                            "question_for_eval": ds.Value("string")})
    rows = [("1", "Text Dominant", "multi-choice", "B", "Plane Geometry"),
            ("2", "Vision Only", "free-form", "\\frac{1}{2}", "Functions"),
            ("3", "Text Lite", "free-form", "25", "Plane Geometry")]
    table: dict[str, list] = {k: [] for k in features}
    for i, (problem, version, qtype, answer, subject) in enumerate(rows):
        table["sample_index"].append(str(i + 1))
        table["problem_index"].append(problem)
        table["problem_version"].append(version)
        table["question"].append("As shown in the figure, find x.")
        table["image"].append(image_struct(png(seed=i + 3), f"{i}.png"))
        table["answer"].append(answer)
        table["question_type"].append(qtype)
        table["metadata"].append({"split": "testmini", "source": "GeoQA", "subject": subject, "subfield": "Length"})
        ask = ("provide the correct option letter, e.g., A, B, C, D" if qtype == "multi-choice"
               else "provide the final value, e.g., 1, 2.5, 300")  # the columns' published form (output_testmini.json)
        table["query_wo"].append(f"Please directly answer the question and {ask}.\nQuestion: find x.")
        table["query_cot"].append(f"Please first conduct reasoning, and then answer the question and {ask}, at the "
                                  "end.\nQuestion: find x.")
        table["question_for_eval"].append("find x.")
    return _save(root / "mathverse", {"testmini": table}, features)


def geometry3k(root: Path) -> Path:
    """hiyouga/geometry3k as its dataset card gives the features: splits train, validation, test (2,101 / 300 / 601
    rows); `images` a list of Images, `problem` with `<image>`, `answer` a string, `id` an int64, `choices` a list
    of strings, `ground_truth` a string (here the right choice's letter: what the card's column holds is unconfirmed;
    vlmrl reads `images`, `problem` and `answer` only)."""
    import datasets as ds

    features = ds.Features({"images": ds.Sequence(ds.Image()), "problem": ds.Value("string"),
                            "answer": ds.Value("string"), "id": ds.Value("int64"),
                            "choices": ds.Sequence(ds.Value("string")), "ground_truth": ds.Value("string")})
    table = {"images": [[image_struct(png(seed=i + 5), f"g{i}.png")] for i in range(3)],
             "problem": ["<image>Find x.", "<image>Find the area of the triangle.", "<image>Find y."],
             "answer": ["3\\sqrt{2}", "24", "\\frac{7}{2}"], "id": [2948, 2101, 17],
             "choices": [["3\\sqrt{2}", "6", "9", "18"], ["12", "24", "36", "48"], ["\\frac{7}{2}", "4", "5", "7"]],
             "ground_truth": ["A", "B", "A"]}
    return _save(root / "geometry3k", {"train": table, "validation": table, "test": table}, features)


def superclevr(root: Path) -> Path:
    """jigsaw-r1/super_clevr (R1-V's superclevr_test200_counting_problems.jsonl with its images, as packaged for
    Jigsaw-R1): one parquet file as split test, read by Jigsaw-R1's utils/utils.py through the columns `image`,
    `question` and `ground_truth`. The feature types are unconfirmed (the card lists no features and its only
    modality is text, so `image` may be encoded bytes rather than an Image); here `image` is an Image and
    `ground_truth` an int64 as in R1-V's jsonl (the benchmark also accepts a digit string)."""
    import datasets as ds

    features = ds.Features({"image": ds.Image(), "question": ds.Value("string"), "ground_truth": ds.Value("int64")})
    table = {"image": [image_struct(png(seed=i + 7), f"s{i}.png") for i in range(3)],
             "question": ["How many items are there in the image?", "How many cars are there?",
                          "How many bicycles are there?"],
             "ground_truth": [5, 2, 0]}
    return _save(root / "superclevr", {"test": table}, features)


def refcoco(root: Path, name: str = "refcoco", splits: tuple = ("val", "test", "testA", "testB")) -> Path:
    """lmms-lab/RefCOCO (also RefCOCOplus, RefCOCOg), as their dataset cards give the features: splits val, test, testA,
    testB (RefCOCOplus val/testA/testB, RefCOCOg val/test); `question_id` a string, `image` an Image, `question` a
    string, `answer` the referring expressions (a list of strings), `segmentation` and `bbox` ([x, y, w, h]) lists of
    float32, `iscrowd` an int8, `file_name` a string."""
    import datasets as ds

    features = ds.Features({"question_id": ds.Value("string"), "image": ds.Image(), "question": ds.Value("string"),
                            "answer": ds.Sequence(ds.Value("string")), "segmentation": ds.Sequence(ds.Value("float32")),
                            "bbox": ds.Sequence(ds.Value("float32")), "iscrowd": ds.Value("int8"),
                            "file_name": ds.Value("string")})
    boxes = [(10.0, 8.0, 30.0, 20.0), (2.0, 2.0, 20.0, 40.0)]
    table = {"question_id": ["100", "101"],
             "image": [image_struct(png(box=(x, y, x + w, y + h), seed=9), f"r{i}.png")
                       for i, (x, y, w, h) in enumerate(boxes)],
             "question": ["Please carefully observe the area circled in the image and come up with a caption for the "
                          "area."] * 2,
             "answer": [["red block", "the block on the right"], ["left red bar"]],
             "segmentation": [[10.0, 8.0, 40.0, 8.0, 40.0, 28.0], [2.0, 2.0, 22.0, 42.0]],
             "bbox": [list(b) for b in boxes], "iscrowd": [0, 0],
             "file_name": ["COCO_train2014_000000000001.jpg", "COCO_train2014_000000000002.jpg"]}
    return _save(root / name, {split: table for split in splits}, features)


def vstar(root: Path) -> Path:
    """craigwu/vstar_bench as its repository holds it: test_questions.jsonl (split test; `image` the image's path in
    the repository, `text` the question with options, `category`, `question_id` an int, `label` the right letter)
    beside the folders direct_attributes/ and relative_position/ of JPEGs, each with a JSON annotation."""
    import json

    folder = root / "vstar"
    suffix = "\nAnswer with the option's letter from the given choices directly."
    rows = [("direct_attributes/sa_1.jpg", "What is the color of the cup?\n(A) red\n(B) blue\n(C) green\n(D) white",
             "direct_attributes", "A"),
            ("relative_position/sa_2.jpg", "Is the dog on the left or right of the cat?\n(A) left\n(B) right",
             "relative_position", "B"),
            ("direct_attributes/sa_3.jpg", "What is the material of the glove?\n(A) rubber\n(B) cotton\n(C) leather"
             "\n(D) wool", "direct_attributes", "C")]
    lines = []
    for i, (path, text, category, label) in enumerate(rows):
        image = folder / path
        image.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (96, 80), (30 * i, 120, 200)).save(image, format="JPEG")
        image.with_suffix(".json").write_text(json.dumps({"target_object": ["cup"], "bbox": [[10, 10, 20, 20]],
                                                          "question": text.split("\n")[0], "options": ["x", "y"]}))
        lines.append(json.dumps({"image": path, "text": text + suffix, "category": category, "question_id": i,
                                 "label": label}))
    (folder / "test_questions.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def virft_classification(root: Path) -> Path:
    """laolao77/ViRFT_CLS_flower_4_shot (Visual-RFT's few-shot classification: 102 classes x 4 = 408 rows): split
    train; `image` an Image (Visual-RFT's dataset/build_dataset.ipynb converts images to RGBA), `problem` the whole
    prompt (Visual-RFT's grpo_classification.py adds nothing to it; its wording here follows the classification
    eval script's, the dataset's own is unconfirmed), `solution` "<answer>label</answer>"."""
    import datasets as ds

    features = ds.Features({"image": ds.Image(), "problem": ds.Value("string"), "solution": ds.Value("string")})
    labels = ["pink primrose", "globe-flower", "sunflower", "sweet pea"]
    rgba = []
    for i in range(4):
        out = io.BytesIO()
        Image.open(io.BytesIO(png(seed=i))).convert("RGBA").save(out, format="PNG")
        rgba.append(image_struct(out.getvalue(), f"f{i}.png"))
    table = {"image": rgba,
             "problem": ["This is an image containing a flower. Please identify the species of the flower based on the "
                         "image.\nOutput the thinking process in <think> </think> and final answer in <answer> </answer> "
                         "tags.The output answer format should be as follows:\n<think> ... </think> <answer>species "
                         "name</answer>\nPlease strictly follow the format."] * 4,
             "solution": [f"<answer>{label}</answer>" for label in labels]}
    return _save(root / "virft_cls", {"train": table}, features)


def clevr_counting(root: Path) -> Path:
    """leonardPKU/clevr_cogen_a_train (R1-V's CLEVR-70k counting, 70,000 rows): split train; `image` an Image,
    `problem` ("How many items are there in the image?"), `solution` "<answer> N </answer>" (the row ms-swift's GRPO
    guide shows; R1-V's grpo.py reads exactly these three columns)."""
    import datasets as ds

    features = ds.Features({"image": ds.Image(), "problem": ds.Value("string"), "solution": ds.Value("string")})
    table = {"image": [image_struct(png(seed=i + 2), f"c{i}.png") for i in range(4)],
             "problem": ["How many items are there in the image?"] * 4,
             "solution": [f"<answer> {n} </answer>" for n in (3, 5, 2, 7)]}
    return _save(root / "clevr", {"train": table}, features)


BUILDERS = {"mathvista": mathvista, "mathverse": mathverse, "geometry3k": geometry3k, "superclevr": superclevr,
            "refcoco": refcoco, "refcoco+": lambda root: refcoco(root, "refcocoplus", ("val", "testA", "testB")),
            "refcocog": lambda root: refcoco(root, "refcocog", ("val", "test")), "vstar": vstar}
