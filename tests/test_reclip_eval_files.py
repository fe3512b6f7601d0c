"""`vlmrl reclip eval --zeroshot / --captions`: zero-shot classification of an image folder and image-text retrieval
on caption files, on hand-made folders and a stub student whose embeddings are tables, so every number is worked by
hand; then the command end to end on the embedded student."""

import json

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from vlmrl.errors import DataError
from vlmrl.eval.metrics import wilson_interval
from vlmrl.reclip.evaluate import Encoder, class_text_embeddings
from vlmrl.reclip.retrieval import caption_retrieval, multi_caption_ranks, read_caption_file
from vlmrl.reclip.twotower import TwoTower
from vlmrl.reclip.zeroshot import class_ranks, image_folder, read_classes, read_templates, zero_shot_classification


class TableStudent(TwoTower):
    """Embeds an image by its top-left pixel's colour and a text by its exact string, both through tables; an
    unknown colour or text is a KeyError, so a prompt formatted wrongly fails loudly."""

    kind = "table"

    def __init__(self, images: dict, texts: dict):
        super().__init__()
        self.image_table, self.text_table = images, texts

    def image_inputs(self, images):
        return torch.tensor([self.image_table[im.getpixel((0, 0))] for im in images], dtype=torch.float)

    def embed_images(self, inputs):
        return F.normalize(inputs, dim=-1)

    def text_inputs(self, texts):
        return {"vec": torch.tensor([self.text_table[t] for t in texts], dtype=torch.float)}

    def embed_texts(self, inputs):
        return F.normalize(inputs["vec"], dim=-1)


def solid(path, rgb):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (4, 4), rgb).save(path)


def one_hot(i, n=7):
    return [1.0 if j == i else 0.0 for j in range(n)]


# --- zero-shot ------------------------------------------------------------------------------------------------------

CLASSES = ["blue", "cyan", "dark_grey", "green", "magenta", "red", "yellow"]  # sorted: the class indices
NAMES = [c.replace("_", " ") for c in CLASSES]
RED, GREEN, BLUE = CLASSES.index("red"), CLASSES.index("green"), CLASSES.index("blue")


def colour_folder(root):
    """7 classes; 5 images that load, one that does not, one non-image file, four classes without images.
    Ranks of the true class (classes scored above it): red/a 0, red/b 1 (green above), green/c 0, green/d 6 (every
    other class above), blue/e 0."""
    for c in CLASSES:
        (root / c).mkdir(parents=True)
    solid(root / "red" / "a.png", (255, 0, 0))
    solid(root / "red" / "b.png", (200, 0, 0))
    solid(root / "green" / "c.png", (0, 255, 0))
    solid(root / "green" / "d.PNG", (0, 200, 0))  # suffixes match in any case
    solid(root / "blue" / "e.png", (0, 0, 255))
    (root / "blue" / "broken.png").write_bytes(b"not a png")
    (root / "blue" / "notes.txt").write_text("not an image")
    images = {(255, 0, 0): one_hot(RED), (200, 0, 0): [{GREEN: 1.0, RED: 0.5}.get(j, 0.0) for j in range(7)],
              (0, 255, 0): one_hot(GREEN), (0, 200, 0): [0.0 if j == GREEN else 1.0 for j in range(7)],
              (0, 0, 255): one_hot(BLUE)}
    texts = {f"a photo of a {name}.": one_hot(i) for i, name in enumerate(NAMES)}
    return TableStudent(images, texts)


def test_zero_shot_top1_top5_per_class_and_intervals_worked_by_hand(tmp_path):
    student = colour_folder(tmp_path / "val")
    (tmp_path / "templates.txt").write_text("# one template\n\na photo of a {}.\n")
    data = image_folder(tmp_path / "val")
    assert data.names == NAMES and data.ignored_files == ["blue/notes.txt"]
    res = zero_shot_classification(student, data, read_templates(tmp_path / "templates.txt"), batch_size=2)
    assert res["n"] == 5 and res["classes"] == 7 and res["skipped_images"] == 1
    assert res["skipped"][0]["path"].endswith("broken.png")
    assert res["top1"] == pytest.approx(3 / 5) and res["top5"] == pytest.approx(4 / 5)  # ranks 0, 1, 0, 6, 0
    assert (res["top1_ci_low"], res["top1_ci_high"]) == pytest.approx(wilson_interval(3, 5))
    assert (res["top5_ci_low"], res["top5_ci_high"]) == pytest.approx(wilson_interval(4, 5))
    per = res["per_class"]
    assert per["red"] == {"folder": "red", "n": 2, "top1": 0.5, "top5": 1.0}
    assert per["green"] == {"folder": "green", "n": 2, "top1": 0.5, "top5": 0.5}
    assert per["blue"] == {"folder": "blue", "n": 1, "top1": 1.0, "top5": 1.0}
    assert per["dark grey"] == {"folder": "dark_grey", "n": 0, "top1": None, "top5": None}
    assert res["per_class_mean_top1"] == pytest.approx((0.5 + 0.5 + 1.0) / 3)


def test_templates_are_averaged_normalised_then_renormalised(tmp_path):
    # cat's two prompts point along x and y, dog's both along (0.6, 0.8). The cat image (0.8, 0.6) is closest to cat's
    # ensemble (0.707, 0.707): 0.990 > 0.96; by the first template alone (0.8 < 0.96) or the mean left unnormalised
    # ((0.5, 0.5): 0.7 < 0.96) it would be a dog.
    solid(tmp_path / "val" / "cat" / "1.png", (10, 10, 10))
    solid(tmp_path / "val" / "dog" / "1.png", (20, 20, 20))
    texts = {"a photo of a cat.": [1.0, 0.0], "a drawing of a cat.": [0.0, 1.0], "a photo of a dog.": [0.6, 0.8],
             "a drawing of a dog.": [0.6, 0.8]}
    student = TableStudent({(10, 10, 10): [0.8, 0.6], (20, 20, 20): [0.6, 0.8]}, texts)
    templates = ["a photo of a {}.", "a drawing of a {}."]
    emb = class_text_embeddings(Encoder(student, []), ["cat", "dog"], templates)
    assert torch.allclose(emb, torch.tensor([[2 ** -0.5, 2 ** -0.5], [0.6, 0.8]]))
    data = image_folder(tmp_path / "val")
    assert zero_shot_classification(student, data, templates)["top1"] == 1.0
    assert zero_shot_classification(student, data, templates[:1])["top1"] == 0.5
    assert "top5" not in zero_shot_classification(student, data, templates)  # 2 classes: top-5 means nothing


def test_class_ranks_break_ties_like_argmax():
    scores = torch.tensor([[0.5, 0.5, 0.1], [0.5, 0.5, 0.1], [0.2, 0.2, 0.2], [0.2, 0.2, 0.2]])
    assert class_ranks(scores, torch.tensor([0, 1, 0, 2])).tolist() == [0, 1, 0, 2]  # a constant model is not 100%


def test_classes_file_names_the_folders_and_layout_errors_say_what_to_fix(tmp_path):
    solid(tmp_path / "val" / "n01" / "1.png", (1, 2, 3))
    solid(tmp_path / "val" / "n02" / "1.png", (1, 2, 3))
    (tmp_path / "classes.yaml").write_text("n01: golden retriever\nn02: tabby cat\nn99: unused\n")
    assert image_folder(tmp_path / "val", read_classes(tmp_path / "classes.yaml")).names == ["golden retriever",
                                                                                            "tabby cat"]
    (tmp_path / "short.json").write_text(json.dumps({"n01": "dog"}))
    with pytest.raises(DataError, match="'n02' has no name"):
        image_folder(tmp_path / "val", read_classes(tmp_path / "short.json"))
    (tmp_path / "same.json").write_text(json.dumps({"n01": "dog", "n02": "dog"}))
    with pytest.raises(DataError, match="share the name 'dog'"):
        image_folder(tmp_path / "val", read_classes(tmp_path / "same.json"))
    (tmp_path / "bad.txt").write_text("a photo of a {}.\na photo\n")
    with pytest.raises(DataError, match="bad.txt line 2"):
        read_templates(tmp_path / "bad.txt")
    with pytest.raises(DataError, match="no class folders"):
        image_folder(tmp_path / "val" / "n01")


# --- retrieval ------------------------------------------------------------------------------------------------------

# images I0 red -> x, I1 green -> y, I2 blue -> z; I3 does not decode, I4 is missing (both skipped with 3 captions)
RET_IMAGES = {(255, 0, 0): [1.0, 0.0, 0.0], (0, 255, 0): [0.0, 1.0, 0.0], (0, 0, 255): [0.0, 0.0, 1.0]}
RET_TEXTS = {"a red square": [1.0, 0.0, 0.0], "a reddish green thing": [0.6, 0.8, 0.0],  # I0's
             "a dull blob": [0.48, 0.36, 0.8], "a green square": [0.0, 0.6, 0.8],  # I1's
             "a blue square": [0.0, 0.0, 1.0]}  # I2's
ROWS = [("red.png", ["a red square", "a reddish green thing"]), ("green.png", ["a dull blob", "a green square"]),
        ("blue.png", ["a blue square"]), ("broken.jpg", ["x", "y"]), ("gone.png", ["z"])]


def caption_folder(root):
    solid(root / "img" / "red.png", (255, 0, 0))
    solid(root / "img" / "green.png", (0, 255, 0))
    solid(root / "img" / "blue.png", (0, 0, 255))
    (root / "img" / "broken.jpg").write_bytes(b"\xff\xd8 truncated")
    path = root / "captions.jsonl"
    path.write_text("".join(json.dumps({"image": f"img/{im}", "captions": caps}) + "\n" for im, caps in ROWS))
    return path


def test_retrieval_recalls_both_ways_worked_by_hand(tmp_path):
    # t2i (rank = images strictly more similar than the caption's own image):
    #   red square 0; reddish green: I0 .6 < I1 .8 -> 1; dull blob: I1 .36 < I0 .48, I2 .8 -> 2; green square:
    #   I1 .6 < I2 .8 -> 1; blue square 0                             => R@1 2/5, R@2 4/5, R@3 5/5 (over 5 captions)
    # i2t (rank = captions strictly more similar than the image's best own caption):
    #   I0: red square 1.0 -> 0; I1: best own .6 (green square, its second) < reddish green .8 -> 1 (by its first,
    #   dull blob .36, it would be 2); I2: blue square 1.0 -> 0        => R@1 2/3, R@2 3/3 (over 3 images)
    student = TableStudent(RET_IMAGES, RET_TEXTS)
    res = caption_retrieval(student, read_caption_file(caption_folder(tmp_path)), ks=(1, 2, 3), batch_size=2)
    assert (res["images"], res["captions"], res["skipped_images"], res["skipped_captions"]) == (3, 5, 2, 3)
    assert sorted(s["path"].rsplit("/", 1)[1] for s in res["skipped"]) == ["broken.jpg", "gone.png"]
    assert [res[f"t2i/R@{k}"] for k in (1, 2, 3)] == pytest.approx([2 / 5, 4 / 5, 1.0])
    assert [res[f"i2t/R@{k}"] for k in (1, 2, 3)] == pytest.approx([2 / 3, 1.0, 1.0])
    assert (res["t2i/R@1_ci_low"], res["t2i/R@1_ci_high"]) == pytest.approx(wilson_interval(2, 5))  # over captions
    assert (res["i2t/R@1_ci_low"], res["i2t/R@1_ci_high"]) == pytest.approx(wilson_interval(2, 3))  # over images


def test_multi_caption_ranks_chunked_equal_whole():
    g = torch.Generator().manual_seed(0)
    images = F.normalize(torch.randn(7, 5, generator=g), dim=-1)
    texts = F.normalize(torch.randn(16, 5, generator=g), dim=-1)
    owners = torch.tensor([0, 0, 1, 2, 2, 2, 3, 4, 4, 5, 6, 6, 1, 3, 5, 0])
    whole = multi_caption_ranks(images, texts, owners)
    parts = multi_caption_ranks(images, texts, owners, chunk=3)
    assert all(torch.equal(a, b) for a, b in zip(whole, parts, strict=True))
    sim = images @ texts.T
    for j in range(16):  # t2i by the definition, one caption at a time
        assert whole[1][j] == (sim[:, j] > sim[owners[j], j]).sum()


def test_karpathy_json_reads_like_the_jsonl(tmp_path):
    caption_folder(tmp_path)
    entries = [{"filepath": "img", "filename": im, "split": "test", "sentences": [{"raw": c} for c in caps]}
               for im, caps in ROWS]
    entries[4]["sentences"] = [{"tokens": ["z"]}]  # no raw: the tokens, joined
    entries.append({"filepath": "img", "filename": "red.png", "split": "train", "sentences": [{"raw": "train only"}]})
    (tmp_path / "dataset_coco.json").write_text(json.dumps({"dataset": "coco", "images": entries}))
    karpathy = read_caption_file(tmp_path / "dataset_coco.json")
    jsonl = read_caption_file(tmp_path / "captions.jsonl")
    assert (karpathy.paths, karpathy.captions) == (jsonl.paths, jsonl.captions)
    assert len(read_caption_file(tmp_path / "dataset_coco.json", split="all").paths) == 6
    with pytest.raises(DataError, match=r"no images in split 'val' \(splits in the file: \['test', 'train'\]\)"):
        read_caption_file(tmp_path / "dataset_coco.json", split="val")
    student = TableStudent(RET_IMAGES, RET_TEXTS)
    assert caption_retrieval(student, karpathy, ks=(1,))["t2i/R@1"] == pytest.approx(2 / 5)


def test_caption_file_errors_name_the_line(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"image": "a.png", "captions": ["ok"]}) + "\n" + json.dumps({"image": "b.png",
                                                                                             "captions": "one"}) + "\n")
    with pytest.raises(DataError, match=r"c.jsonl line 2: 'captions' must be a non-empty list"):
        read_caption_file(path)
    path.write_text(json.dumps({"image": "gone.png", "captions": ["x"]}) + "\n")
    with pytest.raises(DataError, match="none of its 1 images could be loaded"):
        caption_retrieval(TableStudent({}, {}), read_caption_file(path))


# --- the command ----------------------------------------------------------------------------------------------------


def test_cli_eval_on_folders_with_the_embedded_student(tmp_path, capsys):
    pytest.importorskip("efficientnet_lite_pytorch")
    from vlmrl.cli import main
    from vlmrl.reclip.embedded import EmbeddedConfig, EmbeddedStudent

    torch.set_num_threads(1)
    EmbeddedStudent.build(EmbeddedConfig(embed_dim=8), seed=0).save_pretrained(tmp_path / "student")
    for i, (name, rgb) in enumerate([("red", (255, 0, 0)), ("blue", (0, 0, 255))]):
        solid(tmp_path / "val" / name / f"{i}.png", rgb)
    path = tmp_path / "caps.jsonl"
    path.write_text(json.dumps({"image": "val/red/0.png", "captions": ["a red square", "red"]}) + "\n"
                    + json.dumps({"image": "val/blue/1.png", "captions": ["a blue square"]}) + "\n")
    out = tmp_path / "eval.json"
    args = ["reclip", "eval", str(tmp_path / "student"), "--zeroshot", str(tmp_path / "val"), "--captions", str(path),
            "--out", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "top-1" in printed and "i2t" in printed and "t2i" in printed
    res = json.loads(out.read_text())
    zs, ret = res["zeroshot"], res["retrieval"]
    assert {"top1", "top1_ci_low", "top1_ci_high", "per_class", "per_class_mean_top1", "skipped_images"} <= set(zs)
    assert set(zs["per_class"]) == {"red", "blue"} and zs["n"] == 2 and len(zs["templates"]) == 7
    assert {f"{w}/R@{k}{x}" for w in ("i2t", "t2i") for k in (1, 5, 10) for x in ("", "_ci_low", "_ci_high")} <= set(ret)
    assert (ret["images"], ret["captions"], ret["skipped_images"]) == (2, 3, 0)
    assert main(["reclip", "eval", str(tmp_path / "student"), "--classes", "x.yaml"]) == 2
    assert "--classes goes with --zeroshot" in capsys.readouterr().err
