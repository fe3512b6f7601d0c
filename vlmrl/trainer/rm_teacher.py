"""Reward-model distillation teachers: a trained RM of the same kind (`distill.teacher`), or an LLM judge
(`distill.judge`) for an outcome RM; both give a margin per pair (a process teacher: a logit per step) that
`vlmrl.algorithms.losses.preference_kl` turns into the KL the student is trained on.

A judge grades each answer on its own, in [0, 1] (a verdict's 1 or 0, a graded judge's probability of [RELEVANT],
or N/10), and its margin on a pair is the difference of the two log-odds, each score held in [JUDGE_FLOOR,
1 - JUDGE_FLOOR]:

    m_judge = logit(s_c) - logit(s_r),    so    sigmoid(m_judge) = s_c (1 - s_r) / (s_c (1 - s_r) + s_r (1 - s_c))

the Bradley-Terry preference of two answers whose rewards are the judge's log-odds. Two plain verdicts that differ
give +-2 logit(0.99) = +-9.19 (a preference of 0.9999); equal ones give 0 (no preference); a graded judge gives
everything between. A pair the judge could not score (a failed request, a reply without a verdict) has no margin
(NaN): it is left out of the KL, counted, never given a margin of 0, and asked again when its pair is drawn again.
"""

from __future__ import annotations

import math

import torch

from vlmrl.errors import DataError
from vlmrl.models.reward_model import RewardModel, answer_ids
from vlmrl.rewards.judge import JudgeClient
from vlmrl.rewards.parsing import strip_think
from vlmrl.trainer.prm import row_logits
from vlmrl.trainer.rm_pairs import prompt_key

JUDGE_FLOOR = 0.01  # a judge's score is held in [0.01, 0.99] before its log-odds are taken


def judge_margin(chosen: float | None, rejected: float | None, floor: float = JUDGE_FLOOR) -> float:
    """logit(s_c) - logit(s_r), each score clamped to [floor, 1 - floor]; NaN when either is None."""
    if chosen is None or rejected is None:
        return math.nan

    def logit(x: float) -> float:
        x = min(max(x, floor), 1 - floor)
        return math.log(x / (1 - x))

    return logit(chosen) - logit(rejected)


class JudgeTeacher:
    """An LLM judge as an outcome RM's distillation teacher: each distinct (prompt, answer) is graded once per run
    (kept in memory, and in the judge's disk cache across runs; a failed request is tried again at the next draw), the answer as the judge sees it being the completion
    outside think blocks, the reference the pair's `solution` where it has one. `options` are `JudgeClient`'s
    (base_url, model, api_key_env, graded, mode, ...)."""

    def __init__(self, options: dict):
        options = dict(options)
        missing = {"base_url", "model"} - set(options)
        if missing:
            raise DataError(f"distill.judge needs {sorted(missing)} (the judge's OpenAI-compatible base URL and "
                            f"model name), got {sorted(options)}")
        self.client = JudgeClient(**options)
        self.scores: dict[tuple, float] = {}

    def _key(self, pair: dict, answer: str) -> tuple:  # the same answer to the same prompt in two pairs: asked once
        return (prompt_key(pair), str(pair.get("problem", "")), str(pair.get("solution", "")), answer)

    def margins(self, pairs: list[dict]) -> torch.Tensor:
        todo: dict[tuple, list[dict]] = {}
        encoded: dict = {}
        for p in pairs:
            for side in ("chosen", "rejected"):
                key = self._key(p, p[side])
                if key not in self.scores and key not in todo:
                    todo[key] = self.client.messages(str(p.get("problem", "")), strip_think(p[side]).strip(),
                                                     str(p.get("solution", "")), list(p.get("images") or []),
                                                     encoded)
        for key, result in zip(todo, self.client.judge_many(list(todo.values())), strict=True):
            if not result.failed:
                self.scores[key] = result.feedback.score
        return torch.tensor([judge_margin(self.scores.get(self._key(p, p["chosen"])),
                                          self.scores.get(self._key(p, p["rejected"]))) for p in pairs],
                            dtype=torch.float32)


def make_teacher(path: str | None, judge: dict | None, process: dict | None = None
                 ) -> RewardModel | JudgeTeacher | None:
    """The distillation teacher: an RM from `path` (`load_teacher`), a judge from `judge` options, or None."""
    if judge is not None:
        return JudgeTeacher(judge)
    return load_teacher(path, process)


def pair_scores(rm: RewardModel, pairs: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """(r_chosen [B], r_rejected [B]): both answers of a pair after its prompt, the prompt's images encoded once."""
    prompts = rm.prompts(pairs)
    ids, mask = answer_ids(rm.policy, [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs])
    scores = rm.score(prompts, torch.arange(len(pairs)).repeat(2), ids, mask)
    return scores[:len(pairs)], scores[len(pairs):]


def load_teacher(path: str | None, process: dict | None = None) -> RewardModel | None:
    """The distillation teacher (frozen), from a run directory (its newest checkpoint) or a checkpoint folder: an
    outcome RM for an outcome RM; for a process RM (`process`: its split and think_tag) a process RM that splits
    answers into the same steps."""
    if path is None:
        return None
    from vlmrl.models.preflight import resolve_model

    teacher = RewardModel.from_pretrained(resolve_model(path, "distill.teacher"))
    kind = "outcome" if process is None else "process"
    if teacher.kind != kind:
        article = {"outcome": "an", "process": "a"}
        raise DataError(f"distill.teacher {path}: {article[teacher.kind]} {teacher.kind} reward model; training "
                        f"{article[kind]} {kind} RM needs {article[kind]} {kind} teacher "
                        f"({'it ranks the pairs' if process is None else 'it scores every step'})")
    if process is not None:
        theirs = {k: teacher.info["process"][k] for k in ("split", "think_tag")}
        ours = {k: process[k] for k in ("split", "think_tag")}
        if theirs != ours:
            raise DataError(f"distill.teacher {path} splits answers into steps by {theirs}, this PRM by {ours}: the "
                            "steps would not be the same; set process.split and process.think_tag to the teacher's")
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher.train(False)


@torch.no_grad()
def teacher_margins(teacher: RewardModel | JudgeTeacher, pairs: list[dict], batch_size: int) -> torch.Tensor:
    """The teacher's r_c - r_r on each pair, scored in chunks (a judge: `JudgeTeacher.margins`, NaN where it gave
    none)."""
    if isinstance(teacher, JudgeTeacher):
        return teacher.margins(pairs)
    parts = []
    for start in range(0, len(pairs), batch_size):
        chosen, rejected = pair_scores(teacher, pairs[start:start + batch_size])
        parts.append(chosen - rejected)
    return torch.cat(parts)


@torch.no_grad()
def teacher_step_logits(teacher: RewardModel, rows: list[dict], batch_size: int) -> torch.Tensor:
    """A process teacher's logit of every step of `rows` (rows in order, steps in order), scored in chunks."""
    return torch.cat([torch.cat(row_logits(teacher, rows[start:start + batch_size]))
                      for start in range(0, len(rows), batch_size)])
