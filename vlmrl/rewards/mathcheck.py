"""Math equivalence with math-verify, one answer pair per job in worker processes, each under a time limit.

Parsing and comparison are math-verify's (the library TRL and open-r1 grade math with): `latex2sympy2_extended`
reads LaTeX with an ANTLR grammar into sympy objects (`\\dfrac`, `\\sin^2 x`, intervals `(1, 2]`, sets `\\{1,2\\}`,
`\\pm`, percentages `50\\%`, units `5\\text{ cm}`, equations `x = 2`, matrices...), and `verify` compares them
(numerically at a number of decimals, symbolically, as sets or intervals). Only its LaTeX reader is used (its
plain-expression reader gives text to `sympy.parse_expr`, which calls `eval`): the grammar hands sympy nothing of
the model's output but number tokens its lexer matched (`sympy.Number("12.5")`), which `tests/test_mathcheck.py`
checks on hostile and random text.

Math checkers hang: `9^{9^{9^9}}` makes sympy (in fact CPython's big-integer power, which no signal interrupts)
run for ever, and a checker that silently returns 0 on every sample of that batch lets the policy learn nothing.
Here each pair is a job in the "math" `WorkerPool` with its own limit (`timeout`), a batch has a total `budget`,
and a pair that runs out of time becomes a `RewardFailure` (None plus a counted failure), never a silent 0.
math-verify's own time limit (`signal.alarm`, which turns a timeout into a silent False) is switched off: the pool's
kill is the limit.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from typing import Any

from vlmrl.cache import BoundedLRU
from vlmrl.rewards.registry import RewardFailure

MAX_CHARS = 200  # longer answers are not parsed (0), which also bounds the parser's work


def _verdict_bytes(key: tuple[str, str, float], verdict: Any) -> int:
    """A remembered verdict: the two texts (a prediction may be long) and the result."""
    return sys.getsizeof(key[0]) + sys.getsizeof(key[1]) + sys.getsizeof(str(verdict)) + 128


# verdicts by (prediction, reference, tolerance), failures included, for the process's life
_CACHE: BoundedLRU[tuple[str, str, float], Any] = BoundedLRU(16 * 2**20, 4096, _verdict_bytes)


def _latex_config() -> Any:
    """Read the whole text as one LaTeX answer: it is wrapped in `\\boxed{}` and only boxed content is extracted
    (no "the answer is" anchors, no plain-text expressions, which math-verify would give to `parse_expr`).
    Normalisation is math-verify's default: units and `\\text{}` after a number dropped, `\\frac12` and `\\sqrt2`
    repaired, `\\left`/`\\right`/`\\displaystyle` removed."""
    from math_verify import LatexExtractionConfig

    return LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)


def parse_math(text: str) -> list[Any]:
    """math-verify's reading of one answer (plain or LaTeX, `$...$` allowed): a list with one sympy object, or []
    when it does not parse (or is empty or longer than MAX_CHARS). `**` is read as `^` (plain-text powers).
    Runs in a math worker: parsing alone can take long (`\\binom{10^5}{5 \\cdot 10^4}` is computed)."""
    from math_verify import parse

    from vlmrl.rewards.parsing import to_ascii_digits

    s = to_ascii_digits(text).strip().replace("**", "^")
    if not s or len(s) > MAX_CHARS:
        return []
    return parse(f"\\boxed{{{s}}}", extraction_config=[_latex_config()], fallback_mode="no_fallback",
                 extraction_mode="first_match", parsing_timeout=None)


def decimals(tolerance: float) -> int:
    """The decimals math-verify rounds numbers to for `tolerance`: 1e-6 -> 6 (its default), i.e. about an absolute
    tolerance (0.7071 is sqrt(2)/2 at 4 decimals)."""
    return max(0, round(-math.log10(tolerance))) if tolerance > 0 else 15


def math_equal(prediction: str, reference: str, tolerance: float = 1e-6) -> bool:
    """Whether `prediction` is mathematically the `reference` (math-verify's `verify(gold, prediction)`, numbers
    compared at `decimals(tolerance)` decimals); False when either side does not parse. Runs in a math worker (it
    can take for ever); call `symbolic_equal_many` from the trainer."""
    from math_verify import verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns that its own timeout is off: the pool's is on
    gold, pred = parse_math(reference), parse_math(prediction)
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, float_rounding=decimals(tolerance), timeout_seconds=None))


def ready() -> bool:
    """A job that does nothing: running it makes a math worker start."""
    return True


# ANTLR builds its prediction tables lazily, per grammar path: the first parse of a kind of form cost ~1 s, more than
# a loaded machine's per-pair limit left, until a pair of that kind ran once in the worker
_WARM_UP = [("x^2+2x+1", "(x+1)^2"), ("\\dfrac{\\sqrt{2}}{2}", "\\sin^2 x + \\cos^2 x"), ("(1, 2]", "\\{1, 2\\}"),
            ("x = \\pm 2", "50\\%")]


def warm_up() -> None:
    """Compare `_WARM_UP`, so that a worker's first real jobs do not pay for the lazy imports and tables (sympy,
    the ANTLR grammar)."""
    for prediction, reference in _WARM_UP:
        math_equal(prediction, reference)


def symbolic_equal_many(pairs: list[tuple[str, str]], timeout: float = 5.0, budget: float = 30.0,
                        tolerance: float = 1e-6) -> list[bool | RewardFailure]:
    """For each (prediction, reference): True/False (`math_equal`), or a RewardFailure when the check ran past
    `timeout` seconds (or the batch's `budget` was spent first). Results, failures included, are cached per pair
    and tolerance for the process's life (a repeated pathological answer costs its time once)."""
    from vlmrl.rewards.safe import Job, get_pool

    keys = [(a, b, tolerance) for a, b in pairs]
    known: dict[tuple[str, str, float], bool | RewardFailure] = {}  # read first: the new ones may evict them
    for key in dict.fromkeys(keys):
        verdict = _CACHE.get(key)
        if verdict is not None:
            known[key] = verdict
    todo = [k for k in dict.fromkeys(keys) if k not in known]
    if todo:
        pool = get_pool("math", preload=("math_verify", "vlmrl.rewards.mathcheck:warm_up"))
        # start the workers (the imports take seconds) before the budget's clock: a pool that started inside
        # it failed the whole batch whenever the start took longer than the budget, every batch
        pool.run([Job("vlmrl.rewards.mathcheck:ready", timeout=60.0) for _ in range(pool.size)])
        jobs = [Job("vlmrl.rewards.mathcheck:math_equal", key, timeout=timeout) for key in todo]
        for key, outcome in zip(todo, pool.run(jobs, deadline=time.monotonic() + budget), strict=True):
            if outcome.ok:
                result: bool | RewardFailure = bool(outcome.value)
            else:
                result = RewardFailure(f"math check of {key[0][:60]!r}: {outcome.error}")
            if outcome.ok or outcome.timed_out:  # a job the budget never started is not a result
                _CACHE.put(key, result)
            known[key] = result
    return [known[k] for k in keys]
