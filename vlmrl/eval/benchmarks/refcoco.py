"""RefCOCO, RefCOCO+ and RefCOCOg referring-expression grounding: accuracy at IoU > 0.5.

Sources: Kazemzadeh et al., "ReferItGame", EMNLP 2014 and Yu et al., "Modeling Context in Referring Expressions",
ECCV 2016 (RefCOCO, RefCOCO+); Mao et al., "Generation and Comprehension of Unambiguous Object Descriptions", CVPR
2016 (RefCOCOg, umd split). Data: lmms-lab/RefCOCO, lmms-lab/RefCOCOplus, lmms-lab/RefCOCOg (their dataset cards:
one row per object, `question_id` string, `image` Image, `question` string, `answer` = the object's referring
expressions as a list of strings, `segmentation` and `bbox` = [x, y, w, h] in COCO pixels as lists of float32,
`iscrowd` int8, `file_name` string; splits RefCOCO val 8,811 / test 5,000 / testA 1,975 / testB 1,810 rows, RefCOCO+
val 3,805 / testA 1,975 / testB 1,798, RefCOCOg val 7,573 / test 5,023 rows in the current card).

Protocol: VLM-R1 (github.com/om-ai-lab/VLM-R1, src/eval/test_rec_r1.py, checked at commit 90052f4): greedy decoding,
256 new tokens, the question template "{Question} First output the thinking process in <think> </think> tags and
then output the final answer in <answer> </answer> tags. Output the final answer in JSON format.", the box read
from the `<answer>` block only (no block, no box: the sample is wrong), right when its IoU with the true box is
> 0.5 (strictly). VLM-R1's `{Question}` is the `problem` field of its own annotation files (rec_jsons_processed,
not in its repository); the wording used below, "Please provide the bounding box coordinate of the region this
sentence describes: {expression}.", is that field as copies derived from those files show it (the VLM-R1 paper
prints "coordinates"), not confirmed from the files themselves. Where vlmrl departs: VLM-R1's regex takes only a
JSON object holding four integers, and its greedy pattern takes the last of several; here any box in the block
counts (floats, a bare list, Qwen's box tokens), the last of several as there, and IoU is the continuous one (VLM-R1
counts pixels inclusively, which differs by at most a pixel row). As in VLM-R1, a box is not clipped nor refused for
reaching past the image: its IoU decides (a box 3 px past the edge of a 100 px object still has IoU ~0.97).
VLM-R1 reports a random 2,000 expressions (seed 42) of its own val files; vlmrl scores the whole split. As in the
standard REC tables, every referring expression is one sample (a row with three expressions makes three samples);
lmms-lab's testA/testB, RefCOCO+ val and RefCOCOg test rows match the published object counts, but its RefCOCO val
(8,811) and RefCOCOg val (7,573) hold 5,000 rows more than the published 3,811 and 2,573 objects (unconfirmed why),
so those splits do not reproduce the published sample counts.

Box coordinates follow the model family (`box_convention`): Qwen2-VL and Qwen3-VL write boxes on a 0..1000 grid of
the image (also as `<|box_start|>(x1,y1),(x2,y2)<|box_end|>`); Qwen2.5-VL writes absolute pixels of the image *as
the processor resized it* (the pixel budget), which vlmrl maps back to the original image, as VLM-R1 does; other
families are read as pixels of the original image. The true box stays in the original image's pixels.
"""

from __future__ import annotations

import ast
import re
from typing import Any

from vlmrl.data.files import RowError
from vlmrl.data.images import image_sizes
from vlmrl.data.sample import format_box
from vlmrl.eval.benchmarks.registry import Benchmark, register_benchmark
from vlmrl.rewards.boxes import box_iou
from vlmrl.rewards.columns import per_sample
from vlmrl.rewards.parsing import completion_text, parse_boxes

PROMPT = ("Please provide the bounding box coordinate of the region this sentence describes: {expression}. First output "
          "the thinking process in <think> </think> tags and then output the final answer in <answer> </answer> tags. "
          "Output the final answer in JSON format.")
_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.S)  # the first block, as VLM-R1's re.search
GRID = 1000.0
FAMILY_CONVENTIONS = {"qwen2_vl": "grid1000", "qwen3_vl": "grid1000", "qwen3_vl_moe": "grid1000",
                      "qwen2_5_vl": "input_pixels"}
CONVENTIONS = ("grid1000", "input_pixels", "pixels", "normalized")


def adapt(row: dict) -> list[dict]:
    bbox = row["bbox"]
    if not (isinstance(bbox, (list, tuple)) and len(bbox) == 4 and all(isinstance(v, (int, float)) for v in bbox)):
        raise RowError(f"'bbox' must be [x, y, w, h] (4 numbers), got {bbox!r}")
    x, y, w, h = (float(v) for v in bbox)
    if w <= 0 or h <= 0:
        raise RowError(f"'bbox' {bbox!r} has no area (w and h must be > 0)")
    expressions = row["answer"]
    if isinstance(expressions, str) and expressions.startswith("["):  # some copies hold the list's repr
        try:
            expressions = ast.literal_eval(expressions)
        except (ValueError, SyntaxError):
            raise RowError(f"'answer' {row['answer'][:80]!r} looks like a list but does not parse") from None
    expressions = expressions if isinstance(expressions, list) else [expressions]
    expressions = [str(e).strip() for e in expressions if str(e).strip()]
    if not expressions:
        raise RowError("'answer' holds no referring expression")
    return [{"id": f"{row['question_id']}:{i}", "image": row["image"], "problem": PROMPT.format(expression=e),
             "solution": format_box([x, y, x + w, y + h]), "answer_type": "box", "expression": e}
            for i, e in enumerate(expressions)]


def box_convention(model_type: str | None) -> str:
    """How a model family writes box coordinates (see the module docstring)."""
    return FAMILY_CONVENTIONS.get(model_type or "", "pixels")


def prepare(samples: list[dict], policy: Any) -> None:
    """Add each sample's image size, the size the processor resizes it to, and the model's box convention."""
    model_type = getattr(getattr(getattr(policy, "model", None), "config", None), "model_type", None)
    convention = box_convention(model_type)
    for sample in samples:
        width, height = image_sizes(sample["images"])[0]
        sample.update(width=width, height=height, box_convention=convention)
        sample["input_width"], sample["input_height"] = input_size(policy, width, height)


def input_size(policy: Any, width: int, height: int) -> tuple[int, int]:
    """(width, height) of an image after the Qwen processor's resize (`smart_resize` to its pixel budget, sides a
    multiple of patch x merge size); the original size for processors without one."""
    processor = getattr(getattr(policy, "processor", None), "image_processor", None)
    size = getattr(processor, "size", None) or {}
    if "longest_edge" not in size:
        return width, height
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize  # no torchvision

    factor = int(getattr(processor, "patch_size", 14)) * int(getattr(processor, "merge_size", 2))
    h, w = smart_resize(height, width, factor=factor, min_pixels=size.get("shortest_edge", 56 * 56),
                        max_pixels=size["longest_edge"])
    return w, h


def predicted_box(text: str, width: float, height: float, convention: str, input_width: float | None = None,
                  input_height: float | None = None) -> tuple[float, float, float, float] | None:
    """The last box of a response's first `<answer>` block in original-image pixels, by the model's convention;
    None without a block or a box in it (VLM-R1's `extract_bbox_answer` reads that block only, and its greedy
    pattern takes the last box there)."""
    if convention not in CONVENTIONS:
        raise ValueError(f"box_convention={convention!r}: expected one of {CONVENTIONS}")
    block = _ANSWER_BLOCK.search(text)
    if block is None:
        return None
    region = block.group(1).strip()
    boxes = parse_boxes(region, coords="normalized")  # raw numbers; Qwen's box tokens as 0..1 fractions
    if not boxes:
        return None
    x1, y1, x2, y2 = boxes[-1]
    if "<|box_start|>" in region or convention == "normalized":
        sx, sy = width, height
    elif convention == "grid1000":
        sx, sy = width / GRID, height / GRID
    elif convention == "input_pixels":
        sx, sy = width / (input_width or width), height / (input_height or height)
    else:
        sx, sy = 1.0, 1.0
    return (x1 * sx, y1 * sy, x2 * sx, y2 * sy)


def score(completions: list, solution: list, *, width: list, height: list, box_convention: list | str = "pixels",
          input_width: list | None = None, input_height: list | None = None, threshold: float = 0.5,
          **_: Any) -> list[float | None]:
    """1.0 when the last box of the answer block has IoU > `threshold` with the true box (VLM-R1's strict test, on
    the box as written: none is clipped to the image), else 0.0; None for a sample whose true box does not parse."""
    n = len(completions)
    conventions = per_sample(box_convention, n, "pixels")
    iws, ihs = per_sample(input_width, n, None), per_sample(input_height, n, None)
    out: list[float | None] = []
    for i, (text, gold) in enumerate(zip(completions, solution, strict=True)):
        truth = parse_boxes(str(gold), coords="normalized")
        if len(truth) != 1:
            out.append(None)
            continue
        w, h = float(width[i]), float(height[i])
        box = predicted_box(completion_text(text), w, h, conventions[i], iws[i], ihs[i])
        ok = box is not None and box[2] > box[0] and box[3] > box[1] and box_iou(box, truth[0]) > threshold
        out.append(float(ok))
    return out


_SOURCE = "VLM-R1 src/eval/test_rec_r1.py (REC, Acc@IoU > 0.5); "
for _name, _hub, _split, _paper in (
        ("refcoco", "lmms-lab/RefCOCO", "val", "Kazemzadeh et al. EMNLP 2014; Yu et al. ECCV 2016"),
        ("refcoco+", "lmms-lab/RefCOCOplus", "val", "Yu et al. ECCV 2016"),
        ("refcocog", "lmms-lab/RefCOCOg", "val", "Mao et al. CVPR 2016 (umd split)")):
    register_benchmark(Benchmark(
        name=_name, hub=_hub, split=_split, adapt=adapt, score=score, prepare=prepare,
        columns=("question_id", "image", "answer", "bbox"), answer_type="box", max_new_tokens=256,
        source=_SOURCE + _paper,
        notes="one sample per referring expression, the whole split (VLM-R1: 2,000 sampled); boxes read from the "
              "answer block in the model family's coordinate convention",
    ))
