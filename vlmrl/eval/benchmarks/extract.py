"""Rule-based answer extraction shared by the benchmarks: where the published evaluators ask GPT-4 to read the final
answer out of a response (MathVista, MathVerse), vlmrl reads it by rules, in this order, all outside `<think>`:
the last `<answer>...</answer>`, the last `\\boxed{...}`, the last "the answer is X" / "Answer: X", else the last
non-empty line. docs/benchmarks.md says what this changes.
"""

from __future__ import annotations

import re

from vlmrl.rewards.parsing import extract_boxed, extract_last_line, extract_tag, strip_think

_ANSWER_IS = re.compile(r"(?:the\s+(?:final\s+|correct\s+)?answer\s+is|final\s+answer\s*:|answer\s*:)\s*(.+)",
                        flags=re.IGNORECASE)


def final_answer(text: str) -> str:
    """The final answer of a response by the rules above; "" for an empty response."""
    tagged = extract_tag(text)
    if tagged is not None:
        return tagged
    outside = strip_think(text)
    boxed = extract_boxed(outside)
    if boxed is not None:
        return boxed
    stated = None
    for line in outside.splitlines():
        match = _ANSWER_IS.search(line)
        if match:
            stated = match.group(1)
    if stated is not None:
        return stated.strip().rstrip(".").strip().strip("*").strip()
    return extract_last_line(outside) or ""


def choice_letter(answer: str, n_options: int) -> str | None:
    """The option letter an answer names: "B", "(B)", "B.", "B) text", "Option B", "B: text", or the one "(B)" inside
    a sentence; None when it names no letter among the first `n_options` (capitals only), or several ("A or B")."""
    letters = "".join(chr(ord("A") + i) for i in range(n_options))
    text = answer.strip()
    text = re.sub(r"^(?:option|choice)\s+", "", text, flags=re.IGNORECASE)
    match = re.fullmatch(rf"\(?([{letters}])\)?((?:\s*[.:)]\s*.*|\s+.*)?)", text, flags=re.S) if letters else None
    if match:  # "A or B", "A, B": a second option letter after the first names no one option
        return None if re.search(rf"(?<![\w'])\(?[{letters}]\)?(?![\w'])", match.group(2)) else match.group(1)
    found = set(re.findall(rf"\(([{letters}])\)", text)) if letters else set()
    return found.pop() if len(found) == 1 else None


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions), as python-Levenshtein's `distance`."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]
