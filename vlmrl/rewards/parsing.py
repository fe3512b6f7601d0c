"""Answer extraction and parsing for verifiable rewards: answer blocks, numbers, text, boxes.

Pure string functions, no torch. A parser returns None (or an empty list) when its input does not parse; it never
raises on model output, because model output is adversarial: the policy is optimised to find whatever a parser pays.
"""

from __future__ import annotations

import functools
import json
import math
import re
import unicodedata
from collections.abc import Sequence
from numbers import Real
from typing import Any

Box = tuple[float, float, float, float]
EXTRACT_MODES = ("tag", "boxed", "last_line", "auto")


def completion_text(completion: Any) -> str:
    """The text of a completion: a string as is, or the last message's content of a conversational completion
    (TRL's `[{"role": "assistant", "content": ...}]`)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and completion and isinstance(completion[-1], dict):
        content = completion[-1].get("content", "")
        return content if isinstance(content, str) else str(content)
    return str(completion)


# --------------------------------------------------------------------------------------------- answer extraction


def split_reasoning(text: str, think_tag: str = "think") -> tuple[str | None, str]:
    """(reasoning, rest) of a completion: the content of every `<think>...</think>` block, of an unclosed `<think>`
    to the end, and everything before a stray `</think>` (a template that opens the block in the prompt), joined by
    newlines, tags removed; None when there is no think tag at all. `rest` is what `strip_think` keeps. A linear
    scan: a regex here is quadratic on a run of unclosed tags."""
    open_, close = f"<{think_tag}>", f"</{think_tag}>"
    inside, outside, pos = [], [], 0
    while pos < len(text):
        start = text.find(open_, pos)
        if start < 0:
            outside.append(text[pos:])
            break
        outside.append(text[pos:start])
        end = text.find(close, start + len(open_))
        inside.append(text[start + len(open_):] if end < 0 else text[start + len(open_):end])
        pos = len(text) if end < 0 else end + len(close)
    rest = "".join(outside)
    if close in rest:  # the block was opened in the prompt: the reasoning runs up to the last stray close
        cut = rest.rindex(close)
        inside.insert(0, rest[:cut].replace(close, "\n"))
        rest = rest[cut + len(close):]
    if not inside:
        return None, rest
    return "\n".join(part.strip() for part in inside).strip(), rest


def strip_think(text: str, think_tag: str = "think") -> str:
    """`text` without its reasoning: every `<think>...</think>` block, everything up to a stray `</think>` (templates
    that open the block in the prompt), and an unclosed `<think>` to the end of the text (`split_reasoning`'s rest)."""
    return split_reasoning(text, think_tag)[1]


def extract_tag(text: str, tag: str = "answer", think_tag: str | None = "think") -> str | None:
    """Stripped content of the LAST `<tag>...</tag>` outside any think block, or None when there is none.

    A tag inside `<think>` does not count: the reasoning may draft answers, only the final block is the answer."""
    outside = strip_think(text, think_tag) if think_tag else text
    t = re.escape(tag)
    matches = re.findall(rf"<{t}>((?:(?!<{t}>).)*?)</{t}>", outside, flags=re.S)
    return matches[-1].strip() if matches else None


def extract_boxed(text: str) -> str | None:
    """Stripped content of the last `\\boxed{...}` (braces balanced), or None."""
    starts = [m.end() for m in re.finditer(r"\\boxed\s*\{", text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i].strip()
    return None


def extract_last_line(text: str) -> str | None:
    """The last non-empty line, stripped, or None."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else None


def extract_answer(text: str, mode: str = "tag", tag: str = "answer", think_tag: str = "think") -> str | None:
    """The answer in `text` by `mode`, always ignoring think blocks: "tag" (last `<answer>` block), "boxed" (last
    `\\boxed{}`), "last_line", or "auto" (tag, then boxed, then last line)."""
    if mode not in EXTRACT_MODES:
        raise ValueError(f"extract={mode!r}: expected one of {EXTRACT_MODES}")
    if mode in ("tag", "auto"):
        found = extract_tag(text, tag, think_tag)
        if found is not None or mode == "tag":
            return found
    outside = strip_think(text, think_tag)
    if mode in ("boxed", "auto"):
        found = extract_boxed(outside)
        if found is not None or mode == "boxed":
            return found
    return extract_last_line(outside)


def match_answer_block(
    text: str, think: bool | None = None, tags: Sequence[str] = ("think", "answer"), strict: bool = True
) -> str | None:
    """Stripped answer content if `text` has the answer-block format, else None ("" for an empty answer block).

    Format: `<think>...</think>` (think=True: required, None: optional, False: absent) then `<answer>...</answer>`.
    strict: the whole text is that, with only whitespace around it; so `<answer>5</answer></answer>` fails.
    Non-strict: the pattern may appear anywhere, but outside think blocks there must be exactly one `<answer>` and
    one `</answer>`. Think content may not contain think tags; answer content may contain neither kind of tag.
    `tags` is (think_tag, answer_tag)."""
    think_tag, answer_tag = tags[0], tags[-1]
    t, a = re.escape(think_tag), re.escape(answer_tag)
    think_part = rf"<{t}>(?:(?!</?{t}>).)*</{t}>\s*"
    if think is None:
        think_part = f"(?:{think_part})?"
    elif not think:
        think_part = ""
    core = rf"{think_part}<{a}>((?:(?!</?{a}>|</?{t}>).)*)</{a}>"
    if strict:
        match = re.fullmatch(rf"\s*{core}\s*", text, flags=re.S)
    else:
        match = re.search(core, text, flags=re.S)
        outside = strip_think(text, think_tag)
        if match and (outside.count(f"<{answer_tag}>") != 1 or outside.count(f"</{answer_tag}>") != 1):
            match = None
    return match.group(1).strip() if match else None


# --------------------------------------------------------------------------------------------------- numbers

_NUMBER_PUNCT = {
    "\u2212": "-",  # minus sign
    "\uff0d": "-",  # full-width hyphen-minus
    "\uff0b": "+",
    "\uff0e": ".",
    "\uff0c": ",",
    "\uff0f": "/",
    "\u2044": "/",  # fraction slash
    "\u066b": ".",  # Arabic decimal separator
    "\u066c": ",",  # Arabic thousands separator
}
_UNSIGNED = r"(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_NUMBER = re.compile(rf"[-+]?{_UNSIGNED}(?:\s*/\s*{_UNSIGNED})?", flags=re.ASCII)
# each group takes everything up to its brace and is stripped after: `\{\s*([^{}]*?)\s*\}` is cubic on a run of spaces
_LATEX_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")


def to_ascii_digits(text: str) -> str:
    """Map every Unicode decimal digit to ASCII (Arabic-Indic '٣' -> '3', full-width '３' -> '3') and the numeric
    punctuation listed in `_NUMBER_PUNCT`. Superscripts are left alone: '5²' is not '52'."""
    out = []
    for ch in text:
        if ch in _NUMBER_PUNCT:
            out.append(_NUMBER_PUNCT[ch])
        elif not ch.isascii() and unicodedata.decimal(ch, None) is not None:
            out.append(str(unicodedata.decimal(ch)))
        else:
            out.append(ch)
    return "".join(out)


def _number_value(token: str) -> float | None:
    parts = token.replace(",", "").replace(" ", "").split("/")
    try:
        value = float(parts[0]) if len(parts) == 1 else float(parts[0]) / float(parts[1])
    except (ValueError, ZeroDivisionError, OverflowError):
        return None
    return value if math.isfinite(value) else None


@functools.lru_cache(maxsize=1 << 16)  # a pure function of short strings: an RL step parses the same answers often
def parse_number(text: str, exact: bool = False) -> float | None:
    """The number in `text`, or None.

    Accepts ints, floats, scientific notation, fractions "3/4" and `\\frac{3}{4}`, thousands separators "1,000",
    non-ASCII digits, and text around the number ("$5", "5 cm", "x = 5"). The text must hold exactly ONE number:
    "3 or 4", "3-4" and "1,2" parse to None, so listing candidates cannot pay. exact=True: nothing but the number
    (and trailing punctuation) is allowed. Non-finite values are None."""
    s = _LATEX_FRAC.sub(lambda m: f"{m.group(1).strip()}/{m.group(2).strip()}", to_ascii_digits(text)).strip()
    tokens = [m.group(0) for m in _NUMBER.finditer(s)]
    if len(tokens) != 1:
        return None
    if exact and _NUMBER.fullmatch(s.rstrip(".,;:!? ")) is None:
        return None
    return _number_value(tokens[0])


def numbers_equal(a: float, b: float, tolerance: float = 1e-6) -> bool:
    """|a - b| <= tolerance * max(|a|, |b|), or |a - b| <= tolerance (relative or absolute)."""
    return math.isclose(a, b, rel_tol=tolerance, abs_tol=tolerance)


# ------------------------------------------------------------------------------------------------------ text

_QUOTES = "\"'`\u201c\u201d\u2018\u2019\u00ab\u00bb"
_TRAILING_PUNCT = ".,;:!?\u3002\u3001"
_ARTICLES = re.compile(r"\b(?:a|an|the)\b")
_LATEX_WRAPPER = re.compile(r"\\(?:boxed|text|textbf|mathrm)\s*\{(.*)\}|\$(.*)\$", flags=re.S)


def normalize_text(text: str) -> str:
    """Normalised form for exact-match comparison: NFKC, ASCII digits, casefold, whole-string `\\boxed{}`/`\\text{}`/
    `$...$` unwrapped, surrounding quotes and trailing punctuation stripped, articles a/an/the removed, whitespace
    collapsed. "The Red." -> "red". If removing articles would leave nothing, they are kept: the multiple-choice
    answer "A" stays "a", so "the" cannot match it."""
    s = to_ascii_digits(unicodedata.normalize("NFKC", text)).casefold()
    previous = None
    while s != previous:
        previous = s
        s = s.strip().strip(_QUOTES).rstrip(_TRAILING_PUNCT)
        wrapped = _LATEX_WRAPPER.fullmatch(s)
        if wrapped:
            s = wrapped.group(1) if wrapped.group(1) is not None else wrapped.group(2)
    s = " ".join(s.split())
    without_articles = " ".join(_ARTICLES.sub(" ", s).split())
    return without_articles or s


# ----------------------------------------------------------------------------------------------------- boxes

_NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_QWEN_BOX = re.compile(
    rf"<\|box_start\|>\s*\(\s*({_NUM})\s*,\s*({_NUM})\s*\)\s*,\s*\(\s*({_NUM})\s*,\s*({_NUM})\s*\)\s*<\|box_end\|>"
)
_TEXT_BOX = re.compile(
    rf"[\[(]\s*({_NUM})\s*,\s*({_NUM})\s*,\s*({_NUM})\s*,\s*({_NUM})\s*[\])]"
    # `\)\s*(?:,|to|-)?\s*\(` would split a run of spaces between its two `\s*` in every way: quadratic
    rf"|\(\s*({_NUM})\s*,\s*({_NUM})\s*\)\s*(?:(?:,|to|-)\s*)?\(\s*({_NUM})\s*,\s*({_NUM})\s*\)"
)
_BOX_KEYS = ("bbox_2d", "bbox", "box", "Position", "position")


def _four_numbers(value: Any) -> Box | None:
    if isinstance(value, (list, tuple)) and len(value) == 4:
        if all(isinstance(v, Real) and not isinstance(v, bool) for v in value):
            try:
                return (float(value[0]), float(value[1]), float(value[2]), float(value[3]))
            except OverflowError:  # a JSON integer beyond float's range: not a box
                return None
    return None


def boxes_from_json(obj: Any) -> list[Box]:
    """Every box in a parsed JSON value: a list of 4 numbers, an object with a `bbox_2d`/`bbox`/`box`/`Position`
    key, or a list of those (one box per item)."""
    box = _four_numbers(obj)
    if box is not None:
        return [box]
    if isinstance(obj, dict):
        for key in _BOX_KEYS:
            if key in obj:
                return boxes_from_json(obj[key])
        return []
    if isinstance(obj, (list, tuple)):
        return [b for item in obj for b in boxes_from_json(item)]
    return []


def _json_value(text: str) -> Any:
    body = text.strip()  # without a code fence; string methods, as `\s*```$` is quadratic on a run of spaces
    if body.startswith("```"):
        body = body[7:] if body.startswith("```json") else body[3:]
        body = body.lstrip()
    if body.endswith("```"):
        body = body[:-3].rstrip()
    candidates = [body]
    starts = [i for i in (body.find("["), body.find("{")) if i >= 0]
    if starts:
        start = min(starts)
        end = max(body.rfind("]"), body.rfind("}"))
        if end > start:
            candidates.append(body[start : end + 1])
    for candidate in candidates:
        try:
            return json.loads(candidate)
        except (ValueError, RecursionError):
            continue
    return None


def parse_boxes(
    text: str, width: float | None = None, height: float | None = None, coords: str = "absolute"
) -> list[Box]:
    """Every box `(x1, y1, x2, y2)` predicted in `text`, in `coords` units ("absolute" pixels or "normalized"
    0..1 fractions). The caller decides what several boxes mean.

    Tried in order, the first format that yields a box wins:
    1. Qwen2-VL `<|box_start|>(x1,y1),(x2,y2)<|box_end|>` on its 0..1000 grid, converted to `coords` (absolute
       needs width and height; without them no box is returned);
    2. JSON: `[x1, y1, x2, y2]`, `{"bbox_2d": [...]}` / `{"Position": [...]}`, or a list of those;
    3. text: `[x1, y1, x2, y2]`, `(x1, y1, x2, y2)` or `(x1, y1), (x2, y2)`, every occurrence;
    4. a text holding exactly four numbers."""
    if coords not in ("absolute", "normalized"):
        raise ValueError(f"coords={coords!r}: expected 'absolute' or 'normalized'")
    text = to_ascii_digits(text)
    if "<|box_start|>" in text:
        grid = [tuple(float(v) / 1000.0 for v in m.groups()) for m in _QWEN_BOX.finditer(text)]
        if coords == "normalized":
            return [(b[0], b[1], b[2], b[3]) for b in grid]
        if not width or not height:
            return []
        return [(b[0] * width, b[1] * height, b[2] * width, b[3] * height) for b in grid]
    try:
        boxes = boxes_from_json(_json_value(text))
    except RecursionError:  # adversarially deep nesting
        boxes = []
    if boxes:
        return boxes
    for match in _TEXT_BOX.finditer(text):
        values = [float(v) for v in match.groups() if v is not None]
        boxes.append((values[0], values[1], values[2], values[3]))
    if boxes:
        return boxes
    numbers = re.findall(_NUM, text)
    return [(float(numbers[0]), float(numbers[1]), float(numbers[2]), float(numbers[3]))] if len(numbers) == 4 else []


def box_is_valid(box: Box, width: float | None = None, height: float | None = None, coords: str = "absolute") -> bool:
    """Finite, x2 > x1 and y2 > y1, and inside the image within 1 px: absolute coordinates below -1 px, or beyond
    width/height + 1 px when those are known, are invalid; normalized ones must lie in [0, 1] within 1/width
    (1e-3 when the size is unknown)."""
    x1, y1, x2, y2 = box
    if not all(math.isfinite(v) for v in box) or x2 <= x1 or y2 <= y1:
        return False
    if coords == "normalized":
        tol_x = 1.0 / width if width else 1e-3
        tol_y = 1.0 / height if height else 1e-3
        return x1 >= -tol_x and y1 >= -tol_y and x2 <= 1 + tol_x and y2 <= 1 + tol_y
    if x1 < -1 or y1 < -1:
        return False
    return not ((width and x2 > width + 1) or (height and y2 > height + 1))
