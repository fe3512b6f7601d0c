"""Which prompts an RL step draws: a curriculum over data.train, with online filtering by measured pass rate.

`Curriculum` is the prompt stream of a run whose `curriculum` section asks for more than shuffled passes:

- order "easy_to_hard": prompts sorted by their `difficulty` column (ties by position); at RL step t the easiest
  ceil(share(t) * N) are open, share(t) = min(1, start + (1 - start) * (t - 1) / (ramp * trainer.steps)), and a step
  draws uniformly among the open prompts it has not drawn yet (competence-based pacing, Platanios et al. 2019);
- order "learnability": a step draws without replacement in proportion to p (1 - p), p = (solved + 1) / (answers + 2)
  the prompt's pass rate over all its earlier draws (the variance of a 0/1 reward, which is what a group-relative
  advantage feeds on; Foster & Foerster 2025). An unseen prompt has p = 0.5, the largest weight;
- order "random": shuffled passes, as `PromptStream`.

With `filter_solved` / `filter_unsolved`, a prompt whose last `filter_after` draws were all solved by every answer
(or by none, every answer scoring the same) is skipped: its group would have all-equal rewards. A draw no answer
solved whose graded rewards differed (a box's IoU below the solved threshold) is not "unsolved": it still teaches.
Skipping is not forever: each time a draw would take a filtered prompt it takes it anyway with probability
`filter_recheck` (in the weighted orders: its weight is scaled by `filter_recheck`), so a prompt the policy has
since forgotten (or learned) is found again, and a draw that is not all-equal lifts its filter (selective rollouts,
GRESO, Zheng et al. 2025; a filter that never rechecks lets the policy drift on everything it filtered). If fewer
prompts than a draw needs remain open, the filter is lifted for that draw (counted in `refills`), so a run never
stalls. `skipped_*` counts the filtered prompts a random-order pass stepped over, `rechecked` the ones it took
anyway.

Pass rates come from `observe` (the share of a prompt's answers that `correctness` accepts), called by the RL step
for every group it generated, dynamic-sampling rounds included. The counts and draw positions are part of `state()`,
so a resumed run continues the same curriculum; draws use the run's generator, restored with the checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from vlmrl.config import CurriculumConfig
from vlmrl.errors import DataError
from vlmrl.trainer.inputs import PromptStream

PASS_RATE_BINS = ("0", "0-25", "25-50", "50-75", "75-100", "100")  # the trained groups' pass-rate histogram, in %


def pass_rate_bin(solved: int, answers: int) -> str:
    """The histogram bin of a group with `solved` right answers of `answers`: exactly 0, (0, 25], (25, 50], (50, 75],
    (75, 100) or exactly 100 percent."""
    if solved == 0:
        return "0"
    if solved == answers:
        return "100"
    return PASS_RATE_BINS[min(4, math.ceil(4 * solved / answers))]


def difficulties(samples: Sequence[dict], where: str = "data.train") -> list[float]:
    """Each sample's `difficulty` as a number; a missing or non-numeric one is an error naming the sample."""
    out = []
    for s in samples:
        value = s.get("difficulty")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise DataError(f"{where}: sample {s.get('id')!r} has difficulty {value!r}; curriculum.order=easy_to_hard "
                            "sorts prompts by a numeric `difficulty` column (higher = harder). Add one to every "
                            "row, or use curriculum.order=learnability (pass rates measured during the run)")
        out.append(float(value))
    return out


class Curriculum(PromptStream):
    """The prompt stream with a curriculum order, pass-rate bookkeeping and online filtering (module docstring)."""

    def __init__(self, n: int, generator: torch.Generator, cfg: CurriculumConfig, steps: int,
                 difficulty: Sequence[float] | None = None):
        super().__init__(n, generator)
        self.cfg, self.steps = cfg, steps
        if cfg.order == "easy_to_hard" and difficulty is None:
            raise ValueError("Curriculum: order easy_to_hard needs the prompts' difficulty")
        self.ranked = sorted(range(n), key=lambda i: (difficulty[i], i)) if difficulty is not None else None
        self.solved, self.answers = [0] * n, [0] * n
        # prompt -> pass rates of its last `filter_after` draws (None: solved by none, but its rewards differed)
        self.recent: dict[int, list[float | None]] = {}
        self.filtered: dict[int, str] = {}  # prompt -> "solved" / "unsolved"
        self.skipped = {"solved": 0, "unsolved": 0}
        self.refills, self.rechecked, self.step, self.drawn_this_step = 0, 0, 1, set()
        # groups observed while their prompt was filtered (rechecks, refills) or open, and how many had a signal
        self.groups = {"filtered": 0, "filtered_signal": 0, "open": 0, "open_signal": 0}

    # -- drawing -----------------------------------------------------------------------------------------------------
    def set_step(self, step: int) -> None:
        """The RL step the next draws are for (its open share; prompts are not drawn twice within a step)."""
        if step != self.step:
            self.step, self.drawn_this_step = step, set()

    def open_share(self, step: int | None = None) -> float:
        """The share of prompts (the easiest first) open at `step` under easy_to_hard; 1.0 for the other orders."""
        if self.cfg.order != "easy_to_hard":
            return 1.0
        step = self.step if step is None else step
        progress = (step - 1) / max(1.0, self.cfg.ramp * self.steps)
        return min(1.0, self.cfg.start + (1.0 - self.cfg.start) * progress)

    def next(self, k: int) -> list[int]:
        if self.cfg.order == "random":
            out = self._next_random(k)
        else:
            out = self._next_weighted(k)
        self.drawn_this_step.update(out)
        return out

    def _next_random(self, k: int) -> list[int]:
        if self.n - len(self.filtered) < k:  # too few open prompts: this draw ignores the filter
            self.refills += 1
            return super().next(k)
        out = []
        while len(out) < k:
            (i,) = super().next(1)
            reason = self.filtered.get(i)
            if reason is None:
                out.append(i)
            elif self._recheck():
                self.rechecked += 1
                out.append(i)
            else:
                self.skipped[reason] += 1
        return out

    def _recheck(self) -> bool:
        """Whether a filtered prompt the pass reached is drawn anyway (probability filter_recheck). The generator
        is used only here, so a run whose filters never fire draws exactly the prompts of shuffled passes."""
        p = self.cfg.filter_recheck
        return p > 0 and torch.rand((), generator=self.generator, dtype=torch.float64).item() < p

    def _next_weighted(self, k: int) -> list[int]:
        if self.cfg.order == "easy_to_hard":
            pool = self.ranked[:max(1, math.ceil(self.open_share() * self.n))]
            weight = lambda i: 1.0  # noqa: E731
        else:
            pool = list(range(self.n))
            weight = self.learnability
        fresh = [i for i in pool if i not in self.drawn_this_step] or pool
        open_ = [i for i in fresh if i not in self.filtered]
        rechecking = False  # filtered prompts left in the pool, at filter_recheck times their weight
        if len(open_) < min(k, len(fresh)):
            self.refills += 1
            open_ = fresh
        elif self.cfg.filter_recheck > 0 and len(open_) < len(fresh):
            open_, rechecking = fresh, True
        factor = self.cfg.filter_recheck if rechecking else 1.0
        weights = torch.tensor([weight(i) * (factor if i in self.filtered else 1.0) for i in open_],
                               dtype=torch.float64)
        take = torch.multinomial(weights, min(k, len(open_)), replacement=False, generator=self.generator).tolist()
        out = [open_[j] for j in take]
        if rechecking:
            self.rechecked += sum(i in self.filtered for i in out)
        while len(out) < k:  # more prompts asked than open ones: repeat them (a tiny data.train)
            out += [open_[j] for j in torch.randperm(len(open_), generator=self.generator).tolist()][:k - len(out)]
        return out

    def pass_rate(self, i: int) -> float:
        """(solved + 1) / (answers + 2): the pass rate so far, 0.5 before the first draw."""
        return (self.solved[i] + 1) / (self.answers[i] + 2)

    def learnability(self, i: int) -> float:
        p = self.pass_rate(i)
        return p * (1.0 - p)

    # -- bookkeeping -------------------------------------------------------------------------------------------------
    def observe(self, index: int, correct: Sequence[bool], signal: bool | None = None) -> None:
        """Record one group: prompt `index` was answered len(correct) times, sum(correct) of them right. `signal`:
        whether the group's rewards differed (default: whether some answers were right and some not). A group no
        answer solved whose graded rewards still differ (a box's IoU) still teaches, so it is not "unsolved"."""
        solved, answers = sum(map(bool, correct)), len(correct)
        signal = 0 < solved < answers if signal is None else bool(signal)
        kind = "filtered" if index in self.filtered else "open"
        self.groups[kind] += 1
        self.groups[f"{kind}_signal"] += signal
        self.solved[index] += solved
        self.answers[index] += answers
        rate = solved / answers if solved or not signal else None  # None: solved by none, with a signal
        recent = (self.recent.get(index, []) + [rate])[-self.cfg.filter_after:]
        self.recent[index] = recent
        self.filtered.pop(index, None)
        if len(recent) == self.cfg.filter_after:
            if self.cfg.filter_solved and all(r == 1.0 for r in recent):
                self.filtered[index] = "solved"
            elif self.cfg.filter_unsolved and all(r == 0.0 for r in recent):
                self.filtered[index] = "unsolved"

    def metrics(self) -> dict[str, float]:
        filtered = list(self.filtered.values())
        seen = [i for i in range(self.n) if self.answers[i]]
        return {"curriculum/open_share": self.open_share(), "curriculum/seen_prompts": float(len(seen)),
                "curriculum/filtered_solved": float(filtered.count("solved")),
                "curriculum/filtered_unsolved": float(filtered.count("unsolved")),
                "curriculum/skipped_solved": float(self.skipped["solved"]),
                "curriculum/skipped_unsolved": float(self.skipped["unsolved"]),
                "curriculum/refills": float(self.refills), "curriculum/rechecked": float(self.rechecked),
                **{f"curriculum/groups_{k}": float(v) for k, v in self.groups.items()},
                "curriculum/mean_pass_rate_seen": (sum(self.solved[i] / self.answers[i] for i in seen) / len(seen)
                                                   if seen else 0.0)}

    def state(self) -> dict:
        return {**super().state(), "solved": list(self.solved), "answers": list(self.answers),
                "recent": {str(i): r for i, r in self.recent.items()},
                "filtered": {str(i): why for i, why in self.filtered.items()}, "skipped": dict(self.skipped),
                "refills": self.refills, "rechecked": self.rechecked, "groups": dict(self.groups), "step": self.step,
                "drawn_this_step": sorted(self.drawn_this_step)}

    def load(self, state: dict) -> None:
        super().load(state)
        if "solved" not in state:  # a checkpoint of a run without a curriculum: start the bookkeeping here
            return
        self.solved, self.answers = list(state["solved"]), list(state["answers"])
        self.recent = {int(i): list(r) for i, r in state["recent"].items()}
        self.filtered = {int(i): why for i, why in state["filtered"].items()}
        self.skipped, self.refills = dict(state["skipped"]), state["refills"]
        self.rechecked = state.get("rechecked", 0)
        self.groups = {**self.groups, **state.get("groups", {})}
        self.step, self.drawn_this_step = state["step"], set(state["drawn_this_step"])
