"""Watching a run for the failures nobody sees: training that goes on while nothing can be learned, and answers
that are cut before they end.

A step has no learning signal when every group's rewards are equal (group-relative advantages, RLOO, online DPO:
every advantage is 0) or, with one answer per prompt, every reward of the step is equal. After
`trainer.no_signal_steps` such steps in a row, the run says so once, naming the causes it can check from the
metrics it already has; the streak is also a metric (`no_signal_streak`). When more than 85% of the generated
groups (every dynamic-sampling round counted) had no signal over that many steps, the run says so once, per task
(`SparseSignalWatch`): such steps still train, but most generation is thrown away. When more than 20% of the RL
answers of the last `TruncationWatch.WINDOW` steps were cut at `rollout.max_new_tokens`, the run says that too
(once, until the share falls again); evaluations warn about their own truncation (`truncation_warning`). When a
reward lost more than 10% of its values to failures over the last `RewardFailureWatch.WINDOW` steps (a judge that
times out, a user reward that raises), the run says that too, with the reward's own counters. When a task's answers
were scored by no weighted reward that grades answers (only `length`/`format`, or nothing:
`task/<task>/ungraded_answers`), the run names the task once (`UngradedWatch`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from vlmrl.config import Config
from vlmrl.rewards.coverage import grading_specs
from vlmrl.rewards.registry import OWN_METRICS, RewardSpec, answer_type_of
from vlmrl.trainer.step_metrics import task_of

TRUNCATION_WARNING = 0.2  # share of answers cut at max_new_tokens above which training and eval warn
REWARD_FAILURE_WARNING = 0.1  # share of a reward's values lost to failures above which training warns
# share of generated groups without a signal above which training warns (the quickstart runs at 60-75%: most of its
# prompts are solved, and dynamic sampling refills the batch)
SPARSE_SIGNAL_WARNING = 0.85


def has_signal(metrics: dict, group_size: int) -> bool:
    if group_size > 1 and "zero_variance_groups" in metrics:
        return metrics["zero_variance_groups"] < 1.0
    return metrics.get("reward/total/std", 1.0) > 0


def truncation_warning(share: float, key: str, value: int, where: str) -> str | None:
    """The warning for a share of answers cut at `key`=`value`, or None below TRUNCATION_WARNING."""
    if share <= TRUNCATION_WARNING:
        return None
    return (f"{where}: {100 * share:.0f}% of answers were cut at {key}={value} (truncated answers usually score 0); "
            f"raise {key}")


class SignalWatch:
    """Feed it each RL step's metrics; `update` returns the warning text once per streak, else None."""

    def __init__(self, cfg: Config):
        self.cfg, self.window = cfg, cfg.trainer.no_signal_steps
        self.streak, self.warned = 0, False
        self.recent: deque[dict] = deque(maxlen=max(self.window, 1))

    def update(self, step: int, metrics: dict) -> str | None:
        if has_signal(metrics, self.cfg.rollout.group_size):
            self.streak, self.warned = 0, False
            self.recent.clear()
        else:
            self.streak += 1
            self.recent.append(metrics)
        metrics["no_signal_streak"] = float(self.streak)
        if not self.window or self.streak < self.window or self.warned:
            return None
        self.warned = True
        return self.message(step)

    def message(self, step: int) -> str:
        def mean(key: str) -> float | None:
            values = [m[key] for m in self.recent if isinstance(m.get(key), (int, float))]
            return sum(values) / len(values) if values else None

        r = self.cfg.rollout
        reward, causes = mean("reward/total/mean"), []
        truncated = mean("truncated_share")
        if truncated is not None and truncated > TRUNCATION_WARNING:
            causes.append(f"{100 * truncated:.0f}% of answers were cut at rollout.max_new_tokens={r.max_new_tokens}: "
                          f"raise it")
        failures = mean("reward/failure_rate")
        if failures:
            causes.append(f"{100 * failures:.0f}% of reward calls failed (see reward/*/failures): fix the reward "
                          f"or its endpoint")
        if mean("reward/format/mean") == 0:
            causes.append("no answer had the expected format (reward/format/mean = 0): check data.prompt_template's "
                          "format instructions and the SFT warm-start (sft.steps)")
        if r.temperature < 0.5:
            causes.append(f"rollout.temperature={r.temperature} makes a group's answers nearly identical: raise it")
        accuracy = mean("accuracy")
        if accuracy is not None and accuracy >= 1.0:
            causes.append("every answer was correct: the task is solved for this policy; use harder data")
        elif reward is not None and reward == 0:
            causes.append("no answer earned any reward: the task may be too hard for the start policy (more SFT), "
                          "or the reward never matches these answers (try `vlmrl inspect-reward`)")
        if not causes:
            causes.append("the rewards cannot tell this policy's answers apart; check them with `vlmrl "
                          "inspect-reward` and the rollout gallery (rollouts.jsonl)")
        level = "" if reward is None else f" (mean reward {reward:.2f})"
        return (f"step {step}: no learning signal for {self.streak} steps in a row: every group's answers got equal "
                f"rewards{level}, so every advantage was 0. Likely: " + "; ".join(causes))


def task_graders(specs: Sequence[RewardSpec], samples: Sequence[dict]) -> dict[str, list[str]]:
    """Per task of `samples`, the weighted rewards that grade its answer types (vlmrl.rewards.coverage)."""
    kinds: dict[str, set[str]] = {}
    for s in samples:
        kinds.setdefault(task_of(s), set()).add(answer_type_of(s) or "text")
    return {task: sorted({spec.key for kind in found for spec in grading_specs(specs, kind)})
            for task, found in kinds.items()}


class SparseSignalWatch:
    """Feed it each RL step's metrics; `update` says once when, over the last `trainer.no_signal_steps` steps, more
    than SPARSE_SIGNAL_WARNING of the generated groups had no learning signal (every answer to a prompt scored the
    same; counted per task over every dynamic-sampling round, `task/<task>/groups` and `.../signal_groups`). Steps
    still train then (dynamic sampling refills the batch), so `SignalWatch` stays quiet, but most generation is
    thrown away and a task can stop learning unseen. The message names each task's share and what to change: a task
    no answer solves needs a graded reward or a better start, a solved one needs filtering or harder data."""

    def __init__(self, cfg: Config, graders: dict[str, list[str]] | None = None):
        """`graders`: per task, the weighted rewards that grade its answers (`task_graders`), named in the message."""
        self.cfg, self.warned, self.graders = cfg, False, graders or {}
        self.recent: deque[dict] = deque(maxlen=max(cfg.trainer.no_signal_steps, 1))

    def update(self, step: int, metrics: dict) -> str | None:
        counts = {k: float(v) for k, v in metrics.items() if k.startswith("task/") and
                  k.endswith(("/groups", "/signal_groups", "/solved_groups", "/unsolved_groups"))}
        if not self.cfg.trainer.no_signal_steps or not counts:
            return None
        self.recent.append({**counts, "prompts": float(metrics.get("dynamic_sampling/prompts", 0.0))})
        tasks = sorted({k.split("/")[1] for m in self.recent for k in m if k.endswith("/signal_groups")})
        groups = {t: self._sum(f"task/{t}/groups") for t in tasks}
        silent = {t: groups[t] - self._sum(f"task/{t}/signal_groups") for t in tasks}
        share = sum(silent.values()) / max(sum(groups.values()), 1.0)
        if share <= SPARSE_SIGNAL_WARNING:
            self.warned = False
            return None
        if self.warned or len(self.recent) < self.recent.maxlen:
            return None
        self.warned = True
        return self.message(step, share, groups, silent)

    def _sum(self, key: str) -> float:
        return sum(m.get(key, 0.0) for m in self.recent)

    def message(self, step: int, share: float, groups: dict, silent: dict) -> str:
        parts = []
        for task in sorted(groups, key=lambda t: -silent[t]):
            if not groups[task]:
                continue
            solved, unsolved = self._sum(f"task/{task}/solved_groups"), self._sum(f"task/{task}/unsolved_groups")
            part = (f"task {task!r}: {100 * silent[task] / groups[task]:.0f}% of its {groups[task]:g} groups "
                    f"({solved:g} solved by every answer, {unsolved:g} by none)")
            if silent[task] / groups[task] > SPARSE_SIGNAL_WARNING:
                graders = self.graders.get(task)
                under = f" under the rewards that grade it ({', '.join(graders)})" if graders else ""
                part += (f": no answer earns more than another{under}; give it a graded reward where it has none "
                         "(such as `iou` for boxes) or a better start (more sft.steps or labelled rows); "
                         "curriculum.filter_unsolved skips such prompts" if unsolved >= solved else
                         ": solved; curriculum.filter_solved skips such prompts, or use harder data")
            parts.append(part)
        prompts = self._sum("prompts") / len(self.recent)
        drawn = (f"; dynamic sampling generated {prompts:.0f} prompts per step to keep "
                 f"{self.cfg.rollout.prompts_per_step}" if prompts else "")
        first = step - len(self.recent) + 1
        return (f"steps {first}-{step}: {100 * share:.0f}% of the generated groups had no learning signal (every "
                f"answer to the prompt scored the same){drawn}. " + "; ".join(parts))


class TruncationWatch:
    """Feed it each RL step's metrics; `update` returns a warning when the mean `truncated_share` of the last WINDOW
    steps passes TRUNCATION_WARNING (again only after it fell below)."""

    WINDOW = 10

    def __init__(self, cfg: Config):
        self.cfg, self.warned = cfg, False
        self.recent: deque[float] = deque(maxlen=self.WINDOW)

    def update(self, step: int, metrics: dict) -> str | None:
        if "truncated_share" not in metrics:
            return None
        self.recent.append(float(metrics["truncated_share"]))
        share = sum(self.recent) / len(self.recent)
        if share <= TRUNCATION_WARNING:
            self.warned = False
            return None
        if self.warned or len(self.recent) < self.WINDOW:
            return None
        self.warned = True
        key, budget = ("agent.turn_tokens", self.cfg.agent.turn_tokens) if self.cfg.agent.enabled else \
            ("rollout.max_new_tokens", self.cfg.rollout.max_new_tokens)
        return truncation_warning(share, key, budget, f"steps {step - self.WINDOW + 1}-{step}")


class RewardFailureWatch:
    """Feed it each RL step's metrics; `update` returns a warning when a reward component lost more than
    REWARD_FAILURE_WARNING of its values over the last WINDOW steps (again only after its share fell below).

    A component's failure share is sum(reward/{key}/failures) / sum(failures + reward/{key}/count) over the window:
    of the values it gave or lost (a None for "does not apply" is neither). The warning names the component's own
    non-zero counters over the window (for the judge: http_failures, timeouts, circuit_opens, ...)."""

    WINDOW = 10

    def __init__(self, cfg: Config):
        self.cfg, self.warned = cfg, set()
        self.recent: deque[tuple[int, dict]] = deque(maxlen=self.WINDOW)

    def update(self, step: int, metrics: dict) -> str | None:
        keys = [k.split("/")[1] for k in metrics if k.startswith("reward/") and k.count("/") == 2
                and k.endswith("/failures")]
        self.recent.append((step, {k: v for k, v in metrics.items() if k.startswith("reward/")}))
        warnings = []
        for key in keys:
            failed, given = self._sum(f"reward/{key}/failures"), self._sum(f"reward/{key}/count")
            share = failed / (failed + given) if failed + given else 0.0
            if share <= REWARD_FAILURE_WARNING:
                self.warned.discard(key)
            elif key not in self.warned:
                self.warned.add(key)
                warnings.append(self.message(step, key, share, failed, failed + given))
        return "; ".join(warnings) or None

    def _sum(self, name: str) -> float:
        return sum(float(m.get(name, 0.0)) for _, m in self.recent)

    def message(self, step: int, key: str, share: float, failed: float, total: float) -> str:
        prefix = f"reward/{key}/"
        names = sorted({k[len(prefix):] for _, m in self.recent for k in m
                        if k.startswith(prefix) and k[len(prefix):] not in OWN_METRICS})
        counters = [f"{name} {self._sum(prefix + name):g}" for name in names if self._sum(prefix + name)]
        first = self.recent[0][0]
        where = f"step {step}" if first == step else f"steps {first}-{step}"
        weights = {r.label or r.name: r.weight for r in self.cfg.rewards}
        effect = "weight 0: training is unaffected" if weights.get(key) == 0 else "those samples get no loss"
        return (f"{where}: reward {key!r} failed on {100 * share:.0f}% of its values ({failed:g} of {total:g}; "
                f"{effect})" + (f" [{', '.join(counters)}]" if counters else "") +
                f"; see reward/{key}/* in metrics.jsonl and check it with `vlmrl inspect-reward`")


class UngradedWatch:
    """Feed it each RL step's metrics; `update` names, once per task, a task whose answers no weighted grading reward
    scored that step (`task/<task>/ungraded_answers` > 0; vlmrl.rewards.coverage): there nothing pays a right
    answer, and the policy learns only what the shaping rewards pay."""

    def __init__(self):
        self.warned: set[str] = set()

    def update(self, step: int, metrics: dict) -> str | None:
        warnings = []
        for key, ungraded in metrics.items():
            if not (key.startswith("task/") and key.endswith("/ungraded_answers")) or not ungraded:
                continue
            task = key[len("task/"):-len("/ungraded_answers")]
            if task in self.warned:
                continue
            self.warned.add(task)
            total = ungraded + metrics.get(f"task/{task}/graded_answers", 0.0)
            warnings.append(f"step {step}: task {task!r}: {ungraded:g} of {total:g} answers were scored by no "
                            f"weighted reward that grades answers (only shaping rewards such as length, or none), so "
                            f"nothing paid a right answer there; add a reward for its answer type (docs/rewards.md, "
                            f"\"Every sample has a reward that applies\"), or check its solutions (a reward gives "
                            f"None for a solution it cannot parse). Counted in task/{task}/ungraded_answers")
        return "; ".join(warnings) or None


class MismatchWatch:
    """Feed it each RL step's metrics; `update` warns once per stretch of steps whose sampler–trainer KL
    (`mismatch/k3`, vlmrl.algorithms.correction) passes `algorithm.mismatch_warn_kl`: answers sampled by a policy the
    trainer no longer is (stale rollouts, another engine's kernels or precision, weights that did not arrive), which
    trains with a bias unless a correction is on, and then with fewer effective answers."""

    def __init__(self, cfg: Config):
        self.cfg, self.limit, self.warned = cfg, cfg.algorithm.mismatch_warn_kl, False

    def update(self, step: int, metrics: dict) -> str | None:
        kl = metrics.get("mismatch/k3")
        if self.limit is None or kl is None:
            return None
        if kl <= self.limit:
            self.warned = False
            return None
        if self.warned:
            return None
        self.warned = True
        a, r = self.cfg.algorithm, self.cfg.rollout
        stale = r.asynchronous and r.max_staleness
        source = (f"rollout.max_staleness={r.max_staleness}" if stale else
                  "rollout.engine=vllm" if r.engine == "vllm" else "the built-in sampler")
        fix = ("lower rollout.max_staleness" if stale else
               "check that weights reach the engine (rollout/logprob_gap_*) and its dtype")
        return (f"step {step}: the sampler's and the trainer's log-probs differ by a KL of {kl:.3g} (mismatch/k3, "
                f"above algorithm.mismatch_warn_kl={self.limit:g}; answers from {source}; correction: "
                f"{a.rollout_correction}, effective sample share mismatch/ess={metrics.get('mismatch/ess', 1.0):.2f}); "
                f"{fix}, or set algorithm.rollout_correction (docs/algorithms.md, \"Off-policy correction\")")


LEARNED_REWARDS = ("reward_model", "judge")  # rewards a policy can learn to please without being right


class OverOptimisationWatch:
    """Feed it each held-out evaluation; `update` says once when a learned reward with a positive weight (an outcome
    reward model, the LLM judge) rose on the held-out set since the evaluation where held-out accuracy peaked, while
    held-out accuracy fell below that peak's 95% interval: the policy is learning to please the reward, not to be
    right (the over-optimisation Gao et al. 2023 measured). Held-out accuracy is `solved`, so the watch is off when
    `solved` is itself a learned reward; every component is scored at evaluation, so a verifiable reward at weight 0
    beside a learned one is the gold it needs."""

    def __init__(self, cfg: Config):
        self.keys = [r.label or r.name for r in cfg.rewards if r.name in LEARNED_REWARDS and r.weight > 0]
        learned_gold = cfg.solved.reward in self.keys or cfg.solved.reward in LEARNED_REWARDS
        self.active = bool(self.keys) and not learned_gold
        self.seen: list[tuple[int, dict]] = []
        self.warned = False

    def update(self, step: int, metrics: dict) -> str | None:
        if not self.active or self.warned or metrics.get("greedy/accuracy") is None:
            return None
        self.seen.append((step, metrics))
        best_step, best = max(self.seen, key=lambda sm: sm[1]["greedy/accuracy"])
        low = best.get("greedy/accuracy_ci_low", best["greedy/accuracy"])
        if metrics["greedy/accuracy"] >= low:
            return None
        for key in self.keys:
            then, now = best.get(f"greedy/reward/{key}"), metrics.get(f"greedy/reward/{key}")
            if then is None or now is None or now <= then:
                continue
            self.warned = True
            return (f"step {step}: the learned reward {key!r} rose {then:.3f} -> {now:.3f} on the held-out set since "
                    f"step {best_step}, while held-out accuracy fell {100 * best['greedy/accuracy']:.1f}% (95% "
                    f"interval from {100 * low:.1f}%) -> {100 * metrics['greedy/accuracy']:.1f}%: the policy is "
                    f"learning to please the reward, not to be right. Keep the checkpoint nearest step {best_step}, "
                    f"add a KL penalty (algorithm.beta > 0), weigh the learned reward less beside a verifiable one, "
                    f"or train fewer steps")
        return None
