"""Math equivalence on math-verify: a table of answer pairs worked by hand (equal and not), the exploits a lenient
checker pays for, and the proof that model output reaches sympy's `eval` only as a number token."""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vlmrl.rewards import accuracy_reward
from vlmrl.rewards.mathcheck import decimals, symbolic_equal_many
from vlmrl.rewards.safe import Job, get_pool

# (answer, solution, equal?): each worked by hand; the comment says why when it is not plain algebra
TABLE = [
    ("x^2+2x+1", "(x+1)^2", True),
    ("(x+1)^2", "x^2+2x+1", True),
    ("\\frac{1}{2}", "0.5", True),
    ("2\\sqrt{2}", "\\sqrt{8}", True),  # sqrt(8) = sqrt(4 * 2) = 2 sqrt(2)
    ("\\dfrac{x^2-1}{x-1}", "x+1", True),  # (x-1)(x+1) / (x-1)
    ("\\dfrac{3}{4}", "0.75", True),
    ("\\tfrac{3}{4}", "\\frac34", True),
    ("\\sin^2 x + \\cos^2 x", "1", True),
    ("\\sin^2 x", "1-\\cos^2 x", True),
    ("1-\\cos^2 x", "\\sin^2 x", True),
    ("(1, 2]", "(1,2]", True),  # the same half-open interval, spaced differently
    ("[0,\\infty)", "[0, \\infty)", True),
    ("x \\in [1, 2]", "[1,2]", True),
    ("\\{3,2,1\\}", "\\{1,2,3\\}", True),  # a set has no order
    ("\\pm 2", "\\pm2", True),
    ("-2, 2", "\\pm 2", True),  # +-2 is the set {-2, 2}
    ("x = \\pm 2", "\\pm 2", True),
    ("50\\%", "0.5", True),
    ("50\\%", "\\frac{1}{2}", True),
    ("50\\%", "50", True),  # math-verify reads a percentage as either 50 or 0.5
    ("5\\text{ cm}", "5", True),  # units after a number are dropped
    ("5", "5\\text{ cm}", True),
    ("12\\text{ m}^2", "12", True),
    ("\\$12", "12", True),
    ("x = 2", "2", True),  # an equation's value
    ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}", True),  # 1/sqrt(2) = sqrt(2)/2
    ("\\sqrt[3]{8}", "2", True),
    ("2^{10}", "1024", True),
    ("\\log_2 8", "3", True),
    ("\\cos(\\pi/3)", "\\frac12", True),
    ("y^2+x^2", "x^2+y^2", True),
    ("\\left(\\frac{1}{2}\\right)^2", "\\frac14", True),
    ("x**2 - 1", "(x-1)(x+1)", True),  # a plain-text power
    ("\\frac{\\pi}{2}", "\\pi/2", True),
    ("0.333333", "\\frac13", True),  # 1/3 at 6 decimals (tolerance 1e-6)
    ("\\begin{pmatrix}1\\\\2\\end{pmatrix}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", True),
    ("x+2", "x+1", False),
    ("x^2-1", "(x-1)^2", False),  # x^2 - 2x + 1
    ("(1,2)", "[1,2]", False),  # open vs closed
    ("(1,2]", "[1,2)", False),
    ("\\{1,2\\}", "\\{1,2,3\\}", False),
    ("\\pm 2", "2", False),  # {-2, 2} is not 2
    ("2", "\\pm 2", False),
    ("5\\text{ cm}", "6", False),
    ("\\sin^2 x", "\\cos^2 x", False),
    ("\\dfrac{3}{4}", "0.7", False),
    ("50\\%", "0.05", False),
    ("2\\sqrt{3}", "\\sqrt{8}", False),  # sqrt(12) vs sqrt(8)
    ("x = 3", "2", False),
    ("0.33", "\\frac13", False),  # 0.33 is not 0.333333
    ("\\sqrt{x^2}", "x", False),  # |x|
    ("\\frac{\\pi}{3}", "\\frac{\\pi}{2}", False),
]

# answers a lenient checker pays for: hedging, several values, code, an empty answer
EXPLOITS = [
    ("x^2+2x+1 or x+1", "(x+1)^2"),
    ("\\frac{1}{2} \\text{ or } \\frac{1}{3}", "\\frac12"),
    ("x+1 \\text{ and } x+2", "x+1"),
    ("3 or 4", "3"),
    ("3, 4", "3"),
    ("1, 2, 3", "2"),
    ("\\{1, 2\\}", "1"),
    ("__import__('os').system('true')", "x+1"),
    ("().__class__.__bases__[0]", "x+1"),
    ("\\text{__import__('os')}", "x+1"),
    ("", "x+1"),
]


SLOW_OK = {"math_timeout": 30.0, "math_budget": 600.0}  # verdicts, not speed: a loaded machine may parse slowly


def graded(answers: list[str], solutions: list[str], **kwargs) -> list[float | None]:
    return accuracy_reward([f"<answer>{a}</answer>" for a in answers], solutions,
                           answer_type=["math"] * len(answers), **SLOW_OK, **kwargs)


def test_the_table_worked_by_hand():
    answers, solutions, equal = zip(*TABLE, strict=True)
    assert len(TABLE) >= 40 and sum(equal) >= 20 and len(equal) - sum(equal) >= 15
    got = graded(list(answers), list(solutions))
    wrong = [(a, s, g) for a, s, e, g in zip(answers, solutions, equal, got, strict=True) if g != float(e)]
    assert wrong == []


def test_the_checker_itself_on_the_table():
    """The table straight through the math workers (no text or number shortcut before them)."""
    verdicts = symbolic_equal_many([(a, s) for a, s, _ in TABLE], timeout=30.0, budget=600.0)
    assert verdicts == [e for _, _, e in TABLE]


def test_exploits_pay_nothing():
    answers, solutions = zip(*EXPLOITS, strict=True)
    assert graded(list(answers), list(solutions)) == [0.0] * len(EXPLOITS)


def test_a_draft_answer_in_the_reasoning_does_not_count():
    completions = ["<think>maybe <answer>(x+1)^2</answer></think><answer>x+2</answer>",
                   "<think>maybe <answer>x+2</answer></think><answer>x^2+2x+1</answer>",
                   "<answer>x^2+2x+1</answer></answer>"]  # the repeated-closing-tag hack
    assert accuracy_reward(completions, ["(x+1)^2"] * 3, answer_type="math", **SLOW_OK) == [0.0, 1.0, 0.0]


def test_forms_the_answer_type_is_inferred_for():
    # no answer_type column: these solutions are math, so the equivalent answer pays
    answers = ["0.5", "-2, 2", "(1,2]", "\\{2,1\\}", "5"]
    solutions = ["50\\%", "\\pm 2", "(1, 2]", "\\{1,2\\}", "5\\text{ cm}"]
    assert accuracy_reward([f"<answer>{a}</answer>" for a in answers], solutions, **SLOW_OK) == [1.0] * 5


def test_tolerance_sets_the_decimals():
    assert (decimals(1e-6), decimals(1e-4), decimals(0.5), decimals(0.0)) == (6, 4, 0, 15)
    # sqrt(2)/2 = 0.70710678...: 0.7071 at 4 decimals, 0.707107 at 6
    assert graded(["\\frac{\\sqrt{2}}{2}"], ["0.7071"]) == [0.0]
    assert graded(["\\frac{\\sqrt{2}}{2}"], ["0.7071"], tolerance=1e-4) == [1.0]


# --------------------------------------------------------------------------- model output never reaches eval

NUMBER_TOKEN = re.compile(r"\d+(?:\.\d*)?|\.\d+")
HOSTILE = ["__import__('os').system('true')", "().__class__.__bases__[0].__subclasses__()", "lambda: 1",
           "exec('1')", "eval(1)", "\\text{__import__('os')}", "\\mathrm{__class__}", "\\operatorname{eval}(1)",
           "x**2", "1+2", "0x1F", "1_000", "1e5", "1j", "open('/etc/passwd').read()", "$1+1$", "Matrix([1])"]


def parse_expr_inputs(texts: list[str]) -> list[str]:
    """Runs in a worker: parse each text with `parse_math`, and return every string sympy's `parse_expr` (the
    function that calls `eval`) was given meanwhile."""
    import sympy.parsing.sympy_parser as sympy_parser

    from vlmrl.rewards.mathcheck import parse_math

    seen, real = [], sympy_parser.parse_expr

    def recording(s, *args, **kwargs):
        seen.append(str(s))
        return real(s, *args, **kwargs)

    sympy_parser.parse_expr = recording
    try:
        for text in texts:
            parse_math(text)
    finally:
        sympy_parser.parse_expr = real
    return seen


@pytest.fixture
def math_pool():
    return get_pool("math", preload=("math_verify", "vlmrl.rewards.mathcheck:warm_up"))  # the reward's own workers


def test_hostile_text_reaches_eval_only_as_number_tokens(math_pool):
    texts = HOSTILE + [text for row in TABLE for text in row[:2]] + [text for row in EXPLOITS for text in row]
    halves = [texts[::2], texts[1::2]]
    outcomes = math_pool.run([Job(f"{__name__}:parse_expr_inputs", (half,), timeout=60.0) for half in halves])
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
    seen = [s for o in outcomes for s in o.value]
    assert seen and all(NUMBER_TOKEN.fullmatch(s) for s in seen), seen


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.text(max_size=80), st.text("x^{}()\\_.+-*/=,%$0123456789fracsqrtpm ", max_size=80)),
                min_size=1, max_size=5))
def test_random_text_reaches_eval_only_as_number_tokens(math_pool, texts):
    (outcome,) = math_pool.run([Job(f"{__name__}:parse_expr_inputs", (texts,), timeout=20.0)])
    if outcome.timed_out:  # a slow parse is the pool's business (a counted failure), not this test's
        return
    assert outcome.ok, outcome.error
    assert all(NUMBER_TOKEN.fullmatch(s) for s in outcome.value), outcome.value
