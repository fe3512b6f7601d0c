"""Symbolic math equivalence (sympy), one expression pair per job in worker processes, each under a time limit.

Math checkers hang: `9^{9^{9^9}}` makes sympy (in fact CPython's big-integer power, which no signal interrupts)
run for ever, and a checker that silently returns 0 on every sample of that batch lets the policy learn nothing.
Here each pair is a job in the "math" `WorkerPool` with its own limit (`timeout`), a batch has a total `budget`,
and a pair that runs out of time becomes a `RewardFailure` (None plus a counted failure), never a silent 0.

Parsing is deliberately small and closed: a LaTeX subset (`\\frac`, `\\sqrt`, `^`, `\\cdot`, `\\pi`, trig/log
functions...) is rewritten to sympy syntax, and the result may hold only digits, single-letter variables, the
function names in `FUNCTIONS`, operators and parentheses. Anything else does not parse (and pays 0), which also
keeps `sympy.parse_expr` (it calls `eval`) away from attribute access, dunders and strings in model output.
"""

from __future__ import annotations

import re
import time
from collections import OrderedDict
from typing import Any

from vlmrl.rewards.registry import RewardFailure

MAX_CHARS = 200  # longer expressions are not parsed (0), which also bounds the parser's work
FUNCTIONS = ("sqrt", "sin", "cos", "tan", "cot", "sec", "csc", "asin", "acos", "atan", "sinh", "cosh", "tanh",
             "log", "exp", "pi", "oo", "E", "I", "Abs")
_LATEX_WORDS = {
    r"\cdot": "*", r"\times": "*", r"\div": "/", r"\pi": "pi", r"\infty": "oo", r"\ln": "log", r"\log": "log",
    r"\exp": "exp", r"\sin": "sin", r"\cos": "cos", r"\tan": "tan", r"\cot": "cot", r"\sec": "sec", r"\csc": "csc",
    r"\arcsin": "asin", r"\arccos": "acos", r"\arctan": "atan", r"\sinh": "sinh", r"\cosh": "cosh",
    r"\tanh": "tanh",
}
_DROP = re.compile(r"\\left|\\right|\\displaystyle|\\[,;:! ]|\\mathrm|\\text|\\operatorname|\$|\\\(|\\\)|\\\[|\\\]")
_IDENT = re.compile(r"[A-Za-z]+")
_ALLOWED_CHARS = re.compile(r"[0-9A-Za-z+\-*/^().\s]*")
_CACHE: OrderedDict[tuple[str, str], Any] = OrderedDict()
_CACHE_SIZE = 4096


def _argument(text: str, start: int) -> tuple[str, int] | None:
    """The argument of a LaTeX command at text[start]: a `{...}` group (nesting respected) or one character
    (`\\frac12`, `\\sqrt2`), with the index after it; None when there is none."""
    while start < len(text) and text[start] == " ":
        start += 1
    if start >= len(text) or text[start] in "}":
        return None
    if text[start] != "{":
        return text[start], start + 1
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1 : i], i + 1
    return None


def _rewrite_commands(text: str) -> str | None:
    """`\\frac{a}{b}` -> ((a)/(b)), `\\sqrt[n]{a}` -> ((a)**(1/(n))), `\\sqrt{a}` -> sqrt(a), recursively."""
    out, i = [], 0
    while i < len(text):
        command = re.match(r"\\(?:[dt]?frac|sqrt)", text[i:])
        if not command:
            out.append(text[i])
            i += 1
            continue
        j, root = i + command.end(), None
        if command.group(0) == "\\sqrt" and j < len(text) and text[j] == "[":
            end = text.find("]", j)
            root = _rewrite_commands(text[j + 1 : end]) if end > 0 else None
            if root is None:
                return None
            j = end + 1
        first = _argument(text, j)
        second = _argument(text, first[1]) if first and command.group(0).endswith("frac") else None
        if first is None or (command.group(0).endswith("frac") and second is None):
            return None
        a = _rewrite_commands(first[0])
        b = _rewrite_commands(second[0]) if second else ""
        if a is None or b is None:
            return None
        if second:
            out.append(f"(({a})/({b}))")
            i = second[1]
        else:
            out.append(f"(({a})**(1/({root})))" if root else f"sqrt({a})")
            i = first[1]
    return "".join(out)


def to_sympy_text(expression: str) -> str | None:
    """`expression` (plain or LaTeX) rewritten to the closed sympy syntax described above, or None.

    An equation keeps its right-hand side ("x = 2" -> "2"). Multi-letter names that are not in FUNCTIONS are
    read as products of single-letter variables ("xy" -> "x*y")."""
    from vlmrl.rewards.parsing import to_ascii_digits

    s = to_ascii_digits(expression).strip()
    if not s or len(s) > MAX_CHARS:
        return None
    s = _DROP.sub(" ", s)
    s = re.sub(r"\\boxed\s*", "", s)
    s = _rewrite_commands(s)
    if s is None:
        return None
    for word in sorted(_LATEX_WORDS, key=len, reverse=True):
        s = re.sub(re.escape(word) + r"(?![A-Za-z])", f" {_LATEX_WORDS[word]} ", s)
    s = s.replace("{", "(").replace("}", ")").split("=")[-1].strip()
    if not s or "\\" in s or not _ALLOWED_CHARS.fullmatch(s):
        return None
    if re.search(r"\.(?!\d)|[A-Za-z)]\s*\.", s):  # a dot only as a decimal point: no attribute access
        return None

    def split(match: re.Match) -> str:
        word = match.group(0)
        return word if word in FUNCTIONS or len(word) == 1 else "*".join(word)

    return _IDENT.sub(split, s)


def _parse(expression: str) -> Any:
    import sympy
    from sympy.parsing.sympy_parser import (
        convert_xor,
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    text = to_sympy_text(expression)
    if text is None:
        return None
    names = {name: getattr(sympy, name) for name in FUNCTIONS}
    names.update({c: sympy.Symbol(c) for c in set(re.findall(r"[A-Za-z]", text)) if c not in names})
    transformations = (*standard_transformations, implicit_multiplication_application, convert_xor)
    try:
        value = parse_expr(text, local_dict=names, global_dict={"__builtins__": {}, **vars(sympy)},
                           transformations=transformations)
    except Exception:  # any parse error: not an expression
        return None
    return value if isinstance(value, sympy.Basic) else None


def sympy_equal(prediction: str, reference: str, tolerance: float = 1e-6) -> bool | None:
    """Whether two expressions are mathematically equal: simplify(a - b) == 0, or |a - b| <= tolerance * max(1, |b|)
    when both are constants, or sympy's numeric `equals` test. None when either side does not parse.
    Runs in a math worker (it can take for ever); call `symbolic_equal_many` from the trainer."""
    import sympy

    a, b = _parse(prediction), _parse(reference)
    if a is None or b is None:
        return None
    diff = sympy.simplify(a - b)
    if diff == 0:
        return True
    if not diff.free_symbols:
        scale = abs(complex(sympy.N(b))) if not b.free_symbols else 1.0
        return abs(complex(sympy.N(diff))) <= tolerance * max(1.0, scale)
    return bool(diff.equals(0))


def ready() -> bool:
    """A job that does nothing: running it makes a math worker start."""
    return True


def warm_up() -> None:
    """Run one comparison, so that a worker's first real job does not pay for sympy's lazy imports."""
    sympy_equal("\\frac{x^2 - 1}{x - 1}", "x + 1")


def symbolic_equal_many(pairs: list[tuple[str, str]], timeout: float = 2.0, budget: float = 30.0,
                        tolerance: float = 1e-6) -> list[bool | RewardFailure]:
    """For each (prediction, reference): True/False, False when either side does not parse, or a RewardFailure
    when the check ran past `timeout` seconds (or the batch's `budget` was spent first). Results, failures
    included, are cached per pair for the process's life (a repeated pathological answer costs its time once)."""
    from vlmrl.rewards.safe import Job, get_pool

    todo = list(dict.fromkeys(p for p in pairs if p not in _CACHE))
    fresh: dict[tuple[str, str], bool | RewardFailure] = {}
    if todo:
        pool = get_pool("math", preload=("sympy", "vlmrl.rewards.mathcheck:warm_up"))
        # start the workers (importing sympy takes seconds) before the budget's clock: a pool that started inside
        # it failed the whole batch whenever the start took longer than the budget, every batch
        pool.run([Job("vlmrl.rewards.mathcheck:ready", timeout=60.0) for _ in range(pool.size)])
        jobs = [Job("vlmrl.rewards.mathcheck:sympy_equal", (a, b, tolerance), timeout=timeout) for a, b in todo]
        for pair, outcome in zip(todo, pool.run(jobs, deadline=time.monotonic() + budget), strict=True):
            if outcome.ok:
                result: bool | RewardFailure = bool(outcome.value)
            else:
                result = RewardFailure(f"math check of {pair[0][:60]!r}: {outcome.error}")
            if outcome.ok or outcome.timed_out:  # a job the budget never started is not a result
                _CACHE[pair] = result
            fresh[pair] = result
            if len(_CACHE) > _CACHE_SIZE:
                _CACHE.popitem(last=False)
    return [fresh[p] if p in fresh else _CACHE[p] for p in pairs]
