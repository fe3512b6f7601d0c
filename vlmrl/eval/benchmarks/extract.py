"""Rule-based answer extraction shared by the benchmarks: where the published evaluators ask GPT-4 to read the final
answer out of a response (MathVista, MathVerse), vlmrl reads it by rules, in this order, all outside `<think>`:
the last `<answer>...</answer>`, the last `\\boxed{...}`, the last "the answer is X" / "Answer: X", else the last
non-empty line. docs/benchmarks.md says what this changes.
"""

from __future__ import annotations

import re

from vlmrl.rewards.parsing import extract_boxed, extract_last_line, extract_tag, strip_think

_ANSWER_IS = re.compile(r"(?:the\s+(?:final\s+|correct\s+)?(?:answer|option|choice)(?:\s+to\s+(?:the|this)\s+question)?\s+is"
                        r"|final\s+answer\s*[:\uff1a]|answer\s*[:\uff1a]|\u7b54\u6848\s*[\u662f\u4e3a]?)\s*[:\uff1a]?\s*(.*)", flags=re.IGNORECASE)


def _clean(answer: str) -> str:
    """A stated answer without the period after it and markdown emphasis around it ("**B**." -> "B")."""
    return answer.strip().rstrip(".\u3002").strip().strip("*").strip()


def final_answer(text: str) -> str:
    """The final answer of a response by the rules above; "" for an empty response. A statement whose answer is on
    the next line ("The correct answer is:" then "(B) No") reads that line."""
    tagged = extract_tag(text)
    if tagged is not None:
        return tagged
    outside = strip_think(text)
    boxed = extract_boxed(outside)
    if boxed is not None:
        return boxed
    lines = [line for line in outside.splitlines() if line.strip()]
    stated = None
    for i, line in enumerate(lines):
        match = _ANSWER_IS.search(line)
        if match:
            stated = _clean(match.group(1))
            if not stated and i + 1 < len(lines):
                stated = _clean(lines[i + 1])
    if stated:
        return stated
    return extract_last_line(outside) or ""


def choice_letter(answer: str, n_options: int) -> str | None:
    """The option letter an answer names, among the first `n_options` capitals, or None when it names none or
    several ("A or B", "A, B").

    Read, in order: a leading letter marked as one, whatever follows it ("B", "(B) A white cup", "B. Since O is the
    center", "B: text", "**B**", "Option B"); the one "(B)" inside a sentence ("it is (C) green"); a letter that
    ends the answer ("I think it's B"). A bare leading letter followed by words ("A white cup") is not a letter."""
    letters = "".join(chr(ord("A") + i) for i in range(n_options))
    if not letters:
        return None
    text = re.sub(r"[*`]+", "", answer).strip()
    text = re.sub(r"^(?:the\s+)?(?:option|choice|answer)(?:\s+is)?\s*[:\uff1a]?\s*", "", text, flags=re.IGNORECASE)
    other = rf"\s*(?:,|/|&|\bor\b|\band\b)\s*\(?[{letters}]\)?(?!\w)"  # "... or B": a second option named
    lead = re.match(rf"\(([{letters}])\)|([{letters}])(?=[.:\uff1a)\]]|$)", text)
    if lead:
        return None if re.match(other, text[lead.end():].lstrip(".:\uff1a)]")) else lead.group(1) or lead.group(2)
    found = set(re.findall(rf"\(([{letters}])\)", text))
    if len(found) == 1:
        return found.pop()
    if found:
        return None
    last = re.search(rf"(?:^|\s)([{letters}])[.!]?$", text)
    if last and not re.search(rf"(?:(?<!\w)\(?[{letters}]\)?|,|/|&|\bor|\band)\s*$", text[:last.start(1)]):
        return last.group(1)
    return None


def choice_letters(answer: str, n_options: int) -> frozenset[str]:
    """The option letters an answer names: all of them for a list of letters ("C, D", "C and D", "C\nD"), else the
    one `choice_letter` reads (or none)."""
    letters = "".join(chr(ord("A") + i) for i in range(n_options))
    text = re.sub(r"[*`]+", "", answer).strip()
    item = rf"\(?[{letters}]\)?"
    if letters and re.fullmatch(rf"{item}(?:\s*(?:,|/|&|\band\b|\s)\s*{item})+", text):
        return frozenset(re.findall(rf"[{letters}]", text))
    one = choice_letter(answer, n_options)
    return frozenset([one]) if one else frozenset()


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
