"""The published judge-based answer reading of MathVista and MathVerse, on any OpenAI-compatible endpoint.

`vlmrl eval MODEL --benchmark mathvista --extract judge --judge-url URL --judge-model M` scores with the language-model
steps those benchmarks publish, in place of vlmrl's offline rules, through vlmrl's judge client (`JudgeClient`:
retries, a disk cache, bounded concurrency; docs/rewards.md):

- MathVista (lupantech/MathVista evaluation/extract_answer.py, prompts/ext_ans.py): the response is read by its rules
  first (empty; an option's text; an integer or a float), else the judge is sent `demo_prompt` (five in-context
  examples), the query and the response, ending "Extracted answer: "; the reply is normalised and compared as
  calculate_score.py does (`mathvista.normalize`). The quick `The answer is "X".` rule is off, as by default there.
- MathVerse (ZrrSkywalker/MathVerse evaluation/extract_answer_s1.py, score_answer_s2.py, prompts.py): the last 30
  words of the response (`--trunk_response 30`, as its README and lmms-eval run it) go into `demo_prompt_extract`;
  the extraction, the question (`question_for_eval`) and the answer into `demo_prompt_score`, whose reply "1" is
  right, "0" wrong (MathVerse asks again on any other reply; here it is a failed sample, counted).

A request that fails (after the client's retries) or a reply that cannot be read makes the sample unscored (None),
never wrong. The prompts are the published ones, character for character.
"""

from __future__ import annotations

import time
from typing import Any

from vlmrl.eval.benchmarks import mathvista
from vlmrl.rewards.columns import per_sample
from vlmrl.rewards.judge import DEFAULT_CACHE_DIR
from vlmrl.rewards.parsing import completion_text
from vlmrl.rewards.registry import RewardBatch, RewardFailure

# lupantech/MathVista evaluation/prompts/ext_ans.py `demo_prompt` (pids 852, 104, 824, 506, 540)
MATHVISTA_EXTRACT_PROMPT = """
Please read the following example. Then extract the answer from the model response and type it at the end of the prompt.

Hint: Please answer the question requiring an integer answer and provide the final value, e.g., 1, 2, 3, at the end.
Question: Which number is missing?

Model response: The number missing in the sequence is 14.

Extracted answer: 14

Hint: Please answer the question requiring a floating-point number with one decimal place and provide the final value, e.g., 1.2, 1.3, 1.4, at the end.
Question: What is the fraction of females facing the camera?

Model response: The fraction of females facing the camera is 0.6, which means that six out of ten females in the group are facing the camera.

Extracted answer: 0.6

Hint: Please answer the question requiring a floating-point number with two decimal places and provide the final value, e.g., 1.23, 1.34, 1.45, at the end.
Question: How much money does Luca need to buy a sour apple candy and a butterscotch candy? (Unit: $)

Model response: Luca needs $1.45 to buy a sour apple candy and a butterscotch candy.

Extracted answer: 1.45

Hint: Please answer the question requiring a Python list as an answer and provide the final list, e.g., [1, 2, 3], [1.2, 1.3, 1.4], at the end.
Question: Between which two years does the line  graph saw its maximum peak?

Model response: The line graph saw its maximum peak between 2007 and 2008.

Extracted answer: [2007, 2008]

Hint: Please answer the question and provide the correct option letter, e.g., A, B, C, D, at the end.
Question: What fraction of the shape is blue?\nChoices:\n(A) 3/11\n(B) 8/11\n(C) 6/11\n(D) 3/5

Model response: The correct answer is (B) 8/11.

Extracted answer: B
"""

# ZrrSkywalker/MathVerse evaluation/prompts.py `demo_prompt_extract`
MATHVERSE_EXTRACT_PROMPT = """
I am providing you a response from a model to a math problem, termed 'Model Response'. You should extract the answer from the response as 'Extracted Answer'. Directly output the extracted answer with no explanation.

1.
Model response: 'Rounded to two decimal places, the perimeter of the sector is approximately:\n\n(-2, 1)'
Extracted Answer: (-2, 1)

2.
Model response: 'at those points.\n\nTherefore, the correct option that represents the meaning of the intersection points of the graphs is:\n\nD. They give the solutions to the equation $f(t)=g(t)$.",'
Extracted Answer: D

3.
Model response: ' at 1 (there's a closed circle at y = 1), the range in interval notation is \\((-4, 1]\\).\n\nFinal values:\nDomain: \\((-3, 3]\\)\nRange: \\((-4, 1]\\)'
Extracted Answer: Domain: \\((-3, 3]\\)\nRange: \\((-4, 1]\\)

4.
Model response: 'As it stands, I cannot provide the correct option letter because there isn't enough information to solve for 'y'.'
Extracted Answer: null

5.
Model response: 'Given that AB = 17.6 meters, we can now substitute into the equation:\n\nd = 17.6 / cos(38\u00b0)\n\nTherefore, to one decimal place, the distance d between Ned and Bart is approximately 22.3 meters.'
Extracted answer: 22.3

6.
Model response:  have all the coefficients for the quadratic function:\n\\( f(x) = ax^2 + bx + c \\)\n\\( f(x) = -1x^2 - 2x + 1 \\)\n\nTherefore, the equation for the graphed function \\( f \\) is:\n\\( f(x) = -x^2 - 2x + 1 \\)"'
Extracted answer: f(x) = -x^2 - 2x + 1

7.
"""

# ZrrSkywalker/MathVerse evaluation/prompts.py `demo_prompt_score` (filled with str.format, so "{{3}}" reads "{3}")
MATHVERSE_SCORE_PROMPT = """
Below are two answers to a math question. Question is [Question], [Standard Answer] is the standard answer to the question, and [Model_answer] is the answer extracted from a model's output to this question.  Determine whether these two answers are consistent.
Please note that only when the [Model_answer] completely matches the [Standard Answer] means they are consistent. For non-multiple-choice questions, if the meaning is expressed in the same way, it is also considered consistent, for example, 0.5m and 50cm.
If they are consistent, Judement is 1; if they are different, Judement is 0.

[Question]: Write the set of numbers represented on the number line in interval notation.
[Standard Answer]: (-2,1]
[Model_answer] : Extracted Answer: \\((-2, 1)\\)
Judgement: 0

[Question]: As shown in the figure, circle O has a radius 1.0, if angle BAC = 60.0, then the length of BC is ()\nChoices:\nA:2\nB:2\u221a{{3}}\nC:\u221a{{3}}\nD:2\u221a{{2}}
[Standard Answer]: C
[Model_answer] : B:2\u221a{{3}}
Judgement: 0

[Question]: Find the domain and range of the function f using interval notation.
[Standard Answer]: domain: [-4, 0) and range: (-3, 1]
[Model_answer] : Range: \\((-4, 1]\\)
Judgement: 0

[Question]: As shown in the figure, circle O has a radius 1.0, if angle BAC = 60.0, then the length of BC is ()\nChoices:\nA:2\nB:2\u221a{{3}}\nC:\u221a{{3}}\nD:2\u221a{{2}}
[Standard Answer]: C
[Model_answer] : null
Judgement: 0

[Question]: Given the graph of the ellipse that intersects with x-axis at 9 and -9 and with y-axis at 3 and -3, determine its equation.A. \\frac{{x^2}}{{81}} + \\frac{{y^2}}{{9}} = 1 B. Can not determine.\n
[Standard Answer]: A
[Model_answer] : \\frac{{x^2}}{{81}} + \\frac{{y^2}}{{9}} = 1
Judgement: 1

[Question]: {question}
[Standard Answer]: {gt}
[Model_answer] : {extraction}
Judgement: """
MATHVERSE_TRUNK_WORDS = 30


def mathvista_prompt(query: str, response: str) -> str:
    """extract_answer.py's `create_test_prompt`."""
    return f"{MATHVISTA_EXTRACT_PROMPT.strip()}\n\n{query}\n\n{response}\n\nExtracted answer: "


def mathverse_extract_prompt(response: str, trunk_words: int = MATHVERSE_TRUNK_WORDS) -> str:
    """extract_answer_s1.py's `create_test_prompt` on the response's last `trunk_words` words (`trunk_response`)."""
    if trunk_words > 0:
        response = " ".join(response.split(" ")[-trunk_words:])
    return f"{MATHVERSE_EXTRACT_PROMPT.strip()}\n\nModel response: '{response}'\nExtracted Answer: "


def mathverse_score_prompt(question: str, gold: str, extraction: str) -> str:
    """score_answer_s2.py's `create_test_prompt`."""
    return MATHVERSE_SCORE_PROMPT.strip().format(question=question, gt=gold, extraction=extraction)


def _ask(client: Any, prompts: list[str], deadline: float | None) -> list[str | RewardFailure]:
    """Each prompt's reply text (one user message each, as the published scripts send), or a RewardFailure."""
    results = client.judge_many([[{"role": "user", "content": p}] for p in prompts], deadline, raw=True)
    return [r.feedback.raw.strip() if not r.failed else RewardFailure(r.error or "judge: no reply") for r in results]


def _mathvista(client: Any, responses: list[str], solution: list, columns: dict, deadline: float | None) -> list:
    n = len(responses)
    qtypes, atypes = per_sample(columns.get("question_type"), n, None), columns["mathvista_answer_type"]
    choices, precisions = per_sample(columns.get("choices"), n, None), per_sample(columns.get("precision"), n, None)
    queries = per_sample(columns.get("problem"), n, "")
    extractions: list[Any] = [None] * n
    asked: list[int] = []
    for i, response in enumerate(responses):
        by_rule = mathvista.extract(response, qtypes[i], atypes[i], list(choices[i] or []), rules_only=True)
        if by_rule is None:
            asked.append(i)
        else:
            extractions[i] = by_rule
    for i, reply in zip(asked, _ask(client, [mathvista_prompt(str(queries[i]), responses[i]) for i in asked],
                                    deadline), strict=True):
        extractions[i] = reply
    out: list[Any] = []
    for i, extraction in enumerate(extractions):
        if isinstance(extraction, RewardFailure):
            out.append(extraction)
            continue
        options = list(choices[i] or [])
        prediction = mathvista.normalize(extraction, options, qtypes[i], atypes[i], precisions[i])
        out.append(float(prediction is not None and prediction == str(solution[i])))
    return out


def _mathverse(client: Any, responses: list[str], solution: list, columns: dict, deadline: float | None) -> list:
    n = len(responses)
    questions = per_sample(columns.get("question_for_eval"), n, "")
    extractions = _ask(client, [mathverse_extract_prompt(r) for r in responses], deadline)
    out: list[Any] = list(extractions)
    ready = [i for i, e in enumerate(extractions) if not isinstance(e, RewardFailure)]
    prompts = [mathverse_score_prompt(str(questions[i]), str(solution[i]),
                                      str(extractions[i]).replace("Extracted Answer: ", "").strip()) for i in ready]
    for i, reply in zip(ready, _ask(client, prompts, deadline), strict=True):
        verdict = reply if isinstance(reply, RewardFailure) else reply.replace("Judgement:", "").strip()
        out[i] = (verdict if isinstance(verdict, RewardFailure) else float(verdict) if verdict in ("0", "1")
                  else RewardFailure(f"judge: the scoring reply {verdict[:80]!r} is neither 0 nor 1"))
    return out


JUDGED = {"mathvista": _mathvista, "mathverse": _mathverse}


def judged_score(completions: list, solution: list, *, benchmark: str, base_url: str, model: str,
                 api_key_env: str | None = None, timeout: float = 60.0, max_retries: int = 3, concurrency: int = 8,
                 cache_dir: str | None = DEFAULT_CACHE_DIR, max_tokens: int = 256,
                 batch_timeout: float | None = 1800.0, **columns: Any) -> RewardBatch:
    """`benchmark`'s published judge-based score of each completion (1.0, 0.0, or a RewardFailure when the judge
    could not be asked or read), with the judge client's counters as metrics."""
    from vlmrl.rewards.judge_reward import get_client

    if benchmark not in JUDGED:
        raise ValueError(f"benchmark {benchmark!r} publishes no judge-based extraction; those that do: "
                         f"{sorted(JUDGED)}")
    client = get_client(base_url=base_url, model=model, api_key_env=api_key_env, timeout=timeout,
                        max_retries=max_retries, concurrency=concurrency, cache_dir=cache_dir, max_tokens=max_tokens,
                        temperature=0.0)
    before = dict(client.stats)
    deadline = None if batch_timeout is None else time.monotonic() + batch_timeout
    responses = [completion_text(c).strip() for c in completions]
    values = JUDGED[benchmark](client, responses, list(solution), columns, deadline)
    return RewardBatch(values, {k: float(client.stats[k] - before[k]) for k in client.stats}, None)
